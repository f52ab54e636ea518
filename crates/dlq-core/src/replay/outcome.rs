//! Where a replay's decided record stands, read from the record's facts alone (the canary
//! and the stop bounds read it alike).

use crate::dead_letter::Phase;
use crate::facts::Facts;

/// Where one decided record stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Signed, not carried out yet.
    Pending,
    Redriven,
    Dropped,
    /// Signed, and its requeue is failing (Requeued=False for the current generation).
    Failing,
    /// Its decision was taken back (Parked, no action).
    Withdrawn,
}

/// A decided record's outcome, from its phase, action and `Requeued` condition.
pub fn outcome_of(r: &impl Facts) -> Outcome {
    match r.phase() {
        Phase::Redriven => Outcome::Redriven,
        Phase::Dropped => Outcome::Dropped,
        Phase::Parked if r.action().is_none() => Outcome::Withdrawn,
        Phase::Parked => {
            if r.requeue_failing() {
                Outcome::Failing
            } else {
                Outcome::Pending
            }
        }
    }
}
