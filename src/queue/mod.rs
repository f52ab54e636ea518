//! Queue backends behind one small trait. A [`Target`] puts a parked job back on its queue
//! and answers only once the broker has confirmed it.

pub mod redis;

use std::collections::BTreeMap;

use futures::future::BoxFuture;

use crate::api::Job;

/// The untouched job as it goes back to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobMessage {
    pub id: String,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

impl JobMessage {
    pub fn from_job(job: &Job) -> Result<Self, QueueError> {
        if !job.has_payload() {
            return Err(QueueError::Invalid(
                "the record carries no payload (read from a stripped cache?)".into(),
            ));
        }
        let payload = job
            .payload_bytes()
            .map_err(|e| QueueError::Invalid(format!("payloadBase64 is not base64: {e}")))?;
        Ok(JobMessage {
            id: job.id.clone(),
            payload,
            headers: job.headers.clone(),
        })
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
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
}

impl QueueError {
    /// Short reason for conditions and Events.
    pub fn reason(&self) -> &'static str {
        match self {
            QueueError::Unreachable(_) => "BrokerUnreachable",
            QueueError::Refused(_) => "BrokerRefused",
            QueueError::Unsupported(_) => "HeadersNotCarried",
            QueueError::Invalid(_) => "InvalidJob",
            QueueError::Config(_) => "TargetMisconfigured",
        }
    }
}

/// Where redriven jobs go.
pub trait Target: Send + Sync {
    /// One line for status and logs (never includes credentials).
    fn describe(&self) -> String;
    /// Enqueue `job` and resolve once the broker confirmed it.
    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), QueueError>>;
    /// Cheap reachability check for the queue's Ready condition.
    fn probe(&self) -> BoxFuture<'_, Result<(), QueueError>>;
}
