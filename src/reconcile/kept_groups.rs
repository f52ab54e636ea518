//! The failure groups this process wrote, per queue ([`GroupKeeper`], held in the reconcilers'
//! `Context`), apart from the keeping itself (`super::groups`, which reads the `Context`), so
//! the two do not name each other.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dlq_core::groups::DeadLetterGroupStatus;
use dlq_core::history::GroupHistory;

/// What this process wrote of one group.
pub(super) struct Written {
    pub(super) status: DeadLetterGroupStatus,
    pub(super) at: Instant,
}

/// A group's planned status, and since when every pass has planned the same.
pub(super) struct Planned {
    status: DeadLetterGroupStatus,
    since: Instant,
}

/// One queue's groups as this process knows them.
#[derive(Default)]
pub(super) struct QueueGroups {
    /// By fingerprint: what was last written (None: exists, not written by this process).
    pub(super) groups: HashMap<String, Option<Written>>,
    /// Fingerprints folded into the overflow group when last announced.
    pub(super) overflow_announced: usize,
    /// By fingerprint: what the passes have planned lately.
    pub(super) planned: HashMap<String, Planned>,
    /// By fingerprint: the history each group held when this process loaded the queue's
    /// groups (a former leader's), folded on from until this process writes its own.
    pub(super) loaded: HashMap<String, GroupHistory>,
}

impl QueueGroups {
    /// Notes a pass's plan: how long each planned group's status has been planned unchanged
    /// (zero for one that changed since the last pass).
    pub(super) fn held_still(
        &mut self,
        plan: &BTreeMap<String, DeadLetterGroupStatus>,
    ) -> HashMap<String, Duration> {
        let now = Instant::now();
        self.planned.retain(|f, _| plan.contains_key(f));
        plan.iter()
            .map(|(fingerprint, status)| {
                let since = match self.planned.get(fingerprint) {
                    Some(p) if &p.status == status => p.since,
                    _ => {
                        let fresh = Planned {
                            status: status.clone(),
                            since: now,
                        };
                        self.planned.insert(fingerprint.clone(), fresh);
                        now
                    }
                };
                (fingerprint.clone(), now.duration_since(since))
            })
            .collect()
    }
}

/// The groups of every queue, as this process wrote them; loaded from the apiserver the first
/// time a queue is kept (a new leader starts from what exists).
#[derive(Default)]
pub struct GroupKeeper {
    pub(super) queues: Mutex<HashMap<(String, String), QueueGroups>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
