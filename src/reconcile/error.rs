//! The one error policy of the reconcilers: each reconciler owns its error (one enum per
//! reconciler, e.g. `record::RecordError`), whose category becomes the `kind` label of
//! `dlq_reconcile_errors_total`; this file names none of them.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;

use super::context::Context;

/// A reconciler's error: what went wrong, and a short, stable category for metrics.
pub trait ReconcileError: std::error::Error {
    /// Short, stable label for metrics and Event reasons.
    fn category(&self) -> &'static str;
}

/// Counts a failed reconcile by its category and tries again in 5 s.
pub(crate) fn error_policy<K, E: ReconcileError>(
    _obj: Arc<K>,
    err: &E,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&crate::metrics::ErrorLabels {
            kind: err.category().into(),
        })
        .inc();
    tracing::warn!(error = %err, kind = err.category(), "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}
