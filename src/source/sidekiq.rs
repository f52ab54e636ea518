//! Sidekiq source bridge: collects the `dead` sorted set, where Sidekiq moves a job that
//! exhausted its retries (and which it trims to 10,000 jobs and 6 months by default, dropping
//! the rest silently). One atomic script ([`TAKE`]) moves the oldest dead jobs, as many as there
//! are free parking slots and room in the source's byte budget
//! ([`super::taken::BYTES_IN_FLIGHT`]), into this queue's inflight hash under ids Redis gives
//! them (server time + a counter); each is parked with that id as its source message identity
//! and only then HDELed. On start the bridge re-parks what a crash left in the hash: a job whose
//! record exists, even one a human resolved meanwhile, is found by its id, not parked as a new
//! death. A sweep every [`SWEEP`] re-parks what another process left there, as the Redis source
//! does.
//!
//! `queues` and `classes` narrow what is taken (inside the script, so two queues filtering one
//! Sidekiq never take the same job); a member that is not JSON is taken by every filter, since
//! it names no queue and must not wait there until Sidekiq trims it. The job's exact JSON is the
//! record's payload (`dlq_core::sidekiq`); anything that is not a job becomes an Invalid record
//! of its bytes. A member that can never be a record is moved to this queue's rejected list.
//!
//! The dead set has no blocking pop that keeps a job safe, so an idle bridge looks every
//! [`IDLE`].
//!
//! While a standing replay runs on the queue and every slot holds a job waiting for room (the
//! queue Full), the bridge reaches past them as the Redis source does ([`super::reach`]): it
//! reads the overflow list and then the dead set, oldest first, and takes the jobs the replay
//! passes ([`REACH_READ`], [`TAKE_ONE`]), leaving the others where they are, in their order.
//!
//! Sidekiq drops the oldest dead jobs beyond its `dead_max_jobs` (`deadMaxJobs` on the source)
//! whenever a job dies. When parking cannot keep up (the queue at `maxParked`, or jobs dying
//! faster than records are made), the bridge keeps the set well below that: every [`WATCH`],
//! once it holds more than half, one atomic script ([`OVERFLOW`], in batches) moves the oldest
//! jobs this queue's filters take onto [`overflow_list`], a list of this queue's own in the
//! same Redis that Sidekiq never trims, until the set holds a quarter
//! (`dlq_core::sidekiq::DeadSetBounds`). [`TAKE`] takes from that list first, so jobs are
//! still parked oldest first, with the same crash safety. A `DeadSetOverflow` Event says when
//! an episode of moving starts; `DeadSetNearTrim` warns if the set still nears the trim (jobs
//! no filter takes, or a Redis too slow for the deaths).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Client;
use tokio::sync::Semaphore;

use dlq_core::api::{DeadLetterQueue, SidekiqSourceSpec};
use dlq_core::events::{self, EventPlan};
use dlq_core::sidekiq::DeadSetBounds;

use super::park_into::{ParkInto, SourceError, keep_running};
use super::reach::{
    REACH_BYTES, REACH_LARGEST, REACH_PAGE, Reachable, into_inflight_lua, large_lua,
};
use super::taken::{BYTES_IN_FLIGHT, Element, Failpoints, Taken, free_slots, pairs, spawn_handle};
use crate::broker::backend::{Sides, source_url};
use crate::broker::redis::RedisConn;
use crate::secret::SecretReads;
use crate::state::bytes::ByteBudget;

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

/// How often the bridge looks at the dead set's size (a ZCARD): at the fastest fill measured
/// (about 1,000 jobs/s, docs/backends.md) a set grows by 50 jobs a look, far inside the half of
/// the trim kept free even for a small trim.
const WATCH: Duration = Duration::from_millis(50);

/// Dead jobs one [`OVERFLOW`] call moves at most: a script holds Redis while it runs.
const MOVE_BATCH: u64 = 500;

/// This queue's overflow list: dead jobs the bridge moved out of Sidekiq's dead set before
/// Sidekiq could trim them, oldest first, parked before the dead set's. Never prefixed by the
/// source's redis-namespace: its name is the DeadLetterQueue's (`dlq:<namespace>/<queue>`).
pub fn overflow_list(namespace: &str, queue: &str) -> String {
    format!("dlq:{namespace}/{queue}:overflow")
}

/// Where one queue's Sidekiq source keeps its jobs, named once for the bridge and the backlog
/// probe: Sidekiq's dead set, this queue's own keys beside it (under the source's
/// redis-namespace, `dlq:<namespace>/<queue>`) and its [`overflow_list`].
pub(super) struct Keys {
    pub dead: String,
    pub own: String,
    pub overflow: String,
}

impl Keys {
    pub(super) fn of(source: &SidekiqSourceSpec, namespace: &str, queue: &str) -> Keys {
        let prefix = source
            .namespace
            .as_ref()
            .map_or_else(String::new, |n| format!("{n}:"));
        Keys {
            dead: format!("{prefix}dead"),
            own: format!("{prefix}dlq:{namespace}/{queue}"),
            overflow: overflow_list(namespace, queue),
        }
    }

    /// This queue's inflight hash.
    pub(super) fn inflight(&self) -> String {
        format!("{}:inflight", self.own)
    }
}

/// The Lua both scripts share: `wanted(raw)`, whether this queue's filters take a dead job
/// (queues ARGV[3] and classes ARGV[4], JSON arrays; empty: any). A member that is not a JSON
/// object names no queue and is taken by every filter.
macro_rules! filter_lua {
    () => {
        r"
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
"
    };
}

/// Moves up to ARGV[1] dead jobs into the inflight hash, each under a fresh id: first from the
/// overflow list (oldest first, already filtered), then the oldest dead jobs from scores ARGV[2]
/// on that match the filters, reading past at most ARGV[5] others; at most ARGV[6] bytes of
/// them, but always the first however large (the source's byte budget, as the Redis source's).
/// Returns the next cursor (the score of the last job read past, below which none matches),
/// then id, job, id, job, ...
/// KEYS: dead, inflight, counter, overflow.
const TAKE: &str = concat!(
    filter_lua!(),
    r"
local n, limit, room = tonumber(ARGV[1]), tonumber(ARGV[5]), tonumber(ARGV[6])
local out, cursor, skipped, total, full = {ARGV[2]}, ARGV[2], 0, 0, false
local function fits(raw)
  full = #out > 1 and total + #raw > room
  return not full
end
local function take(raw)
  local t = redis.call('TIME')
  local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[2], id, raw)
  total = total + #raw
  out[#out + 1] = id
  out[#out + 1] = raw
end
while #out < 2 * n + 1 do
  local raw = redis.call('LINDEX', KEYS[4], 0)
  if not raw or not fits(raw) then break end
  redis.call('LPOP', KEYS[4])
  take(raw)
end
while not full and #out < 2 * n + 1 and skipped < limit do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[1], cursor, '+inf', 'WITHSCORES', 'LIMIT', skipped, 100)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local raw = batch[i]
    if wanted(raw) then
      if not fits(raw) then break end
      redis.call('ZREM', KEYS[1], raw)
      take(raw)
      if #out >= 2 * n + 1 then break end
    else
      skipped = skipped + 1
      out[1] = batch[i + 1]
    end
  end
end
return out
"
);

/// ARGV[2] of this queue's waiting jobs from ARGV[1] past the oldest, oldest first: the
/// overflow list's, then the dead set's by score; one the filters do not take as an empty
/// string (it keeps its place in the count), and one over ARGV[5] bytes as its facts (the
/// members a record reads, see [`large_lua`]), at most ARGV[6] bytes of them. Jobs Sidekiq adds go to
/// the set's newest end, and jobs moved to the overflow list go from the set's oldest end to
/// the list's newest, so the order a reach reads in holds while it reads.
/// KEYS: overflow, dead.
const REACH_READ: &str = concat!(
    filter_lua!(),
    r"
local function facts(job)
  local f = {}
  for _, k in ipairs({'jid', 'class', 'wrapped', 'queue', 'retry_count', 'error_class', 'error_message', 'failed_at'}) do
    f[k] = job[k]
  end
  return f
end
",
    large_lua!(),
    r"
local at, count, largest = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[5])
local page = {}
local listed = redis.call('LLEN', KEYS[1])
if at < listed then
  page = redis.call('LRANGE', KEYS[1], at, at + count - 1)
end
if #page < count then
  local from = math.max(at - listed, 0)
  for _, raw in ipairs(redis.call('ZRANGE', KEYS[2], from, from + count - #page - 1)) do
    page[#page + 1] = raw
  end
end
for i = 1, #page do
  if not wanted(page[i]) then
    page[i] = ''
  elseif #page[i] > largest then
    page[i] = large(page[i], tonumber(ARGV[6]))
  end
end
return page
"
);

/// Moves one job, ARGV[1], from the dead set or else the overflow list (its oldest copy) into
/// the inflight hash under a fresh id; nil when it is in neither (taken meanwhile).
/// KEYS: overflow, inflight, counter, dead.
const TAKE_ONE: &str = concat!(
    "if redis.call('ZREM', KEYS[4], ARGV[1]) == 0 and redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return false end",
    into_inflight_lua!()
);

/// While the dead set holds more than ARGV[6] jobs, moves up to ARGV[1] of the oldest that
/// match the filters, from scores ARGV[2] on, onto the tail of the overflow list, reading past
/// at most ARGV[5] others. Returns the next cursor (as [`TAKE`]'s), how many it moved, the
/// set's size and the list's length after.
/// KEYS: dead, overflow.
const OVERFLOW: &str = concat!(
    filter_lua!(),
    r"
local n, limit, keep = tonumber(ARGV[1]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cursor, reached, skipped, moved = ARGV[2], ARGV[2], 0, 0
local size = redis.call('ZCARD', KEYS[1])
while moved < n and size > keep and skipped < limit do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[1], cursor, '+inf', 'WITHSCORES', 'LIMIT', skipped, 100)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local raw = batch[i]
    if wanted(raw) then
      redis.call('ZREM', KEYS[1], raw)
      redis.call('RPUSH', KEYS[2], raw)
      moved = moved + 1
      size = size - 1
      if moved >= n or size <= keep then break end
    else
      skipped = skipped + 1
      reached = batch[i + 1]
    end
  end
end
return {reached, moved, size, redis.call('LLEN', KEYS[2])}
"
);

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
    let mut secrets = SecretReads::new(client, into.namespace());
    let url = source_url(&mut secrets, Sides::of(source, &queue.spec)).await?;
    let conn = Arc::new(RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?);
    let ctx = Arc::new(Bridge::new(into.clone(), conn, source)?);
    tracing::debug!(namespace = %into.namespace(), queue = %into.queue(), dead = %ctx.dead, "sidekiq source draining");
    // Keeping the set below the trim starts first: re-parking what a crash left may wait
    // for a full queue for hours.
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    let drain = async {
        ctx.taken.recover().await?;
        tokio::select! {
            pulled = pull(&ctx, &slots) => pulled,
            swept = ctx.sweep() => swept,
            reached = super::reach::reach(ctx.as_ref(), &slots, CONCURRENCY) => reached,
        }
    };
    tokio::select! {
        drained = drain => drained,
        kept = ctx.keep_below_trim() => kept,
    }
}

/// Takes dead jobs as `slots` and the byte budget free up; looks again after [`IDLE`] when
/// there are none.
async fn pull(ctx: &Arc<Bridge>, slots: &Arc<Semaphore>) -> Result<(), SourceError> {
    let budget = ByteBudget::new(BYTES_IN_FLIGHT);
    let mut cursor = Cursor::new();
    loop {
        let permits = free_slots(slots).await?;
        let room = budget.free().await?;
        let (next, taken) = ctx.take(permits.len(), cursor.at(), room).await?;
        cursor.moved_to(next);
        if taken.is_empty() {
            drop(permits);
            tokio::time::sleep(IDLE).await;
            continue;
        }
        // Slots left over (fewer jobs than free slots) are dropped, so freed. The batch fits
        // the room it was taken for, but its first job, which may wait here for jobs in flight
        // to give their bytes back.
        for ((id, raw), permit) in taken.into_iter().zip(permits) {
            let bytes = budget.hold(raw.len() as u64).await?;
            spawn_handle(&ctx.taken, id, raw, (permit, bytes));
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

/// What one [`OVERFLOW`] call did.
struct Moved {
    cursor: String,
    moved: u64,
    /// The dead set's size after it.
    dead: u64,
    /// The overflow list's length after it.
    listed: u64,
}

/// An episode of moving: from the first job moved until the set is back at or below half
/// the trim and the overflow list is empty (all taken to be parked).
struct Episode {
    moved: u64,
    since: Instant,
}

struct Bridge {
    /// This queue's inflight hash (its own keys beside Sidekiq's: two queues filtering one
    /// Sidekiq never share them) and how its jobs are parked and acknowledged.
    taken: Arc<Taken>,
    /// Sidekiq's dead set (`[<namespace>:]dead`).
    dead: String,
    counter: String,
    /// Where jobs go before Sidekiq could trim them ([`overflow_list`]).
    overflow: String,
    /// The filters as the script takes them (JSON arrays).
    queues: String,
    classes: String,
    /// This Sidekiq's `dead_max_jobs` (`deadMaxJobs`) and the sizes that follow from it.
    trim: u64,
    bounds: DeadSetBounds,
}

impl Bridge {
    fn new(
        into: ParkInto,
        conn: Arc<RedisConn>,
        source: &SidekiqSourceSpec,
    ) -> Result<Self, SourceError> {
        let keys = Keys::of(source, into.namespace(), into.queue());
        let own = &keys.own;
        let json = |v: &Vec<String>| {
            serde_json::to_string(v).map_err(|e| SourceError::Config(format!("filters: {e}")))
        };
        let taken = Taken::new(
            into,
            conn,
            keys.inflight(),
            format!("{own}:rejected"),
            keys.inflight(),
            |queue, raw| Element::Whole(dlq_core::sidekiq::request_for(queue, &raw), raw),
            Failpoints {
                after_take: "sidekiq-after-take",
                before_ack: "sidekiq-before-ack",
            },
        );
        let trim = source.dead_max_jobs();
        Ok(Bridge {
            counter: format!("{own}:inflight:seq"),
            dead: keys.dead,
            overflow: keys.overflow,
            queues: json(&source.queues)?,
            classes: json(&source.classes)?,
            taken: Arc::new(taken),
            trim,
            bounds: DeadSetBounds::for_trim(trim),
        })
    }

    /// Every [`SWEEP`]: re-parks inflight jobs seen two sweeps in a row and not parked here.
    async fn sweep(&self) -> Result<(), SourceError> {
        let mut suspects: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep(SWEEP).await;
            suspects = self.taken.sweep_once(&suspects).await?;
        }
    }

    /// Every [`WATCH`]: once the dead set holds more than half the trim, moves this queue's
    /// oldest jobs onto the overflow list until it holds a quarter; says when an episode of
    /// moving starts (`DeadSetOverflow`) and, once per crossing, when the set is near the trim
    /// all the same (`DeadSetNearTrim`).
    async fn keep_below_trim(&self) -> Result<(), SourceError> {
        let mut cursor = Cursor::new();
        let mut episode: Option<Episode> = None;
        let mut near = false;
        loop {
            let before = self.dead_size().await?;
            let mut dead = before;
            let mut moved = 0;
            let mut listed = None;
            if self.bounds.to_move(dead) > 0 {
                // Down to a quarter, a batch at a time (below half, `to_move` says 0).
                while dead > self.bounds.low {
                    let n = (dead - self.bounds.low).min(MOVE_BATCH);
                    let m = self.move_out(n, cursor.at()).await?;
                    cursor.moved_to(m.cursor);
                    (dead, listed) = (m.dead, Some(m.listed));
                    moved += m.moved;
                    // None of this queue's left within the scan: the next look goes on.
                    if m.moved == 0 {
                        break;
                    }
                }
            }
            if moved > 0 {
                match &mut episode {
                    Some(e) => e.moved += moved,
                    None => {
                        episode = Some(Episode {
                            moved,
                            since: Instant::now(),
                        });
                        self.overflowing(before, moved, listed.unwrap_or(moved))
                            .await;
                    }
                }
            }
            if let Some(e) = &episode
                && dead <= self.bounds.high
                && self.overflow_len().await? == 0
            {
                tracing::info!(namespace = %self.taken.into.namespace(), queue = %self.taken.into.queue(), moved = e.moved, secs = e.since.elapsed().as_secs(), overflow = %self.overflow, "sidekiq overflow list emptied: every job moved there is taken to be parked");
                episode = None;
            }
            let now_near = self.bounds.is_near_trim(dead);
            if now_near && !near {
                self.near_trim(dead).await;
            }
            near = now_near;
            tokio::time::sleep(WATCH).await;
        }
    }

    /// Says, once an episode starts, that jobs are being moved out of Sidekiq's reach.
    async fn overflowing(&self, size: u64, moved: u64, listed: u64) {
        let into = &self.taken.into;
        tracing::info!(namespace = %into.namespace(), queue = %into.queue(), size, moved, listed, dead = %self.dead, overflow = %self.overflow, "sidekiq dead set above half its trim: moving the oldest jobs to the overflow list");
        let note = format!(
            "Sidekiq's dead set {} held {size} jobs, more than half of its trim (deadMaxJobs {}): moved the oldest {moved} this queue takes into {} (now {listed}), which Sidekiq never trims; they are parked from there first, oldest first, and count as backlog",
            self.dead, self.trim, self.overflow
        );
        let event = EventPlan::normal(
            events::reason::DEAD_SET_OVERFLOW,
            events::action::PARK,
            note,
        );
        into.tell(&event).await;
    }

    /// Warns that the set nears the trim even so: Sidekiq will soon drop jobs unparked.
    async fn near_trim(&self, size: u64) {
        let note = format!(
            "Sidekiq's dead set {} holds {size} jobs; Sidekiq drops the oldest beyond {} (deadMaxJobs) before they are parked, and moving this queue's jobs to {} has not kept it down: jobs no DeadLetterQueue's filters take, or a deadMaxJobs above Sidekiq's dead_max_jobs",
            self.dead, self.trim, self.overflow
        );
        let into = &self.taken.into;
        tracing::warn!(namespace = %into.namespace(), queue = %into.queue(), size, dead = %self.dead, "sidekiq dead set near its trim");
        into.warn(events::reason::DEAD_SET_NEAR_TRIM, note).await;
    }

    async fn dead_size(&self) -> Result<u64, SourceError> {
        self.taken
            .conn
            .query(redis::cmd("ZCARD").arg(&self.dead))
            .await
            .map_err(SourceError::broker(format!("counting {}", self.dead)))
    }

    async fn overflow_len(&self) -> Result<u64, SourceError> {
        self.taken
            .conn
            .query(redis::cmd("LLEN").arg(&self.overflow))
            .await
            .map_err(SourceError::broker(format!("counting {}", self.overflow)))
    }

    /// Up to `n` of this queue's oldest dead jobs moved onto the overflow list, leaving at
    /// least a quarter of the trim in the set (see [`OVERFLOW`]).
    async fn move_out(&self, n: u64, cursor: &str) -> Result<Moved, SourceError> {
        let (cursor, moved, dead, listed): (String, u64, u64, u64) = self
            .taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(OVERFLOW)
                    .arg(2)
                    .arg(&self.dead)
                    .arg(&self.overflow)
                    .arg(n)
                    .arg(cursor)
                    .arg(&self.queues)
                    .arg(&self.classes)
                    .arg(SCAN_LIMIT)
                    .arg(self.bounds.low),
            )
            .await
            .map_err(SourceError::broker(format!(
                "moving jobs of {} to {}",
                self.dead, self.overflow
            )))?;
        Ok(Moved {
            cursor,
            moved,
            dead,
            listed,
        })
    }

    /// Up to `n` jobs (and `room` bytes, but at least one) moved into the inflight hash with
    /// their ids (the overflow list's first), and the cursor to start from next time (see
    /// [`TAKE`]).
    async fn take(
        &self,
        n: usize,
        cursor: &str,
        room: usize,
    ) -> Result<(String, Vec<(String, Vec<u8>)>), SourceError> {
        let flat: Vec<Vec<u8>> = self
            .taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE)
                    .arg(4)
                    .arg(&self.dead)
                    .arg(&self.taken.hash)
                    .arg(&self.counter)
                    .arg(&self.overflow)
                    .arg(n)
                    .arg(cursor)
                    .arg(&self.queues)
                    .arg(&self.classes)
                    .arg(SCAN_LIMIT)
                    .arg(room),
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

/// The overflow list, then the dead set, oldest first (see [`REACH_READ`]); a job is taken by
/// [`TAKE_ONE`].
impl Reachable for Bridge {
    fn taken(&self) -> &Arc<Taken> {
        &self.taken
    }

    async fn page(&self, at: isize) -> Result<Vec<Vec<u8>>, SourceError> {
        self.taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(REACH_READ)
                    .arg(2)
                    .arg(&self.overflow)
                    .arg(&self.dead)
                    .arg(at)
                    .arg(REACH_PAGE)
                    .arg(&self.queues)
                    .arg(&self.classes)
                    .arg(REACH_LARGEST)
                    .arg(REACH_BYTES),
            )
            .await
            .map_err(SourceError::broker(format!(
                "reading {} and {}",
                self.overflow, self.dead
            )))
    }

    async fn take_one(&self, raw: &[u8]) -> Result<Option<String>, SourceError> {
        self.taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE_ONE)
                    .arg(4)
                    .arg(&self.overflow)
                    .arg(&self.taken.hash)
                    .arg(&self.counter)
                    .arg(&self.dead)
                    .arg(raw),
            )
            .await
            .map_err(SourceError::broker(format!(
                "taking a job of {}",
                self.dead
            )))
    }
}

#[cfg(test)]
mod tests {
    use super::{REACH_READ, TAKE, TAKE_ONE, pairs};

    /// A page element as the test reads it: a job's jid, or a large job's jid, size and args.
    fn looked(raw: &[u8]) -> String {
        let Some(rest) = raw.strip_prefix(b"\0") else {
            let text = String::from_utf8_lossy(raw);
            return text.split('"').nth(3).unwrap_or_default().to_string();
        };
        let end = rest.iter().position(|b| *b == 0).expect("size, NUL");
        let size = String::from_utf8_lossy(&rest[..end]);
        let facts: serde_json::Value =
            serde_json::from_slice(&rest[end + 1..]).expect("facts as JSON");
        let args = if facts.get("args").is_some() {
            "kept"
        } else {
            "left behind"
        };
        format!(
            "{}: {size} bytes, args {args}",
            facts["jid"].as_str().unwrap_or_default()
        )
    }

    /// [`REACH_READ`] and [`TAKE_ONE`] against a real redis-server: pages run through the
    /// overflow list and on into the dead set by score, a job the filters leave reads as empty
    /// in its place, one over the size bound as its size and facts (empty past the decode
    /// budget), and a job is taken from either by its bytes, once.
    #[tokio::test]
    async fn a_reach_reads_the_overflow_list_then_the_dead_set_and_takes_by_bytes() {
        let redis = dlq_testenv::brokers::Redis::start();
        let mut conn = redis.conn().await;
        let job = |jid: &str, queue: &str| {
            format!(r#"{{"jid":"{jid}","queue":"{queue}","class":"C","args":[]}}"#)
        };
        let _: () = redis::cmd("RPUSH")
            .arg("overflow")
            .arg(job("o1", "q"))
            .arg(job("o2", "q"))
            .query_async(&mut conn)
            .await
            .expect("RPUSH");
        let _: () = redis::cmd("ZADD")
            .arg("dead")
            .arg(3)
            .arg(job("d3", "q"))
            .arg(1)
            .arg(job("d1", "q"))
            .arg(2)
            .arg(job("other", "elsewhere"))
            .arg(4)
            .arg(format!(
                r#"{{"jid":"big","queue":"q","args":["{}"]}}"#,
                "x".repeat(100)
            ))
            .query_async(&mut conn)
            .await
            .expect("ZADD");
        let budget = std::cell::Cell::new(1000);
        let mut page = async |at: isize, count: isize| -> Vec<String> {
            let page: Vec<Vec<u8>> = redis::cmd("EVAL")
                .arg(REACH_READ)
                .arg(2)
                .arg(&["overflow", "dead"])
                .arg(at)
                .arg(count)
                .arg(r#"["q"]"#)
                .arg("[]")
                .arg(100)
                .arg(budget.get())
                .query_async(&mut conn)
                .await
                .expect("EVAL");
            page.iter().map(|raw| looked(raw)).collect()
        };
        assert_eq!(
            page(0, 64).await,
            [
                "o1",
                "o2",
                "d1",
                "",
                "d3",
                "big: 137 bytes, args left behind"
            ]
        );
        budget.set(100);
        assert_eq!(
            page(0, 64).await,
            ["o1", "o2", "d1", "", "d3", ""],
            "over the decode budget"
        );
        assert_eq!(page(1, 2).await, ["o2", "d1"], "across the list's end");
        assert_eq!(page(3, 2).await, ["", "d3"], "in the set");
        assert!(page(6, 64).await.is_empty());
        let mut taker = redis.conn().await;
        let mut take = async |raw: String| -> Option<String> {
            redis::cmd("EVAL")
                .arg(TAKE_ONE)
                .arg(4)
                .arg(&["overflow", "inflight", "counter", "dead"])
                .arg(raw)
                .query_async(&mut taker)
                .await
                .expect("EVAL")
        };
        assert!(take(job("d3", "q")).await.is_some(), "from the set");
        assert!(take(job("o2", "q")).await.is_some(), "from the list");
        assert!(take(job("o2", "q")).await.is_none(), "once");
        assert_eq!(redis.hash_len("inflight").await, 2);
        assert_eq!(page(0, 64).await, ["o1", "d1", "", ""]);
    }

    /// [`TAKE`] against a real redis-server: the overflow list first, then the dead set, at
    /// most its room of bytes but always one job however large, and once a job does not fit,
    /// nothing behind it (a small job later in the set is not taken out of order).
    #[tokio::test]
    async fn a_take_moves_at_most_its_room_but_always_one_in_order() {
        let redis = dlq_testenv::brokers::Redis::start();
        let mut conn = redis.conn().await;
        for i in 0..3u8 {
            let _: () = redis::cmd("RPUSH")
                .arg("overflow")
                .arg(vec![i; 1 << 20])
                .query_async(&mut conn)
                .await
                .expect("RPUSH");
        }
        let _: () = redis::cmd("ZADD")
            .arg("dead")
            .arg(1)
            .arg(vec![3u8; 10])
            .arg(2)
            .arg(vec![4u8; 1 << 20])
            .query_async(&mut conn)
            .await
            .expect("ZADD");
        let mut take = async |n: usize, room: usize| -> Vec<u8> {
            let flat: Vec<Vec<u8>> = redis::cmd("EVAL")
                .arg(TAKE)
                .arg(4)
                .arg(&["dead", "inflight", "counter", "overflow"])
                .arg(n)
                .arg("-inf")
                .arg("[]")
                .arg("[]")
                .arg(1000)
                .arg(room)
                .query_async(&mut conn)
                .await
                .expect("EVAL");
            let taken = pairs(flat.into_iter().skip(1)).expect("pairs");
            taken.iter().map(|(_, raw)| raw[0]).collect()
        };
        assert_eq!(
            take(32, (1 << 20) + 10).await,
            [0],
            "one fits, not the next"
        );
        assert_eq!(take(32, 0).await, [1], "one however large");
        assert_eq!(
            take(32, (2 << 20) + 10).await,
            [2, 3, 4],
            "the list, then the set"
        );
        assert!(take(32, 10 << 20).await.is_empty());
        assert_eq!(redis.hash_len("inflight").await, 5);
    }
}
