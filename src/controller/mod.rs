//! Carries out the core's plans: one reflector per kind (DeadLetters with payloads stripped,
//! DeadLetterQueues), a DeadLetter reconciler (redrive/drop) and a DeadLetterQueue reconciler
//! (counters, readiness, retention), the sources, and the one writer ([`apiserver`]).

pub mod aggregate;
pub mod apiserver;
pub mod cache;
mod claims;
pub mod deadletter;
pub mod deadletterqueue;
pub mod index;
pub mod jobs;
pub mod leadership;
pub mod parking_first;
pub mod replay;
pub mod work;

pub use self::leadership::Leadership;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, TryStreamExt};
use kube::api::{WatchEvent, WatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::predicates;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::Mutex;

use dlq_core::api::{DeadLetter, DeadLetterQueue};
use dlq_core::events::EventPlan;
use dlq_core::plan::{Effects, Then};
use k8s_openapi::api::core::v1::ObjectReference;

use crate::error::Error;
use crate::metrics::Metrics;
use crate::target::Targets;
use crate::target::cache::TargetCache;
use apiserver::{Apiserver, KubeApiserver};

/// Tunables of the reconcilers.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Longest wait between requeue attempts while a broker is down.
    pub backoff_cap: Duration,
    /// How often queues refresh counters, readiness and retention without a trigger.
    pub queue_resync: Duration,
    /// Concurrent reconciles per controller.
    pub concurrency: u16,
    /// Per-record Alertmanager alerts; None when no Alertmanager is configured.
    pub alerts: Option<Arc<crate::alert::Alerting>>,
    /// This replica's term on the Lease: no requeue once it ran out (a paused leader).
    pub leadership: Leadership,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backoff_cap: Duration::from_secs(60),
            queue_resync: Duration::from_secs(30),
            concurrency: 32,
            alerts: None,
            leadership: Leadership::always(),
        }
    }
}

/// Everything a reconcile needs; built from parts so tests construct it with a fake
/// [`Apiserver`] and fake [`Targets`] and call the reconcilers in-process.
pub struct Context {
    pub apiserver: Arc<dyn Apiserver>,
    pub targets: Arc<dyn Targets>,
    pub metrics: Metrics,
    pub settings: Settings,
    /// Every record, as a summary (see [`index`]).
    pub records: index::RecordIndex,
    /// DeadLetterQueues as the watch sees them: the only way the operator reads them.
    pub queues: Store<DeadLetterQueue>,
    /// Consecutive requeue failures per record (by uid), for backoff. Entries of records that
    /// are gone are pruned on the next failure.
    failures: Mutex<HashMap<String, (ObjectRef<DeadLetter>, u32)>>,
    /// Record uids this process already enqueued whose resolution is not yet written: a retry
    /// after a failed status write must not enqueue a second time.
    enqueued: Mutex<HashSet<String>>,
    /// Records being reconciled and records resolved by this process, across the two records
    /// controllers.
    claims: claims::Claims,
    /// Folds Normal resolution Events per queue during bulk resolutions; None publishes
    /// every Event as planned (the in-process tests).
    aggregator: Option<aggregate::Aggregator>,
    /// Marks yield to this process's sources while they park (see [`parking_first`]).
    pub parking_first: parking_first::ParkingFirst,
}

/// How long a reconcile waits for the record cache's first complete list before it steps aside
/// and asks to be run again.
pub const CACHE_WAIT: Duration = Duration::from_secs(1);

/// Whether `store` has had its first complete list, waiting at most [`CACHE_WAIT`].
async fn listed_once<K>(store: &Store<K>) -> bool
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    tokio::time::timeout(CACHE_WAIT, store.wait_until_ready())
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Whether `store` has had its first complete list, without waiting.
fn listed_now<K>(store: &Store<K>) -> bool
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    store
        .wait_until_ready()
        .now_or_never()
        .is_some_and(|r| r.is_ok())
}

/// Runs a kube controller until it ends, or at `stop` when its store has never listed: kube
/// holds a controller's reconciles (and so its graceful shutdown) until its own store has
/// listed, so a list that never completes (the CRD missing, RBAC denied, an apiserver that
/// stays down) would otherwise hold a SIGTERM until the kubelet's SIGKILL. No reconcile can
/// have run then, so nothing is cut short.
async fn until_stopped<K>(
    controller: impl std::future::Future<Output = ()>,
    store: Store<K>,
    stop: impl std::future::Future<Output = ()>,
) where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let never_listed = async move {
        stop.await;
        if listed_now(&store) {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        _ = controller => {}
        _ = never_listed => {}
    }
}

impl Context {
    /// Whether the record cache has listed everything once (waiting at most [`CACHE_WAIT`]).
    /// A reconcile must not hold its object's slot while waiting: with 20,000 records the
    /// queue's first reconcile, started before the list was complete, never resumed (its
    /// counters were never written); asking again each time does.
    pub async fn cache_ready(&self) -> bool {
        tokio::time::timeout(CACHE_WAIT, self.records.wait_listed())
            .await
            .is_ok()
    }

    /// Whether the record cache has listed everything once, without waiting.
    pub fn records_listed(&self) -> bool {
        self.records.listed()
    }

    /// Whether the queue cache has listed everything once (waiting at most [`CACHE_WAIT`]):
    /// records can stream in before their queues, and a queue not yet listed is not missing.
    pub async fn queues_ready(&self) -> bool {
        listed_once(&self.queues).await
    }

    pub fn new(
        apiserver: Arc<dyn Apiserver>,
        targets: Arc<dyn Targets>,
        records: index::RecordIndex,
        queues: Store<DeadLetterQueue>,
        metrics: Metrics,
        settings: Settings,
    ) -> Self {
        Context {
            apiserver,
            targets,
            metrics,
            settings,
            records,
            queues,
            failures: Mutex::default(),
            enqueued: Mutex::default(),
            claims: claims::Claims::default(),
            aggregator: None,
            parking_first: parking_first::ParkingFirst::default(),
        }
    }

    /// Sends aggregatable Events through `aggregator` (see [`aggregate`]).
    pub fn with_aggregator(mut self, aggregator: aggregate::Aggregator) -> Self {
        self.aggregator = Some(aggregator);
        self
    }

    /// Publishes the Events and applies the metric changes of a plan about `obj`. Normal
    /// resolution Events go through the aggregator when there is one.
    pub async fn carry_out(&self, obj: &DeadLetter, effects: &Effects) {
        for change in &effects.metrics {
            self.metrics.apply(change);
        }
        for event in &effects.events {
            let regarding = apiserver::reference(obj);
            match (&self.aggregator, self.pending(obj, &regarding, event)) {
                (Some(aggregator), Some(pending)) => {
                    if let Err(p) = aggregator.send(pending) {
                        tracing::warn!("event aggregator gone; publishing directly");
                        self.apiserver.publish(p.regarding, &p.plan).await;
                    }
                }
                _ => self.apiserver.publish(regarding, event).await,
            }
        }
    }

    /// `event` as the aggregator takes it, when it may be aggregated: a Normal resolution
    /// Event about a record.
    fn pending(
        &self,
        obj: &DeadLetter,
        regarding: &ObjectReference,
        event: &EventPlan,
    ) -> Option<aggregate::Pending> {
        if !dlq_core::events::aggregatable(event) {
            return None;
        }
        let meta = obj.meta();
        let queue = obj.spec.queue.clone();
        let namespace = meta.namespace.clone()?;
        Some(aggregate::Pending {
            queue_ref: self
                .queue(&namespace, &queue)
                .map(|q| apiserver::reference(q.as_ref())),
            namespace,
            queue,
            name: meta.name.clone().unwrap_or_default(),
            regarding: regarding.clone(),
            plan: event.clone(),
        })
    }

    /// The queue `name` in `namespace`, from the store.
    pub fn queue(&self, namespace: &str, name: &str) -> Option<Arc<DeadLetterQueue>> {
        self.queues.get(&ObjectRef::new(name).within(namespace))
    }

    /// Counts one more consecutive requeue failure of `record`.
    async fn note_failure(&self, record: &DeadLetter) -> u32 {
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

    async fn clear_failures(&self, record: &DeadLetter) {
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

fn error_policy<K>(_obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&crate::metrics::ErrorLabels {
            kind: err.category().into(),
        })
        .inc();
    tracing::warn!(error = %err, kind = err.category(), "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// Runs both controllers and the sources over `namespace` (all namespaces when None) until
/// `shutdown` resolves.
pub async fn run_scope(
    client: Client,
    namespace: Option<String>,
    metrics: Metrics,
    reporter: Reporter,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let records = index::RecordIndex::default();
    // The records controller's store: only records with something to do (see [`work`]).
    let (work, work_writer) = reflector::store();
    let (record_wakes, woken_records) = futures::channel::mpsc::unbounded();
    let (queue_wakes, woken_queues) = futures::channel::mpsc::unbounded();
    let (queues, queue_writer) = reflector::store_shared(256);
    let (Some(queue_events), Some(queue_changes)) =
        (queue_writer.subscribe(), queue_writer.subscribe())
    else {
        tracing::error!("cannot subscribe to the queue store");
        return;
    };
    let jobs = jobs::JobIndex::default();
    let initial = initial_state_for(&api_for(&client, &namespace)).await;
    let record_watch = watch_records(
        api_for(&client, &namespace),
        initial,
        jobs.clone(),
        records.clone(),
        work::Feeder::new(work_writer, records.clone(), record_wakes, queue_wakes),
    );
    let queue_watch = watcher(
        api_for(&client, &namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect_shared(queue_writer)
    .for_each(|_| futures::future::ready(()));

    let targets = Arc::new(TargetCache::new(client.clone()));
    let apiserver: Arc<dyn Apiserver> = Arc::new(KubeApiserver::new(client.clone(), reporter));
    let ctx = Arc::new(
        Context::new(
            apiserver.clone(),
            targets.clone(),
            records.clone(),
            queues.clone(),
            metrics,
            settings.clone(),
        )
        .with_aggregator(aggregate::Aggregator::spawn(apiserver)),
    );
    let alerts = alert_sender(&settings, &ctx, shutdown.clone());
    let cfg = kube::runtime::controller::Config::default().concurrency(settings.concurrency);
    let records_ctl = until_stopped(
        // Woken by bare references from the feeder, for the records it holds.
        Controller::for_shared_stream(futures::stream::pending(), work.clone())
            .reconcile_on(woken_records)
            .with_config(cfg.clone())
            .graceful_shutdown_on(shutdown.clone())
            .run(deadletter::reconcile, error_policy, ctx.clone())
            .for_each(|_| futures::future::ready(())),
        work,
        shutdown.clone(),
    );
    let client_for_replays = client.clone();
    let sources = crate::source::supervise(
        crate::source::Shared {
            parker: dlq_client::park::Parker::new(client.clone()),
            client,
            queues: queues.clone(),
            jobs,
            apiserver: ctx.apiserver.clone(),
            metrics: ctx.metrics.clone(),
            leadership: settings.leadership.clone(),
            in_flight: Default::default(),
            parking_first: ctx.parking_first.clone(),
        },
        queue_changes,
        targets,
        shutdown.clone(),
    );
    let queues_ctl = Controller::for_shared_stream(queue_events, queues.clone())
        .with_config(cfg.clone().debounce(Duration::from_millis(500)))
        .reconcile_on(woken_queues)
        .graceful_shutdown_on(shutdown.clone())
        .run(deadletterqueue::reconcile, error_policy, ctx.clone())
        .for_each(|_| futures::future::ready(()));
    let queues_ctl = until_stopped(queues_ctl, queues, shutdown.clone());
    let decisions_ctl = decisions_controller(
        &client_for_replays,
        &namespace,
        ctx.clone(),
        cfg.clone(),
        shutdown.clone(),
    );
    let replays_ctl = replay_controller(&client_for_replays, &namespace, ctx, cfg, shutdown);

    tokio::select! {
        _ = record_watch => {}
        _ = queue_watch => {}
        // The controllers end after `shutdown`, once in-flight reconciles finished (the
        // decisions controller already once the full record list has arrived).
        _ = async { tokio::join!(records_ctl, decisions_ctl, queues_ctl, sources, alerts, replays_ctl) } => {}
    }
}

/// Records with a decision not yet carried out: Parked, `spec.action` set (both selectable
/// fields of the CRD; an unset field selects as "").
pub const DECIDED: &str = "status.phase=Parked,spec.action!=";

/// Carries out decisions while the full record cache is still listing. A restarted operator
/// with 100,000 records listed them for 15 s before its first reconcile; decisions waiting to
/// be carried out are a handful, watched on their own, so they are acted on within a second.
/// Once the full cache has listed, the records controller sees every decision and this one
/// stops, letting reconciles in flight finish (the two never act on one record at once: see
/// [`claims`]).
fn decisions_controller(
    client: &Client,
    namespace: &Option<String>,
    ctx: Arc<Context>,
    cfg: kube::runtime::controller::Config,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) -> impl std::future::Future<Output = ()> {
    let records = ctx.records.clone();
    let stop = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = records.wait_listed() => {}
        }
    }
    .shared();
    let (store, writer) = reflector::store();
    let decided = watcher(
        api_for::<DeadLetter>(client, namespace),
        watcher::Config::default().fields(DECIDED).any_semantic(),
    )
    .default_backoff()
    .inspect(|event| match event {
        // An operator newer than its CRDs meets this: the field selector needs `.spec.action`
        // among the CRD's selectableFields (the operator works on without it; waiting
        // decisions then wait for the full record list).
        Err(e) if e.to_string().contains("field label not supported") => {
            tracing::warn!(error = %e, selector = DECIDED, "the watch of decided records failed; is the CRD up to date (`.spec.action` selectable)?");
        }
        Err(e) => tracing::debug!(error = %e, "the watch of decided records failed; retrying"),
        Ok(_) => {}
    })
    .modify(cache::strip)
    .reflect(writer)
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let controller = Controller::for_stream(decided, store.clone())
        .with_config(cfg)
        .graceful_shutdown_on(stop.clone())
        .run(reconcile_until_listed, error_policy, ctx)
        .for_each(|_| futures::future::ready(()));
    until_stopped(controller, store, stop)
}

/// A decision, carried out here only until the full record cache has listed once.
async fn reconcile_until_listed(dl: Arc<DeadLetter>, ctx: Arc<Context>) -> Result<Action, Error> {
    if ctx.records_listed() {
        return Ok(Action::await_change());
    }
    tracing::debug!(name = %dl.name_any(), "carrying out a decision before the record cache has listed");
    deadletter::reconcile(dl, ctx).await
}

/// The DeadLetterReplay controller: woken when a replay appears or its spec changes (not by its
/// own status writes); a running replay paces itself with requeues.
fn replay_controller(
    client: &Client,
    namespace: &Option<String>,
    ctx: Arc<Context>,
    cfg: kube::runtime::controller::Config,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) -> impl std::future::Future<Output = ()> {
    let (store, writer) = reflector::store();
    let replays = watcher(
        api_for::<dlq_core::replay::DeadLetterReplay>(client, namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let controller = Controller::for_stream(replays, store.clone())
        .with_config(cfg)
        .graceful_shutdown_on(shutdown.clone())
        .run(
            replay::reconcile,
            |obj, err, replays: Arc<replay::Replays>| error_policy(obj, err, replays.ctx.clone()),
            Arc::new(replay::Replays::new(ctx)),
        )
        .for_each(|_| futures::future::ready(()));
    until_stopped(controller, store, shutdown)
}

/// The per-record alert sender, or nothing when alerts are off.
fn alert_sender(
    settings: &Settings,
    ctx: &Arc<Context>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> futures::future::BoxFuture<'static, ()> {
    use futures::FutureExt;
    match settings.alerts.clone() {
        Some(cfg) => crate::alert::run(
            cfg,
            ctx.records.clone(),
            ctx.queues.clone(),
            ctx.apiserver.clone(),
            ctx.metrics.clone(),
            shutdown,
        )
        .boxed(),
        None => futures::future::ready(()).boxed(),
    }
}

fn api_for<K>(client: &Client, namespace: &Option<String>) -> Api<K>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// How the record watch gets the records that exist when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitialState {
    /// One watch that streams them first (`sendInitialEvents`, the WatchList API): no paging
    /// round trips, so a restart with 20,000 records reconciled its first decision in 2.9 s
    /// instead of 4.7.
    Streamed,
    /// A paginated list (pages of 50: the initial list carries payloads, so the page size
    /// bounds the operator's peak memory at start-up), then a watch.
    Paged,
}

/// Streamed when the apiserver accepts a streaming watch, Paged otherwise. Asked rather than
/// read from the version: WatchList is on by default from 1.34 but was off in 1.33 (a 422),
/// and a cluster can turn it off. The probe selects no record, so it costs one short request.
async fn initial_state_for(api: &Api<DeadLetter>) -> InitialState {
    let probe = WatchParams::streaming_lists()
        .labels("dlq.dev/watch-list-probe=none")
        .timeout(5);
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        let mut events = api.watch(&probe, "0").await?.boxed();
        events.try_next().await
    })
    .await;
    let why_paged = match answer {
        Ok(Ok(Some(WatchEvent::Bookmark(_)))) => {
            tracing::info!(initial_state = ?InitialState::Streamed, "how the record cache starts");
            return InitialState::Streamed;
        }
        Ok(Ok(_)) => "the streaming watch answered without a bookmark".to_string(),
        Ok(Err(e)) => format!("the streaming watch was refused: {e}"),
        Err(_) => "the streaming watch probe timed out".to_string(),
    };
    tracing::info!(initial_state = ?InitialState::Paged, why = %why_paged, "how the record cache starts");
    InitialState::Paged
}

/// The record watch. Every event goes to the job index the sources park with, the record
/// index, and the feeder of the records controller, in that order.
fn watch_records(
    api: Api<DeadLetter>,
    initial: InitialState,
    jobs: jobs::JobIndex,
    records: index::RecordIndex,
    mut feeder: work::Feeder,
) -> impl std::future::Future<Output = ()> {
    let config = match initial {
        InitialState::Streamed => watcher::Config::default().streaming_lists(),
        InitialState::Paged => watcher::Config::default().any_semantic().page_size(50),
    };
    let events = watcher(api, config).default_backoff().map(Some);
    // Without any event, records whose marks keep failing still free their room in time.
    let ticks = futures::stream::unfold((), |()| async {
        tokio::time::sleep(work::MARK_STALE / 3).await;
        Some((None, ()))
    });
    let watch = futures::stream::select(events, ticks).for_each(move |event| {
        match event {
            Some(Ok(event)) => {
                jobs.observe(&event);
                records.observe(&event);
                feeder.observe(event);
            }
            Some(Err(_)) => {}
            None => feeder.fill(),
        }
        futures::future::ready(())
    });
    async move {
        // A test holds the full list back here to show decisions are carried out without it.
        crate::failpoint::hit("before-record-list").await;
        watch.await
    }
}

#[cfg(test)]
mod tests;
