//! The I/O shells around [`crate::decide`]: a DeadLetter reconciler (redrive/drop) and a
//! DeadLetterQueue reconciler (counters, readiness, retention), sharing one watch of records
//! whose payloads are stripped before they are cached.

pub mod deadletter;
pub mod queue;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::Mutex;

use crate::api::{DeadLetter, DeadLetterQueue};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::targets::TargetCache;

/// Field manager of every status write the operator makes.
pub const MANAGER: &str = "deadletter-operator";

/// Tunables of the reconcilers.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Longest wait between requeue attempts while a broker is down.
    pub backoff_cap: Duration,
    /// How often queues refresh counters, readiness and retention without a trigger.
    pub queue_resync: Duration,
    /// Concurrent reconciles per controller.
    pub concurrency: u16,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backoff_cap: Duration::from_secs(60),
            queue_resync: Duration::from_secs(30),
            concurrency: 32,
        }
    }
}

/// Shared by both reconcilers.
pub struct Context {
    pub client: Client,
    pub metrics: Metrics,
    pub recorder: Recorder,
    reporter: Reporter,
    pub targets: TargetCache,
    pub settings: Settings,
    /// Records (payload-free) as the shared watch sees them.
    pub records: Store<DeadLetter>,
    /// Consecutive requeue failures per record uid, for backoff.
    attempts: Mutex<HashMap<String, u32>>,
    /// Record uids this process already enqueued whose resolution is not yet written: a retry
    /// after a failed status write must not enqueue a second time.
    enqueued: Mutex<HashSet<String>>,
    /// DeadLetterQueues read in the last [`QUEUE_TTL`]: a bulk replay would otherwise read the
    /// same queue once per record.
    queues: Mutex<HashMap<(String, String), (std::time::Instant, DeadLetterQueue)>>,
}

/// How long a DeadLetterQueue read for a redrive is reused.
const QUEUE_TTL: Duration = Duration::from_secs(2);

impl Context {
    pub async fn publish(&self, obj: &impl Resource<DynamicType = ()>, ev: Event) {
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::warn!(error = %e, reason = %ev.reason, "publishing event failed");
        }
    }

    /// Publishes an Event that never repeats for its object (one `Parked` per record) straight
    /// to the API: the recorder keeps every event it sent for minutes to aggregate repeats,
    /// which for a parking storm of 10,000 records is most of the operator's memory.
    pub async fn publish_once(&self, obj: &impl Resource<DynamicType = ()>, ev: Event) {
        let reference = obj.object_ref(&());
        let ns = reference.namespace.clone().unwrap_or_default();
        let now = jiff::Timestamp::now();
        let event = k8s_openapi::api::events::v1::Event {
            metadata: kube::api::ObjectMeta {
                // As the recorder names them: the object's name and the time, unique enough.
                name: Some(format!(
                    "{}.{:x}",
                    reference.name.clone().unwrap_or_default(),
                    now.as_nanosecond()
                )),
                namespace: Some(ns.clone()),
                ..Default::default()
            },
            event_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                now,
            )),
            type_: Some(match ev.type_ {
                EventType::Normal => "Normal".into(),
                EventType::Warning => "Warning".into(),
            }),
            reason: Some(ev.reason.clone()),
            action: Some(ev.action.clone()),
            note: ev.note.clone(),
            regarding: Some(reference),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..Default::default()
        };
        let api: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = api.create(&kube::api::PostParams::default(), &event).await {
            tracing::warn!(error = %e, reason = %ev.reason, "publishing event failed");
        }
    }

    /// The DeadLetterQueue `name` in `ns` (None when it does not exist), read at most once per
    /// [`QUEUE_TTL`]. A missing queue is not remembered, so creating it takes effect at once.
    pub async fn queue(
        &self,
        ns: &str,
        name: &str,
    ) -> Result<Option<DeadLetterQueue>, kube::Error> {
        let key = (ns.to_string(), name.to_string());
        if let Some((at, q)) = self.queues.lock().await.get(&key)
            && at.elapsed() < QUEUE_TTL
        {
            return Ok(Some(q.clone()));
        }
        let api: Api<DeadLetterQueue> = Api::namespaced(self.client.clone(), ns);
        let found = api.get_opt(name).await?;
        if let Some(q) = &found {
            self.queues
                .lock()
                .await
                .insert(key, (std::time::Instant::now(), q.clone()));
        }
        Ok(found)
    }

    async fn note_failure(&self, uid: &str) -> u32 {
        let mut map = self.attempts.lock().await;
        let n = map.entry(uid.to_string()).or_default();
        *n = n.saturating_add(1);
        *n
    }

    async fn clear_failures(&self, uid: &str) {
        self.attempts.lock().await.remove(uid);
    }
}

pub(crate) fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(crate::conditions::truncate(&note, 1024)),
        action: action.into(),
        secondary: None,
    }
}

/// Payloads up to this size stay in the cache, so redriving a small job needs no extra read;
/// memory stays bounded at about this much per record.
pub const CACHED_PAYLOAD_MAX: usize = 1024;

/// Drops what the reconcilers never read from a cached record: a payload over
/// [`CACHED_PAYLOAD_MAX`] (up to 256 KiB per record; read when acting), managed fields, and
/// kubectl's last-applied copy (which would hold the payload again).
pub fn strip(dl: &mut DeadLetter) {
    let size = dl.spec.job.payload.as_ref().map_or(0, String::len)
        + dl.spec
            .job
            .payload_base64
            .as_ref()
            .map_or(0, |b| b.len() / 4 * 3);
    if size > CACHED_PAYLOAD_MAX {
        dl.spec.job.payload = None;
        dl.spec.job.payload_base64 = None;
    }
    dl.managed_fields_mut().clear();
    dl.annotations_mut()
        .remove("kubectl.kubernetes.io/last-applied-configuration");
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

/// Runs both controllers over `namespace` (all namespaces when None) until `shutdown` resolves.
pub async fn run_scope(
    client: Client,
    namespace: Option<String>,
    metrics: Metrics,
    reporter: Reporter,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let (dl_api, dlq_api): (Api<DeadLetter>, Api<DeadLetterQueue>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let (records, writer) = reflector::store_shared(1024);
    let Some(subscriber) = writer.subscribe() else {
        tracing::error!("cannot subscribe to the record store");
        return;
    };
    // Small pages: the initial list carries payloads (stripped right after), so the page size
    // bounds the operator's peak memory at start-up.
    let root = watcher(
        dl_api.clone(),
        watcher::Config::default().any_semantic().page_size(50),
    )
    .default_backoff()
    .modify(strip)
    .reflect_shared(writer)
    .for_each(|_| futures::future::ready(()));

    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter.clone()),
        reporter,
        targets: TargetCache::new(client.clone()),
        client: client.clone(),
        metrics,
        settings: settings.clone(),
        records: records.clone(),
        attempts: Mutex::default(),
        enqueued: Mutex::default(),
        queues: Mutex::default(),
    });
    let cfg = kube::runtime::controller::Config::default().concurrency(settings.concurrency);

    // Records wake their reconciler when first seen and when a human changes the spec (the
    // generation), not on status writes: our own condition writes would otherwise defeat the
    // requeue backoff, and another replica's resolution leaves nothing to do.
    let mut generations: HashMap<String, Option<i64>> = HashMap::new();
    let spec_changes = subscriber.clone().filter(move |dl| {
        let uid = dl.uid().unwrap_or_default();
        let changed =
            generations.insert(uid, dl.metadata.generation) != Some(dl.metadata.generation);
        futures::future::ready(changed)
    });
    let records_ctl = Controller::for_shared_stream(spec_changes, records.clone())
        .with_config(cfg.clone())
        .graceful_shutdown_on(shutdown.clone())
        .run(deadletter::reconcile, error_policy, ctx.clone())
        .for_each(|_| futures::future::ready(()));

    let bridges = crate::bridge::supervise(
        client.clone(),
        namespace.clone(),
        crate::park::Parker::new(client.clone()),
        shutdown.clone(),
    );

    let queues_ctl = Controller::new(dlq_api, watcher::Config::default())
        .with_config(cfg.debounce(Duration::from_millis(500)))
        .watches_shared_stream(subscriber, |dl: Arc<DeadLetter>| {
            let ns = dl.namespace()?;
            Some(ObjectRef::<DeadLetterQueue>::new(&dl.spec.queue).within(&ns))
        })
        .graceful_shutdown_on(shutdown)
        .run(queue::reconcile, error_policy, ctx)
        .for_each(|_| futures::future::ready(()));

    tokio::select! {
        _ = root => {}
        // Both controllers end after `shutdown`, once in-flight reconciles finished.
        _ = async { tokio::join!(records_ctl, queues_ctl, bridges) } => {}
    }
}
