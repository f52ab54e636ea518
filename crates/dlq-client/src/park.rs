//! `park()`: turning a job a consumer gave up on into a `DeadLetter` record, once.
//!
//! A record is created with a plain create (POST) under the field manager `dlq-parker`: the
//! create is the atomic step that makes racing parkers safe (the loser gets AlreadyExists,
//! re-reads, and answers AlreadyParked). The parker only ever owns the parked facts, never
//! `action`/`by`/`note`, so a GitOps server-side apply of a decision does not conflict with it.
//! The operator clears the record's managed fields when it marks it (they are most of the
//! apiserver's memory a record); the first server-side apply then gives the facts to the
//! apiserver's `before-first-apply` manager, so a decision still does not conflict and another
//! value of a fact still does (and the CRD's rules keep the facts immutable anyway).
//! The rules themselves (validation, sealing, naming, cycles) are the core's: a park asks it
//! once for the whole plan (`dlq_core::park_plan::plan`) and carries that plan out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};

use dlq_core::api::{self, DeadLetter, DeadLetterQueue};
use dlq_core::capacity::{QuotaUse, quota_refusal};
use dlq_core::park::{answers_for_its_job, validate};
use dlq_core::park_plan::{AfterList, ParkPlan, Step, Unplannable};
use dlq_core::seal::SealError;

use crate::admission::{Admissions, AdmitError, Slot};
use crate::ceiling::{Ceiling, LedgerGate};
use crate::quota::HOLDS;
pub use dlq_core::park::{KnownCycle, ParkInvalid, ParkRequest};

/// Field manager of every record the parker creates (its home is `admission`, which writes the
/// queue's slot blocks under the same name and sits below this module).
pub use crate::admission::PARKER;

/// What parking did.
#[derive(Debug, Clone)]
pub enum ParkOutcome {
    /// A new record (a new cycle when earlier ones were resolved).
    Parked(Box<DeadLetter>),
    /// The job already has a Parked record; nothing changed.
    AlreadyParked(Box<DeadLetter>),
    /// This very message (same source identity) already has a record, in whatever phase:
    /// a source re-read it after a crash; nothing changed.
    SameMessage(Box<DeadLetter>),
}

impl ParkOutcome {
    pub fn record(&self) -> &DeadLetter {
        match self {
            ParkOutcome::Parked(r)
            | ParkOutcome::AlreadyParked(r)
            | ParkOutcome::SameMessage(r) => r,
        }
    }

    pub fn is_new(&self) -> bool {
        matches!(self, ParkOutcome::Parked(_))
    }
}

/// Why a park was refused. Each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error(transparent)]
    Invalid(#[from] ParkInvalid),
    #[error("unknown queue: no DeadLetterQueue {queue} in namespace {namespace}")]
    UnknownQueue { namespace: String, queue: String },
    #[error(
        "queue {queue} has {parked} parked records, at its maxParked of {limit}: resolve some, or raise spec.maxParked"
    )]
    MaxParked {
        queue: String,
        parked: i64,
        limit: i64,
    },
    /// The namespace's ResourceQuota on records is used up (the apiserver refused the create,
    /// or refused one a moment ago: see `crate::quota`).
    #[error(
        "namespace {namespace} is at its quota on records ({}): resolve records and let retention delete them, or raise the quota",
        quota.describe()
    )]
    QuotaExceeded { namespace: String, quota: QuotaUse },
    /// The operator's `--max-records` across every queue it watches is reached.
    #[error(
        "the operator keeps {in_use} records across its queues, at its --max-records of {limit}: resolve records and let retention delete them, or raise the ceiling"
    )]
    MaxRecords { in_use: i64, limit: i64 },
    /// The operator has not counted its records yet (just started): parking waits for it.
    #[error("{0}")]
    RecordsUncounted(String),
    #[error("job {0} kept changing while parking (parked and resolved concurrently); try again")]
    Busy(String),
    #[error("reserving a place under maxParked: {0}")]
    Admission(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The queue seals payloads but has no recipient in its status yet: parking plaintext
    /// would defeat the seal, so the park waits (the operator publishes it once it read the key).
    #[error(
        "queue {queue} seals payloads (spec.protection.seal) but publishes no recipient (status.protection.recipient is empty: the operator has not read its key Secret yet, or cannot); refusing to park the job in plaintext"
    )]
    NoRecipient { queue: String },
    #[error(transparent)]
    Seal(#[from] SealError),
}

impl From<Unplannable> for ParkError {
    fn from(e: Unplannable) -> Self {
        match e {
            Unplannable::Invalid(e) => ParkError::Invalid(e),
            Unplannable::NoRecipient { queue } => ParkError::NoRecipient { queue },
            Unplannable::Seal(e) => ParkError::Seal(e),
        }
    }
}

impl ParkError {
    /// Whether trying again later can succeed (the apiserver, the queue's capacity or its
    /// existence may change); the rest are properties of the message itself.
    pub fn is_transient(&self) -> bool {
        !matches!(
            self,
            ParkError::Invalid(_) | ParkError::Seal(SealError::TooLarge { .. })
        ) && self.final_refusal().is_none()
    }

    /// A bound refused the record for now (`maxParked`, a ResourceQuota on records, the
    /// operator's `--max-records`): backpressure, not a failure. The message waits where it is
    /// and parking tries again once records are resolved.
    pub fn is_backpressure(&self) -> bool {
        self.bound().is_some()
    }

    /// Which bound refused: `max_parked`, `quota`, `max_records` (or `uncounted`, the
    /// ceiling's count not made yet); None for any other error.
    pub fn bound(&self) -> Option<&'static str> {
        match self {
            ParkError::MaxParked { .. } => Some("max_parked"),
            ParkError::QuotaExceeded { .. } => Some("quota"),
            ParkError::MaxRecords { .. } => Some("max_records"),
            ParkError::RecordsUncounted(_) => Some("uncounted"),
            _ => None,
        }
    }

    /// The apiserver's words when it refused the record for good
    /// (`dlq_core::park::refusal_is_final`: 400, 413, 422): the record as asked for can never
    /// be made, however often it is retried.
    pub fn final_refusal(&self) -> Option<&str> {
        match self {
            ParkError::Kube(kube::Error::Api(s)) if dlq_core::park::refusal_is_final(s.code) => {
                Some(&s.message)
            }
            _ => None,
        }
    }
}

/// Parks jobs. (`dlq_parked_total` and the `Parked` Event come from the operator when it first
/// marks a record Parked, so parkings from any process are counted once.)
#[derive(Clone)]
pub struct Parker {
    client: Client,
    /// The DeadLetterQueues this parker read in the last [`QUEUE_READ_REUSE`]: a producer that
    /// parks a storm of jobs would otherwise read the same queue once per job.
    queues: Arc<Mutex<QueueReads>>,
    /// Slots under `maxParked`, granted in blocks per queue shared by the process's parkers.
    admissions: Admissions,
}

/// Where a park's create goes: a quota's hold lets it (`crate::quota`), or it is refused.
fn quota_gate(namespace: &str) -> Result<Option<crate::quota::Probe>, ParkError> {
    HOLDS
        .enter(namespace)
        .map_err(|quota| ParkError::QuotaExceeded {
            namespace: namespace.to_string(),
            quota,
        })
}

/// (namespace, name) → when read, and what.
type QueueReads = HashMap<(String, String), (Instant, DeadLetterQueue)>;

/// How long [`Parker::park`] reuses a DeadLetterQueue it read (its existence; the admission
/// under `maxParked` re-reads it when it proves stale, and the create stays the guard against
/// doubles).
const QUEUE_READ_REUSE: Duration = Duration::from_secs(1);

/// How a [`Parker`] works; the default is what every program wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParkOptions {
    /// Ask for the next block of slots under `maxParked` in the background while a storm
    /// spends the current one. Off only in the bench's A/B of what it buys.
    pub ask_ahead: bool,
}

impl Default for ParkOptions {
    fn default() -> Self {
        ParkOptions { ask_ahead: true }
    }
}

impl Parker {
    pub fn new(client: Client) -> Self {
        Parker::with_options(client, ParkOptions::default())
    }

    pub fn with_options(client: Client, options: ParkOptions) -> Self {
        Parker {
            client,
            queues: Arc::default(),
            admissions: Admissions::shared().asking_ahead(options.ask_ahead),
        }
    }

    /// This parker also keeps the operator's `ceiling` (`--max-records`): every block of slots
    /// is taken in its ledger first. Only the operator's own parkers are told it.
    pub fn with_ceiling(mut self, ceiling: Ceiling) -> Self {
        self.admissions = self.admissions.under(LedgerGate::shared(ceiling, PARKER));
        self
    }

    /// Validates, reads the DeadLetterQueue (reused for a second), and parks.
    pub async fn park(&self, namespace: &str, req: ParkRequest) -> Result<ParkOutcome, ParkError> {
        validate(&req)?;
        let queue = self.queue(namespace, &req.queue).await?;
        self.park_into(&queue, req).await
    }

    /// The DeadLetterQueue `name`, read at most once per [`QUEUE_READ_REUSE`]; a missing one is
    /// not remembered, so creating it takes effect at once.
    async fn queue(&self, namespace: &str, name: &str) -> Result<DeadLetterQueue, ParkError> {
        let key = (namespace.to_string(), name.to_string());
        if let Some((at, q)) = self.lock_queues().get(&key)
            && at.elapsed() < QUEUE_READ_REUSE
        {
            return Ok(q.clone());
        }
        let api: Api<DeadLetterQueue> = Api::namespaced(self.client.clone(), namespace);
        let queue = api
            .get_opt(name)
            .await?
            .ok_or_else(|| ParkError::UnknownQueue {
                namespace: namespace.into(),
                queue: name.into(),
            })?;
        let mut queues = self.lock_queues();
        queues.retain(|_, (at, _)| at.elapsed() < QUEUE_READ_REUSE);
        queues.insert(key, (Instant::now(), queue.clone()));
        Ok(queue)
    }

    fn lock_queues(&self) -> MutexGuard<'_, QueueReads> {
        // A panic while holding it leaves a plain map behind; keep using it.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parks into a queue the caller already holds (the operator's sources take it from the
    /// operator's own store). Without a view of the job's records it creates cycle 1 first
    /// and lists only when that name is taken (see `dlq_core::park::first_try`).
    pub async fn park_into(
        &self,
        queue: &DeadLetterQueue,
        req: ParkRequest,
    ) -> Result<ParkOutcome, ParkError> {
        self.park_known(queue, req, None).await
    }

    /// Parks with `known`, the job's records as the caller's watch sees them (see
    /// `dlq_core::park::first_try`): a new job costs one create instead of a list and a
    /// create; a 409 or a record no longer Parked falls back to the consistent list. The core
    /// plans the park once (`dlq_core::park_plan::plan`); this carries the plan out.
    pub async fn park_known(
        &self,
        queue: &DeadLetterQueue,
        req: ParkRequest,
        known: Option<&[KnownCycle]>,
    ) -> Result<ParkOutcome, ParkError> {
        let (plan, first) = dlq_core::park_plan::plan(queue, req, known)?;
        let records: Api<DeadLetter> = Api::namespaced(self.client.clone(), plan.namespace());
        match first {
            Step::SameMessage(name) => {
                if let Some(r) = records.get_opt(&name).await? {
                    return Ok(ParkOutcome::SameMessage(Box::new(r)));
                }
            }
            Step::Confirm(name) => {
                if let Some(r) = records.get_opt(&name).await?
                    && answers_for_its_job(r.phase(), r.spec.action)
                {
                    return Ok(ParkOutcome::AlreadyParked(Box::new(r)));
                }
            }
            Step::Create(record) => {
                if let Some(outcome) = self
                    .admit_and_create(queue, &records, &plan, *record)
                    .await?
                {
                    return Ok(outcome);
                }
            }
        }
        // The view was behind the apiserver: ask etcd.
        self.park_listing(queue, &records, &plan).await
    }

    /// Lists the job's records, then does what the plan makes of them (the next cycle, or the
    /// record that answers); consistently, since the caller's view already proved stale.
    async fn park_listing(
        &self,
        queue: &DeadLetterQueue,
        records: &Api<DeadLetter>,
        plan: &ParkPlan,
    ) -> Result<ParkOutcome, ParkError> {
        // From etcd, not the watch cache: the deterministic name makes the create the guard,
        // so two parkers of one job cannot both create a cycle.
        for _ in 0..3 {
            let lp = ListParams::default().labels(&plan.selector());
            let existing = records.list(&lp).await?.items;
            let record = match plan.after_list(&existing) {
                AfterList::SameMessage(record) => {
                    return Ok(ParkOutcome::SameMessage(Box::new(record.clone())));
                }
                AfterList::Confirm(name) => {
                    // Confirm a listed Parked: answering AlreadyParked for a record that was
                    // just resolved would lose this new death of the job.
                    match records.get_opt(&name).await? {
                        Some(r) if answers_for_its_job(r.phase(), r.spec.action) => {
                            return Ok(ParkOutcome::AlreadyParked(Box::new(r)));
                        }
                        _ => continue,
                    }
                }
                AfterList::Create(record) => *record,
            };
            if let Some(outcome) = self.admit_and_create(queue, records, plan, record).await? {
                return Ok(outcome);
            }
        }
        Err(ParkError::Busy(plan.request().job.id.clone()))
    }

    /// Takes a slot under the queue's `maxParked` (`dlq_core::capacity`), then creates the
    /// record in it, unless the slot is older than [`dlq_core::capacity::CREATE_WITHIN_SECS`]
    /// by then (the operator may already have released its block): the caller tries again.
    async fn admit_and_create(
        &self,
        queue: &DeadLetterQueue,
        records: &Api<DeadLetter>,
        plan: &ParkPlan,
        record: DeadLetter,
    ) -> Result<Option<ParkOutcome>, ParkError> {
        let req = plan.request();
        // A used-up quota: no slot taken, no create sent, but one probe at a time.
        let _probe = quota_gate(plan.namespace())?;
        let admitted_at = Instant::now();
        let slot = self
            .admissions
            .admit(&self.client, queue)
            .await
            .map_err(|e| match e {
                AdmitError::Full { in_use, limit } => ParkError::MaxParked {
                    queue: req.queue.clone(),
                    parked: in_use,
                    limit,
                },
                AdmitError::MaxRecords { in_use, limit } => ParkError::MaxRecords { in_use, limit },
                AdmitError::Uncounted(why) => ParkError::RecordsUncounted(why),
                AdmitError::Gone => ParkError::UnknownQueue {
                    namespace: queue.namespace().unwrap_or_default(),
                    queue: req.queue.clone(),
                },
                AdmitError::Kube(why) => ParkError::Admission(why),
            })?;
        let within = Duration::from_secs(dlq_core::capacity::CREATE_WITHIN_SECS.unsigned_abs());
        if admitted_at.elapsed() > within {
            return Err(ParkError::Busy(req.job.id.clone()));
        }
        let created = self.create(records, plan, record, &slot).await;
        if !matches!(created, Ok(Some(ParkOutcome::Parked(_)))) && certainly_not_created(&created) {
            self.admissions.unuse(queue, &slot);
        }
        match &created {
            Err(ParkError::QuotaExceeded { namespace, quota }) => {
                HOLDS.refused(namespace, quota.clone());
            }
            Ok(Some(ParkOutcome::Parked(_))) => HOLDS.fits(plan.namespace()),
            _ => {}
        }
        created
    }

    /// Creates `record` in `slot`. None when its name is taken by a record that does not
    /// answer for the plan's request (the view or list was stale: look again, consistently).
    async fn create(
        &self,
        records: &Api<DeadLetter>,
        plan: &ParkPlan,
        mut record: DeadLetter,
        slot: &Slot,
    ) -> Result<Option<ParkOutcome>, ParkError> {
        let cycle = record.spec.cycle;
        record
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(api::ANNOTATION_SLOT_BLOCK.into(), slot.block.clone());
        let name = record.name_any();
        let pp = PostParams {
            field_manager: Some(PARKER.into()),
            ..PostParams::default()
        };
        match records.create(&pp, &record).await {
            Ok(created) => {
                tracing::info!(namespace = ?created.namespace(), name = %name, job = %created.spec.job.id, cycle, "parked");
                Ok(Some(ParkOutcome::Parked(Box::new(created))))
            }
            // A racing parker created this cycle (then it is ours too), or the list was stale:
            // only a record the plan accepts answers for it (`ParkPlan::answered_by`).
            Err(kube::Error::Api(s)) if s.code == 409 => match records.get_opt(&name).await? {
                Some(r) if plan.answered_by(&r) => {
                    Ok(Some(ParkOutcome::AlreadyParked(Box::new(r))))
                }
                _ => Ok(None),
            },
            // The namespace's ResourceQuota on records is used up: backpressure, said as such.
            Err(kube::Error::Api(s)) if let Some(quota) = quota_refusal(s.code, &s.message) => {
                tracing::debug!(namespace = %plan.namespace(), name = %name, quota = %quota.name, "the quota on records refused the record");
                Err(ParkError::QuotaExceeded {
                    namespace: plan.namespace().to_string(),
                    quota,
                })
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Whether a create's outcome proves no record was made (the name was taken, or the apiserver
/// refused the request): only then may its slot be used again.
fn certainly_not_created(outcome: &Result<Option<ParkOutcome>, ParkError>) -> bool {
    match outcome {
        Ok(None) | Ok(Some(ParkOutcome::AlreadyParked(_))) => true,
        Ok(Some(_)) => false,
        Err(ParkError::QuotaExceeded { .. }) => true,
        Err(ParkError::Kube(kube::Error::Api(s))) => {
            (400..500).contains(&s.code) && s.code != 408 && s.code != 429
        }
        Err(_) => false,
    }
}

/// Parks one job: see [`Parker::park`].
pub async fn park(
    client: Client,
    namespace: &str,
    req: ParkRequest,
) -> Result<ParkOutcome, ParkError> {
    Parker::new(client).park(namespace, req).await
}
