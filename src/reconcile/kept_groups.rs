//! The failure groups this process wrote, per queue ([`GroupKeeper`], held in the reconcilers'
//! `Context`), apart from the keeping itself (`super::groups`, which reads the `Context`), so
//! the two do not name each other.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use dlq_core::groups::DeadLetterGroupStatus;

/// What this process wrote of one group.
pub(super) struct Written {
    pub(super) status: DeadLetterGroupStatus,
    pub(super) at: Instant,
}

/// One queue's groups as this process knows them.
#[derive(Default)]
pub(super) struct QueueGroups {
    /// By fingerprint: what was last written (None: exists, not written by this process).
    pub(super) groups: HashMap<String, Option<Written>>,
    /// Fingerprints folded into the overflow group when last announced.
    pub(super) overflow_announced: usize,
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
