//! Redis source bridge: consumers LPUSH dead jobs onto a list; the bridge BLMOVEs each one onto
//! `<list>:processing`, parks it, and only then LREMs it from there. On start it first re-parks
//! whatever a crash left in `<list>:processing` (parking deduplicates, so that is safe).
//!
//! Elements are JSON envelopes (see README, "Dead-list envelope"). Anything else is parked as an
//! Invalid record holding the exact bytes. An element that cannot be a record at all (over the
//! payload limit) is moved to `<list>:rejected`, never deleted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use kube::{Client, ResourceExt};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use crate::api::{DeadLetterQueue, FailureKind, IntentSnapshot, Job, RedisSource};
use crate::park::{ParkRequest, Parker};
use crate::queue::redis::RedisConn;
use crate::targets::read_secret;

/// Parks in flight at once per bridge.
const CONCURRENCY: usize = 8;

/// The JSON a consumer pushes onto the dead list.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope {
    pub id: String,
    #[serde(default)]
    pub payload: Option<String>,
    #[serde(default)]
    pub payload_base64: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub deliveries: i32,
    #[serde(default)]
    pub failure_kind: Option<FailureKind>,
    #[serde(default)]
    pub intent: Option<IntentSnapshot>,
    #[serde(default)]
    pub service_version: Option<String>,
    #[serde(default)]
    pub failed_at: Option<jiff::Timestamp>,
}

/// Turns one dead-list element into a park request: the envelope's facts, or an Invalid record
/// of the raw bytes when it is not an envelope.
pub fn request_for(queue: &str, raw: &[u8]) -> ParkRequest {
    match serde_json::from_slice::<Envelope>(raw) {
        Ok(env)
            if !env.id.trim().is_empty()
                && (env.payload.is_some() != env.payload_base64.is_some()) =>
        {
            ParkRequest {
                queue: queue.into(),
                job: Job {
                    id: env.id,
                    payload: env.payload,
                    payload_base64: env.payload_base64,
                    headers: env.headers,
                    origin: None,
                },
                intent: env.intent,
                deliveries: env.deliveries,
                reason: env.reason,
                failure_kind: env.failure_kind.unwrap_or(FailureKind::Transient),
                service_version: env.service_version,
                failed_at: env.failed_at,
            }
        }
        Ok(_) => invalid(
            queue,
            raw,
            "envelope needs a non-empty id and exactly one of payload, payloadBase64".into(),
        ),
        Err(e) => invalid(queue, raw, e.to_string()),
    }
}

fn invalid(queue: &str, raw: &[u8], why: String) -> ParkRequest {
    // The id comes from the bytes, so re-parking the same element after a crash deduplicates.
    let id = format!("invalid-{}", hex::encode(&Sha256::digest(raw)[..8]));
    let (payload, payload_base64) = match std::str::from_utf8(raw) {
        Ok(text) => (Some(text.to_string()), None),
        Err(_) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(raw)),
        ),
    };
    let mut req = ParkRequest::new(
        queue,
        Job {
            id,
            payload,
            payload_base64,
            headers: BTreeMap::new(),
            origin: None,
        },
    );
    req.failure_kind = FailureKind::Invalid;
    req.reason = format!("not a dead-letter envelope: {why}");
    req
}

/// Runs one bridge until aborted.
pub async fn run(client: Client, parker: Parker, queue: DeadLetterQueue, source: RedisSource) {
    let ns = queue.namespace().unwrap_or_default();
    let name = queue.name_any();
    super::keep_running("redis", &ns, &name, || {
        run_once(&client, &parker, &ns, &name, &queue, &source)
    })
    .await
}

async fn run_once(
    client: &Client,
    parker: &Parker,
    ns: &str,
    name: &str,
    queue: &DeadLetterQueue,
    source: &RedisSource,
) -> Result<(), String> {
    let secret_ref = source
        .url_secret_ref
        .clone()
        .or_else(|| {
            queue
                .spec
                .target
                .redis
                .as_ref()
                .map(|r| r.url_secret_ref.clone())
        })
        .ok_or("source.redis needs urlSecretRef (the target is not redis)")?;
    let (url, _) = read_secret(client, ns, &secret_ref)
        .await
        .map_err(|e| e.to_string())?;
    // One connection blocks in BLMOVE; the other carries LREM/LPUSH for finished elements.
    let puller = RedisConn::new(&url).map_err(|e| e.to_string())?;
    let acker = Arc::new(RedisConn::new(&url).map_err(|e| e.to_string())?);
    let dead = source.list.clone();
    let processing = format!("{dead}:processing");
    let ctx = Arc::new(Bridge {
        parker: parker.clone(),
        ns: ns.to_string(),
        queue: name.to_string(),
        acker,
        processing: processing.clone(),
        rejected: format!("{dead}:rejected"),
    });

    // Recovery: what a previous run moved but never acknowledged.
    let leftover: Vec<Vec<u8>> = ctx
        .acker
        .query(redis::cmd("LRANGE").arg(&processing).arg(0).arg(-1))
        .await
        .map_err(|e| e.to_string())?;
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
            .map_err(|e| e.to_string())?;
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
            .map_err(|e| e.to_string())?;
        let Some(raw) = raw else { continue };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.handle(raw).await;
            drop(permit);
        });
    }
}

struct Bridge {
    parker: Parker,
    ns: String,
    queue: String,
    acker: Arc<RedisConn>,
    processing: String,
    rejected: String,
}

impl Bridge {
    /// Parks one element, retrying until it is a record (or provably never can be), then
    /// acknowledges it by removing it from the processing list.
    async fn handle(&self, raw: Vec<u8>) {
        let req = request_for(&self.queue, &raw);
        let mut attempt = 0u32;
        loop {
            let outcome = self.parker.park(&self.ns, req.clone()).await;
            match outcome {
                Ok(_) => break,
                Err(e) if e.is_transient() => {
                    // Transient: the element stays in the processing list while we wait.
                    attempt = attempt.saturating_add(1);
                    let wait = crate::decide::backoff(attempt, Duration::from_secs(30));
                    tracing::warn!(namespace = %self.ns, queue = %self.queue, error = %e, retry_in = ?wait, "parking a dead element failed; it stays in {}", self.processing);
                    tokio::time::sleep(wait).await;
                }
                Err(e) => {
                    // Can never be a record (e.g. over the payload limit): keep it in Redis.
                    tracing::error!(namespace = %self.ns, queue = %self.queue, error = %e, "dead element cannot be parked; moved to {}", self.rejected);
                    if self
                        .ack(redis::cmd("LPUSH").arg(&self.rejected).arg(&raw[..]))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    break;
                }
            }
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
                    tokio::time::sleep(crate::decide::backoff(attempt, Duration::from_secs(5)))
                        .await;
                }
            }
        }
        Err(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_become_requests() {
        let raw = br#"{"id":"pi_0001/settle","payload":"{\"a\":1}","reason":"gave up","deliveries":3,
            "failureKind":"Transient","intent":{"id":"pi_0001","state":"failed"},"headers":{"x-trace":"t"},
            "serviceVersion":"relayer@1.4.2","failedAt":"2026-11-29T10:00:00Z"}"#;
        let r = request_for("relayer", raw);
        assert_eq!(r.job.id, "pi_0001/settle");
        assert_eq!(r.job.payload.as_deref(), Some("{\"a\":1}"));
        assert_eq!(r.deliveries, 3);
        assert_eq!(r.failure_kind, FailureKind::Transient);
        assert_eq!(r.intent.unwrap().state, "failed");
        assert_eq!(r.job.headers["x-trace"], "t");
        assert!(r.failed_at.is_some());
    }

    #[test]
    fn anything_else_is_invalid_with_its_exact_bytes() {
        for raw in [
            &b"not json"[..],
            b"\xff\x00garbage",
            br#"{"id":"x"}"#,
            br#"{"id":"","payload":"p"}"#,
        ] {
            let r = request_for("relayer", raw);
            assert_eq!(r.failure_kind, FailureKind::Invalid, "{raw:?}");
            assert_eq!(r.job.payload_bytes().unwrap(), raw, "exact bytes kept");
            assert!(r.job.id.starts_with("invalid-"));
            assert!(r.reason.starts_with("not a dead-letter envelope"));
            assert_eq!(
                request_for("relayer", raw).job.id,
                r.job.id,
                "same bytes, same id"
            );
        }
    }
}
