//! NATS source bridge: parks the messages a JetStream consumer gave up on.
//!
//! JetStream announces each one with a `MAX_DELIVERIES` advisory on
//! `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`. Advisories are plain
//! fire-and-forget NATS messages: one published while the operator is down would be lost. So
//! the bridge first makes sure a small work-queue stream (`DLQ_ADV_<stream>_<consumer>_<hash>`)
//! captures that subject, and reads it with a durable pull consumer. For each advisory it
//! fetches the dead message by stream sequence, parks it (headers, payload, delivery count,
//! origin stream/subject/sequence), deletes it from the stream when `onParked` is `delete`, and
//! only then acks the advisory.
//!
//! Crash safety: a crash at any point leaves the advisory unacked, so it is delivered again
//! (after the ack wait) and the whole step repeats; parking dedupes (same job id) and deleting
//! an already deleted message counts as done. A message whose advisory arrives after it left
//! the stream (deleted, or aged out) is skipped with a log line. Advisories published before
//! the bridge first created its advisory stream are not recovered.
//!
//! The job id is the message's `Nats-Msg-Id`, so a job that dies again after a redrive is the
//! next cycle of the same job; without one it is `nats-<stream>-<sequence>`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use futures::StreamExt;
use kube::Client;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use async_nats::jetstream::{self, AckKind};

use dlq_client::park::ParkRequest;
use dlq_core::api::{self, DeadLetterQueue, FailureKind, Job, NatsSourceSpec, OnParked, Origin};

use super::park_into::{ParkInto, SourceError, keep_running};
use crate::broker::backend::Sides;
use crate::broker::nats::{NatsConn, carried_headers, parse_header_block};
use crate::secret::SecretReads;

/// Advisories handled at once.
const CONCURRENCY: usize = 16;
/// JetStream's error code for "no message found".
const NO_MESSAGE_FOUND: u64 = 10037;
/// How long an advisory may stay unacked before JetStream hands it out again.
const ACK_WAIT: Duration = Duration::from_secs(15);
/// The durable consumer of the advisory stream.
const DURABLE: &str = "deadletter-operator";

/// The advisory JetStream publishes when a message exceeds its consumer's MaxDeliver.
#[derive(Debug, Clone, Deserialize)]
pub struct Advisory {
    /// The advisory's kind (`io.nats.jetstream.advisory.v1.max_deliver`): the record's error
    /// class.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    pub stream: String,
    pub consumer: String,
    pub stream_seq: u64,
    pub deliveries: u64,
    #[serde(default)]
    pub timestamp: Option<String>,
}

/// The kind of the MAX_DELIVERIES advisory, for one that does not say.
pub const MAX_DELIVER_ADVISORY: &str = "io.nats.jetstream.advisory.v1.max_deliver";

pub fn advisory_subject(stream: &str, consumer: &str) -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}")
}

/// A valid stream name for the advisory capture of one stream/consumer pair.
pub fn advisory_stream(stream: &str, consumer: &str) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(60)
            .collect()
    };
    let hash = hex::encode(&Sha256::digest(format!("{stream}/{consumer}").as_bytes())[..4]);
    format!("DLQ_ADV_{}_{}_{hash}", clean(stream), clean(consumer))
}

/// A message as the stream stores it (`STREAM.MSG.GET`). Read through the raw API because
/// async-nats's own decoding keeps only the last value of a repeated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub subject: String,
    pub sequence: u64,
    pub headers: BTreeMap<String, Vec<String>>,
    pub payload: bytes::Bytes,
}

/// Decodes a `STREAM.MSG.GET` answer: the message, None when there is no such message, or the
/// error.
pub fn decode_stored(answer: &serde_json::Value) -> Result<Option<Stored>, String> {
    if let Some(err) = answer.get("error") {
        if err.get("err_code").and_then(|c| c.as_u64()) == Some(NO_MESSAGE_FOUND) {
            return Ok(None);
        }
        return Err(format!(
            "JetStream: {}",
            err.get("description")
                .and_then(|d| d.as_str())
                .unwrap_or("error")
        ));
    }
    let m = answer.get("message").ok_or("answer has no message")?;
    let b64 = |k: &str| -> Result<Vec<u8>, String> {
        match m.get(k).and_then(|v| v.as_str()) {
            Some(text) => base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| format!("{k}: {e}")),
            None => Ok(Vec::new()),
        }
    };
    let hdrs = b64("hdrs")?;
    let headers = if hdrs.is_empty() {
        BTreeMap::new()
    } else {
        parse_header_block(&hdrs)?
    };
    Ok(Some(Stored {
        subject: m
            .get("subject")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string(),
        sequence: m.get("seq").and_then(|v| v.as_u64()).unwrap_or_default(),
        headers,
        payload: b64("data")?.into(),
    }))
}

/// Turns the dead message of one advisory into a park request.
pub fn request_for(queue: &str, adv: &Advisory, msg: &Stored) -> ParkRequest {
    let (headers, lost) = carried_headers(&msg.headers);
    let msg_id = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("nats-msg-id"))
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty() && v.len() <= api::MAX_JOB_ID_LEN);
    let id = msg_id.unwrap_or_else(|| format!("nats-{}-{}", adv.stream, adv.stream_seq));
    let mut req = ParkRequest::of_message(
        queue,
        Job {
            id,
            headers,
            origin: Some(Box::new(Origin {
                stream: Some(adv.stream.clone()),
                subject: Some(msg.subject.clone()),
                sequence: i64::try_from(adv.stream_seq).ok(),
                ..Origin::default()
            })),
            ..Job::default()
        },
        &msg.payload,
    )
    // The work stream's sequence: a redriven job dying again is a new message there.
    .with_message(format!("nats:{}/{}", adv.stream, adv.stream_seq));
    req.deliveries = i32::try_from(adv.deliveries).unwrap_or(i32::MAX);
    req.error_class = Some(
        adv.kind
            .as_deref()
            .and_then(dlq_core::group::bounded_error_class)
            .unwrap_or_else(|| MAX_DELIVER_ADVISORY.to_string()),
    );
    req.reason = format!(
        "JetStream consumer {} gave up after {} deliveries (MaxDeliver); stream {} sequence {}, subject {}",
        adv.consumer, adv.deliveries, adv.stream, adv.stream_seq, msg.subject
    );
    req.failed_at = adv
        .timestamp
        .as_deref()
        .and_then(|t| t.parse::<jiff::Timestamp>().ok());
    if !lost.is_empty() {
        req.failure_kind = FailureKind::Invalid;
        req.reason = format!(
            "headers beyond what a record holds were left out ({}): {}",
            lost.join(", "),
            req.reason
        );
    }
    req
}

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: NatsSourceSpec) {
    keep_running("nats", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &NatsSourceSpec,
) -> Result<(), SourceError> {
    let (ns, name) = (into.namespace(), into.queue());
    let mut secrets = SecretReads::new(client, ns);
    let url = crate::broker::nats::source_url(&mut secrets, Sides::of(source, &queue.spec)).await?;
    let nats = NatsConn::new(&url)
        .map_err(SourceError::broker("NATS"))?
        .get()
        .await
        .map_err(SourceError::broker("NATS"))?;
    let js = jetstream::new(nats);
    js.get_stream(&source.stream)
        .await
        .map_err(SourceError::broker(format!("stream {}", source.stream)))?;
    let capture = advisory_stream(&source.stream, &source.consumer);
    let advisories = js
        .get_or_create_stream(jetstream::stream::Config {
            name: capture.clone(),
            subjects: vec![advisory_subject(&source.stream, &source.consumer)],
            retention: jetstream::stream::RetentionPolicy::WorkQueue,
            storage: jetstream::stream::StorageType::File,
            description: Some(format!(
                "deadletter-operator: MAX_DELIVERIES advisories of {}/{}, kept until parked",
                source.stream, source.consumer
            )),
            ..Default::default()
        })
        .await
        .map_err(SourceError::broker(format!("advisory stream {capture}")))?;
    let consumer = advisories
        .get_or_create_consumer(
            DURABLE,
            jetstream::consumer::pull::Config {
                durable_name: Some(DURABLE.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                max_ack_pending: CONCURRENCY as i64 * 4,
                ..Default::default()
            },
        )
        .await
        .map_err(SourceError::broker(format!(
            "advisory consumer on {capture}"
        )))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(SourceError::broker(format!("reading {capture}")))?;
    tracing::info!(namespace = %ns, queue = %name, stream = %source.stream, consumer = %source.consumer, capture = %capture, "nats source bridge reading advisories");
    let ctx = Arc::new(Bridge {
        into: into.clone(),
        js: js.clone(),
        stream: source.stream.clone(),
        on_parked: source.on_parked.unwrap_or_default(),
    });
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    while let Some(m) = messages.next().await {
        let m = m.map_err(SourceError::broker(format!("reading {capture}")))?;
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .map_err(SourceError::broker("NATS"))?;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.handle(m).await;
            drop(permit);
        });
    }
    Ok(())
}

struct Bridge {
    into: ParkInto,
    js: jetstream::Context,
    stream: String,
    on_parked: OnParked,
}

impl Bridge {
    async fn handle(&self, m: jetstream::Message) {
        let adv: Advisory = match serde_json::from_slice(&m.message.payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(namespace = %self.into.namespace(), queue = %self.into.queue(), error = %e, "ignoring an advisory that is not a MAX_DELIVERIES advisory");
                let _ = m.ack().await;
                return;
            }
        };
        let seq = adv.stream_seq;
        let Some(msg) = self.fetch(&m, seq).await else {
            let _ = m.ack().await;
            return;
        };
        let req = request_for(self.into.queue(), &adv, &msg);
        let job = req.job.id.clone();
        let parked = self
            .into
            .park_message(req, &msg.payload, "in the stream", || async {
                let _ = m.ack_with(AckKind::Progress).await;
            })
            .await;
        if let Err(e) = &parked {
            let kept_in = format!("stream {} sequence {seq}", self.stream);
            tracing::debug!(job = %job, "dead message left in the stream");
            self.into.rejected(e, msg.payload.len(), &kept_in).await;
        }
        let parked = parked.is_ok();
        if parked && self.on_parked == OnParked::Delete {
            self.delete(&m, seq).await;
        }
        crate::failpoint::hit("nats-before-advisory-ack").await;
        if let Err(e) = m.ack().await {
            tracing::warn!(namespace = %self.into.namespace(), queue = %self.into.queue(), job = %job, seq, error = %e, "acking an advisory failed; it comes back and dedupes");
        }
    }

    async fn get_stored(&self, seq: u64) -> Result<Option<Stored>, SourceError> {
        let answer: serde_json::Value = self
            .js
            .request(
                format!("STREAM.MSG.GET.{}", self.stream),
                &serde_json::json!({ "seq": seq }),
            )
            .await
            .map_err(SourceError::broker(format!("reading message {seq}")))?;
        decode_stored(&answer).map_err(SourceError::Decode)
    }

    /// The dead message, or None when it already left the stream.
    async fn fetch(&self, m: &jetstream::Message, seq: u64) -> Option<Stored> {
        let mut attempt = 0u32;
        loop {
            match self.get_stored(seq).await {
                Ok(Some(msg)) => return Some(msg),
                Ok(None) => {
                    tracing::info!(namespace = %self.into.namespace(), queue = %self.into.queue(), seq, "dead message is no longer in the stream (parked and deleted earlier, or aged out)");
                    return None;
                }
                Err(e) => {
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, Duration::from_secs(10));
                    tracing::warn!(namespace = %self.into.namespace(), queue = %self.into.queue(), seq, error = %e, retry_in = ?wait, "fetching a dead message failed");
                    let _ = m.ack_with(AckKind::Progress).await;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Deletes the parked message; one that is already gone counts as deleted.
    async fn delete(&self, m: &jetstream::Message, seq: u64) {
        for attempt in 0..5u32 {
            let answer: Result<serde_json::Value, _> = self
                .js
                .request(
                    format!("STREAM.MSG.DELETE.{}", self.stream),
                    &serde_json::json!({ "seq": seq }),
                )
                .await;
            let error = match answer {
                Ok(a) if a.get("success").and_then(|v| v.as_bool()) == Some(true) => return,
                Ok(a) => a
                    .get("error")
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| a.to_string()),
                Err(e) => e.to_string(),
            };
            if let Ok(None) = self.get_stored(seq).await {
                return;
            }
            tracing::warn!(namespace = %self.into.namespace(), queue = %self.into.queue(), seq, error = %error, "deleting a parked message from the stream failed");
            let _ = m.ack_with(AckKind::Progress).await;
            tokio::time::sleep(dlq_core::decide::backoff(attempt, Duration::from_secs(5))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_names_are_valid_and_distinct() {
        assert_eq!(
            advisory_subject("JOBS", "worker"),
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.JOBS.worker"
        );
        let a = advisory_stream("a_b", "c");
        let b = advisory_stream("a", "b_c");
        assert_ne!(a, b);
        assert!(a.starts_with("DLQ_ADV_a_b_c_"));
        assert!(!a.contains(['.', '*', '>', ' ']));
    }

    #[test]
    fn stored_messages_decode_with_every_header_value() {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let answer = serde_json::json!({"message": {
            "subject": "jobs.a", "seq": 9, "time": "2026-11-29T10:00:00Z",
            "hdrs": b64(b"NATS/1.0\r\nNats-Msg-Id: m9\r\nx-tag: a\r\nx-tag: b\r\n\r\n"),
            "data": b64(b"\xffpayload"),
        }});
        let m = decode_stored(&answer).unwrap().unwrap();
        assert_eq!(m.subject, "jobs.a");
        assert_eq!(m.headers["x-tag"], ["a", "b"]);
        assert_eq!(&m.payload[..], b"\xffpayload");
        let adv = Advisory {
            kind: None,
            stream: "JOBS".into(),
            consumer: "worker".into(),
            stream_seq: 9,
            deliveries: 4,
            timestamp: None,
        };
        let r = request_for("relayer", &adv, &m);
        assert_eq!(r.job.id, "m9");
        assert_eq!(r.deliveries, 4);
        assert_eq!(r.job.payload_bytes().unwrap(), b"\xffpayload");
        assert_eq!(r.job.origin.unwrap().sequence, Some(9));
        assert_eq!(r.error_class.as_deref(), Some(MAX_DELIVER_ADVISORY));
        let gone = serde_json::json!({"error": {"code": 404, "err_code": 10037, "description": "no message found"}});
        assert_eq!(decode_stored(&gone), Ok(None));
    }

    #[test]
    fn advisories_parse() {
        let raw = br#"{"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"x","timestamp":"2026-11-29T10:00:00.123456789Z","stream":"JOBS","consumer":"worker","stream_seq":42,"deliveries":3}"#;
        let a: Advisory = serde_json::from_slice(raw).unwrap();
        assert_eq!((a.stream_seq, a.deliveries), (42, 3));
        assert_eq!(a.kind.as_deref(), Some(MAX_DELIVER_ADVISORY));
        assert!(a.timestamp.unwrap().parse::<jiff::Timestamp>().is_ok());
    }
}
