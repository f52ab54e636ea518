//! Source bridges: drain a broker's dead messages into DeadLetter records, acknowledging each
//! message only after its record exists (ack after the side effect), so a crash never loses one.
//!
//! A supervisor keeps one bridge task per DeadLetterQueue that has a `source`, restarting it when
//! the source changes. Aborting a bridge mid-message is safe by construction: the message is still
//! in the broker's in-flight area and is re-parked (deduplicated) on the next start.

pub mod amqp;
pub mod nats;
pub mod redis;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use kube::{Api, Client, ResourceExt};
use tokio::task::JoinHandle;

use crate::api::DeadLetterQueue;
use crate::park::Parker;

/// How often the supervisor looks for new, changed or removed sources.
const RESYNC: Duration = Duration::from_secs(5);

struct Running {
    fingerprint: u64,
    task: JoinHandle<()>,
}

/// Runs bridges for every DeadLetterQueue with a `source` in `namespace` (all when None) until
/// `stop` resolves.
pub async fn supervise(
    client: Client,
    namespace: Option<String>,
    parker: Parker,
    stop: impl std::future::Future<Output = ()> + Send,
) {
    let api: Api<DeadLetterQueue> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut running: HashMap<(String, String), Running> = HashMap::new();
    let supervise = async {
        loop {
            match api.list(&Default::default()).await {
                Ok(list) => reconcile(&client, &parker, list.items, &mut running),
                Err(e) => tracing::warn!(error = %e, "listing DeadLetterQueues for bridges failed"),
            }
            tokio::time::sleep(RESYNC).await;
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

fn reconcile(
    client: &Client,
    parker: &Parker,
    queues: Vec<DeadLetterQueue>,
    running: &mut HashMap<(String, String), Running>,
) {
    let mut wanted = HashMap::new();
    for q in queues {
        let Some(source) = q.spec.source.clone() else {
            continue;
        };
        let key = (q.namespace().unwrap_or_default(), q.name_any());
        let fingerprint = {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            serde_json::to_string(&source)
                .unwrap_or_default()
                .hash(&mut h);
            serde_json::to_string(&q.spec.target)
                .unwrap_or_default()
                .hash(&mut h);
            h.finish()
        };
        wanted.insert(key, (fingerprint, q));
    }
    running.retain(|key, r| {
        let keep =
            wanted.get(key).is_some_and(|(f, _)| *f == r.fingerprint) && !r.task.is_finished();
        if !keep {
            tracing::info!(namespace = %key.0, queue = %key.1, "stopping source bridge");
            r.task.abort();
        }
        keep
    });
    for (key, (fingerprint, queue)) in wanted {
        if running.contains_key(&key) {
            continue;
        }
        let Some(source) = queue.spec.source.clone() else {
            continue;
        };
        let task = if let Some(src) = source.redis {
            tracing::info!(namespace = %key.0, queue = %key.1, list = %src.list, "starting redis source bridge");
            tokio::spawn(redis::run(client.clone(), parker.clone(), queue, src))
        } else if let Some(src) = source.amqp {
            tracing::info!(namespace = %key.0, queue = %key.1, amqp_queue = %src.queue, "starting amqp source bridge");
            tokio::spawn(amqp::run(client.clone(), parker.clone(), queue, src))
        } else if let Some(src) = source.nats {
            tracing::info!(namespace = %key.0, queue = %key.1, stream = %src.stream, consumer = %src.consumer, "starting nats source bridge");
            tokio::spawn(nats::run(client.clone(), parker.clone(), queue, src))
        } else {
            continue;
        };
        running.insert(key, Running { fingerprint, task });
    }
}

/// Runs one bridge's `once` again and again: after it ends or fails, waits with capped
/// exponential backoff (reset once a run lasted a minute), so a broker outage is retried
/// without hammering it.
pub(crate) async fn keep_running<F, Fut>(kind: &str, ns: &str, queue: &str, mut once: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut attempt = 0u32;
    loop {
        let started = std::time::Instant::now();
        let result = once().await;
        if started.elapsed() > Duration::from_secs(60) {
            attempt = 0;
        }
        attempt = attempt.saturating_add(1);
        let wait = crate::decide::backoff(attempt, Duration::from_secs(30));
        match result {
            Ok(()) => {
                tracing::info!(namespace = ns, queue, source = kind, retry_in = ?wait, "source bridge ended; restarting")
            }
            Err(e) => {
                tracing::warn!(namespace = ns, queue, source = kind, error = %e, retry_in = ?wait, "source bridge failed")
            }
        }
        tokio::time::sleep(wait).await;
    }
}
