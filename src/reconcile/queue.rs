//! The DeadLetterQueue reconciler: retention of resolved records, counters, target readiness.
//!
//! Steps: select the queue's records from the store, delete the expired resolved ones
//! (`dlq_core::plan::expired`), probe the target, build the status and gauges
//! (`dlq_core::plan::queue_status`), write.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use dlq_core::api::DeadLetterQueue;
use dlq_core::capacity;
use dlq_core::conditions::reason;
use dlq_core::plan::{self, Readiness};
use dlq_core::record::{Facts, Summary};

use super::Context;
use crate::state::apiserver::reference;

/// Why a DeadLetterQueue reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("DeadLetterQueue has no namespace")]
    NoNamespace,
    #[error("writing the status of DeadLetterQueue {name}: {source}")]
    WriteStatus {
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl QueueError {
    /// Short, stable label for metrics and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            QueueError::NoNamespace => "InvalidObject",
            QueueError::WriteStatus { .. } => "KubeApi",
        }
    }
}

pub async fn reconcile(
    queue: Arc<DeadLetterQueue>,
    ctx: Arc<Context>,
) -> Result<Action, super::Error> {
    let ns = queue.namespace().ok_or(QueueError::NoNamespace)?;
    let name = queue.name_any();
    tracing::debug!(namespace = %ns, queue = %name, "queue reconcile");
    // Counting from a store that has not listed yet would under-count, and the count settles
    // blocks of slots: maxParked would no longer hold.
    if !ctx.cache_ready().await {
        return Ok(Action::requeue(super::CACHE_WAIT));
    }
    let records = records_of(&ctx, &ns, &name);
    tracing::debug!(namespace = %ns, queue = %name, records = records.len(), "counting the queue's records");
    let now = Timestamp::now();
    let settled = settled(&queue, &records, now);
    let deleted = retain(&ctx, &queue, &records, now).await;
    let live = records
        .iter()
        .filter(|r| !deleted.contains(&*r.name))
        .map(|r| r.as_ref());
    let counts = plan::count(live);
    let readiness = readiness(&ctx, &queue).await;
    tracing::debug!(namespace = %ns, queue = %name, ready = readiness.ready, "probed the queue's target");
    let plan = plan::queue_status(&queue, counts, settled, readiness, now);
    for change in &plan.metrics {
        ctx.metrics.apply(change);
    }
    ctx.apiserver
        .write_queue_status(&queue, &plan.status)
        .await
        .map_err(|source| QueueError::WriteStatus { name, source })?;
    for event in &plan.events {
        ctx.apiserver
            .publish(reference(queue.as_ref()), event)
            .await;
    }
    Ok(Action::requeue(ctx.settings.queue_resync))
}

/// The queue's blocks of slots that `records` (one snapshot of the store, the one counted)
/// settle: see `dlq_core::capacity`.
fn settled(
    queue: &DeadLetterQueue,
    records: &[Arc<Summary>],
    now: Timestamp,
) -> capacity::Settlement {
    let Some(status) = queue.status.as_ref().filter(|s| !s.blocks.is_empty()) else {
        return capacity::Settlement::default();
    };
    let mut seen: HashMap<&str, i64> = HashMap::new();
    for block in records.iter().filter_map(|r| r.slot_block.as_deref()) {
        *seen.entry(block).or_default() += 1;
    }
    capacity::Settlement {
        blocks: capacity::settle_blocks(
            &status.blocks,
            |id| seen.get(id).copied().unwrap_or(0),
            now.as_second(),
        ),
    }
}

/// The queue's records, from the index.
fn records_of(ctx: &Context, ns: &str, name: &str) -> Vec<Arc<Summary>> {
    ctx.records.queue(ns, name)
}

/// Whether the queue's target answers.
async fn readiness(ctx: &Context, queue: &DeadLetterQueue) -> Readiness {
    match ctx.targets.target(queue).await {
        Ok(target) => match target.probe().await {
            Ok(()) => Readiness {
                ready: true,
                reason: reason::TARGET_REACHABLE,
                message: "target answered".into(),
                target: target.describe(),
            },
            Err(e) => Readiness {
                ready: false,
                reason: e.reason(),
                message: e.to_string(),
                target: target.describe(),
            },
        },
        Err(e) => Readiness {
            ready: false,
            reason: e.reason(),
            message: e.to_string(),
            target: String::new(),
        },
    }
}

/// Deletes resolved records older than `retention.resolvedFor`; never a Parked one. Returns the
/// names deleted. Each delete is guarded by uid + resourceVersion: exactly the resolved version
/// looked at goes.
async fn retain(
    ctx: &Context,
    queue: &DeadLetterQueue,
    records: &[Arc<Summary>],
    now: Timestamp,
) -> HashSet<String> {
    let mut deleted = HashSet::new();
    for r in plan::expired(queue, records.iter().map(|r| r.as_ref()), now) {
        let name = r.name.to_string();
        match ctx.apiserver.delete_record(&r.to_record()).await {
            Ok(()) => {
                tracing::info!(namespace = %r.namespace, name = %name, job = %r.job_id, phase = r.phase().as_str(), "retention deleted resolved record");
                deleted.insert(name);
            }
            // Changed or gone meanwhile (the preconditions failed): the next pass decides again.
            Err(e) => {
                tracing::debug!(namespace = %r.namespace, name = %name, error = %e, "retention delete skipped")
            }
        }
    }
    deleted
}
