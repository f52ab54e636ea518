//! The state machine of a record: what to do, given what was observed. Every phase × action
//! combination is unit-tested here.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

use crate::dead_letter::{Action, DeadLetter, Phase};

/// The manager a first server-side apply on a record whose managed fields were cleared names
/// the facts it finds after (the apiserver's `skipNonApplied` manager).
pub const BEFORE_FIRST_APPLY: &str = "before-first-apply";

/// What the reconciler should do next with one record (its effects are built by [`crate::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new record ([`needs_mark`]): mark it, announce it and count it, once.
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

/// The decision for a record in `phase` that [`needs_mark`] or not, carrying `action` signed by
/// `by`.
pub fn decide(
    phase: Phase,
    needs_mark: bool,
    action: Option<Action>,
    by: Option<&str>,
) -> Decision {
    match (phase, action) {
        (Phase::Redriven | Phase::Dropped, _) => Decision::Done,
        (_, Some(action)) => match by.map(str::trim).filter(|b| !b.is_empty()) {
            None => Decision::Refuse {
                reason: "every decision must be signed: spec.by is empty".into(),
            },
            Some(by) => match action {
                Action::Redrive => Decision::Redrive { by: by.into() },
                Action::Drop => Decision::Drop { by: by.into() },
            },
        },
        (Phase::Parked, None) if needs_mark => Decision::MarkParked,
        (Phase::Parked, None) => Decision::Wait,
    }
}

/// Whether `record` still needs the operator's mark (its Parked Event and count, and its
/// managed fields cleared). The mark writes no status, so it is told by what it does clear:
/// a record needs one while it is Parked without a decision, has no condition (the records a
/// previous release marked have a Ready condition, failing ones a Requeued one), and has
/// managed fields (every create leaves its creator's entry) none of which is
/// [`BEFORE_FIRST_APPLY`] (what a server-side apply adds after the mark cleared them).
pub fn needs_mark(record: &DeadLetter) -> bool {
    let conditions = record.status.as_ref().map_or(0, |s| s.conditions.len());
    let managed = record
        .metadata
        .managed_fields
        .as_deref()
        .unwrap_or_default();
    record.spec.action.is_none()
        && record.phase() == Phase::Parked
        && conditions == 0
        && !managed.is_empty()
        && managed
            .iter()
            .all(|m| m.manager.as_deref() != Some(BEFORE_FIRST_APPLY))
}

/// What a copy of a record keeps of managed fields it drops (the held copy, a record rebuilt
/// from its summary) so that [`needs_mark`] reads the same of the copy: one empty entry when the
/// record needs its mark, else none.
pub fn managed_fields_kept(needs_mark: bool) -> Option<Vec<ManagedFieldsEntry>> {
    needs_mark.then(|| vec![ManagedFieldsEntry::default()])
}

/// What `record` calls for, from its phase, whether it [`needs_mark`] and its decision.
pub fn for_record(record: &DeadLetter) -> Decision {
    decide(
        record.phase(),
        needs_mark(record),
        record.spec.action,
        record.spec.by.as_deref(),
    )
}

/// Whether reconciling `record` would do anything. A record that waits for a decision, or is
/// resolved, is not queued at all: a restart with 100,000 parked records queues none of them
/// (each queued reconcile holds two copies of the record's reference until it runs).
pub fn has_work(record: &DeadLetter) -> bool {
    !matches!(for_record(record), Decision::Done | Decision::Wait)
}

/// The identity of one record's redrive. Every enqueue of that redrive carries it as its
/// idempotency key, and a process remembers a broker's confirmation by it. A record a source
/// parked from one dead message has that message's key (`crate::park::message_key`, which a
/// standing replay's pass-through of the same message carries too: one dead message, one key,
/// however it goes back); any other record, its uid and the job's cycle. The generation is
/// left out on purpose: an edit of the spec after the confirmation (a note, a re-signature)
/// does not ask for a second delivery.
pub fn redrive_key(record: &DeadLetter) -> String {
    if let Some(message) = crate::park::source_message(record) {
        let ns = record.metadata.namespace.as_deref().unwrap_or_default();
        return crate::park::message_key(ns, &record.spec.queue, Some(message), &[]);
    }
    let uid = record.metadata.uid.as_deref().unwrap_or_default();
    format!("{uid}-{}", record.spec.cycle)
}

/// The next step of a redrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedriveStep {
    /// No broker has confirmed this redrive's job yet: enqueue it, then write the resolution.
    Enqueue,
    /// A broker confirmed the job already (the resolution's write failed since): write only the
    /// resolution. Enqueueing again would deliver the job twice without any crash.
    WriteStatus,
}

/// What a redrive does, given whether its job's confirmation is remembered (see [`redrive_key`]).
pub fn redrive_step(confirmed: bool) -> RedriveStep {
    if confirmed {
        RedriveStep::WriteStatus
    } else {
        RedriveStep::Enqueue
    }
}

/// The decision to carry out, given the signer of a redrive of this record whose job a broker
/// already confirmed (see [`redrive_key`]), if this process remembers one. Once the job is on
/// its target the record is Redriven by that signer, whatever the decision says now: a drop
/// (or a redrive signed again by someone else) that came after the confirmation cannot take the
/// job back, and writing Dropped would hide a job a consumer is running.
pub fn after_confirmation(decision: Decision, confirmed_by: Option<&str>) -> Decision {
    match (decision, confirmed_by) {
        (Decision::Drop { .. } | Decision::Redrive { .. }, Some(by)) => {
            Decision::Redrive { by: by.into() }
        }
        (decision, _) => decision,
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

#[cfg(test)]
mod tests {
    use super::*;

    const PHASES: [Phase; 3] = [Phase::Parked, Phase::Redriven, Phase::Dropped];
    const ACTIONS: [Option<Action>; 3] = [None, Some(Action::Redrive), Some(Action::Drop)];

    #[test]
    fn every_phase_and_action() {
        for phase in PHASES {
            for needs_mark in [false, true] {
                for action in ACTIONS {
                    for by in [None, Some(""), Some("  "), Some("ops")] {
                        let plan = decide(phase, needs_mark, action, by);
                        let signed = by.is_some_and(|b| !b.trim().is_empty());
                        let expected = match (phase, action) {
                            (Phase::Redriven | Phase::Dropped, _) => Decision::Done,
                            (_, Some(_)) if !signed => Decision::Refuse {
                                reason: "every decision must be signed: spec.by is empty".into(),
                            },
                            (_, Some(Action::Redrive)) => Decision::Redrive { by: "ops".into() },
                            (_, Some(Action::Drop)) => Decision::Drop { by: "ops".into() },
                            (Phase::Parked, None) if needs_mark => Decision::MarkParked,
                            (Phase::Parked, None) => Decision::Wait,
                        };
                        assert_eq!(
                            plan, expected,
                            "phase {phase:?} needs_mark {needs_mark} action {action:?} by {by:?}"
                        );
                    }
                }
            }
        }
    }

    fn entry(manager: &str) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            ..ManagedFieldsEntry::default()
        }
    }

    fn condition(
        type_: &str,
        status: &str,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "R".into(),
            message: "m".into(),
            observed_generation: None,
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::UNIX_EPOCH,
            ),
        }
    }

    /// Every case of the rule: what a create leaves needs a mark; what the mark leaves, what a
    /// previous release's mark left, a decision, a resolution, a condition and a server-side
    /// apply after the mark do not.
    #[test]
    fn a_record_needs_its_mark_only_as_a_create_left_it() {
        use crate::dead_letter::DeadLetterStatus;
        let created = || {
            let mut r = crate::testing::RecordBuilder::job("j").build();
            r.metadata.managed_fields = Some(vec![entry("dlq-parker")]);
            r
        };
        let with = |change: &dyn Fn(&mut DeadLetter)| {
            let mut r = created();
            change(&mut r);
            r
        };
        let status = |phase: Option<Phase>, conditions: Vec<_>| {
            Some(DeadLetterStatus {
                phase,
                conditions,
                ..DeadLetterStatus::default()
            })
        };
        let cases: Vec<(&str, DeadLetter, bool)> = vec![
            ("as created", created(), true),
            (
                "created by two writers",
                with(&|r| {
                    r.metadata.managed_fields = Some(vec![entry("dlq-parker"), entry("kubectl")])
                }),
                true,
            ),
            (
                "phase Parked by the schema's default",
                with(&|r| r.status = status(Some(Phase::Parked), vec![])),
                true,
            ),
            (
                "an empty status",
                with(&|r| r.status = status(None, vec![])),
                true,
            ),
            (
                "held copy: the stand-in entry",
                with(&|r| r.metadata.managed_fields = managed_fields_kept(true)),
                true,
            ),
            (
                "marked: no managed fields",
                with(&|r| r.metadata.managed_fields = None),
                false,
            ),
            (
                "marked: an empty list",
                with(&|r| r.metadata.managed_fields = Some(vec![])),
                false,
            ),
            (
                "marked, then a server-side apply",
                with(&|r| {
                    r.metadata.managed_fields = Some(vec![entry(BEFORE_FIRST_APPLY), entry("flux")])
                }),
                false,
            ),
            (
                "marked by a previous release (Ready), fields kept",
                with(&|r| r.status = status(Some(Phase::Parked), vec![condition("Ready", "True")])),
                false,
            ),
            (
                "marked by a previous release (Ready), fields cleared",
                with(&|r| {
                    r.status = status(Some(Phase::Parked), vec![condition("Ready", "True")]);
                    r.metadata.managed_fields = None;
                }),
                false,
            ),
            (
                "a failing requeue",
                with(&|r| r.status = status(None, vec![condition("Requeued", "False")])),
                false,
            ),
            (
                "decided",
                with(&|r| {
                    r.spec.action = Some(Action::Redrive);
                    r.spec.by = Some("ops".into());
                }),
                false,
            ),
            (
                "decided, unsigned",
                with(&|r| r.spec.action = Some(Action::Drop)),
                false,
            ),
            (
                "redriven",
                with(&|r| r.status = status(Some(Phase::Redriven), vec![])),
                false,
            ),
            (
                "dropped",
                with(&|r| r.status = status(Some(Phase::Dropped), vec![])),
                false,
            ),
        ];
        for (case, record, want) in cases {
            assert_eq!(needs_mark(&record), want, "{case}");
            let decision = for_record(&record);
            assert_eq!(
                decision == Decision::MarkParked,
                want,
                "{case}: {decision:?}"
            );
        }
        assert_eq!(managed_fields_kept(false), None);
    }

    #[test]
    fn resolved_records_are_never_acted_on_again() {
        for action in ACTIONS {
            for needs_mark in [false, true] {
                assert_eq!(
                    decide(Phase::Redriven, needs_mark, action, Some("ops")),
                    Decision::Done
                );
                assert_eq!(
                    decide(Phase::Dropped, needs_mark, action, Some("ops")),
                    Decision::Done
                );
            }
        }
    }

    #[test]
    fn a_confirmed_redrive_only_writes_its_status() {
        assert_eq!(redrive_step(false), RedriveStep::Enqueue);
        assert_eq!(redrive_step(true), RedriveStep::WriteStatus);
    }

    #[test]
    fn a_confirmed_redrive_outranks_a_later_decision() {
        let drop = Decision::Drop { by: "bob".into() };
        let redrive = |by: &str| Decision::Redrive { by: by.into() };
        assert_eq!(after_confirmation(drop.clone(), None), drop);
        assert_eq!(after_confirmation(drop, Some("alice")), redrive("alice"));
        assert_eq!(
            after_confirmation(redrive("carol"), Some("alice")),
            redrive("alice"),
            "the resolution names who decided the redrive that was sent"
        );
        assert_eq!(
            after_confirmation(Decision::Done, Some("alice")),
            Decision::Done,
            "resolved already: nothing to write"
        );
    }

    #[test]
    fn a_redrive_key_names_the_record_and_its_cycle_not_the_generation() {
        let mut record = crate::testing::RecordBuilder::job("j").uid("u-1").build();
        record.spec.cycle = 2;
        assert_eq!(redrive_key(&record), "u-1-2");
        record.metadata.generation = Some(7);
        assert_eq!(
            redrive_key(&record),
            "u-1-2",
            "a spec edit is the same redrive"
        );
        record.spec.cycle = 3;
        assert_ne!(redrive_key(&record), "u-1-2");
    }

    /// Issue 47: a record a source parked from one dead message is redriven under that
    /// message's key, the key its pass-through would have had: one message, one key.
    #[test]
    fn a_record_parked_from_a_dead_message_is_redriven_under_that_messages_key() {
        let req = crate::park::ParkRequest::new(
            "relayer",
            crate::dead_letter::Job {
                id: "pi_1/settle".into(),
                payload: Some("{}".into()),
                ..Default::default()
            },
        )
        .with_message("relayer:dead#7");
        let mut record = crate::park::new_record(&req, 1);
        record.metadata.namespace = Some("payments".into());
        record.metadata.uid = Some("u-1".into());
        let key = crate::park::message_key("payments", "relayer", Some("relayer:dead#7"), b"");
        assert_eq!(redrive_key(&record), key);
        assert!(key.starts_with("msg-"));
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
}
