//! Redis source bridge: consumers LPUSH dead jobs onto a list; the bridge moves each one into
//! the hash `<list>:inflight` under an id Redis gives it (server time + a counter), parks it
//! with that id as its source message identity, and only then HDELs it. While the list has a
//! backlog one atomic script moves as many elements as there are free parking slots ([`TAKE_BATCH`]);
//! when it is empty the bridge blocks in BLMOVE onto `<list>:processing` and then takes that
//! element into the hash ([`TAKE_ONE`]). On start it first re-parks whatever a crash left in
//! `<list>:processing` and `<list>:inflight`. The id is what makes that safe: a re-parked
//! element whose record exists, even one a human resolved meanwhile, is recognised as the same
//! dead message, not a new death of the job.
//!
//! While running it also sweeps both places every [`SWEEP`]: what another process left there
//! after this one started (a replica that lost its Lease while parking, a puller of a run that
//! failed) and is still there one sweep later, unhandled here, is re-parked the same way.
//!
//! Elements are JSON envelopes (see docs/backends.md, "Source: the dead-list envelope"). Anything else, and any
//! envelope that fails validation, is parked as an Invalid record holding the exact bytes. An
//! element that cannot be a record at all (over the payload limit) is moved to
//! `<list>:rejected`, never deleted, and counted and announced.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kube::Client;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use dlq_core::api::{DeadLetterQueue, RedisSourceSpec};
use dlq_core::envelope::request_for;

use super::{ParkInto, SourceError};
use crate::target::redis::RedisConn;

/// Parks in flight at once per bridge: parkings waiting together share one reservation under
/// maxParked, so more in flight means fewer queue writes per record. 32 rather than the 16 of
/// NATS and SQS: a Redis backlog is drained in batches as fast as parks finish, and with 16 a
/// storm went at the pace of each park's round trips (71% of the create ceiling instead of
/// 62%) while the apiserver still had room.
pub const CONCURRENCY: usize = 32;

/// How often a running bridge looks for elements nobody is parking (see the module doc).
const SWEEP: Duration = Duration::from_secs(10);

/// Moves one element from the processing list into the inflight hash under a fresh id; nil
/// when the element is no longer in the list. KEYS: processing, inflight, counter.
const TAKE_ONE: &str = r"
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return false end
local t = redis.call('TIME')
local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[2], id, ARGV[1])
return id
";

/// Moves up to ARGV[1] elements from the dead list straight into the inflight hash, each under
/// a fresh id, in one atomic step; returns id, element, id, element, ... (empty when the list
/// is). KEYS: dead, inflight, counter. One round trip per batch instead of two per element:
/// a storm was drained at the pace of those round trips.
const TAKE_BATCH: &str = r"
local out = {}
for i = 1, tonumber(ARGV[1]) do
  local raw = redis.call('RPOP', KEYS[1])
  if not raw then break end
  local t = redis.call('TIME')
  local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[2], id, raw)
  out[#out + 1] = id
  out[#out + 1] = raw
end
return out
";

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: RedisSourceSpec) {
    super::keep_running("redis", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &RedisSourceSpec,
) -> Result<(), SourceError> {
    let (ns, name) = (into.namespace(), into.queue());
    let url = super::url_from_secret(
        client,
        into,
        source.url_secret_ref.as_ref(),
        queue.spec.target.redis.as_ref().map(|t| &t.url_secret_ref),
        "redis",
    )
    .await?;
    // One connection blocks in BLMOVE; the other takes elements and acknowledges them.
    let puller = RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?;
    let acker = Arc::new(RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?);
    let dead = source.list.clone();
    let processing = format!("{dead}:processing");
    let ctx = Arc::new(Bridge {
        into: into.clone(),
        acker,
        inflight: format!("{dead}:inflight"),
        counter: format!("{dead}:inflight:seq"),
        processing: processing.clone(),
        rejected: format!("{dead}:rejected"),
        dead: dead.clone(),
        handling: Mutex::default(),
    });
    ctx.recover().await?;
    tracing::debug!(namespace = %ns, queue = %name, list = %dead, "redis source draining");
    tokio::select! {
        pulled = pull(&ctx, &puller) => pulled,
        swept = ctx.sweep() => swept,
    }
}

/// Takes dead elements as parking slots free up: a batch at once while the list has a
/// backlog, else one at a time through a blocking BLMOVE.
async fn pull(ctx: &Arc<Bridge>, puller: &RedisConn) -> Result<(), SourceError> {
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        let mut permits = free_slots(&slots).await?;
        let taken = ctx.take(permits.len()).await?;
        if taken.is_empty() {
            // The slot is taken before the element (free_slots holds at least one), so a
            // taken element always has one.
            if let Some(permit) = permits.pop()
                && let Some((id, raw)) = ctx.wait_for_one(puller).await?
            {
                spawn_handle(ctx, id, raw, permit);
            }
            continue;
        }
        // Slots left over (fewer elements than free slots) are dropped, so freed.
        for ((id, raw), permit) in taken.into_iter().zip(permits) {
            spawn_handle(ctx, id, raw, permit);
        }
    }
}

/// Waits for one free parking slot, then takes every other one free at that moment.
async fn free_slots(slots: &Arc<Semaphore>) -> Result<Vec<OwnedSemaphorePermit>, SourceError> {
    let first = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(SourceError::broker("waiting for a parking slot"))?;
    let mut permits = vec![first];
    while let Ok(permit) = slots.clone().try_acquire_owned() {
        permits.push(permit);
    }
    Ok(permits)
}

/// Parks and acknowledges one taken element in its own task, holding its slot until done.
fn spawn_handle(ctx: &Arc<Bridge>, id: String, raw: Vec<u8>, permit: OwnedSemaphorePermit) {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        ctx.handle(id, raw).await;
        drop(permit);
    });
}

struct Bridge {
    into: ParkInto,
    acker: Arc<RedisConn>,
    /// The dead list: the source message identities start with its name.
    dead: String,
    processing: String,
    inflight: String,
    counter: String,
    rejected: String,
    /// Ids of the inflight elements this process is parking or acknowledging now (the sweep
    /// leaves them be). Wider than `source::in_flight`'s turns, which end with the park: an
    /// acknowledgement retried through a cut link is not left behind either.
    handling: Mutex<HashSet<String>>,
}

impl Bridge {
    /// Re-parks what a previous run left: elements moved but never taken, then taken but
    /// never acknowledged (those keep their ids, so records made before the crash are found).
    async fn recover(&self) -> Result<(), SourceError> {
        let untaken: Vec<Vec<u8>> = self
            .acker
            .query(redis::cmd("LRANGE").arg(&self.processing).arg(0).arg(-1))
            .await
            .map_err(SourceError::broker(format!("reading {}", self.processing)))?;
        for raw in &untaken {
            self.take_one(raw).await?;
        }
        let taken = self.taken().await?;
        if !taken.is_empty() {
            tracing::info!(namespace = %self.into.namespace(), queue = %self.into.queue(), count = taken.len(), inflight = %self.inflight, "re-parking elements a previous run did not acknowledge");
        }
        for (id, raw) in taken {
            self.handle(id, raw).await;
        }
        Ok(())
    }

    /// Every taken, unacknowledged element by id.
    async fn taken(&self) -> Result<BTreeMap<String, Vec<u8>>, SourceError> {
        self.acker
            .query(redis::cmd("HGETALL").arg(&self.inflight))
            .await
            .map_err(SourceError::broker(format!("reading {}", self.inflight)))
    }

    /// Re-parks, every [`SWEEP`], what was left by others since the start: elements in the
    /// processing list or the inflight hash at two sweeps in a row and not being parked here
    /// (an element moved a moment ago is taken and parked within one sweep). Re-parking is
    /// safe even if another process still parks it: the id finds the same record.
    async fn sweep(&self) -> Result<(), SourceError> {
        let mut suspects: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep(SWEEP).await;
            let untaken: Vec<Vec<u8>> = self
                .acker
                .query(redis::cmd("LRANGE").arg(&self.processing).arg(0).arg(-1))
                .await
                .map_err(SourceError::broker(format!("reading {}", self.processing)))?;
            // Suspects are element digests and inflight ids (the two never look alike).
            let mut seen: HashSet<String> = HashSet::new();
            for raw in &untaken {
                let digest = fingerprint(raw);
                if suspects.contains(&digest) {
                    self.take_one(raw).await?;
                }
                seen.insert(digest);
            }
            for (id, raw) in self.taken().await? {
                if self.lock_handling().contains(&id) {
                    continue;
                }
                if suspects.contains(&id) {
                    tracing::info!(namespace = %self.into.namespace(), queue = %self.into.queue(), id = %id, inflight = %self.inflight, "re-parking an element another run left unacknowledged");
                    self.handle(id, raw).await;
                } else {
                    seen.insert(id);
                }
            }
            suspects = seen;
        }
    }

    fn lock_handling(&self) -> MutexGuard<'_, HashSet<String>> {
        // A panic while holding it leaves a plain set behind; keep using it.
        self.handling.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Up to `n` elements moved from the dead list into the inflight hash, with their ids
    /// (see [`TAKE_BATCH`]).
    async fn take(&self, n: usize) -> Result<Vec<(String, Vec<u8>)>, SourceError> {
        let flat: Vec<Vec<u8>> = self
            .acker
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE_BATCH)
                    .arg(3)
                    .arg(&self.dead)
                    .arg(&self.inflight)
                    .arg(&self.counter)
                    .arg(n),
            )
            .await
            .map_err(SourceError::broker(format!(
                "taking elements of {}",
                self.dead
            )))?;
        let mut taken = Vec::with_capacity(flat.len() / 2);
        let mut pairs = flat.into_iter();
        while let (Some(id), Some(raw)) = (pairs.next(), pairs.next()) {
            let id = String::from_utf8(id)
                .map_err(|e| SourceError::Decode(format!("an inflight id: {e}")))?;
            taken.push((id, raw));
        }
        Ok(taken)
    }

    /// Blocks (one second at most) until an element arrives on the empty dead list, moves it
    /// to the processing list and takes it. None when nothing came, or the element was
    /// taken by someone else.
    async fn wait_for_one(
        &self,
        puller: &RedisConn,
    ) -> Result<Option<(String, Vec<u8>)>, SourceError> {
        let raw: Option<Vec<u8>> = puller
            .query(
                redis::cmd("BLMOVE")
                    .arg(&self.dead)
                    .arg(&self.processing)
                    .arg("RIGHT")
                    .arg("LEFT")
                    .arg(1),
            )
            .await
            .map_err(SourceError::broker(format!("BLMOVE from {}", self.dead)))?;
        let Some(raw) = raw else { return Ok(None) };
        // Until taken the element waits in the processing list for the next start.
        Ok(self.take_one(&raw).await?.map(|id| (id, raw)))
    }

    /// Gives an element of the processing list its id (see [`TAKE_ONE`]).
    async fn take_one(&self, raw: &[u8]) -> Result<Option<String>, SourceError> {
        self.acker
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE_ONE)
                    .arg(3)
                    .arg(&self.processing)
                    .arg(&self.inflight)
                    .arg(&self.counter)
                    .arg(raw),
            )
            .await
            .map_err(SourceError::broker(format!(
                "claiming an element of {}",
                self.processing
            )))
    }

    /// Parks one taken element, retrying until it is a record (or provably never can be),
    /// then acknowledges it by removing it from the inflight hash.
    async fn handle(&self, id: String, raw: Vec<u8>) {
        self.lock_handling().insert(id.clone());
        self.park_and_ack(&id, raw).await;
        self.lock_handling().remove(&id);
    }

    async fn park_and_ack(&self, id: &str, raw: Vec<u8>) {
        let req = request_for(self.into.queue(), &raw).with_message(format!("{}#{id}", self.dead));
        let stays = format!("in {}", self.inflight);
        let parked = self.into.park_message(req, &raw, &stays, || async {}).await;
        if let Err(e) = parked {
            // Can never be a record (over the payload limit, or refused by the apiserver even as an
            // Invalid record of its bytes): keep it in Redis, and say so.
            if self
                .ack(redis::cmd("LPUSH").arg(&self.rejected).arg(&raw[..]))
                .await
                .is_err()
            {
                return;
            }
            self.into.rejected(&e, raw.len(), &self.rejected).await;
        }
        crate::failpoint::hit("redis-before-ack").await;
        let _ = self
            .ack(redis::cmd("HDEL").arg(&self.inflight).arg(id))
            .await;
    }

    /// Retries an acknowledgement until Redis takes it: the record exists, so giving up here
    /// leaves the element for the next recovery, which finds its record by its id.
    async fn ack(&self, cmd: &mut redis::Cmd) -> Result<(), ()> {
        for attempt in 0..10u32 {
            match self.acker.query::<redis::Value>(cmd).await {
                Ok(_) => return Ok(()),
                Err(e) => {
                    tracing::warn!(error = %e, "redis acknowledgement failed; retrying");
                    tokio::time::sleep(dlq_core::decide::backoff(attempt, Duration::from_secs(5)))
                        .await;
                }
            }
        }
        Err(())
    }
}

/// A processing-list element, by its bytes' digest (elements may be large).
fn fingerprint(raw: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(raw))
}
