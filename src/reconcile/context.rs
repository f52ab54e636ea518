//! What the reconcilers share: their [`Context`] (constructible in tests with a fake apiserver
//! and fake targets), their [`Settings`] and the throughput [`Mechanisms`]. Its own file, so the
//! reconcilers and the parts they share name it without going through the module's facade.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use tokio::sync::Mutex;

use dlq_core::api::{DeadLetter, DeadLetterQueue, Job};
use dlq_core::capacity;
use dlq_core::plan::{Effects, Then};
use dlq_core::replay::DeadLetterReplay;
use k8s_openapi::api::core::v1::ResourceQuota;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::views::Views;
use super::{aggregate, claims, kept_groups};
use crate::metrics::Metrics;
use crate::state::apiserver::{self, Apiserver};
use crate::state::bytes::ByteBudget;
use crate::state::jobs::JobIndex;
use crate::state::leadership::Leadership;
use crate::state::parking_first;
use crate::state::records::RecordIndex;
use crate::targets::Targets;

/// Tunables of the reconcilers.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Longest wait between requeue attempts while a broker is down.
    pub backoff_cap: Duration,
    /// How often queues refresh counters, readiness and retention without a trigger.
    pub queue_resync: Duration,
    /// Concurrent reconciles per controller.
    pub concurrency: u16,
    /// This replica's term on the Lease: no requeue once it ran out (a paused leader).
    pub leadership: Leadership,
    /// The throughput mechanisms switched on (all but in the bench's A/B).
    pub mechanisms: Mechanisms,
    /// The park endpoint's advertised base URL (`--park-url`): queues with `spec.http` show
    /// their `status.address` under it. None when the endpoint is not served.
    pub park_url: Option<String>,
    /// The CA bundle beside the endpoint's certificate (`ca.crt` in `--park-tls-dir`, as
    /// cert-manager writes it), read at each queue reconcile into `status.address.CACerts`.
    pub park_ca_file: Option<std::path::PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backoff_cap: Duration::from_secs(60),
            queue_resync: Duration::from_secs(30),
            concurrency: 32,
            leadership: Leadership::always(),
            mechanisms: Mechanisms::default(),
            park_url: None,
            park_ca_file: None,
        }
    }
}

/// Mechanisms that exist only for throughput or memory, each switchable so that the bench can
/// measure what it buys against the same build without it (`make bench`'s A/B). Every one is
/// on in production; only the hidden `--disable` flag turns one off, and only a build with
/// feature `bench` has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mechanisms {
    /// Marks yield to this process's busy sources (see [`parking_first`]).
    pub parking_first: bool,
    /// The feeder holds at most a quota of records for their first mark
    /// (`crate::run::feeder::MARK_QUOTA`); off, it holds every unmarked record.
    pub mark_quota: bool,
    /// The sources' parker asks for the next block of slots while a storm spends the current
    /// one (`dlq_client::park::ParkOptions::ask_ahead`).
    pub ask_ahead: bool,
    /// Normal resolution Events folded per queue per period, and a parking storm's `Parked`
    /// Events into one series per failure group (see [`aggregate`]).
    pub aggregation: bool,
    /// The Kafka source handles several messages at once (`crate::source::kafka::IN_FLIGHT`).
    pub kafka_in_flight: bool,
    /// The SQS source receives with several long polls at once (`crate::source::sqs::RECEIVERS`).
    pub sqs_receivers: bool,
    /// A redrive of one failure group sends its records' jobs ahead of their decisions and
    /// signs them behind (see [`super::ahead`]); off, it signs each record first.
    pub send_ahead: bool,
}

impl Default for Mechanisms {
    fn default() -> Self {
        Mechanisms {
            parking_first: true,
            mark_quota: true,
            ask_ahead: true,
            aggregation: true,
            kafka_in_flight: true,
            sqs_receivers: true,
            send_ahead: true,
        }
    }
}

/// A name `--disable` does not know.
#[derive(Debug, thiserror::Error)]
#[error("unknown mechanism {0:?}: known are {known}", known = Mechanisms::NAMES.join(", "))]
pub struct UnknownMechanism(String);

impl Mechanisms {
    /// The names `--disable` takes.
    pub const NAMES: [&str; 7] = [
        "parking_first",
        "mark_quota",
        "ask_ahead",
        "aggregation",
        "kafka_in_flight",
        "sqs_receivers",
        "send_ahead",
    ];

    /// Every mechanism on but those `names` lists (blank names are skipped).
    pub fn without<S: AsRef<str>>(names: &[S]) -> Result<Self, UnknownMechanism> {
        let mut on = Mechanisms::default();
        for name in names.iter().map(|n| n.as_ref().trim()) {
            let switch = match name {
                "" => continue,
                "parking_first" => &mut on.parking_first,
                "mark_quota" => &mut on.mark_quota,
                "ask_ahead" => &mut on.ask_ahead,
                "aggregation" => &mut on.aggregation,
                "kafka_in_flight" => &mut on.kafka_in_flight,
                "sqs_receivers" => &mut on.sqs_receivers,
                "send_ahead" => &mut on.send_ahead,
                other => return Err(UnknownMechanism(other.to_string())),
            };
            *switch = false;
        }
        Ok(on)
    }
}

/// What a redrive reaches beyond its record: where the job goes back, the keys that open a
/// sealed one, the store a large body is fetched from, and how many such bodies are held at
/// once. The queue reconciler asks the same targets and keys for readiness and recipients.
pub struct Redrive {
    pub targets: Arc<dyn Targets>,
    /// The queues' sealing keys (opening sealed jobs to redrive them, the recipients a queue
    /// publishes); [`crate::keys::NoKeys`] unless set with [`Context::with_keys`].
    pub keys: Arc<dyn crate::keys::Keys>,
    /// The queues' body stores (fetching a stored body to redrive it); [`crate::body::NoBodies`]
    /// unless set with [`Context::with_bodies`].
    pub bodies: Arc<dyn crate::body::Bodies>,
    /// Bytes of stored bodies being redriven at once ([`REDRIVE_BYTES`], see
    /// [`Redrive::body_turn`]).
    bytes: ByteBudget,
}

impl Redrive {
    fn new(targets: Arc<dyn Targets>) -> Self {
        Redrive {
            targets,
            keys: Arc::new(crate::keys::NoKeys),
            bodies: Arc::new(crate::body::NoBodies),
            bytes: ByteBudget::new(REDRIVE_BYTES),
        }
    }

    /// A turn to redrive `job`'s stored body: its size of [`REDRIVE_BYTES`] (all of it for a
    /// larger one), held while the body is fetched, opened and sent; None for a job whose
    /// bytes are in its record or whose body is only checked (an external object).
    pub async fn body_turn(&self, job: &Job) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let body = job.body.as_deref().filter(|b| !b.external)?;
        let size = u64::try_from(body.size).unwrap_or(0);
        self.bytes.hold(size).await.ok()
    }
}

/// The bounds beside `maxParked` a queue's `Full` condition names: a ResourceQuota on its
/// namespace's records, the operator's `--max-records`. Only the queue reconciler reads them.
#[derive(Default)]
pub struct QueueBounds {
    /// ResourceQuotas as the watch sees them; None in tests that do not watch them.
    quotas: Option<Store<ResourceQuota>>,
    /// The operator's `--max-records` and its last count; None without one.
    ceiling: Option<crate::state::ceiling::Ceiling>,
}

impl QueueBounds {
    /// The bounds on the records of a queue in `ns`: the tightest ResourceQuota on
    /// `count/deadletters.dlq.dev` in `ns`, and the operator's ceiling.
    pub fn of(&self, ns: &str) -> capacity::Bounds {
        let quota = self.quotas.as_ref().and_then(|store| {
            capacity::tightest(
                store
                    .state()
                    .iter()
                    .filter(|q| q.metadata.namespace.as_deref() == Some(ns))
                    .filter_map(|q| quota_use(q)),
            )
        });
        capacity::Bounds {
            quota,
            ceiling: self.ceiling.as_ref().and_then(|c| c.use_now()),
        }
    }
}

/// Everything a reconcile needs, by concern; built from parts so tests construct it with a
/// fake [`Apiserver`] and fake [`Targets`] and call the reconcilers in-process.
pub struct Context {
    pub apiserver: Arc<dyn Apiserver>,
    pub metrics: Metrics,
    pub settings: Settings,
    /// Every record, as a summary (see [`index`]).
    pub records: RecordIndex,
    /// Queues, groups and replays as the watches see them.
    pub views: Views,
    /// Consecutive requeue failures per record (by uid), for backoff. Entries of records that
    /// are gone are pruned on the next failure.
    pub(super) failures: Mutex<HashMap<String, (ObjectRef<DeadLetter>, u32)>>,
    /// Records being reconciled, records resolved by this process, and redrives a broker
    /// confirmed whose resolution is not yet written, across the two records controllers.
    pub(super) claims: claims::Claims,
    /// Folds Normal resolution Events per queue during bulk resolutions and `Parked` into a
    /// series per failure group during storms; None publishes every Event as planned (the
    /// in-process tests that do not ask for one).
    pub(super) aggregator: Option<aggregate::Aggregator>,
    /// Marks yield to this process's sources while they park (see [`parking_first`]).
    pub parking_first: parking_first::ParkingFirst,
    /// The failure groups this process keeps (see [`groups`]).
    pub groups: kept_groups::GroupKeeper,
    /// What a redrive reaches beyond its record.
    pub redrive: Redrive,
    /// The bounds beside `maxParked` (a queue's `Full`).
    pub bounds: QueueBounds,
    /// The sources' view of each job's records: a replay sending a job ahead of its record's
    /// decision says so there first (see [`crate::state::jobs`]).
    pub jobs: JobIndex,
}

/// Bytes of stored bodies redriven at once. A redrive holds its body whole (fetched, opened when
/// sealed, encoded by the target), and the records controllers run 32 reconciles at once: 32
/// bodies of 100 MiB would be gigabytes, past any memory limit, and again after each restart.
/// Bodies below a few MiB are not held back; one larger than this runs alone.
pub const REDRIVE_BYTES: u32 = 64 << 20;

/// How long a reconcile waits for a store's first complete list (the record index's, the queue
/// store's) before it steps aside and asks to be run again.
pub const LIST_WAIT: Duration = Duration::from_secs(1);

/// Whether `store` has had its first complete list, waiting at most [`LIST_WAIT`].
async fn listed_once<K>(store: &Store<K>) -> bool
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    tokio::time::timeout(LIST_WAIT, store.wait_until_ready())
        .await
        .is_ok_and(|r| r.is_ok())
}

impl Context {
    /// Whether the record index has listed everything once (waiting at most [`LIST_WAIT`]).
    /// A reconcile must not hold its object's slot while waiting: with 20,000 records the
    /// queue's first reconcile, started before the list was complete, never resumed (its
    /// counters were never written); asking again each time does.
    pub async fn records_ready(&self) -> bool {
        tokio::time::timeout(LIST_WAIT, self.records.wait_listed())
            .await
            .is_ok()
    }

    /// Whether the record index has listed everything once, without waiting.
    pub fn records_listed(&self) -> bool {
        self.records.listed()
    }

    /// Whether the queue store has listed everything once (waiting at most [`LIST_WAIT`]):
    /// records can stream in before their queues, and a queue not yet listed is not missing.
    pub async fn queues_ready(&self) -> bool {
        listed_once(&self.views.queues).await
    }

    pub fn new(
        apiserver: Arc<dyn Apiserver>,
        targets: Arc<dyn Targets>,
        records: RecordIndex,
        queues: Store<DeadLetterQueue>,
        metrics: Metrics,
        settings: Settings,
    ) -> Self {
        Context {
            apiserver,
            metrics,
            records,
            views: Views::new(queues),
            failures: Mutex::default(),
            claims: claims::Claims::default(),
            aggregator: None,
            parking_first: parking_first::ParkingFirst::new(settings.mechanisms.parking_first),
            groups: kept_groups::GroupKeeper::default(),
            redrive: Redrive::new(targets),
            bounds: QueueBounds::default(),
            jobs: JobIndex::default(),
            settings,
        }
    }

    /// Shares the sources' view of each job's records (see [`Context::jobs`]).
    pub fn with_jobs(mut self, jobs: JobIndex) -> Self {
        self.jobs = jobs;
        self
    }

    /// Reads the replays from `store` (see [`Views::passed_through`]).
    pub fn with_replay_store(mut self, store: Store<DeadLetterReplay>) -> Self {
        self.views.replays = Some(store);
        self
    }

    /// Reads the ResourceQuotas from `store` (see [`QueueBounds::of`]).
    pub fn with_quotas(mut self, store: Store<ResourceQuota>) -> Self {
        self.bounds.quotas = Some(store);
        self
    }

    /// Tells the queues' `Full` condition about the operator's `--max-records`.
    pub fn with_ceiling(mut self, ceiling: crate::state::ceiling::Ceiling) -> Self {
        self.bounds.ceiling = Some(ceiling);
        self
    }

    /// Reads the queues' sealing keys with `keys`.
    pub fn with_keys(mut self, keys: Arc<dyn crate::keys::Keys>) -> Self {
        self.redrive.keys = keys;
        self
    }

    /// Keeps and fetches large bodies with `bodies`.
    pub fn with_bodies(mut self, bodies: Arc<dyn crate::body::Bodies>) -> Self {
        self.redrive.bodies = bodies;
        self
    }

    /// Reads the groups' acknowledgements from `store` (see [`groups`]).
    pub fn with_group_store(mut self, store: Store<dlq_core::groups::DeadLetterGroup>) -> Self {
        self.views.groups = Some(store);
        self
    }

    /// Sends aggregatable Events through `aggregator` (see [`aggregate`]).
    pub fn with_aggregator(mut self, aggregator: aggregate::Aggregator) -> Self {
        self.aggregator = Some(aggregator);
        self
    }

    /// Publishes the Events and applies the metric changes of a plan about `obj`. Normal
    /// resolution Events and `Parked` go through the aggregator when there is one: folded
    /// during bulk resolutions and parking storms, else handed back and published here.
    pub async fn carry_out(&self, obj: &DeadLetter, effects: &Effects) {
        for change in &effects.metrics {
            self.metrics.apply(change);
        }
        for event in &effects.events {
            let regarding = apiserver::reference(obj);
            match (&self.aggregator, self.views.pending(obj, &regarding, event)) {
                (Some(aggregator), Some(pending)) => {
                    if let Some(p) = aggregator.take(pending) {
                        self.apiserver.publish(p.regarding, &p.plan).await;
                    }
                }
                _ => self.apiserver.publish(regarding, event).await,
            }
        }
    }

    /// The queue `name` in `namespace`, from the store.
    pub fn queue(&self, namespace: &str, name: &str) -> Option<Arc<DeadLetterQueue>> {
        self.views.queue(namespace, name)
    }

    /// Counts one more consecutive requeue failure of `record`.
    pub(super) async fn note_failure(&self, record: &DeadLetter) -> u32 {
        let mut map = self.failures.lock().await;
        map.retain(|_, (r, _)| {
            let ns = r.namespace.as_deref().unwrap_or_default();
            self.records.get(ns, &r.name).is_some()
        });
        let entry = map
            .entry(record.uid().unwrap_or_default())
            .or_insert_with(|| (ObjectRef::from_obj(record), 0));
        entry.1 = entry.1.saturating_add(1);
        entry.1
    }

    pub(super) async fn clear_failures(&self, record: &DeadLetter) {
        self.failures
            .lock()
            .await
            .remove(&record.uid().unwrap_or_default());
    }
}

/// The controller's form of a plan's follow-up.
pub fn action(then: Then) -> Action {
    match then {
        Then::AwaitChange => Action::await_change(),
        Then::RequeueAfter(d) => Action::requeue(d),
    }
}

/// What a ResourceQuota says of the records of its namespace, when it bounds them and its
/// controller has counted it.
pub fn quota_use(q: &ResourceQuota) -> Option<capacity::QuotaUse> {
    let scoped = q.spec.as_ref().is_some_and(|s| {
        s.scopes.as_ref().is_some_and(|v| !v.is_empty()) || s.scope_selector.is_some()
    });
    let status = q.status.as_ref()?;
    fn pairs(list: Option<&BTreeMap<String, Quantity>>) -> Vec<(&str, &str)> {
        list.into_iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v.0.as_str()))
            .collect()
    }
    capacity::QuotaUse::from_status(
        q.metadata.name.as_deref().unwrap_or_default(),
        scoped,
        pairs(status.hard.as_ref()),
        pairs(status.used.as_ref()),
    )
}

#[cfg(test)]
mod mechanisms_tests {
    use super::Mechanisms;

    #[test]
    fn disable_names_switch_off_exactly_those_mechanisms() {
        assert_eq!(
            Mechanisms::without::<&str>(&[]).expect("none"),
            Mechanisms::default()
        );
        let off = Mechanisms::without(&["parking_first", " aggregation", ""]).expect("known");
        assert_eq!(
            off,
            Mechanisms {
                parking_first: false,
                aggregation: false,
                ..Mechanisms::default()
            }
        );
        for name in Mechanisms::NAMES {
            assert_ne!(
                Mechanisms::without(&[name]).expect("known"),
                Mechanisms::default()
            );
        }
        assert!(Mechanisms::without(&["claims"]).is_err());
    }
}
