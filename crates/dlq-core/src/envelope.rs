//! The dead-list envelope: the JSON a consumer pushes onto a dead list (see README,
//! "Dead-list envelope"), and how one element becomes a park request.

use std::collections::BTreeMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::api::{FailureKind, IntentSnapshot, Job};
use crate::park::ParkRequest;

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
    let mut req = ParkRequest::new(queue, Job::from_bytes(id, raw));
    req.failure_kind = FailureKind::Invalid;
    req.reason = format!("not a dead-letter envelope: {why}");
    req
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
