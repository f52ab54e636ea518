//! Sidekiq source bridge: collects the `dead` sorted set, where Sidekiq moves a job that
//! exhausted its retries (and which it trims to 10,000 jobs and 6 months by default, dropping
//! the rest silently). One atomic script ([`TAKE`]) moves the oldest dead jobs, as many as there
//! are free parking slots, into this queue's inflight hash under ids Redis gives them (server
//! time + a counter); each is parked with that id as its source message identity and only then
//! HDELed. On start the bridge re-parks what a crash left in the hash: a job whose record exists,
//! even one a human resolved meanwhile, is found by its id, not parked as a new death. A sweep
//! every [`SWEEP`] re-parks what another process left there, as the Redis source does.
//!
//! `queues` and `classes` narrow what is taken (inside the script, so two queues filtering one
//! Sidekiq never take the same job); a member that is not JSON is taken by every filter, since
//! it names no queue and must not wait there until Sidekiq trims it. The job's exact JSON is the
//! record's payload (`dlq_core::sidekiq`); anything that is not a job becomes an Invalid record
//! of its bytes. A member that can never be a record is moved to this queue's rejected list.
//!
//! The dead set has no blocking pop that keeps a job safe, so an idle bridge looks every
//! [`IDLE`]. When the set grows near the size Sidekiq trims it to (the queue at `maxParked`, or
//! jobs dying faster than they are parked), the bridge says so: a warning and a
//! `DeadSetNearTrim` Event.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kube::Client;
use tokio::sync::Semaphore;

use dlq_core::api::{DeadLetterQueue, SidekiqSourceSpec};
use dlq_core::events;

use super::park_into::{ParkInto, SourceError, keep_running, url_from_secret};
use super::taken::{Failpoints, Taken, free_slots, pairs, spawn_handle};
use crate::broker::redis::RedisConn;

/// Parks in flight at once per bridge (as the Redis source: a backlog is taken in batches).
pub const CONCURRENCY: usize = 32;

/// How often a running bridge looks for inflight jobs nobody is parking.
const SWEEP: Duration = Duration::from_secs(10);

/// How long an idle bridge waits before looking at the dead set again.
const IDLE: Duration = Duration::from_millis(500);

/// Dead jobs a filtered take reads past at most per call (non-matching ones stay).
const SCAN_LIMIT: usize = 1000;

/// How often the filter's cursor starts again from the oldest job: a Sidekiq host whose clock
/// is behind may add jobs below it.
const CURSOR_RESET: Duration = Duration::from_secs(60);

/// Sidekiq's default `dead_max_jobs`: beyond it the oldest dead jobs are dropped.
const SIDEKIQ_DEAD_MAX: u64 = 10_000;

/// The dead set's size at which the bridge warns (80% of [`SIDEKIQ_DEAD_MAX`]).
const NEAR_TRIM: u64 = SIDEKIQ_DEAD_MAX * 4 / 5;

/// Moves up to ARGV[1] dead jobs, oldest first, from scores ARGV[2] on, that match the queues
/// (ARGV[3]) and classes (ARGV[4], JSON arrays; empty: any) into the inflight hash, each under a
/// fresh id, reading past at most ARGV[5] others. Returns the next cursor (the score of the last
/// job read past, below which none matches), then id, job, id, job, ...
/// KEYS: dead, inflight, counter.
const TAKE: &str = r"
local n, limit = tonumber(ARGV[1]), tonumber(ARGV[5])
local function set(json)
  local s, any = {}, false
  for _, v in ipairs(cjson.decode(json)) do s[v] = true; any = true end
  return s, any
end
local queues, by_queue = set(ARGV[3])
local classes, by_class = set(ARGV[4])
local function wanted(raw)
  if not (by_queue or by_class) then return true end
  local ok, job = pcall(cjson.decode, raw)
  if not ok or type(job) ~= 'table' then return true end
  local class = job['wrapped'] or job['class']
  return (not by_queue or queues[job['queue']] == true) and (not by_class or classes[class] == true)
end
local out, cursor, skipped = {ARGV[2]}, ARGV[2], 0
while #out < 2 * n + 1 and skipped < limit do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[1], cursor, '+inf', 'WITHSCORES', 'LIMIT', skipped, 100)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local raw = batch[i]
    if wanted(raw) then
      redis.call('ZREM', KEYS[1], raw)
      local t = redis.call('TIME')
      local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
      redis.call('HSET', KEYS[2], id, raw)
      out[#out + 1] = id
      out[#out + 1] = raw
      if #out >= 2 * n + 1 then break end
    else
      skipped = skipped + 1
      out[1] = batch[i + 1]
    end
  end
end
return out
";

/// Runs one bridge until aborted.
pub async fn run(
    client: Client,
    into: ParkInto,
    queue: DeadLetterQueue,
    source: SidekiqSourceSpec,
) {
    keep_running("sidekiq", &into, || {
        run_once(&client, &into, &queue, &source)
    })
    .await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &SidekiqSourceSpec,
) -> Result<(), SourceError> {
    let url = url_from_secret(
        client,
        into,
        source.url_secret_ref.as_ref(),
        queue
            .spec
            .target
            .sidekiq
            .as_ref()
            .and_then(|t| t.url_secret_ref.as_ref()),
        "sidekiq",
    )
    .await?;
    let conn = Arc::new(RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?);
    let ctx = Arc::new(Bridge::new(into.clone(), conn, source)?);
    ctx.taken.recover().await?;
    tracing::debug!(namespace = %into.namespace(), queue = %into.queue(), dead = %ctx.dead, "sidekiq source draining");
    tokio::select! {
        pulled = pull(&ctx) => pulled,
        swept = ctx.sweep() => swept,
    }
}

/// Takes dead jobs as parking slots free up; looks again after [`IDLE`] when there are none.
async fn pull(ctx: &Arc<Bridge>) -> Result<(), SourceError> {
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    let mut cursor = Cursor::new();
    loop {
        let permits = free_slots(&slots).await?;
        let (next, taken) = ctx.take(permits.len(), cursor.at()).await?;
        cursor.moved_to(next);
        if taken.is_empty() {
            drop(permits);
            tokio::time::sleep(IDLE).await;
            continue;
        }
        // Slots left over (fewer jobs than free slots) are dropped, so freed.
        for ((id, raw), permit) in taken.into_iter().zip(permits) {
            spawn_handle(&ctx.taken, id, raw, permit);
        }
    }
}

/// Where a filtered take starts: below it no dead job matches (see [`TAKE`]).
struct Cursor {
    score: String,
    since: Instant,
}

impl Cursor {
    fn new() -> Self {
        Cursor {
            score: "-inf".into(),
            since: Instant::now(),
        }
    }

    fn at(&mut self) -> &str {
        if self.since.elapsed() > CURSOR_RESET {
            *self = Cursor::new();
        }
        &self.score
    }

    fn moved_to(&mut self, score: String) {
        self.score = score;
    }
}

struct Bridge {
    /// This queue's inflight hash (its own keys beside Sidekiq's: two queues filtering one
    /// Sidekiq never share them) and how its jobs are parked and acknowledged.
    taken: Arc<Taken>,
    /// Sidekiq's dead set (`[<namespace>:]dead`).
    dead: String,
    counter: String,
    /// The filters as the script takes them (JSON arrays).
    queues: String,
    classes: String,
    /// Whether the last look found the dead set near Sidekiq's trim (warned once per crossing).
    near_trim: Mutex<bool>,
}

impl Bridge {
    fn new(
        into: ParkInto,
        conn: Arc<RedisConn>,
        source: &SidekiqSourceSpec,
    ) -> Result<Self, SourceError> {
        let prefix = source
            .namespace
            .as_ref()
            .map_or_else(String::new, |n| format!("{n}:"));
        let own = format!("{prefix}dlq:{}/{}", into.namespace(), into.queue());
        let json = |v: &Vec<String>| {
            serde_json::to_string(v).map_err(|e| SourceError::Config(format!("filters: {e}")))
        };
        let taken = Taken::new(
            into,
            conn,
            format!("{own}:inflight"),
            format!("{own}:rejected"),
            format!("{own}:inflight"),
            dlq_core::sidekiq::request_for,
            Failpoints {
                after_take: "sidekiq-after-take",
                before_ack: "sidekiq-before-ack",
            },
        );
        Ok(Bridge {
            dead: format!("{prefix}dead"),
            counter: format!("{own}:inflight:seq"),
            queues: json(&source.queues)?,
            classes: json(&source.classes)?,
            taken: Arc::new(taken),
            near_trim: Mutex::default(),
        })
    }

    /// Every [`SWEEP`]: re-parks inflight jobs seen two sweeps in a row and not parked here,
    /// and says whether the dead set is near Sidekiq's trim.
    async fn sweep(&self) -> Result<(), SourceError> {
        let mut suspects: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep(SWEEP).await;
            self.watch_size().await?;
            suspects = self.taken.sweep_once(&suspects).await?;
        }
    }

    /// Warns once each time the dead set grows past [`NEAR_TRIM`]: Sidekiq will soon drop
    /// its oldest jobs before they are parked.
    async fn watch_size(&self) -> Result<(), SourceError> {
        let size: u64 = self
            .taken
            .conn
            .query(redis::cmd("ZCARD").arg(&self.dead))
            .await
            .map_err(SourceError::broker(format!("counting {}", self.dead)))?;
        let near = size >= NEAR_TRIM;
        let was = std::mem::replace(&mut *lock(&self.near_trim), near);
        if near && !was {
            let note = format!(
                "Sidekiq's dead set {} holds {size} jobs; Sidekiq drops the oldest beyond {SIDEKIQ_DEAD_MAX} (its default dead_max_jobs) before they are parked: resolve records (the queue may be at maxParked) or raise Sidekiq's limit",
                self.dead
            );
            let into = &self.taken.into;
            tracing::warn!(namespace = %into.namespace(), queue = %into.queue(), size, dead = %self.dead, "sidekiq dead set near its trim");
            into.warn(events::reason::DEAD_SET_NEAR_TRIM, note).await;
        }
        Ok(())
    }

    /// Up to `n` dead jobs moved into the inflight hash with their ids, and the cursor to
    /// start from next time (see [`TAKE`]).
    async fn take(
        &self,
        n: usize,
        cursor: &str,
    ) -> Result<(String, Vec<(String, Vec<u8>)>), SourceError> {
        let flat: Vec<Vec<u8>> = self
            .taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE)
                    .arg(3)
                    .arg(&self.dead)
                    .arg(&self.taken.hash)
                    .arg(&self.counter)
                    .arg(n)
                    .arg(cursor)
                    .arg(&self.queues)
                    .arg(&self.classes)
                    .arg(SCAN_LIMIT),
            )
            .await
            .map_err(SourceError::broker(format!("taking jobs of {}", self.dead)))?;
        let mut items = flat.into_iter();
        let next = items
            .next()
            .map(String::from_utf8)
            .transpose()
            .map_err(|e| SourceError::Decode(format!("a dead-set cursor: {e}")))?
            .unwrap_or_else(|| "-inf".into());
        Ok((next, pairs(items)?))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it leaves plain data behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
