//! Redis source bridge: consumers LPUSH dead jobs onto a list; the bridge BLMOVEs each one onto
//! `<list>:processing`, parks it, and only then LREMs it from there. On start it first re-parks
//! whatever a crash left in `<list>:processing` (parking deduplicates, so that is safe).
//!
//! Elements are JSON envelopes (see README, "Dead-list envelope"). Anything else, and any
//! envelope that fails validation, is parked as an Invalid record holding the exact bytes. An
//! element that cannot be a record at all (over the payload limit) is moved to
//! `<list>:rejected`, never deleted, and counted and announced.

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio::sync::Semaphore;

use dlq_core::api::{DeadLetterQueue, RedisSourceSpec};
use dlq_core::envelope::request_for;

use super::{ParkInto, SourceError};
use crate::target::redis::RedisConn;

/// Parks in flight at once per bridge (as for NATS and SQS): parkings waiting together share
/// one reservation under maxParked, so more in flight means fewer queue writes per record.
const CONCURRENCY: usize = 16;

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
    // One connection blocks in BLMOVE; the other carries LREM/LPUSH for finished elements.
    let puller = RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?;
    let acker = Arc::new(RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?);
    let dead = source.list.clone();
    let processing = format!("{dead}:processing");
    let ctx = Arc::new(Bridge {
        into: into.clone(),
        acker,
        processing: processing.clone(),
        rejected: format!("{dead}:rejected"),
    });

    // Recovery: what a previous run moved but never acknowledged.
    let leftover: Vec<Vec<u8>> = ctx
        .acker
        .query(redis::cmd("LRANGE").arg(&processing).arg(0).arg(-1))
        .await
        .map_err(SourceError::broker(format!("reading {processing}")))?;
    if !leftover.is_empty() {
        tracing::info!(namespace = %ns, queue = %name, count = leftover.len(), "re-parking elements left in {processing}");
    }
    for raw in leftover {
        ctx.handle(raw).await;
    }

    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .map_err(SourceError::broker("waiting for a parking slot"))?;
        let raw: Option<Vec<u8>> = puller
            .query(
                redis::cmd("BLMOVE")
                    .arg(&dead)
                    .arg(&processing)
                    .arg("RIGHT")
                    .arg("LEFT")
                    .arg(1),
            )
            .await
            .map_err(SourceError::broker(format!("BLMOVE from {dead}")))?;
        let Some(raw) = raw else { continue };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.handle(raw).await;
            drop(permit);
        });
    }
}

struct Bridge {
    into: ParkInto,
    acker: Arc<RedisConn>,
    processing: String,
    rejected: String,
}

impl Bridge {
    /// Parks one element, retrying until it is a record (or provably never can be), then
    /// acknowledges it by removing it from the processing list.
    async fn handle(&self, raw: Vec<u8>) {
        let parked = match self
            .into
            .dispose(request_for(self.into.queue(), &raw), &raw)
        {
            Ok(req) => {
                let stays = format!("in {}", self.processing);
                self.into
                    .park_until_settled(&req, &stays, || async {})
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = parked {
            // Can never be a record (over the payload limit): keep it in Redis, and say so.
            if self
                .ack(redis::cmd("LPUSH").arg(&self.rejected).arg(&raw[..]))
                .await
                .is_err()
            {
                return;
            }
            self.into.rejected(&e, raw.len(), &self.rejected).await;
        }
        let _ = self
            .ack(
                redis::cmd("LREM")
                    .arg(&self.processing)
                    .arg(1)
                    .arg(&raw[..]),
            )
            .await;
    }

    /// Retries an acknowledgement until Redis takes it: the record exists, so giving up here
    /// would only leave a duplicate for the next recovery (deduplicated), never a loss.
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
