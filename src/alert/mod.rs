//! Alerts: the leader keeps, in each configured Alertmanager, one alert per failure group with
//! Parked records that no acknowledgement silences (or, where a queue asks for it, one per
//! Parked record), and one per record whose requeue keeps failing; each resolved when what it
//! is about is.
//!
//! A task per scope reads the record store (woken by a store subscription, and rescanning on
//! a timer to notice deletions and queue setting changes), turns it into the current alerts
//! (`dlq_core::alert::current`) and hands them to one [`ledger::Ledger`] per Alertmanager.
//! Each round posts what is due in batches. It never blocks a reconcile: the subscription is
//! drained into a flag at once. When the leader dies, alerts lapse by their lease unless the
//! next leader resends them (same labels and `startsAt`, so nothing flaps).

pub mod client;
pub mod ledger;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Notify;

use dlq_core::alert::{Current, Links};
use dlq_core::api::DeadLetterQueue;
use dlq_core::events::{EventPlan, action, reason};
use dlq_core::groups::DeadLetterGroup;
use kube::ResourceExt;

use crate::metrics::Metrics;
use crate::state::apiserver::{self, Apiserver};
use crate::state::records::RecordIndex;
pub use client::{AlertError, Alertmanager};
use ledger::{Key, Ledger};

/// How often due alerts are looked for (and the shortest time between two posts).
const ROUND: Duration = Duration::from_secs(1);
/// How often the store is rescanned without a wake-up (deletions, queue settings).
const RESCAN: Duration = Duration::from_secs(2);
/// After a wake-up, how long to gather more changes into the same batch.
const GATHER: Duration = Duration::from_millis(200);
/// Alerts per POST.
const BATCH: usize = 500;
/// Alerts per round per Alertmanager: bounds the request rate during a storm.
const MAX_PER_ROUND: usize = 5 * BATCH;
/// Longest wait between attempts while an Alertmanager is down.
const BACKOFF_CAP: Duration = Duration::from_secs(15);

/// The operator's alerting configuration (from `--alertmanager-*` flags).
#[derive(Debug)]
pub struct Alerting {
    pub alertmanagers: Vec<Alertmanager>,
    /// `endsAt` is this far ahead while a record is Parked; resent every quarter of it.
    pub lease: Duration,
    /// A Warning Event on the affected queues once delivery has failed this long.
    pub undeliverable_after: Duration,
    pub links: Links,
}

/// One Alertmanager's delivery state.
struct Delivery<'a> {
    am: &'a Alertmanager,
    ledger: Ledger,
    next_try: Instant,
    backoff: Duration,
    failing_since: Option<Instant>,
    warned: bool,
}

/// Everything a round needs besides the delivery state.
struct Env<'a> {
    cfg: &'a Alerting,
    queues: &'a Store<DeadLetterQueue>,
    apiserver: &'a dyn Apiserver,
    metrics: &'a Metrics,
}

/// Runs until `shutdown`. Nothing is resolved on the way out: a standby takes over.
pub async fn run(
    cfg: Arc<Alerting>,
    records: RecordIndex,
    queues: Store<DeadLetterQueue>,
    groups: Option<Store<DeadLetterGroup>>,
    apiserver: Arc<dyn Apiserver>,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let wake = Arc::new(Notify::new());
    let drain = tokio::spawn(drain_into(records.changes(), wake.clone()));
    tokio::select! {
        _ = shutdown => {}
        _ = deliver(&cfg, &records, &queues, groups.as_ref(), &wake, &*apiserver, &metrics) => {}
    }
    drain.abort();
}

/// Turns changes to the record index into wake-ups.
async fn drain_into(mut changes: tokio::sync::watch::Receiver<u64>, wake: Arc<Notify>) {
    while changes.changed().await.is_ok() {
        wake.notify_one();
    }
}

async fn deliver(
    cfg: &Alerting,
    records: &RecordIndex,
    queues: &Store<DeadLetterQueue>,
    groups: Option<&Store<DeadLetterGroup>>,
    wake: &Notify,
    apiserver: &dyn Apiserver,
    metrics: &Metrics,
) {
    records.wait_listed().await;
    if queues.wait_until_ready().await.is_err() {
        return;
    }
    tracing::info!(
        alertmanagers = cfg.alertmanagers.len(),
        "per-record alerts on"
    );
    let env = Env {
        cfg,
        queues,
        apiserver,
        metrics,
    };
    let mut deliveries: Vec<Delivery<'_>> = cfg
        .alertmanagers
        .iter()
        .map(|am| Delivery {
            am,
            ledger: Ledger::default(),
            next_try: Instant::now(),
            backoff: ROUND,
            failing_since: None,
            warned: false,
        })
        .collect();
    let mut scanner = Scanner::default();
    let mut last_scan: Option<Instant> = None;
    loop {
        let woken = tokio::select! {
            _ = wake.notified() => true,
            _ = tokio::time::sleep(ROUND) => false,
        };
        if woken {
            tokio::time::sleep(GATHER).await;
        }
        if woken || last_scan.is_none_or(|t| t.elapsed() >= RESCAN) {
            let desired = scanner.scan(records, queues, groups, &cfg.links);
            let now = Timestamp::now();
            for d in &mut deliveries {
                d.ledger.update(desired.clone(), now);
            }
            last_scan = Some(Instant::now());
        }
        futures::future::join_all(deliveries.iter_mut().map(|d| d.round(&env))).await;
    }
}

impl Delivery<'_> {
    /// Posts what is due, or backs off.
    async fn round(&mut self, env: &Env<'_>) {
        if Instant::now() < self.next_try {
            return;
        }
        let now = Timestamp::now();
        let lease = SignedDuration::try_from(env.cfg.lease).unwrap_or(SignedDuration::MAX);
        self.ledger.expire(now, lease);
        let due = self.ledger.due(now, lease / 4, lease, MAX_PER_ROUND);
        for batch in due.chunks(BATCH) {
            let alerts: Vec<_> = batch.iter().map(|(_, a)| a.clone()).collect();
            let result = self.am.post(&alerts).await;
            let label = if result.is_ok() { "success" } else { "failure" };
            env.metrics.alert_sent(label, alerts.len() as u64);
            match result {
                Ok(()) => {
                    self.ledger.accepted(batch.iter().map(|(k, _)| k), now);
                    self.recovered();
                }
                Err(error) => {
                    self.failed(env, &error).await;
                    return;
                }
            }
        }
    }

    fn recovered(&mut self) {
        if self.failing_since.take().is_some() {
            tracing::info!(alertmanager = %self.am.shown, "alertmanager accepts alerts again");
        }
        self.backoff = ROUND;
        self.warned = false;
    }

    async fn failed(&mut self, env: &Env<'_>, error: &AlertError) {
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        tracing::warn!(alertmanager = %self.am.shown, %error, retry_in = ?self.backoff, "posting alerts failed");
        // It may restart empty: resend everything current once it answers.
        self.ledger.forget_sent();
        self.next_try = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_CAP);
        if !self.warned && since.elapsed() >= env.cfg.undeliverable_after {
            self.warned = true;
            self.warn_queues(env, error, since.elapsed()).await;
        }
    }

    /// A Warning Event on every queue whose records' alerts are not getting through.
    async fn warn_queues(&self, env: &Env<'_>, error: &AlertError, for_: Duration) {
        let note = format!(
            "alerts of {} parked records cannot be delivered to {} for {}s: {error}",
            self.ledger.current_len(),
            self.am.shown,
            for_.as_secs()
        );
        for (ns, name) in self.ledger.queues() {
            let Some(q) = env.queues.get(&ObjectRef::new(&name).within(&ns)) else {
                continue;
            };
            let plan = EventPlan::warning(reason::ALERTS_UNDELIVERABLE, action::ALERT, &note);
            env.apiserver
                .publish(apiserver::reference(&*q), &plan)
                .await;
        }
    }
}

/// The current alerts of every record, recomputed only for records or queue settings that
/// changed since the last scan.
#[derive(Default)]
struct Scanner {
    /// By record uid: (resourceVersion, queue generation, its alerts).
    cache: HashMap<String, (String, Option<i64>, Vec<Current>)>,
}

impl Scanner {
    fn scan(
        &mut self,
        records: &RecordIndex,
        queues: &Store<DeadLetterQueue>,
        groups: Option<&Store<DeadLetterGroup>>,
        links: &Links,
    ) -> HashMap<Key, Current> {
        let mut next = HashMap::with_capacity(self.cache.len());
        let mut out = HashMap::new();
        for summary in records.all() {
            let queue = queues.get(&ObjectRef::new(&summary.queue).within(&summary.namespace));
            let qgen = queue.as_ref().and_then(|q| q.metadata.generation);
            let uid = summary.uid.to_string();
            let rv = summary.resource_version.to_string();
            let alerts = match self.cache.remove(&uid) {
                Some((r, g, a)) if r == rv && g == qgen => a,
                _ => record_alerts(&summary.to_record(), queue.as_deref(), links),
            };
            for a in &alerts {
                out.insert(a.labels.clone(), a.clone());
            }
            next.insert(uid, (rv, qgen, alerts));
        }
        self.cache = next;
        if let Some(groups) = groups {
            for group in groups.state() {
                let Some(ns) = group.metadata.namespace.as_deref() else {
                    continue;
                };
                let queue = group
                    .labels()
                    .get(dlq_core::api::LABEL_QUEUE)
                    .and_then(|q| queues.get(&ObjectRef::new(q).within(ns)));
                if let Some(a) = dlq_core::alert::group_alert(&group, queue.as_deref(), links) {
                    out.insert(a.labels.clone(), a);
                }
            }
        }
        out
    }
}

/// A record's own alerts: `DeadLetterParked` only where its queue alerts per record (by
/// default its group alerts instead), `DeadLetterRequeueFailing` always.
fn record_alerts(
    record: &dlq_core::api::DeadLetter,
    queue: Option<&DeadLetterQueue>,
    links: &Links,
) -> Vec<Current> {
    let per_record = queue
        .and_then(|q| q.spec.alerts.as_ref())
        .is_some_and(|a| a.per_record());
    let mut alerts = dlq_core::alert::current(record, queue, links);
    if !per_record {
        alerts.retain(|a| {
            a.labels.get("alertname").map(String::as_str) != Some(dlq_core::alert::PARKED)
        });
    }
    alerts
}
