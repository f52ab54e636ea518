//! The park rules: what a valid request is, what a record is named, which cycle it gets.
//! `dlq-client` carries them out against the apiserver.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use sha2::{Digest, Sha256};

use crate::dead_letter::{
    self, Action, BodyRef, DeadLetter, DeadLetterSpec, FailureKind, IntentSnapshot, Job, Phase,
};

/// Everything known about a given-up job.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkRequest {
    /// The DeadLetterQueue (same namespace) the job came from.
    pub queue: String,
    /// The untouched job.
    pub job: Job,
    pub intent: Option<IntentSnapshot>,
    /// Deliveries in this cycle.
    pub deliveries: i32,
    pub reason: String,
    pub failure_kind: FailureKind,
    pub service_version: Option<String>,
    /// What kind of error it was (an exception class): part of its failure group.
    pub error_class: Option<String>,
    /// When the consumer gave up; now when None.
    pub failed_at: Option<jiff::Timestamp>,
    /// The broker's identity of this one dead message (a Kafka offset, a stream sequence, an
    /// id the Redis source gave it), when a source has one. A source that re-reads a message
    /// after a crash between parking and acknowledging finds the record of that message by it,
    /// even when a human resolved the record meanwhile: without it, that re-read would look
    /// like the job dying again and become a second record.
    pub message: Option<String>,
    /// Whether this message may already have a record: the broker may have handed it out
    /// before, or an earlier attempt to park it may have created its record without the reply
    /// arriving ([`ParkRequest::retrying`]). Only then does a record with the same `message`
    /// count as this message's record. Sources whose identities are unique forever leave it
    /// true ([`ParkRequest::with_message`]); AMQP, whose identity is a hash that is only
    /// probably unique, sets RabbitMQ's `redelivered` flag, so a first delivery can never be
    /// taken for an earlier, resolved death.
    pub redelivered: bool,
    /// What [`ParkRequest::reason`] says instead on a queue that seals
    /// (`crate::seal::seal_request`), when the reason quotes the message's bytes (a parse
    /// error's words, a header name, the job id an Invalid message claimed): the same diagnosis
    /// without the value, since a sealed record's reason is readable by anyone who reads
    /// records. None: the reason quotes nothing of the message.
    pub sealed_reason: Option<String>,
    /// Whether every message (by `message`) is a death of its own, so a Parked record of the
    /// same job made from another message does not answer for this one: it is parked as the
    /// next cycle beside it. Sidekiq's dead set, whose members are distinct by their bytes
    /// while a `jid` is not unique across them (a job enqueued twice, a client that sets jids).
    pub own_death: bool,
    /// Whether the job's payload is still only the source's message (see
    /// [`ParkRequest::of_message`]): the job holds none yet, and the parker takes it from the
    /// message's bytes when it places the body ([`ParkRequest::fill_payload`]).
    pub payload_in_message: bool,
    /// The cycle this job's record had where it came from (`kubectl dlq park --from` an
    /// export): it is parked as at least this cycle, so moving records between namespaces or
    /// clusters keeps their cycles. None: cycles count from 1 here.
    pub least_cycle: Option<i32>,
}

impl ParkRequest {
    /// A request with only the required parts; set the rest as fields.
    pub fn new(queue: impl Into<String>, job: Job) -> Self {
        ParkRequest {
            queue: queue.into(),
            job,
            intent: None,
            deliveries: 0,
            reason: String::new(),
            failure_kind: FailureKind::Transient,
            service_version: None,
            error_class: None,
            failed_at: None,
            message: None,
            redelivered: false,
            sealed_reason: None,
            own_death: false,
            payload_in_message: false,
            least_cycle: None,
        }
    }

    /// A request for a message whose exact bytes `data` are the job's payload. Up to what a
    /// record can hold they are copied into the job; above that the payload can only go to a
    /// body store (or be refused), so it is left in the message, which the body store is given
    /// whole: a large dead message is never held twice on its way there.
    pub fn of_message(queue: impl Into<String>, job: Job, data: &[u8]) -> Self {
        let mut req = ParkRequest::new(queue, job);
        req.payload_in_message = true;
        if data.len() <= dead_letter::MAX_PAYLOAD_BYTES {
            req.fill_payload(data);
        }
        req
    }

    /// Copies the payload left in the source's `message` into the job (a payload that stays in
    /// the record, or is refused with the record's limit).
    pub fn fill_payload(&mut self, message: &[u8]) {
        if !std::mem::take(&mut self.payload_in_message) {
            return;
        }
        let filled = Job::from_bytes(String::new(), message);
        self.job.payload = filled.payload;
        self.job.payload_base64 = filled.payload_base64;
    }

    /// Sets [`ParkRequest::message`], hashed when longer than an annotation should be.
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        let message = message.into();
        self.message = Some(if message.len() > dead_letter::MAX_SOURCE_MESSAGE_LEN {
            format!("sha256:{}", hex::encode(Sha256::digest(message.as_bytes())))
        } else {
            message
        });
        self.redelivered = true;
        self
    }

    /// The cycle to create after the job's highest recorded one (`None`: no record): the next,
    /// or the cycle the job had where it was exported, whichever is higher.
    pub fn cycle_after(&self, highest: Option<i32>) -> i32 {
        let next = highest.unwrap_or(0) + 1;
        self.least_cycle.map_or(next, |least| next.max(least))
    }

    /// Marks a request about to be tried again after an attempt whose outcome is unknown (an
    /// apiserver error may come after the create was stored): its record may exist already,
    /// and may even have been resolved meanwhile, so from now on a record with the same
    /// `message` is this message's record and parking it again answers with that record
    /// instead of starting a new cycle.
    pub fn retrying(&mut self) {
        if self.message.is_some() {
            self.redelivered = true;
        }
    }

    /// The source message identity to match earlier records against, if any.
    fn reread_of(&self) -> Option<&str> {
        self.message.as_deref().filter(|_| self.redelivered)
    }

    /// Whether a Parked record of this job, parked from message `other`, answers for this
    /// request (see [`ParkRequest::own_death`]).
    pub fn answered_by(&self, other: Option<&str>) -> bool {
        !self.own_death || self.message.is_none() || other == self.message.as_deref()
    }
}

/// Why a park request is refused before any I/O. Each message says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParkInvalid {
    #[error("missing job id")]
    MissingJobId,
    #[error("job id is {len} bytes; at most {max}")]
    JobIdTooLong { len: usize, max: usize },
    #[error("missing queue")]
    MissingQueue,
    #[error("queue name {0:?} is not a valid Kubernetes name (lower-case letters, digits, '-')")]
    BadQueueName(String),
    #[error("job has both payload and payloadBase64; give exactly one")]
    BothPayloadForms,
    #[error("job has payloadNull and a payload; a null value has none")]
    NullWithPayload,
    #[error("job has no payload; give payload (UTF-8) or payloadBase64 (bytes)")]
    NoPayload,
    #[error("payloadBase64 is not valid base64: {0}")]
    BadBase64(String),
    #[error("payload is {size} bytes; the limit is {limit} bytes")]
    PayloadTooLarge { size: usize, limit: usize },
    #[error("job has a body in the store and a payload; a stored body replaces the payload")]
    BodyWithPayload,
    #[error(
        "job body is not a reference (at most 2048 characters), a size >= 0 and a lower-case hex SHA-256"
    )]
    BadBody,
    #[error("invalid header name {0:?}: use RFC 7230 token characters, at most 256")]
    InvalidHeaderName(String),
    #[error("header {name:?} value is invalid: {why}")]
    InvalidHeaderValue { name: String, why: String },
    #[error("{count} headers; at most {max}")]
    TooManyHeaders { count: usize, max: usize },
    #[error("header name {0:?} is the operator's own")]
    ReservedHeaderName(String),
    #[error("deliveries must be >= 0, got {0}")]
    NegativeDeliveries(i32),
    #[error("{field} is {len} characters; at most {max}")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
}

const MAX_REASON: usize = 1024;

impl ParkInvalid {
    /// The refusal in words that quote nothing of the message (no header name, no decoder's
    /// quote of the bytes): what a sealed record's reason says (see
    /// [`ParkRequest::sealed_reason`]).
    pub fn without_values(&self) -> String {
        match self {
            ParkInvalid::BadBase64(_) => "payloadBase64 is not valid base64".into(),
            ParkInvalid::InvalidHeaderName(_) => {
                "invalid header name: use RFC 7230 token characters, at most 256".into()
            }
            ParkInvalid::ReservedHeaderName(_) => "a header name is the operator's own".into(),
            ParkInvalid::InvalidHeaderValue { why, .. } => {
                format!("a header value is invalid: {why}")
            }
            other => other.to_string(),
        }
    }

    /// Short, stable label for metrics (`dlq_rejected_total{reason}`).
    pub fn category(&self) -> &'static str {
        match self {
            ParkInvalid::MissingJobId => "MissingJobId",
            ParkInvalid::JobIdTooLong { .. } => "JobIdTooLong",
            ParkInvalid::MissingQueue => "MissingQueue",
            ParkInvalid::BadQueueName(_) => "BadQueueName",
            ParkInvalid::BothPayloadForms => "BothPayloadForms",
            ParkInvalid::NullWithPayload => "NullWithPayload",
            ParkInvalid::NoPayload => "NoPayload",
            ParkInvalid::BadBase64(_) => "BadBase64",
            ParkInvalid::PayloadTooLarge { .. } => "PayloadTooLarge",
            ParkInvalid::BodyWithPayload => "BodyWithPayload",
            ParkInvalid::BadBody => "BadBody",
            ParkInvalid::InvalidHeaderName(_) => "InvalidHeaderName",
            ParkInvalid::InvalidHeaderValue { .. } => "InvalidHeaderValue",
            ParkInvalid::TooManyHeaders { .. } => "TooManyHeaders",
            ParkInvalid::ReservedHeaderName(_) => "ReservedHeaderName",
            ParkInvalid::NegativeDeliveries(_) => "NegativeDeliveries",
            ParkInvalid::TooLong { .. } => "TooLong",
        }
    }
}

/// What a source does with one dead message.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Park this: the job the message claims to be, or an Invalid record of its exact bytes.
    Park(Box<ParkRequest>),
    /// The message can never be a record (its bytes are over the payload limit): the source
    /// keeps it where rejected messages go, counts it and announces it. Never dropped.
    Reject(ParkInvalid),
}

/// The one rule for every source: a request that fails validation is parked as an Invalid
/// record of the message's exact bytes (`raw`), with the validation error as its reason; only
/// what cannot be a record even so is rejected.
pub fn dispose(req: ParkRequest, raw: &[u8]) -> Disposition {
    let why = match validate(&req) {
        Ok(()) => return Disposition::Park(Box::new(req)),
        Err(why) => why,
    };
    // The request's headers are the message's own when its payload is the message's bytes
    // (not an envelope around them): keep them when a record can hold them.
    let same_bytes = req.job.payload_bytes().is_ok_and(|b| b == raw);
    let headers = Some(&req.job.headers)
        .filter(|h| same_bytes && !h.is_empty() && validate_headers(h).is_ok());
    let kept = match (headers, req.job.headers.is_empty() || !same_bytes) {
        (Some(_), _) => "its exact bytes and headers",
        (None, true) => "its exact bytes",
        (None, false) => "its exact bytes; its headers could not be held and were left out",
    };
    let mut invalid = invalid_request(
        &req.queue,
        raw,
        format!(
            "cannot be parked as job {:?}: {why}; parked with {kept}",
            truncate_chars(&req.job.id, 64)
        ),
    );
    invalid.sealed_reason = Some(format!(
        "cannot be parked as the job it names: {}; parked with {kept}",
        why.without_values()
    ));
    if let Some(h) = headers {
        invalid.job.headers = h.clone();
    }
    let mut invalid = ParkRequest {
        message: req.message,
        redelivered: req.redelivered,
        own_death: req.own_death,
        ..invalid
    };
    // A message without a value stays one: its Invalid record says null, not empty.
    if req.job.payload_null && raw.is_empty() {
        invalid.job = Job::null_value(invalid.job.id);
    }
    match validate(&invalid) {
        Ok(()) => Disposition::Park(Box::new(invalid)),
        Err(e) => Disposition::Reject(e),
    }
}

/// [`dispose`] for a request whose payload was kept in the body store as `body`, the message's
/// exact bytes `raw` themselves: an invalid one too large for a record inline is parked as an
/// Invalid record of those bytes by reference, instead of being refused as too large.
pub fn dispose_kept(req: ParkRequest, raw: &[u8], body: &BodyRef) -> Disposition {
    let mut light = req.clone();
    light.job.payload = None;
    light.job.payload_base64 = None;
    light.job.body = None;
    match dispose(req, raw) {
        Disposition::Reject(ParkInvalid::PayloadTooLarge { .. }) => {}
        other => return other,
    }
    let mut invalid = match dispose(light, b"") {
        Disposition::Park(invalid) => invalid,
        reject => return reject,
    };
    invalid.job.payload = None;
    invalid.job.payload_base64 = None;
    invalid.job.body = Some(Box::new(body.clone()));
    match validate(&invalid) {
        Ok(()) => Disposition::Park(invalid),
        Err(e) => Disposition::Reject(e),
    }
}

/// Whether an apiserver answer of HTTP `code` to a create is final: a bad request (400), a
/// body too large (413) or a refusal by the schema, a CEL rule or an admission policy (422)
/// answers the same however often it is asked. Everything else (409, 429, 5xx, timeouts, and
/// 403, which RBAC or the capacity policy may lift) is worth retrying.
pub fn refusal_is_final(code: u16) -> bool {
    matches!(code, 400 | 413 | 422)
}

/// Longest part of the apiserver's words quoted in a reason (reasons hold 1024 characters).
const MAX_REFUSAL_QUOTE: usize = 640;

/// What a source parks after the apiserver finally refused `req` (with `refusal`, its words),
/// or None when nothing is left to try and the message must be set aside visibly. `tried` counts
/// the earlier fallbacks for this message:
/// 0. an Invalid record of the exact bytes `raw` under the same job id, keeping its headers
///    (they passed validation) but not what was read from the message's metadata (origin,
///    intent, service version), whichever of those the apiserver objected to;
/// 1. an Invalid record of the exact bytes alone, as [`dispose`] makes;
/// 2. None.
pub fn after_refusal(
    req: &ParkRequest,
    raw: &[u8],
    refusal: &str,
    tried: usize,
) -> Option<ParkRequest> {
    let quoted = truncate_chars(refusal, MAX_REFUSAL_QUOTE);
    let mut next = match tried {
        0 => {
            let mut next = invalid_request(
                &req.queue,
                raw,
                format!(
                    "the apiserver refused its record ({quoted}); parked with its exact bytes, its headers and its job id, without its origin, intent or service version"
                ),
            );
            next.job.id = req.job.id.clone();
            next.job.headers = req.job.headers.clone();
            next.deliveries = req.deliveries;
            next.failed_at = req.failed_at;
            next
        }
        1 => invalid_request(
            &req.queue,
            raw,
            format!(
                "the apiserver refused its record, also without its origin ({quoted}); parked with its exact bytes only"
            ),
        ),
        _ => return None,
    };
    if req.job.payload_null && raw.is_empty() {
        next.job = Job {
            headers: std::mem::take(&mut next.job.headers),
            ..Job::null_value(next.job.id)
        };
    }
    next.message = req.message.clone();
    next.redelivered = req.redelivered;
    next.own_death = req.own_death;
    Some(next)
}

/// A JSON parse error in words that quote nothing of the input: serde's own words quote the
/// offending value (``invalid type: integer `4242424242424242`, expected a string``), which a
/// sealed record's reason must not (see [`ParkRequest::sealed_reason`]). Syntax errors are
/// serde_json's fixed words and stay as they are; data errors keep what was wrong and what the
/// schema expected; anything else (a custom error of a field's own parser) says only where.
pub fn json_error_without_values(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let full = e.to_string();
    let at = if e.line() == 0 {
        String::new()
    } else {
        format!(" at line {} column {}", e.line(), e.column())
    };
    if matches!(e.classify(), Category::Syntax | Category::Eof) {
        return full;
    }
    let said = full.strip_suffix(&at).unwrap_or(&full);
    // The schema's words come last (serde writes `<what> <value>, expected <schema>`), so
    // the last ", expected " is the schema's even when the quoted value holds one.
    let expected = said
        .rfind(", expected ")
        .map(|i| format!(" (expected {})", &said[i + ", expected ".len()..]))
        .unwrap_or_default();
    let what = [
        ("invalid type", "a value of the wrong type"),
        ("invalid value", "an invalid value"),
        ("invalid length", "a list or map of the wrong length"),
        ("unknown field", "an unknown field"),
        ("unknown variant", "an unknown variant"),
    ]
    .into_iter()
    .find(|(prefix, _)| said.starts_with(prefix));
    match what {
        Some((_, what)) => format!("{what}{expected}{at}"),
        // Field names serde quotes here are the schema's own.
        None if said.starts_with("missing field") || said.starts_with("duplicate field") => full,
        None => format!("a value that could not be read{at}"),
    }
}

/// An Invalid record of `raw` exactly. Its id comes from the bytes, so re-parking the same
/// message after a crash deduplicates.
pub fn invalid_request(queue: &str, raw: &[u8], reason: String) -> ParkRequest {
    let id = format!("invalid-{}", hex::encode(&Sha256::digest(raw)[..8]));
    let mut req = ParkRequest::new(queue, Job::from_bytes(id, raw));
    req.failure_kind = FailureKind::Invalid;
    req.reason = reason;
    req
}

fn truncate_chars(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max).collect();
    out.push_str("...");
    out
}

/// Checks a request without any I/O.
pub fn validate(req: &ParkRequest) -> Result<(), ParkInvalid> {
    validate_queue(&req.queue)?;
    validate_id(&req.job.id)?;
    validate_payload(&req.job)?;
    validate_headers(&req.job.headers)?;
    if req.deliveries < 0 {
        return Err(ParkInvalid::NegativeDeliveries(req.deliveries));
    }
    validate_bounded_text(req)
}

fn validate_queue(queue: &str) -> Result<(), ParkInvalid> {
    if queue.trim().is_empty() {
        return Err(ParkInvalid::MissingQueue);
    }
    if !is_dns_label(queue) {
        return Err(ParkInvalid::BadQueueName(queue.to_string()));
    }
    Ok(())
}

fn validate_id(id: &str) -> Result<(), ParkInvalid> {
    if id.trim().is_empty() {
        return Err(ParkInvalid::MissingJobId);
    }
    if id.len() > dead_letter::MAX_JOB_ID_LEN {
        return Err(ParkInvalid::JobIdTooLong {
            len: id.len(),
            max: dead_letter::MAX_JOB_ID_LEN,
        });
    }
    Ok(())
}

/// Exactly one payload form, decodable, within the size limit.
fn validate_payload(job: &Job) -> Result<(), ParkInvalid> {
    if let Some(body) = &job.body {
        validate_body(body)?;
        if !body.external {
            return match (&job.payload, &job.payload_base64, job.payload_null) {
                (None, None, false) => Ok(()),
                _ => Err(ParkInvalid::BodyWithPayload),
            };
        }
    }
    let size = match (&job.payload, &job.payload_base64) {
        (Some(_), _) | (_, Some(_)) if job.payload_null => {
            return Err(ParkInvalid::NullWithPayload);
        }
        (None, None) if job.payload_null => 0,
        (Some(_), Some(_)) => return Err(ParkInvalid::BothPayloadForms),
        (None, None) => return Err(ParkInvalid::NoPayload),
        (Some(text), None) => text.len(),
        (None, Some(_)) => job
            .payload_bytes()
            .map_err(|e| ParkInvalid::BadBase64(e.to_string()))?
            .len(),
    };
    if size > dead_letter::MAX_PAYLOAD_BYTES {
        return Err(ParkInvalid::PayloadTooLarge {
            size,
            limit: dead_letter::MAX_PAYLOAD_BYTES,
        });
    }
    Ok(())
}

/// A body reference as the CRD bounds it: a reference, a size and a lower-case hex digest.
fn validate_body(body: &dead_letter::BodyRef) -> Result<(), ParkInvalid> {
    let digest_ok = body.sha256.len() == 64
        && body
            .sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if body.reference.is_empty() || body.reference.len() > 2048 || body.size < 0 || !digest_ok {
        return Err(ParkInvalid::BadBody);
    }
    Ok(())
}

/// Headers that can travel back to any broker: token names, bounded values without CR/LF/NUL.
pub fn validate_headers(headers: &BTreeMap<String, String>) -> Result<(), ParkInvalid> {
    if headers.len() > dead_letter::MAX_HEADERS {
        return Err(ParkInvalid::TooManyHeaders {
            count: headers.len(),
            max: dead_letter::MAX_HEADERS,
        });
    }
    for (name, value) in headers {
        if name.is_empty() || name.len() > 256 || !name.bytes().all(is_tchar) {
            return Err(ParkInvalid::InvalidHeaderName(name.clone()));
        }
        if value.len() > dead_letter::MAX_HEADER_VALUE_LEN {
            return Err(ParkInvalid::InvalidHeaderValue {
                name: name.clone(),
                why: format!(
                    "{} bytes, at most {}",
                    value.len(),
                    dead_letter::MAX_HEADER_VALUE_LEN
                ),
            });
        }
        if value.contains(['\r', '\n', '\0']) {
            return Err(ParkInvalid::InvalidHeaderValue {
                name: name.clone(),
                why: "contains CR, LF or NUL".into(),
            });
        }
    }
    Ok(())
}

/// The short free-text facts, bounded as the CRD bounds them.
fn validate_bounded_text(req: &ParkRequest) -> Result<(), ParkInvalid> {
    let bounded = [
        (
            "serviceVersion",
            req.service_version.as_deref().unwrap_or(""),
            128,
        ),
        (
            "errorClass",
            req.error_class.as_deref().unwrap_or(""),
            crate::group::MAX_ERROR_CLASS,
        ),
        (
            "intent.id",
            req.intent.as_ref().map_or("", |i| i.id.as_str()),
            253,
        ),
        (
            "intent.state",
            req.intent.as_ref().map_or("", |i| i.state.as_str()),
            253,
        ),
    ];
    for (field, value, max) in bounded {
        if value.chars().count() > max {
            return Err(ParkInvalid::TooLong {
                field,
                len: value.chars().count(),
                max,
            });
        }
    }
    Ok(())
}

/// Whether a record can hold this header as it is: a token name (RFC 7230, at most 256) and a
/// value without CR, LF or NUL. Codecs carry the others in their raw header (as bytes).
pub fn header_holdable(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name.bytes().all(is_tchar)
        && !value.contains(['\r', '\n', '\0'])
}

/// RFC 7230 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// 16 hex of sha256(`queue/jobId`): the `dlq.dev/job-key` label shared by every cycle of a job.
pub fn job_key(queue: &str, job_id: &str) -> String {
    let digest = Sha256::digest(format!("{queue}/{job_id}").as_bytes());
    hex::encode(&digest[..8])
}

/// `<slug of job id>-<8 hex of sha256(queue/jobId)>-<cycle>`, a valid DNS subdomain.
pub fn record_name(queue: &str, job_id: &str, cycle: i32) -> String {
    let mut slug = String::new();
    for c in job_id.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            slug.push(c);
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
        if slug.len() >= 40 {
            break;
        }
    }
    let slug = slug.trim_matches('-');
    let slug = if slug.is_empty() { "job" } else { slug };
    format!("{slug}-{}-{cycle}", &job_key(queue, job_id)[..8])
}

/// Cuts free text to `max` characters with a marker; the job itself is never cut.
fn bounded_reason(reason: &str) -> String {
    if reason.chars().count() <= MAX_REASON {
        return reason.to_string();
    }
    let mut s: String = reason.chars().take(MAX_REASON - 3).collect();
    s.push_str("...");
    s
}

/// The record of `req`'s `cycle`, labelled for lookups (queue, failure kind, job key, failure
/// group: computed here, so grouping costs the park path no write).
pub fn new_record(req: &ParkRequest, cycle: i32) -> DeadLetter {
    let key = job_key(&req.queue, &req.job.id);
    let mut record = DeadLetter::new(
        &record_name(&req.queue, &req.job.id, cycle),
        DeadLetterSpec {
            queue: req.queue.clone(),
            cycle,
            job: req.job.clone(),
            intent: req.intent.clone().map(Box::new),
            deliveries: req.deliveries,
            reason: bounded_reason(&req.reason),
            failure_kind: req.failure_kind,
            service_version: req.service_version.clone(),
            error_class: req.error_class.clone(),
            failed_at: Time(req.failed_at.unwrap_or_else(jiff::Timestamp::now)),
            action: None,
            by: None,
            note: None,
        },
    );
    record.metadata.labels = Some(BTreeMap::from([
        (dead_letter::LABEL_QUEUE.to_string(), req.queue.clone()),
        (
            dead_letter::LABEL_FAILURE_KIND.to_string(),
            req.failure_kind.label().to_string(),
        ),
        (dead_letter::LABEL_JOB_KEY.to_string(), key),
        (
            crate::group::LABEL_GROUP.to_string(),
            crate::group::Key::of(&record).fingerprint(),
        ),
    ]));
    if let Some(message) = &req.message {
        record.metadata.annotations = Some(BTreeMap::from([(
            dead_letter::ANNOTATION_SOURCE_MESSAGE.to_string(),
            message.clone(),
        )]));
    }
    record
}

/// The record `req` would become, without its job's content, on a queue that seals (`seals`:
/// its reason as sealing keeps it) or not: what a replay's selector matches before any record
/// exists (a standing replay's pass-through), labelled with the group the record would have.
pub fn arriving(req: &ParkRequest, seals: bool) -> DeadLetter {
    let mut reason = req.reason.clone();
    if seals {
        if let Some(sealed) = &req.sealed_reason {
            reason.clone_from(sealed);
        }
        reason = crate::mask::mask_cards(&reason);
    }
    let light = ParkRequest {
        queue: req.queue.clone(),
        job: crate::dead_letter::Job {
            id: req.job.id.clone(),
            ..Default::default()
        },
        intent: None,
        deliveries: req.deliveries,
        reason,
        failure_kind: req.failure_kind,
        service_version: req.service_version.clone(),
        error_class: req.error_class.clone(),
        failed_at: req.failed_at,
        message: None,
        redelivered: false,
        sealed_reason: None,
        own_death: false,
        payload_in_message: false,
        least_cycle: None,
    };
    new_record(&light, 1)
}

/// The idempotency key of one dead message: the same for every delivery of it, however it goes
/// back, so a consumer that drops repeated keys takes it once. A standing replay's pass-through
/// carries it, and so does the redrive of a record parked from that message
/// (`crate::decide::redrive_key`): a pass whose answer was lost and whose message was then
/// parked, or a message parked by a replica paused past its term while the next leader passed
/// it, reaches the target under one key. From the source's message identity when it has one,
/// else from the message's exact bytes.
pub fn message_key(namespace: &str, queue: &str, message: Option<&str>, raw: &[u8]) -> String {
    let mut h = Sha256::new();
    for part in [namespace.as_bytes(), queue.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    match message {
        Some(m) => {
            h.update(b"m");
            h.update(m.as_bytes());
        }
        None => {
            h.update(b"b");
            h.update(raw);
        }
    }
    format!("msg-{}", hex::encode(&h.finalize()[..16]))
}

/// The source message identity a record was parked with.
pub fn source_message(record: &DeadLetter) -> Option<&str> {
    record
        .metadata
        .annotations
        .as_ref()?
        .get(dead_letter::ANNOTATION_SOURCE_MESSAGE)
        .map(String::as_str)
}

/// Whether a record of a job answers for a new dead message of that job (the same death,
/// dead-lettered twice): a Parked one, but not once a redrive is decided. Its job may be on its
/// queue again from then on (the broker confirms before the record says Redriven), and a death
/// now is its own, the next cycle, however soon it comes: answered by the record, it was
/// acknowledged and lost once the record turned Redriven.
pub fn answers_for_its_job(phase: Phase, action: Option<Action>) -> bool {
    phase == Phase::Parked && action != Some(Action::Redrive)
}

/// What earlier records of a job mean for parking it now.
#[derive(Debug, Clone)]
pub enum Cycle<'a> {
    /// The record of this very message (same source identity), whatever its phase: the
    /// message was re-read after its record was made; parking it again changes nothing.
    SameMessage(&'a DeadLetter),
    /// A record of the job is Parked: parking again is a no-op that returns it.
    AlreadyParked(&'a DeadLetter),
    /// Park as this cycle: 1 + the highest earlier cycle.
    Next(i32),
}

/// Dedupe and cycle rule over the records carrying the job's key. Only records of exactly this
/// queue and job id count: a 64-bit key collision can never merge two jobs.
pub fn next_cycle<'a>(req: &ParkRequest, existing: &'a [DeadLetter]) -> Cycle<'a> {
    let same = || {
        existing
            .iter()
            .filter(|r| r.spec.job.id == req.job.id && r.spec.queue == req.queue)
    };
    if let Some(message) = req.reread_of()
        && let Some(record) = same().find(|r| source_message(r) == Some(message))
    {
        return Cycle::SameMessage(record);
    }
    if let Some(parked) = same().find(|r| {
        answers_for_its_job(r.phase(), r.spec.action) && req.answered_by(source_message(r))
    }) {
        return Cycle::AlreadyParked(parked);
    }
    Cycle::Next(req.cycle_after(same().map(|r| r.spec.cycle).max()))
}

/// One record of a job as a parker's local view holds it (the operator's record store): enough
/// to choose the cycle to create without asking the apiserver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownCycle {
    pub name: String,
    pub queue: String,
    pub job_id: String,
    pub cycle: i32,
    pub phase: Phase,
    /// Its decision, if any (a redrive decided: its job may be back on its queue).
    pub action: Option<Action>,
    /// The source message identity it was parked with.
    pub message: Option<String>,
}

impl KnownCycle {
    /// What a view keeps of `record`.
    pub fn of(record: &DeadLetter) -> Self {
        KnownCycle {
            name: record.metadata.name.clone().unwrap_or_default(),
            queue: record.spec.queue.clone(),
            job_id: record.spec.job.id.clone(),
            cycle: record.spec.cycle,
            phase: record.phase(),
            action: record.spec.action,
            message: source_message(record).map(str::to_string),
        }
    }
}

/// Where a park starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirstTry {
    /// The view holds the record of this very message (see [`Cycle::SameMessage`]): read it
    /// and answer with it.
    SameMessage(String),
    /// Create this cycle straight away: one request where listing first made two. The create
    /// is still the guard; a 409 (the view was behind) falls back to a consistent list.
    Create(i32),
    /// The view holds this Parked record: read it once to confirm before answering
    /// AlreadyParked (it may have been resolved a moment ago).
    Confirm(String),
}

/// Which cycle to try first, from `known`: the job's records in a view that is a consistent
/// prefix of the apiserver's history (a reflector's store after its initial list), or None.
///
/// Why trusting a possibly stale view is safe: records are only added with increasing
/// cycles and removed by retention, so a view that is behind either misses a newer cycle (the
/// create of that name then fails with 409 and the caller lists consistently) or still holds
/// an older one (its next cycle is then at most the real next one, again a 409).
///
/// Without a view (an external parker, a store not yet synced) cycle 1 is created first:
/// retention deletes a job's cycle 1 only once it is the job's last record
/// (`plan::expired`), so a free cycle-1 name means the job has no records, and a taken one
/// is the 409 that sends the caller to list. Only a human deleting cycle 1 by hand while later
/// cycles exist makes a job start again at cycle 1 (its earlier cycles stay as they are).
pub fn first_try(req: &ParkRequest, known: Option<&[KnownCycle]>) -> FirstTry {
    let Some(known) = known else {
        return FirstTry::Create(req.cycle_after(None));
    };
    let same = || {
        known
            .iter()
            .filter(|k| k.job_id == req.job.id && k.queue == req.queue)
    };
    if let Some(message) = req.reread_of()
        && let Some(record) = same().find(|k| k.message.as_deref() == Some(message))
    {
        return FirstTry::SameMessage(record.name.clone());
    }
    if let Some(parked) = same()
        .find(|k| answers_for_its_job(k.phase, k.action) && req.answered_by(k.message.as_deref()))
    {
        return FirstTry::Confirm(parked.name.clone());
    }
    FirstTry::Create(req.cycle_after(same().map(|k| k.cycle).max()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ParkRequest {
        ParkRequest::new(
            "relayer",
            Job {
                id: "pi_0003/settle".into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
        )
    }

    /// A job moved from elsewhere keeps its cycle: created as at least that cycle, and after it
    /// the next as always.
    #[test]
    fn a_moved_job_keeps_its_cycle() {
        let mut r = req();
        assert_eq!(r.cycle_after(None), 1);
        r.least_cycle = Some(3);
        assert_eq!(r.cycle_after(None), 3);
        assert_eq!(r.cycle_after(Some(1)), 3);
        assert_eq!(r.cycle_after(Some(3)), 4);
        assert_eq!(first_try(&r, None), FirstTry::Create(3));
        assert_eq!(first_try(&r, Some(&[])), FirstTry::Create(3));
        match next_cycle(&r, &[]) {
            Cycle::Next(c) => assert_eq!(c, 3),
            _ => panic!("no record: the next cycle"),
        }
    }

    /// A request whose payload went to the store as the message's own bytes: valid, it parks as
    /// it is; invalid and too large for a record inline, it parks as an Invalid record of those
    /// bytes by reference (refused before, as too large); small enough, inline as always.
    #[test]
    fn an_invalid_request_kept_in_the_store_parks_by_reference() {
        let body = BodyRef {
            reference: "s3://b/p/sha256/ab".into(),
            size: 300_000,
            sha256: "ab".repeat(32),
            ..BodyRef::default()
        };
        let kept = |id: &str| {
            let mut r = req();
            r.job.id = id.into();
            r.job.payload = None;
            r.job.body = Some(Box::new(body.clone()));
            r
        };
        let raw = vec![b'x'; 300_000];
        let valid = kept("j");
        assert_eq!(
            dispose_kept(valid.clone(), &raw, &body),
            Disposition::Park(Box::new(valid))
        );
        let long = "j".repeat(dead_letter::MAX_JOB_ID_LEN + 1);
        assert!(matches!(
            dispose(kept(&long), &raw),
            Disposition::Reject(ParkInvalid::PayloadTooLarge { .. })
        ));
        let Disposition::Park(invalid) = dispose_kept(kept(&long), &raw, &body) else {
            panic!("parked by reference");
        };
        assert_eq!(invalid.failure_kind, FailureKind::Invalid);
        assert_eq!(invalid.job.body.as_deref(), Some(&body));
        assert_eq!(
            (invalid.job.payload, invalid.job.payload_base64),
            (None, None)
        );
        assert!(
            invalid.reason.contains("job id is 254 bytes"),
            "{}",
            invalid.reason
        );
        let small = b"tiny";
        let Disposition::Park(inline) = dispose_kept(kept(&long), small, &body) else {
            panic!("parked inline");
        };
        assert_eq!(inline.job.payload_bytes().ok().as_deref(), Some(&small[..]));
        assert_eq!(inline.job.body, None);
    }

    /// Issue 47: a message passed through without a record is matched by the group its record
    /// would have had, on a sealing queue too (whose records keep a reason without values).
    #[test]
    fn an_arriving_message_has_the_group_its_record_would_have() {
        let mut r = req();
        r.reason = "card 4111 1111 1111 1111 declined: timeout after 30s".into();
        r.sealed_reason = Some("declined: timeout after <n>s".into());
        r.service_version = Some("relayer@1.4.2".into());
        let group = |d: &DeadLetter| crate::group::Key::of(d).fingerprint();
        assert_eq!(group(&arriving(&r, false)), group(&new_record(&r, 1)));
        let sealed = crate::seal::seal_request(r.clone(), &crate::seal::generate_identity().1)
            .expect("seal");
        assert_eq!(group(&arriving(&r, true)), group(&new_record(&sealed, 1)));
        assert_ne!(group(&arriving(&r, true)), group(&arriving(&r, false)));
        assert!(arriving(&r, false).spec.job.payload.is_none(), "no content");
    }

    #[test]
    fn a_message_key_is_the_same_for_every_delivery_of_one_message() {
        let a = message_key("payments", "relayer", Some("relayer:dead#1"), b"x");
        assert_eq!(
            a,
            message_key("payments", "relayer", Some("relayer:dead#1"), b"y")
        );
        assert_ne!(
            a,
            message_key("payments", "relayer", Some("relayer:dead#2"), b"x")
        );
        assert_ne!(
            a,
            message_key("payments", "mailer", Some("relayer:dead#1"), b"x")
        );
        let b = message_key("payments", "relayer", None, b"x");
        assert_eq!(b, message_key("payments", "relayer", None, b"x"));
        assert_ne!(b, message_key("payments", "relayer", None, b"y"));
        assert!(a.starts_with("msg-") && a.len() == 36, "{a}");
    }

    #[test]
    fn names_follow_the_spec() {
        let name = record_name("relayer", "pi_0003/settle", 1);
        assert!(name.starts_with("pi-0003-settle-"), "{name}");
        assert!(name.ends_with("-1"));
        assert_eq!(name.len(), "pi-0003-settle-".len() + 8 + 2);
        assert_eq!(&job_key("relayer", "pi_0003/settle")[..8], &name[15..23]);
        assert_eq!(job_key("relayer", "pi_0003/settle").len(), 16);
        assert_ne!(job_key("relayer", "a"), job_key("other", "a"));
        assert!(record_name("q", "///", 2).starts_with("job-"));
        let long = record_name("q", &"Ab".repeat(200), 12);
        assert!(long.len() <= 63, "{long}");
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let check = |f: &dyn Fn(&mut ParkRequest), want: &str| {
            let mut r = req();
            f(&mut r);
            let err = validate(&r).expect_err(want).to_string();
            assert!(err.contains(want), "{err} should mention {want}");
        };
        check(&|r| r.job.id.clear(), "missing job id");
        check(&|r| r.queue.clear(), "missing queue");
        check(
            &|r| r.queue = "Bad_Queue".into(),
            "not a valid Kubernetes name",
        );
        check(
            &|r| r.job.payload_base64 = Some("YQ==".into()),
            "both payload and payloadBase64",
        );
        check(&|r| r.job.payload = None, "no payload");
        check(&|r| r.job.payload_null = true, "payloadNull and a payload");
        check(
            &|r| r.job.payload = Some("x".repeat(dead_letter::MAX_PAYLOAD_BYTES + 1)),
            "the limit is 262144 bytes",
        );
        check(
            &|r| {
                r.job.payload = None;
                r.job.payload_base64 = Some("!!".into());
            },
            "not valid base64",
        );
        check(
            &|r| {
                r.job.headers.insert("bad header".into(), "v".into());
            },
            "invalid header name",
        );
        check(
            &|r| {
                r.job.headers.insert("x".into(), "a\nb".into());
            },
            "CR, LF or NUL",
        );
        check(&|r| r.deliveries = -1, "deliveries must be >= 0");
        check(
            &|r| r.error_class = Some("E".repeat(257)),
            "errorClass is 257 characters; at most 256",
        );
        assert!(validate(&req()).is_ok());
    }

    #[test]
    fn cycles_follow_earlier_records_of_the_same_job_only() {
        let request = req();
        assert!(matches!(next_cycle(&request, &[]), Cycle::Next(1)));
        let mut first = new_record(&request, 1);
        first.status = Some(crate::dead_letter::DeadLetterStatus {
            phase: Some(Phase::Redriven),
            ..Default::default()
        });
        let mut other = new_record(
            &ParkRequest::new(
                "relayer",
                Job {
                    id: "x".into(),
                    payload: Some("{}".into()),
                    ..Job::default()
                },
            ),
            7,
        );
        other.status = first.status.clone();
        assert!(matches!(
            next_cycle(&request, &[first.clone(), other]),
            Cycle::Next(2)
        ));
        let parked = new_record(&request, 2);
        let existing = [first, parked.clone()];
        assert!(
            matches!(next_cycle(&request, &existing), Cycle::AlreadyParked(r) if r.metadata.name == parked.metadata.name)
        );
        assert_eq!(
            parked
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(dead_letter::LABEL_JOB_KEY)),
            Some(&job_key("relayer", "pi_0003/settle"))
        );
    }

    #[test]
    fn a_parked_record_carries_its_group_and_error_class() {
        use crate::group::{Key, LABEL_GROUP, labelled};
        let mut request = req();
        request.reason = "timeout after 3021 ms talking to payer 7f3a9c21".into();
        let record = new_record(&request, 1);
        let group = labelled(&record).expect("labelled at park");
        assert_eq!(group, Key::of(&record).fingerprint());
        request.reason = "timeout after 15 ms talking to payer 0b11e0aa".into();
        assert_eq!(labelled(&new_record(&request, 2)), Some(group));
        request.error_class = Some("PayerTimeout".into());
        let classed = new_record(&request, 3);
        assert_eq!(classed.spec.error_class.as_deref(), Some("PayerTimeout"));
        assert_ne!(labelled(&classed), Some(group), "the class is part of it");
        let value = classed
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_GROUP));
        assert!(value.is_some_and(|v| v.len() <= 63), "a valid label value");
    }

    #[test]
    fn what_fails_validation_is_parked_invalid_with_its_exact_bytes() {
        let raw = br#"{"id":"e5","payload":"x","headers":{"bad name":"v"}}"#;
        let mut bad = req();
        bad.job.headers.insert("bad name".into(), "v".into());
        let Disposition::Park(parked) = dispose(bad, raw) else {
            panic!("fits in a record");
        };
        assert_eq!(parked.failure_kind, FailureKind::Invalid);
        assert_eq!(parked.job.payload_bytes().expect("bytes"), raw);
        assert!(parked.job.headers.is_empty());
        assert!(
            parked.reason.contains("invalid header name"),
            "{}",
            parked.reason
        );
        assert!(matches!(dispose(req(), b"{}"), Disposition::Park(r) if *r == req()));
    }

    /// What a request that fails validation quotes of the message (the job id it claims, a
    /// header name) is left out of the reason a sealed queue keeps.
    #[test]
    fn an_invalid_request_has_a_reason_without_its_values_for_a_sealed_queue() {
        let mut bad = req();
        bad.job.id = "pan 6011111111111117".into();
        bad.job
            .headers
            .insert("x pan 6011111111111117".into(), "v".into());
        let Disposition::Park(parked) = dispose(bad, b"raw") else {
            panic!("fits in a record");
        };
        assert!(
            parked.reason.contains("6011111111111117"),
            "{}",
            parked.reason
        );
        let sealed = parked.sealed_reason.unwrap_or_default();
        assert_eq!(
            sealed,
            "cannot be parked as the job it names: invalid header name: use RFC 7230 token characters, at most 256; parked with its exact bytes"
        );
        let mut bad = req();
        bad.job
            .headers
            .insert("x-pan".into(), "6011111111111117\n".into());
        let Disposition::Park(parked) = dispose(bad, b"raw") else {
            panic!("fits in a record");
        };
        let sealed = parked.sealed_reason.unwrap_or_default();
        assert!(
            sealed.contains("a header value is invalid: contains CR, LF or NUL")
                && !sealed.contains("x-pan"),
            "{sealed}"
        );
    }

    #[test]
    fn json_errors_are_described_without_the_input() {
        let parse = |raw: &str| {
            serde_json::from_str::<BTreeMap<String, String>>(raw).expect_err("not a map")
        };
        assert_eq!(
            json_error_without_values(&parse(r#"{"a":4242424242424242}"#)),
            "a value of the wrong type (expected a string) at line 1 column 21"
        );
        assert_eq!(
            json_error_without_values(&parse(r#"{"a":"4242, expected 1" 1}"#)),
            "expected `,` or `}` at line 1 column 25",
            "syntax errors are serde_json's fixed words"
        );
        let custom = serde_json::from_str::<jiff::Timestamp>(r#""4242424242424242""#)
            .expect_err("not a time");
        assert_eq!(
            json_error_without_values(&custom),
            "a value that could not be read at line 1 column 18"
        );
    }

    #[test]
    fn only_what_can_never_be_a_record_is_rejected() {
        let raw = vec![b'x'; dead_letter::MAX_PAYLOAD_BYTES + 1];
        let mut big = req();
        big.job.payload = Some(String::from_utf8(raw.clone()).expect("utf8"));
        match dispose(big, &raw) {
            Disposition::Reject(why) => assert_eq!(why.category(), "PayloadTooLarge"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn long_reasons_are_cut_not_refused() {
        let r = bounded_reason(&"é".repeat(5000));
        assert_eq!(r.chars().count(), MAX_REASON);
        assert!(r.ends_with("..."));
    }

    fn known(cycle: i32, phase: Phase) -> KnownCycle {
        KnownCycle {
            name: record_name("relayer", "pi_0003/settle", cycle),
            queue: "relayer".into(),
            job_id: "pi_0003/settle".into(),
            cycle,
            phase,
            action: None,
            message: None,
        }
    }

    #[test]
    fn a_re_read_message_finds_its_record_even_when_resolved() {
        let req = req().with_message("relayer:dead/7f3a");
        let mut mine = known(1, Phase::Redriven);
        mine.message = Some("relayer:dead/7f3a".into());
        let other_death = known(2, Phase::Dropped);
        assert_eq!(
            first_try(&req, Some(&[mine, other_death])),
            FirstTry::SameMessage(record_name("relayer", "pi_0003/settle", 1))
        );
        // A new death of the same job (another message) is the next cycle.
        let new_death = self::req().with_message("relayer:dead/91bc");
        let mut view = [known(1, Phase::Redriven)];
        view[0].message = Some("relayer:dead/7f3a".into());
        assert_eq!(first_try(&new_death, Some(&view)), FirstTry::Create(2));
    }

    #[test]
    fn the_record_carries_the_message_identity_and_next_cycle_finds_it() {
        let req = req().with_message("kafka/orders.DLT/0/17");
        let mut first = new_record(&req, 1);
        first.status = Some(crate::dead_letter::DeadLetterStatus {
            phase: Some(Phase::Redriven),
            ..Default::default()
        });
        assert_eq!(source_message(&first), Some("kafka/orders.DLT/0/17"));
        assert!(matches!(
            next_cycle(&req, std::slice::from_ref(&first)),
            Cycle::SameMessage(_)
        ));
        let again = self::req().with_message("kafka/orders.DLT/0/18");
        assert!(matches!(next_cycle(&again, &[first]), Cycle::Next(2)));
    }

    #[test]
    fn a_retry_after_a_lost_reply_finds_its_record_even_once_resolved() {
        // An AMQP first delivery: its identity is a hash, so it must not match on its own.
        let mut first_delivery = req().with_message("amqp:sha256:ab12");
        first_delivery.redelivered = false;
        let mut created = new_record(&first_delivery, 1);
        created.status = Some(crate::dead_letter::DeadLetterStatus {
            phase: Some(Phase::Dropped),
            ..Default::default()
        });
        let view = [KnownCycle::of(&created)];
        assert_eq!(first_try(&first_delivery, Some(&view)), FirstTry::Create(2));
        assert!(matches!(
            next_cycle(&first_delivery, std::slice::from_ref(&created)),
            Cycle::Next(2)
        ));

        // The create was stored, its reply lost, and a human dropped the record meanwhile:
        // the retry is the same message, not the job dying again.
        let mut retry = first_delivery.clone();
        retry.retrying();
        assert_eq!(
            first_try(&retry, Some(&view)),
            FirstTry::SameMessage(created.metadata.name.clone().unwrap_or_default())
        );
        assert!(matches!(
            next_cycle(&retry, std::slice::from_ref(&created)),
            Cycle::SameMessage(_)
        ));

        // Without an identity there is nothing to match: retrying changes nothing.
        let mut anonymous = req();
        anonymous.retrying();
        assert!(!anonymous.redelivered);
    }

    #[test]
    fn long_message_identities_are_hashed_and_invalid_requests_keep_them() {
        let req = req().with_message("x".repeat(400));
        let id = req.message.clone().unwrap_or_default();
        assert!(id.starts_with("sha256:") && id.len() < crate::dead_letter::MAX_SOURCE_MESSAGE_LEN);
        let mut bad = req.clone();
        bad.job.id = String::new();
        let Disposition::Park(invalid) = dispose(bad, b"raw") else {
            panic!("an invalid request is parked as Invalid")
        };
        assert_eq!(invalid.message, req.message);
    }

    #[test]
    fn an_own_death_beside_a_parked_record_of_its_job_is_the_next_cycle() {
        let mut second = req().with_message("sidekiq#2");
        second.own_death = true;
        let mut first = known(1, Phase::Parked);
        first.message = Some("sidekiq#1".into());
        assert_eq!(
            first_try(&second, Some(std::slice::from_ref(&first))),
            FirstTry::Create(2)
        );
        let mut parked = new_record(&req().with_message("sidekiq#1"), 1);
        parked.status = None;
        assert!(matches!(
            next_cycle(&second, std::slice::from_ref(&parked)),
            Cycle::Next(2)
        ));
        // Its own record, re-read, still answers for it; without the flag the Parked one does.
        let again = new_record(&second, 2);
        assert!(matches!(
            next_cycle(&second, &[parked.clone(), again]),
            Cycle::SameMessage(_)
        ));
        second.own_death = false;
        assert!(matches!(
            next_cycle(&second, &[parked]),
            Cycle::AlreadyParked(_)
        ));
    }

    /// A job redriven and dead again before its record says Redriven (a consumer failing
    /// within milliseconds): the Parked record with its redrive decided no longer answers for
    /// the job, so the death is the next cycle, not a duplicate acknowledged and lost. A
    /// Parked record without a decision, or with a drop, still answers (the same death twice).
    #[test]
    fn a_death_beside_a_record_whose_redrive_is_decided_is_the_next_cycle() {
        let again = req().with_message("m#2");
        let mut first = known(1, Phase::Parked);
        first.action = Some(Action::Redrive);
        assert_eq!(
            first_try(&again, Some(std::slice::from_ref(&first))),
            FirstTry::Create(2)
        );
        let mut parked = new_record(&req().with_message("m#1"), 1);
        parked.status = None;
        assert!(matches!(
            next_cycle(&again, std::slice::from_ref(&parked)),
            Cycle::AlreadyParked(_)
        ));
        parked.spec.action = Some(Action::Redrive);
        assert!(matches!(
            next_cycle(&again, std::slice::from_ref(&parked)),
            Cycle::Next(2)
        ));
        first.action = Some(Action::Drop);
        assert_eq!(
            first_try(&again, Some(std::slice::from_ref(&first))),
            FirstTry::Confirm(first.name.clone())
        );
    }

    #[test]
    fn without_a_view_the_parker_creates_cycle_one_first() {
        assert_eq!(first_try(&req(), None), FirstTry::Create(1));
    }

    #[test]
    fn a_job_the_view_never_saw_creates_cycle_one() {
        assert_eq!(first_try(&req(), Some(&[])), FirstTry::Create(1));
    }

    #[test]
    fn resolved_cycles_in_the_view_give_the_next_cycle() {
        let view = [known(1, Phase::Redriven), known(3, Phase::Dropped)];
        assert_eq!(first_try(&req(), Some(&view)), FirstTry::Create(4));
    }

    #[test]
    fn retention_gaps_still_count_from_the_highest_cycle() {
        // cycle 1 deleted by retention; cycle 2 resolved: the next is 3, never 1 again.
        let view = [known(2, Phase::Redriven)];
        assert_eq!(first_try(&req(), Some(&view)), FirstTry::Create(3));
    }

    #[test]
    fn a_parked_record_in_the_view_is_confirmed_not_trusted() {
        let view = [known(1, Phase::Redriven), known(2, Phase::Parked)];
        assert_eq!(
            first_try(&req(), Some(&view)),
            FirstTry::Confirm(record_name("relayer", "pi_0003/settle", 2))
        );
    }

    #[test]
    fn other_jobs_in_the_view_are_ignored() {
        let mut other = known(5, Phase::Parked);
        other.job_id = "pi_0004/settle".into();
        assert_eq!(first_try(&req(), Some(&[other])), FirstTry::Create(1));
    }

    #[test]
    fn known_cycle_reads_a_record() {
        let r = new_record(&req(), 2);
        let k = KnownCycle::of(&r);
        assert_eq!(
            (k.cycle, k.phase, k.job_id.as_str()),
            (2, Phase::Parked, "pi_0003/settle")
        );
        assert_eq!(k.name, record_name("relayer", "pi_0003/settle", 2));
    }

    #[test]
    fn a_null_value_is_a_payload_and_stays_null_when_parked_invalid() {
        let mut r = req();
        r.job = Job::null_value("tomb");
        assert_eq!(validate(&r), Ok(()));
        r.job.headers.insert("x".into(), "a\nb".into());
        let Disposition::Park(parked) = dispose(r, b"") else {
            panic!("a null value with a bad header is parked Invalid");
        };
        assert_eq!(parked.failure_kind, FailureKind::Invalid);
        assert!(parked.job.payload_null && parked.job.payload.is_none());
    }

    #[test]
    fn a_final_refusal_falls_back_to_the_exact_bytes_then_to_nothing() {
        assert!(refusal_is_final(422) && refusal_is_final(400) && refusal_is_final(413));
        for code in [403, 404, 409, 429, 500, 503, 504] {
            assert!(!refusal_is_final(code), "{code} may change");
        }
        let mut r = req();
        r.job.headers.insert("trace".into(), "t-1".into());
        r.job.origin = Some(Box::new(dead_letter::Origin {
            partition: Some(-1),
            ..dead_letter::Origin::default()
        }));
        r.service_version = Some("v1".into());
        r = r.with_message("kafka:dlt/0/7");
        let raw = b"\xffraw";
        let first = after_refusal(&r, raw, "spec.job.origin.partition: Invalid value: -1", 0)
            .expect("a first fallback");
        assert_eq!(first.failure_kind, FailureKind::Invalid);
        assert_eq!(first.job.id, r.job.id);
        assert_eq!(first.job.payload_bytes().expect("bytes"), raw);
        assert_eq!(first.job.headers, r.job.headers);
        assert_eq!(
            (first.job.origin.as_ref(), first.service_version.as_ref()),
            (None, None)
        );
        assert!(
            first.reason.contains("Invalid value: -1"),
            "{}",
            first.reason
        );
        assert_eq!(first.message, r.message);
        assert_eq!(validate(&first), Ok(()));
        let second = after_refusal(&first, raw, "still no", 1).expect("a second fallback");
        assert!(second.job.id.starts_with("invalid-") && second.job.headers.is_empty());
        assert_eq!(second.message, r.message);
        assert_eq!(after_refusal(&second, raw, "no", 2), None);
        let long = "x".repeat(5000);
        let capped = after_refusal(&r, raw, &long, 0).expect("fallback");
        assert_eq!(validate(&capped), Ok(()), "a long refusal is cut to fit");
    }

    #[test]
    fn an_invalid_record_keeps_the_headers_of_its_bytes_and_says_so() {
        let mut r = req();
        r.job.id = "x".repeat(300);
        r.job.headers.insert("trace".into(), "t-1".into());
        let Disposition::Park(p) = dispose(r.clone(), b"{}") else {
            panic!("parked");
        };
        assert_eq!(p.job.headers.get("trace").map(String::as_str), Some("t-1"));
        assert!(
            p.reason.ends_with("its exact bytes and headers"),
            "{}",
            p.reason
        );
        // An envelope's headers are not those of the bytes parked.
        let Disposition::Park(p) = dispose(r.clone(), b"{\"envelope\":1}") else {
            panic!("parked");
        };
        assert!(p.job.headers.is_empty() && p.reason.ends_with("its exact bytes"));
        r.job.headers.insert("bad".into(), "a\nb".into());
        let Disposition::Park(p) = dispose(r, b"{}") else {
            panic!("parked");
        };
        assert!(p.job.headers.is_empty());
        assert!(
            p.reason.contains("headers could not be held"),
            "{}",
            p.reason
        );
    }
}
