//! `maxParked` as a hard limit, for parkers in any number of processes.
//!
//! The serialisation point is the DeadLetterQueue's status: a parker admits a new record by a
//! compare-and-swap (a merge patch carrying the status's resourceVersion) that adds the record's
//! name to `status.reservations`, and only creates the record once that write won. The operator
//! counts Parked records from its watch and, in the same status write, removes the
//! reservations of records its count already includes. So at every moment
//!
//! ```text
//! Parked records in etcd  <=  status.parked + |status.reservations|  <=  maxParked
//! ```
//!
//! because a record exists only after its reservation was written, and a reservation is
//! removed only together with a count that includes its record (both from one snapshot of the
//! watch, which is a prefix of the apiserver's history: it may over-count records resolved a
//! moment ago, never under-count). Parkers batch: one compare-and-swap admits every parking
//! waiting in that process, so a storm costs one queue write per batch, not per record.
//!
//! Reservations of parkers that died before creating are removed after [`RESERVATION_TTL_SECS`];
//! a parker never creates later than [`CREATE_WITHIN_SECS`] after its admission, so an expired
//! reservation can no longer turn into a record. Without a running operator nothing is
//! counted: reservations pile up and parking stops at `maxParked` (the safe side).

use std::collections::BTreeMap;

use crate::api::DeadLetterQueueStatus;

/// How long a reservation the operator has not seen a record for is kept.
pub const RESERVATION_TTL_SECS: i64 = 300;
/// A parker creates a record at most this long after its admission; later it asks again.
pub const CREATE_WITHIN_SECS: i64 = 60;
/// Clock skew tolerated between a parker (admission time) and the apiserver
/// (`creationTimestamp`) when matching a record to its reservation.
const SKEW_SECS: i64 = 60;

/// Slots in use: the operator's last count plus the parkings admitted since.
pub fn in_use(status: Option<&DeadLetterQueueStatus>) -> i64 {
    status.map_or(0, |s| {
        s.parked
            .saturating_add(i64::try_from(s.reservations.len()).unwrap_or(i64::MAX))
    })
}

/// What one compare-and-swap decides for a batch of parkings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Names to write into `status.reservations` (then create).
    pub admitted: Vec<String>,
    /// Names that do not fit: the queue is full.
    pub refused: Vec<String>,
    /// Slots in use before this batch.
    pub in_use: i64,
    /// The queue's `maxParked`.
    pub limit: i64,
}

/// Which of `names` fit under `limit`, in order. A name already reserved (a retry) is admitted
/// again without taking a second slot.
pub fn admit(status: Option<&DeadLetterQueueStatus>, limit: i64, names: &[String]) -> Admission {
    let used = in_use(status);
    let mut free = limit.saturating_sub(used);
    let mut out = Admission {
        admitted: Vec::new(),
        refused: Vec::new(),
        in_use: used,
        limit,
    };
    for name in names {
        let known = status.is_some_and(|s| s.reservations.contains_key(name));
        if known || out.admitted.contains(name) {
            out.admitted.push(name.clone());
        } else if free > 0 {
            free -= 1;
            out.admitted.push(name.clone());
        } else {
            out.refused.push(name.clone());
        }
    }
    out
}

/// The reservations the operator removes in its status write: those whose record is in the
/// same snapshot it counted (`created` gives a record's creationTimestamp in Unix seconds, or
/// None when the snapshot does not hold it), and those older than [`RESERVATION_TTL_SECS`].
/// A record older than its reservation (a name reused after retention deleted every cycle of
/// a job, seen in a stale snapshot) does not settle it.
pub fn settled(
    reservations: &BTreeMap<String, i64>,
    created: impl Fn(&str) -> Option<i64>,
    now: i64,
) -> Vec<String> {
    reservations
        .iter()
        .filter(|(name, at)| {
            now.saturating_sub(**at) > RESERVATION_TTL_SECS
                || created(name).is_some_and(|c| c >= at.saturating_sub(SKEW_SECS))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(parked: i64, reserved: &[&str]) -> DeadLetterQueueStatus {
        DeadLetterQueueStatus {
            parked,
            reservations: reserved.iter().map(|n| (n.to_string(), 100)).collect(),
            ..Default::default()
        }
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn admits_up_to_the_limit_counting_reservations() {
        let s = status(3, &["a"]);
        let a = admit(Some(&s), 6, &names(&["b", "c", "d"]));
        assert_eq!(a.in_use, 4);
        assert_eq!(a.admitted, names(&["b", "c"]));
        assert_eq!(a.refused, names(&["d"]));
    }

    #[test]
    fn a_retry_of_a_reserved_name_takes_no_second_slot() {
        let s = status(1, &["a"]);
        let a = admit(Some(&s), 2, &names(&["a", "a"]));
        assert_eq!((a.admitted.len(), a.refused.len()), (2, 0));
        let full = admit(Some(&s), 2, &names(&["b"]));
        assert_eq!(full.refused, names(&["b"]));
    }

    #[test]
    fn a_queue_without_status_starts_empty() {
        let a = admit(None, 1, &names(&["a", "b"]));
        assert_eq!((a.admitted, a.refused), (names(&["a"]), names(&["b"])));
    }

    #[test]
    fn counted_and_expired_reservations_settle_others_stay() {
        let r: BTreeMap<String, i64> =
            [("seen", 100), ("unseen", 100), ("old", 10), ("reused", 500)]
                .into_iter()
                .map(|(n, t)| (n.to_string(), t))
                .collect();
        let created = |n: &str| match n {
            "seen" => Some(101),
            "reused" => Some(50),
            _ => None,
        };
        let mut gone = settled(&r, created, 400);
        gone.sort();
        assert_eq!(gone, names(&["old", "seen"]));
    }
}
