//! What the harness saw during a run, to check the invariants against: every record's phase
//! sequence from a watch, every job that arrived on a target, and when each fault happened.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use dlq_core::api::{DeadLetter, Phase};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};

/// One record as the watch saw it over time.
#[derive(Clone, Debug, Default)]
pub struct RecordHistory {
    pub job: String,
    pub queue: String,
    pub cycle: i64,
    /// The decision, once set (`redrive` / `drop`).
    pub action: Option<String>,
    /// Each distinct phase in the order seen.
    pub phases: Vec<Phase>,
    /// Each distinct `resolvedAt` seen: more than one is a second resolution.
    pub resolutions: Vec<String>,
    /// Times the phase went backwards (a resolved record seen Parked, or flipping outcome).
    pub regressions: u32,
}

/// A job arriving on its target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub at: Instant,
    /// The redrive's idempotency key, as the consumer found it beside the job.
    pub key: Option<String>,
}

/// Whether `key` is the idempotency key of one dead message (`dlq_core::park::message_key`:
/// `msg-` and 32 hex digits): what a standing replay's pass-through carries, and a record a
/// source parked from that message too. A repeat of either carries the same key.
pub fn is_message_key(key: &str) -> bool {
    key.strip_prefix("msg-")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Arrival {
    /// Whether it carries a dead message's key (passed through, or a source-parked record's
    /// redrive), not a record's uid and cycle.
    pub fn keyed_by_message(&self) -> bool {
        self.key.as_deref().is_some_and(is_message_key)
    }
}

/// How long before a job's first arrival a fault may have started and still explain its
/// second (a link cut just as the broker took the job loses only the answer).
pub const BLAME_LEAD: std::time::Duration = std::time::Duration::from_secs(1);

/// Fault kinds in the order [`History::blame_between`] prefers them.
const BLAME_ORDER: [&str; 8] = [
    "operator_sigkill",
    "leader_pause",
    "broker_partition",
    "broker_cut",
    "redis_restart",
    "rabbitmq_restart",
    "apiserver_restart",
    "etcd_restart",
];

/// Shared run history.
#[derive(Clone, Default)]
pub struct History {
    records: Arc<Mutex<BTreeMap<String, RecordHistory>>>,
    /// Job id → each arrival on its target, in order.
    arrivals: Arc<Mutex<HashMap<String, Vec<Arrival>>>>,
    /// (start, kind) of every fault injected, in order.
    faults: Arc<Mutex<Vec<(Instant, &'static str)>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn rank(p: Phase) -> u8 {
    match p {
        Phase::Parked => 0,
        Phase::Redriven | Phase::Dropped => 1,
    }
}

impl History {
    /// Records one watched state of a record.
    pub fn observe(&self, r: &DeadLetter) {
        let phase = r.phase();
        let mut all = lock(&self.records);
        let h = all.entry(r.name_any()).or_default();
        h.job.clone_from(&r.spec.job.id);
        h.queue.clone_from(&r.spec.queue);
        h.cycle = i64::from(r.spec.cycle);
        if let Some(a) = &r.spec.action {
            h.action = Some(format!("{a:?}").to_lowercase());
        }
        if let Some(&last) = h.phases.last()
            && (rank(phase) < rank(last) || (rank(last) == 1 && phase != last))
        {
            h.regressions += 1;
        }
        if h.phases.last() != Some(&phase) {
            h.phases.push(phase);
        }
        let at = r.status.as_ref().and_then(|s| s.resolved_at.as_ref());
        if let Some(at) = at.map(|t| t.0.to_string())
            && !h.resolutions.contains(&at)
        {
            h.resolutions.push(at);
        }
    }

    /// A copy of every record's history.
    pub fn records(&self) -> BTreeMap<String, RecordHistory> {
        lock(&self.records).clone()
    }

    /// Notes that `job` arrived on its target now, with the idempotency key beside it.
    pub fn arrived(&self, job: &str, key: Option<String>) {
        lock(&self.arrivals)
            .entry(job.to_string())
            .or_default()
            .push(Arrival {
                at: Instant::now(),
                key,
            });
    }

    pub fn arrivals(&self) -> HashMap<String, Vec<Arrival>> {
        lock(&self.arrivals).clone()
    }

    /// Notes that a fault of `kind` starts now.
    pub fn fault(&self, kind: &'static str) {
        lock(&self.faults).push((Instant::now(), kind));
    }

    pub fn faults(&self) -> Vec<(Instant, &'static str)> {
        lock(&self.faults).clone()
    }

    /// The kind of the last fault that started before `t` ("none" before the first).
    pub fn blame(&self, t: Instant) -> &'static str {
        lock(&self.faults)
            .iter()
            .rev()
            .find(|(at, _)| *at <= t)
            .map_or("none", |(_, k)| *k)
    }

    /// The fault that explains a job arriving again at `second` after it arrived at `first`.
    /// Faults come every few seconds, so the last one before `second` is often not the cause:
    /// among those that started between the two arrivals (from [`BLAME_LEAD`] before the
    /// first), the kind that can make a second enqueue by itself wins: a process gone or
    /// paused (the next leader enqueues again), then a broker that took the job but whose
    /// answer was lost (the enqueue is retried), then the control plane, whose faults the
    /// operator's memory of confirmations covers. With none in between, [`History::blame`].
    pub fn blame_between(&self, first: Instant, second: Instant) -> &'static str {
        let from = first.checked_sub(BLAME_LEAD).unwrap_or(first);
        let faults = lock(&self.faults);
        let between = faults.iter().filter(|(at, _)| (from..=second).contains(at));
        match between.min_by_key(|(_, k)| BLAME_ORDER.iter().position(|o| o == k)) {
            Some((_, kind)) => kind,
            None => {
                drop(faults);
                self.blame(second)
            }
        }
    }

    /// Watches every DeadLetter of the namespace for the whole run, through apiserver and
    /// etcd restarts (the watcher re-lists with backoff).
    pub fn spawn_watch(&self, api: Api<DeadLetter>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(ev) = events.next().await {
                // Errors (the apiserver restarting) are retried by the backoff.
                if let Ok(watcher::Event::Apply(r) | watcher::Event::InitApply(r)) = ev {
                    me.observe(&r);
                }
            }
        })
    }
}
