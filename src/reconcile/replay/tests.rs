//! The replay controller driven in-process against a fake apiserver holding a queue's records:
//! pace, resuming after a restart without deciding twice, stop with withdrawal, dry run.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue};
use dlq_core::replay::{
    Canary, DeadLetterReplay, DeadLetterReplaySpec, DeadLetterReplayStatus, ReplayPhase,
    ReplaySelector,
};
use dlq_core::testing::{RecordBuilder, at};

use super::{Replays, reconcile};
use crate::metrics::Metrics;
use crate::pass::Standing;
use crate::reconcile::tests::{FakeTarget, store_of};
use crate::reconcile::{Context, Settings};
use crate::state::apiserver::fake::FakeApiserver;

const NS: &str = "payments";

fn record(name: &str, failed: i64, created: i64) -> DeadLetter {
    RecordBuilder::job(name)
        .named(name)
        .uid(&format!("uid-{name}"))
        .reason("timeout")
        .failed_at(at(failed))
        .created(at(created))
        .build()
}

fn queue() -> DeadLetterQueue {
    let mut q = DeadLetterQueue::new("relayer", Default::default());
    q.metadata.namespace = Some(NS.into());
    q
}

fn replay(rate: &str) -> DeadLetterReplay {
    let mut r = DeadLetterReplay::new(
        "inc-1234",
        DeadLetterReplaySpec {
            queue: "relayer".into(),
            selector: Some(ReplaySelector {
                reason_contains: Some("timeout".into()),
                ..ReplaySelector::default()
            }),
            action: None,
            rate: Some(rate.into()),
            max: None,
            stop_when: None,
            dry_run: None,
            by: "carol".into(),
            note: Some("INC-1234".into()),
            settle_seconds: Some(60),
            stop: None,
            paused: None,
            standing: None,
            canary: None,
            approvals: Vec::new(),
        },
    );
    r.metadata.namespace = Some(NS.into());
    r.metadata.uid = Some("replay-uid".into());
    r.metadata.generation = Some(1);
    r
}

/// A replay that started ten seconds ago (its pace allows a full burst).
fn started(mut r: DeadLetterReplay, selected: i64) -> DeadLetterReplay {
    let ago = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(10);
    r.status = Some(DeadLetterReplayStatus {
        phase: Some(ReplayPhase::Running),
        selected,
        started_at: Some(Time(ago)),
        ..Default::default()
    });
    r
}

/// A fresh operator process over the fake's current records (replays never requeue: the
/// broker is never asked).
fn process(fake: &Arc<FakeApiserver>) -> Arc<Replays> {
    let ctx = Context::new(
        fake.clone(),
        Arc::new(Arc::<FakeTarget>::default()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[queue()]),
        Metrics::default(),
        Settings::default(),
    );
    replays_of(ctx)
}

/// The replay controller over `ctx`, its standing replays passing to `ctx`'s targets (as
/// `crate::run` wires them).
fn replays_of(ctx: Context) -> Arc<Replays> {
    let standing = Standing::new(ctx.redrive.targets.clone());
    Arc::new(Replays::new(Arc::new(ctx), standing))
}

/// Five matching records parked long ago, one that does not match, one parked just now.
fn queue_records() -> Vec<DeadLetter> {
    let now = jiff::Timestamp::now().as_second();
    let mut other = record("other", 1, 1);
    other.spec.reason = "bad json".into();
    let mut records: Vec<DeadLetter> = (0..5)
        .map(|i| record(&format!("r{i}"), 10 + i, 1))
        .collect();
    records.push(other);
    records.push(record("fresh", 1, now + 5));
    records
}

#[tokio::test]
async fn the_pace_and_a_restart_decide_each_record_once_oldest_first() {
    let fake = FakeApiserver::holding(queue_records());
    let replay = Arc::new(started(replay("1/s"), 5));
    // One process whose cache never catches up: its memory keeps it from signing again.
    let first = process(&fake);
    reconcile(replay.clone(), first.clone())
        .await
        .expect("step");
    assert_eq!(fake.signed(), ["r0", "r1"], "a burst is two seconds' worth");
    reconcile(replay.clone(), first.clone())
        .await
        .expect("step");
    reconcile(replay.clone(), first).await.expect("step");
    // A new leader: memory empty, the records say what was decided; nothing is left.
    reconcile(replay.clone(), process(&fake))
        .await
        .expect("step");
    let signed = fake.signed();
    assert_eq!(
        signed,
        ["r0", "r1", "r2", "r3", "r4"],
        "each once, oldest failure first"
    );
    assert_eq!(
        fake.last_replay_status().phase,
        Some(ReplayPhase::Running),
        "waiting for outcomes"
    );
    let r0 = fake
        .all()
        .into_iter()
        .find(|r| r.metadata.name.as_deref() == Some("r0"))
        .expect("r0");
    assert_eq!(r0.spec.by.as_deref(), Some("carol"));
    assert_eq!(r0.spec.note.as_deref(), Some("replay inc-1234: INC-1234"));
    assert_eq!(r0.spec.action, Some(Action::Redrive));

    fake.carry_out_decisions();
    reconcile(replay, process(&fake)).await.expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Completed));
    assert_eq!(
        (status.selected, status.decided, status.redriven),
        (5, 5, 5)
    );
    let summary = status.summary.expect("summary");
    assert!(
        summary.contains("selected 5, decided 5, redriven 5, failing 0"),
        "{summary}"
    );
    assert!(summary.ends_with("; completed"), "{summary}");
    assert_eq!(
        fake.reasons(),
        ["Replay"],
        "the decision record, on the queue"
    );
}

#[tokio::test]
async fn stop_withdraws_what_was_not_carried_out() {
    let fake = FakeApiserver::holding(queue_records());
    let mut replay = started(replay("1.5/s"), 5);
    reconcile(Arc::new(replay.clone()), process(&fake))
        .await
        .expect("step");
    assert_eq!(fake.signed().len(), 3);
    replay.spec.stop = Some(true);
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Stopped));
    assert_eq!(
        status.stop_reason.as_deref(),
        Some("stopped on request (spec.stop)")
    );
    assert_eq!(
        (status.decided, status.withdrawn, status.skipped),
        (3, 3, 2)
    );
    assert!(
        fake.all().iter().all(|r| r.spec.action.is_none()),
        "withdrawn"
    );
    let events = fake.events();
    assert!(
        !events.is_empty() && events.iter().all(|e| e.reason == "ReplayStopped"),
        "{events:?}"
    );
}

/// `spec.paused`: the run decides nothing more and withdraws nothing; said once (phase,
/// Event) however many steps it stays paused; resumed, it goes on with the rest.
#[tokio::test]
async fn a_paused_replay_decides_nothing_withdraws_nothing_and_resumes() {
    let fake = FakeApiserver::holding(queue_records());
    let mut replay = started(replay("1.5/s"), 5);
    reconcile(Arc::new(replay.clone()), process(&fake))
        .await
        .expect("step");
    assert_eq!(fake.signed().len(), 3);
    replay.spec.paused = Some(true);
    for _ in 0..3 {
        replay.status = Some(fake.last_replay_status());
        reconcile(Arc::new(replay.clone()), process(&fake))
            .await
            .expect("step");
    }
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Paused));
    assert_eq!((status.decided, status.withdrawn), (3, 0));
    assert_eq!(fake.signed().len(), 3, "nothing more decided while paused");
    let decided = fake
        .all()
        .iter()
        .filter(|r| r.spec.action.is_some())
        .count();
    assert_eq!(decided, 3, "nothing withdrawn");

    replay.spec.paused = Some(false);
    replay.status = Some(fake.last_replay_status());
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    assert_eq!(fake.last_replay_status().phase, Some(ReplayPhase::Running));
    assert_eq!(fake.signed().len(), 5, "the rest, once resumed");
    assert_eq!(fake.reasons(), ["ReplayPaused", "ReplayResumed"]);
}

/// `spec.canary`: two of the five go first, spread across the selection (r1, r3), and
/// nothing else is decided while they are carried out; none came back, so the rest go.
#[tokio::test]
async fn a_canary_goes_first_and_a_healthy_one_lets_the_rest_go() {
    let fake = FakeApiserver::holding(queue_records());
    let mut replay = started(replay("100/s"), 5);
    replay.spec.canary = Some(Canary {
        count: 2,
        observe_seconds: Some(0),
    });
    let step = async |replay: &mut DeadLetterReplay| {
        reconcile(Arc::new(replay.clone()), process(&fake))
            .await
            .expect("step");
        replay.status = Some(fake.last_replay_status());
    };
    step(&mut replay).await;
    assert_eq!(fake.signed(), ["r1", "r3"], "the canary, spread");
    step(&mut replay).await;
    assert_eq!(
        fake.signed().len(),
        2,
        "nothing more while it is carried out"
    );
    fake.carry_out_decisions();
    step(&mut replay).await;
    assert!(fake.last_replay_status().canary.is_some_and(|c| c.passed()));
    assert_eq!(fake.reasons(), ["CanaryPassed"]);
    step(&mut replay).await;
    assert_eq!(
        fake.signed(),
        ["r1", "r3", "r0", "r2", "r4"],
        "then the rest"
    );
}

/// A canary job that came back (parked again as its next cycle) stops the replay, naming it,
/// with nothing but the canary decided.
#[tokio::test]
async fn a_canary_that_came_back_stops_the_replay_naming_it() {
    let fake = FakeApiserver::holding(queue_records());
    let mut replay = started(replay("100/s"), 5);
    replay.spec.canary = Some(Canary {
        count: 2,
        observe_seconds: Some(0),
    });
    reconcile(Arc::new(replay.clone()), process(&fake))
        .await
        .expect("step");
    replay.status = Some(fake.last_replay_status());
    fake.carry_out_decisions();
    let again = RecordBuilder::job("r3")
        .named("r3-again")
        .reason("timeout")
        .cycle(2)
        .failed_at(at(100))
        .created(at(100))
        .build();
    fake.park(again);
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Stopped));
    let why = status.stop_reason.unwrap_or_default();
    assert!(
        why.starts_with("canary failed: 1 of 2: r3 (r3) came back, parked again as cycle 2"),
        "{why}"
    );
    assert_eq!(fake.signed(), ["r1", "r3"], "nothing but the canary");
}

#[tokio::test]
async fn a_dry_run_counts_and_names_but_decides_nothing() {
    let fake = FakeApiserver::holding(queue_records());
    let mut replay = replay("5/s");
    replay.spec.dry_run = Some(true);
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::DryRun));
    assert_eq!(
        status.selected, 6,
        "the fresh record matches too: nothing is frozen yet"
    );
    assert_eq!(status.first_names, ["fresh", "r0", "r1", "r2", "r3", "r4"]);
    assert!(fake.signed().is_empty());
}

#[tokio::test]
async fn a_missing_queue_keeps_the_replay_pending() {
    let fake = FakeApiserver::holding(queue_records());
    let ctx = Context::new(
        fake.clone(),
        Arc::new(Arc::<FakeTarget>::default()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of::<DeadLetterQueue>(&[]),
        Metrics::default(),
        Settings::default(),
    );
    let replays = replays_of(ctx);
    reconcile(Arc::new(replay("5/s")), replays)
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Pending));
    assert_eq!(status.conditions[0].reason, "QueueNotFound");
}

/// Issue 47: a standing redrive of a group decides the group's records parked after it
/// started, passes the group's dead messages straight to the target (counted, sampled, keyed),
/// keeps running while the broker holds more, and completes once the queue's backlog is seen
/// empty; after that the group's messages park again.
#[tokio::test]
async fn a_standing_redrive_decides_later_records_and_passes_messages_until_the_backlog_is_empty() {
    use crate::pass::Passed;
    use dlq_core::api::{Job, QueueBacklog};
    use dlq_core::facts::Facts;
    use dlq_core::park::ParkRequest;

    // The group's record parked after the start, a second ago.
    let mut records = queue_records();
    records.pop();
    records.push(record("fresh", 1, jiff::Timestamp::now().as_second() - 1));
    let fake = FakeApiserver::holding(records);
    let group = record("r0", 10, 1).group().into_owned();
    let mut standing = replay("100/s");
    standing.spec.selector = Some(ReplaySelector {
        group: Some(group),
        ..ReplaySelector::default()
    });
    standing.spec.standing = Some(true);
    let standing = started(standing, 5);
    let mut full = queue();
    full.status = Some(dlq_core::api::DeadLetterQueueStatus {
        backlog: Some(QueueBacklog {
            messages: Some(170_000),
            observed_at: Some(Time(jiff::Timestamp::now())),
        }),
        ..Default::default()
    });
    let target = Arc::<FakeTarget>::default();
    let ctx = Context::new(
        fake.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[full.clone()]),
        Metrics::default(),
        Settings::default(),
    );
    let replays = replays_of(ctx);
    reconcile(Arc::new(standing.clone()), replays.clone())
        .await
        .expect("step");
    let ids = || {
        let got = target.received.lock().expect("lock");
        got.iter().map(|m| m.id.clone()).collect::<Vec<_>>()
    };
    let mut sent = ids();
    sent.sort();
    let group = ["fresh", "r0", "r1", "r2", "r3", "r4"];
    assert_eq!(
        sent, group,
        "sent ahead: the group's record parked after the start too, not the other group's"
    );
    assert!(fake.signed().is_empty(), "signed behind, at the next step");
    reconcile(Arc::new(standing.clone()), replays.clone())
        .await
        .expect("step");
    let mut signed = fake.signed();
    signed.sort();
    assert_eq!(signed, group);

    // A dead message of the group arrives at a source while the replay runs.
    let mut dead = ParkRequest::new(
        "relayer",
        Job {
            id: "pi_9/settle".into(),
            payload: Some("{}".into()),
            ..Job::default()
        },
    )
    .with_message("relayer:dead#9");
    dead.reason = "timeout".into();
    assert!(matches!(
        replays.standing.pass(&full, &dead, b"raw").await,
        Passed::Through { .. }
    ));
    let got = target.received.lock().expect("lock").clone();
    assert_eq!(got.len(), 7, "the records' 6 jobs, then the message");
    assert_eq!(got[6].id, "pi_9/settle");
    assert!(
        got[6]
            .idempotency_key
            .as_deref()
            .is_some_and(|k| k.starts_with("msg-"))
    );

    fake.carry_out_decisions();
    reconcile(Arc::new(standing.clone()), replays.clone())
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(
        status.phase,
        Some(ReplayPhase::Running),
        "the broker still holds 170,000"
    );
    assert_eq!(status.passed_through, 1);
    assert_eq!(status.sample, ["pi_9/settle"]);

    // The backlog is seen empty after the last message came: the replay completes.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let mut empty = full.clone();
    empty.status = Some(dlq_core::api::DeadLetterQueueStatus {
        backlog: Some(QueueBacklog {
            messages: Some(0),
            observed_at: Some(Time(jiff::Timestamp::now())),
        }),
        ..Default::default()
    });
    let ctx = Context::new(
        fake.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[empty.clone()]),
        Metrics::default(),
        Settings::default(),
    );
    let later = Arc::new(Replays::new(Arc::new(ctx), replays.standing.clone()));
    reconcile(Arc::new(standing), later.clone())
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Completed));
    assert_eq!(status.passed_through, 1);
    let summary = status.summary.expect("summary");
    assert!(summary.contains("passed through 1"), "{summary}");
    assert_eq!(
        later.standing.pass(&empty, &dead, b"raw").await,
        Passed::No,
        "uncovered: the group's messages park again"
    );
}

/// `n` records of one failure group (uids `uid-i`), the first `labelled` of them labelled with
/// their group as a parker labels them (the rest as records parked before groups).
fn group_records(n: usize, labelled: usize) -> Vec<DeadLetter> {
    use dlq_core::group::LABEL_GROUP;
    (0..n)
        .map(|i| {
            let mut r = RecordBuilder::job(&format!("pi_{i:03}/settle"))
                .named(&format!("g{i:03}"))
                .reason("timeout")
                .uid(&format!("uid-{i}"))
                .failed_at(at(10 + i as i64))
                .created(at(1))
                .build();
            if i >= labelled
                && let Some(labels) = r.metadata.labels.as_mut()
            {
                labels.remove(LABEL_GROUP);
            }
            r
        })
        .collect()
}

/// A standing redrive of `records`' group, without a rate (the broker's speed).
fn standing_of(records: &[DeadLetter]) -> DeadLetterReplay {
    use dlq_core::facts::Facts;
    let mut r = replay("1/s");
    r.spec.rate = None;
    r.spec.standing = Some(true);
    r.spec.selector = Some(ReplaySelector {
        group: Some(records[0].group().into_owned()),
        ..ReplaySelector::default()
    });
    started(r, i64::try_from(records.len()).unwrap_or(0))
}

/// The idempotency keys the target received, in order.
fn keys(target: &crate::reconcile::tests::FakeTarget) -> Vec<String> {
    let got = target.received.lock().unwrap_or_else(|p| p.into_inner());
    got.iter()
        .map(|m| m.idempotency_key.clone().unwrap_or_default())
        .collect()
}

/// Issue 58 item 4: a standing redrive of a group puts every record's job on the target in its
/// first step, before any record is signed or resolved (a page at a time for the labelled
/// records, one by one for the others), each with its record's redrive key; the next step
/// signs them behind, and their reconciles write only the resolutions: no job twice.
#[tokio::test]
async fn a_standing_redrive_sends_its_records_jobs_before_their_resolutions_and_once() {
    use dlq_core::api::Phase;
    use dlq_core::decide::redrive_key;
    let records = group_records(300, 270);
    let fake = FakeApiserver::holding(records.clone());
    let target = Arc::<FakeTarget>::default();
    let ctx = Context::new(
        fake.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[queue()]),
        Metrics::default(),
        Settings::default(),
    );
    let replays = replays_of(ctx);
    let standing = Arc::new(standing_of(&records));
    reconcile(standing.clone(), replays.clone())
        .await
        .expect("step");
    let mut sent = keys(&target);
    sent.sort();
    let mut expected: Vec<String> = records.iter().map(redrive_key).collect();
    expected.sort();
    assert_eq!(sent, expected, "every job, each with its record's key");
    assert!(fake.signed().is_empty(), "no record signed before");
    assert!(fake.writes().is_empty(), "no resolution before");
    assert_eq!(fake.listed().len(), 2, "270 labelled: two pages of 250");

    reconcile(standing.clone(), replays.clone())
        .await
        .expect("step");
    assert_eq!(fake.signed().len(), 256, "signed behind, a step's worth");
    reconcile(standing.clone(), replays.clone())
        .await
        .expect("step");
    assert_eq!(fake.signed().len(), 300, "then the rest");
    for record in fake.all() {
        assert_eq!(record.spec.by.as_deref(), Some("carol"));
        crate::reconcile::record::reconcile(Arc::new(record), replays.ctx.clone())
            .await
            .expect("record reconcile");
    }
    assert_eq!(keys(&target).len(), 300, "no job enqueued twice");
    assert!(
        fake.all().iter().all(|r| r.phase() == Phase::Redriven),
        "each resolved"
    );
    assert_eq!(fake.writes().len(), 300, "one resolution each");
}

/// A process that dies after sending jobs ahead and before signing their records: the next
/// leader selects them again (still Parked, undecided) and sends each again with the same key,
/// as a redrive does after a crash before its resolution.
#[tokio::test]
async fn after_a_crash_before_the_signatures_the_jobs_go_again_with_the_same_keys() {
    let records = group_records(5, 5);
    let fake = FakeApiserver::holding(records.clone());
    let target = Arc::<FakeTarget>::default();
    let process = || {
        replays_of(Context::new(
            fake.clone(),
            Arc::new(target.clone()),
            crate::state::records::RecordIndex::listed_with(&fake.all()),
            store_of(&[queue()]),
            Metrics::default(),
            Settings::default(),
        ))
    };
    let standing = Arc::new(standing_of(&records));
    reconcile(standing.clone(), process()).await.expect("step");
    let mut first = keys(&target);
    assert_eq!(first.len(), 5);
    reconcile(standing, process()).await.expect("step");
    first.sort();
    let mut again = keys(&target).split_off(5);
    again.sort();
    assert_eq!(
        again, first,
        "sent again by the next leader, with the same keys"
    );
    assert!(fake.signed().is_empty());
}

/// Stopped with jobs sent ahead and not signed yet: they are signed (carried out), not
/// withdrawn, and resolved by their reconciles without a second enqueue.
#[tokio::test]
async fn a_stop_signs_what_went_ahead_and_withdraws_nothing_of_it() {
    use dlq_core::api::Phase;
    let records = group_records(5, 5);
    let fake = FakeApiserver::holding(records.clone());
    let target = Arc::<FakeTarget>::default();
    let ctx = Context::new(
        fake.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[queue()]),
        Metrics::default(),
        Settings::default(),
    );
    let replays = replays_of(ctx);
    let mut standing = standing_of(&records);
    reconcile(Arc::new(standing.clone()), replays.clone())
        .await
        .expect("step");
    standing.spec.stop = Some(true);
    reconcile(Arc::new(standing), replays.clone())
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Stopped));
    assert_eq!((status.decided, status.withdrawn), (5, 0), "{status:?}");
    for record in fake.all() {
        crate::reconcile::record::reconcile(Arc::new(record), replays.ctx.clone())
            .await
            .expect("record reconcile");
    }
    assert!(fake.all().iter().all(|r| r.phase() == Phase::Redriven));
    assert_eq!(keys(&target).len(), 5, "each job once");
}

/// A run freezes what the cache shows, so it starts only once the cache shows every record of
/// its queue that etcd holds: two parked a moment before the replay, not cached yet, are still
/// the replay's, not new parkings (tests/replay.rs saw 3 of 5 selected under load).
#[tokio::test]
async fn a_start_waits_for_the_cache_to_show_what_etcd_holds() {
    let fake = FakeApiserver::holding(queue_records());
    let behind: Vec<DeadLetter> = fake
        .all()
        .into_iter()
        .filter(|r| !matches!(r.metadata.name.as_deref(), Some("r3" | "r4")))
        .collect();
    let lagging = Context::new(
        fake.clone(),
        Arc::new(Arc::<FakeTarget>::default()),
        crate::state::records::RecordIndex::listed_with(&behind),
        store_of(&[queue()]),
        Metrics::default(),
        Settings::default(),
    );
    let replay = Arc::new(replay("5/s"));
    reconcile(replay.clone(), replays_of(lagging))
        .await
        .expect("step");
    assert!(
        fake.all_replay_statuses().is_empty(),
        "nothing frozen while the cache lags"
    );
    reconcile(replay, process(&fake)).await.expect("step");
    let status = fake
        .all_replay_statuses()
        .into_iter()
        .find(|s| s.started_at.is_some())
        .expect("a start");
    assert_eq!(
        status.selected, 6,
        "every timeout etcd held, r3 and r4 among them: {status:?}"
    );
    let frozen = status.frozen.expect("frozen");
    for r in fake.all().iter().filter(|r| r.spec.reason == "timeout") {
        assert!(
            frozen.existed(r),
            "{:?} existed at the start",
            r.metadata.name
        );
    }
}

/// Issue 59 item 1: the queue `relayer` requiring `required` approvals (expiring after an hour)
/// for `for_` (empty: every replay), above `above` records.
fn approving_queue(
    required: i64,
    for_: &[dlq_core::replay::approvals::ApprovalFor],
    above: Option<i64>,
) -> DeadLetterQueue {
    let mut q = queue();
    q.spec.approvals = Some(dlq_core::replay::ApprovalPolicy {
        required: Some(required),
        for_: for_.to_vec(),
        above,
        expire_after: Some("1h".into()),
    });
    q
}

/// A process whose queue is `q` (with what the fake holds now).
fn process_with(fake: &Arc<FakeApiserver>, q: &DeadLetterQueue) -> Arc<Replays> {
    let ctx = Context::new(
        fake.clone(),
        Arc::new(Arc::<FakeTarget>::default()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(std::slice::from_ref(q)),
        Metrics::default(),
        Settings::default(),
    );
    replays_of(ctx)
}

/// An approval by `by`, `ago` seconds ago.
fn approval(by: &str, ago: i64, note: &str) -> dlq_core::replay::Approval {
    dlq_core::replay::Approval {
        by: by.into(),
        at: Time(jiff::Timestamp::now() - jiff::SignedDuration::from_secs(ago)),
        note: Some(note.into()),
    }
}

/// The replay's Ready condition message.
fn ready_message(status: &DeadLetterReplayStatus) -> String {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| format!("{} {}: {}", c.status, c.reason, c.message))
        .unwrap_or_default()
}

/// A replay its queue requires an approval for waits, deciding nothing, while it has none,
/// only its author's, or an expired one; bob's fresh approval lets it run, and every record it
/// signs names him.
#[tokio::test]
async fn a_replay_awaiting_approval_decides_nothing_until_someone_else_approves() {
    let fake = FakeApiserver::holding(queue_records());
    let q = approving_queue(1, &[], None);
    let mut replay = replay("100/s");
    let step = async |replay: &mut DeadLetterReplay| {
        reconcile(Arc::new(replay.clone()), process_with(&fake, &q))
            .await
            .expect("step");
        replay.status = Some(fake.last_replay_status());
    };
    step(&mut replay).await;
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::AwaitingApproval));
    assert!(
        ready_message(&status)
            .starts_with("False AwaitingApproval: awaiting approval: 0 of 1 approvals"),
        "{}",
        ready_message(&status)
    );
    assert_eq!(status.started_at, None, "not started: nothing frozen");

    replay.spec.approvals = vec![
        approval("carol", 10, "looks fine to me"),
        approval("bob", 7200, "yesterday's"),
    ];
    step(&mut replay).await;
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::AwaitingApproval));
    let message = ready_message(&status);
    assert!(
        message.contains("0 of 1 approvals; not counted: carol: the author's own; bob: expired"),
        "{message}"
    );
    assert!(fake.signed().is_empty(), "nothing decided while awaiting");
    assert!(fake.reasons().is_empty(), "{:?}", fake.reasons());

    replay
        .spec
        .approvals
        .push(approval("bob", 5, "INC-1234 reviewed"));
    step(&mut replay).await;
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::Running));
    assert_eq!(
        status.approval.as_ref().map(|a| a.approved_by.clone()),
        Some(vec!["bob".to_string()])
    );
    assert!(
        ready_message(&status).ends_with(", approved by bob"),
        "{}",
        ready_message(&status)
    );
    assert_eq!(
        (status.selected, fake.signed().len()),
        (6, 1),
        "every timeout selected, the first decided at once"
    );
    assert!(
        fake.all()
            .iter()
            .filter(|r| r.spec.action.is_some())
            .all(|r| r.spec.note.as_deref() == Some("replay inc-1234 (approved by bob): INC-1234"))
    );
    let approved: Vec<String> = fake
        .events()
        .into_iter()
        .filter(|e| e.reason == "Approved")
        .map(|e| e.note)
        .collect();
    assert_eq!(
        approved,
        ["bob approved replay inc-1234 by carol (1 of 1): INC-1234 reviewed"]
    );
}

/// `above`: a replay of a selection no bigger than the threshold runs without an approval; a
/// policy for drops only leaves a redrive alone.
#[tokio::test]
async fn a_replay_under_the_threshold_or_of_another_kind_runs_without_approval() {
    use dlq_core::replay::approvals::ApprovalFor;
    for q in [
        approving_queue(1, &[], Some(10)),
        approving_queue(1, &[ApprovalFor::Drop], None),
    ] {
        let fake = FakeApiserver::holding(queue_records());
        reconcile(Arc::new(replay("100/s")), process_with(&fake, &q))
            .await
            .expect("step");
        assert_eq!(fake.last_replay_status().phase, Some(ReplayPhase::Running));
        assert_eq!(fake.signed().len(), 1, "the first decision at once");
    }
}

/// A standing replay awaiting approval has no cover: its group's dead messages are not passed
/// through (they park) and none of its records' jobs are sent ahead.
#[tokio::test]
async fn a_standing_replay_awaiting_approval_passes_nothing_through() {
    use crate::pass::Passed;
    use dlq_core::api::Job;
    use dlq_core::park::ParkRequest;
    use dlq_core::replay::approvals::ApprovalFor;

    let records = group_records(5, 5);
    let fake = FakeApiserver::holding(records.clone());
    let q = approving_queue(2, &[ApprovalFor::Standing], None);
    let mut standing = standing_of(&records);
    standing.status = None;
    standing.spec.approvals = vec![approval("bob", 5, "ok")];
    let target = Arc::<FakeTarget>::default();
    let ctx = Context::new(
        fake.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(std::slice::from_ref(&q)),
        Metrics::default(),
        Settings::default(),
    );
    let replays = replays_of(ctx);
    reconcile(Arc::new(standing.clone()), replays.clone())
        .await
        .expect("step");
    let status = fake.last_replay_status();
    assert_eq!(status.phase, Some(ReplayPhase::AwaitingApproval));
    assert!(
        ready_message(&status).contains("1 of 2 approvals (bob)"),
        "{}",
        ready_message(&status)
    );
    let mut dead = ParkRequest::new(
        "relayer",
        Job {
            id: "pi_900/settle".into(),
            payload: Some("{}".into()),
            ..Job::default()
        },
    )
    .with_message("relayer:dead#900");
    dead.reason = "timeout".into();
    assert_eq!(
        replays.standing.pass(&q, &dead, b"raw").await,
        Passed::No,
        "nothing passes through before the approvals"
    );
    assert!(target.received.lock().expect("lock").is_empty());
    assert!(fake.signed().is_empty());
    assert_eq!(fake.reasons(), ["Approved"]);
}

/// A replay that has waited longer than the overdue time says so once, as a Warning on the
/// replay and its queue.
#[tokio::test]
async fn a_replay_waiting_too_long_for_approval_warns_once() {
    let fake = FakeApiserver::holding(queue_records());
    let q = approving_queue(1, &[], None);
    let mut replay = replay("100/s");
    let long_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(2 * 3600);
    replay.status = Some(DeadLetterReplayStatus {
        phase: Some(ReplayPhase::AwaitingApproval),
        approval: Some(dlq_core::replay::ApprovalStatus {
            waiting_since: Some(Time(long_ago)),
            ..Default::default()
        }),
        ..Default::default()
    });
    let replays = process_with(&fake, &q);
    for _ in 0..2 {
        reconcile(Arc::new(replay.clone()), replays.clone())
            .await
            .expect("step");
    }
    let overdue: Vec<_> = fake
        .events()
        .into_iter()
        .filter(|e| e.reason == "ApprovalOverdue")
        .collect();
    assert_eq!(overdue.len(), 2, "once, on the replay and on its queue");
    assert!(
        overdue[0].note.contains("has awaited approval for 120 min"),
        "{}",
        overdue[0].note
    );
    assert!(fake.signed().is_empty());
}
