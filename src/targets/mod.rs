//! Targets: where redrive puts a job back. A [`Target`] enqueues a parked job and answers only
//! once the broker has confirmed it; [`Targets`] gives a DeadLetterQueue's target.
//!
//! One file per backend: [`redis`], [`amqp`] (RabbitMQ), [`nats`] (JetStream or core NATS) and
//! [`http`] (the consumer's own endpoint), [`sqs`] (Amazon SQS), [`kafka`], [`sidekiq`] (the job's
//! own Sidekiq queue), [`pubsub`] (Google Cloud Pub/Sub); [`cache`] builds them from a queue's spec and Secrets and keeps their
//! connections; [`enqueue`] is the one way a job is put on one, for a redrive and a
//! pass-through alike. docs/backends.md describes what each one carries. The Kafka,
//! SQS and Pub/Sub backends are cargo features (`kafka`, `sqs`, `pubsub`, on by default); a build without one answers
//! a queue naming it with [`crate::broker::not_built`].

pub mod amqp;
pub mod cache;
pub mod enqueue;
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nats;
#[cfg(feature = "pubsub")]
pub mod pubsub;
pub mod redis;
pub mod sidekiq;
#[cfg(feature = "sqs")]
pub mod sqs;

use std::borrow::Cow;
use std::collections::BTreeMap;

use futures::future::BoxFuture;

use dlq_core::api::{DeadLetterQueue, Job, Origin};

use crate::broker::BrokerError;

/// The untouched job as it goes back to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobMessage {
    pub id: String,
    /// Shared, not copied, by a target whose client takes `Bytes`.
    pub payload: bytes::Bytes,
    /// No value at all (a Kafka tombstone), not an empty `payload`: only a target that
    /// [`Target::carries_null_payload`] sends it.
    pub null_payload: bool,
    pub headers: BTreeMap<String, String>,
    /// Where the broker says it was published before it died, when it was collected from one.
    pub origin: Option<Origin>,
    /// The redrive's idempotency key (`dlq_core::decide::redrive_key`: record uid and cycle):
    /// the same for every enqueue of one redrive, a new one for the next cycle of the job. It
    /// keys SQS FIFO deduplication and JetStream's `Nats-Msg-Id` (when the job has none), and
    /// goes in [`JobMessage::key_header`].
    pub idempotency_key: Option<String>,
    /// The header that carries [`JobMessage::idempotency_key`] beside the job's own headers
    /// (the queue's `spec.target.idempotencyKeyHeader`); None: not carried.
    pub key_header: Option<String>,
}

impl JobMessage {
    /// Refuses a null job to a target that would send it as an empty value instead, and a
    /// Pub/Sub message parked whole to a target that would send its JSON instead.
    pub fn check_carried_by(&self, target: &dyn Target) -> Result<(), TargetError> {
        if self.null_payload && !target.carries_null_payload() {
            return Err(TargetError::NullNotCarried(format!(
                "job {} has no value at all (a Kafka tombstone); {} would send an empty one instead: redrive it to a Kafka target, or drop it",
                self.id,
                target.describe()
            )));
        }
        if self
            .headers
            .contains_key(dlq_core::headers::pubsub::WHOLE_HEADER)
            && !target.publishes_whole_pubsub_messages()
        {
            return Err(TargetError::Unsupported(format!(
                "job {} is a whole Pub/Sub message (its payload holds its data and attributes as JSON); {} would send that JSON instead: redrive it to a Pub/Sub target, or drop it",
                self.id,
                target.describe()
            )));
        }
        Ok(())
    }

    pub fn from_job(job: &Job) -> Result<Self, TargetError> {
        if !job.has_payload() {
            return Err(TargetError::Invalid(
                "the record carries no payload (read from a stripped cache?)".into(),
            ));
        }
        if job.stored_body().is_some() {
            return Err(TargetError::Invalid(
                "the job's body is in the queue's body store; fetch it first".into(),
            ));
        }
        let payload = job
            .payload_bytes()
            .map_err(|e| TargetError::Invalid(format!("payloadBase64 is not base64: {e}")))?;
        Ok(Self::with_payload(job, payload))
    }

    /// The job with `payload` as its bytes (a body fetched from the store).
    pub fn with_payload(job: &Job, payload: Vec<u8>) -> Self {
        JobMessage {
            id: job.id.clone(),
            payload: bytes::Bytes::from(payload),
            null_payload: job.payload_null,
            headers: job.headers.clone(),
            origin: job.origin.as_deref().cloned(),
            idempotency_key: None,
            key_header: None,
        }
    }

    /// The job's own headers, plus the idempotency key in its header (for targets that carry
    /// headers). A job that already has a header of that name (any case) keeps its own: the
    /// job is never altered.
    pub fn headers_with_key(&self) -> Cow<'_, BTreeMap<String, String>> {
        let (Some(name), Some(key)) = (&self.key_header, &self.idempotency_key) else {
            return Cow::Borrowed(&self.headers);
        };
        if self.headers.keys().any(|k| k.eq_ignore_ascii_case(name)) {
            return Cow::Borrowed(&self.headers);
        }
        let mut headers = self.headers.clone();
        headers.insert(name.clone(), key.clone());
        Cow::Owned(headers)
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TargetError {
    /// Could not reach the broker, or it did not answer in time. Retried with backoff.
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// The broker answered but did not accept the job.
    #[error("broker refused the job: {0}")]
    Refused(String),
    /// The job cannot be carried by this target without losing part of it (e.g. headers on a
    /// plain Redis list). Refused rather than silently altered.
    #[error("{0}")]
    Unsupported(String),
    /// The record itself is unusable.
    #[error("invalid job: {0}")]
    Invalid(String),
    /// The DeadLetterQueue's target is misconfigured (bad URL, missing secret).
    #[error("target misconfigured: {0}")]
    Config(String),
    /// JetStream discarded the job as a duplicate of the dead message itself: its
    /// `Nats-Msg-Id` is still inside the stream's duplicate window. Retried with backoff, it
    /// goes through once the window has passed.
    #[error("{0}")]
    Duplicate(String),
    /// The job has no value (a Kafka tombstone) and the target has no way to send none.
    #[error("{0}")]
    NullNotCarried(String),
    /// The HTTP endpoint answered, but not with 2xx.
    #[error("endpoint answered HTTP {status}: {body}")]
    HttpStatus { status: u16, body: String },
}

impl TargetError {
    /// Short reason for conditions and Events.
    pub fn reason(&self) -> &'static str {
        match self {
            TargetError::Unreachable(_) => "BrokerUnreachable",
            TargetError::Refused(_) => "BrokerRefused",
            TargetError::Unsupported(_) => "HeadersNotCarried",
            TargetError::NullNotCarried(_) => "NullNotCarried",
            TargetError::Invalid(_) => "InvalidJob",
            TargetError::Config(_) => "TargetMisconfigured",
            TargetError::Duplicate(_) => "DuplicateWindow",
            TargetError::HttpStatus { .. } => "EndpointRefused",
        }
    }
}

/// Gives a DeadLetterQueue's target. The operator's is [`cache::TargetCache`]; tests give fakes.
pub trait Targets: Send + Sync {
    fn target<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<std::sync::Arc<dyn Target>, TargetError>>;
}

/// Where redriven jobs go.
pub trait Target: Send + Sync {
    /// One line for status and logs (never includes credentials).
    fn describe(&self) -> String;
    /// Enqueue `job` and resolve once the broker confirmed it.
    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>>;
    /// Whether it can send a message with no value at all (Kafka can; the others would send
    /// an empty one instead, so a null job is refused before them).
    fn carries_null_payload(&self) -> bool {
        false
    }
    /// Whether it publishes a Pub/Sub message parked whole as that message
    /// (`dlq_core::headers::pubsub`): only Pub/Sub does; the others would send its JSON.
    fn publishes_whole_pubsub_messages(&self) -> bool {
        false
    }
    /// Cheap reachability check for the queue's Ready condition.
    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>>;
}

impl From<BrokerError> for TargetError {
    /// The same words: a broker's answer reads as it did when the connection was the target's.
    fn from(e: BrokerError) -> Self {
        match e {
            BrokerError::Unreachable(m) => TargetError::Unreachable(m),
            BrokerError::Refused(m) => TargetError::Refused(m),
            BrokerError::Invalid(m) => TargetError::Invalid(m),
            BrokerError::Config(m) => TargetError::Config(m),
        }
    }
}

impl From<crate::broker::backend::ConnectError> for TargetError {
    /// A target whose connection cannot be read is misconfigured, in the reader's words.
    fn from(e: crate::broker::backend::ConnectError) -> Self {
        TargetError::Config(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobMessage {
        JobMessage {
            id: "j".into(),
            payload: bytes::Bytes::from_static(b"p"),
            null_payload: false,
            headers: BTreeMap::from([("x-trace".to_string(), "t".to_string())]),
            origin: None,
            idempotency_key: Some("u-1-1".into()),
            key_header: Some("Idempotency-Key".into()),
        }
    }

    #[test]
    fn the_key_goes_beside_the_jobs_own_headers() {
        let job = job();
        let carried = job.headers_with_key();
        assert_eq!(carried["Idempotency-Key"], "u-1-1");
        assert_eq!(carried["x-trace"], "t");
        assert_eq!(carried.len(), 2);
        assert_eq!(job.headers.len(), 1, "the job itself is unchanged");
    }

    #[test]
    fn the_jobs_own_header_of_that_name_wins_and_off_carries_nothing() {
        let mut own = job();
        own.headers
            .insert("idempotency-key".into(), "producer's".into());
        assert_eq!(*own.headers_with_key(), own.headers);
        let mut off = job();
        off.key_header = None;
        assert_eq!(*off.headers_with_key(), off.headers);
    }

    /// A target that carries what it is given, and says whether it can send no value.
    struct Carrier(bool);

    impl Target for Carrier {
        fn describe(&self) -> String {
            "carrier".into()
        }
        fn requeue<'a>(&'a self, _: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
            Box::pin(async { Ok(()) })
        }
        fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
            Box::pin(async { Ok(()) })
        }
        fn carries_null_payload(&self) -> bool {
            self.0
        }
    }

    #[test]
    fn a_null_job_goes_only_to_a_target_that_sends_no_value() {
        let null = JobMessage::from_job(&Job::null_value("tomb")).expect("a payload, null");
        assert!(null.null_payload && null.payload.is_empty());
        assert_eq!(null.check_carried_by(&Carrier(true)), Ok(()));
        let refused = null.check_carried_by(&Carrier(false)).expect_err("refused");
        assert_eq!(refused.reason(), "NullNotCarried");
        let empty = JobMessage::from_job(&Job::from_bytes("e", b"")).expect("empty");
        assert_eq!(empty.check_carried_by(&Carrier(false)), Ok(()));
    }

    #[test]
    fn a_pubsub_message_parked_whole_goes_only_to_pubsub() {
        let mut whole = job();
        whole.headers.insert(
            dlq_core::headers::pubsub::WHOLE_HEADER.into(),
            dlq_core::headers::pubsub::WHOLE_JSON.into(),
        );
        let refused = whole.check_carried_by(&Carrier(true)).expect_err("refused");
        assert!(
            refused
                .to_string()
                .contains("redrive it to a Pub/Sub target"),
            "{refused}"
        );
    }
}
