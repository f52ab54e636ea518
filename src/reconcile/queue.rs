//! The DeadLetterQueue reconciler: retention of resolved records, counters, target readiness.
//!
//! Steps: select the queue's records from the store, delete the expired resolved ones
//! (`dlq_core::plan::expired`), label records whose group label is missing or wrong with their
//! group, keep its failure groups (`super::groups`), probe the target, build the status and gauges (`dlq_core::plan::queue_status`),
//! write.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use dlq_core::api::DeadLetterQueue;
use dlq_core::capacity;
use dlq_core::conditions::reason;
use dlq_core::plan::{self, Readiness};
use dlq_core::record::{Facts, Summary};
use dlq_core::seal;

use super::context::{Context, LIST_WAIT, Settings};
use super::error::ReconcileError;
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

impl ReconcileError for QueueError {
    fn category(&self) -> &'static str {
        match self {
            QueueError::NoNamespace => "InvalidObject",
            QueueError::WriteStatus { .. } => "KubeApi",
        }
    }
}

pub async fn reconcile(
    queue: Arc<DeadLetterQueue>,
    ctx: Arc<Context>,
) -> Result<Action, QueueError> {
    let ns = queue.namespace().ok_or(QueueError::NoNamespace)?;
    let name = queue.name_any();
    tracing::debug!(namespace = %ns, queue = %name, "queue reconcile");
    // Counting from a store that has not listed yet would under-count, and the count reckons
    // blocks of slots: maxParked would no longer hold.
    if !ctx.records_ready().await {
        return Ok(Action::requeue(LIST_WAIT));
    }
    let records = records_of(&ctx, &ns, &name);
    tracing::debug!(namespace = %ns, queue = %name, records = records.len(), "counting the queue's records");
    let now = Timestamp::now();
    let reckoned = reckoned(&queue, &records, now);
    let deleted = retain(&ctx, &queue, &records, now).await;
    let live = records
        .iter()
        .filter(|r| !deleted.contains(&*r.name))
        .map(|r| r.as_ref());
    let counts = plan::count(live);
    let readiness = readiness(&ctx, &queue).await;
    tracing::debug!(namespace = %ns, queue = %name, ready = readiness.ready, "probed the queue's target");
    let bounds = ctx.bounds.of(&ns);
    let mut plan = plan::queue_status(&queue, counts, reckoned, readiness, &bounds, now);
    let ca_certs = park_ca(&ctx.settings);
    plan.status.address = plan::address(
        &queue,
        ctx.settings.park_url.as_deref(),
        ca_certs.as_deref(),
    );
    plan.status.protection = protection(&ctx, &queue, &records, &deleted).await;
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
    // The failure groups after the counters: those reckon blocks of slots (maxParked), which
    // must not wait for group bookkeeping.
    let unlabelled = label_groups(&ctx, &records).await;
    let live_records: Vec<Arc<Summary>> = records
        .iter()
        .filter(|r| !deleted.contains(&*r.name))
        .cloned()
        .collect();
    let groups_again = super::groups::keep(&ctx, &queue, &live_records, now).await;
    // Records still unlabelled: the next batch soon, not at the next resync.
    let mut next = if unlabelled > 0 {
        ctx.settings.queue_resync.min(LABEL_AGAIN)
    } else {
        ctx.settings.queue_resync
    };
    if let Some(wait) = groups_again {
        next = next.min(wait);
    }
    Ok(Action::requeue(next))
}

/// The queue's `status.protection`: the recipients of the keys it seals with (read from their
/// Secrets) and its live records per recipient. None for a queue that neither seals nor holds
/// sealed records.
async fn protection(
    ctx: &Context,
    queue: &DeadLetterQueue,
    records: &[Arc<Summary>],
    deleted: &HashSet<String>,
) -> Option<seal::ProtectionWrite> {
    let sealed_to = records
        .iter()
        .filter(|r| !deleted.contains(&*r.name))
        .filter_map(|r| r.sealed_to.as_deref());
    let before = queue.status.as_ref().and_then(|s| s.protection.as_ref());
    if !queue.seals() && before.is_none() && records.iter().all(|r| r.sealed_to.is_none()) {
        return None;
    }
    let published = if queue.seals() {
        ctx.redrive.keys.load(queue).await.published()
    } else {
        Vec::new()
    };
    let now = seal::protection_status(published, sealed_to);
    Some(seal::protection_write(before, now))
}

/// Records labelled with their group in one reconcile (the rest in the next ones).
const LABEL_BATCH: usize = 512;
/// Labels written at once.
const LABEL_CONCURRENCY: usize = 8;
/// When the next batch of labels goes out.
const LABEL_AGAIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Labels records with their group (computed from their facts) where the `dlq.dev/group`
/// label is missing (parked before failure groups existed, or by an older parker) or wrong
/// (edited by hand, or a fingerprint the masks now compute differently), a batch per
/// reconcile, so `-l dlq.dev/group=...` finds exactly a group's records. The label is the
/// operator's: counts and replays read the facts, never the label. Returns how many are still
/// to label after this batch.
async fn label_groups(ctx: &Context, records: &[Arc<Summary>]) -> usize {
    let unlabelled: Vec<Arc<Summary>> = records
        .iter()
        .filter(|r| !r.group_labelled)
        .cloned()
        .collect();
    if unlabelled.is_empty() {
        return 0;
    }
    let batch = unlabelled.iter().take(LABEL_BATCH).cloned();
    let labelled: usize = futures::stream::iter(batch)
        .map(|r| label_group(ctx, r))
        .buffer_unordered(LABEL_CONCURRENCY)
        .collect::<Vec<usize>>()
        .await
        .into_iter()
        .sum();
    let remaining = unlabelled.len() - labelled;
    tracing::info!(
        labelled,
        remaining,
        "labelled records whose group label was missing or wrong with their group"
    );
    remaining
}

/// 1 when `r` was labelled with its group.
async fn label_group(ctx: &Context, r: Arc<Summary>) -> usize {
    match ctx.apiserver.label_group(&r.to_record(), &r.group).await {
        Ok(()) => 1,
        // Gone meanwhile, or the apiserver away: the next pass tries again.
        Err(e) => {
            tracing::debug!(namespace = %r.namespace, name = %r.name, error = %e, "labelling a record with its group failed");
            0
        }
    }
}

/// The queue's blocks of slots that `records` (one snapshot of the store, the one counted)
/// reckon: see `dlq_core::capacity`.
fn reckoned(
    queue: &DeadLetterQueue,
    records: &[Arc<Summary>],
    now: Timestamp,
) -> capacity::Reckoning {
    let Some(status) = queue.status.as_ref().filter(|s| !s.blocks.is_empty()) else {
        return capacity::Reckoning::default();
    };
    let mut seen: HashMap<&str, i64> = HashMap::new();
    for block in records.iter().filter_map(|r| r.slot_block.as_deref()) {
        *seen.entry(block).or_default() += 1;
    }
    capacity::Reckoning {
        blocks: capacity::reckon_blocks(
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
    match ctx.redrive.targets.target(queue).await {
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

/// The park endpoint's CA bundle, when `--park-tls-dir` holds a readable `ca.crt` of at most
/// [`plan::MAX_CA_CERTS`] bytes (a missing one is normal: the certificate's issuer is then
/// trusted some other way).
fn park_ca(settings: &Settings) -> Option<String> {
    let path = settings.park_ca_file.as_ref()?;
    let meta = std::fs::metadata(path).ok()?;
    if meta.len() > plan::MAX_CA_CERTS as u64 {
        tracing::warn!(path = %path.display(), bytes = meta.len(), "the park endpoint's ca.crt is too large to publish in status.address.CACerts");
        return None;
    }
    std::fs::read_to_string(path).ok()
}
