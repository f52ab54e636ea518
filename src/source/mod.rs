//! Sources: drain a broker's dead messages into DeadLetter records, acknowledging each message
//! only after its record exists (ack after the side effect), so a crash never loses one.
//!
//! The supervisor keeps one task per DeadLetterQueue that has a `source`, driven by the
//! operator's queue store (no polling): it starts, restarts (source or target changed) and
//! stops them as queues change, and closes the targets of deleted queues. Aborting a source
//! mid-message is safe by construction: the message is still in the broker's in-flight area
//! and is re-parked (deduplicated) on the next start.

pub mod amqp;
pub mod http;
pub mod in_flight;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nats;
#[cfg(feature = "pubsub")]
pub mod pubsub;
pub mod redis;
pub mod sidekiq;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod taken;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;

use dlq_client::park::{ParkError, ParkOutcome, ParkRequest, Parker};
use dlq_core::api::{DeadLetterQueue, SecretKeyRef};
use dlq_core::events::{self, EventPlan};
use dlq_core::park::{Disposition, after_refusal, dispose, job_key};

use crate::metrics::Metrics;
use crate::secret::{SecretError, read_secret};
use crate::source::in_flight::InFlight;
use crate::state::apiserver::{Apiserver, reference};
use crate::state::jobs::JobIndex;
use crate::state::leadership::Leadership;
use crate::state::parking_first::ParkingFirst;
use crate::target::cache::TargetCache;

/// Why one run of a source ended. It is restarted with backoff.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source misconfigured: {0}")]
    Config(String),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("unreadable answer from the broker: {0}")]
    Decode(String),
    #[error("{context}: {source}")]
    Broker {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl SourceError {
    /// Wraps a broker client's error with what the source was doing.
    pub fn broker<E>(context: impl Into<String>) -> impl FnOnce(E) -> SourceError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let context = context.into();
        move |e| SourceError::Broker {
            context,
            source: Box::new(e),
        }
    }
}

/// Longest wait of a source whose queue is full before it tries to park again.
const FULL_RECHECK: Duration = Duration::from_secs(2);

/// How often a source whose replica's term ran out looks whether it was renewed.
const TERM_RECHECK: Duration = Duration::from_secs(1);

/// How often the supervisor also checks for sources that ended by themselves.
const RESYNC: Duration = Duration::from_secs(30);

struct Running {
    fingerprint: u64,
    task: JoinHandle<()>,
}

/// What every source shares: how it parks, and how it reports what it cannot park.
#[derive(Clone)]
pub struct Shared {
    pub client: Client,
    pub parker: Parker,
    pub queues: Store<DeadLetterQueue>,
    /// The operator's records by job: sources create the right cycle without listing first.
    pub jobs: JobIndex,
    pub apiserver: Arc<dyn Apiserver>,
    pub metrics: Metrics,
    /// This replica's term on the Lease: a source parks only while it holds.
    pub leadership: Leadership,
    /// One park at a time per dead message (see [`in_flight`]).
    pub in_flight: InFlight,
    /// Parks in flight, which the records controller's marks yield to.
    pub parking_first: ParkingFirst,
}

/// Runs sources for every DeadLetterQueue with a `source` in `shared.queues`, following
/// `queue_changes`, until `stop` resolves.
pub async fn supervise(
    shared: Shared,
    queue_changes: impl Stream<Item = Arc<DeadLetterQueue>> + Send,
    targets: Arc<TargetCache>,
    stop: impl std::future::Future<Output = ()> + Send,
) {
    let queues = shared.queues.clone();
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
            targets.prune(&queues).await;
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

/// The source and target as a fingerprint: either changing restarts the source.
fn fingerprint(q: &DeadLetterQueue) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
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
        .queues
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
        if let Some(task) = start(&shared.client, into, &queue) {
            running.insert(key, Running { fingerprint, task });
        }
    }
}

/// Starts the source `queue` names.
fn start(client: &Client, into: ParkInto, queue: &DeadLetterQueue) -> Option<JoinHandle<()>> {
    let source = queue.spec.source.clone()?;
    let (ns, name) = (into.namespace().to_string(), into.queue().to_string());
    let queue = queue.clone();
    let client = client.clone();
    if let Some(src) = source.redis {
        tracing::info!(namespace = %ns, queue = %name, list = %src.list, "starting redis source");
        Some(tokio::spawn(redis::run(client, into, queue, src)))
    } else if let Some(src) = source.amqp {
        tracing::info!(namespace = %ns, queue = %name, amqp_queue = %src.queue, "starting amqp source");
        Some(tokio::spawn(amqp::run(client, into, queue, src)))
    } else if let Some(src) = source.nats {
        tracing::info!(namespace = %ns, queue = %name, stream = %src.stream, consumer = %src.consumer, "starting nats source");
        Some(tokio::spawn(nats::run(client, into, queue, src)))
    } else if let Some(src) = source.sqs {
        tracing::info!(namespace = %ns, queue = %name, sqs_queue = %crate::target::redact_url(&src.queue_url), "starting sqs source");
        #[cfg(feature = "sqs")]
        let task = tokio::spawn(sqs::run(client, into, queue, src));
        #[cfg(not(feature = "sqs"))]
        let task = tokio::spawn(not_built(into, "sqs"));
        Some(task)
    } else if let Some(src) = source.sidekiq {
        tracing::info!(namespace = %ns, queue = %name, sidekiq_namespace = src.namespace.as_deref().unwrap_or(""), "starting sidekiq source");
        Some(tokio::spawn(sidekiq::run(client, into, queue, src)))
    } else if let Some(src) = source.kafka {
        tracing::info!(namespace = %ns, queue = %name, topics = ?src.topics, "starting kafka source");
        #[cfg(feature = "kafka")]
        let task = tokio::spawn(kafka::run(client, into, queue, src));
        #[cfg(not(feature = "kafka"))]
        let task = tokio::spawn(not_built(into, "kafka"));
        Some(task)
    } else if let Some(src) = source.pubsub {
        tracing::info!(namespace = %ns, queue = %name, subscription = %src.subscription, "starting pubsub source");
        #[cfg(feature = "pubsub")]
        let task = tokio::spawn(pubsub::run(client, into, queue, src));
        #[cfg(not(feature = "pubsub"))]
        let task = tokio::spawn(not_built(into, "pubsub"));
        Some(task)
    } else {
        None
    }
}

/// The source of a backend this build left out (cargo feature `kafka`, `sqs` or `pubsub`): says so once,
/// as an error log and a Warning Event on the queue, and then waits (a task that ended would be
/// restarted, and would say it again, at every resync).
#[cfg(not(all(feature = "kafka", feature = "sqs", feature = "pubsub")))]
async fn not_built(into: ParkInto, backend: &'static str) {
    let why = crate::target::not_built(backend);
    tracing::error!(namespace = %into.namespace(), queue = %into.queue(), source = backend, "{why}");
    if let Some(queue) = into.shared.queues.get(&into.key) {
        let note = format!("source.{backend}: {why}");
        let event = EventPlan::warning(
            events::reason::BACKEND_NOT_BUILT,
            events::action::PARK,
            note,
        );
        into.shared
            .apiserver
            .publish(reference(queue.as_ref()), &event)
            .await;
    }
    std::future::pending::<()>().await
}

/// Where a source parks: its DeadLetterQueue as the operator's store holds it right now (its
/// `maxParked` and counters), so a parking storm costs no queue reads.
#[derive(Clone)]
pub struct ParkInto {
    shared: Shared,
    key: ObjectRef<DeadLetterQueue>,
}

impl ParkInto {
    pub fn namespace(&self) -> &str {
        self.key.namespace.as_deref().unwrap_or_default()
    }

    pub fn queue(&self) -> &str {
        &self.key.name
    }

    /// Parks once, choosing the cycle from the operator's own records (a create, and a
    /// consistent list only when that create meets a record the watch had not yet shown).
    pub async fn park(&self, req: ParkRequest) -> Result<ParkOutcome, ParkError> {
        let _parking = self.shared.parking_first.parking();
        let queue = self
            .shared
            .queues
            .get(&self.key)
            .ok_or_else(|| ParkError::UnknownQueue {
                namespace: self.namespace().to_string(),
                queue: self.queue().to_string(),
            })?;
        let known = self
            .shared
            .jobs
            .cycles(self.namespace(), &job_key(&req.queue, &req.job.id));
        self.shared
            .parker
            .park_known(&queue, req, known.as_deref())
            .await
    }

    /// The one rule for every source (`dlq_core::park::dispose`): `req` if it is valid, else an
    /// Invalid record of the message's exact bytes `raw`; `Err` only for what can never be a
    /// record, which the source then keeps where rejected messages go and reports with
    /// [`ParkInto::rejected`].
    pub fn dispose(&self, req: ParkRequest, raw: &[u8]) -> Result<ParkRequest, ParkError> {
        match dispose(req, raw) {
            Disposition::Park(req) => Ok(*req),
            Disposition::Reject(why) => Err(ParkError::Invalid(why)),
        }
    }

    /// Parks one dead message of exact bytes `raw`, read as `req`: the one path of every
    /// source. Retries what may succeed later ([`ParkInto::park_until_known`]); when the
    /// apiserver refuses the record for good (400, 413, 422: a schema or CEL rule), parks the
    /// message as an Invalid record of its bytes with the refusal as reason instead
    /// (`dlq_core::park::after_refusal`), so one bad message never stalls those behind it.
    /// `Err` only when even that is refused or the message is over the payload limit: the
    /// source then keeps it where rejected messages go and reports it with
    /// [`ParkInto::rejected`].
    pub async fn park_message<W, Fut>(
        &self,
        req: ParkRequest,
        raw: &[u8],
        where_it_stays: &str,
        waiting: W,
    ) -> Result<(), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut req = self.dispose(req, raw)?;
        let mut tried = 0;
        loop {
            let refused = match self.park_until_known(&req, where_it_stays, &waiting).await {
                Err(e) if e.final_refusal().is_some() => e,
                done => return done,
            };
            let refusal = refused.final_refusal().unwrap_or_default();
            let Some(next) = after_refusal(&req, raw, refusal, tried) else {
                return Err(refused);
            };
            tracing::warn!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, error = %refused, fallback = tried + 1, "the apiserver refused the record for good; parking the message as Invalid with its exact bytes");
            req = next;
            tried += 1;
        }
    }

    /// Counts and announces a message that could not become a record and was kept at
    /// `kept_in` (`dlq_rejected_total`, Warning Event `Rejected` on the DeadLetterQueue).
    pub async fn rejected(&self, why: &ParkError, size: usize, kept_in: &str) {
        let reason = match why {
            ParkError::Invalid(e) => e.category(),
            e if e.final_refusal().is_some() => "Refused",
            _ => "Unparkable",
        };
        self.shared
            .metrics
            .rejected(self.namespace(), self.queue(), reason);
        tracing::error!(namespace = %self.namespace(), queue = %self.queue(), error = %why, size, kept_in, "dead message cannot be a record; kept in the broker");
        let Some(queue) = self.shared.queues.get(&self.key) else {
            return;
        };
        let note = format!(
            "a dead message of {size} bytes cannot be a record ({why}); its bytes are kept in {kept_in}"
        );
        let event = EventPlan::warning(events::reason::REJECTED, events::action::PARK, note);
        self.shared
            .apiserver
            .publish(reference(queue.as_ref()), &event)
            .await;
    }

    /// Says something about the source's broker as a Warning Event on the queue (`reason`:
    /// `dlq_core::events::reason`).
    pub async fn warn(&self, reason: &'static str, note: String) {
        let Some(queue) = self.shared.queues.get(&self.key) else {
            return;
        };
        let event = EventPlan::warning(reason, events::action::PARK, note);
        self.shared
            .apiserver
            .publish(reference(queue.as_ref()), &event)
            .await;
    }

    /// Parks, retrying what may succeed later (apiserver down, queue full) with capped
    /// backoff; `waiting` runs before each wait (to tell the broker the message is still being
    /// worked on) and the message stays in the broker meanwhile. Returns an error only for a
    /// request that can never be a record.
    pub async fn park_until_known<W, Fut>(
        &self,
        req: &ParkRequest,
        where_it_stays: &str,
        waiting: W,
    ) -> Result<(), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut req = req.clone();
        let _turn = self.shared.in_flight.turn(&mut req).await;
        let mut attempt = 0u32;
        loop {
            if !self.shared.leadership.holds() {
                // A replica that was paused past its term wakes up with messages in hand that
                // the broker has meanwhile handed to the new leader, whose records may even be
                // resolved by now: park nothing until the term is renewed, and then only as a
                // re-read of the message (matched by its identity), never as a new death.
                req.retrying();
                tracing::debug!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, "this replica's term on the Lease ran out; the dead message stays {where_it_stays}");
                waiting().await;
                tokio::time::sleep(TERM_RECHECK).await;
                continue;
            }
            match self.park(req.clone()).await {
                Ok(_) => return Ok(()),
                Err(e @ ParkError::MaxParked { .. }) => {
                    // Backpressure, not a failure: the queue's Full condition and QueueFull
                    // Event say so once. Look again soon, so parking resumes shortly after
                    // records are resolved.
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, FULL_RECHECK);
                    tracing::debug!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, error = %e, retry_in = ?wait, "queue full; the dead message stays {where_it_stays}");
                    waiting().await;
                    tokio::time::sleep(wait).await;
                }
                Err(e) if e.is_transient() => {
                    // The create may have been stored before the error (a reply lost in an
                    // apiserver restart), and its record resolved before the retry: match
                    // by message identity from now on, or the retry parks a second cycle.
                    req.retrying();
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, Duration::from_secs(30));
                    tracing::warn!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, error = %e, retry_in = ?wait, "parking a dead message failed; it stays {where_it_stays}");
                    waiting().await;
                    tokio::time::sleep(wait).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The broker URL a source connects with: from its own Secret, else from its queue's target's
/// (the same broker), read fresh at every (re)start of the source.
pub(crate) async fn url_from_secret(
    client: &Client,
    into: &ParkInto,
    own: Option<&SecretKeyRef>,
    target: Option<&SecretKeyRef>,
    kind: &str,
) -> Result<String, SourceError> {
    let secret_ref = own.or(target).ok_or_else(|| {
        SourceError::Config(format!(
            "source.{kind} needs urlSecretRef (the target has none of {kind})"
        ))
    })?;
    Ok(read_secret(client, into.namespace(), secret_ref).await?.0)
}

/// Runs one source's `once` again and again: after it ends or fails, waits with capped
/// exponential backoff (reset once a run lasted a minute), so a broker outage is retried
/// without hammering it.
pub(crate) async fn keep_running<F, Fut>(kind: &str, into: &ParkInto, mut once: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), SourceError>>,
{
    let mut attempt = 0u32;
    loop {
        let started = std::time::Instant::now();
        let result = once().await;
        if started.elapsed() > Duration::from_secs(60) {
            attempt = 0;
        }
        attempt = attempt.saturating_add(1);
        let wait = dlq_core::decide::backoff(attempt, Duration::from_secs(30));
        match result {
            Ok(()) => {
                tracing::info!(namespace = into.namespace(), queue = into.queue(), source = kind, retry_in = ?wait, "source ended; restarting")
            }
            Err(e) => {
                tracing::warn!(namespace = into.namespace(), queue = into.queue(), source = kind, error = %e, retry_in = ?wait, "source failed")
            }
        }
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use dlq_core::api::Job;
    use kube::runtime::events::Reporter;
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::state::apiserver::KubeApiserver;

    /// A replica whose term on the Lease ran out (a leader paused past it) parks nothing, not
    /// even a first try: the broker may have handed the same message to the new leader, whose
    /// record of it may be resolved by now. It parks again once the term is renewed.
    #[tokio::test]
    async fn a_source_parks_nothing_while_its_replica_has_no_term() {
        // An "apiserver" that only counts the connections made to it.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = connections.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                drop(socket);
            }
        });
        let url = format!("http://{addr}").parse().expect("url");
        let client = Client::try_from(kube::Config::new(url)).expect("client");
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.metadata.namespace = Some("payments".into());
        let (queues, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(queue));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let leadership = Leadership::not_yet();
        let into = ParkInto {
            shared: Shared {
                parker: Parker::new(client.clone()),
                queues,
                jobs: JobIndex::default(),
                apiserver: Arc::new(KubeApiserver::new(client.clone(), Reporter::from("t"))),
                metrics: Metrics::default(),
                leadership: leadership.clone(),
                in_flight: InFlight::default(),
                parking_first: ParkingFirst::default(),
                client,
            },
            key: ObjectRef::new("relayer").within("payments"),
        };
        let job = Job {
            id: "pi_0003/settle".into(),
            payload: Some("{}".into()),
            ..Job::default()
        };
        let req = ParkRequest::new("relayer", job).with_message("relayer:dead#1".to_string());
        let parking = tokio::spawn(async move {
            let _ = into
                .park_until_known(&req, "in the broker", || async {})
                .await;
        });

        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            connections.load(Ordering::SeqCst),
            0,
            "parked without a term"
        );
        let now = jiff::Timestamp::now().as_millisecond();
        leadership.renewed(now, Duration::from_secs(15));
        for _ in 0..50 {
            if connections.load(Ordering::SeqCst) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            connections.load(Ordering::SeqCst) > 0,
            "parking resumes once the term is renewed"
        );
        parking.abort();
    }
}
