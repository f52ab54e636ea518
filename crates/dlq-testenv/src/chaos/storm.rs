//! The storm of a chaos run (issue 47): a dead list holding many times its queue's `maxParked`
//! of one failure group, and one standing redrive created while the queue is Full, which passes
//! the rest straight from the broker to the target while the run's faults hit. What it checks
//! at the end: every job on the target (first arrival), nothing left in the dead list, its
//! processing list or its inflight hash, no storm record left undecided, and the replay
//! Completed with `passedThrough + redriven` equal to the storm.

use std::time::{Duration, Instant};

use dlq_core::api::{DeadLetter, DeadLetterQueue, Phase};
use dlq_core::group::labelled;
use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde::Serialize;
use serde_json::json;
use tokio::sync::watch;

/// The storm's queue, dead list and replay. Its jobs go back to the relayer's target stream
/// ([`super::shared::REDIS_JOBS`]), where the harness's consumer notes them.
pub const QUEUE: &str = "storm";
pub const DEAD: &str = "storm:dead";
pub const REPLAY: &str = "storm-standing";

/// The storm's size, and the queue's bound it is many times of.
#[derive(Clone, Copy, Debug)]
pub struct StormSize {
    pub messages: usize,
    pub max_parked: i64,
}

impl StormSize {
    /// `maxParked` a tenth of the storm (10 to 100): the queue is Full long before the storm
    /// is parked, and the rest can only pass through.
    pub fn of(messages: usize) -> StormSize {
        StormSize {
            messages,
            max_parked: (messages as i64 / 10).clamp(10, 100),
        }
    }
}

/// The storm's job ids, `s-<i>`.
pub fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("s-{i:05}")).collect()
}

/// The queue's spec: the proxied Redis (so broker cuts hit the source and the target), the
/// storm's dead list, the relayer's target stream.
pub fn queue_spec(size: StormSize) -> serde_json::Value {
    json!({
        "maxParked": size.max_parked,
        "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"},
            "stream": super::shared::REDIS_JOBS}},
        "source": {"redis": {"list": DEAD}},
    })
}

/// RPUSHes the storm onto its dead list before any operator runs (one failure group: the
/// reasons differ only in their numbers).
pub async fn fill(redis_url: &str, n: usize) {
    let client = redis::Client::open(redis_url).unwrap_or_else(|e| panic!("redis url: {e}"));
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("connecting to redis for the storm: {e}"));
    for chunk in ids(n).chunks(1000) {
        let mut pipe = redis::pipe();
        for (i, id) in chunk.iter().enumerate() {
            let envelope = json!({"id": id, "payload": id, "failureKind": "Transient",
                "reason": format!("payer timeout after {}ms", 30_000 + i), "deliveries": 3});
            pipe.cmd("RPUSH").arg(DEAD).arg(envelope.to_string());
        }
        let pushed: redis::RedisResult<()> = pipe.query_async(&mut c).await;
        pushed.unwrap_or_else(|e| panic!("RPUSH the storm: {e}"));
    }
}

/// What the storm's standing redrive did, as its status said at the end.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StormOutcome {
    pub messages: u64,
    pub max_parked: i64,
    /// The group the standing redrive covered.
    pub group: String,
    /// Dead messages the queue's backlog said waited in the broker when the redrive was made.
    pub waiting_at_start: Option<i64>,
    /// Seconds from the start of the run until the redrive was created.
    pub created_at_secs: f64,
    pub phase: String,
    pub stop_reason: Option<String>,
    pub passed_through: i64,
    pub redriven: i64,
}

/// Waits until the storm's queue is Full (its backlog beyond the records known), then creates
/// the standing redrive of its group, paced at `rate` per second so the passing spans the
/// faults. Retries through apiserver and etcd restarts until `stop`; a create that already
/// happened (the answer lost) is found by name.
pub async fn standing_redrive(
    client: Client,
    ns: String,
    size: StormSize,
    rate: f64,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> Option<StormOutcome> {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let replays: Api<DeadLetterReplay> = Api::namespaced(client, &ns);
    let mut outcome = StormOutcome {
        messages: size.messages as u64,
        max_parked: size.max_parked,
        ..StormOutcome::default()
    };
    loop {
        if *stop.borrow() {
            return None;
        }
        if let Some((group, waiting)) = full(&queues, &records, size).await {
            outcome.group = group;
            outcome.waiting_at_start = waiting;
            break;
        }
        pause(&mut stop).await;
    }
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": QUEUE, "by": "oncall", "note": "chaos storm: payer fixed",
        "standing": true, "selector": {"group": outcome.group},
        "rate": format!("{rate:.2}/s"),
        // The run cuts the target's link on purpose: the failure-ratio stop is proven
        // elsewhere; here every message must come back through every fault.
        "stopWhen": {"failureRatio": 1.0},
    }))
    .unwrap_or_else(|e| panic!("the storm's replay spec: {e}"));
    let replay = DeadLetterReplay::new(REPLAY, spec);
    loop {
        match replays.create(&PostParams::default(), &replay).await {
            Ok(_) => break,
            Err(kube::Error::Api(e)) if e.code == 409 => break,
            Err(_) if !*stop.borrow() => pause(&mut stop).await,
            Err(_) => return None,
        }
    }
    outcome.created_at_secs = started.elapsed().as_secs_f64();
    crate::harness::report(&format!(
        "chaos: storm: standing redrive of group {} created at {:.0}s ({} waiting in the broker, {} parked)",
        outcome.group,
        outcome.created_at_secs,
        outcome
            .waiting_at_start
            .map_or("unknown".to_string(), |n| n.to_string()),
        size.max_parked
    ));
    Some(outcome)
}

/// The storm's group and the queue's backlog once the queue holds `maxParked` records.
async fn full(
    queues: &Api<DeadLetterQueue>,
    records: &Api<DeadLetter>,
    size: StormSize,
) -> Option<(String, Option<i64>)> {
    let status = queues.get(QUEUE).await.ok()?.status?;
    if status.parked < size.max_parked {
        return None;
    }
    let lp = ListParams::default().labels(&format!("{}={QUEUE}", dlq_core::api::LABEL_QUEUE));
    let list = records.list(&lp).await.ok()?.items;
    let group = list.iter().find_map(labelled)?.to_string();
    Some((group, status.backlog.and_then(|b| b.messages)))
}

async fn pause(stop: &mut watch::Receiver<bool>) {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        _ = stop.changed() => {}
    }
}

/// The replay now: its phase, when final.
pub async fn replay_final(replays: &Api<DeadLetterReplay>) -> bool {
    replays
        .get(REPLAY)
        .await
        .is_ok_and(|r| r.phase().is_final())
}

/// Fills in the replay's end from its status.
pub async fn conclude(replays: &Api<DeadLetterReplay>, outcome: &mut StormOutcome) {
    let Ok(r) = replays.get(REPLAY).await else {
        outcome.phase = "unreadable".into();
        return;
    };
    outcome.phase = r.phase().as_str().to_string();
    let status = r.status.unwrap_or_default();
    outcome.stop_reason = status.stop_reason;
    outcome.passed_through = status.passed_through;
    outcome.redriven = status.redriven;
}

/// Whether the replay ended as a storm's redrive must: Completed (its counts are checked job
/// by job on the target instead; see `Report::storm_count_gap`).
pub fn completed(o: &StormOutcome) -> bool {
    o.phase == ReplayPhase::Completed.as_str()
}

/// Storm records not Redriven at the end (the standing redrive decides every one it parks).
pub fn left_parked(finals: &[DeadLetter]) -> Vec<&str> {
    finals
        .iter()
        .filter(|d| d.spec.queue == QUEUE && d.phase() != Phase::Redriven)
        .map(|d| d.spec.job.id.as_str())
        .collect()
}
