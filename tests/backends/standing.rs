//! Issue 47 item 4, for every source backend: a standing redrive of one failure group drains
//! what the source holds beyond a small `maxParked`, and a SIGKILL while passed-through messages
//! wait between their requeue and their acknowledgement loses nothing (repeats only of what was
//! in flight, with the same idempotency key).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
use dlq_testenv::backends::Sent;

use super::*;

/// Dead messages of the storm: more than `maxParked` plus what a source holds at once (32 at
/// most), so most of them can only go through without a record.
const STORM: usize = 40;
/// The queue's `maxParked`: Full after a handful, the rest waiting in the broker.
const MAX_PARKED: usize = 3;
/// How long the first operator holds each message at its source's failpoint, between the
/// requeue (or park) and the acknowledgement: the kill lands inside it.
const HOLD: Duration = Duration::from_millis(2000);

/// What a backend's target does with a job delivered again with the same idempotency key.
trait Repeats {
    const ON_REPEAT: Repeat;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Repeat {
    /// Delivered again, the key beside it (the consumer deduplicates).
    SameKey,
    /// Pushed once: a marker named after the key (the Redis list and Sidekiq targets).
    Once,
    /// Delivered again without the key (an SQS standard queue; a FIFO one deduplicates).
    Unseen,
}

impl Repeats for RedisBackend {
    const ON_REPEAT: Repeat = Repeat::Once;
}
impl Repeats for SidekiqBackend {
    const ON_REPEAT: Repeat = Repeat::Once;
}
impl Repeats for SqsBackend {
    const ON_REPEAT: Repeat = Repeat::Unseen;
}
impl Repeats for RabbitBackend {
    const ON_REPEAT: Repeat = Repeat::SameKey;
}
impl Repeats for NatsBackend {
    const ON_REPEAT: Repeat = Repeat::SameKey;
}
impl Repeats for KafkaBackend {
    const ON_REPEAT: Repeat = Repeat::SameKey;
}
impl Repeats for PubsubBackend {
    const ON_REPEAT: Repeat = Repeat::SameKey;
}

/// A storm of one failure group fills a queue of `maxParked` 3 while the broker still holds
/// most of it (its backlog says so, where the broker can say); one standing redrive of the
/// group drains it. The operator holds every message at its source's failpoint (between the
/// requeue and the acknowledgement) and is killed while the first passed-through ones wait
/// there; a fresh operator finishes. Every job arrives; a job arrives again only if it was on
/// the target at the kill, and then with the same idempotency key (where the target carries
/// it; a target that deduplicates by key has each exactly once); the replay completes having
/// passed messages through; the broker holds nothing; fewer records than dead messages.
async fn a_standing_redrive_drains_the_backlog_and_a_kill_during_pass_through_loses_nothing<
    B: Source + Repeats,
>() {
    let began = Instant::now();
    let hold = format!("{}@{}", B::FAILPOINT, HOLD.as_millis());
    let mut r = rig::<B>(
        "standing",
        Broker::Shared,
        true,
        &[("DLQ_FAILPOINT", &hold)],
    )
    .await;
    let queues: Api<DeadLetterQueue> = Api::namespaced(r.client.clone(), &r.ns);
    set_max_parked(&queues, MAX_PARKED).await;
    r.backend.wait_listening().await;
    let sent = r.backend.put_dead(STORM).await;

    // Full, and (where the broker can say) the rest of the storm waiting in the broker.
    let waiting = eventually(60, "the queue Full and its backlog said", || async {
        let s = queues.get("relayer").await.ok()?.status?;
        let full = dlq_core::conditions::find(&s.conditions, dlq_core::conditions::FULL)
            .is_some_and(|c| c.status == "True");
        let messages = s.backlog?.messages;
        match (full, B::BACKLOG_KNOWN, messages) {
            (true, true, Some(n)) if n > 0 => Some(Some(n)),
            (true, false, None) => Some(None),
            _ => None,
        }
    })
    .await;
    let full_at = began.elapsed();
    let parked = records(&r.api).await;
    let group = dlq_core::group::labelled(&parked[0])
        .unwrap_or_else(|| panic!("{} has no group label", parked[0].name_any()))
        .to_string();
    assert!(
        parked
            .iter()
            .all(|p| dlq_core::group::labelled(p) == Some(group.as_str())),
        "the storm is one failure group"
    );

    let replays: Api<DeadLetterReplay> = Api::namespaced(r.client.clone(), &r.ns);
    // A long settle: the replay ends when the broker is seen empty (the operator's restart and
    // the broker's redelivery of what the kill left in flight must not end it early); Pub/Sub
    // cannot say its backlog, so there it ends after this long without a message of the group.
    let settle = if B::BACKLOG_KNOWN { 60 } else { 15 };
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "by": "ops", "note": "INC-47 payer fixed", "standing": true,
        "selector": {"group": group}, "rate": "100/s", "settleSeconds": settle
    }))
    .unwrap_or_else(|e| panic!("a replay spec: {e}"));
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("storm", spec),
        )
        .await
        .unwrap_or_else(|e| panic!("creating the standing replay: {e}"));

    // A pass-through is counted just before its message reaches the failpoint, where it waits
    // HOLD before its acknowledgement: a kill within HOLD of the last poll that saw none lands
    // while it waits there.
    let labels = [("namespace", r.ns.as_str()), ("queue", "relayer")];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut none_yet = Instant::now();
    loop {
        let asked = Instant::now();
        if r.op.metric("dlq_passed_through_total", &labels) > 0.0 {
            break;
        }
        none_yet = asked;
        assert!(
            Instant::now() < deadline,
            "nothing passed through within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let killing = Instant::now();
    r.op.kill();
    let reached = format!("failpoint {} reached", B::FAILPOINT);
    assert!(
        r.op.logs().contains(&reached),
        "the operator never held a message at {} (built without feature failpoints?)",
        B::FAILPOINT
    );
    assert!(
        killing - none_yet < HOLD,
        "the kill came {:?} after the last poll without a pass-through, past the hold of {HOLD:?}",
        killing - none_yet
    );
    let killed_at = began.elapsed();
    // What reached the target (NATS publishes redrives into the stream that still holds the
    // dead messages: there only what carries a key).
    let at_kill: BTreeSet<Delivered> = r
        .backend
        .keyed()
        .await
        .into_iter()
        .filter(|(_, key)| key.is_some() || !B::CARRIES_KEY)
        .map(|(job, _)| job)
        .collect();

    let _op = r.operator_without_failpoint();
    let done = eventually(150, "the standing replay to end", || async {
        let replay = replays.get("storm").await.ok()?;
        replay.phase().is_final().then_some(replay)
    })
    .await;
    let done_at = began.elapsed();
    let phase = done.phase();
    let status = done.status.unwrap_or_default();
    assert_eq!(phase, ReplayPhase::Completed, "{status:?}");
    assert!(
        status.passed_through > 0,
        "nothing passed through: {status:?}"
    );
    let summary = status.summary.clone().unwrap_or_default();
    assert!(summary.contains("passed through"), "{summary}");
    eventually(30, "every dead message acknowledged", || async {
        (r.backend.pending_dead().await == 0).then_some(())
    })
    .await;

    let made = records(&r.api).await;
    assert!(
        made.len() < STORM,
        "{} records for {STORM} dead messages: pass-through makes none",
        made.len()
    );
    for rec in &made {
        assert_eq!(
            rec.phase(),
            Phase::Redriven,
            "{} ({}) is not redriven",
            rec.name_any(),
            rec.spec.job.id
        );
    }
    let recorded: BTreeSet<&str> = made.iter().map(|m| m.spec.job.id.as_str()).collect();

    let want: BTreeSet<Delivered> = sent.iter().map(Sent::delivered).collect();
    let keyed = eventually(30, "every job on the target", || async {
        let keyed = r.backend.keyed().await;
        let jobs: BTreeSet<Delivered> = keyed.iter().map(|(d, _)| d.clone()).collect();
        want.is_subset(&jobs).then_some(keyed)
    })
    .await;
    let mut arrivals: BTreeMap<Delivered, Vec<Option<String>>> = BTreeMap::new();
    for (job, key) in keyed {
        arrivals.entry(job).or_default().push(key);
    }
    assert_eq!(
        arrivals.len(),
        STORM,
        "only the storm's jobs arrive, each untouched"
    );
    let mut repeats = 0;
    for s in &sent {
        let keys = &arrivals[&s.delivered()];
        if B::CARRIES_KEY && !recorded.contains(s.job_id.as_str()) {
            assert!(
                keys.iter().all(Option::is_some),
                "job {} has no record, so it passed through, yet arrived without its key: {keys:?}",
                s.job_id
            );
        }
        if keys.len() == 1 {
            continue;
        }
        repeats += keys.len() - 1;
        assert!(
            at_kill.contains(&s.delivered()),
            "job {} arrived {} times, yet was not on the target at the kill",
            s.job_id,
            keys.len()
        );
        match B::ON_REPEAT {
            Repeat::Once => panic!(
                "job {} pushed {} times: a target that deduplicates by key got two keys",
                s.job_id,
                keys.len()
            ),
            Repeat::SameKey => assert!(
                keys[0].is_some() && keys.iter().all(|k| *k == keys[0]),
                "job {} arrived again with another key: {keys:?}",
                s.job_id
            ),
            Repeat::Unseen => {}
        }
    }
    dlq_testenv::report(&format!(
        "standing {}: {STORM} dead messages, maxParked {MAX_PARKED}, {} waiting in the broker when Full; killed with {} jobs on the target; {} passed through, {} records (all redriven), {repeats} repeats; Full at {:.1} s, killed at {:.1} s, completed at {:.1} s, checked at {:.1} s",
        B::NAME,
        waiting.map_or("unknown".to_string(), |n| n.to_string()),
        at_kill.len(),
        status.passed_through,
        made.len(),
        full_at.as_secs_f64(),
        killed_at.as_secs_f64(),
        done_at.as_secs_f64(),
        began.elapsed().as_secs_f64()
    ));
}

run_for!(a_standing_redrive_drains_the_backlog_and_a_kill_during_pass_through_loses_nothing:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);
