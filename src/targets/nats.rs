//! NATS target: a JetStream publish that waits for the stream's PubAck (or, with
//! `jetStream: false`, a core publish confirmed only by the server's flush).
//!
//! Headers: each job header becomes a NATS header of the same name and value. NATS allows a
//! header several values; the source bridge keeps such headers in one job header,
//! `nats-multi` (a JSON object of name to list of values), which is expanded again by the
//! broker's codec ([`crate::broker::nats`]).
//!
//! # The duplicate window
//!
//! A job that carries `Nats-Msg-Id` is deduplicated by JetStream for the stream's duplicate
//! window (2 minutes by default). A redrive inside that window would be acknowledged with
//! `duplicate: true` and silently not stored. The redrive keeps the header (the job is sent
//! untouched) and reads the PubAck instead:
//! - the duplicate is the dead message itself (same stream and sequence as the record's
//!   origin), or the record has no origin to compare with: the redrive is a failure with reason
//!   `DuplicateWindow` (condition `Requeued=False` + Warning Event). The record stays Parked and
//!   is retried with backoff, so it goes through by itself once the window has passed.
//! - the duplicate is a newer message with the same id (an earlier attempt of this redrive
//!   whose PubAck was lost): the job is in the stream, so the redrive succeeded.
//!
//! A job without a `Nats-Msg-Id` of its own gets the redrive's idempotency key as one: a
//! second enqueue of the same redrive (its status write failed, the operator was killed before
//! it) is then dropped by JetStream within the window, and its `duplicate: true` PubAck means
//! the job is already stored: a success.
//!
//! While the client is reconnecting nothing is published: a publish buffered during an outage
//! would land later, after the redrive had been reported failed and retried.

use futures::future::BoxFuture;

use super::{JobMessage, Target, TargetError};
use crate::broker::nats::{NatsConn, REQUEST_TIMEOUT, nats_headers, publish_error};
use dlq_core::api::{self, Route};

/// JetStream's deduplication header.
const MSG_ID: &str = "Nats-Msg-Id";

/// The job's own `Nats-Msg-Id`, if it carries one (any case).
fn own_msg_id(job: &JobMessage) -> Option<&str> {
    job.headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(MSG_ID))
        .map(|(_, v)| v.as_str())
}

/// The `Nats-Msg-Id` a JetStream redrive adds: its idempotency key, when the job has no id of
/// its own (which it keeps, untouched), so JetStream stores one copy of every enqueue of one
/// redrive within the stream's duplicate window.
pub fn redrive_msg_id(job: &JobMessage) -> Option<&str> {
    match own_msg_id(job) {
        Some(_) => None,
        None => job.idempotency_key.as_deref(),
    }
}

/// Subject for `job` under `route`.
pub fn address<'a>(route: Route, job: &'a JobMessage, subject: &'a str) -> &'a str {
    if route == Route::Origin
        && let Some(s) = job.origin.as_ref().and_then(|o| o.subject.as_deref())
    {
        return s;
    }
    subject
}

/// What a `duplicate: true` PubAck means for this redrive (see the module doc).
pub fn judge_duplicate(
    job: &JobMessage,
    stream: &str,
    sequence: u64,
) -> Result<&'static str, TargetError> {
    let Some(id) = own_msg_id(job) else {
        // The id was this redrive's idempotency key: an earlier enqueue of it is stored.
        return Ok("an earlier enqueue of this redrive (same idempotency key) is in the stream");
    };
    let origin = job.origin.as_ref();
    let same_stream = origin.and_then(|o| o.stream.as_deref()) == Some(stream);
    let origin_seq = origin.and_then(|o| o.sequence);
    match origin_seq {
        Some(seq) if same_stream && u64::try_from(seq).ok() != Some(sequence) => {
            Ok("a newer message with this Nats-Msg-Id is already in the stream")
        }
        Some(_) if same_stream => Err(TargetError::Duplicate(format!(
            "JetStream discarded the redrive as a duplicate: Nats-Msg-Id {id} of the dead message (stream {stream} sequence {sequence}) is still inside the stream's duplicate window; it goes through once the window has passed"
        ))),
        _ => Err(TargetError::Duplicate(format!(
            "JetStream discarded the redrive as a duplicate: stream {stream} already holds Nats-Msg-Id {id} (sequence {sequence}) inside its duplicate window; it goes through once the window has passed"
        ))),
    }
}

pub struct NatsTarget {
    conn: NatsConn,
    subject: String,
    jet_stream: bool,
    route: Route,
}

impl NatsTarget {
    pub fn new(spec: &api::NatsTargetSpec, url: &str) -> Result<Self, TargetError> {
        Ok(NatsTarget {
            conn: NatsConn::new(url)?,
            subject: spec.subject.clone(),
            jet_stream: spec.jet_stream(),
            route: spec.route.unwrap_or_default(),
        })
    }
}

impl Target for NatsTarget {
    fn describe(&self) -> String {
        let kind = if self.jet_stream {
            "nats jetstream"
        } else {
            "nats"
        };
        let origin = match self.route {
            Route::Origin => " (or the record's origin)",
            Route::Target => "",
        };
        format!("{kind} subject {}{origin}", self.subject)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let mut headers = nats_headers(&job.headers_with_key())?;
            if self.jet_stream
                && let Some(key) = redrive_msg_id(job)
            {
                headers.insert(MSG_ID, key);
            }
            let subject = address(self.route, job, &self.subject).to_string();
            let payload = job.payload.clone();
            let client = self.conn.get().await?;
            if !self.jet_stream {
                client
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .map_err(|e| TargetError::Unreachable(format!("NATS publish: {e}")))?;
                return tokio::time::timeout(REQUEST_TIMEOUT, client.flush())
                    .await
                    .map_err(|_| TargetError::Unreachable("NATS flush timed out".into()))?
                    .map_err(|e| TargetError::Unreachable(format!("NATS flush: {e}")));
            }
            let js = async_nats::jetstream::new(client);
            let ack = js
                .publish_with_headers(subject.clone(), headers, payload)
                .await
                .map_err(|e| publish_error(e, &subject))?
                .await
                .map_err(|e| publish_error(e, &subject))?;
            if ack.duplicate {
                let why = judge_duplicate(job, &ack.stream, ack.sequence)?;
                tracing::info!(job = %job.id, stream = %ack.stream, sequence = ack.sequence, "redrive was a JetStream duplicate: {why}");
            }
            Ok(())
        })
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        Box::pin(async move {
            let client = self.conn.get().await?;
            if !self.jet_stream {
                return Ok(());
            }
            let js = async_nats::jetstream::new(client);
            match js.stream_by_subject(self.subject.clone()).await {
                Ok(_) => Ok(()),
                Err(e) => Err(TargetError::Refused(format!(
                    "no JetStream stream for subject {}: {e}",
                    self.subject
                ))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::broker::nats::{MULTI_HEADER, carried_headers, parse_header_block};
    use dlq_core::api::Origin;

    fn job(origin: Option<Origin>) -> JobMessage {
        JobMessage {
            id: "j".into(),
            payload: b"p".to_vec().into(),
            null_payload: false,
            headers: BTreeMap::from([("Nats-Msg-Id".to_string(), "m1".to_string())]),
            origin,
            idempotency_key: None,
            key_header: None,
        }
    }

    #[test]
    fn headers_round_trip_with_multiple_values_and_without_preconditions() {
        let block = b"NATS/1.0\r\nNats-Msg-Id: m1\r\nx-trace: abc\r\nx-tag: a\r\nx-tag: b\r\nNats-Expected-Last-Sequence: 41\r\n\r\n";
        let parsed = parse_header_block(block).unwrap();
        assert_eq!(parsed["x-tag"], ["a", "b"]);
        let (carried, lost) = carried_headers(&parsed);
        assert!(lost.is_empty());
        assert_eq!(carried["Nats-Msg-Id"], "m1");
        assert_eq!(carried["x-trace"], "abc");
        assert_eq!(carried[MULTI_HEADER], r#"{"x-tag":["a","b"]}"#);
        assert!(!carried.keys().any(|k| k.starts_with("Nats-Expected")));
        let back = nats_headers(&carried).unwrap();
        let tags: Vec<&str> = back.get_all("x-tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);
        assert_eq!(back.get("Nats-Msg-Id").map(|v| v.as_str()), Some("m1"));
        assert!(parse_header_block(b"HTTP/1.1 200\r\n").is_err());
    }

    #[test]
    fn a_duplicate_of_the_dead_message_is_a_failure_a_newer_copy_is_not() {
        let origin = Origin {
            stream: Some("JOBS".into()),
            subject: Some("jobs.a".into()),
            sequence: Some(7),
            ..Origin::default()
        };
        let err = judge_duplicate(&job(Some(origin.clone())), "JOBS", 7).unwrap_err();
        assert_eq!(err.reason(), "DuplicateWindow");
        assert!(err.to_string().contains("m1"), "{err}");
        assert!(judge_duplicate(&job(Some(origin)), "JOBS", 9).is_ok());
        assert!(judge_duplicate(&job(None), "JOBS", 9).is_err());
    }

    #[test]
    fn a_job_without_an_id_of_its_own_gets_the_redrive_key_and_its_duplicate_is_stored() {
        let mut own = job(None);
        own.idempotency_key = Some("u-1-1".into());
        assert_eq!(redrive_msg_id(&own), None, "the job's own id stays");
        let mut bare = own.clone();
        bare.headers.clear();
        assert_eq!(redrive_msg_id(&bare), Some("u-1-1"));
        assert!(
            judge_duplicate(&bare, "JOBS", 3).is_ok(),
            "an earlier enqueue is stored"
        );
        bare.idempotency_key = None;
        assert_eq!(redrive_msg_id(&bare), None);
    }

    #[test]
    fn origin_subject_wins_unless_the_route_says_target() {
        let j = job(Some(Origin {
            subject: Some("jobs.b".into()),
            ..Origin::default()
        }));
        assert_eq!(address(Route::Origin, &j, "jobs.a"), "jobs.b");
        assert_eq!(address(Route::Target, &j, "jobs.a"), "jobs.a");
        assert_eq!(address(Route::Origin, &job(None), "jobs.a"), "jobs.a");
    }
}
