//! Sources: drain a broker's dead messages into DeadLetter records, acknowledging each message
//! only after its record exists (ack after the side effect), so a crash never loses one.
//!
//! The supervisor keeps one task per DeadLetterQueue that has a `source`, driven by the
//! operator's queue store (no polling): it starts, restarts (source or target changed) and
//! stops them as queues change, and closes the targets of deleted queues. Aborting a source
//! mid-message is safe by construction: the message is still in the broker's in-flight area
//! and is re-parked (deduplicated) on the next start.

pub mod amqp;
pub mod backlog;
pub mod http;
pub mod in_flight;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nats;
pub mod park_into;
#[cfg(feature = "pubsub")]
pub mod pubsub;
pub mod reach;
pub mod redis;
pub mod sidekiq;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod taken;

/// Kept here too: the wiring (`crate::run`) names `source::Shared`.
pub use park_into::{ParkInto, ParkServices, Reports, Shared, SourceError, Tuning};

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;

use dlq_core::api::DeadLetterQueue;

use crate::broker::backend::{SourceBackend, Unserved};

/// How often the supervisor also checks for sources that ended by themselves.
const RESYNC: Duration = Duration::from_secs(30);

struct Running {
    fingerprint: u64,
    task: JoinHandle<()>,
}

/// Runs sources for every DeadLetterQueue with a `source` in `shared.queues`, following
/// `queue_changes`, until `stop` resolves. After each pass it awaits `close_deleted_targets`:
/// the wiring (`crate::run`) passes in the closing of the targets of deleted queues, so a
/// source never names a target.
pub async fn supervise<F>(
    shared: Shared,
    queue_changes: impl Stream<Item = Arc<DeadLetterQueue>> + Send,
    close_deleted_targets: impl Fn() -> F + Send,
    stop: impl std::future::Future<Output = ()> + Send,
) where
    F: std::future::Future<Output = ()> + Send,
{
    let queues = shared.queues().clone();
    let mut running: HashMap<(String, String), Running> = HashMap::new();
    let supervise = async {
        let mut changes = std::pin::pin!(queue_changes);
        let mut tick = tokio::time::interval(RESYNC);
        loop {
            tokio::select! {
                Some(_) = changes.next() => {}
                _ = tick.tick() => {}
            }
            if queues.wait_until_ready().await.is_err() {
                return;
            }
            sync(&shared, &mut running);
            close_deleted_targets().await;
        }
    };
    tokio::select! {
        _ = supervise => {}
        _ = stop => {}
    }
    for (_, r) in running.drain() {
        r.task.abort();
    }
}

/// The source and target as a fingerprint: either changing restarts the source, and so does
/// the body store's `maxBytes` (the Kafka source sizes its fetches by it).
fn fingerprint(q: &DeadLetterQueue) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    q.spec.bodies.as_ref().map(|b| b.max()).hash(&mut h);
    serde_json::to_string(&q.spec.source)
        .unwrap_or_default()
        .hash(&mut h);
    serde_json::to_string(&q.spec.target)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

fn sync(shared: &Shared, running: &mut HashMap<(String, String), Running>) {
    let wanted: HashMap<(String, String), (u64, Arc<DeadLetterQueue>)> = shared
        .queues()
        .state()
        .into_iter()
        .filter(|q| q.spec.source.is_some())
        .map(|q| {
            (
                (q.namespace().unwrap_or_default(), q.name_any()),
                (fingerprint(&q), q),
            )
        })
        .collect();
    running.retain(|key, r| {
        let keep =
            wanted.get(key).is_some_and(|(f, _)| *f == r.fingerprint) && !r.task.is_finished();
        if !keep {
            tracing::info!(namespace = %key.0, queue = %key.1, "stopping source");
            r.task.abort();
        }
        keep
    });
    for (key, (fingerprint, queue)) in wanted {
        if running.contains_key(&key) {
            continue;
        }
        let into = ParkInto {
            shared: shared.clone(),
            key: ObjectRef::new(&key.1).within(&key.0),
        };
        if let Some(task) = start(shared.client(), into, &queue) {
            running.insert(key, Running { fingerprint, task });
        }
    }
}

/// Starts the source `queue` names, with its backlog sampler beside it in the same task
/// (aborted together; a source that ends ends its sampler).
fn start(client: &Client, into: ParkInto, queue: &DeadLetterQueue) -> Option<JoinHandle<()>> {
    let source = queue.spec.source.clone()?;
    let (ns, name) = (into.namespace().to_string(), into.queue().to_string());
    let sampler = backlog::sample(client.clone(), into.clone(), queue.clone(), source.clone());
    let spawn = move |run: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>| {
        tokio::spawn(async move {
            tokio::select! {
                _ = run => {}
                _ = sampler => {}
            }
        })
    };
    let (queue, client) = (queue.clone(), client.clone());
    let backend = match SourceBackend::of(&source) {
        Ok(backend) => backend,
        Err(Unserved::NotBuilt(backend)) => return Some(spawn(Box::pin(not_built(into, backend)))),
        Err(Unserved::Unnamed) => return None,
    };
    let run: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = match backend {
        SourceBackend::Redis(src) => {
            tracing::info!(namespace = %ns, queue = %name, list = %src.list, "starting redis source");
            Box::pin(redis::run(client, into, queue, src.clone()))
        }
        SourceBackend::Amqp(src) => {
            tracing::info!(namespace = %ns, queue = %name, amqp_queue = %src.queue, "starting amqp source");
            Box::pin(amqp::run(client, into, queue, src.clone()))
        }
        SourceBackend::Nats(src) => {
            tracing::info!(namespace = %ns, queue = %name, stream = %src.stream, consumer = %src.consumer, "starting nats source");
            Box::pin(nats::run(client, into, queue, src.clone()))
        }
        #[cfg(feature = "sqs")]
        SourceBackend::Sqs(src) => {
            tracing::info!(namespace = %ns, queue = %name, sqs_queue = %crate::broker::redact_url(&src.queue_url), "starting sqs source");
            Box::pin(sqs::run(client, into, queue, src.clone()))
        }
        SourceBackend::Sidekiq(src) => {
            tracing::info!(namespace = %ns, queue = %name, sidekiq_namespace = src.namespace.as_deref().unwrap_or(""), "starting sidekiq source");
            Box::pin(sidekiq::run(client, into, queue, src.clone()))
        }
        #[cfg(feature = "kafka")]
        SourceBackend::Kafka(src) => {
            tracing::info!(namespace = %ns, queue = %name, topics = ?src.topics, "starting kafka source");
            Box::pin(kafka::run(client, into, queue, src.clone()))
        }
        #[cfg(feature = "pubsub")]
        SourceBackend::Pubsub(src) => {
            tracing::info!(namespace = %ns, queue = %name, subscription = %src.subscription, "starting pubsub source");
            Box::pin(pubsub::run(client, into, queue, src.clone()))
        }
    };
    Some(spawn(run))
}

/// The source of a backend this build left out (cargo feature `kafka`, `sqs` or `pubsub`): says so once,
/// as an error log and a Warning Event on the queue, and then waits (a task that ended would be
/// restarted, and would say it again, at every resync).
async fn not_built(into: ParkInto, backend: &'static str) {
    use dlq_core::events::{self, EventPlan};
    let why = crate::broker::not_built(backend);
    tracing::error!(namespace = %into.namespace(), queue = %into.queue(), source = backend, "{why}");
    let note = format!("source.{backend}: {why}");
    let event = EventPlan::warning(
        events::reason::BACKEND_NOT_BUILT,
        events::action::PARK,
        note,
    );
    into.tell(&event).await;
    std::future::pending::<()>().await
}
