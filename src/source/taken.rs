//! What the Redis-backed sources (`super::redis`, `super::sidekiq`) took and have not yet
//! acknowledged: a hash `id → element` in Redis, where each source's own script moves what it
//! takes under an id Redis gives it (server time + a counter). The parking, the acknowledgement
//! (HDEL only once the record exists), the re-parking of what a crashed run left and the sweep
//! for what another process left are the same for both, so they are here once.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dlq_core::park::ParkRequest;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::park_into::{ParkInto, SourceError};
use crate::broker::redis::RedisConn;

/// Which failpoints a source's parking passes (`crate::failpoint`).
pub struct Failpoints {
    /// Just taken, before the park.
    pub after_take: &'static str,
    /// Parked, before the acknowledgement.
    pub before_ack: &'static str,
}

/// Moves element `ARGV[1]` of hash `KEYS[1]` onto list `KEYS[2]` as Redis holds it, at once
/// (nothing when it is gone: acknowledged already).
const REJECT: &str = "local v = redis.call('HGET', KEYS[1], ARGV[1]) \
    if v then redis.call('LPUSH', KEYS[2], v) redis.call('HDEL', KEYS[1], ARGV[1]) end return 1";

/// A taken element as its source reads it.
pub enum Element {
    /// The request it names, and its exact bytes.
    Whole(ParkRequest, Vec<u8>),
    /// The request alone: its payload, too large for a record, was decoded in the element's
    /// own buffer (`dlq_core::envelope::take_apart`), so its exact bytes are only in the hash.
    Apart(ParkRequest),
}

/// One source's hash of taken elements and how it parks them.
pub struct Taken {
    pub into: ParkInto,
    pub conn: Arc<RedisConn>,
    /// The hash: `<list>:inflight`, or the Sidekiq queue's own.
    pub hash: String,
    /// Where an element that can never be a record is kept (a list), never deleted.
    pub rejected: String,
    /// The source message identity of element `id` is `<identity_prefix>#<id>`.
    pub identity_prefix: String,
    /// How an element is read (in the queue of the given name).
    pub read: fn(&str, Vec<u8>) -> Element,
    pub failpoints: Failpoints,
    /// Ids this process is parking or acknowledging now (the sweep leaves them be). Wider than
    /// `super::in_flight`'s turns, which end with the park: an acknowledgement retried through
    /// a cut link is not left behind either.
    handling: Mutex<HashSet<String>>,
}

impl Taken {
    pub fn new(
        into: ParkInto,
        conn: Arc<RedisConn>,
        hash: String,
        rejected: String,
        identity_prefix: String,
        read: fn(&str, Vec<u8>) -> Element,
        failpoints: Failpoints,
    ) -> Self {
        Taken {
            into,
            conn,
            hash,
            rejected,
            identity_prefix,
            read,
            failpoints,
            handling: Mutex::default(),
        }
    }

    /// Every taken, unacknowledged element by id.
    pub async fn all(&self) -> Result<BTreeMap<String, Vec<u8>>, SourceError> {
        self.conn
            .query(redis::cmd("HGETALL").arg(&self.hash))
            .await
            .map_err(SourceError::broker(format!("reading {}", self.hash)))
    }

    /// Re-parks what a previous run took but never acknowledged (by id, so records made
    /// before the crash are found).
    pub async fn recover(&self) -> Result<(), SourceError> {
        let taken = self.all().await?;
        if !taken.is_empty() {
            tracing::info!(namespace = %self.into.namespace(), queue = %self.into.queue(), count = taken.len(), inflight = %self.hash, "re-parking what a previous run did not acknowledge");
        }
        for (id, raw) in taken {
            self.handle(id, raw).await;
        }
        Ok(())
    }

    /// One sweep of the hash: re-parks what was there at the last sweep too (`suspects`) and is
    /// not being parked here; returns the ids to suspect next time. Re-parking is safe even if
    /// another process still parks it: the id finds the same record.
    pub async fn sweep_once(
        &self,
        suspects: &HashSet<String>,
    ) -> Result<HashSet<String>, SourceError> {
        let mut seen = HashSet::new();
        for (id, raw) in self.all().await? {
            if self.lock_handling().contains(&id) {
                continue;
            }
            if suspects.contains(&id) {
                tracing::info!(namespace = %self.into.namespace(), queue = %self.into.queue(), id = %id, inflight = %self.hash, "re-parking what another run left unacknowledged");
                self.handle(id, raw).await;
            } else {
                seen.insert(id);
            }
        }
        Ok(seen)
    }

    fn lock_handling(&self) -> MutexGuard<'_, HashSet<String>> {
        // A panic while holding it leaves a plain set behind; keep using it.
        self.handling.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parks one taken element, retrying until it is a record (or provably never can be),
    /// then acknowledges it by removing it from the hash.
    pub async fn handle(&self, id: String, raw: Vec<u8>) {
        self.lock_handling().insert(id.clone());
        self.park_and_ack(&id, raw).await;
        self.lock_handling().remove(&id);
    }

    async fn park_and_ack(&self, id: &str, raw: Vec<u8>) {
        crate::failpoint::hit(self.failpoints.after_take).await;
        let message = format!("{}#{id}", self.identity_prefix);
        let stays = format!("in {}", self.hash);
        let len = raw.len();
        let parked = match (self.read)(self.into.queue(), raw) {
            Element::Whole(req, raw) => {
                let raw = bytes::Bytes::from(raw);
                let req = req.with_message(message);
                self.into.park_message(req, &raw, &stays, || async {}).await
            }
            Element::Apart(req) => {
                let req = req.with_message(message);
                self.into.park_taken_apart(req, &stays).await
            }
        };
        if let Err(e) = parked {
            // Can never be a record (over the payload limit, or refused by the apiserver even
            // as an Invalid record of its bytes): keep it in Redis, moved there by Redis from
            // the hash (its bytes as they were; an element taken apart is no longer whole
            // here), and say so.
            let mut reject = redis::cmd("EVAL");
            reject
                .arg(REJECT)
                .arg(2)
                .arg(&self.hash)
                .arg(&self.rejected);
            if self.ack(reject.arg(id)).await.is_err() {
                return;
            }
            self.into.rejected(&e, len, &self.rejected).await;
        }
        crate::failpoint::hit(self.failpoints.before_ack).await;
        let _ = self.ack(redis::cmd("HDEL").arg(&self.hash).arg(id)).await;
    }

    /// Retries an acknowledgement until Redis takes it: the record exists, so giving up here
    /// leaves the element for the next recovery, which finds its record by its id.
    async fn ack(&self, cmd: &mut redis::Cmd) -> Result<(), ()> {
        for attempt in 0..10u32 {
            match self.conn.query::<redis::Value>(cmd).await {
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

/// Waits for one free parking slot, then takes every other one free at that moment.
pub async fn free_slots(slots: &Arc<Semaphore>) -> Result<Vec<OwnedSemaphorePermit>, SourceError> {
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

/// Bytes of taken elements a source holds at once while it parks them. A slot's worth of
/// large dead messages is otherwise held all at once, each about twice over on its way to the
/// body store (32 slots: 20 envelopes of 10 MiB peaked at 453 MiB, over the 256 MiB the chart
/// allowed then). An element larger than the whole budget is still taken, alone.
pub const BYTES_IN_FLIGHT: u32 = 32 << 20;

/// Parks and acknowledges one taken element in its own task, holding what it `holds` (its
/// slot, its bytes of the budget) until done.
pub fn spawn_handle<H: Send + 'static>(taken: &Arc<Taken>, id: String, raw: Vec<u8>, holds: H) {
    let taken = taken.clone();
    tokio::spawn(async move {
        taken.handle(id, raw).await;
        drop(holds);
    });
}

/// A take script's answer `id, element, id, element, ...` as pairs.
pub fn pairs(
    flat: impl IntoIterator<Item = Vec<u8>>,
) -> Result<Vec<(String, Vec<u8>)>, SourceError> {
    let mut items = flat.into_iter();
    let mut taken = Vec::new();
    while let (Some(id), Some(raw)) = (items.next(), items.next()) {
        let id = String::from_utf8(id)
            .map_err(|e| SourceError::Decode(format!("an inflight id: {e}")))?;
        taken.push((id, raw));
    }
    Ok(taken)
}
