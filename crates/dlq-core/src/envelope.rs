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

use crate::dead_letter::{FailureKind, IntentSnapshot, Job, MAX_PAYLOAD_BYTES};
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
        Ok(env) => request_of(queue, env).unwrap_or_else(|why| invalid(queue, raw, why.into())),
        Err(e) => not_json(queue, raw, &e),
    }
}

/// The request an envelope names, or why it names none.
fn request_of(queue: &str, env: Envelope) -> Result<ParkRequest, &'static str> {
    if env.id.trim().is_empty() || env.payload.is_some() == env.payload_base64.is_some() {
        return Err("envelope needs a non-empty id and exactly one of payload, payloadBase64");
    }
    Ok(ParkRequest {
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
        least_cycle: None,
    })
}

/// An element whose payload is too large for a record, taken apart in its own buffer: its
/// payload string decoded in place and the buffer made the job's payload (`payloadBase64`
/// still as base64, decoded in place on its way to the store), so the element and its payload
/// are never held at once. `Err` gives the element back untouched when it is not such an
/// element, or when, its payload aside, it is not a valid request: [`request_for`] reads it
/// then, and an Invalid record of it keeps its exact bytes as before. Once taken apart the
/// exact bytes are only in the source's own copy (Redis's inflight hash).
pub fn take_apart(queue: &str, mut raw: Vec<u8>) -> Result<ParkRequest, Vec<u8>> {
    // No payload of a shorter element is longer than a record holds: not parsed twice.
    if raw.len() <= MAX_PAYLOAD_BYTES {
        return Err(raw);
    }
    let Some((mut req, text)) = apart(queue, &raw) else {
        return Err(raw);
    };
    match json::unescape_in_place(&mut raw, text.clone(), false) {
        Some(len) if len > MAX_PAYLOAD_BYTES => {}
        _ => return Err(raw),
    }
    let len = json::unescape_in_place(&mut raw, text.clone(), true).unwrap_or(0);
    raw.copy_within(text.start..text.start + len, 0);
    raw.truncate(len);
    // Decoded from JSON text, which is UTF-8, by escapes that stand for characters: UTF-8.
    let payload = String::from_utf8(raw)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    if req.job.payload.is_some() {
        req.job.payload = Some(payload);
    } else {
        req.job.payload_base64 = Some(payload);
    }
    Ok(req)
}

/// The request of element `raw` with an empty payload, valid as it is, and where in `raw` its
/// payload's JSON string is (longer than a record holds); `None` for any other element.
fn apart(queue: &str, raw: &[u8]) -> Option<(ParkRequest, std::ops::Range<usize>)> {
    let mut members = json::members(raw).ok()?;
    let name = match (
        members.contains_key("payload"),
        members.contains_key("payloadBase64"),
    ) {
        (true, false) => "payload",
        (false, true) => "payloadBase64",
        _ => return None,
    };
    let text = members.remove(name)?.get();
    if text.len() <= MAX_PAYLOAD_BYTES || !text.starts_with('"') {
        return None;
    }
    let start = (text.as_ptr() as usize).checked_sub(raw.as_ptr() as usize)?;
    let mut value = json::object(&members, FIELDS, true).ok()?;
    if let serde_json::Value::Object(object) = &mut value {
        object.insert(name.into(), serde_json::Value::String(String::new()));
    }
    let req = request_of(queue, serde_json::from_value::<Envelope>(value).ok()?).ok()?;
    crate::park::validate(&req).ok()?;
    Some((req, start..start + text.len()))
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
    use super::{request_for, take_apart};
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

    /// An element whose payload is larger than a record holds is taken apart in its own
    /// buffer into the very request `request_for` reads from it. Any other element comes back
    /// untouched: a small payload, one that decodes to no more than a record holds, one that
    /// does not decode, and one whose other members are not a valid request (its Invalid
    /// record keeps its exact bytes).
    #[test]
    fn a_large_payload_is_taken_apart_in_its_own_buffer() {
        let big = "{\\\"a\\\":\\\"\\u00e9\\ud83d\\ude00\\\"}\\n".repeat(20_000);
        let b64 = "QUJD".repeat(70_000);
        let taken = [
            format!(r#"{{"id":"j1","payload":"{big}","reason":"r","headers":{{"h":"v"}}}}"#),
            format!(r#"{{"payloadBase64":"{b64}","id":"j2","deliveries":2}}"#),
        ];
        for raw in taken {
            let want = request_for("relayer", raw.as_bytes());
            assert_eq!(want.failure_kind, FailureKind::Transient);
            let got = take_apart("relayer", raw.into_bytes()).expect("taken apart");
            assert!(got == want, "the request request_for reads");
        }
        let untouched = [
            r#"{"id":"j3","payload":"small"}"#.to_string(),
            format!(r#"{{"id":"j4","payload":"{}"}}"#, "\\u0041".repeat(50_000)),
            format!(r#"{{"id":"j5","payload":"{}\ud83d"}}"#, "x".repeat(300_000)),
            format!(r#"{{"id":"","payload":"{big}"}}"#),
            format!(r#"{{"id":"j7","payload":"{big}","deliveries":-1}}"#),
            format!(r#"{{"id":"j8","payload":"{big}","paylod":"typo"}}"#),
            format!(r#"{{"id":"{}","payload":"{big}"}}"#, "i".repeat(300)),
            format!(r#"{{"id":"j9","payload":"{big}","payloadBase64":"{b64}"}}"#),
            format!(r#"["j10","{big}"]"#),
        ];
        for raw in untouched {
            let back = take_apart("relayer", raw.clone().into_bytes());
            let got = back.as_ref().map(|r| r.job.id.clone()).map_err(|b| b.len());
            assert!(
                back == Err(raw.clone().into_bytes()),
                "{}: {got:?}",
                &raw[..20]
            );
        }
    }
}
