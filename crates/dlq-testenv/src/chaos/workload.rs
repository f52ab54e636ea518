//! The workload, all at once: producers dead-lettering jobs into Redis and RabbitMQ, humans
//! deciding (kubectl dlq redrive/drop, GitOps server-side apply, the `--queue --rate` replay),
//! and consumers reading every job that comes back on a target.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlq_core::api::{DeadLetter, Phase};
use kube::api::{Api, Patch, PatchParams};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::json;
use tokio::sync::watch;

use super::history::History;
use super::shared::Rng;

/// The Redis queue's dead list and target stream (a stream, so the idempotency key travels
/// beside each job).
pub const REDIS_DEAD: &str = "relayer:dead";

pub use super::shared::REDIS_JOBS;

/// The fields of a redriven job on a Redis stream (`deadletter::targets::redis`).
const STREAM_PAYLOAD: &str = "payload";
const STREAM_KEY: &str = "header:Idempotency-Key";

/// The idempotency key header of a redrive (the queues' default).
const KEY_HEADER: &str = dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER;

/// Where the producers and consumers reach the brokers (directly, never through the proxy).
#[derive(Clone)]
pub struct Brokers {
    pub redis_url: String,
    pub amqp_url: String,
    /// The exchange whose queue dead-letters every message at once (TTL 0).
    pub shop: String,
    /// The dead-letter queue the operator's AMQP source reads.
    pub dead: String,
    /// Where redriven AMQP jobs land: their origin queue, and the queue's configured target.
    pub jobs: Vec<String>,
}

/// Pushes `n` envelopes `r-<i>` onto the Redis dead list at `per_sec`, retrying through
/// restarts. Returns the ids it pushed (each acknowledged by Redis).
pub async fn produce_redis(b: Brokers, n: usize, per_sec: f64) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    let gap = Duration::from_secs_f64(1.0 / per_sec.max(1.0));
    for i in 0..n {
        let id = format!("r-{i}");
        let env = json!({"id": id, "payload": id, "reason": "retries exhausted",
            "deliveries": 3, "failureKind": "Transient"});
        loop {
            if lpush(&b.redis_url, &env.to_string()).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        ids.push(id);
        tokio::time::sleep(gap).await;
    }
    ids
}

/// LPUSH onto the dead list; false when Redis did not acknowledge it.
async fn lpush(url: &str, element: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut c) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    let r: redis::RedisResult<i64> = redis::cmd("LPUSH")
        .arg(REDIS_DEAD)
        .arg(element)
        .query_async(&mut c)
        .await;
    r.is_ok()
}

/// Publishes `n` persistent messages `a-<i>` (confirmed) that RabbitMQ dead-letters at once
/// (per-message TTL 0).
pub async fn produce_amqp(b: Brokers, n: usize, per_sec: f64) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    let gap = Duration::from_secs_f64(1.0 / per_sec.max(1.0));
    let mut conn: Option<(Connection, lapin::Channel)> = None;
    for i in 0..n {
        let id = format!("a-{i}");
        loop {
            if conn.is_none() {
                conn = amqp_channel(&b.amqp_url, true).await;
            }
            if let Some((_, ch)) = &conn {
                let props = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_expiration("0".into())
                    .with_delivery_mode(2);
                let confirmed = within(async {
                    let confirm = ch
                        .basic_publish(
                            b.shop.as_str().into(),
                            "orders.created".into(),
                            BasicPublishOptions::default(),
                            id.as_bytes(),
                            props,
                        )
                        .await
                        .ok()?;
                    confirm.await.ok()
                })
                .await
                .flatten();
                if confirmed.is_some_and(|c| c.is_ack()) {
                    break;
                }
            }
            conn = None;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        ids.push(id);
        tokio::time::sleep(gap).await;
    }
    ids
}

/// A producer's message (published with TTL 0) as opposed to a redriven job, which the
/// operator republishes without the expiration.
fn is_original(props: &BasicProperties) -> bool {
    props
        .expiration()
        .as_ref()
        .is_some_and(|e| e.as_str() == "0")
}

/// A channel (with publisher confirms when asked), or None while the broker is down.
async fn amqp_channel(url: &str, confirms: bool) -> Option<(Connection, lapin::Channel)> {
    within(async {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .ok()?;
        let ch = conn.create_channel().await.ok()?;
        if confirms {
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .ok()?;
        }
        Some((conn, ch))
    })
    .await
    .flatten()
}

/// How long a harness AMQP call may take. lapin can wait forever for the reply of a call made
/// just before the broker died, and a stuck consumer would leave TTL-0 messages unexpired in
/// a quorum queue (which expires them only at its head, when a consumer asks).
const AMQP_CALL: Duration = Duration::from_secs(5);

async fn within<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::time::timeout(AMQP_CALL, f).await.ok()
}

/// Reads every job the operator puts back on the Redis target stream (deleting what it read),
/// until `stop`.
pub async fn consume_redis(b: Brokers, history: History, mut stop: watch::Receiver<bool>) {
    while !*stop.borrow() {
        let n = read_stream(&b.redis_url, &history).await;
        if n == 0 {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

/// One entry of the target stream: its id and its fields.
type StreamEntry = (String, Vec<(String, String)>);

/// Notes up to 500 jobs of the target stream as arrived and deletes them; how many.
async fn read_stream(url: &str, history: &History) -> usize {
    let read = async {
        let client = redis::Client::open(url).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(REDIS_JOBS)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(500)
            .query_async(&mut c)
            .await
            .ok()?;
        Some((c, entries))
    };
    let Some((mut c, entries)) = read.await else {
        return 0;
    };
    for (_, fields) in &entries {
        let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        if let Some(job) = field(STREAM_PAYLOAD) {
            history.arrived(job, field(STREAM_KEY).cloned());
        }
    }
    if !entries.is_empty() {
        let mut del = redis::cmd("XDEL");
        del.arg(REDIS_JOBS);
        for (id, _) in &entries {
            del.arg(id);
        }
        let _: Result<u64, _> = del.query_async(&mut c).await;
    }
    entries.len()
}

/// Reads every job the operator puts back on the AMQP target (acked after it is noted; a
/// redelivery to this consumer of a message it already noted is not a second enqueue).
pub async fn consume_amqp(b: Brokers, history: History, stop: watch::Receiver<bool>) {
    let mut conn: Option<(Connection, lapin::Channel)> = None;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut turn = 0usize;
    while !*stop.borrow() {
        if conn.is_none() {
            conn = amqp_channel(&b.amqp_url, false).await;
        }
        let Some((_, ch)) = &conn else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        };
        let queue = &b.jobs[turn % b.jobs.len()];
        turn += 1;
        let got = within(ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false }));
        match got.await {
            Some(Ok(Some(m))) if is_original(&m.delivery.properties) => {
                // A quorum queue applies TTL 0 only at the head of the queue, so a get can
                // catch a producer's message before it expires: reject it, which dead-letters
                // it (at least once) as a consumer giving up would. It is not a redrive.
                let reject = BasicRejectOptions { requeue: false };
                if !matches!(within(m.delivery.acker.reject(reject)).await, Some(Ok(_))) {
                    conn = None;
                }
            }
            Some(Ok(Some(m))) => {
                let job = String::from_utf8_lossy(&m.delivery.data).to_string();
                let key = fxhash(&job);
                if !(m.delivery.redelivered && seen.contains(&key)) {
                    history.arrived(&job, idempotency_key(&m.delivery.properties));
                    seen.insert(key);
                }
                let acked = within(m.delivery.acker.ack(BasicAckOptions::default())).await;
                if !matches!(acked, Some(Ok(_))) {
                    conn = None;
                }
            }
            Some(Ok(None)) => tokio::time::sleep(Duration::from_millis(200)).await,
            // An error or no answer in time: start over on a new connection.
            Some(Err(_)) | None => conn = None,
        }
    }
}

/// The idempotency key a redrive put beside the job, in its AMQP headers.
fn idempotency_key(props: &BasicProperties) -> Option<String> {
    let value = props.headers().as_ref()?.inner().get(KEY_HEADER)?;
    match value {
        lapin::types::AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Messages left in every broker queue of the run: the dead list and its in-flight hash, the
/// dead-letter queue, the targets.
pub async fn leftovers(b: &Brokers) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if let Ok(client) = redis::Client::open(b.redis_url.as_str())
        && let Ok(mut c) = client.get_multiplexed_async_connection().await
    {
        for (cmd, key) in [
            ("LLEN", REDIS_DEAD.to_string()),
            ("LLEN", format!("{REDIS_DEAD}:processing")),
            ("HLEN", format!("{REDIS_DEAD}:inflight")),
            ("LLEN", format!("{REDIS_DEAD}:rejected")),
            ("LLEN", super::storm::DEAD.to_string()),
            ("LLEN", format!("{}:processing", super::storm::DEAD)),
            ("HLEN", format!("{}:inflight", super::storm::DEAD)),
            ("LLEN", format!("{}:rejected", super::storm::DEAD)),
            ("XLEN", REDIS_JOBS.to_string()),
        ] {
            let n: Option<u64> = redis::cmd(cmd).arg(&key).query_async(&mut c).await.ok();
            out.insert(key, n.unwrap_or(u64::MAX));
        }
    }
    if let Some((_conn, ch)) = amqp_channel(&b.amqp_url, false).await {
        let passive = QueueDeclareOptions {
            passive: true,
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for q in std::iter::once(b.dead.as_str()).chain(b.jobs.iter().map(String::as_str)) {
            let declared = within(ch.queue_declare(q.into(), passive, FieldTable::default()));
            let n = match declared.await {
                Some(Ok(d)) => u64::from(d.message_count()),
                _ => u64::MAX,
            };
            out.insert(q.to_string(), n);
        }
    }
    out
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// How one record gets its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decider {
    GitopsRedrive,
    GitopsDrop,
    CliRedrive,
    CliDrop,
    /// Left to the `--queue --rate` replay.
    Runbook,
}

/// The humans: every second, decides the Parked records nobody decided yet; every 15 s, a
/// replay of each queue with `kubectl dlq redrive --queue … --rate`. Until `stop`.
pub async fn decide(ctx: DecideCtx, history: History, mut stop: watch::Receiver<bool>) {
    let decided: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut rng = Rng(ctx.seed ^ 0xdec1de);
    let mut round = 0u64;
    while !*stop.borrow() {
        round += 1;
        let open: Vec<(String, String)> = history
            .records()
            .into_iter()
            // The storm's records are its standing redrive's to decide.
            .filter(|(_, h)| h.queue != super::storm::QUEUE)
            .filter(|(_, h)| h.action.is_none() && h.phases.last() == Some(&Phase::Parked))
            .map(|(name, h)| (name, h.job))
            .collect();
        let mut plan: Vec<(Decider, String, String)> = Vec::new();
        for (name, job) in open {
            let mut d = super::shared::lock(&decided);
            if d.contains(&name) {
                continue;
            }
            d.insert(name.clone());
            let pick = match rng.below(100) {
                0..40 => Decider::GitopsRedrive,
                40..50 => Decider::GitopsDrop,
                50..70 => Decider::CliRedrive,
                70..80 => Decider::CliDrop,
                _ => Decider::Runbook,
            };
            plan.push((pick, name, job));
        }
        apply_plan(&ctx, plan, &decided).await;
        if round.is_multiple_of(15) {
            for queue in ["relayer", "orders"] {
                let _ = ctx
                    .dlq(&[
                        "redrive", "--queue", queue, "--rate", "100/s", "--by", "runbook",
                    ])
                    .await;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => {}
        }
    }
}

/// What the deciders need.
#[derive(Clone)]
pub struct DecideCtx {
    pub api: Api<DeadLetter>,
    pub ns: String,
    pub kubeconfig: PathBuf,
    pub seed: u64,
}

impl DecideCtx {
    /// Runs `kubectl-dlq -n <ns> args…`; true when it exited 0.
    async fn dlq(&self, args: &[&str]) -> bool {
        tokio::process::Command::new(crate::paths::bin("kubectl-dlq"))
            .arg("-n")
            .arg(&self.ns)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status()
            .await
            .is_ok_and(|s| s.success())
    }
}

/// Carries out one round's decisions; a failed one (apiserver down) is retried next round.
async fn apply_plan(
    ctx: &DecideCtx,
    plan: Vec<(Decider, String, String)>,
    decided: &Mutex<HashSet<String>>,
) {
    let pp = PatchParams::apply("gitops").force();
    for (pick, name, _) in plan
        .iter()
        .filter(|p| matches!(p.0, Decider::GitopsRedrive | Decider::GitopsDrop))
    {
        let action = if *pick == Decider::GitopsRedrive {
            "redrive"
        } else {
            "drop"
        };
        let body = json!({"apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetter",
            "spec": {"action": action, "by": "gitops", "note": "chaos run"}});
        if ctx
            .api
            .patch(name, &pp, &Patch::Apply(&body))
            .await
            .is_err()
        {
            super::shared::lock(decided).remove(name);
        }
    }
    for (verb, by, which) in [
        ("redrive", "alice", Decider::CliRedrive),
        ("drop", "bob", Decider::CliDrop),
    ] {
        let batch: Vec<&(Decider, String, String)> = plan.iter().filter(|p| p.0 == which).collect();
        for chunk in batch.chunks(25) {
            let mut args = vec![verb];
            args.extend(chunk.iter().map(|p| p.2.as_str()));
            args.extend(["--by", by]);
            if !ctx.dlq(&args).await {
                // Some may have gone through: the next round sees their action and skips them.
                let mut d = super::shared::lock(decided);
                for p in chunk {
                    d.remove(&p.1);
                }
            }
        }
    }
}
