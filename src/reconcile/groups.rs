//! Keeping a queue's DeadLetterGroups: the plan from the record index
//! (`dlq_core::groups::plan`), written only where it changed and, while its records keep
//! changing, at most once per group every [`MIN_INTERVAL`], so a storm of parkings costs a
//! group a few writes, not one per record; once they have held still for [`SETTLED`] (the
//! storm is over), at once, so that its counts are exact within a second of its last park.
//!
//! The groups are the operator's: one deleted by hand while it has records is created again
//! from them (at its next write, which finds it gone, or at the next pass once the group watch
//! has not shown it for [`GONE_AFTER`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use kube::ResourceExt;

use dlq_core::api::DeadLetterQueue;
use dlq_core::events::{EventPlan, action, reason};
use dlq_core::groups::{self, DeadLetterGroupStatus, Existing};
use dlq_core::history::GroupHistory;
use dlq_core::record::Summary;

use super::context::Context;
use super::kept_groups::{QueueGroups, Written, lock};
use crate::state::apiserver::reference;

/// Shortest time between two status writes of one group while its status keeps changing.
pub const MIN_INTERVAL: Duration = Duration::from_secs(2);
/// How long a group's planned status must stay the same to be written before
/// [`MIN_INTERVAL`] has passed.
pub const SETTLED: Duration = Duration::from_millis(500);
/// Group statuses written at once.
const WRITES: usize = 8;
/// How long after this process wrote a group the group watch may still not show it (its
/// own lag) before the group counts as deleted.
pub const GONE_AFTER: Duration = Duration::from_secs(5);

/// Brings `queue`'s groups up to date with `records`. Returns when it should run again for
/// writes it held back (None: nothing held).
pub async fn keep(
    ctx: &Context,
    queue: &DeadLetterQueue,
    records: &[std::sync::Arc<Summary>],
    now: Timestamp,
) -> Option<Duration> {
    let ns = queue.namespace().unwrap_or_default();
    let name = queue.name_any();
    let key = (ns.clone(), name.clone());
    if !lock(&ctx.groups.queues).contains_key(&key) {
        let loaded = load(ctx, &ns, &name).await?;
        lock(&ctx.groups.queues).insert(key.clone(), loaded);
    }
    let (plan, due) = {
        let mut queues = lock(&ctx.groups.queues);
        let known = queues.get_mut(&key)?;
        let histories: HashMap<&str, GroupHistory> = known
            .groups
            .keys()
            .filter_map(|f| Some((f.as_str(), last_history(ctx, known, &ns, &name, f)?)))
            .collect();
        let existing: Vec<Existing<'_>> = known
            .groups
            .iter()
            .map(|(f, w)| Existing {
                fingerprint: f,
                last_seen: w
                    .as_ref()
                    .and_then(|w| w.status.last_seen.as_ref())
                    .map(|t| t.0),
                history: histories.get(f.as_str()),
            })
            .collect();
        let mut plan = groups::plan(queue, records.iter().map(|r| r.as_ref()), &existing, now);
        let passed = ctx.views.passed_through(&ns, &name);
        for (fingerprint, status) in plan.groups.iter_mut() {
            acknowledge(ctx, known, &ns, &name, fingerprint, status);
            status.passed_through = passed.get(fingerprint).copied().unwrap_or(0);
        }
        let still = known.held_still(&plan.groups);
        let mut due = due_writes(known, &plan.groups, &still);
        for fingerprint in deleted_by_hand(ctx, known, &ns, &name, &plan.groups) {
            due.insert(fingerprint, Due::Now { create: true });
        }
        (plan, due)
    };
    let mut later: Option<Duration> = None;
    let mut due_now = Vec::new();
    for (fingerprint, status) in &plan.groups {
        match due.get(fingerprint.as_str()) {
            Some(Due::Now { create }) => due_now.push((fingerprint, status, *create)),
            Some(Due::After(wait)) => later = Some(later.map_or(*wait, |l| l.min(*wait))),
            None => {}
        }
    }
    futures::stream::iter(due_now)
        .for_each_concurrent(WRITES, |(fingerprint, status, create)| {
            write(ctx, queue, &key, fingerprint, status, create)
        })
        .await;
    for fingerprint in &plan.delete {
        let group = groups::group_name(&name, fingerprint);
        match ctx.apiserver.delete_group(&ns, &group).await {
            Ok(()) => {
                tracing::info!(namespace = %ns, queue = %name, group = %group, "deleted an empty failure group");
                if let Some(q) = lock(&ctx.groups.queues).get_mut(&key) {
                    q.groups.remove(fingerprint);
                    q.loaded.remove(fingerprint);
                }
            }
            Err(e) => {
                tracing::warn!(namespace = %ns, group = %group, error = %e, "deleting an empty failure group failed")
            }
        }
    }
    announce_overflow(ctx, queue, &key, plan.overflowed).await;
    later
}

/// The history a group was last written with: this process's last write, else the stored
/// status (the group watch's copy, else what was listed when the queue's groups were loaded),
/// so that a new leader folds on from the old one's instead of starting again.
fn last_history(
    ctx: &Context,
    known: &QueueGroups,
    ns: &str,
    queue: &str,
    fingerprint: &str,
) -> Option<GroupHistory> {
    let written = known
        .groups
        .get(fingerprint)
        .and_then(|w| w.as_ref())
        .and_then(|w| w.status.history.clone());
    written
        .or_else(|| {
            let stored = ctx
                .views
                .group(ns, &groups::group_name(queue, fingerprint))?;
            stored.status.as_ref()?.history.clone()
        })
        .or_else(|| known.loaded.get(fingerprint).cloned())
}

/// Sets a planned status's acknowledgement from the group's spec (the watch's copy) and what
/// was kept of it before (this process's last write, else the stored status).
fn acknowledge(
    ctx: &Context,
    known: &QueueGroups,
    ns: &str,
    queue: &str,
    fingerprint: &str,
    status: &mut DeadLetterGroupStatus,
) {
    if !ctx.views.watches_groups() {
        return;
    }
    let stored = ctx.views.group(ns, &groups::group_name(queue, fingerprint));
    let spec = stored.as_ref().map(|g| g.spec.clone()).unwrap_or_default();
    let written = known
        .groups
        .get(fingerprint)
        .and_then(|w| w.as_ref())
        .and_then(|w| w.status.acknowledgement.clone());
    let previous = written.or_else(|| {
        stored
            .as_ref()
            .and_then(|g| g.status.as_ref())
            .and_then(|s| s.acknowledgement.clone())
    });
    status.acknowledgement = groups::acknowledged_at(&spec, previous.as_ref(), status);
    status.silenced = groups::silenced(status);
}

/// Planned groups this process wrote at least [`GONE_AFTER`] ago that the group watch does not
/// hold: deleted by someone else, to be created again.
fn deleted_by_hand(
    ctx: &Context,
    known: &QueueGroups,
    ns: &str,
    queue: &str,
    planned: &std::collections::BTreeMap<String, DeadLetterGroupStatus>,
) -> Vec<String> {
    if !ctx.views.watches_groups() {
        return Vec::new();
    }
    planned
        .keys()
        .filter(|f| {
            known
                .groups
                .get(*f)
                .and_then(|w| w.as_ref())
                .is_some_and(|w| w.at.elapsed() >= GONE_AFTER)
        })
        .filter(|f| ctx.views.group(ns, &groups::group_name(queue, f)).is_none())
        .cloned()
        .collect()
}

/// When a planned group's status is to be written.
enum Due {
    Now { create: bool },
    After(Duration),
}

/// The planned groups whose status differs from what was written: now, or once
/// [`MIN_INTERVAL`] has passed since the last write or the status has been planned unchanged
/// (`still`) for [`SETTLED`], whichever comes first.
fn due_writes(
    known: &QueueGroups,
    planned: &std::collections::BTreeMap<String, DeadLetterGroupStatus>,
    still: &HashMap<String, Duration>,
) -> HashMap<String, Due> {
    let mut due = HashMap::new();
    for (fingerprint, status) in planned {
        let d = match known.groups.get(fingerprint) {
            None => Due::Now { create: true },
            Some(None) => Due::Now { create: false },
            Some(Some(w)) if &w.status == status => continue,
            Some(Some(w)) => {
                let interval = MIN_INTERVAL.saturating_sub(w.at.elapsed());
                let settle =
                    SETTLED.saturating_sub(still.get(fingerprint).copied().unwrap_or_default());
                match interval.min(settle) {
                    wait if wait.is_zero() => Due::Now { create: false },
                    wait => Due::After(wait),
                }
            }
        };
        due.insert(fingerprint.clone(), d);
    }
    due
}

/// The queue's existing groups, or None when they cannot be listed (the next pass tries).
async fn load(ctx: &Context, ns: &str, queue: &str) -> Option<QueueGroups> {
    match ctx.apiserver.list_groups(ns, queue).await {
        Ok(list) => {
            let fingerprint =
                |g: &groups::DeadLetterGroup| g.labels().get(dlq_core::group::LABEL_GROUP).cloned();
            Some(QueueGroups {
                groups: list
                    .iter()
                    .filter_map(fingerprint)
                    .map(|f| (f, None))
                    .collect(),
                loaded: list
                    .iter()
                    .filter_map(|g| {
                        let history = g.status.as_ref()?.history.clone()?;
                        Some((fingerprint(g)?, history))
                    })
                    .collect(),
                ..QueueGroups::default()
            })
        }
        Err(e) => {
            tracing::warn!(namespace = %ns, queue = %queue, error = %e, "listing the queue's failure groups failed");
            None
        }
    }
}

async fn write(
    ctx: &Context,
    queue: &DeadLetterQueue,
    key: &(String, String),
    fingerprint: &str,
    status: &DeadLetterGroupStatus,
    create: bool,
) {
    let object = groups::group_object(queue, fingerprint, status.clone());
    let mut result = ctx.apiserver.apply_group(&object, create).await;
    if !create && matches!(&result, Err(kube::Error::Api(s)) if s.code == 404) {
        // Deleted by hand (or by a former leader's retention): its records say it exists.
        tracing::info!(namespace = %key.0, queue = %key.1, group = %fingerprint, "a failure group with records was gone; creating it again");
        result = ctx.apiserver.apply_group(&object, true).await;
    }
    match result {
        Ok(()) => {
            if let Some(q) = lock(&ctx.groups.queues).get_mut(key) {
                let written = Written {
                    status: status.clone(),
                    at: Instant::now(),
                };
                q.groups.insert(fingerprint.to_string(), Some(written));
            }
        }
        Err(e) => {
            tracing::warn!(namespace = %key.0, queue = %key.1, group = %fingerprint, error = %e, "writing a failure group failed")
        }
    }
}

/// A Warning Event on the queue whenever the number of groups folded into its overflow group
/// grows.
async fn announce_overflow(
    ctx: &Context,
    queue: &DeadLetterQueue,
    key: &(String, String),
    overflowed: usize,
) {
    let grew = {
        let mut queues = lock(&ctx.groups.queues);
        let Some(q) = queues.get_mut(key) else {
            return;
        };
        let grew = overflowed > q.overflow_announced;
        q.overflow_announced = overflowed;
        grew
    };
    if grew {
        let max = queue.spec.groups.clone().unwrap_or_default().max();
        let event = EventPlan::warning(
            reason::GROUPS_OVERFLOW,
            action::GROUP,
            format!(
                "{overflowed} failure groups beyond this queue's {max} are counted in its overflow group ({}); raise spec.groups.max or resolve groups",
                groups::group_name(&key.1, groups::OVERFLOW)
            ),
        );
        ctx.apiserver.publish(reference(queue), &event).await;
    }
}
