//! The Sidekiq source and target against a real Sidekiq (Debian's ruby-sidekiq 6.4) running
//! `tests/fixtures/sidekiq/worker.rb` on a redis-server of the test's own: a job that fails until
//! a flag is set dies into the `dead` set (`retry: 0`), the operator parks its exact JSON, a human
//! sets the flag and redrives, and the same Sidekiq process performs it once, byte-identical.
//! Also: many jobs at once (drain rate against Sidekiq's fill rate), a job JSON Sidekiq itself
//! cannot read, a Redis restart in the middle, the operator killed between take and park, the
//! `queues`/`classes` filters, a redrive while Redis is down, and a standing redrive reaching
//! its group behind other groups' jobs waiting for room. What every source must do
//! (the kill between park and acknowledgement among it) is `tests/backends.rs`' table.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, FailureKind, Phase};
use dlq_testenv::brokers::{Redis, Sidekiq};
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, events_for, eventually, setup,
    wait_phase,
};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

const DEAD: &str = "dead";
const FLAG: &str = "test:flag";
const RECEIVED: &str = "test:received";
const PERFORMED: &str = "test:performed";

/// A namespace with queue `relayer` (a sidekiq target, and the sidekiq source when asked) on
/// a redis-server of its own.
struct Rig {
    client: kube::Client,
    ns: String,
    api: Api<DeadLetter>,
    redis: Redis,
}

/// `kubectl dlq <args>` in `ns`: its stdout; panics when it fails.
fn dlq(ns: &str, args: &[&str]) -> String {
    let plane = dlq_testenv::plane();
    let out = std::process::Command::new(dlq_testenv::bin("kubectl-dlq"))
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig)
        .args(["-n", ns])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running kubectl-dlq");
    assert!(
        out.status.success(),
        "kubectl dlq {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn rig(scenario: &str, redis: Redis, with_source: bool) -> Rig {
    let (client, ns) = setup(&format!("sidekiq-{scenario}")).await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    let mut spec =
        json!({"target": {"sidekiq": {"urlSecretRef": {"name": "redis", "key": "url"}}}});
    if with_source {
        spec["source"] = source();
    }
    create_dlq(&client, &ns, "relayer", spec).await;
    Rig {
        api: Api::namespaced(client.clone(), &ns),
        client,
        ns,
        redis,
    }
}

/// The source, its URL from the target's.
fn source() -> serde_json::Value {
    json!({"sidekiq": {}})
}

impl Rig {
    async fn records(&self) -> Vec<DeadLetter> {
        let mut items = self
            .api
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        items.sort_by(|a, b| a.spec.job.id.cmp(&b.spec.job.id));
        items
    }

    async fn cmd<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> T {
        let mut c = self.redis.conn().await;
        cmd.query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("redis: {e}"))
    }

    async fn dead(&self) -> Vec<Vec<u8>> {
        self.cmd(redis::cmd("ZRANGE").arg(DEAD).arg(0).arg(-1))
            .await
    }

    async fn zcard(&self) -> usize {
        self.cmd(redis::cmd("ZCARD").arg(DEAD)).await
    }

    /// Jobs taken but not acknowledged (this queue's inflight hash).
    async fn inflight(&self) -> usize {
        let key = format!("dlq:{}/relayer:inflight", self.ns);
        self.redis.hash_len(&key).await
    }

    /// Waits until `n` records exist and the dead set and inflight hash are empty.
    async fn all_parked(&self, n: usize, secs: u64) -> Vec<DeadLetter> {
        eventually(secs, &format!("{n} records, dead set drained"), || async {
            (self.records().await.len() >= n
                && self.zcard().await == 0
                && self.inflight().await == 0)
                .then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.records().await
    }

    /// Adds the source to a queue created without one (the operator starts it at once).
    async fn add_source(&self) {
        let patch = json!({"spec": {"source": source()}});
        Api::<DeadLetterQueue>::namespaced(self.client.clone(), &self.ns)
            .patch("relayer", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("adding the source");
    }
}

/// Enqueues `n` jobs with Sidekiq's client and waits until Sidekiq moved them all into the
/// dead set; their jids and the seconds it took.
async fn jobs_die(r: &Rig, n: usize, prefix: &str) -> (Vec<String>, f64) {
    let started = Instant::now();
    let jids = Sidekiq::enqueue(&r.redis.url(), n, prefix);
    assert_eq!(jids.len(), n);
    eventually(120, &format!("{n} jobs in the dead set"), || async {
        (r.zcard().await >= n).then_some(())
    })
    .await;
    (jids, started.elapsed().as_secs_f64())
}

#[tokio::test]
async fn a_dead_job_is_parked_and_performed_once_by_the_same_sidekiq_after_a_redrive() {
    let r = rig("once", Redis::start(), true).await;
    let sidekiq = Sidekiq::start(&r.redis.url(), 2).await;
    // The dead job as Sidekiq wrote it, before any operator runs.
    let (jids, _) = jobs_die(&r, 1, "pi_0003").await;
    let dead = r.dead().await;
    assert_eq!(dead.len(), 1);
    let dead = dead[0].clone();
    let job: serde_json::Value = serde_json::from_slice(&dead).expect("the dead job is JSON");

    let _op = Operator::start(&r.ns);
    let items = r.all_parked(1, 60).await;
    assert_eq!(items.len(), 1, "one record");
    let rec = &items[0];
    assert_eq!(rec.spec.job.id, jids[0], "job id = jid");
    assert_eq!(
        rec.spec.job.payload_bytes().expect("payload"),
        dead,
        "the record holds the dead job's exact JSON"
    );
    assert_eq!(rec.spec.deliveries, 1, "retry_count 0 + 1");
    assert_eq!(
        rec.spec.reason,
        "GatewayError: gateway said no to pi_0003-0"
    );
    assert_eq!(rec.spec.failure_kind, FailureKind::Transient);
    assert_eq!(rec.spec.error_class.as_deref(), Some("GatewayError"));
    let failed_at = job["failed_at"].as_f64().expect("failed_at");
    // A record's time is whole seconds.
    let parked_at = rec.spec.failed_at.0.as_second();
    assert_eq!(parked_at, failed_at.floor() as i64, "failedAt = failed_at");
    let origin = rec.spec.job.origin.as_ref().expect("origin");
    assert_eq!(origin.queue.as_deref(), Some("default"));
    assert_eq!(origin.class.as_deref(), Some("SettleJob"));
    let name = rec.name_any();
    wait_phase(&r.api, &name, Phase::Parked, 20).await;

    let show = dlq(&r.ns, &["show", &jids[0]]);
    assert!(
        show.contains("GatewayError: gateway said no to pi_0003-0"),
        "{show}"
    );
    assert!(show.contains(r#""jid":""#), "the job JSON is shown: {show}");
    assert!(
        show.contains("Origin:         class=SettleJob, queue=default"),
        "{show}"
    );
    assert!(
        show.contains("Backtrace:\n") && show.contains("worker.rb:"),
        "Sidekiq's compressed backtrace, decoded: {show}"
    );
    dlq_testenv::report(&format!("kubectl dlq show {}:\n{show}", jids[0]));

    // A human sets the flag, and redrives with the plugin.
    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;
    let redrive = dlq(&r.ns, &["redrive", &jids[0], "--by", "ops"]);
    dlq_testenv::report(&format!(
        "kubectl dlq redrive {} --by ops:\n{redrive}",
        jids[0]
    ));
    wait_phase(&r.api, &name, Phase::Redriven, 60).await;
    let performed: Vec<String> = eventually(30, "the job performed", || async {
        let p: Vec<String> = r
            .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
            .await;
        (!p.is_empty()).then_some(p)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let performed_later: Vec<String> = r
        .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
        .await;
    assert_eq!(performed_later, performed, "performed once");
    assert_eq!(
        performed,
        vec![format!("{} {}", jids[0], sidekiq.pid)],
        "by the same process"
    );
    let received: Vec<Vec<u8>> = r
        .cmd(redis::cmd("LRANGE").arg(RECEIVED).arg(0).arg(-1))
        .await;
    assert_eq!(
        received.len(),
        2,
        "fetched twice: the first run and the redrive"
    );
    assert_eq!(
        received[1], dead,
        "Sidekiq fetched the dead job's JSON byte for byte"
    );
    assert_eq!(r.zcard().await, 0, "it did not die again");
    let queues: Vec<String> = r.cmd(redis::cmd("SMEMBERS").arg("queues")).await;
    assert_eq!(queues, vec!["default".to_string()]);
}

/// Every dead job of a burst becomes one record and, redriven at once, is performed exactly once.
/// It reports (never asserts: a timed assertion on a shared machine is noise) Sidekiq's speed of
/// filling the dead set against the source's of draining it; the source is the slower today
/// (docs/backends.md). `DLQ_SIDEKIQ_JOBS` sets how many (default 300).
#[tokio::test]
async fn many_dead_jobs_each_become_one_record_and_each_runs_once_after_one_redrive() {
    let n: usize = std::env::var("DLQ_SIDEKIQ_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let r = rig("many", Redis::start(), false).await;
    let sidekiq = Sidekiq::start(&r.redis.url(), 10).await;
    let _op = Operator::start(&r.ns);
    let (jids, fill_secs) = jobs_die(&r, n, "pi").await;

    let started = Instant::now();
    r.add_source().await;
    let items = r.all_parked(n, 180).await;
    let drain_secs = started.elapsed().as_secs_f64() - 1.0;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    let want: BTreeSet<&str> = jids.iter().map(String::as_str).collect();
    assert_eq!(items.len(), n, "one record per dead job");
    assert_eq!(ids, want);

    let names: Vec<String> = items.iter().map(ResourceExt::name_any).collect();
    eventually(60, "every record Parked", || async {
        let items = r.records().await;
        items
            .iter()
            .all(|i| i.phase() == Phase::Parked)
            .then_some(())
    })
    .await;
    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;
    let redriven = Instant::now();
    futures::future::join_all(
        names
            .iter()
            .map(|name| decide(&r.api, name, Action::Redrive, "ops")),
    )
    .await;
    let performed: Vec<String> = eventually(180, "every job performed", || async {
        let p: Vec<String> = r
            .cmd(redis::cmd("LRAnGE").arg(PERFORMED).arg(0).arg(-1))
            .await;
        (p.len() >= n).then_some(p)
    })
    .await;
    let redrive_secs = redriven.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let performed_jids: BTreeSet<String> = performed
        .iter()
        .map(|p| p.split(' ').next().unwrap_or_default().to_string())
        .collect();
    assert_eq!(performed.len(), n, "each performed once");
    assert_eq!(performed_jids.len(), n);
    assert!(
        performed
            .iter()
            .all(|p| p.ends_with(&format!(" {}", sidekiq.pid)))
    );
    let fill = n as f64 / fill_secs;
    let drain = n as f64 / drain_secs;
    dlq_testenv::report(&format!(
        "sidekiq {n} jobs: Sidekiq (10 threads) filled the dead set at {fill:.0} jobs/s ({fill_secs:.1} s); the source drained it into records at {drain:.0} jobs/s ({drain_secs:.1} s); redriven and performed in {redrive_secs:.1} s"
    ));
}

/// A job JSON Sidekiq cannot read goes to its dead set as it is; so does a member that is not
/// even UTF-8. Both become Invalid records of their exact bytes; a good job behind them parks.
#[tokio::test]
async fn a_job_json_that_is_not_valid_is_parked_invalid_with_its_exact_bytes() {
    let r = rig("invalid", Redis::start(), true).await;
    let _sidekiq = Sidekiq::start(&r.redis.url(), 2).await;
    let broken = br#"{"class":"SettleJob","args":["pi_9"],"jid":"#.to_vec();
    let _: () = r
        .cmd(redis::cmd("LPUSH").arg("queue:default").arg(&broken[..]))
        .await;
    eventually(
        30,
        "Sidekiq moves the broken job to its dead set",
        || async { (r.zcard().await == 1).then_some(()) },
    )
    .await;
    // Scored now: Sidekiq trims members older than 6 months whenever a job dies.
    let binary = b"\xff\xfe not UTF-8 \x00".to_vec();
    let now = jiff::Timestamp::now().as_second();
    let _: () = r
        .cmd(redis::cmd("ZADD").arg(DEAD).arg(now).arg(&binary[..]))
        .await;
    let (jids, _) = jobs_die(&r, 1, "pi_good").await;

    let _op = Operator::start(&r.ns);
    let items = r.all_parked(3, 60).await;
    assert_eq!(items.len(), 3);
    for raw in [&broken, &binary] {
        let rec = items
            .iter()
            .find(|i| i.spec.job.payload_bytes().ok().as_ref() == Some(raw))
            .unwrap_or_else(|| panic!("a record of exactly {raw:?}"));
        assert_eq!(rec.spec.failure_kind, FailureKind::Invalid);
        assert!(
            rec.spec.reason.starts_with("not a Sidekiq job"),
            "{}",
            rec.spec.reason
        );
    }
    assert!(
        items.iter().any(|i| i.spec.job.id == jids[0]),
        "the good job parks too"
    );
}

/// Redis stops while the source drains a full dead set and comes back (its AOF keeps what it
/// acknowledged): every dead job ends as exactly one record, none left behind.
#[tokio::test]
async fn a_redis_restart_in_the_middle_loses_and_doubles_nothing() {
    const N: usize = 200;
    let mut r = rig("restart", Redis::start_durable(), true).await;
    let sidekiq = Sidekiq::start(&r.redis.url(), 10).await;
    let (jids, _) = jobs_die(&r, N, "pi").await;
    drop(sidekiq);

    let _op = Operator::start(&r.ns);
    eventually(60, "the first records", || async {
        (!r.records().await.is_empty()).then_some(())
    })
    .await;
    let before = r.records().await.len();
    r.redis.stop();
    tokio::time::sleep(Duration::from_secs(3)).await;
    r.redis.restart();
    let items = r.all_parked(N, 180).await;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    let want: BTreeSet<&str> = jids.iter().map(String::as_str).collect();
    assert_eq!(items.len(), N, "none doubled");
    assert_eq!(ids, want, "none lost");
    assert!(items.iter().all(|i| i.spec.cycle == 1));
    dlq_testenv::report(&format!(
        "sidekiq restart: {before} of {N} records before Redis stopped for 3 s; after, {N} records, dead set and inflight hash empty"
    ));
}

/// Killed after taking dead jobs and before parking them: they wait in the inflight hash (not
/// in the dead set, not lost), and the next operator parks each once.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn the_operator_killed_between_take_and_park_parks_each_job_once() {
    const N: usize = 10;
    let r = rig("take", Redis::start(), true).await;
    let sidekiq = Sidekiq::start(&r.redis.url(), 5).await;
    let (jids, _) = jobs_die(&r, N, "pi").await;
    drop(sidekiq);
    let mut op = Operator::start_with(&r.ns, &[], &[("DLQ_FAILPOINT", "sidekiq-after-take")]);
    op.reached_failpoint("sidekiq-after-take", 90).await;
    op.kill();
    assert!(
        r.records().await.is_empty(),
        "nothing parked before the kill"
    );
    assert_eq!(r.zcard().await + r.inflight().await, N, "every job kept");
    assert!(r.inflight().await > 0, "taken before the kill");

    let _op = Operator::start(&r.ns);
    let items = r.all_parked(N, 90).await;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    assert_eq!(items.len(), N);
    assert_eq!(ids, jids.iter().map(String::as_str).collect());
}

/// A dead job as Sidekiq writes it, of `queue` and `class` (and ActiveJob's `wrapped` class).
fn dead_job(jid: &str, queue: &str, class: &str, wrapped: Option<&str>) -> String {
    let mut job = json!({
        "retry": 0, "queue": queue, "class": class, "args": [jid], "jid": jid,
        "error_message": "no", "error_class": "RuntimeError", "failed_at": 1.5, "retry_count": 0
    });
    if let Some(w) = wrapped {
        job["wrapped"] = json!(w);
    }
    job.to_string()
}

/// `queues` and `classes` take only their jobs (ActiveJob's by the wrapped class), and read past
/// more non-matching jobs than one take scans; a member that is not JSON is taken by every
/// filter; the rest stay in the dead set for Sidekiq's UI or another queue.
#[tokio::test]
async fn filters_take_only_their_queues_and_classes() {
    const OTHERS: usize = 1500;
    let r = rig("filters", Redis::start(), false).await;
    let now = jiff::Timestamp::now().as_millisecond() as f64 / 1000.0;
    let mut members: Vec<String> = (0..OTHERS)
        .map(|i| dead_job(&format!("other-{i}"), "default", "SettleJob", None))
        .collect();
    let wanted = [
        dead_job("settle-1", "payments", "SettleJob", None),
        dead_job(
            "settle-2",
            "payments",
            "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
            Some("SettleJob"),
        ),
    ];
    let refund = dead_job("refund-1", "payments", "RefundJob", None);
    members.extend(wanted.iter().cloned());
    members.push(refund.clone());
    members.push("not json at all".into());
    let mut pipe = redis::pipe();
    for (i, m) in members.iter().enumerate() {
        pipe.cmd("ZADD")
            .arg(DEAD)
            .arg(now + i as f64 / 1000.0)
            .arg(m);
    }
    let mut c = r.redis.conn().await;
    let _: () = pipe.query_async(&mut c).await.expect("ZADD");
    let patch = json!({"spec": {"source": {"sidekiq": {"queues": ["payments"], "classes": ["SettleJob"]}}}});
    Api::<DeadLetterQueue>::namespaced(r.client.clone(), &r.ns)
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("the filtered source");

    let _op = Operator::start(&r.ns);
    eventually(90, "3 records", || async {
        (r.records().await.len() >= 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let items = r.records().await;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    assert_eq!(items.len(), 3, "{ids:?}");
    assert!(
        ids.contains("settle-1") && ids.contains("settle-2"),
        "{ids:?}"
    );
    assert!(
        items
            .iter()
            .any(|i| i.spec.failure_kind == FailureKind::Invalid),
        "the member that is not JSON is taken: {ids:?}"
    );
    let left = r.dead().await;
    assert_eq!(left.len(), OTHERS + 1, "the others stay in the dead set");
    assert!(left.contains(&refund.into_bytes()));
    assert_eq!(r.inflight().await, 0);
}

/// Redis down when a human redrives: the record stays Parked with `Requeued=False`
/// (BrokerUnreachable) and a `RequeueFailed` Event; once Redis is back the job is enqueued once,
/// and a Sidekiq started then performs it with the record's exact JSON.
#[tokio::test]
async fn a_redrive_while_redis_is_down_waits_and_then_runs_once() {
    let mut r = rig("down", Redis::start(), false).await;
    let jid = "0123456789abcdef01234567";
    let payload = dead_job(jid, "default", "SettleJob", None);
    r.api
        .create(
            &kube::api::PostParams::default(),
            &dlq_testenv::record("down-1", jid, payload.as_bytes(), &[]),
        )
        .await
        .expect("a parked Sidekiq job");
    let _op = Operator::start(&r.ns);
    wait_phase(&r.api, "down-1", Phase::Parked, 20).await;

    r.redis.stop();
    decide(&r.api, "down-1", Action::Redrive, "ops").await;
    let rec = eventually(60, "Requeued=False", || async {
        let rec = r.api.get("down-1").await.ok()?;
        matches!(condition(&rec, "Requeued"), Some((s, _, _)) if s == "False").then_some(rec)
    })
    .await;
    assert_eq!(
        rec.phase(),
        Phase::Parked,
        "stays Parked while Redis is down"
    );
    let reason = condition(&rec, "Requeued").map(|c| c.1);
    assert_eq!(reason.as_deref(), Some("BrokerUnreachable"));
    eventually(30, "a RequeueFailed Event", || async {
        (!events_for(&r.client, &r.ns, "down-1", "RequeueFailed")
            .await
            .is_empty())
        .then_some(())
    })
    .await;

    r.redis.restart();
    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;
    wait_phase(&r.api, "down-1", Phase::Redriven, 90).await;
    let sidekiq = Sidekiq::start(&r.redis.url(), 2).await;
    let performed: Vec<String> = eventually(30, "the job performed", || async {
        let p: Vec<String> = r
            .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
            .await;
        (!p.is_empty()).then_some(p)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(performed, vec![format!("{jid} {}", sidekiq.pid)], "once");
    let received: Vec<Vec<u8>> = r
        .cmd(redis::cmd("LRANGE").arg(RECEIVED).arg(0).arg(-1))
        .await;
    assert_eq!(
        received,
        vec![payload.into_bytes()],
        "the record's exact JSON"
    );
}

/// The target against a real Redis: the same redrive enqueued twice (an answer lost, a new
/// leader) pushes one job; the next redrive of the job (another key) pushes again.
#[tokio::test]
async fn one_redrive_enqueued_twice_pushes_one_job() {
    use deadletter::targets::sidekiq::SidekiqTarget;
    use deadletter::targets::{JobMessage, Target};
    let redis = Redis::start();
    let target = SidekiqTarget::new(&redis.url(), Some("myapp")).expect("target");
    let payload = dead_job("j1", "payments", "SettleJob", None).into_bytes();
    let job = |key: &str| JobMessage {
        id: "j1".into(),
        payload: payload.clone().into(),
        null_payload: false,
        headers: Default::default(),
        origin: None,
        idempotency_key: Some(key.into()),
        key_header: Some("Idempotency-Key".into()),
    };
    target.requeue(&job("uid-1")).await.expect("first enqueue");
    target
        .requeue(&job("uid-1"))
        .await
        .expect("the same redrive again");
    assert_eq!(
        redis.list("myapp:queue:payments").await,
        vec![payload.clone()]
    );
    target
        .requeue(&job("uid-2"))
        .await
        .expect("the next cycle's redrive");
    assert_eq!(redis.list("myapp:queue:payments").await.len(), 2);
    let mut c = redis.conn().await;
    let queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg("myapp:queues")
        .query_async(&mut c)
        .await
        .expect("SMEMBERS");
    assert_eq!(queues, vec!["payments".to_string()]);
    let ttl: i64 = redis::cmd("TTL")
        .arg("myapp:queue:payments:dlq-redriven:uid-1")
        .query_async(&mut c)
        .await
        .expect("TTL");
    assert!(ttl > 0 && ttl <= 24 * 3600, "the marker expires: {ttl}");
}

/// Two dead jobs with one jid and different args (a job enqueued twice, a client that sets
/// jids): two deaths. Each is parked with its own exact bytes, the second as the next cycle
/// beside the first (which is still Parked), and neither is acknowledged without its record.
#[tokio::test]
async fn two_dead_jobs_with_one_jid_and_different_args_are_two_records() {
    let r = rig("same-jid", Redis::start(), true).await;
    let now = jiff::Timestamp::now().as_second();
    let one = json!({"retry": 0, "queue": "default", "class": "SettleJob", "args": ["pi_1"],
        "jid": "dup-jid", "error_class": "RuntimeError", "error_message": "no", "failed_at": 1.5});
    let two = json!({"retry": 0, "queue": "default", "class": "SettleJob", "args": ["pi_2"],
        "jid": "dup-jid", "error_class": "RuntimeError", "error_message": "no", "failed_at": 1.5});
    let (one, two) = (one.to_string(), two.to_string());
    let _: () = r
        .cmd(
            redis::cmd("ZADD")
                .arg(DEAD)
                .arg(now)
                .arg(&one)
                .arg(now)
                .arg(&two),
        )
        .await;
    let _op = Operator::start(&r.ns);
    let items = r.all_parked(2, 60).await;
    assert_eq!(items.len(), 2, "one record per dead job");
    let mut kept: Vec<Vec<u8>> = items
        .iter()
        .map(|i| i.spec.job.payload_bytes().expect("bytes"))
        .collect();
    kept.sort();
    let mut sent = vec![one.into_bytes(), two.into_bytes()];
    sent.sort();
    assert_eq!(kept, sent, "each job's exact bytes");
    let mut cycles: Vec<i32> = items.iter().map(|i| i.spec.cycle).collect();
    cycles.sort();
    assert_eq!(cycles, [1, 2]);
    assert!(items.iter().all(|i| i.spec.job.id == "dup-jid"));
    assert!(items.iter().all(|i| i.phase() == Phase::Parked));
}

/// The jid of a dead job's JSON (what a record's `spec.job.id` holds).
fn jid_of(raw: &[u8]) -> String {
    let job: serde_json::Value = serde_json::from_slice(raw).expect("a dead job's JSON");
    job["jid"].as_str().expect("a jid").to_string()
}

/// The largest dead-set size and overflow-list length seen every 10 ms until stopped.
struct Peaks {
    dead: std::sync::Arc<std::sync::atomic::AtomicU64>,
    overflow: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Peaks {
    fn watch(url: &str, overflow: String) -> Peaks {
        use std::sync::atomic::{AtomicU64, Ordering};
        let dead = std::sync::Arc::new(AtomicU64::new(0));
        let listed = std::sync::Arc::new(AtomicU64::new(0));
        let client = redis::Client::open(url).expect("a redis URL");
        let (d, l) = (dead.clone(), listed.clone());
        let task = tokio::spawn(async move {
            let mut c = client
                .get_multiplexed_async_connection()
                .await
                .expect("redis");
            loop {
                let (size, len): (u64, u64) = redis::pipe()
                    .cmd("ZCARD")
                    .arg(DEAD)
                    .cmd("LLEN")
                    .arg(&overflow)
                    .query_async(&mut c)
                    .await
                    .expect("ZCARD, LLEN");
                d.fetch_max(size, Ordering::Relaxed);
                l.fetch_max(len, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Peaks {
            dead,
            overflow: listed,
            task,
        }
    }

    fn stop(self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        self.task.abort();
        (
            self.dead.load(Ordering::Relaxed),
            self.overflow.load(Ordering::Relaxed),
        )
    }
}

/// Sidekiq trims its dead set at `dead_max_jobs` and the queue is Full (`maxParked` records),
/// when `DLQ_SIDEKIQ_STORM_JOBS` jobs (default 3,000) die at once with a trim of
/// `DLQ_SIDEKIQ_DEAD_MAX` (default 1,000; `deadMaxJobs` says the same): the source moves them to
/// its overflow list before Sidekiq can trim them, so every jid is exactly once in a record, the
/// overflow list, the dead set or the inflight hash (read in one MULTI). Once `maxParked` is
/// raised every job is parked, and after one `kubectl dlq redrive --queue` each is performed
/// exactly once. Without the overflow list Sidekiq drops all but the newest 999. The full
/// measurement: `DLQ_SIDEKIQ_STORM_JOBS=30000 DLQ_SIDEKIQ_DEAD_MAX=10000
/// DLQ_SIDEKIQ_STORM_STANDING=1` (the queue stays Full and one standing redrive of the storm's
/// group passes the rest through, see [`standing_redrive_of_the_storm`]). The redrive's
/// `--rate` (`DLQ_SIDEKIQ_STORM_RATE`, default 100/s) stays near what one debug operator
/// carries out (about 50 redrives/s): a leader with decided records unattempted for 180 s
/// steps down and exits (`run::decided`), and this test runs no second replica.
#[tokio::test]
async fn a_storm_past_sidekiqs_trim_while_the_queue_is_full_loses_no_job_and_each_runs_once() {
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n = env("DLQ_SIDEKIQ_STORM_JOBS", 3_000);
    let trim = env("DLQ_SIDEKIQ_DEAD_MAX", 1_000);
    let rate = format!("{}/s", env("DLQ_SIDEKIQ_STORM_RATE", 100));
    const MAX_PARKED: usize = 20;
    let redis = Redis::start();
    let (client, ns) = setup("sidekiq-storm").await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "target": {"sidekiq": {"urlSecretRef": {"name": "redis", "key": "url"}}},
            "source": {"sidekiq": {"deadMaxJobs": trim}},
            "maxParked": MAX_PARKED,
        }),
    )
    .await;
    let r = Rig {
        api: Api::namespaced(client.clone(), &ns),
        client,
        ns,
        redis,
    };
    let overflow = deadletter::source::sidekiq::overflow_list(&r.ns, "relayer");
    let inflight = format!("dlq:{}/relayer:inflight", r.ns);
    let sidekiq = Sidekiq::start_trimming_at(&r.redis.url(), 10, trim).await;
    let _op = Operator::start(&r.ns);

    // The queue fills first: the source runs, and parks no more. For the standing redrive the
    // records that fill it are the storm's first deaths (one failure group, as in an incident).
    let standing = std::env::var("DLQ_SIDEKIQ_STORM_STANDING").is_ok_and(|v| v == "1");
    let fill = if standing { "storm" } else { "full" };
    let mut jids = Sidekiq::enqueue(&r.redis.url(), MAX_PARKED, fill);
    eventually(120, "the queue Full", || async {
        (r.records().await.len() >= MAX_PARKED).then_some(())
    })
    .await;

    let peaks = Peaks::watch(&r.redis.url(), overflow.clone());
    let started = Instant::now();
    jids.extend(Sidekiq::enqueue(&r.redis.url(), n, "storm"));
    let total = jids.len();
    eventually(600, &format!("Sidekiq ran all {total} jobs"), || async {
        let received: usize = r.cmd(redis::cmd("LLEN").arg(RECEIVED)).await;
        (received >= total).then_some(())
    })
    .await;
    let died_secs = started.elapsed().as_secs_f64();
    // The last jobs' deaths land after they were fetched; the mover's next look after that.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak_dead, peak_overflow) = peaks.stop();

    let mut c = r.redis.conn().await;
    type Members = Vec<Vec<u8>>;
    let (dead, listed, taken): (Members, Members, Members) = redis::pipe()
        .atomic()
        .cmd("ZRANGE")
        .arg(DEAD)
        .arg(0)
        .arg(-1)
        .cmd("LRANGE")
        .arg(&overflow)
        .arg(0)
        .arg(-1)
        .cmd("HVALS")
        .arg(&inflight)
        .query_async(&mut c)
        .await
        .expect("one read of the dead set, overflow list and inflight hash");
    let records = r.records().await;
    let mut seen: std::collections::BTreeMap<String, Vec<&str>> = Default::default();
    for (raws, place) in [(&dead, "dead"), (&listed, "overflow"), (&taken, "inflight")] {
        for raw in raws {
            seen.entry(jid_of(raw)).or_default().push(place);
        }
    }
    for rec in &records {
        seen.entry(rec.spec.job.id.clone())
            .or_default()
            .push("record");
    }
    let lost: Vec<&String> = jids.iter().filter(|j| !seen.contains_key(*j)).collect();
    let doubled: Vec<_> = seen.iter().filter(|(_, p)| p.len() > 1).collect();
    assert!(
        lost.is_empty(),
        "{} of {total} jobs lost (Sidekiq trimmed them), e.g. {:?}; the dead set peaked at {peak_dead}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    assert!(doubled.is_empty(), "jobs held twice: {doubled:?}");
    assert_eq!(seen.len(), total, "nothing but these jobs");
    assert_eq!(records.len(), MAX_PARKED, "the queue stayed Full");
    assert!(
        listed.len() > n.saturating_sub(trim) / 2,
        "most of the storm waits in the overflow list: {} of {n}",
        listed.len()
    );
    assert!(
        (peak_dead as usize) < trim,
        "the dead set never reached the trim: {peak_dead}"
    );
    let moved = events_for(&r.client, &r.ns, "relayer", "DeadSetOverflow").await;
    assert!(!moved.is_empty(), "a DeadSetOverflow Event on the queue");
    let note = moved[0].note.clone().unwrap_or_default();
    assert!(note.contains(&overflow), "{note}");
    let near_trim = events_for(&r.client, &r.ns, "relayer", "DeadSetNearTrim")
        .await
        .len();
    dlq_testenv::report(&format!(
        "sidekiq storm: {n} jobs died in {died_secs:.1} s into a dead set trimmed at {trim} while the queue was Full ({MAX_PARKED}); the dead set peaked at {peak_dead}, the overflow list at {peak_overflow}; none lost ({near_trim} DeadSetNearTrim)"
    ));

    if standing {
        return standing_redrive_of_the_storm(&r, &jids, sidekiq.pid).await;
    }
    // Room for all of them: each is parked once, oldest first from the overflow list.
    let parking = Instant::now();
    let patch = json!({"spec": {"maxParked": total + 100}});
    Api::<DeadLetterQueue>::namespaced(r.client.clone(), &r.ns)
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("raising maxParked");
    eventually(
        3600,
        &format!("{total} records, nothing left in Redis"),
        || async {
            let left: usize = r.cmd(redis::cmd("LLEN").arg(&overflow)).await;
            (r.zcard().await == 0
                && left == 0
                && r.inflight().await == 0
                && r.records().await.len() >= total)
                .then_some(())
        },
    )
    .await;
    let parked_secs = parking.elapsed().as_secs_f64();
    let items = r.records().await;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    assert_eq!(items.len(), total, "one record per job");
    assert_eq!(ids, jids.iter().map(String::as_str).collect());
    eventually(300, "every record Parked", || async {
        r.records()
            .await
            .iter()
            .all(|i| i.phase() == Phase::Parked)
            .then_some(())
    })
    .await;

    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;
    let redriving = Instant::now();
    let out = dlq(
        &r.ns,
        &[
            "redrive",
            "--queue",
            "relayer",
            "--by",
            "ops",
            "--rate",
            &rate,
            "--settle-timeout",
            "600",
        ],
    );
    let redrive_secs = each_performed_once(&r, &jids, sidekiq.pid, &out, redriving).await;
    dlq_testenv::report(&format!(
        "sidekiq storm: {total} parked in {parked_secs:.1} s once maxParked was raised; one redrive at {rate} performed each once in {redrive_secs:.1} s"
    ));
}

/// The storm's second half as issue 47 measures it (`DLQ_SIDEKIQ_STORM_STANDING=1`): the queue
/// stays Full, and ONE standing `kubectl dlq redrive --group G` passes the dead set and the
/// overflow list through to Sidekiq while it redrives the records; each job is performed once.
async fn standing_redrive_of_the_storm(r: &Rig, jids: &[String], pid: u32) {
    use dlq_core::group::labelled;
    let total = jids.len();
    let records = r.records().await;
    let group = labelled(&records[0]).expect("a group label").to_string();
    assert!(
        records.iter().all(|i| labelled(i) == Some(group.as_str())),
        "one failure group"
    );
    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;
    let redriving = Instant::now();
    let out = dlq(
        &r.ns,
        &[
            "redrive",
            "--group",
            &group,
            "--standing",
            "--by",
            "ops",
            "--queue",
            "relayer",
        ],
    );
    let redrive_secs = each_performed_once(r, jids, pid, &out, redriving).await;
    let made = r.records().await.len();
    dlq_testenv::report(&format!(
        "sidekiq storm: one standing redrive of group {group} performed all {total} jobs once in {redrive_secs:.1} s ({:.0}/s); {made} records at the end",
        total as f64 / redrive_secs
    ));
}

/// Waits until Sidekiq (process `pid`) performed every one of `jids`, then checks each was
/// performed exactly once (3 s later still) and none died again; `out` is the redrive's output.
/// Returns the seconds from `since` until all were performed.
async fn each_performed_once(r: &Rig, jids: &[String], pid: u32, out: &str, since: Instant) -> f64 {
    let total = jids.len();
    let performed: Vec<String> = eventually(3600, "every job performed", || async {
        let p: Vec<String> = r
            .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
            .await;
        (p.len() >= total).then_some(p)
    })
    .await;
    let secs = since.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again: usize = r.cmd(redis::cmd("LLEN").arg(PERFORMED)).await;
    assert_eq!(again, total, "each performed once:\n{out}");
    let once: BTreeSet<&str> = performed
        .iter()
        .map(|p| p.split(' ').next().unwrap_or_default())
        .collect();
    assert_eq!(once, jids.iter().map(String::as_str).collect(), "by jid");
    assert!(performed.iter().all(|p| p.ends_with(&format!(" {pid}"))));
    assert_eq!(r.zcard().await, 0, "none died again");
    secs
}

/// The group a dead job of `prefix` falls in, read from the dead set as the source reads it.
async fn group_of(r: &Rig, prefix: &str) -> String {
    use dlq_core::facts::Facts;
    let mark = format!("\"{prefix}-");
    let raw = r
        .dead()
        .await
        .into_iter()
        .find(|raw| String::from_utf8_lossy(raw).contains(&mark))
        .unwrap_or_else(|| panic!("a dead job of {prefix}"));
    let req = dlq_core::sidekiq::request_for("relayer", &raw);
    dlq_core::park::arriving(&req, false).group().into_owned()
}

/// The dead jobs of `prefix` still in Redis: in the dead set, the overflow list or the inflight
/// hash (taken, not acknowledged).
async fn left_in_redis(r: &Rig, prefix: &str) -> usize {
    let overflow = deadletter::source::sidekiq::overflow_list(&r.ns, "relayer");
    let mut left = r.dead().await;
    let listed: Vec<Vec<u8>> = r
        .cmd(redis::cmd("LRANGE").arg(&overflow).arg(0).arg(-1))
        .await;
    let taken: Vec<Vec<u8>> = r
        .cmd(redis::cmd("HVALS").arg(format!("dlq:{}/relayer:inflight", r.ns)))
        .await;
    left.extend(listed);
    left.extend(taken);
    let mark = format!("\"{prefix}-");
    left.iter()
        .filter(|raw| String::from_utf8_lossy(raw).contains(&mark))
        .count()
}

/// Issue 57 item 2, for Sidekiq as for the Redis source (`tests/replay.rs`): the queue Full
/// (`maxParked` 5) with 32 dead jobs of another failure group waiting for room in the source's
/// hands, then 60 jobs of group G die behind them in Sidekiq's dead set. One standing redrive
/// of G reaches past the waiting jobs and passes all 60 to Sidekiq, which performs each once;
/// it completes only once none of G is left in Redis (before: Completed with `passedThrough`
/// 0 and all 60 still in the dead set); the other group's jobs stay where they were.
#[tokio::test]
async fn a_standing_redrive_reaches_its_group_behind_other_groups_waiting_for_room() {
    use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
    let redis = Redis::start();
    let (client, ns) = setup("sidekiq-reach").await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "target": {"sidekiq": {"urlSecretRef": {"name": "redis", "key": "url"}}},
            "source": source(),
            "maxParked": 5,
        }),
    )
    .await;
    let r = Rig {
        api: Api::namespaced(client.clone(), &ns),
        client,
        ns,
        redis,
    };
    let sidekiq = Sidekiq::start(&r.redis.url(), 10).await;
    jobs_die(&r, 40, "other").await;
    let _op = Operator::start(&r.ns);
    let queues: Api<DeadLetterQueue> = Api::namespaced(r.client.clone(), &r.ns);
    eventually(90, "the queue Full, 32 jobs waiting for room", || async {
        let parked = queues.get("relayer").await.ok()?.status?.parked;
        (parked == 5 && r.inflight().await >= 32).then_some(())
    })
    .await;
    let other = group_of(&r, "other").await;
    let g_jids = Sidekiq::enqueue(&r.redis.url(), 60, "g");
    eventually(60, "G's 60 jobs in the dead set", || async {
        (left_in_redis(&r, "g").await == 60).then_some(())
    })
    .await;
    let group = group_of(&r, "g").await;
    assert_ne!(group, other, "two failure groups");
    let _: () = r.cmd(redis::cmd("SET").arg(FLAG).arg("1")).await;

    let started = Instant::now();
    let replays: Api<DeadLetterReplay> = Api::namespaced(r.client.clone(), &r.ns);
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "by": "ops", "note": "INC-57", "standing": true,
        "selector": {"group": group}, "settleSeconds": 15
    }))
    .expect("a spec");
    replays
        .create(
            &kube::api::PostParams::default(),
            &DeadLetterReplay::new("reach", spec),
        )
        .await
        .expect("the replay");
    let done = eventually(180, "the standing replay to end", || async {
        let r = replays.get("reach").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let took = started.elapsed();
    let status = done.status.clone().unwrap_or_default();
    let left = left_in_redis(&r, "g").await;
    let performed: Vec<String> = r
        .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
        .await;
    let g_performed: Vec<&str> = performed
        .iter()
        .filter_map(|p| p.split(' ').next())
        .filter(|jid| g_jids.iter().any(|g| g == jid))
        .collect();
    dlq_testenv::report(&format!(
        "sidekiq standing redrive behind 32 waiting jobs of another group: {:?} after {:.1} s, passed through {}, {} of G's 60 performed, {left} left in Redis",
        done.phase(),
        took.as_secs_f64(),
        status.passed_through,
        g_performed.len()
    ));
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    assert_eq!(
        (left, status.passed_through),
        (0, 60),
        "G left in Redis when the replay said Completed, and passed through: {status:?}"
    );
    // The last passes are acknowledged before the replay ends; Sidekiq performs them soon after.
    let performed: Vec<String> = eventually(30, "G's 60 jobs performed", || async {
        let p: Vec<String> = r
            .cmd(redis::cmd("LRANGE").arg(PERFORMED).arg(0).arg(-1))
            .await;
        (p.len() >= 60).then_some(p)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let again: usize = r.cmd(redis::cmd("LLEN").arg(PERFORMED)).await;
    assert_eq!(again, 60, "each performed once, none of the other group");
    let once: BTreeSet<&str> = performed
        .iter()
        .map(|p| p.split(' ').next().unwrap_or_default())
        .collect();
    assert_eq!(
        once,
        g_jids.iter().map(String::as_str).collect(),
        "G's jids"
    );
    assert!(
        performed
            .iter()
            .all(|p| p.ends_with(&format!(" {}", sidekiq.pid)))
    );
    assert_eq!(
        left_in_redis(&r, "other").await,
        35,
        "the other group's jobs wait where they were"
    );
}
