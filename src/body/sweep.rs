//! The sweep: deletes the objects of a queue's body store that no live record references and
//! that are older than `spec.bodies.orphansAfter` (default 1 h), without finalizers. An object
//! outlives its record (retention deleted it, or a human deleted a resolved one) by at most
//! one sweep period plus that age; an upload whose record was never created (a crash between
//! the two) goes the same way. It runs on the leader, after the record index's first list.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use dlq_core::api::DeadLetterQueue;

use super::{Bodies, BodyError, BodyStore};
use crate::state::leadership::Leadership;
use crate::state::records::RecordIndex;

/// How often each store is swept.
pub const SWEEP_EVERY: Duration = Duration::from_secs(300);

/// Sweeps every queue's store every `every`, while this replica leads.
pub async fn run(
    queues: Store<DeadLetterQueue>,
    records: RecordIndex,
    bodies: Arc<dyn Bodies>,
    leadership: Leadership,
    every: Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        if !leadership.holds() || !records.listed() {
            continue;
        }
        for queue in queues.state() {
            let store = match bodies.store(&queue).await {
                Ok(Some(store)) => store,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(namespace = ?queue.namespace(), queue = %queue.name_any(), error = %e, "body store unusable; not swept");
                    continue;
                }
            };
            match sweep(&store, &queue, &records).await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(namespace = ?queue.namespace(), queue = %queue.name_any(), deleted = n, "swept bodies no record references")
                }
                Err(e) => {
                    tracing::warn!(namespace = ?queue.namespace(), queue = %queue.name_any(), error = %e, "sweeping the body store failed")
                }
            }
        }
    }
}

/// One sweep of `queue`'s store: deletes what `dlq_core::body::sweep` picks; how many.
pub async fn sweep(
    store: &BodyStore,
    queue: &DeadLetterQueue,
    records: &RecordIndex,
) -> Result<usize, BodyError> {
    // Listed before the references are read: an object uploaded after this list cannot be
    // taken, and one whose record appears meanwhile is young.
    let stored = store.list().await?;
    let ns = queue.namespace().unwrap_or_default();
    let summaries = records.queue(&ns, &queue.name_any());
    let pending = store.pending();
    let referenced: HashSet<&str> = summaries
        .iter()
        .filter_map(|s| s.body.as_deref())
        .chain(pending.iter().map(String::as_str))
        .collect();
    let spec = store.spec();
    let doomed = dlq_core::body::sweep(
        &spec.prefix(),
        &stored,
        &referenced,
        spec.orphans_after_secs(),
    );
    for key in &doomed {
        store.delete(key).await?;
    }
    Ok(doomed.len())
}
