//! Sidekiq's job JSON: how a job of the `dead` sorted set becomes a park request, and which
//! queue a redriven job goes back to. The job's bytes are the record's payload, untouched;
//! the facts are read beside them: job id = `jid`, deliveries = `retry_count` + 1, reason =
//! `error_class: error_message` (and `error_class` as the record's error class), failed at =
//! `failed_at`, and the Sidekiq queue and job class as the job's origin. Anything that is not a Sidekiq job is an Invalid record of its exact bytes.

use serde::Deserialize;

use crate::dead_letter::{FailureKind, Job, Origin};
use crate::json::{self, NotObject};
use crate::park::{ParkRequest, invalid_request, json_error_without_values};

/// Longest reason a record holds (its schema's bound).
const MAX_REASON_CHARS: usize = 1024;

/// The fields of a dead job the record reads; the rest travels in the payload.
#[derive(Debug, Deserialize)]
struct DeadJob {
    jid: String,
    #[serde(default)]
    class: Option<String>,
    /// ActiveJob's own class, inside its one Sidekiq wrapper class.
    #[serde(default)]
    wrapped: Option<String>,
    #[serde(default)]
    queue: Option<String>,
    #[serde(default)]
    retry_count: Option<i64>,
    #[serde(default)]
    error_class: Option<String>,
    #[serde(default)]
    error_message: Option<String>,
    #[serde(default)]
    failed_at: Option<f64>,
}

/// The members of [`DeadJob`].
const DEAD_JOB_FIELDS: &[&str] = &[
    "jid",
    "class",
    "wrapped",
    "queue",
    "retry_count",
    "error_class",
    "error_message",
    "failed_at",
];

/// How full Sidekiq's dead set may grow while a source collects it, given Sidekiq's
/// `dead_max_jobs` (the size at which it drops the oldest dead jobs silently). Well below
/// that, the source moves its oldest dead jobs into a list of its own that Sidekiq never trims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadSetBounds {
    /// Above this many (half the trim) the source moves jobs out...
    pub high: u64,
    /// ...until the set holds this many (a quarter): it moves in batches, not a job a look.
    pub low: u64,
    /// At or above this many (80% of the trim) moving has not kept the set down (jobs no
    /// filter takes, or a Redis too slow): the source warns.
    pub near_trim: u64,
}

impl DeadSetBounds {
    pub fn for_trim(dead_max_jobs: u64) -> Self {
        DeadSetBounds {
            high: dead_max_jobs / 2,
            low: dead_max_jobs / 4,
            near_trim: (dead_max_jobs.saturating_mul(4) / 5).max(1),
        }
    }

    /// How many jobs to move out of a set that holds `size`: none at or below `high`.
    pub fn to_move(&self, size: u64) -> u64 {
        if size > self.high { size - self.low } else { 0 }
    }

    pub fn is_near_trim(&self, size: u64) -> bool {
        size >= self.near_trim
    }
}

/// Turns one member of the `dead` set into a park request for DeadLetterQueue `queue`.
pub fn request_for(queue: &str, raw: &[u8]) -> ParkRequest {
    // Through an object of the members read (serde would read a JSON array as the fields in
    // order); `args`, which may be large, is never read into values (`crate::json`).
    let members = match json::members(raw) {
        Ok(members) => members,
        Err(NotObject::Syntax(e)) => return not_json(queue, raw, &e),
        Err(NotObject::Shape(_)) => return invalid(queue, raw, "not a JSON object".into()),
    };
    let job = match json::object(&members, DEAD_JOB_FIELDS, false) {
        Ok(value) => serde_json::from_value::<DeadJob>(value),
        Err(too_large) => return invalid(queue, raw, too_large.to_string()),
    };
    let job = match job {
        Ok(job) => job,
        Err(e) => return not_json(queue, raw, &e),
    };
    if job.jid.trim().is_empty() {
        return invalid(queue, raw, "its jid is empty".into());
    }
    let origin = Origin {
        queue: job.queue.clone(),
        class: job.wrapped.clone().or_else(|| job.class.clone()),
        ..Origin::default()
    };
    // The job's exact JSON is the payload: left in the member when larger than a record holds.
    let mut req = ParkRequest::of_message(
        queue,
        Job {
            id: job.jid.clone(),
            origin: Some(Box::new(origin)),
            ..Job::default()
        },
        raw,
    );
    req.deliveries = job
        .retry_count
        .map_or(1, |c| c.saturating_add(1))
        .clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32;
    req.reason = reason(&job);
    // The class groups failures (`crate::group`) apart from the message's ids.
    req.error_class = job
        .error_class
        .as_deref()
        .and_then(crate::group::bounded_error_class);
    req.failure_kind = FailureKind::Transient;
    req.failed_at = job.failed_at.and_then(timestamp);
    // Two members of the dead set are two deaths (their bytes differ), even with one jid.
    req.own_death = true;
    req
}

/// The queue a job goes back to: its own `queue` field, as Sidekiq's client reads it.
pub fn job_queue(payload: &[u8]) -> Result<String, String> {
    let members = match json::members(payload) {
        Ok(members) => members,
        Err(NotObject::Syntax(e)) => return Err(format!("not a Sidekiq job: {e}")),
        Err(NotObject::Shape(_)) => return Err("not a Sidekiq job: it names no queue".into()),
    };
    let queue = members.get("queue").map(|q| json::value("queue", q));
    match queue {
        Some(Ok(serde_json::Value::String(queue))) if !queue.is_empty() => Ok(queue),
        _ => Err("not a Sidekiq job: it names no queue".into()),
    }
}

/// The backtrace a dead job carries (`backtrace` option), for display: Sidekiq 6 and later
/// store it as base64 of zlib-deflated JSON, older versions as a JSON array. None when the job
/// has none; `Err` when it is there but does not decode. The payload itself is never changed.
pub fn backtrace(payload: &[u8]) -> Option<Result<Vec<String>, String>> {
    let members = json::members(payload).ok()?;
    match json::value("error_backtrace", members.get("error_backtrace")?) {
        Ok(serde_json::Value::String(packed)) => Some(inflate(&packed)),
        Ok(lines @ serde_json::Value::Array(_)) => {
            Some(serde_json::from_value(lines).map_err(|e| e.to_string()))
        }
        Ok(_) => Some(Err("error_backtrace is neither text nor a list".into())),
        Err(too_large) => Some(Err(too_large.to_string())),
    }
}

fn inflate(packed: &str) -> Result<Vec<String>, String> {
    use base64::Engine;
    use std::io::Read;
    // Ruby's Base64.encode64 breaks lines every 60 characters.
    let text: String = packed
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    let deflated = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("error_backtrace is not base64: {e}"))?;
    let mut json = Vec::new();
    flate2::read::ZlibDecoder::new(&deflated[..])
        .read_to_end(&mut json)
        .map_err(|e| format!("error_backtrace does not inflate: {e}"))?;
    serde_json::from_slice(&json).map_err(|e| format!("error_backtrace is not a JSON list: {e}"))
}

fn reason(job: &DeadJob) -> String {
    let text = match (&job.error_class, &job.error_message) {
        (Some(class), Some(message)) => format!("{class}: {message}"),
        (Some(class), None) => class.clone(),
        (None, Some(message)) => message.clone(),
        (None, None) => "moved to the dead set without an error (killed by hand?)".into(),
    };
    if text.chars().count() <= MAX_REASON_CHARS {
        return text;
    }
    let mut cut: String = text.chars().take(MAX_REASON_CHARS - 3).collect();
    cut.push_str("...");
    cut
}

/// Sidekiq's times are float seconds since the epoch.
fn timestamp(seconds: f64) -> Option<jiff::Timestamp> {
    if !seconds.is_finite() {
        return None;
    }
    jiff::Timestamp::from_microsecond((seconds * 1e6).round() as i64).ok()
}

fn invalid(queue: &str, raw: &[u8], why: String) -> ParkRequest {
    invalid_request(queue, raw, format!("not a Sidekiq job: {why}"))
}

/// An Invalid record for a parse error: serde's words quote the offending value, so a sealed
/// queue's record says what was wrong without it.
fn not_json(queue: &str, raw: &[u8], e: &serde_json::Error) -> ParkRequest {
    let mut req = invalid(queue, raw, e.to_string());
    req.sealed_reason = Some(format!(
        "not a Sidekiq job: {}",
        json_error_without_values(e)
    ));
    req
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::park::{Disposition, dispose};

    const DEAD: &[u8] = br#"{"retry":0,"queue":"payments","class":"SettleJob","args":["pi_0003"],"jid":"b4a577edbccf1d805744efa9","created_at":1764670000.123456,"enqueued_at":1764670000.1236,"error_message":"gateway timeout","error_class":"Net::ReadTimeout","failed_at":1764670001.5,"retry_count":2}"#;

    #[test]
    fn the_dead_set_is_emptied_to_a_quarter_of_the_trim_once_above_half() {
        let b = DeadSetBounds::for_trim(10_000);
        assert_eq!((b.high, b.low, b.near_trim), (5_000, 2_500, 8_000));
        assert_eq!(b.to_move(0), 0);
        assert_eq!(b.to_move(5_000), 0, "at half: left to the take");
        assert_eq!(b.to_move(5_001), 2_501, "just above: down to a quarter");
        assert_eq!(b.to_move(9_999), 7_499);
        assert!(!b.is_near_trim(7_999) && b.is_near_trim(8_000));
        let small = DeadSetBounds::for_trim(300);
        assert_eq!((small.high, small.low, small.near_trim), (150, 75, 240));
        assert_eq!(small.to_move(151), 76);
    }

    #[test]
    fn a_tiny_trim_moves_every_job_and_warns_only_when_one_waits() {
        let b = DeadSetBounds::for_trim(1);
        assert_eq!(b.to_move(1), 1, "Sidekiq keeps none: move each at once");
        assert_eq!(b.to_move(0), 0);
        assert!(!b.is_near_trim(0), "an empty set is never near the trim");
        assert!(b.is_near_trim(1));
    }

    #[test]
    fn a_dead_job_becomes_a_record_of_its_exact_json() {
        let r = request_for("relayer", DEAD);
        assert_eq!(r.job.id, "b4a577edbccf1d805744efa9");
        assert_eq!(r.job.payload_bytes().expect("bytes"), DEAD);
        assert_eq!(r.deliveries, 3, "retry_count + 1");
        assert_eq!(r.reason, "Net::ReadTimeout: gateway timeout");
        assert_eq!(r.error_class.as_deref(), Some("Net::ReadTimeout"));
        assert_eq!(r.failure_kind, FailureKind::Transient);
        assert_eq!(
            r.failed_at.map(|t| t.as_millisecond()),
            Some(1_764_670_001_500)
        );
        let origin = r.job.origin.expect("origin");
        assert_eq!(origin.queue.as_deref(), Some("payments"));
        assert_eq!(origin.class.as_deref(), Some("SettleJob"));
        assert_eq!(job_queue(DEAD).as_deref(), Ok("payments"));
    }

    /// serde's words for a jid that is a number quote it: the reason a sealed queue keeps
    /// does not.
    #[test]
    fn a_job_that_does_not_parse_is_described_without_its_values_for_a_sealed_queue() {
        let r = request_for("relayer", br#"{"jid":4242424242424242,"queue":"q"}"#);
        assert_eq!(r.failure_kind, FailureKind::Invalid);
        assert!(r.reason.contains("4242424242424242"), "{}", r.reason);
        assert_eq!(
            r.sealed_reason.as_deref(),
            Some("not a Sidekiq job: a value of the wrong type (expected a string)")
        );
    }

    #[test]
    fn a_job_without_retries_or_error_still_parks() {
        let raw = br#"{"jid":"j1","queue":"default","class":"K","args":[]}"#;
        let r = request_for("relayer", raw);
        assert_eq!(r.deliveries, 1);
        assert!(r.reason.contains("without an error"));
        assert!(r.failed_at.is_none());
        let active_job = br#"{"jid":"j2","queue":"default","class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"SettleJob"}"#;
        let origin = request_for("relayer", active_job)
            .job
            .origin
            .expect("origin");
        assert_eq!(
            origin.class.as_deref(),
            Some("SettleJob"),
            "ActiveJob's own class"
        );
    }

    #[test]
    fn long_reasons_are_cut_to_what_a_record_holds() {
        let raw = format!(
            r#"{{"jid":"j","queue":"q","error_class":"E","error_message":"{}"}}"#,
            "é".repeat(5000)
        );
        let r = request_for("relayer", raw.as_bytes());
        assert_eq!(r.reason.chars().count(), MAX_REASON_CHARS);
        assert!(
            matches!(dispose(r, raw.as_bytes()), Disposition::Park(p) if p.failure_kind == FailureKind::Transient)
        );
    }

    #[test]
    fn anything_else_is_invalid_with_its_exact_bytes() {
        for raw in [
            &b"{not json"[..],
            b"\xff\x00",
            br#"["a"]"#,
            br#"{"queue":"q"}"#,
            br#"{"jid":""}"#,
            br#"{"jid":7}"#,
        ] {
            let r = request_for("relayer", raw);
            assert_eq!(r.failure_kind, FailureKind::Invalid, "{raw:?}");
            assert_eq!(r.job.payload_bytes().expect("bytes"), raw);
            assert!(r.reason.starts_with("not a Sidekiq job"), "{}", r.reason);
        }
        assert!(job_queue(b"{}").is_err());
        assert!(job_queue(br#"["q"]"#).is_err());
        assert!(job_queue(br#"{"queue":""}"#).is_err());
    }

    /// What Sidekiq 6.4's `compress_backtrace` wrote for `["a.rb:1:in `x'", "b.rb:2"]`.
    #[test]
    fn backtraces_decode_for_display() {
        let packed =
            r#"{"jid":"j","error_backtrace":"eJyLVkrUK0qyMrTKzFNIqFBX0lFKAvGNlGIBZEUHOw==\n"}"#;
        assert_eq!(
            backtrace(packed.as_bytes()),
            Some(Ok(vec!["a.rb:1:in `x'".to_string(), "b.rb:2".to_string()]))
        );
        let plain = br#"{"jid":"j","error_backtrace":["a.rb:1"]}"#;
        assert_eq!(backtrace(plain), Some(Ok(vec!["a.rb:1".to_string()])));
        assert_eq!(backtrace(br#"{"jid":"j"}"#), None);
        assert!(matches!(
            backtrace(br#"{"error_backtrace":"!!"}"#),
            Some(Err(_))
        ));
    }

    #[test]
    fn a_jid_too_long_for_a_record_is_parked_invalid() {
        let raw = format!(r#"{{"jid":"{}","queue":"q"}}"#, "j".repeat(300));
        let Disposition::Park(r) = dispose(request_for("relayer", raw.as_bytes()), raw.as_bytes())
        else {
            panic!("fits in a record");
        };
        assert_eq!(r.failure_kind, FailureKind::Invalid);
        assert_eq!(r.job.payload_bytes().expect("bytes"), raw.as_bytes());
    }
}
