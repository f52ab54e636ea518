//! The dead-list envelope: the JSON object a consumer pushes onto a dead list (see
//! docs/backends.md, "Source: the dead-list envelope"), and how one element becomes a park
//! request.
//!
//! Only a JSON object with known fields is an envelope: serde would otherwise read a JSON array
//! as the fields in order (`["an","array"]` as job `an` with payload `array`), and a typo such
//! as `paylod` would park a record without its payload. Anything else is parked as an Invalid
//! record of the element's exact bytes.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::dead_letter::{FailureKind, IntentSnapshot, Job};
use crate::json::{self, NotObject};
use crate::park::{ParkRequest, invalid_request, json_error_without_values};

/// The members of [`Envelope`], as its JSON names them.
const FIELDS: &[&str] = &[
    "id",
    "payload",
    "payloadBase64",
    "headers",
    "reason",
    "deliveries",
    "failureKind",
    "intent",
    "serviceVersion",
    "errorClass",
    "failedAt",
];

/// The JSON a consumer pushes onto the dead list.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
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
    /// The error's kind (an exception class): part of the record's failure group.
    #[serde(default)]
    pub error_class: Option<String>,
    #[serde(default)]
    pub failed_at: Option<jiff::Timestamp>,
}

/// Turns one dead-list element into a park request: the envelope's facts, or an Invalid record
/// of the raw bytes when it is not an envelope.
pub fn request_for(queue: &str, raw: &[u8]) -> ParkRequest {
    // Only the envelope's own members are read into values (`crate::json`); any other is seen
    // by name, so it is still refused as unknown.
    let members = match json::members(raw) {
        Ok(members) => members,
        Err(NotObject::Syntax(e)) => return not_json(queue, raw, &e),
        Err(NotObject::Shape(shape)) => {
            return invalid(queue, raw, format!("{shape}, not an object"));
        }
    };
    let value = match json::object(&members, FIELDS, true) {
        Ok(value) => value,
        Err(too_large) => return invalid(queue, raw, too_large.to_string()),
    };
    match serde_json::from_value::<Envelope>(value) {
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
                    payload_null: false,
                    headers: env.headers,
                    origin: None,
                    body: None,
                    sealed: None,
                },
                intent: env.intent,
                deliveries: env.deliveries,
                reason: env.reason,
                failure_kind: env.failure_kind.unwrap_or(FailureKind::Transient),
                service_version: env.service_version,
                error_class: env.error_class,
                failed_at: env.failed_at,
                message: None,
                redelivered: false,
                sealed_reason: None,
                own_death: false,
                payload_in_message: false,
            }
        }
        Ok(_) => invalid(
            queue,
            raw,
            "envelope needs a non-empty id and exactly one of payload, payloadBase64".into(),
        ),
        Err(e) => not_json(queue, raw, &e),
    }
}

fn invalid(queue: &str, raw: &[u8], why: String) -> ParkRequest {
    invalid_request(queue, raw, format!("not a dead-letter envelope: {why}"))
}

/// An Invalid record for a parse error: serde's words quote the offending value, so a sealed
/// queue's record says what was wrong without it.
fn not_json(queue: &str, raw: &[u8], e: &serde_json::Error) -> ParkRequest {
    let mut req = invalid(queue, raw, e.to_string());
    req.sealed_reason = Some(format!(
        "not a dead-letter envelope: {}",
        json_error_without_values(e)
    ));
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

    /// A card number where a header value (a string) belongs: serde's words quote it, so the
    /// reason a sealed queue keeps says what was wrong without it.
    #[test]
    fn a_parse_error_is_described_without_the_value_for_a_sealed_queue() {
        let raw = br#"{"id":"j","payload":"p","headers":{"x-card":4242424242424242}}"#;
        let r = request_for("relayer", raw);
        assert_eq!(r.failure_kind, FailureKind::Invalid);
        let sealed = r.sealed_reason.as_deref().unwrap_or_default();
        assert_eq!(
            sealed,
            "not a dead-letter envelope: a value of the wrong type (expected a string)"
        );
        assert!(r.reason.contains("4242424242424242"), "{}", r.reason);
        for raw in [
            &br#"{"id":"j","payload":"p","x4242424242424242":1}"#[..],
            br#"{"id":"j","payload":"p","failedAt":"4242424242424242"}"#,
            br#"{"id":"j","payload":"p","failureKind":"4242424242424242"}"#,
            br#"{"id":"j","payload":"p","deliveries":"4242424242424242"}"#,
            br#"{"id":4242424242424242}"#,
            b"{\"id\":\"4242424242424242\" x}",
        ] {
            let r = request_for("relayer", raw);
            let sealed = r.sealed_reason.unwrap_or(r.reason);
            assert!(!sealed.contains("4242"), "{sealed}");
            assert!(
                sealed.starts_with("not a dead-letter envelope: "),
                "{sealed}"
            );
        }
    }

    #[test]
    fn anything_else_is_invalid_with_its_exact_bytes() {
        for raw in [
            &b"not json"[..],
            b"\xff\x00garbage",
            br#"{"id":"x"}"#,
            br#"{"id":"","payload":"p"}"#,
            br#"["an","array"]"#,
            br#""a string""#,
            br#"42"#,
            br#"{"id":"t","paylod":"typo"}"#,
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

#[cfg(test)]
mod dispositions {
    use super::request_for;
    use crate::dead_letter::FailureKind;
    use crate::park::{Disposition, dispose};

    /// Well-formed envelopes that fail validation still fit in a record: Invalid, exact bytes.
    #[test]
    fn envelopes_that_fail_validation_become_invalid_records_of_their_bytes() {
        let long_id = format!(r#"{{"id":"{}","payload":"x"}}"#, "i".repeat(300));
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                br#"{"id":"e5","payload":"x","headers":{"bad name":"v"}}"#.to_vec(),
                "invalid header name",
            ),
            (
                br#"{"id":"e6","payload":"x","headers":{"x":"a\r\nb"}}"#.to_vec(),
                "CR, LF or NUL",
            ),
            (
                br#"{"id":"e7","payload":"x","deliveries":-5}"#.to_vec(),
                "deliveries must be >= 0",
            ),
            (long_id.into_bytes(), "job id is 300 bytes"),
            (
                br#"{"id":"e9","payloadBase64":"!!!"}"#.to_vec(),
                "not valid base64",
            ),
        ];
        for (raw, why) in cases {
            let Disposition::Park(r) = dispose(request_for("relayer", &raw), &raw) else {
                panic!("{why}: fits in a record");
            };
            assert_eq!(r.failure_kind, FailureKind::Invalid, "{why}");
            assert_eq!(
                r.job.payload_bytes().expect("bytes"),
                raw,
                "{why}: exact bytes"
            );
            assert!(r.reason.contains(why), "{why} not in {:?}", r.reason);
        }
    }
}
