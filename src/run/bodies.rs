//! The leader's sweep of every queue's body store (`crate::body::sweep`), with the digests its
//! live records name from the record index.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use dlq_core::api::DeadLetterQueue;

use crate::body::Bodies;
use crate::state::leadership::Leadership;
use crate::state::records::RecordIndex;

/// Sweeps every queue's store every `every`, while this replica leads and once the record
/// index has listed (before that, a live record's object would look unreferenced).
pub async fn sweep(
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
            let (ns, name) = (queue.namespace().unwrap_or_default(), queue.name_any());
            let store = match bodies.store(&queue).await {
                Ok(Some(store)) => store,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(namespace = %ns, queue = %name, error = %e, "body store unusable; not swept");
                    continue;
                }
            };
            let referenced = || {
                records
                    .queue(&ns, &name)
                    .iter()
                    .filter_map(|s| s.body.clone())
                    .collect()
            };
            match crate::body::sweep::sweep(&store, referenced).await {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(namespace = %ns, queue = %name, deleted, "swept bodies no record references")
                }
                Err(e) => {
                    tracing::warn!(namespace = %ns, queue = %name, error = %e, "sweeping the body store failed")
                }
            }
        }
    }
}
