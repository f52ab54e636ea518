//! The leader's sweep of every queue's body store (`crate::body::sweep`): one sweep per place as
//! spelled (`dlq_core::body::shared_sweeps`), each keeping every digest any record of any queue
//! names (the record index), since one place may be spelled two ways.

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
        let state = queues.state();
        let stored = state
            .iter()
            .filter_map(|q| Some((q.clone(), q.spec.bodies.as_ref()?)));
        for place in dlq_core::body::shared_sweeps(stored) {
            let (ns, name) = (
                place.by.namespace().unwrap_or_default(),
                place.by.name_any(),
            );
            let store = match bodies.store(&place.by).await {
                Ok(Some(store)) => store,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(namespace = %ns, queue = %name, error = %e, "body store unusable; not swept");
                    continue;
                }
            };
            match crate::body::sweep::sweep(&store, || records.body_digests()).await {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(namespace = %ns, queue = %name, sharing = place.queues.len(), deleted, "swept bodies no record references")
                }
                Err(e) => {
                    tracing::warn!(namespace = %ns, queue = %name, error = %e, "sweeping the body store failed")
                }
            }
        }
    }
}
