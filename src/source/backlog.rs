//! What still waits in a source's broker beyond the records (`status.backlog` of a
//! DeadLetterQueue), and what the HTTP park endpoint refused (`status.http`).
//!
//! A sampler runs beside each source (started with it by the supervisor, stopped with it) and
//! asks the broker every [`SAMPLE_EVERY`] how many dead messages it holds, on a connection of
//! its own; the answers go to one process-wide registry ([`BACKLOGS`]: the park endpoint, which
//! counts its 429s there, spans every scope). One writer ([`write_backlogs`], started by `run`
//! once this replica leads) merge-patches `status.backlog` and `status.http` only: when the
//! number changed, else at most every [`REFRESH`], never once per message. The queue reconciler
//! merge-patches its own fields (`write_queue_status` sends neither of these), so the two never
//! overwrite each other. A broker that stops answering keeps its last number and its old
//! `observedAt`: never a made-up 0.

use std::collections::HashMap;
#[cfg(feature = "kafka")]
use std::sync::Arc;
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use dlq_core::api::{DeadLetterQueue, SourceSpec};

use super::park_into::{ParkInto, SourceError};
use crate::broker::BrokerError;
use crate::broker::backend::{Sides, SourceBackend, source_url};
use crate::broker::redis::{Counted, RedisConn};
use crate::secret::SecretReads;
use crate::state::apiserver::MANAGER;

/// How often a sampler asks its broker.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How often an unchanged backlog is written again (a fresh `observedAt`).
pub const REFRESH: Duration = Duration::from_secs(10);
/// How often the writer looks at the registry.
const WRITE_TICK: Duration = Duration::from_secs(1);
/// How long one broker question may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// A queue, as the registry keys it: (namespace, name).
type QueueKey = (String, String);

/// The process's samples and refusals, by queue.
pub static BACKLOGS: LazyLock<Backlogs> = LazyLock::new(Backlogs::default);

/// One broker answer: how many (None: the broker cannot say), and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub messages: Option<i64>,
    pub at: Timestamp,
}

/// The registry: the latest sample of each running source, and the park endpoint's refusals.
#[derive(Default)]
pub struct Backlogs {
    queues: Mutex<HashMap<QueueKey, Entry>>,
}

#[derive(Default)]
struct Entry {
    /// The running sampler's latest answer (None before its first, and once it stopped).
    sample: Option<Sample>,
    /// Which sampler runs for the queue: a restarted source's new one may register before
    /// the old one is dropped, whose drop must not clear the new one's answers.
    sampler: u64,
    /// Messages the source holds delivered and unacknowledged, where the broker's count leaves
    /// them out (RabbitMQ's ready count): waiting for a slot while the queue is Full.
    in_hand: i64,
    refusals: Refusals,
}

/// Numbers the samplers.
static SAMPLERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Refusals per second over the last minute: a ring of (second, count).
struct Refusals {
    ring: [(i64, i64); 60],
    /// Whether there was ever one (else `status.http` is not written).
    any: bool,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals {
            ring: [(i64::MIN, 0); 60],
            any: false,
        }
    }
}

impl Refusals {
    fn add(&mut self, second: i64) {
        let slot = &mut self.ring[second.rem_euclid(60) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 += 1;
        self.any = true;
    }

    fn last_minute(&self, now: i64) -> i64 {
        self.ring
            .iter()
            .filter(|(s, _)| *s <= now && now.saturating_sub(*s) < 60)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Backlogs {
    fn lock(&self) -> MutexGuard<'_, HashMap<QueueKey, Entry>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts sampling a queue; its samples stop counting when the returned guard drops.
    pub fn sampling(&'static self, namespace: &str, queue: &str) -> Sampling {
        let key = (namespace.to_string(), queue.to_string());
        let id = SAMPLERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut queues = self.lock();
        let entry = queues.entry(key.clone()).or_default();
        entry.sampler = id;
        entry.sample = None;
        Sampling {
            backlogs: self,
            key,
            id,
        }
    }

    /// One message the source holds unacknowledged until the guard drops.
    pub fn holding(&'static self, namespace: &str, queue: &str) -> Holding {
        let key = (namespace.to_string(), queue.to_string());
        self.lock().entry(key.clone()).or_default().in_hand += 1;
        Holding {
            backlogs: self,
            key,
        }
    }

    fn in_hand(&self, key: &QueueKey) -> i64 {
        self.lock().get(key).map_or(0, |e| e.in_hand)
    }

    /// One park refused with 429 (the queue at `maxParked`) by the HTTP endpoint.
    pub fn refused(&self, namespace: &str, queue: &str) {
        let key = (namespace.to_string(), queue.to_string());
        let now = Timestamp::now().as_second();
        self.lock().entry(key).or_default().refusals.add(now);
    }

    /// What the writer reads: each queue's sample and its refusals in the last minute (None:
    /// never refused).
    fn snapshot(&self, now: Timestamp) -> Vec<(QueueKey, Option<Sample>, Option<i64>)> {
        self.lock()
            .iter()
            .map(|(k, e)| {
                let refused = e
                    .refusals
                    .any
                    .then(|| e.refusals.last_minute(now.as_second()));
                (k.clone(), e.sample, refused)
            })
            .collect()
    }
}

/// A running sampler's handle on the registry.
pub struct Sampling {
    backlogs: &'static Backlogs,
    key: QueueKey,
    id: u64,
}

impl Sampling {
    pub fn observe(&self, messages: Option<i64>) {
        let sample = Sample {
            messages,
            at: Timestamp::now(),
        };
        if let Some(e) = self.backlogs.lock().get_mut(&self.key)
            && e.sampler == self.id
        {
            e.sample = Some(sample);
        }
    }
}

/// A message a source holds (see [`Backlogs::holding`]).
pub struct Holding {
    backlogs: &'static Backlogs,
    key: QueueKey,
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(e) = self.backlogs.lock().get_mut(&self.key) {
            e.in_hand -= 1;
        }
    }
}

impl Drop for Sampling {
    fn drop(&mut self) {
        let mut queues = self.backlogs.lock();
        if let Some(e) = queues.get_mut(&self.key)
            && e.sampler == self.id
        {
            e.sampler = 0;
            e.sample = None;
            if !e.refusals.any && e.in_hand == 0 {
                queues.remove(&self.key);
            }
        }
    }
}

/// Samples the broker `source` names every [`SAMPLE_EVERY`] until dropped (with its source).
/// Never returns: a broker that does not answer is asked again at the next turn.
pub async fn sample(client: Client, into: ParkInto, queue: DeadLetterQueue, source: SourceSpec) {
    let sampling = BACKLOGS.sampling(into.namespace(), into.queue());
    let mut probe: Option<Probe> = None;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if probe.is_none() {
            match Probe::connect(&client, &into, &queue, &source).await {
                Ok(p) => probe = Some(p),
                Err(e) => {
                    tracing::debug!(namespace = %into.namespace(), queue = %into.queue(), error = %e, "cannot sample the backlog yet");
                    continue;
                }
            }
        }
        let Some(p) = probe.as_ref() else { continue };
        if matches!(p, Probe::Unknown) {
            sampling.observe(None);
            // Nothing will change: the writer wrote it once.
            std::future::pending::<()>().await;
        }
        match tokio::time::timeout(ASK_TIMEOUT, p.depth()).await {
            Ok(Ok(n)) => {
                let held = match p {
                    Probe::Amqp { .. } => BACKLOGS.in_hand(&sampling.key),
                    _ => 0,
                };
                sampling.observe(Some(n + held))
            }
            Ok(Err(e)) => {
                tracing::debug!(namespace = %into.namespace(), queue = %into.queue(), error = %e, "sampling the backlog failed; keeping the last one");
                if p.reconnects() {
                    probe = None;
                }
            }
            Err(_) => {
                tracing::debug!(namespace = %into.namespace(), queue = %into.queue(), "the broker did not say its backlog in time; keeping the last one");
                probe = None;
            }
        }
    }
}

/// How a sampler asks one broker.
enum Probe {
    /// Keys whose sizes add up (Redis: the dead list, the processing list and the inflight
    /// hash; Sidekiq: the dead set, the overflow list and the inflight hash).
    Redis {
        conn: RedisConn,
        lists: Vec<String>,
        hashes: Vec<String>,
        sets: Vec<String>,
    },
    /// Its ready messages, plus those the source holds unacknowledged ([`Backlogs::holding`]).
    Amqp {
        conn: lapin::Connection,
        queue: String,
    },
    Nats {
        client: async_nats::Client,
        stream: String,
    },
    #[cfg(feature = "sqs")]
    Sqs {
        client: aws_sdk_sqs::Client,
        url: String,
    },
    #[cfg(feature = "kafka")]
    Kafka {
        consumer: Arc<rdkafka::consumer::BaseConsumer>,
        topics: Vec<String>,
    },
    /// A broker that cannot say (Pub/Sub: the backlog is in Cloud Monitoring, not its API).
    Unknown,
}

impl Probe {
    /// A connection of its own to the broker `source` names, read by that backend's rules in
    /// `crate::broker` (the source's own Secret, else its target's), as the source's is.
    async fn connect(
        client: &Client,
        into: &ParkInto,
        queue: &DeadLetterQueue,
        source: &SourceSpec,
    ) -> Result<Probe, SourceError> {
        // A backend this build left out cannot say either.
        let Ok(backend) = SourceBackend::of(source) else {
            return Ok(Probe::Unknown);
        };
        let secrets = &mut SecretReads::new(client, into.namespace());
        let spec = &queue.spec;
        match backend {
            SourceBackend::Redis(src) => {
                let url = source_url(secrets, Sides::of(src, spec)).await?;
                let dead = &src.list;
                let lists = vec![dead.clone(), format!("{dead}:processing")];
                Probe::redis(&url, lists, vec![format!("{dead}:inflight")], vec![])
            }
            SourceBackend::Sidekiq(src) => {
                let url = source_url(secrets, Sides::of(src, spec)).await?;
                let keys = super::sidekiq::Keys::of(src, into.namespace(), into.queue());
                // Dead jobs moved out of Sidekiq's reach before its trim count too.
                Probe::redis(
                    &url,
                    vec![keys.overflow.clone()],
                    vec![keys.inflight()],
                    vec![keys.dead],
                )
            }
            SourceBackend::Amqp(src) => {
                let url = source_url(secrets, Sides::of(src, spec)).await?;
                let conn = crate::broker::amqp::AmqpConn::connect(&url)
                    .await
                    .map_err(SourceError::broker("connecting to RabbitMQ"))?;
                let queue = src.queue.clone();
                Ok(Probe::Amqp { conn, queue })
            }
            SourceBackend::Nats(src) => {
                let url = crate::broker::nats::source_url(secrets, Sides::of(src, spec)).await?;
                let client = crate::broker::nats::NatsConn::new(&url)
                    .map_err(SourceError::broker("NATS"))?
                    .get()
                    .await
                    .map_err(SourceError::broker("NATS"))?;
                let stream = super::nats::advisory_stream(&src.stream, &src.consumer);
                Ok(Probe::Nats { client, stream })
            }
            #[cfg(feature = "sqs")]
            SourceBackend::Sqs(src) => {
                let conn =
                    crate::broker::sqs::SqsConn::for_source(secrets, Sides::of(src, spec)).await?;
                let client = conn.client(ASK_TIMEOUT).await;
                let url = src.queue_url.clone();
                Ok(Probe::Sqs { client, url })
            }
            #[cfg(feature = "kafka")]
            SourceBackend::Kafka(src) => Probe::kafka(secrets, Sides::of(src, spec)).await,
            // Pub/Sub keeps its backlog in Cloud Monitoring.
            #[cfg(feature = "pubsub")]
            SourceBackend::Pubsub(_) => Ok(Probe::Unknown),
        }
    }

    /// Keys on one Redis whose sizes add up.
    fn redis(
        url: &str,
        lists: Vec<String>,
        hashes: Vec<String>,
        sets: Vec<String>,
    ) -> Result<Probe, SourceError> {
        let conn = RedisConn::new(url).map_err(SourceError::broker("connecting to redis"))?;
        Ok(Probe::Redis {
            conn,
            lists,
            hashes,
            sets,
        })
    }

    /// The consumer group's lag, read by a consumer that never joins the group.
    #[cfg(feature = "kafka")]
    async fn kafka(
        secrets: &mut SecretReads<'_>,
        sides: Sides<'_, dlq_core::api::KafkaSourceSpec>,
    ) -> Result<Probe, SourceError> {
        let src = sides.own;
        let conn = crate::broker::kafka::KafkaConn::for_source(secrets, sides).await?;
        let group = src
            .group_id
            .as_deref()
            .unwrap_or(super::kafka::DEFAULT_GROUP);
        let consumer: rdkafka::consumer::BaseConsumer = conn
            .config()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(SourceError::broker("creating the Kafka lag reader"))?;
        Ok(Probe::Kafka {
            consumer: Arc::new(consumer),
            topics: src.topics.clone(),
        })
    }

    /// How many dead messages the broker holds now.
    async fn depth(&self) -> Result<i64, BrokerError> {
        match self {
            Probe::Redis {
                conn,
                lists,
                hashes,
                sets,
            } => {
                let keys: Vec<Counted<'_>> = lists
                    .iter()
                    .map(|k| Counted::List(k))
                    .chain(hashes.iter().map(|k| Counted::Hash(k)))
                    .chain(sets.iter().map(|k| Counted::SortedSet(k)))
                    .collect();
                conn.depth(&keys).await
            }
            Probe::Amqp { conn, queue } => crate::broker::amqp::queue_depth(conn, queue).await,
            Probe::Nats { client, stream } => {
                crate::broker::nats::stream_depth(client.clone(), stream).await
            }
            #[cfg(feature = "sqs")]
            Probe::Sqs { client, url } => crate::broker::sqs::queue_depth(client, url).await,
            #[cfg(feature = "kafka")]
            Probe::Kafka { consumer, topics } => {
                let (consumer, topics) = (consumer.clone(), topics.clone());
                tokio::task::spawn_blocking(move || {
                    crate::broker::kafka::consumer_lag(&consumer, &topics, ASK_TIMEOUT)
                })
                .await
                .map_err(|e| BrokerError::Unreachable(e.to_string()))?
                .map_err(|e| BrokerError::Unreachable(e.to_string()))
            }
            Probe::Unknown => Err(BrokerError::Config("the broker cannot say".into())),
        }
    }

    /// Whether a failed question means the connection is gone (a fresh one next turn).
    fn reconnects(&self) -> bool {
        match self {
            // RedisConn and the NATS and AWS clients reconnect by themselves.
            Probe::Amqp { conn, .. } => !conn.status().connected(),
            _ => false,
        }
    }
}

/// What the writer last wrote for a queue.
#[derive(Default)]
struct Written {
    backlog: Option<(Sample, Instant)>,
    refused: Option<i64>,
}

/// Writes the registry's backlogs and refusals into the queues' status until `stop`: a
/// backlog when its number changed or its last write is [`REFRESH`] old (and the broker
/// answered since), the refusals when their count changed.
pub async fn write_backlogs(client: Client, stop: impl std::future::Future<Output = ()>) {
    let writing = async {
        let mut written: HashMap<QueueKey, Written> = HashMap::new();
        let mut tick = tokio::time::interval(WRITE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let snapshot = BACKLOGS.snapshot(Timestamp::now());
            written.retain(|k, _| snapshot.iter().any(|(s, _, _)| s == k));
            for (key, sample, refused) in snapshot {
                let last = written.entry(key.clone()).or_default();
                let mut status = serde_json::Map::new();
                let backlog = sample.filter(|s| backlog_due(s, last.backlog.as_ref()));
                if let Some(s) = backlog {
                    status.insert(
                        "backlog".into(),
                        json!({ "messages": s.messages, "observedAt": Time(s.at) }),
                    );
                }
                let refused = refused.filter(|n| last.refused != Some(*n));
                if let Some(n) = refused {
                    status.insert("http".into(), json!({ "refusedLastMinute": n }));
                }
                if status.is_empty() {
                    continue;
                }
                match patch_status(&client, &key, status).await {
                    Ok(()) => {
                        if let Some(s) = backlog {
                            last.backlog = Some((s, Instant::now()));
                        }
                        if refused.is_some() {
                            last.refused = refused;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(namespace = %key.0, queue = %key.1, error = %e, "writing the queue's backlog failed; next turn")
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = writing => {}
        _ = stop => {}
    }
}

/// Whether `sample` is to be written after `last`: a different number, or a newer answer
/// once the last write is [`REFRESH`] old.
fn backlog_due(sample: &Sample, last: Option<&(Sample, Instant)>) -> bool {
    match last {
        None => true,
        Some((l, at)) => {
            l.messages != sample.messages || (sample.at > l.at && at.elapsed() >= REFRESH)
        }
    }
}

/// A merge patch of `status` (its `backlog` and `http` only) on the queue `key`.
async fn patch_status(
    client: &Client,
    key: &QueueKey,
    status: serde_json::Map<String, serde_json::Value>,
) -> Result<(), kube::Error> {
    let api: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &key.0);
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    api.patch_status(&key.1, &params, &Patch::Merge(json!({ "status": status })))
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_count_the_last_minute_only() {
        let mut r = Refusals::default();
        assert!(!r.any);
        r.add(1_000);
        r.add(1_000);
        r.add(1_030);
        assert_eq!(r.last_minute(1_030), 3);
        assert_eq!(r.last_minute(1_059), 3);
        assert_eq!(r.last_minute(1_060), 1, "the two of second 1,000 have gone");
        r.add(1_060);
        assert_eq!(r.last_minute(1_060), 2, "a slot is reused a minute on");
        assert_eq!(r.last_minute(1_200), 0);
        assert!(r.any);
    }

    #[test]
    fn a_backlog_is_written_when_it_changes_or_goes_stale_never_for_an_old_answer() {
        let at = |s: i64| Timestamp::from_second(s).unwrap_or_default();
        let sample = |n: i64, s: i64| Sample {
            messages: Some(n),
            at: at(s),
        };
        assert!(backlog_due(&sample(5, 10), None), "the first");
        let just = (sample(5, 10), Instant::now());
        assert!(
            !backlog_due(&sample(5, 15), Some(&just)),
            "same number, fresh write"
        );
        assert!(
            backlog_due(&sample(6, 15), Some(&just)),
            "a new number at once"
        );
        let unknown = Sample {
            messages: None,
            at: at(15),
        };
        assert!(backlog_due(&unknown, Some(&just)), "unknown is a change");
        let Some(old) = Instant::now().checked_sub(REFRESH) else {
            return;
        };
        let stale = (sample(5, 10), old);
        assert!(backlog_due(&sample(5, 20), Some(&stale)), "refreshed");
        assert!(
            !backlog_due(&sample(5, 10), Some(&stale)),
            "a broker that stopped answering keeps its old observedAt"
        );
    }
}
