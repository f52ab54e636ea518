//! Kubernetes Events as data: what to publish about a record or a queue. The operator and
//! `kubectl dlq` turn an [`EventPlan`] into a real Event; the reasons are named once here.

use crate::conditions::truncate;

/// Longest Event note we write (the API allows 1 KiB).
pub const MAX_NOTE: usize = 1024;

/// Event reasons (the `reason` column of `kubectl get events`).
pub mod reason {
    pub const PARKED: &str = "Parked";
    pub const REDRIVEN: &str = "Redriven";
    pub const DROPPED: &str = "Dropped";
    pub const REQUEUE_FAILED: &str = "RequeueFailed";
    pub const RESOLVE_CONFLICT: &str = "ResolveConflict";
    pub const DECISION_REFUSED: &str = "DecisionRefused";
    pub const REPLAY: &str = "Replay";
    pub const REPLAY_STOPPED: &str = "ReplayStopped";
    /// A dead message that can never be a record, kept in the broker's rejected list/queue.
    pub const REJECTED: &str = "Rejected";
    /// Alertmanager has not accepted the per-record alerts for a while.
    pub const ALERTS_UNDELIVERABLE: &str = "AlertsUndeliverable";
}

/// Event actions (what the reporter was doing).
pub mod action {
    pub const PARK: &str = "Park";
    pub const RESOLVE: &str = "Resolve";
    pub const REDRIVE: &str = "Redrive";
    pub const REPLAY: &str = "Replay";
    pub const ALERT: &str = "Alert";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// One Event to publish about the object being reconciled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPlan {
    pub type_: EventType,
    pub reason: &'static str,
    pub action: &'static str,
    /// Bounded to [`MAX_NOTE`].
    pub note: String,
    /// Never repeats for its object (one `Parked` per record): published directly, outside any
    /// aggregation cache, which would otherwise hold every Event of a parking storm.
    pub once: bool,
}

impl EventPlan {
    pub fn normal(reason: &'static str, action: &'static str, note: impl AsRef<str>) -> Self {
        Self::new(EventType::Normal, reason, action, note)
    }

    pub fn warning(reason: &'static str, action: &'static str, note: impl AsRef<str>) -> Self {
        Self::new(EventType::Warning, reason, action, note)
    }

    fn new(
        type_: EventType,
        reason: &'static str,
        action: &'static str,
        note: impl AsRef<str>,
    ) -> Self {
        EventPlan {
            type_,
            reason,
            action,
            note: truncate(note.as_ref(), MAX_NOTE),
            once: false,
        }
    }

    /// Marks the Event as one that never repeats for its object.
    pub fn once(mut self) -> Self {
        self.once = true;
        self
    }
}
