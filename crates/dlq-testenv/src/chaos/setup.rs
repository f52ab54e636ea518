//! The run's world (control plane, brokers, proxy, replicas) and the run itself.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlq_core::api::{DeadLetter, Phase};
use kube::Client;
use kube::api::{Api, ListParams};
use lapin::ExchangeKind;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde_json::json;
use tokio::sync::watch;

use super::config::ChaosConfig;
use super::faults::Targets;
use super::history::History;
use super::proxy::Toxiproxy;
use super::report::{Report, count_enqueues, count_panics};
use super::shared::{Rng, Spawner, lock};
use super::storm::{self, StormSize};
use super::workload::{self, Brokers, DecideCtx};
use crate::brokers::{Rabbit, Redis, declare_exchange, declare_queue, quorum_args};
use crate::plane::ControlPlane;

/// Everything one run owns.
pub struct Env {
    targets: Targets,
    brokers: Brokers,
    history: History,
    api: Api<DeadLetter>,
    /// The storm a standing redrive drains during the faults (none when `CHAOS_STORM=0`).
    storm: Option<StormSize>,
}

async fn admin_client(plane: &Mutex<ControlPlane>) -> Client {
    let path = lock(plane).kubeconfig.clone();
    crate::cluster::admin_client(&path).await
}

/// The RabbitMQ side: a work queue `<ns>.orders` whose dead letters go to `<ns>.dlq`, all
/// quorum queues. The
/// producers' messages expire at once (per-message TTL 0); a redriven job goes back to its
/// origin (exchange and routing key from x-death) without the expiration, so it stays in
/// `<ns>.orders`, where the harness reads it. `<ns>.jobs` is the queue's configured target,
/// used when a record has no origin. Returns (shop exchange, dlq, orders, jobs).
async fn amqp_topology(rabbit: &Rabbit, ns: &str) -> (String, String, String, String) {
    let (_conn, ch) = rabbit.channel().await;
    let (shop, dlx) = (format!("{ns}.shop"), format!("{ns}.dlx"));
    let (orders, dlq, jobs) = (
        format!("{ns}.orders"),
        format!("{ns}.dlq"),
        format!("{ns}.jobs"),
    );
    declare_exchange(&ch, &shop, ExchangeKind::Direct).await;
    declare_exchange(&ch, &dlx, ExchangeKind::Fanout).await;
    // Quorum queues with at-least-once dead-lettering: RabbitMQ's default (at-most-once)
    // may drop a message it is dead-lettering when the node restarts, a loss no consumer of
    // the dead-letter queue could prevent. This is what docs/backends.md tells users to set.
    let text = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes()));
    let mut args = quorum_args();
    args.insert(ShortString::from("x-dead-letter-exchange"), text(&dlx));
    args.insert(
        ShortString::from("x-dead-letter-strategy"),
        text("at-least-once"),
    );
    args.insert(ShortString::from("x-overflow"), text("reject-publish"));
    declare_queue(&ch, &orders, args).await;
    declare_queue(&ch, &dlq, quorum_args()).await;
    declare_queue(&ch, &jobs, quorum_args()).await;
    let bind = |q: String, x: String, key: &'static str| {
        let ch = ch.clone();
        async move {
            ch.queue_bind(
                q.as_str().into(),
                x.as_str().into(),
                key.into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("binding {q} to {x}: {e}"));
        }
    };
    bind(orders.clone(), shop.clone(), "orders.created").await;
    bind(dlq.clone(), dlx, "").await;
    (shop, dlq, orders, jobs)
}

impl Env {
    /// Starts the plane, the brokers, the proxy, the queues and two replicas.
    pub async fn start(cfg: &ChaosConfig) -> Env {
        let spawner = Spawner::new();
        let plane = spawner
            .run(ControlPlane::start)
            .await
            .unwrap_or_else(|e| panic!("starting the chaos control plane: {e}"))
            .unwrap_or_else(|e| panic!("starting the chaos control plane: {e}"));
        let plane = Arc::new(Mutex::new(plane));
        let client = admin_client(&plane).await;
        crate::cluster::apply_crds(&client, crate::cluster::CRDS).await;
        let ns = crate::cluster::namespace(&client, "chaos").await;
        let (redis, rabbit) = spawner
            .run(|| (Redis::start_durable(), Rabbit::start()))
            .await
            .unwrap_or_else(|e| panic!("starting the brokers: {e}"));
        let proxy = Toxiproxy::start(redis.port, cfg.out.clone())
            .await
            .unwrap_or_else(|e| panic!("starting toxiproxy: {e}"));
        let (shop, dlq, orders, jobs) = amqp_topology(&rabbit, &ns).await;
        let rabbit = Arc::new(rabbit);
        let node = rabbit.clone();
        spawner
            .run(move || node.checkpoint())
            .await
            .unwrap_or_else(|e| panic!("checkpointing rabbitmq: {e}"));
        let proxied = format!("redis://127.0.0.1:{}/", proxy.port);
        crate::fixtures::create_secret(&client, &ns, "redis", "url", &proxied).await;
        crate::fixtures::create_secret(&client, &ns, "amqp", "url", &rabbit.url()).await;
        crate::fixtures::create_dlq(&client, &ns, "relayer", json!({
            "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": workload::REDIS_JOBS}},
            "source": {"redis": {"list": workload::REDIS_DEAD}}})).await;
        crate::fixtures::create_dlq(&client, &ns, "orders", json!({
            "target": {"amqp": {"urlSecretRef": {"name": "amqp", "key": "url"}, "exchange": "", "routingKey": jobs}},
            "source": {"amqp": {"queue": dlq.clone()}}})).await;
        let storm = (cfg.storm > 0).then(|| StormSize::of(cfg.storm));
        if let Some(size) = storm {
            // Dead before any operator runs: the queue fills at once, the rest waits.
            storm::fill(&redis.url(), size.messages).await;
            crate::fixtures::create_dlq(&client, &ns, storm::QUEUE, storm::queue_spec(size)).await;
        }
        let brokers = Brokers {
            redis_url: redis.url(),
            amqp_url: rabbit.url(),
            shop,
            dead: dlq,
            jobs: vec![orders, jobs.clone()],
        };
        let targets = Targets {
            plane,
            client: client.clone(),
            ns: ns.clone(),
            redis: Arc::new(Mutex::new(redis)),
            rabbit,
            proxy,
            operators: Arc::default(),
            logs: cfg.out.join("logs"),
            spawner,
        };
        let _ = std::fs::remove_dir_all(&targets.logs);
        targets.start_replica().await;
        targets.start_replica().await;
        Env {
            targets,
            brokers,
            history: History::default(),
            api: Api::namespaced(client, &ns),
            storm,
        }
    }
}

impl Env {
    /// The workload under the fault schedule, the settling, and the checks.
    pub async fn run(self, cfg: &ChaosConfig, started: Instant) -> Report {
        let watch_task = self.history.spawn_watch(self.api.clone());
        let (stop_tx, stop) = watch::channel(false);
        let (decide_tx, decide_stop) = watch::channel(false);
        let consumers = [
            tokio::spawn(workload::consume_redis(
                self.brokers.clone(),
                self.history.clone(),
                stop.clone(),
            )),
            tokio::spawn(workload::consume_amqp(
                self.brokers.clone(),
                self.history.clone(),
                stop.clone(),
            )),
        ];
        let ctx = DecideCtx {
            api: self.api.clone(),
            ns: self.targets.ns.clone(),
            kubeconfig: lock(&self.targets.plane).kubeconfig.clone(),
            seed: cfg.seed,
        };
        let decider = tokio::spawn(workload::decide(ctx, self.history.clone(), decide_stop));
        // Spread the messages over about 80 % of the expected fault period (≈ 7 s a fault).
        let planned = (cfg.faults as f64 * (7.0 + cfg.max_gap.as_secs_f64() / 2.0)).max(10.0);
        // The storm passes over about 60 % of it, so the faults hit the passing.
        let storm_task = self.storm.map(|size| {
            let rate = ((size.messages as f64 - size.max_parked as f64) / (0.6 * planned)).max(1.0);
            tokio::spawn(storm::standing_redrive(
                self.targets.client.clone(),
                self.targets.ns.clone(),
                size,
                rate,
                started,
                stop.clone(),
            ))
        });
        let per_sec = (cfg.messages as f64 / 2.0) / (0.8 * planned);
        let half = cfg.messages / 2;
        let redis_ids = tokio::spawn(workload::produce_redis(self.brokers.clone(), half, per_sec));
        let amqp_ids = tokio::spawn(workload::produce_amqp(
            self.brokers.clone(),
            cfg.messages - half,
            per_sec,
        ));

        let mut rng = Rng(cfg.seed);
        for (i, kind) in super::config::schedule(cfg.faults, &cfg.kinds, &mut rng)
            .into_iter()
            .enumerate()
        {
            let gap = 500 + rng.below(cfg.max_gap.as_millis() as u64);
            tokio::time::sleep(Duration::from_millis(gap)).await;
            let t = Instant::now();
            self.history.fault(kind);
            self.targets.inject(kind, &mut rng).await;
            self.targets.check_plane();
            crate::harness::report(&format!(
                "chaos: fault {}/{} {kind} ({:.1}s) at {:.0}s",
                i + 1,
                cfg.faults,
                t.elapsed().as_secs_f64(),
                started.elapsed().as_secs_f64()
            ));
        }
        let mut produced = redis_ids.await.expect("the redis producer");
        produced.extend(amqp_ids.await.expect("the amqp producer"));
        crate::harness::report(&format!(
            "chaos: faults over at {:.0}s; {} messages produced; settling (≤ {}s)",
            started.elapsed().as_secs_f64(),
            produced.len(),
            cfg.settle.as_secs()
        ));
        let _ = decide_tx.send(true);
        let _ = decider.await;
        let storm_ids = self
            .storm
            .map(|s| storm::ids(s.messages))
            .unwrap_or_default();
        let finals = self.settle(&produced, &storm_ids, cfg.settle).await;
        let _ = stop_tx.send(true);
        let mut storm_outcome = match storm_task {
            Some(t) => t.await.ok().flatten(),
            None => None,
        };
        if let Some(o) = storm_outcome.as_mut() {
            storm::conclude(&self.replays(), o).await;
        }
        for c in consumers {
            let _ = c.await;
        }
        watch_task.abort();
        let leftovers = workload::leftovers(&self.brokers).await;
        self.targets.stop_all();
        let enqueues = count_enqueues(&self.targets.logs);
        let mut report = Report::compute(&produced, &finals, &self.history, &enqueues);
        if let Some(size) = self.storm {
            report.check_storm(
                size,
                storm_outcome,
                &storm_ids,
                &finals,
                &self.history,
                &leftovers,
            );
        }
        report.seed = cfg.seed;
        report.broker_leftovers = leftovers;
        report.panics = count_panics(&self.targets.logs);
        report.duration_secs = started.elapsed().as_secs_f64();
        report
    }

    fn replays(&self) -> Api<dlq_core::replay::DeadLetterReplay> {
        Api::namespaced(self.targets.client.clone(), &self.targets.ns)
    }

    /// Waits (at most `limit`) until every message has a record, every decided record is
    /// resolved, every redriven job has arrived, and the storm's jobs have all arrived and its
    /// standing redrive ended; returns the records then.
    async fn settle(
        &self,
        produced: &[String],
        storm_ids: &[String],
        limit: Duration,
    ) -> Vec<DeadLetter> {
        // A storm still passing gets two more minutes (a paused leader's lease, a slow pace).
        let extra = if storm_ids.is_empty() { 0 } else { 120 };
        let deadline = Instant::now() + limit + Duration::from_secs(extra);
        loop {
            let items = self
                .api
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            let arrivals = self.history.arrivals();
            let jobs: std::collections::HashSet<&str> =
                items.iter().map(|d| d.spec.job.id.as_str()).collect();
            let done = produced.iter().all(|id| jobs.contains(id.as_str()))
                && items.iter().all(|d| match d.phase() {
                    Phase::Parked => d.spec.action.is_none(),
                    Phase::Redriven => arrivals.contains_key(&d.spec.job.id),
                    Phase::Dropped => true,
                })
                && storm_ids.iter().all(|id| arrivals.contains_key(id))
                && (storm_ids.is_empty() || storm::replay_final(&self.replays()).await);
            if (done && !items.is_empty()) || Instant::now() > deadline {
                // A moment more so late duplicate arrivals are counted too.
                tokio::time::sleep(Duration::from_secs(2)).await;
                return items;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
