//! The DeadLetter reconciler: carries out a signed decision exactly once.
//!
//! Steps: decide (pure, `dlq_core::decide`), then for a redrive: load the full record, requeue
//! on the target, resolve with a compare-and-swap. Redrive order is requeue first, then the
//! resourceVersion-guarded status write. A failed status write is retried alone: the process
//! remembers the broker's confirmation (`super::claims`), and a process that stops (shutdown,
//! the Lease lost) first writes what it can of those ([`flush_confirmed`]). A crash between
//! the two leaves the record Parked with its decision, so the next run enqueues again: at worst
//! one more delivery, never a lost job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use dlq_core::api::{DeadLetter, DeadLetterQueue, Job, Phase};
use dlq_core::conditions::reason;
use dlq_core::decide::{self, AfterConflict, Decision, RedriveStep};
use dlq_core::plan::{self, RequeueFailure, Write};
use dlq_core::seal::Keyring;

use super::claims::Unwritten;
use super::context::Context;
use super::error::ReconcileError;
use crate::body::open::OpenFailed;
use crate::body::payload::{self, Payloads};
use crate::state::apiserver::is_conflict;
use crate::targets::enqueue::{Destination, EnqueueError};
use crate::targets::{JobMessage, TargetError};

/// Attempts at writing a resolution before handing the record back to the work queue.
const RESOLVE_ATTEMPTS: usize = 8;

/// Why a DeadLetter reconcile failed (the requeue failing is not one: it is an outcome,
/// recorded on the record).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("DeadLetter has no namespace")]
    NoNamespace,
    #[error("reading DeadLetter {name}: {source}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of DeadLetter {name}: {source}")]
    WriteStatus {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("marking DeadLetter {name} (clearing its managed fields): {source}")]
    Mark {
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl ReconcileError for RecordError {
    fn category(&self) -> &'static str {
        match self {
            RecordError::NoNamespace => "InvalidObject",
            RecordError::Read { .. }
            | RecordError::WriteStatus { .. }
            | RecordError::Mark { .. } => "KubeApi",
        }
    }
}

type Result<T, E = RecordError> = std::result::Result<T, E>;

/// How soon a record another reconcile in this process holds is looked at again.
const CLAIMED_RETRY: Duration = Duration::from_millis(500);

pub async fn reconcile(dl: Arc<DeadLetter>, ctx: Arc<Context>) -> Result<Action> {
    let ns = dl.namespace().ok_or(RecordError::NoNamespace)?;
    // The other records controller is on it (see `super::claims`).
    let Some(_claim) = ctx.claims.claim(&dl.uid().unwrap_or_default()) else {
        return Ok(Action::requeue(CLAIMED_RETRY));
    };
    let confirmed_by = ctx.claims.confirmed_by(&decide::redrive_key(&dl));
    let action = match decide::after_confirmation(decide::for_record(&dl), confirmed_by.as_deref())
    {
        Decision::Done | Decision::Wait => Action::await_change(),
        Decision::MarkParked => mark_parked(&ctx, &dl).await?,
        Decision::Refuse { reason } => refuse(&ctx, &dl, &reason).await,
        Decision::Drop { by } => {
            attempt(&ctx, &dl, resolve(&ctx, (*dl).clone(), Phase::Dropped, &by)).await?
        }
        Decision::Redrive { .. } => {
            attempt(&ctx, &dl, redrive(&ctx, &ns, &dl, confirmed_by)).await?
        }
    };
    Ok(action)
}

/// Runs `acting` on the decision of `dl` and notes when it ended, failed or not: an attempt
/// that never ends (an await that hangs) is what the leader's stall check looks for.
async fn attempt<T>(
    ctx: &Context,
    dl: &DeadLetter,
    acting: impl std::future::Future<Output = T>,
) -> T {
    let out = acting.await;
    ctx.claims.attempted(&dl.uid().unwrap_or_default());
    out
}

/// When a reconcile acting on the decision of record `uid` last ended (see [`attempt`]).
pub fn last_attempt(ctx: &Context, uid: &str) -> Option<Instant> {
    ctx.claims.last_attempt(uid)
}

/// When a reconcile acting on any decision last ended.
pub fn latest_attempt(ctx: &Context) -> Option<Instant> {
    ctx.claims.latest_attempt()
}

/// Forgets the attempts of records `keep` says no (resolved or gone).
pub fn retain_attempts(ctx: &Context, keep: impl Fn(&str) -> bool) {
    ctx.claims.retain_attempts(keep);
}

/// Writes `write.status` as a compare-and-swap; on success carries out what follows it.
/// Returns whether the write won.
async fn write(ctx: &Context, record: &DeadLetter, write: &Write) -> Result<bool> {
    match ctx
        .apiserver
        .write_record_status(record, &write.status)
        .await
    {
        Ok(()) => {
            ctx.carry_out(record, &write.then).await;
            Ok(true)
        }
        Err(e) if is_conflict(&e) => Ok(false),
        Err(source) => Err(RecordError::WriteStatus {
            name: record.name_any(),
            source,
        }),
    }
}

/// First sight of a record ([`decide::needs_mark`]): its one write clears its managed fields,
/// guarded by its resourceVersion, so one writer wins and the record, Parked by the CRD's
/// default, no longer needs a mark; the winner announces and counts it, once. No status is
/// written: a status write can never clear managed fields (the apiserver ignores them on a
/// subresource), and the clear alone says the record was marked. While sources are busy
/// parking, marks take turns (see [`crate::state::parking_first`]).
async fn mark_parked(ctx: &Context, dl: &DeadLetter) -> Result<Action> {
    let turn = ctx.parking_first.mark_turn().await;
    tracing::debug!(name = %dl.name_any(), while_parking = turn.is_some(), "marking Parked");
    match ctx.apiserver.clear_managed_fields(dl).await {
        Ok(_) => {
            ctx.carry_out(dl, &plan::mark_parked(dl)).await;
            Ok(Action::await_change())
        }
        // It changed since it was read (a decision, another replica's mark): the watch brings
        // the new version, and a look shortly after covers a change that wakes nothing here.
        Err(e) if is_conflict(&e) => Ok(Action::requeue(Duration::from_secs(1))),
        Err(source) => Err(RecordError::Mark {
            name: dl.name_any(),
            source,
        }),
    }
}

/// An unsigned decision: Warning Event and `Ready=False`, then wait for a signed one.
async fn refuse(ctx: &Context, dl: &DeadLetter, why: &str) -> Action {
    let (effects, status) = plan::refuse(dl, why, Timestamp::now());
    ctx.carry_out(dl, &effects).await;
    if let Err(e) = ctx.apiserver.write_record_status(dl, &status).await
        && !is_conflict(&e)
    {
        tracing::warn!(name = %dl.name_any(), error = %e, "writing Ready=False (unsigned) failed");
    }
    Action::await_change()
}

/// `confirmed_by`: the signer of this redrive if a broker already confirmed its job (see
/// `super::claims`; the record's claim is held, so it cannot change during this reconcile).
async fn redrive(
    ctx: &Context,
    ns: &str,
    cached: &DeadLetter,
    confirmed_by: Option<String>,
) -> Result<Action> {
    let uid = cached.uid().unwrap_or_default();
    if ctx.claims.resolved_here(&uid) {
        // Resolved here already: this copy is stale, and the watch brings the resolution.
        return Ok(Action::await_change());
    }
    let record = match &confirmed_by {
        // Its job is on the target already: only the resolution is written, a compare-and-swap
        // on the held copy (a record sent ahead by its replay is not read again).
        Some(_) => cached.clone(),
        None => match load(ctx, ns, cached).await? {
            Some(record) => record,
            None => return Ok(Action::await_change()),
        },
    };
    let key = decide::redrive_key(&record);
    let by = match decide::after_confirmation(decide::for_record(&record), confirmed_by.as_deref())
    {
        Decision::Redrive { by } => by,
        // The decision changed or was carried out meanwhile; the watch brings the new state.
        _ => return Ok(Action::await_change()),
    };
    match decide::redrive_step(confirmed_by.is_some()) {
        RedriveStep::Enqueue => {
            if let Some(wait) = enqueue(ctx, ns, &record, &key, &by).await {
                return Ok(wait);
            }
        }
        RedriveStep::WriteStatus => {
            tracing::info!(namespace = ns, name = %record.name_any(), job = %record.spec.job.id, "the broker confirmed this redrive before; writing only its resolution");
        }
    }
    let action = resolve(ctx, record, Phase::Redriven, &by).await;
    // Forget the confirmation only once the record is done with (resolved, lost to a rival,
    // gone): a failed or still-racing status write is retried without enqueueing again.
    if matches!(&action, Ok(a) if *a == Action::await_change()) {
        ctx.claims.remember_resolved(&uid);
        ctx.claims.forget_confirmed(&key);
    }
    action
}

/// Enqueues the job of the redrive `key` and remembers the broker's confirmation. Some(action)
/// when nothing was confirmed: the reconcile ends there with that action.
async fn enqueue(
    ctx: &Context,
    ns: &str,
    record: &DeadLetter,
    key: &str,
    by: &str,
) -> Option<Action> {
    if !ctx.settings.leadership.holds() {
        // Our term on the Lease ran out (paused, or renewals failing): a standby may be
        // redriving this record now. Enqueue nothing; retry once the term is renewed.
        tracing::warn!(name = %record.name_any(), "not requeueing: this replica's lease term ran out");
        return Some(Action::requeue(Duration::from_secs(1)));
    }
    if ctx.queue(ns, &record.spec.queue).is_none() && !ctx.queues_ready().await {
        // The queue cache has not listed yet (records may stream in first): the queue is
        // not known to be missing. Ask again shortly and write nothing.
        return Some(Action::requeue(super::LIST_WAIT));
    }
    // A test hangs a reconcile here (an await that never ends) to show the leader steps down.
    crate::failpoint::hit("before-requeue").await;
    if let Err(failure) = requeue(ctx, ns, record).await {
        return Some(requeue_failed(ctx, record, failure).await);
    }
    confirmed(ctx, ns, record, key, by);
    tracing::info!(namespace = ns, name = %record.name_any(), job = %record.spec.job.id, queue = %record.spec.queue, "job requeued");
    crate::failpoint::hit("after-requeue").await;
    None
}

/// Remembers that a broker confirmed the job of `record`'s redrive `key`, signed by `by`: its
/// reconcile then writes only the resolution (see `super::claims`).
fn confirmed(ctx: &Context, ns: &str, record: &DeadLetter, key: &str, by: &str) {
    let unwritten = Unwritten {
        namespace: ns.to_string(),
        name: record.name_any(),
        by: by.to_string(),
    };
    ctx.claims.confirm(key, unwritten);
}

/// Puts `record`'s job on its queue's target ahead of its decision, for a replay that is itself
/// the signed decision (`super::ahead`): the redrive's own enqueue ([`requeue`], keyed by
/// [`decide::redrive_key`]), then the confirmation remembered as a redrive's, so that once the
/// replay signs the record its reconcile writes only the resolution, and a crash before that
/// sends the job again with the same key.
pub(super) async fn send_ahead(
    ctx: &Context,
    ns: &str,
    record: &DeadLetter,
    by: &str,
) -> Result<(), RequeueFailure> {
    requeue(ctx, ns, record).await?;
    confirmed(ctx, ns, record, &decide::redrive_key(record), by);
    Ok(())
}

/// How long a process that is stopping (shutdown, or the Lease lost) keeps trying to write the
/// resolutions of redrives a broker confirmed (see [`flush_confirmed`]).
pub const FLUSH_WINDOW: Duration = Duration::from_secs(20);

/// Pause between rounds of [`flush_confirmed`].
const FLUSH_RETRY: Duration = Duration::from_millis(250);

/// Writes the resolutions of the redrives whose job a broker confirmed but whose status write
/// has not succeeded (etcd or the apiserver away), for at most `window`. A process that exits
/// with them unwritten (the Lease is lost when the apiserver is away long enough) leaves them
/// Parked, and the next leader enqueues them again. Safe after the Lease is gone: each write is
/// a compare-and-swap on a still-Parked record, which a rival's resolution wins.
pub async fn flush_confirmed(ctx: &Context, window: Duration) {
    let deadline = Instant::now() + window;
    loop {
        let unwritten = ctx.claims.unwritten();
        if unwritten.is_empty() {
            return;
        }
        for (key, record) in &unwritten {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, flush_one(ctx, key, record)).await {
                Ok(Ok(true)) => ctx.claims.forget_confirmed(key),
                Ok(Ok(false)) | Err(_) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "writing a confirmed redrive's resolution failed; retrying")
                }
            }
        }
        if Instant::now() >= deadline {
            let left = ctx.claims.unwritten().len();
            if left > 0 {
                tracing::warn!(
                    left,
                    "stopping with confirmed redrives unresolved; the next leader enqueues them again"
                );
            }
            return;
        }
        tokio::time::sleep(FLUSH_RETRY).await;
    }
}

/// Resolves one confirmed redrive from a fresh read. True when it is done with (resolved here
/// or by a rival, gone, or no longer this redrive).
async fn flush_one(ctx: &Context, key: &str, unwritten: &Unwritten) -> Result<bool> {
    let Some(record) = ctx
        .apiserver
        .get_record(&unwritten.namespace, &unwritten.name)
        .await
        .map_err(|source| RecordError::Read {
            name: unwritten.name.clone(),
            source,
        })?
    else {
        return Ok(true);
    };
    if decide::redrive_key(&record) != key {
        return Ok(true);
    }
    match decide::after_confirmation(decide::for_record(&record), Some(&unwritten.by)) {
        Decision::Redrive { by } => {
            let uid = record.uid().unwrap_or_default();
            let done = resolve(ctx, record, Phase::Redriven, &by).await? == Action::await_change();
            if done {
                ctx.claims.remember_resolved(&uid);
            }
            Ok(done)
        }
        _ => Ok(true),
    }
}

/// The record with its payload: the cached copy when small jobs are cached whole (see
/// [`crate::run::held::strip`]), else read from the apiserver. A stale cached copy is safe: the status
/// write is a compare-and-swap. None when the record is gone.
async fn load(ctx: &Context, ns: &str, cached: &DeadLetter) -> Result<Option<DeadLetter>> {
    if cached.spec.job.has_payload() {
        return Ok(Some(cached.clone()));
    }
    let name = cached.name_any();
    ctx.apiserver
        .get_record(ns, &name)
        .await
        .map_err(|source| RecordError::Read { name, source })
}

/// Enqueues the untouched job on the record's DeadLetterQueue target and waits for the broker.
async fn requeue(ctx: &Context, ns: &str, record: &DeadLetter) -> Result<(), RequeueFailure> {
    let queue = ctx
        .queue(ns, &record.spec.queue)
        .ok_or_else(|| RequeueFailure {
            reason: reason::QUEUE_NOT_FOUND,
            message: format!(
                "DeadLetterQueue {} does not exist in this namespace; create it and the redrive proceeds",
                record.spec.queue
            ),
        })?;
    let keyring = match payload::needs_keys(&record.spec.job) {
        true => ctx.redrive.keys.load(&queue).await.keyring,
        false => Keyring::default(),
    };
    // The record's job as it was parked, whole or not at all: a record whose key is gone is
    // refused (`SealKeyMissing`) and stays Parked.
    let job = payload::opened(&record.spec.job, &keyring)
        .map_err(|e| open_failure(OpenFailed::Seal(e)))?;
    let destination = Destination::of(ctx.redrive.targets.as_ref(), &queue)
        .await
        .map_err(enqueue_failure)?;
    let _turn = ctx.redrive.body_turn(&job).await;
    let message = message_of(ctx, &queue, &job, &keyring).await?;
    let started = Instant::now();
    let result = destination
        .enqueue(message, decide::redrive_key(record))
        .await;
    ctx.metrics
        .requeue_duration
        .observe(started.elapsed().as_secs_f64());
    result.map_err(enqueue_failure)
}

/// The message a redrive sends: the job's own bytes, or its body as the body store reads it
/// back (`body::payload`: checked against the record's size and digest, opened when sealed).
/// A missing or changed object sends nothing (`BodyMissing`, `BodyCorrupt`); an external
/// body (an SQS Extended Client pointer's object) is checked, and the pointer message itself
/// is sent.
async fn message_of(
    ctx: &Context,
    queue: &DeadLetterQueue,
    job: &Job,
    keyring: &Keyring,
) -> Result<JobMessage, RequeueFailure> {
    let Some(body) = job.body.as_deref() else {
        return JobMessage::from_job(job).map_err(failure);
    };
    let sent = Payloads::of(ctx.redrive.bodies.as_ref(), queue)
        .sent(job, body, keyring)
        .await
        .map_err(open_failure)?;
    match sent {
        Some(payload) => Ok(JobMessage::with_payload(job, payload)),
        None => JobMessage::from_job(job).map_err(failure),
    }
}

/// A job or body that could not be read back: the store's reason or the seal's.
fn open_failure(e: OpenFailed) -> RequeueFailure {
    RequeueFailure {
        reason: e.reason(),
        message: e.to_string(),
    }
}

fn failure(e: TargetError) -> RequeueFailure {
    RequeueFailure {
        reason: e.reason(),
        message: e.to_string(),
    }
}

/// A record's condition says the target's own words, whichever step of the enqueue failed.
fn enqueue_failure(e: EnqueueError) -> RequeueFailure {
    failure(e.into_cause())
}

/// Keeps the record Parked, says why on a condition and a Warning Event, retries with backoff.
async fn requeue_failed(ctx: &Context, record: &DeadLetter, failure: RequeueFailure) -> Action {
    let attempt = ctx.note_failure(record).await;
    let plan = plan::requeue_failed(
        record,
        &failure,
        attempt,
        ctx.settings.backoff_cap,
        Timestamp::now(),
    );
    tracing::warn!(
        namespace = %record.namespace().unwrap_or_default(),
        name = %record.name_any(),
        job = %record.spec.job.id,
        reason = failure.reason,
        attempt,
        retry_in = ?plan.retry_in,
        "requeue failed; record stays Parked"
    );
    ctx.carry_out(record, &plan.effects).await;
    if let Some(status) = &plan.status
        && let Err(e) = ctx.apiserver.write_record_status(record, status).await
        && !is_conflict(&e)
    {
        // A conflict only means someone else wrote; the retry re-reads anyway.
        tracing::warn!(name = %record.name_any(), error = %e, "writing Requeued=False failed");
    }
    Action::requeue(plan.retry_in)
}

/// Writes the resolution guarded by resourceVersion. On 409, re-reads: if someone else
/// resolved the record we stop and count the conflict; if it is still Parked we write again.
async fn resolve(ctx: &Context, mut record: DeadLetter, phase: Phase, by: &str) -> Result<Action> {
    let ns = record.namespace().unwrap_or_default();
    let name = record.name_any();
    for _ in 0..RESOLVE_ATTEMPTS {
        let resolution = plan::resolve(&record, phase, by, Timestamp::now());
        if write(ctx, &record, &resolution).await? {
            ctx.clear_failures(&record).await;
            tracing::info!(namespace = %ns, name = %name, job = %record.spec.job.id, by, phase = phase.as_str(), "record resolved");
            return Ok(Action::await_change());
        }
        let fresh = ctx
            .apiserver
            .get_record(&ns, &name)
            .await
            .map_err(|source| RecordError::Read {
                name: name.clone(),
                source,
            })?;
        let Some(fresh) = fresh else {
            return Ok(Action::await_change());
        };
        match decide::after_conflict(fresh.phase()) {
            AfterConflict::RetryWrite => record = fresh,
            AfterConflict::Lost => {
                tracing::info!(namespace = %ns, name = %name, job = %fresh.spec.job.id, "resolution lost the race");
                ctx.carry_out(&fresh, &plan::lost_race(&fresh, phase)).await;
                return Ok(Action::await_change());
            }
        }
    }
    // Still racing after many rounds: hand it back to the queue; the remembered confirmation
    // prevents a second requeue from this process.
    Ok(Action::requeue(Duration::from_secs(1)))
}
