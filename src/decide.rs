//! The pure core: what to do with a record, given what was observed. No I/O here, so every
//! phase × action combination is unit-tested without an apiserver.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use crate::api::{Action, Phase};

/// What the reconciler should do next with one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The operator has not written a phase yet: record it as Parked.
    MarkParked,
    /// Parked, no decision: wait for a human, however long it takes.
    Wait,
    /// Enqueue the untouched job on the target, then resolve as Redriven (signed by `by`).
    Redrive { by: String },
    /// Resolve as Dropped (signed by `by`); nothing is enqueued.
    Drop { by: String },
    /// Already resolved: nothing to do, ever.
    Done,
    /// A decision that cannot be honoured (unsigned). The apiserver's CEL rule refuses these,
    /// so reaching this means the CRD is older than the operator.
    Refuse { reason: String },
}

/// The decision for a record in `phase` (None: never written) carrying `action` signed by `by`.
pub fn decide(phase: Option<Phase>, action: Option<Action>, by: Option<&str>) -> Plan {
    match (phase, action) {
        (Some(Phase::Redriven | Phase::Dropped), _) => Plan::Done,
        (_, Some(action)) => match by.map(str::trim).filter(|b| !b.is_empty()) {
            None => Plan::Refuse {
                reason: "every decision must be signed: spec.by is empty".into(),
            },
            Some(by) => match action {
                Action::Redrive => Plan::Redrive { by: by.into() },
                Action::Drop => Plan::Drop { by: by.into() },
            },
        },
        (None, None) => Plan::MarkParked,
        (Some(Phase::Parked), None) => Plan::Wait,
    }
}

/// After a status write lost its compare-and-swap, what the fresh record tells us to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterConflict {
    /// Someone else resolved it first: stop, count the conflict. Our enqueue (if any) was a
    /// duplicate delivery, which consumers tolerate by re-reading the business state.
    Lost,
    /// Still Parked (something else bumped resourceVersion): write the status again, without
    /// enqueueing again.
    RetryWrite,
}

pub fn after_conflict(fresh_phase: Phase) -> AfterConflict {
    match fresh_phase {
        Phase::Parked => AfterConflict::RetryWrite,
        Phase::Redriven | Phase::Dropped => AfterConflict::Lost,
    }
}

/// Capped exponential backoff for requeue failures: 1s, 2s, 4s, ... up to `cap`.
pub fn backoff(attempt: u32, cap: Duration) -> Duration {
    let secs = 1u64.checked_shl(attempt.min(32)).unwrap_or(u64::MAX);
    Duration::from_secs(secs).min(cap)
}

/// Whether a record resolved at `resolved_at` is past `keep` at `now`. Parked records never are.
pub fn retention_expired(
    phase: Phase,
    resolved_at: Option<Timestamp>,
    keep: Duration,
    now: Timestamp,
) -> bool {
    match (phase, resolved_at) {
        (Phase::Parked, _) | (_, None) => false,
        (_, Some(at)) => SignedDuration::try_from(keep)
            .ok()
            .and_then(|keep| at.checked_add(keep).ok())
            .is_some_and(|expiry| expiry <= now),
    }
}

/// Parses a Go-style duration (`720h`, `1h30m`, `90s`, `500ms`), as `retention.resolvedFor`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    if rest == "0" {
        return Some(Duration::ZERO);
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(digits);
        let value: f64 = num.parse().ok()?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let secs = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += Duration::try_from_secs_f64(value * secs).ok()?;
        rest = tail;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PHASES: [Option<Phase>; 4] = [
        None,
        Some(Phase::Parked),
        Some(Phase::Redriven),
        Some(Phase::Dropped),
    ];
    const ACTIONS: [Option<Action>; 3] = [None, Some(Action::Redrive), Some(Action::Drop)];

    #[test]
    fn every_phase_and_action() {
        for phase in PHASES {
            for action in ACTIONS {
                for by in [None, Some(""), Some("  "), Some("ops")] {
                    let plan = decide(phase, action, by);
                    let signed = by.is_some_and(|b| !b.trim().is_empty());
                    let expected = match (phase, action) {
                        (Some(Phase::Redriven | Phase::Dropped), _) => Plan::Done,
                        (_, Some(_)) if !signed => Plan::Refuse {
                            reason: "every decision must be signed: spec.by is empty".into(),
                        },
                        (_, Some(Action::Redrive)) => Plan::Redrive { by: "ops".into() },
                        (_, Some(Action::Drop)) => Plan::Drop { by: "ops".into() },
                        (None, None) => Plan::MarkParked,
                        (Some(Phase::Parked), None) => Plan::Wait,
                    };
                    assert_eq!(
                        plan, expected,
                        "phase {phase:?} action {action:?} by {by:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn resolved_records_are_never_acted_on_again() {
        for action in ACTIONS {
            assert_eq!(
                decide(Some(Phase::Redriven), action, Some("ops")),
                Plan::Done
            );
            assert_eq!(
                decide(Some(Phase::Dropped), action, Some("ops")),
                Plan::Done
            );
        }
    }

    #[test]
    fn conflicts() {
        assert_eq!(after_conflict(Phase::Parked), AfterConflict::RetryWrite);
        assert_eq!(after_conflict(Phase::Redriven), AfterConflict::Lost);
        assert_eq!(after_conflict(Phase::Dropped), AfterConflict::Lost);
    }

    #[test]
    fn backoff_is_capped_exponential() {
        let cap = Duration::from_secs(60);
        let got: Vec<u64> = (0..9).map(|a| backoff(a, cap).as_secs()).collect();
        assert_eq!(got, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(u32::MAX, cap), cap);
    }

    #[test]
    fn retention_never_touches_parked() {
        let now = Timestamp::now();
        let old = now - SignedDuration::from_hours(400 * 24);
        let keep = Duration::from_secs(3600);
        assert!(!retention_expired(Phase::Parked, Some(old), keep, now));
        assert!(!retention_expired(Phase::Parked, None, keep, now));
        assert!(retention_expired(Phase::Redriven, Some(old), keep, now));
        assert!(retention_expired(Phase::Dropped, Some(old), keep, now));
        assert!(!retention_expired(
            Phase::Dropped,
            Some(now),
            keep,
            now + SignedDuration::from_secs(10)
        ));
        assert!(!retention_expired(Phase::Dropped, None, keep, now));
    }

    #[test]
    fn go_durations() {
        assert_eq!(
            parse_duration("720h"),
            Some(Duration::from_secs(720 * 3600))
        );
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration(""), None);
        assert_eq!(parse_duration("3d"), None);
        assert_eq!(parse_duration("h"), None);
    }
}
