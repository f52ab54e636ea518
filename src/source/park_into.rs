//! What every source shares: where it parks ([`ParkInto`], the one path of a dead message into
//! a record), why one of its runs ended ([`SourceError`]), and how it is kept running. Its own
//! file, so each backend's source names it without going through the supervisor (`super`),
//! which starts them.

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::runtime::reflector::{ObjectRef, Store};

use dlq_client::park::{ParkError, ParkOutcome, ParkRequest, Parker};
use dlq_core::api::DeadLetterQueue;
use dlq_core::events::{self, EventPlan};
use dlq_core::park::job_key;
use dlq_core::source_plan::{self, Keeping, Parking, QueueSettings, SourcePlan};

use super::in_flight::InFlight;
use crate::body::payload::Payloads;
use crate::body::{Bodies, Kept};
use crate::broker::backend::ConnectError;
use crate::metrics::Metrics;
use crate::pass::{PassThrough, Passed};
use crate::secret::SecretError;
use crate::state::apiserver::{Apiserver, reference};
use crate::state::jobs::JobIndex;
use crate::state::leadership::Leadership;
use crate::state::parking_first::ParkingFirst;

/// Why one run of a source ended. It is restarted with backoff.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source misconfigured: {0}")]
    Config(String),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("unreadable answer from the broker: {0}")]
    Decode(String),
    #[error(transparent)]
    Budget(#[from] crate::state::bytes::Closed),
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

impl From<ConnectError> for SourceError {
    /// A Secret that cannot be read says so; a spec naming no way to connect is misconfigured.
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Secret(e) => SourceError::Secret(e),
            ConnectError::Unnamed(why) => SourceError::Config(why),
        }
    }
}

/// Longest wait of a source whose queue is full before it tries to park again.
const FULL_RECHECK: Duration = Duration::from_secs(2);

/// How often a source whose replica's term ran out looks whether it was renewed.
const TERM_RECHECK: Duration = Duration::from_secs(1);

/// What every source shares, by concern. Private: a source reaches it only through
/// [`ParkInto`]'s narrow methods (the queue as the store holds it, an Event on it, its
/// tunables, the body stores), never the parts it does not use.
#[derive(Clone)]
pub struct Shared {
    parking: ParkServices,
    reports: Reports,
    /// The standing replays running here, as a source may ask them: a dead message one covers
    /// is passed through.
    passes: Arc<dyn PassThrough>,
    /// The queues' body stores: a dead message over a queue's threshold is kept there and its
    /// record holds a reference.
    bodies: Arc<dyn Bodies>,
    /// What the brokers' Secrets are read with.
    client: Client,
    tuning: Tuning,
    /// One park at a time per dead message (see [`super::in_flight`]).
    in_flight: InFlight,
}

/// Where dead messages become records.
#[derive(Clone)]
pub struct ParkServices {
    pub parker: Parker,
    /// The queues as the operator's store holds them (their `maxParked` and counters).
    pub queues: Store<DeadLetterQueue>,
    /// The operator's records by job: sources create the right cycle without listing first.
    pub jobs: JobIndex,
    /// This replica's term on the Lease: a source parks only while it holds.
    pub leadership: Leadership,
    /// Parks in flight, which the records controller's marks yield to.
    pub parking_first: ParkingFirst,
}

/// How a source tells what it could not park: Events on its queue, and metrics.
#[derive(Clone)]
pub struct Reports {
    pub apiserver: Arc<dyn Apiserver>,
    pub metrics: Metrics,
}

/// The sources' tunables (the process's flags), beside the sources that read them.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// The Kafka source handles several messages at once (`super::kafka::IN_FLIGHT`); off
    /// only in the bench's A/B.
    pub kafka_in_flight: bool,
    /// The SQS source receives with several long polls at once (`super::sqs::RECEIVERS`); one
    /// only in the bench's A/B.
    pub sqs_receivers: bool,
    /// The SQS source's long poll (`--sqs-long-poll-seconds`).
    pub sqs_long_poll: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            kafka_in_flight: true,
            sqs_receivers: true,
            sqs_long_poll: Duration::from_secs(20),
        }
    }
}

impl Shared {
    /// The sources' services: no body store ([`crate::body::NoBodies`]) and the default
    /// [`Tuning`] until set.
    pub fn new(
        client: Client,
        parking: ParkServices,
        reports: Reports,
        passes: Arc<dyn PassThrough>,
    ) -> Self {
        Shared {
            parking,
            reports,
            passes,
            bodies: Arc::new(crate::body::NoBodies),
            client,
            tuning: Tuning::default(),
            in_flight: InFlight::default(),
        }
    }

    /// Keeps large dead messages in `bodies`.
    pub fn with_bodies(mut self, bodies: Arc<dyn Bodies>) -> Self {
        self.bodies = bodies;
        self
    }

    /// The sources run with `tuning`.
    pub fn with_tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// The queues, as the supervisor follows them.
    pub(super) fn queues(&self) -> &Store<DeadLetterQueue> {
        &self.parking.queues
    }

    /// What the sources read their brokers' Secrets with.
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// Whether this replica's term on the Lease holds (parks only then).
    pub fn holds_term(&self) -> bool {
        self.parking.leadership.holds()
    }
}

/// Where a source parks: its DeadLetterQueue as the operator's store holds it right now (its
/// `maxParked` and counters), so a parking storm costs no queue reads.
#[derive(Clone)]
pub struct ParkInto {
    pub(super) shared: Shared,
    pub(super) key: ObjectRef<DeadLetterQueue>,
}

impl ParkInto {
    pub fn namespace(&self) -> &str {
        self.key.namespace.as_deref().unwrap_or_default()
    }

    pub fn queue(&self) -> &str {
        &self.key.name
    }

    /// The queue as the operator's store holds it right now.
    pub fn queue_now(&self) -> Option<Arc<DeadLetterQueue>> {
        self.shared.parking.queues.get(&self.key)
    }

    /// The sources' tunables.
    pub fn tuning(&self) -> Tuning {
        self.shared.tuning
    }

    /// The queues' body stores.
    pub fn bodies(&self) -> &dyn Bodies {
        self.shared.bodies.as_ref()
    }

    /// The process's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.reports.metrics
    }

    /// One park at a time per dead message (see [`super::in_flight`]).
    pub fn in_flight(&self) -> &InFlight {
        &self.shared.in_flight
    }

    /// Publishes `event` about the queue (nothing when the store no longer holds it).
    pub async fn tell(&self, event: &EventPlan) {
        let Some(queue) = self.queue_now() else {
            return;
        };
        let regarding = reference(queue.as_ref());
        self.shared
            .reports
            .apiserver
            .publish(regarding, event)
            .await;
    }

    /// Parks once, choosing the cycle from the operator's own records (a create, and a
    /// consistent list only when that create meets a record the watch had not yet shown).
    pub async fn park(&self, req: ParkRequest) -> Result<ParkOutcome, ParkError> {
        let _parking = self.shared.parking.parking_first.parking();
        let queue =
            self.shared
                .parking
                .queues
                .get(&self.key)
                .ok_or_else(|| ParkError::UnknownQueue {
                    namespace: self.namespace().to_string(),
                    queue: self.queue().to_string(),
                })?;
        let known = self
            .shared
            .parking
            .jobs
            .cycles(self.namespace(), &job_key(&req.queue, &req.job.id));
        self.shared
            .parking
            .parker
            .park_known(&queue, req, known.as_deref())
            .await
    }

    /// Parks one dead message of exact bytes `raw`, read as `req`: the one path of every
    /// source. Retries what may succeed later ([`ParkInto::park_until_known`]); when the
    /// apiserver refuses the record for good (400, 413, 422: a schema or CEL rule), parks the
    /// message as an Invalid record of its bytes with the refusal as reason instead (its
    /// plan's next fallback, `dlq_core::source_plan::Parking::after_refusal`), so one bad
    /// message never stalls those behind it.
    /// `Err` only when even that is refused or the message is over the payload limit: the
    /// source then keeps it where rejected messages go and reports it with
    /// [`ParkInto::rejected`].
    /// `raw` is shared, not copied: a payload left in it ([`ParkRequest::of_message`]) goes to
    /// the body store from the broker's own buffer.
    pub async fn park_message<W, Fut>(
        &self,
        req: ParkRequest,
        raw: &bytes::Bytes,
        where_it_stays: &str,
        waiting: W,
    ) -> Result<(), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        self.park_read(req, Some(raw), where_it_stays, waiting)
            .await
    }

    /// [`ParkInto::park_message`] for a message whose exact bytes are no longer held here: a
    /// Redis envelope whose payload, too large for a record, was decoded in the element's own
    /// buffer (`dlq_core::envelope::take_apart`). Parked as `req` or not at all: an Invalid
    /// record of the message's bytes could not hold them anyway (they are more than a record
    /// holds), so what would be one is `Err`, and the source keeps the message where rejected
    /// messages go from its own copy. Nothing to do while it waits: the message is in the
    /// source's hash meanwhile.
    pub async fn park_taken_apart(
        &self,
        req: ParkRequest,
        where_it_stays: &str,
    ) -> Result<(), ParkError> {
        self.park_read(req, None, where_it_stays, || async {}).await
    }

    /// Parks `req`, read from a message of exact bytes `raw` when they are still held: the
    /// core's one plan of it carried out ([`ParkInto::keep_body`], then pass or park).
    async fn park_read<W, Fut>(
        &self,
        req: ParkRequest,
        raw: Option<&bytes::Bytes>,
        where_it_stays: &str,
        waiting: W,
    ) -> Result<(), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let (mut parking, _kept) = self.keep_body(req, raw, where_it_stays, &waiting).await?;
        if self.passed_through(&parking).await {
            return Ok(());
        }
        loop {
            let refused = match self
                .park_until_known(&parking, where_it_stays, &waiting)
                .await
            {
                Err(e) if e.final_refusal().is_some() => e,
                done => return done,
            };
            let job = parking.request().job.id.clone();
            let refusal = refused.final_refusal().unwrap_or_default();
            let Some(next) = parking.after_refusal(refusal) else {
                return Err(refused);
            };
            tracing::warn!(namespace = %self.namespace(), queue = %self.queue(), %job, error = %refused, fallback = next.fallbacks(), "the apiserver refused the record for good; parking the message as Invalid with its exact bytes");
            parking = next;
        }
    }

    /// The core's one plan of a dead message read as `req` from exact bytes `raw`
    /// (`dlq_core::source_plan::plan`, against its queue as the store holds it now), carried
    /// out up to its park: its payload kept in the queue's body store first when the plan
    /// says so (the [`Kept`] guard keeps the object from the sweep until the record exists).
    /// While the store cannot take it, the message stays in the broker (`waiting` runs before
    /// each wait) and a `BodyStoreUnavailable` Event says why. `Err` for what can never be a
    /// record (over `maxBytes`, invalid even as an Invalid record).
    pub(super) async fn keep_body<W, Fut>(
        &self,
        req: ParkRequest,
        raw: Option<&bytes::Bytes>,
        where_it_stays: &str,
        waiting: &W,
    ) -> Result<(Parking, Option<Kept>), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let queue = self.shared.parking.queues.get(&self.key);
        let settings = QueueSettings::of(queue.as_deref());
        let keeping = match source_plan::plan(req, raw.cloned(), settings) {
            SourcePlan::Park(parking) => return Ok((parking, None)),
            SourcePlan::Reject(why) => return Err(ParkError::Invalid(why)),
            SourcePlan::Keep(keeping) => keeping,
        };
        // Kept only for a queue with a store: the plan read it from this very queue.
        let queue = queue.ok_or_else(|| ParkError::UnknownQueue {
            namespace: self.namespace().to_string(),
            queue: self.queue().to_string(),
        })?;
        let kept = self
            .put_until_kept(&keeping, &queue, where_it_stays, waiting)
            .await;
        let parking = keeping
            .kept(kept.body.clone())
            .map_err(ParkError::Invalid)?;
        Ok((parking, Some(kept)))
    }

    /// Puts the planned payload in the queue's store, retrying while the store cannot take it
    /// (the message stays in the broker meanwhile, `waiting` runs before each wait, and a
    /// `BodyStoreUnavailable` Event says why).
    async fn put_until_kept<W, Fut>(
        &self,
        keeping: &Keeping,
        queue: &Arc<DeadLetterQueue>,
        where_it_stays: &str,
        waiting: &W,
    ) -> Kept
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let (job, size) = (keeping.job(), keeping.size);
        let mut attempt = 0u32;
        loop {
            // Read afresh each time: the recipient it seals to may be published meanwhile.
            let queue = self
                .shared
                .parking
                .queues
                .get(&self.key)
                .unwrap_or_else(|| queue.clone());
            // Sealed when the queue seals: `body::payload` decides.
            let payloads = Payloads::of(self.shared.bodies.as_ref(), &queue);
            match payloads.keep(job, &keeping.payload).await {
                Ok(kept) => {
                    // Tests kill the operator here: an object with no record yet.
                    crate::failpoint::hit("body-after-upload").await;
                    return kept;
                }
                Err(e) => {
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, Duration::from_secs(30));
                    tracing::warn!(namespace = %self.namespace(), queue = %self.queue(), job = %job, error = %e, retry_in = ?wait, "keeping a large body failed; the dead message stays {where_it_stays}");
                    if attempt == 1 || attempt.is_power_of_two() {
                        let note = format!(
                            "a dead message of {size} bytes waits {where_it_stays}: {} ({})",
                            e,
                            e.reason()
                        );
                        self.warn(events::reason::BODY_STORE_UNAVAILABLE, note)
                            .await;
                    }
                    waiting().await;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Whether a standing replay took the planned message (see [`crate::pass`]): requeued on
    /// the target, so the source acknowledges it without a record. Only a message whose bytes
    /// are in hand and whose body was not kept may pass (its plan's `arriving` facts). A failed
    /// requeue parks it.
    async fn passed_through(&self, parking: &Parking) -> bool {
        let (Some(facts), Some(raw)) = (parking.arriving(), parking.passable()) else {
            return false;
        };
        let req = parking.request();
        // A replica without a term parks nothing, and passes nothing either.
        if !self.shared.parking.leadership.holds() {
            return false;
        }
        let Some(queue) = self.shared.parking.queues.get(&self.key) else {
            return false;
        };
        if self.maybe_parked(req) {
            return false;
        }
        match self.shared.passes.pass(&queue, req, facts, raw).await {
            Passed::No => false,
            Passed::Through { replay } => {
                self.shared
                    .reports
                    .metrics
                    .passed_through(self.namespace(), self.queue());
                tracing::debug!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, %replay, "passed through");
                true
            }
            Passed::Failed { replay, error } => {
                self.shared.reports.metrics.pass_through_failed(
                    self.namespace(),
                    self.queue(),
                    error.reason(),
                );
                tracing::warn!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, %replay, reason = error.reason(), %error, "pass-through failed; parking the dead message instead");
                false
            }
        }
    }

    /// Whether a standing replay runs on this queue (while this replica leads): only then does
    /// a source reach past the messages that wait for room.
    pub fn covered(&self) -> bool {
        self.shared.parking.leadership.holds()
            && self
                .shared
                .passes
                .covers_queue(self.namespace(), self.queue())
    }

    /// Whether a standing replay would pass `req` now (seen, it keeps its replay running).
    pub fn would_pass(&self, req: &ParkRequest) -> bool {
        let Some(queue) = self.shared.parking.queues.get(&self.key) else {
            return false;
        };
        !self.maybe_parked(req) && self.shared.passes.would_pass(&queue, req)
    }

    /// Whether this very message may already be a record: re-read after a crash between its
    /// park and its acknowledgement, it belongs to that record (passing it would deliver the
    /// job a second time, under another key). Until the records are listed, it may be.
    fn maybe_parked(&self, req: &ParkRequest) -> bool {
        let key = job_key(&req.queue, &req.job.id);
        let Some(known) = self.shared.parking.jobs.cycles(self.namespace(), &key) else {
            return true;
        };
        known
            .iter()
            .any(|k| k.message.is_some() && k.message == req.message)
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
            .reports
            .metrics
            .rejected(self.namespace(), self.queue(), reason);
        tracing::error!(namespace = %self.namespace(), queue = %self.queue(), error = %why, size, kept_in, "dead message cannot be a record; kept in the broker");
        let note = format!(
            "a dead message of {size} bytes cannot be a record ({why}); its bytes are kept in {kept_in}"
        );
        let event = EventPlan::warning(events::reason::REJECTED, events::action::PARK, note);
        self.tell(&event).await;
    }

    /// Says something about the source's broker as a Warning Event on the queue (`reason`:
    /// `dlq_core::events::reason`).
    pub async fn warn(&self, reason: &'static str, note: String) {
        let event = EventPlan::warning(reason, events::action::PARK, note);
        self.tell(&event).await;
    }

    /// Parks the planned request, retrying what may succeed later (apiserver down, queue full)
    /// with capped backoff; while the queue is full, a message its plan lets pass is offered
    /// to a standing replay before each wait; `waiting` runs before each wait (to tell the
    /// broker the message is still being worked on) and the message stays in the broker
    /// meanwhile. Returns an error only for a request that can never be a record.
    pub async fn park_until_known<W, Fut>(
        &self,
        parking: &Parking,
        where_it_stays: &str,
        waiting: W,
    ) -> Result<(), ParkError>
    where
        W: Fn() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut req = parking.request().clone();
        let _turn = self.shared.in_flight.turn(&mut req).await;
        let mut attempt = 0u32;
        loop {
            if !self.shared.parking.leadership.holds() {
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
                Err(e) if e.is_backpressure() => {
                    // A standing replay started while this message waited for room: it passes
                    // now, instead of after the replay's redrives made room (a storm's first
                    // pass-through waited for 5,000 records to be redriven).
                    if self.passed_through(parking).await {
                        return Ok(());
                    }
                    // Backpressure, not a failure (maxParked, the namespace's ResourceQuota on
                    // records, the operator's --max-records): the queue's Full condition and
                    // QueueFull Event say so once. Look again soon, so parking resumes shortly
                    // after records are resolved; a used-up quota lets one create through per
                    // interval whatever the number of messages waiting (dlq_client::quota).
                    let bound = e.bound().unwrap_or_default();
                    self.shared
                        .reports
                        .metrics
                        .park_refused(self.namespace(), self.queue(), bound);
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, FULL_RECHECK);
                    tracing::debug!(namespace = %self.namespace(), queue = %self.queue(), job = %req.job.id, bound, error = %e, retry_in = ?wait, "no room for a record; the dead message stays {where_it_stays}");
                    waiting().await;
                    tokio::time::sleep(wait).await;
                    // And again before the next try: a replay that started during the wait
                    // (its redrives making room) takes it rather than a record being made.
                    if self.passed_through(parking).await {
                        return Ok(());
                    }
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

    /// A process with no standing replay: every message parks.
    struct PassesNothing;

    impl PassThrough for PassesNothing {
        fn covers_queue(&self, _: &str, _: &str) -> bool {
            false
        }
        fn would_pass(&self, _: &DeadLetterQueue, _: &ParkRequest) -> bool {
            false
        }
        fn pass<'a>(
            &'a self,
            _: &'a DeadLetterQueue,
            _: &'a ParkRequest,
            _: &'a dlq_core::api::DeadLetter,
            _: &'a [u8],
        ) -> futures::future::BoxFuture<'a, Passed> {
            Box::pin(async { Passed::No })
        }
    }

    /// A source's way in for queue `payments/relayer`, its parker's apiserver at `addr`.
    fn into_for(
        addr: std::net::SocketAddr,
        mut queue: DeadLetterQueue,
        leadership: Leadership,
        bodies: Arc<dyn Bodies>,
    ) -> ParkInto {
        let url = format!("http://{addr}").parse().expect("url");
        let client = Client::try_from(kube::Config::new(url)).expect("client");
        queue.metadata.name = Some("relayer".into());
        queue.metadata.namespace = Some("payments".into());
        let (queues, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(queue));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        ParkInto {
            shared: Shared::new(
                client.clone(),
                ParkServices {
                    parker: Parker::new(client.clone()),
                    queues,
                    jobs: JobIndex::default(),
                    leadership,
                    parking_first: ParkingFirst::default(),
                },
                Reports {
                    apiserver: Arc::new(KubeApiserver::new(client, Reporter::from("t"))),
                    metrics: Metrics::default(),
                },
                Arc::new(PassesNothing),
            )
            .with_bodies(bodies),
            key: ObjectRef::new("relayer").within("payments"),
        }
    }

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
        let leadership = Leadership::not_yet();
        let queue = DeadLetterQueue::new("relayer", Default::default());
        let into = into_for(
            addr,
            queue,
            leadership.clone(),
            Arc::new(crate::body::NoBodies),
        );
        let job = Job {
            id: "pi_0003/settle".into(),
            payload: Some("{}".into()),
            ..Job::default()
        };
        let req = ParkRequest::new("relayer", job).with_message("relayer:dead#1".to_string());
        let SourcePlan::Park(planned) = source_plan::plan(req, None, QueueSettings::default())
        else {
            panic!("a small valid job parks");
        };
        let parking = tokio::spawn(async move {
            let _ = into
                .park_until_known(&planned, "in the broker", || async {})
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

    /// The park request of a message `raw` as a broker's source reads it, or as the park
    /// endpoint reads a binary-mode CloudEvent posted with it as its body.
    fn read(kind: &str, raw: bytes::Bytes) -> (ParkRequest, bytes::Bytes) {
        if kind != "cloudevent" {
            let job = Job {
                id: format!("big-{kind}"),
                ..Job::default()
            };
            return (ParkRequest::of_message("relayer", job, &raw), raw);
        }
        let headers = [
            ("ce-specversion", "1.0"),
            ("ce-id", "e-1"),
            ("ce-source", "/s"),
        ]
        .into_iter()
        .chain([("ce-type", "t")])
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
        let post = dlq_core::cloudevent::HttpRequest {
            method: "POST",
            headers,
            body: raw,
        };
        let (_, mut events) =
            dlq_core::cloudevent::parse_within("relayer", &post, 8 << 20).expect("an event");
        let event = events.pop().expect("one event");
        (event.request, event.raw)
    }

    /// A dead message too large for any record goes to the body store from the source's own
    /// buffer, never copied whole into the job first (#48): text, binary (which a record would
    /// hold as base64) or a CloudEvent posted to the park endpoint, keeping 6 MiB holds at most
    /// a small fraction of it beside the message.
    #[tokio::test(flavor = "current_thread")]
    async fn a_large_message_goes_to_the_store_from_its_own_buffer() {
        use dlq_core::api::DeadLetterQueueSpec;
        let (bodies, spec) = crate::body::InMemory::new();
        let store = bodies.store.clone();
        let queue = DeadLetterQueue::new(
            "relayer",
            DeadLetterQueueSpec {
                bodies: Some(spec),
                ..Default::default()
            },
        );
        let apiserver = "127.0.0.1:9".parse().expect("an address");
        let into = into_for(apiserver, queue, Leadership::not_yet(), bodies);
        for (kind, byte) in [("text", b'x'), ("binary", 0xff), ("cloudevent", 0xff)] {
            let raw = bytes::Bytes::from(vec![byte; 6 << 20]);
            let before = dlq_testenv::alloc::thread::start_peak();
            let (req, raw) = read(kind, raw);
            let (parking, kept) = into
                .keep_body(req, Some(&raw), "in the broker", &|| async {})
                .await
                .expect("kept");
            let req = parking.request();
            let peak = dlq_testenv::alloc::thread::peak_above(before);
            assert!(kept.is_some(), "{kind}: kept in the store");
            assert!(
                peak < (raw.len() / 16) as isize,
                "{kind}: held {peak} bytes beside a message of {}",
                raw.len()
            );
            assert_eq!(req.job.payload, None);
            assert_eq!(req.job.payload_base64, None);
            let body = req.job.body.as_deref().expect("a reference");
            let fetched = store.fetch(&req.job.id, body).await.expect("fetched");
            assert!(fetched == raw, "{kind}: the exact bytes");
        }
    }
}
