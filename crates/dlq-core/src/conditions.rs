//! `metav1.Condition` bookkeeping, and every condition type and fixed reason the operator
//! writes, named once.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// `Ready`: on a record, whether it is resolved (True) or its decision was refused (False); a
/// Parked record has none (the mark writes no status); on a queue, whether its target answers.
pub const READY: &str = "Ready";
/// `Requeued`: whether the broker confirmed the redriven job (False while requeue fails).
pub const REQUEUED: &str = "Requeued";
/// `Full`: on a queue, whether new parkings are refused, so sources leave dead messages in the
/// broker: its Parked records (and parkings admitted but not yet counted) reached `maxParked`,
/// or a ResourceQuota on its namespace's records is used up, or the operator's `--max-records`
/// is reached (`dlq_core::capacity::Bounds`).
pub const FULL: &str = "Full";

/// Fixed condition reasons. Failure reasons come from the target's error category.
pub mod reason {
    pub const UNSIGNED: &str = "Unsigned";
    pub const REQUEUED: &str = "Requeued";
    /// Requeued, and the decision changed to drop after the broker had confirmed the job.
    pub const REQUEUED_BEFORE_DROP: &str = "RequeuedBeforeDrop";
    pub const TARGET_REACHABLE: &str = "TargetReachable";
    pub const QUEUE_NOT_FOUND: &str = "QueueNotFound";
    /// A replay waits for the approvals its queue requires (the message says how many of how
    /// many, and whose).
    pub const AWAITING_APPROVAL: &str = "AwaitingApproval";
    pub const KUBE_API: &str = "KubeApi";
    pub const MAX_PARKED_REACHED: &str = "MaxParkedReached";
    pub const BELOW_MAX_PARKED: &str = "BelowMaxParked";
    /// Full: a ResourceQuota on `count/deadletters.dlq.dev` in the queue's namespace is used up.
    pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";
    /// Full: the operator's `--max-records` across every queue it watches is reached.
    pub const MAX_RECORDS_REACHED: &str = "MaxRecordsReached";
    /// A sealed job none of its queue's keys opens: refused, never sent half-opened.
    pub const SEAL_KEY_MISSING: &str = "SealKeyMissing";
    /// A sealed job whose ciphertext does not open with its key (damaged).
    pub const SEAL_BROKEN: &str = "SealBroken";

    // A record's body in its queue's store (`spec.bodies`): why it could not be kept or read
    // back, on a redrive's condition, a reveal's refusal and their Events.
    /// The record's object is not in the store (deleted by hand, a lifecycle rule).
    pub const BODY_MISSING: &str = "BodyMissing";
    /// The object is there but is not the body the record names (size or digest differ).
    pub const BODY_CORRUPT: &str = "BodyCorrupt";
    /// An external reference names an object the queue does not declare; not read.
    pub const BODY_OUTSIDE_STORE: &str = "BodyOutsideStore";
    /// The store did not answer, or refused (credentials, permissions).
    pub const BODY_STORE_UNREACHABLE: &str = "BodyStoreUnreachable";
    /// `spec.bodies` cannot be used (a Secret missing, a backend not built in, none at all).
    pub const BODY_STORE_MISCONFIGURED: &str = "BodyStoreMisconfigured";
    /// A stored body could not be sealed or opened.
    pub const BODY_SEAL_BROKEN: &str = "BodySealBroken";
    /// The store cannot keep a large dead message right now (an Event on the queue): it stays
    /// in the broker until the store answers.
    pub const BODY_STORE_UNAVAILABLE: &str = "BodyStoreUnavailable";
}

/// Longest condition message we write (the API limit is 32 KiB; we keep status small).
pub const MAX_MESSAGE: usize = 1024;

/// One condition to set, before its bookkeeping (transition time, generation).
pub struct Cond<'a> {
    pub type_: &'a str,
    pub status: bool,
    pub reason: &'a str,
    pub message: &'a str,
}

/// Sets `cond` in `list`, keeping `lastTransitionTime` when the status did not change.
pub fn set(list: &mut Vec<Condition>, cond: Cond<'_>, generation: Option<i64>, now: &Time) {
    let status = if cond.status { "True" } else { "False" }.to_string();
    let message = truncate(cond.message, MAX_MESSAGE);
    let existing = list.iter_mut().find(|c| c.type_ == cond.type_);
    match existing {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = now.clone();
            }
            c.status = status;
            c.reason = cond.reason.to_string();
            c.message = message;
            c.observed_generation = generation;
        }
        None => list.push(Condition {
            type_: cond.type_.to_string(),
            status,
            reason: cond.reason.to_string(),
            message,
            observed_generation: generation,
            last_transition_time: now.clone(),
        }),
    }
}

/// The condition of `type_`, if present.
pub fn find<'a>(list: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    list.iter().find(|c| c.type_ == type_)
}

/// Cuts `s` to at most `max` bytes on a char boundary, marking the cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    fn at(secs: i64) -> Time {
        Time(jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_moves_only_on_status_change() {
        let mut list = Vec::new();
        let c = |status, reason| Cond {
            type_: "Requeued",
            status,
            reason,
            message: "m",
        };
        set(&mut list, c(false, "BrokerUnreachable"), Some(1), &at(10));
        set(&mut list, c(false, "BrokerUnreachable"), Some(1), &at(20));
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].last_transition_time, at(10));
        set(&mut list, c(true, "Requeued"), Some(2), &at(30));
        assert_eq!(list[0].last_transition_time, at(30));
        assert_eq!(list[0].status, "True");
        assert_eq!(list[0].observed_generation, Some(2));
    }

    #[test]
    fn long_messages_are_cut_on_char_boundaries() {
        let s = "é".repeat(2000);
        let t = truncate(&s, 1024);
        assert!(t.len() <= 1024);
        assert!(t.ends_with("..."));
        assert_eq!(truncate("short", 10), "short");
    }
}
