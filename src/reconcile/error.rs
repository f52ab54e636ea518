//! The operator's reconcile error: one enum per reconciler step set, each with a category that
//! becomes the `kind` label of `dlq_reconcile_errors_total`.

use super::queue::QueueError;
use super::record::RecordError;
use super::replay::ReplayError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

impl Error {
    /// Short, stable label for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Record(e) => e.category(),
            Error::Queue(e) => e.category(),
            Error::Replay(e) => e.category(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
