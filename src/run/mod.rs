//! The process wiring: what one scope of the operator runs (a namespace, or all of them). The
//! record watch feeds the job index, the record index and the [`feeder`]; a reflector each
//! for queues and replays; the records, decisions, queues and replays controllers (their
//! bodies are [`crate::reconcile`]); the sources ([`crate::source`]) and the alert sender
//! ([`crate::alert`]). Everything below this module is started from here and nothing below
//! reaches back up.

pub mod bodies;
pub mod decided;
pub mod endpoints;
pub mod feeder;
pub mod held;
pub mod lease;
pub mod relist;
pub mod shutdown;
pub mod start;
pub mod wakes;

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt, TryStreamExt};
use kube::api::{WatchEvent, WatchParams};
use kube::runtime::controller::{Action, Config, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::predicates;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use dlq_core::api::DeadLetter;
use k8s_openapi::api::core::v1::ResourceQuota;

use crate::alert::Alerting;
use crate::metrics::Metrics;
use crate::pass::Standing;
use crate::reconcile::{
    self, Context, Settings, aggregate, error_policy, record::RecordError as Error,
};
use crate::source;
use crate::state::apiserver::{Apiserver, KubeApiserver};
use crate::state::jobs::JobIndex;
use crate::state::records::RecordIndex;
use crate::targets::cache::TargetCache;

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

/// What every scope of the process shares.
#[derive(Clone)]
pub struct Process {
    pub client: Client,
    /// For the record watches: without kube's retry of 503s (see `start::watch_client`).
    pub watch_client: Client,
    pub metrics: Metrics,
    /// Who the Events say they come from.
    pub reporter: Reporter,
    pub settings: Settings,
    /// Per-record Alertmanager alerts; None when no Alertmanager is configured.
    pub alerts: Option<Arc<Alerting>>,
    /// The HTTP park endpoint, which parks through each scope while it runs; None when not
    /// served.
    pub park_endpoint: Option<crate::source::http::ParkEndpoint>,
    /// How often decided records are re-listed, and how long one may go unattempted.
    pub vigil: decided::Vigil,
    /// Raised when this leader stalls on decided records; None: it only logs and says so.
    pub stall_alarm: Option<decided::StallAlarm>,
    /// The operator's `--max-records` across every scope; None without one.
    pub ceiling: Option<crate::state::ceiling::Ceiling>,
    /// The sources' tunables.
    pub sources: source::Tuning,
    /// How often the leader sweeps the body stores ([`bodies`]).
    pub sweep_every: Duration,
}

/// Runs the controllers, the sources and the alert sender over `namespace` (all namespaces
/// when None) until `shutdown` resolves.
pub async fn run_scope(
    process: Process,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let Process {
        client,
        watch_client,
        metrics,
        reporter,
        settings,
        alerts,
        park_endpoint,
        vigil,
        stall_alarm,
        ceiling,
        sources,
        sweep_every,
    } = process;
    let records = RecordIndex::default();
    if let Some(c) = &ceiling {
        c.register(records.clone());
    }
    // The records controller's store: only records with something to do (see [`feeder`]).
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
    let jobs = JobIndex::default();
    let initial = initial_state_for(&api_for(&client, &namespace)).await;
    let group_wakes = queue_wakes.clone();
    let bound_wakes = queue_wakes.clone();
    let mut feeder = feeder::Feeder::new(work_writer, records.clone(), record_wakes, queue_wakes);
    if !settings.mechanisms.mark_quota {
        feeder = feeder.without_mark_quota();
    }
    let (relisted, decided_relists) = futures::channel::mpsc::unbounded();
    let record_watch = watch_records(
        api_for(&watch_client, &namespace),
        initial,
        jobs.clone(),
        records.clone(),
        feeder,
        decided_relists,
    );
    let queue_watch = watcher(
        api_for(&client, &namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect_shared(queue_writer)
    .for_each(|_| futures::future::ready(()));

    let (group_store, group_writer) = reflector::store();
    let group_watch = watcher(
        api_for::<dlq_core::groups::DeadLetterGroup>(&client, &namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(group_writer)
    .applied_objects()
    // A new acknowledgement (a spec change) is judged at once, not at the next resync.
    .predicate_filter(predicates::generation, Default::default())
    .for_each(move |group| {
        if let Ok(g) = group
            && let (Some(ns), Some(queue)) =
                (g.namespace(), g.labels().get(dlq_core::api::LABEL_QUEUE))
        {
            let _ = group_wakes.unbounded_send(reflector::ObjectRef::new(queue).within(&ns));
        }
        futures::future::ready(())
    });
    let targets = Arc::new(TargetCache::new(client.clone()));
    // The standing replays running here: covered by the replay controller, offered every dead
    // message by the sources, passing what they cover straight to the targets.
    let standing = Standing::new(targets.clone());
    let apiserver: Arc<dyn Apiserver> = Arc::new(KubeApiserver::new(client.clone(), reporter));
    let mut ctx = Context::new(
        apiserver.clone(),
        targets.clone(),
        records.clone(),
        queues.clone(),
        metrics,
        settings.clone(),
    );
    let (replay_store, replay_writer) = reflector::store();
    ctx = ctx
        .with_group_store(group_store)
        .with_replay_store(replay_store.clone())
        .with_keys(Arc::new(crate::keys::SecretKeys::new(client.clone())))
        .with_bodies(Arc::new(crate::body::cache::BodyCache::new(client.clone())))
        .with_jobs(jobs.clone());
    if settings.mechanisms.aggregation {
        ctx = ctx.with_aggregator(aggregate::Aggregator::spawn(apiserver));
    }
    let (quota_store, quota_writer) = reflector::store();
    ctx = ctx.with_quotas(quota_store);
    if let Some(c) = &ceiling {
        ctx = ctx.with_ceiling(c.clone());
    }
    let bounds_watch = watch_bounds(
        api_for(&client, &namespace),
        quota_writer,
        queues.clone(),
        ceiling.clone(),
        bound_wakes,
    );
    let ctx = Arc::new(ctx);
    let alerts = alert_sender(alerts, &ctx, shutdown.clone());
    let cfg = Config::default().concurrency(settings.concurrency);
    let records_ctl = until_stopped(
        // Woken by bare references from the feeder, for the records it holds.
        Controller::for_shared_stream(futures::stream::pending(), work.clone())
            .reconcile_on(woken_records)
            .with_config(cfg.clone())
            .graceful_shutdown_on(shutdown.clone())
            .run(reconcile::record::reconcile, error_policy, ctx.clone())
            .for_each(|_| futures::future::ready(())),
        work,
        shutdown.clone(),
    );
    let client_for_replays = client.clone();
    let mut parker = dlq_client::park::Parker::with_options(
        client.clone(),
        dlq_client::park::ParkOptions {
            ask_ahead: settings.mechanisms.ask_ahead,
        },
    );
    if let Some(c) = &ceiling {
        parker = parker.with_ceiling(c.ledger().clone());
    }
    let parking = source::ParkServices {
        parker,
        queues: queues.clone(),
        jobs,
        leadership: settings.leadership.clone(),
        parking_first: ctx.parking_first.clone(),
    };
    let reports = source::Reports {
        apiserver: ctx.apiserver.clone(),
        metrics: ctx.metrics.clone(),
    };
    let shared = source::Shared::new(client, parking, reports, Arc::new(standing.clone()))
        .with_bodies(ctx.redrive.bodies.clone())
        .with_tuning(sources);
    let sweep = bodies::sweep(
        queues.clone(),
        ctx.records.clone(),
        ctx.redrive.bodies.clone(),
        settings.leadership.clone(),
        sweep_every,
    );
    // Parks over HTTP while this scope runs.
    let _registration = park_endpoint.map(|e| e.register(namespace.clone(), shared.clone()));
    let close_deleted_targets = {
        let queues = queues.clone();
        move || {
            let (targets, queues) = (targets.clone(), queues.clone());
            async move { targets.prune(&queues).await }
        }
    };
    let sources = source::supervise(
        shared,
        queue_changes,
        close_deleted_targets,
        shutdown.clone(),
    );
    // A queue's own changes and its records' wakes, coalesced per queue (see [`wakes`]): not
    // kube's debounce, which a storm's steady wakes re-arm until they stop.
    let queue_triggers = futures::stream::select(
        woken_queues,
        queue_events.map(|q| reflector::ObjectRef::from_obj(q.as_ref())),
    );
    let queues_ctl = Controller::for_shared_stream(futures::stream::pending(), queues.clone())
        .with_config(cfg.clone())
        .reconcile_on(wakes::coalesced(queue_triggers, wakes::COALESCE))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile::queue::reconcile, error_policy, ctx.clone())
        .for_each(|_| futures::future::ready(()));
    let queues_ctl = until_stopped(queues_ctl, queues, shutdown.clone());
    let decisions_ctl = decisions_controller(
        &watch_client,
        &namespace,
        ctx.clone(),
        cfg.clone(),
        shutdown.clone(),
    );
    let replays_ctl = replay_controller(
        (replay_store, replay_writer),
        &client_for_replays,
        &namespace,
        reconcile::replay::Replays::new(ctx.clone(), standing),
        cfg,
        shutdown.clone(),
    );
    let watch = decided::keep_watch(
        api_for(&client_for_replays, &namespace),
        ctx.clone(),
        relisted,
        vigil,
        stall_alarm,
    );
    // A stalled leader stops (the alarm ends `shutdown`); a reconcile that hangs would hold
    // the controllers' graceful shutdown for ever, so it gets STEP_DOWN_GRACE and is dropped
    // (at worst one more delivery of a job it was enqueueing, as after a crash).
    let stalled = async move {
        watch.await;
        tokio::time::sleep(STEP_DOWN_GRACE).await;
        tracing::warn!("reconciles still running after the step-down grace; dropping them");
    };

    tokio::select! {
        _ = record_watch => {}
        _ = queue_watch => {}
        _ = group_watch => {}
        _ = bounds_watch => {}
        // The controllers end after `shutdown`, once in-flight reconciles finished (the
        // decisions controller already once the full record list has arrived).
        _ = async { tokio::join!(records_ctl, decisions_ctl, queues_ctl, sources, alerts, replays_ctl) } => {}
        _ = stalled => {}
        _ = sweep => {}
    }
    // Stopping (shutdown, or the Lease lost while the apiserver was away): write the
    // resolutions of jobs already enqueued, else the next leader enqueues them again.
    reconcile::record::flush_confirmed(&ctx, reconcile::record::FLUSH_WINDOW).await;
}

/// How long a leader that stalled on decided records lets running reconciles finish.
pub const STEP_DOWN_GRACE: Duration = Duration::from_secs(10);

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
    cfg: Config,
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
        watcher::Config::default()
            .fields(decided::DECIDED)
            .any_semantic(),
    );
    let decided = relist::backoff_unless_expired(decided)
    .inspect(|event| match event {
        // An operator newer than its CRDs meets this: the field selector needs `.spec.action`
        // among the CRD's selectableFields (the operator works on without it; waiting
        // decisions then wait for the full record list).
        Err(e) if e.to_string().contains("field label not supported") => {
            tracing::warn!(error = %e, selector = decided::DECIDED, "the watch of decided records failed; is the CRD up to date (`.spec.action` selectable)?");
        }
        Err(e) => tracing::debug!(error = %e, "the watch of decided records failed; retrying"),
        Ok(_) => {}
    })
    .modify(held::strip)
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
    reconcile::record::reconcile(dl, ctx).await
}

/// The DeadLetterReplay controller: woken when a replay appears or its spec changes (not by its
/// own status writes); a running replay paces itself with requeues.
fn replay_controller(
    (store, writer): (
        reflector::Store<dlq_core::replay::DeadLetterReplay>,
        reflector::store::Writer<dlq_core::replay::DeadLetterReplay>,
    ),
    client: &Client,
    namespace: &Option<String>,
    replays: reconcile::replay::Replays,
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) -> impl std::future::Future<Output = ()> {
    let changes = watcher(
        api_for::<dlq_core::replay::DeadLetterReplay>(client, namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let controller = Controller::for_stream(changes, store.clone())
        .with_config(cfg)
        .graceful_shutdown_on(shutdown.clone())
        .run(
            reconcile::replay::reconcile,
            |obj, err, replays: Arc<reconcile::replay::Replays>| {
                error_policy(obj, err, replays.ctx.clone())
            },
            Arc::new(replays),
        )
        .for_each(|_| futures::future::ready(()));
    until_stopped(controller, store, shutdown)
}

/// The per-record alert sender, or nothing when alerts are off.
fn alert_sender(
    alerts: Option<Arc<Alerting>>,
    ctx: &Arc<Context>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> futures::future::BoxFuture<'static, ()> {
    use futures::FutureExt;
    match alerts {
        Some(cfg) => crate::alert::run(
            cfg,
            ctx.records.clone(),
            ctx.views.queues.clone(),
            ctx.views.groups.clone(),
            ctx.apiserver.clone(),
            ctx.metrics.clone(),
            shutdown,
        )
        .boxed(),
        None => futures::future::ready(()).boxed(),
    }
}

/// Wakes the queues whose `Full` condition may change with a bound beside `maxParked`: those of
/// a namespace whose ResourceQuota on records changed (kept in `quotas` for the queue
/// reconciler), and every queue when the operator's ceiling is reached or left.
fn watch_bounds(
    api: Api<ResourceQuota>,
    quotas: reflector::store::Writer<ResourceQuota>,
    queues: Store<dlq_core::api::DeadLetterQueue>,
    ceiling: Option<crate::state::ceiling::Ceiling>,
    wakes: futures::channel::mpsc::UnboundedSender<
        reflector::ObjectRef<dlq_core::api::DeadLetterQueue>,
    >,
) -> impl std::future::Future<Output = ()> {
    let wake = move |ns: Option<&str>| {
        for q in queues.state() {
            if ns.is_none() || q.metadata.namespace.as_deref() == ns {
                let _ = wakes.unbounded_send(reflector::ObjectRef::from_obj(q.as_ref()));
            }
        }
    };
    let wake_for_quota = wake.clone();
    let quota_watch = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .reflect(quotas)
        .inspect_err(|e| {
            tracing::warn!(error = %e, "watching ResourceQuotas failed (queues cannot name a quota on their records); retrying")
        })
        .touched_objects()
        .for_each(move |quota| {
            if let Ok(q) = quota
                && reconcile::context::quota_use(&q).is_some()
            {
                wake_for_quota(q.metadata.namespace.as_deref());
            }
            futures::future::ready(())
        });
    let ceiling_watch = async move {
        let Some(ceiling) = ceiling else {
            return std::future::pending::<()>().await;
        };
        let limit = ceiling.ledger().limit;
        let mut counts = ceiling.subscribe();
        let mut reached = false;
        while counts.changed().await.is_ok() {
            let now = counts.borrow_and_update().is_some_and(|held| held >= limit);
            if now != reached {
                wake(None);
            }
            reached = now;
        }
        std::future::pending::<()>().await
    };
    async move {
        tokio::join!(quota_watch, ceiling_watch);
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
    jobs: JobIndex,
    records: RecordIndex,
    mut feeder: feeder::Feeder,
    relisted: futures::channel::mpsc::UnboundedReceiver<Vec<decided::Listed>>,
) -> impl std::future::Future<Output = ()> {
    /// What the feeder is given, one at a time (a watch event boxed: a whole record, the
    /// other two are small).
    enum Input {
        Watch(Box<Result<watcher::Event<DeadLetter>, watcher::Error>>),
        Tick,
        Relisted(Vec<decided::Listed>),
    }
    let config = match initial {
        InitialState::Streamed => watcher::Config::default().streaming_lists(),
        InitialState::Paged => watcher::Config::default().any_semantic().page_size(50),
    };
    // An apiserver restart expires the watch: it re-lists at once (see [`relist`]).
    let events =
        relist::backoff_unless_expired(watcher(api, config)).map(|e| Input::Watch(Box::new(e)));
    // Without any event, records whose marks keep failing still free their room in time.
    let ticks = futures::stream::unfold((), |()| async {
        tokio::time::sleep(feeder::MARK_STALE / 3).await;
        Some((Input::Tick, ()))
    });
    let inputs = futures::stream::select(
        futures::stream::select(events, ticks),
        relisted.map(Input::Relisted),
    );
    let watch = inputs.for_each(move |input| {
        match input {
            Input::Watch(event) => match *event {
                Ok(event) => {
                    jobs.observe(&event);
                    records.observe(&event);
                    feeder.observe(event);
                }
                Err(e) => tracing::debug!(error = %e, "the record watch failed; retrying"),
            },
            Input::Tick => feeder.fill(),
            Input::Relisted(decided) => feeder.resync(decided),
        }
        futures::future::ready(())
    });
    async move {
        // A test holds the full list back here to show decisions are carried out without it.
        crate::failpoint::hit("before-record-list").await;
        watch.await
    }
}
