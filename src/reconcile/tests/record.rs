//! The records reconciler: marks, redrives, drops, conflicts, flushes and wakes.

use super::*;
use crate::reconcile::record;

struct Harness {
    apiserver: Arc<FakeApiserver>,
    target: Arc<FakeTarget>,
    ctx: Arc<Context>,
}

impl Harness {
    fn new(record: &DeadLetter, queues: &[DeadLetterQueue]) -> Self {
        Self::with(
            FakeApiserver::holding([record.clone()]),
            Arc::default(),
            queues,
        )
    }

    /// A fresh operator process (empty memory) over the same apiserver and broker.
    fn with(
        apiserver: Arc<FakeApiserver>,
        target: Arc<FakeTarget>,
        queues: &[DeadLetterQueue],
    ) -> Self {
        let ctx = context(&apiserver, &target, queues, Settings::default());
        Harness {
            apiserver,
            target,
            ctx,
        }
    }

    async fn reconcile(&self) -> Result<ReconcileAction, record::RecordError> {
        record::reconcile(Arc::new(self.apiserver.current()), self.ctx.clone()).await
    }

    fn phase(&self) -> Phase {
        self.apiserver.current().phase()
    }

    fn sent(&self) -> Vec<JobMessage> {
        self.target
            .received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn delivered(&self) -> usize {
        self.sent().len()
    }

    fn metric(&self, series: &str) -> f64 {
        metric(&self.ctx, series)
    }
}

const SUCCESS: &str =
    r#"dlq_redrives_total{namespace="payments",queue="relayer",result="success"}"#;
const FAILURE: &str =
    r#"dlq_redrives_total{namespace="payments",queue="relayer",result="failure"}"#;
const CONFLICT: &str =
    r#"dlq_redrives_total{namespace="payments",queue="relayer",result="conflict"}"#;

const PARKED: &str =
    r#"dlq_parked_total{namespace="payments",queue="relayer",failure_kind="transient"}"#;

/// The mark is one write: the record's managed fields cleared at the version read. No status
/// is written (the CRD's default serves it as Parked), one Parked Event, one count; the record
/// then waits.
#[tokio::test]
async fn a_new_record_is_marked_with_one_write_announced_and_counted_once() {
    let h = Harness::new(&record(None), &[queue()]);
    assert!(dlq_core::decide::needs_mark(&h.apiserver.current()));
    assert_eq!(
        h.reconcile().await.expect("reconcile"),
        ReconcileAction::await_change()
    );
    assert_eq!(h.apiserver.cleared(), [NAME], "one metadata write");
    assert!(h.apiserver.writes().is_empty(), "no status write");
    let now = h.apiserver.current();
    assert_eq!(now.metadata.managed_fields, None);
    assert_eq!(now.status, None, "Parked by the schema's default");
    assert_eq!(h.phase(), Phase::Parked);
    assert!(!dlq_core::decide::needs_mark(&now));
    assert_eq!(h.apiserver.reasons(), ["Parked"]);
    assert!(h.apiserver.events()[0].once);
    assert_eq!(h.metric(PARKED), 1.0);

    h.reconcile().await.expect("second reconcile");
    assert_eq!(h.apiserver.reasons(), ["Parked"], "a Parked record waits");
    assert_eq!(h.apiserver.cleared().len(), 1);
    assert_eq!(h.metric(PARKED), 1.0);
}

/// A record that changed since it was read (a decision, another replica's mark) is looked at
/// again, unmarked and unannounced; a mark that fails otherwise is an error, retried.
#[tokio::test]
async fn a_mark_that_loses_its_compare_and_swap_announces_nothing() {
    let h = Harness::new(&record(None), &[queue()]);
    let stale = h.apiserver.current();
    h.apiserver.edit(NAME, |_| {});
    let again = record::reconcile(Arc::new(stale), h.ctx.clone()).await;
    assert_eq!(
        again.expect("reconcile"),
        ReconcileAction::requeue(Duration::from_secs(1))
    );
    assert!(h.apiserver.cleared().is_empty());
    assert!(h.apiserver.reasons().is_empty(), "not marked");
    assert_eq!(h.metric(PARKED), 0.0);

    // Two replicas with the same copy: one mark wins, one Event.
    let fresh = Arc::new(h.apiserver.current());
    let rival = context(&h.apiserver, &h.target, &[queue()], Settings::default());
    record::reconcile(fresh.clone(), h.ctx.clone())
        .await
        .expect("reconcile");
    record::reconcile(fresh, rival.clone())
        .await
        .expect("the loser");
    assert_eq!(h.apiserver.cleared(), [NAME]);
    assert_eq!(h.apiserver.reasons(), ["Parked"]);
    assert_eq!(h.metric(PARKED) + metric(&rival, PARKED), 1.0);
}

/// Records a previous release marked (a written status: phase Parked and a Ready condition,
/// managed fields kept or cleared) are not marked again: no write, no second Parked Event.
#[tokio::test]
async fn a_record_marked_by_the_previous_release_is_left_as_it_is() {
    use dlq_core::dead_letter::DeadLetterStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    let ready = Condition {
        type_: conditions::READY.into(),
        status: "True".into(),
        reason: "Parked".into(),
        message: "waiting for a signed decision (spec.action + spec.by)".into(),
        observed_generation: Some(1),
        last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
    };
    for fields in [Some(vec![crate::state::apiserver::fake::creator()]), None] {
        let mut old = record(None);
        old.status = Some(DeadLetterStatus {
            phase: Some(Phase::Parked),
            conditions: vec![ready.clone()],
            ..DeadLetterStatus::default()
        });
        old.metadata.managed_fields = fields.clone();
        let h = Harness::new(&old, &[queue()]);
        assert!(!dlq_core::decide::has_work(&h.apiserver.current()));
        assert_eq!(
            h.reconcile().await.expect("reconcile"),
            ReconcileAction::await_change()
        );
        assert!(h.apiserver.cleared().is_empty(), "{fields:?}");
        assert!(h.apiserver.writes().is_empty());
        assert!(h.apiserver.reasons().is_empty(), "no second Parked Event");
        assert_eq!(h.metric(PARKED), 0.0);

        // Its decision is carried out as ever, and the Ready condition says the resolution.
        h.apiserver.edit(NAME, |r| {
            r.spec.action = Some(Action::Drop);
            r.spec.by = Some("ops".into());
        });
        h.reconcile().await.expect("drop");
        assert_eq!(h.phase(), Phase::Dropped);
        assert_eq!(h.apiserver.reasons(), ["Dropped"]);
    }
}

/// While sources are busy parking, a new record's mark waits for its turn behind another mark,
/// and a signed decision does not wait at all (see `parking_first`).
#[tokio::test]
async fn while_sources_park_marks_take_turns_and_decisions_do_not_wait() {
    let h = Harness::new(&record(None), &[queue()]);
    let busy = crate::state::parking_first::BUSY;
    let parking: Vec<_> = (0..busy).map(|_| h.ctx.parking_first.parking()).collect();
    let other_mark = h.ctx.parking_first.mark_turn().await;
    let mut mark = Box::pin(h.reconcile());
    assert!((&mut mark).now_or_never().is_none(), "the mark waits");
    assert!(h.apiserver.cleared().is_empty());
    drop(other_mark);
    tokio::time::timeout(Duration::from_secs(5), mark)
        .await
        .expect("the mark goes once the other is done")
        .expect("reconcile");
    assert_eq!(h.phase(), Phase::Parked);
    assert_eq!(h.apiserver.reasons(), ["Parked"]);
    drop(parking);

    let d = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    let _parking: Vec<_> = (0..busy).map(|_| d.ctx.parking_first.parking()).collect();
    let _other_mark = d.ctx.parking_first.mark_turn().await;
    tokio::time::timeout(Duration::from_secs(5), d.reconcile())
        .await
        .expect("a decision does not wait for marks")
        .expect("reconcile");
    assert_eq!(d.phase(), Phase::Redriven);
    assert_eq!(d.delivered(), 1);
}

#[tokio::test]
async fn a_redrive_requeues_the_untouched_job_then_resolves() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.reconcile().await.expect("reconcile");
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].payload, &br#"{"intent":"pi_0003"}"#[..]);
    assert_eq!(sent[0].headers["x-trace"], "abc");
    let now = h.apiserver.current();
    assert_eq!(now.phase(), Phase::Redriven);
    assert_eq!(
        now.status.as_ref().and_then(|s| s.resolved_by.as_deref()),
        Some("ops")
    );
    assert_eq!(h.apiserver.reasons(), ["Redriven"]);
    assert_eq!(h.metric(SUCCESS), 1.0);

    h.reconcile().await.expect("again");
    assert_eq!(
        h.delivered(),
        1,
        "a resolved record is never requeued again"
    );
}

#[test]
fn a_held_record_keeps_its_jobs_bytes_only_while_its_decision_waits() {
    let held = |mut r: DeadLetter| {
        crate::run::held::strip(&mut r);
        (r.spec.job.has_payload(), r.spec.job.headers.len())
    };
    assert_eq!(held(record(None)), (false, 0), "parked, undecided");
    assert_eq!(held(record(Some(Action::Redrive))), (true, 1), "decided");
    let mut resolved = record(Some(Action::Redrive));
    resolved.status = Some(DeadLetterStatus {
        phase: Some(Phase::Redriven),
        ..Default::default()
    });
    assert_eq!(held(resolved), (false, 0), "history");
    let mut big = record(Some(Action::Redrive));
    big.spec.job.payload = Some("x".repeat(crate::run::held::HELD_PAYLOAD_MAX + 1));
    assert_eq!(held(big), (false, 0), "over the held size");
}

#[tokio::test]
async fn a_redrive_from_a_stripped_held_copy_sends_the_whole_job() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    // The store stripped the record while it waited; the decision's event was not seen yet.
    let mut held = record(None);
    crate::run::held::strip(&mut held);
    held.spec.action = Some(Action::Redrive);
    held.spec.by = Some("ops".into());
    record::reconcile(Arc::new(held), h.ctx.clone())
        .await
        .expect("reconcile");
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].payload, &br#"{"intent":"pi_0003"}"#[..]);
    assert_eq!(sent[0].headers["x-trace"], "abc");
    assert_eq!(h.phase(), Phase::Redriven);
}

#[tokio::test]
async fn a_stale_copy_of_a_record_resolved_here_is_not_enqueued_again() {
    let decided = record(Some(Action::Redrive));
    let h = Harness::new(&decided, &[queue()]);
    h.reconcile().await.expect("reconcile");
    assert_eq!(h.phase(), Phase::Redriven);
    // The other records controller's cache still shows it Parked with its decision.
    let action = record::reconcile(Arc::new(decided), h.ctx.clone())
        .await
        .expect("stale reconcile");
    assert_eq!(action, ReconcileAction::await_change());
    assert_eq!(h.delivered(), 1, "enqueued once");
}

#[tokio::test]
async fn a_drop_resolves_without_enqueueing() {
    let h = Harness::new(&record(Some(Action::Drop)), &[queue()]);
    h.reconcile().await.expect("reconcile");
    assert_eq!(h.phase(), Phase::Dropped);
    assert_eq!(h.delivered(), 0);
    assert_eq!(h.apiserver.reasons(), ["Dropped"]);
}

#[tokio::test]
async fn a_failing_broker_keeps_the_record_parked_and_backs_off() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.target.down.store(true, Ordering::SeqCst);
    let first = h.reconcile().await.expect("reconcile");
    assert_eq!(first, ReconcileAction::requeue(Duration::from_secs(1)));
    let now = h.apiserver.current();
    assert_eq!(now.phase(), Phase::Parked);
    let requeued = now
        .status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, conditions::REQUEUED))
        .expect("Requeued");
    assert_eq!(
        (requeued.status.as_str(), requeued.reason.as_str()),
        ("False", "BrokerUnreachable")
    );
    let writes = h.apiserver.writes().len();

    let second = h.reconcile().await.expect("reconcile");
    assert_eq!(second, ReconcileAction::requeue(Duration::from_secs(2)));
    assert_eq!(
        h.apiserver.writes().len(),
        writes,
        "unchanged condition not rewritten"
    );
    assert_eq!(h.apiserver.reasons(), ["RequeueFailed", "RequeueFailed"]);
    assert_eq!(h.metric(FAILURE), 2.0);

    h.target.down.store(false, Ordering::SeqCst);
    h.reconcile().await.expect("reconcile");
    assert_eq!(h.phase(), Phase::Redriven);
    assert_eq!(h.delivered(), 1);
    let requeued = h.apiserver.current().status.and_then(|s| {
        conditions::find(&s.conditions, conditions::REQUEUED).map(|c| c.status.clone())
    });
    assert_eq!(requeued.as_deref(), Some("True"));
}

#[tokio::test]
async fn a_missing_queue_is_a_requeue_failure_that_says_so() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[]);
    h.reconcile().await.expect("reconcile");
    let reason = h.apiserver.current().status.and_then(|s| {
        conditions::find(&s.conditions, conditions::REQUEUED).map(|c| c.reason.clone())
    });
    assert_eq!(reason.as_deref(), Some("QueueNotFound"));
    assert_eq!(h.delivered(), 0);
}

/// Records can stream in before the queues are listed: a queue the cache has not listed yet is
/// not missing, so nothing is written (no QueueNotFound at every start-up) and it asks again.
#[tokio::test]
async fn a_queue_not_listed_yet_is_waited_for_not_reported_missing() {
    let apiserver = FakeApiserver::holding([record(Some(Action::Redrive))]);
    let (queues, _writer) = reflector::store::<DeadLetterQueue>();
    let ctx = Arc::new(Context::new(
        apiserver.clone(),
        Arc::new(Arc::<FakeTarget>::default()),
        crate::state::records::RecordIndex::listed_with(&apiserver.all()),
        queues,
        Metrics::default(),
        Settings::default(),
    ));
    let action = record::reconcile(Arc::new(apiserver.current()), ctx)
        .await
        .expect("reconcile");
    assert_eq!(
        action,
        ReconcileAction::requeue(crate::reconcile::LIST_WAIT)
    );
    assert!(apiserver.writes().is_empty());
    assert!(apiserver.reasons().is_empty(), "no Event");
}

#[tokio::test]
async fn a_conflict_while_still_parked_rewrites_without_enqueueing_again() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.bumps.store(2, Ordering::SeqCst);
    h.reconcile().await.expect("reconcile");
    assert_eq!(h.phase(), Phase::Redriven);
    assert_eq!(h.delivered(), 1);
    assert_eq!(h.metric(SUCCESS), 1.0);
    assert_eq!(h.metric(CONFLICT), 0.0);
}

#[tokio::test]
async fn a_lost_race_stops_counts_a_conflict_and_names_the_winner() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    *h.apiserver.race.lock().unwrap_or_else(|p| p.into_inner()) = Some(Phase::Dropped);
    h.reconcile().await.expect("reconcile");
    let now = h.apiserver.current();
    assert_eq!(
        now.phase(),
        Phase::Dropped,
        "the winner's resolution stands"
    );
    assert_eq!(
        now.status.and_then(|s| s.resolved_by).as_deref(),
        Some("alice")
    );
    assert_eq!(h.apiserver.reasons(), ["ResolveConflict"]);
    let note = h.apiserver.events()[0].note.clone();
    assert_eq!(
        note,
        "already dropped by alice; this resolver (redriven) lost the race"
    );
    assert_eq!(h.metric(CONFLICT), 1.0);
    assert_eq!(h.metric(SUCCESS), 0.0);
}

#[tokio::test]
async fn a_failed_status_write_after_the_requeue_never_requeues_twice_in_one_process() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.fail_next_write.store(true, Ordering::SeqCst);
    let err = h.reconcile().await.expect_err("the write failed");
    assert_eq!(err.category(), "KubeApi");
    assert_eq!(h.phase(), Phase::Parked);
    assert_eq!(h.delivered(), 1);

    h.reconcile().await.expect("retry");
    assert_eq!(h.phase(), Phase::Redriven);
    assert_eq!(h.delivered(), 1, "the retry only writes the status");
}

/// A drop decided after the broker confirmed the redrive (the status write failing between)
/// cannot take the job back: the record ends Redriven by the redrive's signer, with a Warning
/// saying the drop came too late, and nothing is sent again.
#[tokio::test]
async fn a_drop_decided_after_the_confirmed_redrive_resolves_it_as_redriven() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.fail_next_write.store(true, Ordering::SeqCst);
    let _ = h.reconcile().await;
    assert_eq!((h.phase(), h.delivered()), (Phase::Parked, 1));
    h.apiserver.edit(NAME, |r| {
        r.spec.action = Some(Action::Drop);
        r.spec.by = Some("bob".into());
    });

    h.reconcile().await.expect("reconcile");
    let now = h.apiserver.current();
    assert_eq!(now.phase(), Phase::Redriven, "the job is on its target");
    assert_eq!(
        now.status.and_then(|s| s.resolved_by).as_deref(),
        Some("ops")
    );
    assert_eq!(h.delivered(), 1);
    assert!(h.apiserver.reasons().contains(&"DecisionTooLate"));
    assert!(h.ctx.claims.unwritten().is_empty());
}

/// Issue 35: etcd restarting (or the apiserver away) fails the resolution's write several
/// times after the broker confirmed the job; every retry writes only the status.
#[tokio::test]
async fn status_writes_failing_many_times_still_enqueue_exactly_once() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.failing_writes.store(5, Ordering::SeqCst);
    for attempt in 0..5 {
        let err = h.reconcile().await.expect_err("the write failed");
        assert_eq!(err.category(), "KubeApi", "attempt {attempt}");
        assert_eq!((h.phase(), h.delivered()), (Phase::Parked, 1));
    }
    h.reconcile().await.expect("the write goes through");
    assert_eq!(h.phase(), Phase::Redriven);
    assert_eq!(h.delivered(), 1, "one enqueue for six attempts");
    assert_eq!(h.metric(SUCCESS), 1.0);
    assert!(
        h.ctx.claims.unwritten().is_empty(),
        "the confirmation is forgotten once resolved"
    );
    h.reconcile().await.expect("a stale wake-up");
    assert_eq!(h.delivered(), 1);
}

/// A process that stops (shutdown, or the Lease lost while the apiserver was away) writes the
/// resolutions of jobs it enqueued before it exits, so the next leader enqueues nothing.
#[tokio::test]
async fn a_stopping_process_writes_its_confirmed_resolutions_before_exiting() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.failing_writes.store(3, Ordering::SeqCst);
    let _ = h.reconcile().await;
    assert_eq!((h.phase(), h.delivered()), (Phase::Parked, 1));

    // Two more failures while stopping, then the apiserver answers again.
    record::flush_confirmed(&h.ctx, Duration::from_secs(10)).await;
    assert_eq!(h.phase(), Phase::Redriven);
    assert!(h.ctx.claims.unwritten().is_empty());

    let next_leader = Harness::with(h.apiserver.clone(), h.target.clone(), &[queue()]);
    next_leader.reconcile().await.expect("reconcile");
    assert_eq!(next_leader.delivered(), 1, "no second enqueue");
}

/// The flush is bounded: a process whose apiserver stays away exits after the window with
/// the record still Parked (the next leader enqueues once more, as after a crash).
#[tokio::test]
async fn the_flush_gives_up_after_its_window() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.failing_writes.store(u32::MAX, Ordering::SeqCst);
    let _ = h.reconcile().await;
    let started = std::time::Instant::now();
    record::flush_confirmed(&h.ctx, Duration::from_millis(600)).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(h.phase(), Phase::Parked);
    assert_eq!(h.ctx.claims.unwritten().len(), 1);
}

/// A record resolved by a rival meanwhile is forgotten without a write of ours.
#[tokio::test]
async fn flushing_a_record_a_rival_resolved_writes_nothing() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.fail_next_write.store(true, Ordering::SeqCst);
    let _ = h.reconcile().await;
    *h.apiserver.race.lock().unwrap_or_else(|p| p.into_inner()) = Some(Phase::Dropped);
    record::flush_confirmed(&h.ctx, Duration::from_secs(5)).await;
    assert_eq!(h.phase(), Phase::Dropped, "the rival's resolution stands");
    assert!(h.ctx.claims.unwritten().is_empty());
    assert_eq!(h.delivered(), 1);
}

#[tokio::test]
async fn a_crash_between_requeue_and_status_write_delivers_at_most_once_more() {
    let h = Harness::new(&record(Some(Action::Redrive)), &[queue()]);
    h.apiserver.fail_next_write.store(true, Ordering::SeqCst);
    let _ = h.reconcile().await;
    assert_eq!((h.phase(), h.delivered()), (Phase::Parked, 1));

    // The process dies; a new one (empty memory) finds the record still Parked with its decision.
    let restarted = Harness::with(h.apiserver.clone(), h.target.clone(), &[queue()]);
    restarted.reconcile().await.expect("reconcile");
    assert_eq!(restarted.phase(), Phase::Redriven);
    assert_eq!(
        restarted.delivered(),
        2,
        "one more delivery of the same job, never a lost one"
    );
    let sent = restarted.sent();
    assert_eq!(sent[0], sent[1]);
}

#[tokio::test]
async fn an_unsigned_decision_is_refused_on_the_record() {
    let mut r = record(Some(Action::Redrive));
    r.spec.by = Some("  ".into());
    let h = Harness::new(&r, &[queue()]);
    assert_eq!(
        h.reconcile().await.expect("reconcile"),
        ReconcileAction::await_change()
    );
    assert_eq!(h.delivered(), 0);
    assert_eq!(h.apiserver.reasons(), ["DecisionRefused"]);
    let ready =
        h.apiserver.current().status.and_then(|s| {
            conditions::find(&s.conditions, conditions::READY).map(|c| c.reason.clone())
        });
    assert_eq!(ready.as_deref(), Some("Unsigned"));
}

/// Issue 14: a leader paused past its lease wakes up believing it leads; it must enqueue
/// nothing until its term is renewed (a standby may be redriving the same record meanwhile).
#[tokio::test]
async fn a_leader_whose_lease_term_ran_out_enqueues_nothing() {
    let apiserver = FakeApiserver::holding([record(Some(Action::Redrive))]);
    let target: Arc<FakeTarget> = Arc::default();
    let leadership = crate::state::leadership::Leadership::not_yet();
    let settings = Settings {
        leadership: leadership.clone(),
        ..Settings::default()
    };
    let ctx = context(&apiserver, &target, &[queue()], settings);
    let h = Harness {
        apiserver,
        target,
        ctx,
    };
    let now = jiff::Timestamp::now().as_millisecond();
    // Last renewed 20 s ago with a 15 s lease: the SIGSTOP outlasted the term.
    leadership.renewed(now - 20_000, Duration::from_secs(15));
    let action = h.reconcile().await.expect("reconcile");
    assert_eq!(h.delivered(), 0, "nothing enqueued on an expired term");
    assert_eq!(h.phase(), Phase::Parked);
    assert_eq!(action, ReconcileAction::requeue(Duration::from_secs(1)));

    leadership.renewed(now, Duration::from_secs(15));
    h.reconcile().await.expect("reconcile after renewal");
    assert_eq!(h.delivered(), 1);
    assert_eq!(h.phase(), Phase::Redriven);

    leadership.revoke();
    assert!(!leadership.holds(), "a revoked term is over at once");
}

/// Resolution Events go through the aggregator when the operator runs one: the first at once,
/// the rest of the window as one summary.
#[tokio::test]
async fn resolution_events_go_through_the_aggregator() {
    let apiserver = FakeApiserver::holding([record(Some(Action::Redrive))]);
    let target: Arc<FakeTarget> = Arc::default();
    let ctx = Arc::new(
        Context::new(
            apiserver.clone(),
            Arc::new(target.clone()),
            crate::state::records::RecordIndex::listed_with(&apiserver.all()),
            store_of(&[queue()]),
            Metrics::default(),
            Settings::default(),
        )
        .with_aggregator(crate::reconcile::aggregate::Aggregator::spawn(
            apiserver.clone(),
        )),
    );
    let dl = apiserver.current();
    let effects = dlq_core::plan::resolve(&dl, Phase::Redriven, "ops", jiff::Timestamp::now()).then;
    for _ in 0..3 {
        ctx.carry_out(&dl, &effects).await;
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let published = apiserver.events();
    assert_eq!(published.len(), 2, "{published:?}");
    assert!(
        published[1]
            .note
            .starts_with("2 records of queue relayer redriven"),
        "{published:?}"
    );
}

/// `Parked` through the aggregator, as the operator runs it: a trickle gets one Event per
/// record; a storm of 1,000 records in a second a handful of Event writes: the first
/// `STORM_ABOVE` records' own, then one series about the queue (its group object is not known
/// here) whose count makes up the rest, exactly; after the storm a trickle is one each again.
#[tokio::test(start_paused = true)]
async fn a_parking_storm_is_one_event_series_and_a_trickle_one_event_each() {
    use crate::state::apiserver::fake::EventWrite;
    use dlq_core::event_series::{CALM_FOR, STORM_ABOVE};
    let named = |i: usize| {
        RecordBuilder::job(&format!("storm/{i}"))
            .named(&format!("storm-{i}"))
            .uid(&format!("uid-{i}"))
            .reason(&format!("timeout after {i} ms"))
            .build()
    };
    let apiserver = FakeApiserver::holding((0..1_020).map(named));
    let target: Arc<FakeTarget> = Arc::default();
    let ctx = Arc::new(
        Context::new(
            apiserver.clone(),
            Arc::new(target),
            crate::state::records::RecordIndex::listed_with(&apiserver.all()),
            store_of(&[queue()]),
            Metrics::default(),
            Settings::default(),
        )
        .with_aggregator(crate::reconcile::aggregate::Aggregator::spawn(
            apiserver.clone(),
        )),
    );
    let mark = |i: usize| {
        let ctx = ctx.clone();
        let dl = apiserver
            .get(&format!("storm-{i}"))
            .unwrap_or_else(|| panic!("record storm-{i}"));
        async move { record::reconcile(Arc::new(dl), ctx).await.expect("mark") }
    };
    let own_parked = || {
        apiserver
            .published()
            .iter()
            .filter(|(about, e)| e.reason == "Parked" && about.as_deref() != Some("relayer"))
            .count()
    };
    let settle = CALM_FOR.unsigned_abs() + Duration::from_secs(3);

    // A trickle: two a second for five seconds, each announced on its record at once.
    for i in 0..10 {
        let _ = mark(i).await;
        assert_eq!(own_parked(), i + 1, "announced at once");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(settle).await;
    assert_eq!(apiserver.event_writes().len(), 10);
    assert!(apiserver.series().is_empty());

    // A storm: 1,000 records marked within a second.
    futures::future::join_all((10..1_010).map(mark)).await;
    tokio::time::sleep(settle).await;
    let writes = apiserver.event_writes();
    let storm_writes = &writes[10..];
    assert!(storm_writes.len() <= STORM_ABOVE + 3, "{storm_writes:?}");
    let series = apiserver.series();
    assert_eq!(series.len(), 1, "{series:?}");
    let Some((name, event)) = series.into_iter().next() else {
        panic!("no series")
    };
    assert_eq!(event.regarding.as_deref(), Some("relayer"));
    assert_eq!(event.plan.reason, "Parked");
    assert_eq!(event.plan.type_, dlq_core::events::EventType::Warning);
    assert!(
        event.plan.note.starts_with(&format!(
            "{} records of queue relayer, failure group ",
            event.count
        )),
        "{}",
        event.plan.note
    );
    assert_eq!(own_parked(), 10 + STORM_ABOVE);
    assert_eq!(
        STORM_ABOVE + event.count as usize,
        1_000,
        "each record counted once: its own Event or the series"
    );
    let created: Vec<&EventWrite> = storm_writes
        .iter()
        .filter(|w| !matches!(w, EventWrite::Published(_)))
        .collect();
    assert_eq!(
        created.first(),
        Some(&&EventWrite::Created(name, event.count)),
        "created once with the whole count: {created:?}"
    );
    let parked =
        r#"dlq_parked_total{namespace="payments",queue="relayer",failure_kind="transient"}"#;
    assert_eq!(
        metric(&ctx, parked),
        1_010.0,
        "the metric counts every record"
    );

    // The storm is over: a trickle after it is one Event each again.
    let before = apiserver.event_writes().len();
    for i in 1_010..1_020 {
        let _ = mark(i).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(settle).await;
    assert_eq!(own_parked(), 20 + STORM_ABOVE);
    assert_eq!(apiserver.event_writes().len(), before + 10);
    assert_eq!(apiserver.series().len(), 1);
}

/// The records controller's wakes: unmarked and decided records, not the ones that wait for a
/// human or are resolved, and not a status write.
#[tokio::test]
async fn only_records_with_something_to_do_are_queued() {
    use futures::StreamExt;
    let named = |name: &str, action: Option<Action>, phase: Option<Phase>| {
        let mut r = record(action);
        r.metadata.name = Some(name.into());
        r.metadata.uid = Some(format!("uid-{name}"));
        r.status = phase.map(|p| DeadLetterStatus {
            phase: Some(p),
            ..Default::default()
        });
        r
    };
    let mut unmarked = named("unmarked", None, None);
    unmarked.metadata.managed_fields = Some(vec![crate::state::apiserver::fake::creator()]);
    let mut decided = named("waiting", Some(Action::Drop), Some(Phase::Parked));
    decided.metadata.generation = Some(2);
    let events = vec![
        unmarked,
        named("waiting", None, Some(Phase::Parked)),
        named("resolved", Some(Action::Redrive), Some(Phase::Redriven)),
        // The operator's mark of the unmarked record (its managed fields cleared): same
        // generation.
        named("unmarked", None, None),
        // A human decides the waiting one: a new generation.
        decided,
    ];
    let (_store, writer) = reflector::store();
    let (wakes, woken) = futures::channel::mpsc::unbounded();
    let (queue_wakes, _queues) = futures::channel::mpsc::unbounded();
    let index = crate::state::records::RecordIndex::default();
    let mut feeder = crate::run::feeder::Feeder::new(writer, index.clone(), wakes, queue_wakes);
    for event in [watcher::Event::Init, watcher::Event::InitDone]
        .into_iter()
        .chain(events.into_iter().map(watcher::Event::Apply))
    {
        index.observe(&event);
        feeder.observe(event);
    }
    drop(feeder);
    let woken: Vec<String> = woken.map(|r| r.name).collect().await;
    assert_eq!(woken, ["unmarked", "waiting"]);
}

/// A broker that counts the requeues it is in at once, each taking a while.
#[derive(Default)]
struct SlowTarget {
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl Target for SlowTarget {
    fn describe(&self) -> String {
        "slow".into()
    }

    fn requeue<'a>(&'a self, _job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        async move {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        async move { Ok(()) }.boxed()
    }
}

/// How many of two decided records with stored bodies of `size` bytes were being sent at once
/// when reconciled together.
async fn redriven_at_once(size: usize) -> usize {
    let (bodies, spec) = crate::body::InMemory::new();
    let store = bodies.store.clone();
    let mut records = Vec::new();
    for i in 0..2u8 {
        let kept = store
            .put(bytes::Bytes::from(vec![i; size]), None)
            .await
            .expect("kept");
        let mut r = RecordBuilder::job(&format!("big-{i}"))
            .named(&format!("big-{i}"))
            .uid(&format!("uid-{i}"))
            .decided(Action::Redrive, "ops")
            .build();
        r.spec.job.payload = None;
        r.spec.job.body = Some(Box::new(kept.body.clone()));
        records.push(r);
    }
    let mut q = queue();
    q.spec.bodies = Some(spec);
    let apiserver = FakeApiserver::holding(records.clone());
    let target = Arc::new(SlowTarget::default());
    let ctx = Arc::new(
        Context::new(
            apiserver.clone(),
            Arc::new(target.clone()),
            crate::state::records::RecordIndex::listed_with(&apiserver.all()),
            store_of(&[q]),
            Metrics::default(),
            Settings::default(),
        )
        .with_bodies(bodies),
    );
    let reconciles = records
        .iter()
        .map(|r| record::reconcile(Arc::new(r.clone()), ctx.clone()));
    for done in futures::future::join_all(reconciles).await {
        done.expect("reconcile");
    }
    assert!(
        apiserver.all().iter().all(|r| r.phase() == Phase::Redriven),
        "both redriven"
    );
    target.most.load(Ordering::SeqCst)
}

/// A redrive holds its stored body whole while it sends it, so large bodies take turns by size
/// (`REDRIVE_BYTES`): two of more than half of it are sent one after the other, small ones side
/// by side. Without the turns, 32 reconciles of 100 MiB bodies would hold gigabytes.
#[tokio::test]
async fn large_stored_bodies_are_redriven_in_turns_small_ones_side_by_side() {
    let large = (crate::reconcile::context::REDRIVE_BYTES / 2) as usize + 1;
    assert_eq!(redriven_at_once(large).await, 1, "large: one at a time");
    assert_eq!(redriven_at_once(1 << 20).await, 2, "small: side by side");
}
