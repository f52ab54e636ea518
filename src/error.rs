//! One error type for the library. Every variant has a category that becomes the Event reason
//! and the `kind` label of `dlq_reconcile_errors_total`.

use crate::queue::QueueError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),

    #[error("DeadLetterQueue {namespace}/{name} not found")]
    QueueNotFound { namespace: String, name: String },

    #[error("requeue failed: {0}")]
    Requeue(#[from] QueueError),

    #[error("secret {namespace}/{name} key {key}: {reason}")]
    Secret {
        namespace: String,
        name: String,
        key: String,
        reason: String,
    },

    #[error("invalid record: {0}")]
    InvalidRecord(String),

    #[error("object has no {0}")]
    MissingField(&'static str),
}

impl Error {
    /// Short, stable label for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubeApi",
            Error::QueueNotFound { .. } => "QueueNotFound",
            Error::Requeue(_) => "RequeueFailed",
            Error::Secret { .. } => "SecretUnavailable",
            Error::InvalidRecord(_) => "InvalidRecord",
            Error::MissingField(_) => "InvalidObject",
        }
    }

    /// Whether the apiserver answered 409 Conflict (a lost compare-and-swap).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Kube(kube::Error::Api(s)) if s.code == 409)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
