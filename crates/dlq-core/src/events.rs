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
    /// A replay was paused (`spec.paused`): it decides and passes nothing until resumed.
    pub const REPLAY_PAUSED: &str = "ReplayPaused";
    /// A replay's canary was carried out and none of it came back within its watch: the rest go.
    pub const CANARY_PASSED: &str = "CanaryPassed";
    /// A paused replay was resumed: it goes on where it was.
    pub const REPLAY_RESUMED: &str = "ReplayResumed";
    /// Someone approved a replay whose queue requires approvals (once per approver seen).
    pub const APPROVED: &str = "Approved";
    /// A replay has waited for its approvals longer than the operator's overdue time.
    pub const APPROVAL_OVERDUE: &str = "ApprovalOverdue";
    /// A dead message that can never be a record, kept in the broker's rejected list/queue.
    pub const REJECTED: &str = "Rejected";
    /// The queue's body store cannot keep a large dead message right now (unreachable,
    /// refused, misconfigured): it stays in the broker until the store answers. A body
    /// reason, named with the others in `conditions`.
    pub use crate::conditions::reason::BODY_STORE_UNAVAILABLE;
    /// A queue became Full (its maxParked, its namespace's ResourceQuota on records, or the
    /// operator's --max-records): parkings wait (in the broker) until records resolve.
    pub const QUEUE_FULL: &str = "QueueFull";
    /// The operator's --max-records is reached (on its ledger ConfigMap, once per time reached).
    pub const MAX_RECORDS_REACHED: &str = "MaxRecordsReached";
    /// Alertmanager has not accepted the per-record alerts for a while.
    pub const ALERTS_UNDELIVERABLE: &str = "AlertsUndeliverable";
    /// A queue has more failure groups than `spec.groups.max`: the rest share its overflow group.
    pub const GROUPS_OVERFLOW: &str = "GroupsOverflow";
    /// A drop came after the broker confirmed the record's redrive: the record is Redriven.
    pub const DECISION_TOO_LATE: &str = "DecisionTooLate";
    /// A queue names a backend (kafka, sqs) that this operator build left out.
    pub const BACKEND_NOT_BUILT: &str = "BackendNotBuilt";
    /// A Sidekiq dead set is near the size at which Sidekiq drops its oldest jobs unparked.
    pub const DEAD_SET_NEAR_TRIM: &str = "DeadSetNearTrim";
    /// A Sidekiq source moved dead jobs out of the dead set into its overflow list before
    /// Sidekiq could trim them (once per episode).
    pub const DEAD_SET_OVERFLOW: &str = "DeadSetOverflow";
    /// A standing replay started: its group's dead messages pass from the broker to the target
    /// (or, a standing drop, are discarded) without a record each while it runs.
    pub const STANDING: &str = "Standing";
    /// Someone read a record's payload through the reveal API (`deadletterpayloads`).
    pub const PAYLOAD_REVEALED: &str = "PayloadRevealed";
    /// A reveal of a record's payload found it unopenable (its key is gone, or its ciphertext
    /// is damaged): the record stays as it is, and whoever asked hears why.
    pub const REVEAL_FAILED: &str = "RevealFailed";
}

/// Event actions (what the reporter was doing).
pub mod action {
    pub const PARK: &str = "Park";
    pub const RESOLVE: &str = "Resolve";
    pub const REDRIVE: &str = "Redrive";
    pub const REPLAY: &str = "Replay";
    pub const ALERT: &str = "Alert";
    pub const GROUP: &str = "Group";
    pub const REVEAL: &str = "Reveal";
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

/// Whether `plan` may be folded into a per-queue summary during bulk resolutions, as
/// client-go's event aggregator folds similar Events: Normal resolution Events only.
/// Warnings (RequeueFailed, ...) are always published one by one, but `Parked` in a storm
/// ([`in_series`]).
pub fn aggregatable(plan: &EventPlan) -> bool {
    plan.type_ == EventType::Normal && matches!(plan.reason, reason::REDRIVEN | reason::DROPPED)
}

/// Whether `plan` goes into its failure group's Event series during a parking storm
/// (`crate::event_series`): `Parked`, the one Warning folded, because it comes once per
/// record and a storm brings thousands; every other Warning is published one by one.
pub fn in_series(plan: &EventPlan) -> bool {
    plan.type_ == EventType::Warning && plan.reason == reason::PARKED
}

/// What a summary or series of `reason` says happened to its records.
pub fn verb(reason: &str) -> &'static str {
    match reason {
        reason::PARKED => "parked",
        reason::DROPPED => "dropped",
        _ => "redriven",
    }
}

/// `head` followed by as many of `names` as fit in [`MAX_NOTE`], then "and N more" for the
/// rest of `total`.
pub fn listed(head: String, names: &[String], total: usize) -> String {
    let mut note = head;
    for (i, name) in names.iter().enumerate() {
        let rest = total.saturating_sub(i);
        let tail = format!(" and {rest} more");
        let sep = if i == 0 { "" } else { ", " };
        if note.len() + sep.len() + name.len() + tail.len() > MAX_NOTE {
            note.push_str(&tail);
            return note;
        }
        note.push_str(sep);
        note.push_str(name);
    }
    let rest = total.saturating_sub(names.len());
    if rest > 0 {
        note.push_str(&format!(" and {rest} more"));
    }
    note
}

/// One Event about a queue standing for `names.len()` Events of `reason` about its records:
/// the count and the names, as many as fit in [`MAX_NOTE`]. Never repeats, so it is published
/// once (outside the recorder's cache).
pub fn summary(
    queue: &str,
    reason: &'static str,
    action: &'static str,
    names: &[String],
) -> EventPlan {
    let head = format!(
        "{} records of queue {queue} {}: ",
        names.len(),
        verb(reason)
    );
    EventPlan::normal(reason, action, listed(head, names, names.len())).once()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_normal_resolution_events_aggregate() {
        assert!(aggregatable(&EventPlan::normal(
            reason::REDRIVEN,
            action::REDRIVE,
            "x"
        )));
        assert!(aggregatable(&EventPlan::normal(
            reason::DROPPED,
            action::RESOLVE,
            "x"
        )));
        assert!(!aggregatable(&EventPlan::warning(
            reason::REQUEUE_FAILED,
            action::REDRIVE,
            "x"
        )));
        assert!(!aggregatable(
            &EventPlan::warning(reason::PARKED, action::PARK, "x").once()
        ));
        assert!(!aggregatable(&EventPlan::normal(
            reason::RESOLVE_CONFLICT,
            action::RESOLVE,
            "x"
        )));
        assert!(aggregatable(
            &EventPlan::normal(reason::REDRIVEN, action::REDRIVE, "x").once()
        ));
    }

    #[test]
    fn only_parked_goes_in_a_series() {
        assert!(in_series(
            &EventPlan::warning(reason::PARKED, action::PARK, "x").once()
        ));
        assert!(!in_series(&EventPlan::warning(
            reason::REQUEUE_FAILED,
            action::REDRIVE,
            "x"
        )));
        assert!(!in_series(&EventPlan::normal(
            reason::REDRIVEN,
            action::REDRIVE,
            "x"
        )));
    }

    #[test]
    fn a_list_says_how_many_it_left_out() {
        let names = vec!["a".to_string(), "b".to_string()];
        assert_eq!(listed("x: ".into(), &names, 2), "x: a, b");
        assert_eq!(listed("x: ".into(), &names, 5), "x: a, b and 3 more");
    }

    #[test]
    fn a_summary_counts_and_names_within_the_note_limit() {
        let names: Vec<String> = (0..3).map(|i| format!("job-{i}")).collect();
        let s = summary("relayer", reason::REDRIVEN, action::REDRIVE, &names);
        assert_eq!(
            s.note,
            "3 records of queue relayer redriven: job-0, job-1, job-2"
        );
        assert_eq!(s.type_, EventType::Normal);
        let many: Vec<String> = (0..500)
            .map(|i| format!("pi-{i:04}-settle-5d41402a-1"))
            .collect();
        let s = summary("relayer", reason::DROPPED, action::RESOLVE, &many);
        assert!(s.note.len() <= MAX_NOTE, "{}", s.note.len());
        assert!(
            s.note
                .starts_with("500 records of queue relayer dropped: pi-0000")
        );
        assert!(s.note.ends_with(" more"), "{}", s.note);
    }
}
