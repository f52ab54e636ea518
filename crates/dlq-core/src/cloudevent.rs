//! CloudEvents 1.0 over HTTP as park requests, without I/O: what the operator's park endpoint
//! (and anything else that receives a POST) makes of one request.
//!
//! The job is the event as it arrived, so a redrive through the `http` target rebuilds the
//! same event: in binary mode the body is the payload and the `ce-*` headers (with
//! `content-type`) are the job's headers; in structured mode the JSON document is the payload
//! and `content-type: application/cloudevents+json` its one header; a batch is split into
//! structured events. A plain body (no CloudEvent) keeps its headers but those HTTP or the
//! endpoint own.
//!
//! `id` + `source` name the event (the job id and the message identity), so a retried POST of
//! a parked event answers with the same record. Knative's dead-letter attributes
//! (`knativeerrorcode`, `knativeerrordata`, `knativeerrordest`) make the reason and error class;
//! they stay on the event.

use std::collections::BTreeMap;

use base64::Engine;
use sha2::{Digest, Sha256};

use crate::dead_letter::{self, FailureKind, Job};
use crate::park::{ParkRequest, invalid_request};

/// Content type of a structured-mode event.
pub const STRUCTURED: &str = "application/cloudevents+json";
/// Content type of a batch of structured events.
pub const BATCH: &str = "application/cloudevents-batch+json";
/// Most events in one batch: each becomes its own record, parked one after the other.
pub const MAX_BATCH: usize = 100;
/// Largest body read: a record's payload limit, plus room for a batch's framing.
pub const MAX_BODY: usize = dead_letter::MAX_PAYLOAD_BYTES + 4096;

/// Headers HTTP manages itself (framing, the connection): a request's own, never a job's.
/// The park endpoint does not keep them and the `http` target cannot send a job carrying them.
pub const HTTP_MANAGED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

/// Request headers a plain (non-CloudEvent) body does not keep beside [`HTTP_MANAGED`]: the
/// caller's credentials, its client's preferences, and the endpoint's `x-dlq-*` controls.
const NOT_KEPT: &[&str] = &[
    "expect",
    "proxy-authorization",
    "authorization",
    "cookie",
    "accept",
    "accept-encoding",
    "accept-language",
    "user-agent",
];

/// Controls a plain body's sender may set (CloudEvents carry theirs as attributes).
pub const HEADER_JOB_ID: &str = "x-dlq-job-id";
pub const HEADER_REASON: &str = "x-dlq-reason";
pub const HEADER_DELIVERIES: &str = "x-dlq-deliveries";
pub const HEADER_FAILURE_KIND: &str = "x-dlq-failure-kind";
pub const HEADER_ERROR_CLASS: &str = "x-dlq-error-class";

/// Why a request is not parked at all. Everything else becomes a record (an Invalid one of the
/// exact bytes when it is not what it claims to be).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CeError {
    #[error("only POST parks")]
    MethodNotAllowed,
    #[error("the body is over {limit} bytes")]
    TooLarge { limit: usize },
    #[error("content-encoding {0:?} is not accepted; send the body as it is")]
    Encoded(String),
    #[error("a batch holds {count} events; at most {max}")]
    BatchTooLong { count: usize, max: usize },
    #[error("an empty batch parks nothing")]
    EmptyBatch,
    #[error("{0}")]
    Unparkable(String),
    #[error(
        "header {0:?} is not ASCII text, and a record keeps headers as text: refused rather than parked without it (CloudEvents' HTTP binding percent-encodes other characters)"
    )]
    UnreadableHeader(String),
}

impl CeError {
    /// The HTTP status a sender can act on.
    pub fn status(&self) -> u16 {
        match self {
            CeError::MethodNotAllowed => 405,
            CeError::TooLarge { .. } => 413,
            CeError::Encoded(_) => 415,
            CeError::BatchTooLong { .. }
            | CeError::EmptyBatch
            | CeError::Unparkable(_)
            | CeError::UnreadableHeader(_) => 400,
        }
    }
}

/// One POST as received: lower-case header names (repeated headers joined with ", ").
#[derive(Debug, Clone, Default)]
pub struct HttpRequest<'a> {
    pub method: &'a str,
    pub headers: BTreeMap<String, String>,
    /// Shared by the events read from it, not copied.
    pub body: bytes::Bytes,
}

impl HttpRequest<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The media type alone, lower case (`application/json; charset=utf-8` → `application/json`).
    fn media_type(&self) -> String {
        self.header("content-type")
            .and_then(|c| c.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase())
            .unwrap_or_default()
    }
}

/// Refuses a request whose header the record would keep arrived as bytes that are not text
/// (`unreadable`: their names; `headers`: the readable ones). Parked without it, the event
/// would lose it silently; headers the endpoint never keeps do not matter.
pub fn refuse_unreadable(
    headers: &BTreeMap<String, String>,
    unreadable: &[String],
) -> Result<(), CeError> {
    let binary = headers.contains_key("ce-specversion");
    match unreadable.iter().find(|n| keeps_header(binary, n)) {
        Some(name) => Err(CeError::UnreadableHeader(name.clone())),
        None => Ok(()),
    }
}

/// Whether a record of a request keeps header `name` (lower case): a binary-mode event its
/// `ce-*` and `content-type`, a plain body all but HTTP's and the endpoint's own.
fn keeps_header(binary: bool, name: &str) -> bool {
    if binary {
        name.starts_with("ce-") || name == "content-type"
    } else {
        !HTTP_MANAGED.contains(&name) && !NOT_KEPT.contains(&name) && !name.starts_with("x-dlq-")
    }
}

/// Which of the HTTP bindings the request used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Binary,
    Structured,
    Batched,
    Plain,
}

/// One event (or plain body) to park: the request and the exact bytes it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Incoming {
    pub request: ParkRequest,
    /// What an Invalid record of it holds ([`crate::park::dispose`]), shared with the body it
    /// came in; a large event's data is left in it ([`ParkRequest::of_message`]).
    pub raw: bytes::Bytes,
}

/// The park requests in `req` for queue `queue`, in order.
pub fn parse(queue: &str, req: &HttpRequest<'_>) -> Result<(Mode, Vec<Incoming>), CeError> {
    parse_within(queue, req, MAX_BODY)
}

/// [`parse`] for a queue whose bodies may be larger than a record holds (its body store's
/// `maxBytes`, plus room for framing): bodies up to `limit` bytes.
pub fn parse_within(
    queue: &str,
    req: &HttpRequest<'_>,
    limit: usize,
) -> Result<(Mode, Vec<Incoming>), CeError> {
    if !req.method.eq_ignore_ascii_case("POST") {
        return Err(CeError::MethodNotAllowed);
    }
    if req.body.len() > limit {
        return Err(CeError::TooLarge { limit });
    }
    if let Some(enc) = req
        .header("content-encoding")
        .filter(|e| !e.trim().eq_ignore_ascii_case("identity"))
    {
        return Err(CeError::Encoded(enc.to_string()));
    }
    let media = req.media_type();
    if req.headers.contains_key("ce-specversion") {
        Ok((Mode::Binary, vec![binary(queue, req)]))
    } else if media == STRUCTURED {
        Ok((Mode::Structured, vec![structured(queue, &req.body)]))
    } else if media == BATCH {
        Ok((Mode::Batched, batched(queue, &req.body)?))
    } else {
        Ok((Mode::Plain, vec![plain(queue, req)]))
    }
}

/// The attributes a park request is read from, whichever mode carried them.
#[derive(Default)]
struct Attributes {
    specversion: Option<String>,
    id: Option<String>,
    source: Option<String>,
    ty: Option<String>,
    error_code: Option<String>,
    error_data: Option<String>,
    error_dest: Option<String>,
}

/// Binary mode: attributes in `ce-*` headers, data in the body.
fn binary(queue: &str, req: &HttpRequest<'_>) -> Incoming {
    let mut headers = BTreeMap::new();
    for (name, value) in &req.headers {
        if keeps_header(true, name) {
            headers.insert(name.clone(), value.clone());
        }
    }
    let attr = |n: &str| req.header(&format!("ce-{n}")).map(str::to_string);
    let attrs = Attributes {
        specversion: attr("specversion"),
        id: attr("id"),
        source: attr("source"),
        ty: attr("type"),
        error_code: attr("knativeerrorcode"),
        error_data: attr("knativeerrordata"),
        error_dest: attr("knativeerrordest"),
    };
    event(queue, attrs, req.body.clone(), headers)
}

/// Structured mode: the whole event is one JSON document, kept as it arrived.
fn structured(queue: &str, body: &bytes::Bytes) -> Incoming {
    // The event's members as their text: `data`, which may be most of a large body, is never
    // read into JSON values (`crate::json`).
    let members = match crate::json::members(body) {
        Ok(members) => members,
        Err(crate::json::NotObject::Syntax(e)) => {
            return not_an_event(queue, body, &format!("not JSON ({e})"));
        }
        Err(crate::json::NotObject::Shape(_)) => {
            return not_an_event(queue, body, "a structured CloudEvent is a JSON object");
        }
    };
    let value = |n: &str| members.get(n).and_then(|v| crate::json::value(n, v).ok());
    // Attributes are strings; a number or null is read as absent (and so refused below).
    let attr = |n: &str| match value(n) {
        Some(serde_json::Value::String(s)) => Some(s),
        _ => None,
    };
    let attrs = Attributes {
        specversion: attr("specversion"),
        id: attr("id"),
        source: attr("source"),
        ty: attr("type"),
        error_code: value("knativeerrorcode").map(|v| match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        }),
        error_data: attr("knativeerrordata"),
        error_dest: attr("knativeerrordest"),
    };
    let headers = BTreeMap::from([("content-type".to_string(), STRUCTURED.to_string())]);
    event(queue, attrs, body.clone(), headers)
}

/// Batched mode: a JSON array of structured events, each its own record.
fn batched(queue: &str, body: &bytes::Bytes) -> Result<Vec<Incoming>, CeError> {
    // Each event as the exact text the sender wrote (parsed into values, a number such as
    // 12345678901234567890.12345678901234567890 would come back as another number), a slice of
    // the body rather than a copy.
    let events: Vec<&serde_json::value::RawValue> = match serde_json::from_slice(body) {
        Ok(events) => events,
        Err(e) => {
            let why = match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                Ok(_) => "a CloudEvents batch is a JSON array".to_string(),
                Err(_) => format!("not JSON ({e})"),
            };
            return Ok(vec![not_an_event(queue, body, &why)]);
        }
    };
    if events.is_empty() {
        return Err(CeError::EmptyBatch);
    }
    if events.len() > MAX_BATCH {
        return Err(CeError::BatchTooLong {
            count: events.len(),
            max: MAX_BATCH,
        });
    }
    Ok(events
        .iter()
        .map(|e| structured(queue, &body.slice_ref(e.get().as_bytes())))
        .collect())
}

/// A plain body: the sender's headers but HTTP's and the endpoint's own; the id from
/// `x-dlq-job-id` (else `idempotency-key`, else the body's hash, so a retry finds its record).
fn plain(queue: &str, req: &HttpRequest<'_>) -> Incoming {
    let mut headers = BTreeMap::new();
    for (name, value) in &req.headers {
        if keeps_header(false, name) {
            headers.insert(name.clone(), value.clone());
        }
    }
    let id = req
        .header(HEADER_JOB_ID)
        .or_else(|| req.header("idempotency-key"))
        .map(str::to_string)
        .unwrap_or_else(|| format!("body-{}", hex::encode(&Sha256::digest(&req.body)[..8])));
    let job = Job {
        id: id.clone(),
        headers,
        ..Job::default()
    };
    let mut request =
        ParkRequest::of_message(queue, job, &req.body).with_message(format!("http:{id}"));
    // Only a retry (or a copy waiting for its turn) matches an earlier record by identity: a
    // resolved job that dies again is a new cycle.
    request.redelivered = false;
    request.reason = req
        .header(HEADER_REASON)
        .unwrap_or("posted to the park endpoint")
        .to_string();
    request.deliveries = req
        .header(HEADER_DELIVERIES)
        .and_then(|d| d.trim().parse().ok())
        .unwrap_or(0);
    if req
        .header(HEADER_FAILURE_KIND)
        .is_some_and(|k| k.trim().eq_ignore_ascii_case("invalid"))
    {
        request.failure_kind = FailureKind::Invalid;
    }
    request.error_class = req.header(HEADER_ERROR_CLASS).map(str::to_string);
    Incoming {
        request,
        raw: req.body.clone(),
    }
}

/// The job id of an event: `id@source`, whole when it fits. The pair is unique per
/// CloudEvents 1.0 (the id alone is not across sources), so no two different pairs may ever
/// share a job id: what is too long is cut with a digest of the whole pair.
///
/// Earlier versions hashed only the source (`<id>@sha256:<16 hex of source>`); that form is
/// kept while the id is whole in it, so a retry of an event they parked finds its record.
/// A source that looks like a digest itself is hashed too: `e-1` from `sha256:<hex>` must not
/// take the job id of `e-1` from the long source whose digest that is.
pub fn job_id(id: &str, source: &str) -> String {
    let both = format!("{id}@{source}");
    let max = dead_letter::MAX_SOURCE_MESSAGE_LEN;
    if both.len() <= max && !looks_hashed(source) {
        return both;
    }
    if id.chars().count() <= 200 {
        let earlier = format!(
            "{id}@sha256:{}",
            hex::encode(&Sha256::digest(source.as_bytes())[..8])
        );
        if earlier.len() <= max && !looks_hashed(source) {
            return earlier;
        }
    }
    // The id does not fit whole: its beginning (for humans), then the digest of the pair.
    let suffix = format!("~@sha256:{}", hex::encode(Sha256::digest(both.as_bytes())));
    let mut cut = max - suffix.len();
    while !id.is_char_boundary(cut.min(id.len())) {
        cut -= 1;
    }
    format!("{}{suffix}", &id[..cut.min(id.len())])
}

/// Whether `source` has the shape of a digest [`job_id`] writes (`sha256:` and hex).
fn looks_hashed(source: &str) -> bool {
    source
        .strip_prefix("sha256:")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn event(
    queue: &str,
    attrs: Attributes,
    raw: bytes::Bytes,
    headers: BTreeMap<String, String>,
) -> Incoming {
    let missing: Vec<&str> = [
        ("specversion", &attrs.specversion),
        ("id", &attrs.id),
        ("source", &attrs.source),
        ("type", &attrs.ty),
    ]
    .iter()
    .filter(|(_, v)| v.as_deref().is_none_or(str::is_empty))
    .map(|(n, _)| *n)
    .collect();
    if !missing.is_empty() {
        let why = format!("a CloudEvent without {}", missing.join(", "));
        return not_an_event_with(queue, &raw, &why, headers);
    }
    let (id, source) = (
        attrs.id.unwrap_or_default(),
        attrs.source.unwrap_or_default(),
    );
    if attrs.specversion.as_deref() != Some("1.0") {
        let why = format!(
            "CloudEvents specversion {:?}; only 1.0 is read",
            attrs.specversion.unwrap_or_default()
        );
        return not_an_event_with(queue, &raw, &why, headers);
    }
    let job_id = job_id(&id, &source);
    let job = Job {
        id: job_id.clone(),
        headers,
        ..Job::default()
    };
    let mut request =
        ParkRequest::of_message(queue, job, &raw).with_message(format!("ce:{job_id}"));
    request.redelivered = false;
    request.deliveries = 1;
    request.reason = reason(
        attrs.ty.as_deref().unwrap_or_default(),
        attrs.error_code.as_deref(),
        attrs.error_data.as_deref(),
        attrs.error_dest.as_deref(),
    );
    request.error_class = attrs
        .error_code
        .as_deref()
        .map(|c| format!("HTTP {}", c.trim()))
        .filter(|c| c.len() <= crate::group::MAX_ERROR_CLASS);
    Incoming { request, raw }
}

/// The reason of an event: Knative's words when it dead-lettered it, else that it was posted.
fn reason(ty: &str, code: Option<&str>, data: Option<&str>, dest: Option<&str>) -> String {
    let Some(code) = code else {
        return format!("CloudEvent {ty:?} posted to the park endpoint");
    };
    let mut reason = format!("delivery of {ty:?}");
    if let Some(dest) = dest {
        reason.push_str(&format!(" to {dest}"));
    }
    reason.push_str(&format!(" failed with HTTP {}", code.trim()));
    // knativeerrordata is the subscriber's answer body, base64: quoted only when it is text.
    if let Some(text) = data
        .and_then(|d| {
            base64::engine::general_purpose::STANDARD
                .decode(d.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .filter(|t| !t.trim().is_empty())
    {
        let text: String = text.trim().chars().take(512).collect();
        reason.push_str(&format!(": {text}"));
    }
    reason
}

fn not_an_event(queue: &str, raw: &[u8], why: &str) -> Incoming {
    not_an_event_with(queue, raw, why, BTreeMap::new())
}

/// An Invalid record of `raw` (and the headers that came with it, when a record can hold them).
fn not_an_event_with(
    queue: &str,
    raw: &[u8],
    why: &str,
    headers: BTreeMap<String, String>,
) -> Incoming {
    let mut request = invalid_request(queue, raw, format!("not a CloudEvent 1.0: {why}"));
    // The same bytes posted again are the same record.
    let id = request.job.id.clone();
    request = request.with_message(format!("ce-invalid:{id}"));
    request.redelivered = false;
    if headers
        .iter()
        .all(|(n, v)| crate::park::header_holdable(n, v))
        && headers.len() <= dead_letter::MAX_HEADERS
    {
        request.job.headers = headers;
    }
    Incoming {
        request,
        raw: bytes::Bytes::copy_from_slice(raw),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::park::{Disposition, dispose};

    fn req<'a>(headers: &[(&str, &str)], body: &'a [u8]) -> HttpRequest<'a> {
        HttpRequest {
            method: "POST",
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: bytes::Bytes::copy_from_slice(body),
        }
    }

    fn one(r: &HttpRequest<'_>) -> (Mode, Incoming) {
        let (mode, mut all) = parse("relayer", r).expect("parsed");
        assert_eq!(all.len(), 1);
        (mode, all.remove(0))
    }

    const BINARY: &[(&str, &str)] = &[
        ("ce-specversion", "1.0"),
        ("ce-id", "e-1"),
        ("ce-source", "/payments/relayer"),
        ("ce-type", "dev.payments.settle"),
        ("ce-traceparent", "00-abc-01"),
        ("content-type", "application/json"),
        ("authorization", "Bearer secret"),
        ("user-agent", "Go-http-client/1.1"),
    ];

    #[test]
    fn a_binary_event_keeps_its_body_and_ce_headers_only() {
        let (mode, e) = one(&req(BINARY, br#"{"intent":"pi_1"}"#));
        assert_eq!(mode, Mode::Binary);
        let r = &e.request;
        assert_eq!(r.job.id, "e-1@/payments/relayer");
        assert_eq!(r.job.payload.as_deref(), Some(r#"{"intent":"pi_1"}"#));
        assert_eq!(
            r.job.headers.keys().collect::<Vec<_>>(),
            [
                "ce-id",
                "ce-source",
                "ce-specversion",
                "ce-traceparent",
                "ce-type",
                "content-type"
            ]
        );
        assert_eq!(r.message.as_deref(), Some("ce:e-1@/payments/relayer"));
        assert!(!r.redelivered, "only a retry matches by identity");
        assert_eq!(r.failure_kind, FailureKind::Transient);
        assert!(crate::park::validate(r).is_ok());
    }

    #[test]
    fn knative_error_attributes_become_reason_and_error_class() {
        let data = base64::engine::general_purpose::STANDARD.encode("payer said no");
        let mut h = BINARY.to_vec();
        h.push(("ce-knativeerrorcode", "503"));
        h.push(("ce-knativeerrordata", &data));
        h.push(("ce-knativeerrordest", "http://relayer.payments.svc/"));
        let (_, e) = one(&req(&h, b"{}"));
        let r = e.request;
        assert_eq!(
            r.reason,
            "delivery of \"dev.payments.settle\" to http://relayer.payments.svc/ failed with HTTP 503: payer said no"
        );
        assert_eq!(r.error_class.as_deref(), Some("HTTP 503"));
        assert_eq!(
            r.job.headers.get("ce-knativeerrordest").map(String::as_str),
            Some("http://relayer.payments.svc/")
        );
        assert_eq!(r.deliveries, 1);
    }

    #[test]
    fn a_structured_event_is_kept_as_its_document() {
        let body = br#"{"specversion":"1.0","id":"7","source":"urn:x","type":"t","knativeerrorcode":500,"data":{"a":1}}"#;
        let (mode, e) = one(&req(&[("content-type", STRUCTURED)], body));
        assert_eq!(mode, Mode::Structured);
        assert_eq!(e.request.job.payload_bytes().expect("bytes"), body);
        assert_eq!(e.request.job.id, "7@urn:x");
        assert_eq!(e.request.error_class.as_deref(), Some("HTTP 500"));
        assert_eq!(
            e.request
                .job
                .headers
                .get("content-type")
                .map(String::as_str),
            Some(STRUCTURED)
        );
    }

    #[test]
    fn a_batch_is_split_into_structured_events() {
        let body = br#"[{"specversion":"1.0","id":"1","source":"s","type":"t"},{"specversion":"1.0","id":"2","source":"s","type":"t"}]"#;
        let (mode, all) = parse("relayer", &req(&[("content-type", BATCH)], body)).expect("ok");
        assert_eq!(mode, Mode::Batched);
        let ids: Vec<_> = all.iter().map(|e| e.request.job.id.as_str()).collect();
        assert_eq!(ids, ["1@s", "2@s"]);
        assert_eq!(
            parse("relayer", &req(&[("content-type", BATCH)], b"[]")),
            Err(CeError::EmptyBatch)
        );
        let many = format!("[{}]", vec!["{}"; MAX_BATCH + 1].join(","));
        assert_eq!(
            parse("relayer", &req(&[("content-type", BATCH)], many.as_bytes()))
                .map_err(|e| e.status()),
            Err(400)
        );
    }

    #[test]
    fn what_is_not_an_event_is_parked_invalid_with_its_exact_bytes() {
        for (headers, body) in [
            (vec![("content-type", STRUCTURED)], &b"{not json"[..]),
            (vec![("content-type", STRUCTURED)], &b"[1,2]"[..]),
            (
                vec![("content-type", STRUCTURED)],
                &br#"{"specversion":"1.0","id":"1","type":"t"}"#[..],
            ),
            (
                vec![
                    ("ce-specversion", "0.3"),
                    ("ce-id", "1"),
                    ("ce-source", "s"),
                    ("ce-type", "t"),
                ],
                &b"x"[..],
            ),
            (vec![("content-type", BATCH)], &b"{}"[..]),
        ] {
            let (_, e) = one(&req(&headers, body));
            assert_eq!(e.request.failure_kind, FailureKind::Invalid, "{body:?}");
            assert_eq!(e.request.job.payload_bytes().expect("bytes"), body);
            assert!(
                e.request.reason.starts_with("not a CloudEvent 1.0"),
                "{}",
                e.request.reason
            );
            assert!(crate::park::validate(&e.request).is_ok());
        }
    }

    #[test]
    fn a_plain_body_keeps_its_headers_but_credentials_and_controls() {
        let r = req(
            &[
                ("content-type", "text/plain"),
                ("x-trace", "t1"),
                ("authorization", "Bearer secret"),
                (HEADER_JOB_ID, "job-9"),
                (HEADER_REASON, "gave up"),
                (HEADER_DELIVERIES, "4"),
                (HEADER_FAILURE_KIND, "Invalid"),
            ],
            b"hello",
        );
        let (mode, e) = one(&r);
        assert_eq!(mode, Mode::Plain);
        let p = e.request;
        assert_eq!(p.job.id, "job-9");
        assert_eq!(
            p.job.headers.keys().collect::<Vec<_>>(),
            ["content-type", "x-trace"]
        );
        assert_eq!((p.reason.as_str(), p.deliveries), ("gave up", 4));
        assert_eq!(p.failure_kind, FailureKind::Invalid);
        let (_, anon) = one(&req(&[], b"hello"));
        let (_, again) = one(&req(&[], b"hello"));
        assert_eq!(
            anon.request.job.id, again.request.job.id,
            "a retry is the same job"
        );
    }

    #[test]
    fn refusals_map_to_statuses() {
        let mut r = req(BINARY, b"");
        r.method = "GET";
        assert_eq!(parse("q", &r).map_err(|e| e.status()), Err(405));
        let big = vec![b'x'; MAX_BODY + 1];
        assert_eq!(
            parse("q", &req(&[], &big)).map_err(|e| e.status()),
            Err(413)
        );
        assert_eq!(
            parse("q", &req(&[("content-encoding", "gzip")], b"x")).map_err(|e| e.status()),
            Err(415)
        );
    }

    #[test]
    fn long_sources_are_hashed_into_a_bounded_job_id() {
        let id = job_id("e-1", &"s".repeat(400));
        assert!(id.len() <= dead_letter::MAX_SOURCE_MESSAGE_LEN && id.starts_with("e-1@sha256:"));
        assert_ne!(id, job_id("e-1", &"t".repeat(400)));
    }

    #[test]
    fn long_ids_differing_only_at_the_end_are_two_jobs() {
        let a = format!("{}a", "x".repeat(299));
        let b = format!("{}b", "x".repeat(299));
        let (ja, jb) = (job_id(&a, "/s"), job_id(&b, "/s"));
        assert_ne!(ja, jb);
        assert!(
            ja.len() <= dead_letter::MAX_SOURCE_MESSAGE_LEN,
            "{}",
            ja.len()
        );
        let wide = "é".repeat(150);
        let jw = job_id(&wide, "/s");
        assert!(jw.len() <= dead_letter::MAX_SOURCE_MESSAGE_LEN && jw.starts_with('é'));
        assert_ne!(jw, job_id(&format!("{wide}é"), "/s"));
    }

    #[test]
    fn job_ids_that_fit_keep_the_form_earlier_versions_parked() {
        assert_eq!(job_id("e-1", "/s"), "e-1@/s");
        let long = "s".repeat(400);
        let digest = hex::encode(&Sha256::digest(long.as_bytes())[..8]);
        assert_eq!(job_id("e-1", &long), format!("e-1@sha256:{digest}"));
        // A source shaped like that digest does not take the long source's job id.
        assert_ne!(
            job_id("e-1", &format!("sha256:{digest}")),
            job_id("e-1", &long)
        );
    }

    #[test]
    fn a_batch_keeps_each_event_as_the_exact_text_sent() {
        let one = r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"n":12345678901234567890.12345678901234567890,"i":123456789012345678901234567890}}"#;
        let two = r#"{ "specversion" : "1.0", "id":"2","source":"s","type":"t","data":1.0e1 }"#;
        let body = format!("[ {one},\n  {two} ]");
        let (_, all) =
            parse("relayer", &req(&[("content-type", BATCH)], body.as_bytes())).expect("a batch");
        let kept: Vec<_> = all
            .iter()
            .map(|e| e.request.job.payload_bytes().expect("bytes"))
            .collect();
        assert_eq!(kept, [one.as_bytes(), two.as_bytes()]);
    }

    #[test]
    fn an_unreadable_header_the_record_would_keep_refuses_the_request() {
        let binary: BTreeMap<String, String> = [("ce-specversion", "1.0")]
            .into_iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        let err = refuse_unreadable(&binary, &["ce-subject".into()]).expect_err("refused");
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("ce-subject"), "{err}");
        assert_eq!(refuse_unreadable(&binary, &["user-agent".into()]), Ok(()));
        let plain = BTreeMap::new();
        assert!(refuse_unreadable(&plain, &["x-note".into()]).is_err());
        assert_eq!(refuse_unreadable(&plain, &["cookie".into()]), Ok(()));
    }

    proptest! {
        /// Whatever arrives, parsing never panics and every result either validates or is
        /// turned by `dispose` into a record of its exact bytes (or refused as too large).
        #[test]
        fn any_request_is_a_record_or_a_reasoned_refusal(
            body in proptest::collection::vec(any::<u8>(), 0..512),
            ct in prop_oneof![Just(STRUCTURED), Just(BATCH), Just("application/json"), Just("")],
            ce in any::<bool>(),
            id in "[ -~]{0,40}",
            src in "[ -~\n]{0,40}",
        ) {
            let mut headers = vec![("content-type", ct)];
            if ce {
                headers.extend([("ce-specversion", "1.0"), ("ce-type", "t")]);
                headers.push(("ce-id", id.as_str()));
                headers.push(("ce-source", src.as_str()));
            }
            let r = req(&headers, &body);
            match parse("relayer", &r) {
                Ok((_, all)) => for e in all {
                    match dispose(e.request.clone(), &e.raw) {
                        Disposition::Park(p) => {
                            prop_assert!(crate::park::validate(&p).is_ok());
                            if p.failure_kind == FailureKind::Invalid && e.request.failure_kind == FailureKind::Transient {
                                prop_assert_eq!(p.job.payload_bytes().expect("bytes"), e.raw.clone());
                            }
                        }
                        Disposition::Reject(why) => prop_assert!(false, "rejected {why}"),
                    }
                },
                Err(e) => prop_assert_eq!(e.status(), 400),
            }
        }

        /// The same event posted twice is the same job and message (a retry finds its record).
        #[test]
        fn the_same_event_is_the_same_job(id in "[a-z0-9-]{1,30}", src in "[a-z/:.]{1,300}") {
            let h = [("ce-specversion", "1.0"), ("ce-id", id.as_str()), ("ce-source", src.as_str()), ("ce-type", "t")];
            let (_, a) = one(&req(&h, b"{}"));
            let (_, b) = one(&req(&h, b"{\"other\":1}"));
            prop_assert_eq!(&a.request.job.id, &b.request.job.id);
            prop_assert_eq!(&a.request.message, &b.request.message);
            prop_assert!(crate::park::validate(&a.request).is_ok());
        }
    }
}
