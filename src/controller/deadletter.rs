//! The DeadLetter reconciler: carries out a signed decision exactly once.
//!
//! Redrive order is requeue first, then a resourceVersion-guarded status write. A crash between
//! the two leaves the record Parked with its decision, so the next run enqueues again: at worst
//! one more delivery, never a lost job.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{Context, MANAGER, event};
use crate::api::{DeadLetter, Phase};
use crate::conditions::{self, Cond};
use crate::decide::{self, AfterConflict, Plan};
use crate::error::{Error, Result};
use crate::queue::{JobMessage, QueueError};

/// Attempts at writing a resolution before handing the record back to the work queue.
const RESOLVE_ATTEMPTS: usize = 8;

pub async fn reconcile(dl: Arc<DeadLetter>, ctx: Arc<Context>) -> Result<Action> {
    let ns = dl
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = dl.name_any();
    let api: Api<DeadLetter> = Api::namespaced(ctx.client.clone(), &ns);
    let status_phase = dl.status.as_ref().and_then(|s| s.phase);
    let plan = decide::decide(status_phase, dl.spec.action, dl.spec.by.as_deref());
    match plan {
        Plan::Done | Plan::Wait => Ok(Action::await_change()),
        Plan::MarkParked => {
            let mut conds = current_conditions(&dl);
            conditions::set(
                &mut conds,
                Cond {
                    type_: "Ready",
                    status: true,
                    reason: "Parked",
                    message: "waiting for a signed decision (spec.action + spec.by)",
                },
                dl.metadata.generation,
                &now(),
            );
            let patch = json!({"status": {"phase": Phase::Parked, "conditions": conds}});
            match write_status(&api, &dl, patch).await {
                Ok(()) => {
                    // Counted and announced here, once per record (the CAS has one winner),
                    // whoever parked it: the CLI, a producer's park() call, or a bridge. Alerts
                    // see every parking, and producers need no Events permission.
                    ctx.metrics
                        .parked
                        .get_or_create(&crate::metrics::ParkedLabels {
                            namespace: ns.clone(),
                            queue: dl.spec.queue.clone(),
                            failure_kind: dl.spec.failure_kind.label().into(),
                        })
                        .inc();
                    let note = format!(
                        "{} parked ({}, cycle {}, {} deliveries): {}",
                        dl.spec.job.id,
                        dl.spec.failure_kind.label(),
                        dl.spec.cycle,
                        dl.spec.deliveries,
                        dl.spec.reason
                    );
                    ctx.publish_once(&*dl, event(EventType::Warning, "Parked", "Park", note))
                        .await;
                    Ok(Action::await_change())
                }
                // Someone else wrote first; the watch brings their version.
                // Someone else wrote first: look again shortly (status-only changes do not
                // wake this controller).
                Err(e) if e.is_conflict() => Ok(Action::requeue(std::time::Duration::from_secs(1))),
                Err(e) => Err(e),
            }
        }
        Plan::Refuse { reason } => {
            ctx.publish(
                &*dl,
                event(
                    EventType::Warning,
                    "DecisionRefused",
                    "Resolve",
                    reason.clone(),
                ),
            )
            .await;
            let mut conds = current_conditions(&dl);
            conditions::set(
                &mut conds,
                Cond {
                    type_: "Ready",
                    status: false,
                    reason: "Unsigned",
                    message: &reason,
                },
                dl.metadata.generation,
                &now(),
            );
            let _ = write_status(&api, &dl, json!({"status": {"conditions": conds}})).await;
            Ok(Action::await_change())
        }
        Plan::Drop { by } => resolve(&ctx, &api, (*dl).clone(), Phase::Dropped, &by).await,
        Plan::Redrive { .. } => redrive(&ctx, &api, &ns, &name, &dl).await,
    }
}

async fn redrive(
    ctx: &Context,
    api: &Api<DeadLetter>,
    ns: &str,
    name: &str,
    cached: &DeadLetter,
) -> Result<Action> {
    // Small jobs are cached whole (see `strip`); a large payload is read from the apiserver.
    // A stale cached copy is safe: the status write is a compare-and-swap.
    let record = if cached.spec.job.has_payload() {
        cached.clone()
    } else {
        match api.get_opt(name).await? {
            Some(r) => r,
            None => return Ok(Action::await_change()),
        }
    };
    let uid = record.uid().unwrap_or_default();
    let by = match decide::decide(
        record.status.as_ref().and_then(|s| s.phase),
        record.spec.action,
        record.spec.by.as_deref(),
    ) {
        Plan::Redrive { by } => by,
        // The decision changed or was carried out meanwhile; the watch brings the new state.
        _ => return Ok(Action::await_change()),
    };
    let queue_name = record.spec.queue.clone();

    if !ctx.enqueued.lock().await.contains(&uid) {
        if let Err(err) = requeue(ctx, ns, &record).await {
            return requeue_failed(ctx, api, &record, err).await;
        }
        ctx.enqueued.lock().await.insert(uid.clone());
        tracing::info!(namespace = ns, name, job = %record.spec.job.id, queue = %queue_name, "job requeued");
        crate::failpoint::hit("after-requeue").await;
    }
    let action = resolve(ctx, api, record, Phase::Redriven, &by).await;
    ctx.enqueued.lock().await.remove(&uid);
    action
}

/// Enqueues the untouched job on the record's DeadLetterQueue target and waits for the broker.
async fn requeue(ctx: &Context, ns: &str, record: &DeadLetter) -> Result<(), RequeueError> {
    let queue = ctx
        .queue(ns, &record.spec.queue)
        .await
        .map_err(|e| RequeueError::Kube(Error::Kube(e)))?
        .ok_or_else(|| RequeueError::QueueMissing(record.spec.queue.clone()))?;
    let target = ctx.targets.get(&queue).await.map_err(RequeueError::Queue)?;
    let message = JobMessage::from_job(&record.spec.job).map_err(RequeueError::Queue)?;
    let started = Instant::now();
    let result = target.requeue(&message).await;
    ctx.metrics
        .requeue_duration
        .observe(started.elapsed().as_secs_f64());
    result.map_err(RequeueError::Queue)
}

enum RequeueError {
    QueueMissing(String),
    Queue(QueueError),
    Kube(Error),
}

impl RequeueError {
    fn reason(&self) -> &'static str {
        match self {
            RequeueError::QueueMissing(_) => "QueueNotFound",
            RequeueError::Queue(e) => e.reason(),
            RequeueError::Kube(_) => "KubeApi",
        }
    }

    fn message(&self) -> String {
        match self {
            RequeueError::QueueMissing(q) => {
                format!(
                    "DeadLetterQueue {q} does not exist in this namespace; create it and the redrive proceeds"
                )
            }
            RequeueError::Queue(e) => e.to_string(),
            RequeueError::Kube(e) => e.to_string(),
        }
    }
}

/// Keeps the record Parked, says why on a condition and a Warning Event, retries with backoff.
async fn requeue_failed(
    ctx: &Context,
    api: &Api<DeadLetter>,
    record: &DeadLetter,
    err: RequeueError,
) -> Result<Action> {
    let uid = record.uid().unwrap_or_default();
    let attempt = ctx.note_failure(&uid).await;
    let wait = decide::backoff(attempt.saturating_sub(1), ctx.settings.backoff_cap);
    // The message stays the same from one attempt to the next: an unchanged condition is not
    // rewritten (a write would wake the watch and defeat the backoff), and identical Events
    // are aggregated by the recorder into one series with a count.
    let message = err.message();
    tracing::warn!(
        namespace = %record.namespace().unwrap_or_default(),
        name = %record.name_any(),
        job = %record.spec.job.id,
        reason = err.reason(),
        attempt,
        retry_in = ?wait,
        "requeue failed; record stays Parked"
    );
    ctx.metrics.redrive(
        &record.namespace().unwrap_or_default(),
        &record.spec.queue,
        "failure",
    );
    ctx.publish(
        record,
        event(
            EventType::Warning,
            "RequeueFailed",
            "Redrive",
            message.clone(),
        ),
    )
    .await;
    let unchanged = record
        .status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, "Requeued"))
        .is_some_and(|c| {
            c.status == "False"
                && c.reason == err.reason()
                && c.message == conditions::truncate(&message, conditions::MAX_MESSAGE)
                && c.observed_generation == record.metadata.generation
        });
    if unchanged {
        return Ok(Action::requeue(wait));
    }
    let mut conds = current_conditions(record);
    conditions::set(
        &mut conds,
        Cond {
            type_: "Requeued",
            status: false,
            reason: err.reason(),
            message: &message,
        },
        record.metadata.generation,
        &now(),
    );
    // Best effort: a conflict here only means someone else wrote; the retry re-reads anyway.
    let mut patch = json!({"status": {"conditions": conds}});
    if record.status.as_ref().and_then(|s| s.phase).is_none() {
        patch["status"]["phase"] = json!(Phase::Parked);
    }
    if let Err(e) = write_status(api, record, patch).await
        && !e.is_conflict()
    {
        tracing::warn!(error = %e, "writing Requeued=False failed");
    }
    Ok(Action::requeue(wait))
}

/// Writes the resolution guarded by resourceVersion. On 409, re-reads: if someone else
/// resolved the record we stop and count the conflict; if it is still Parked we write again.
async fn resolve(
    ctx: &Context,
    api: &Api<DeadLetter>,
    mut record: DeadLetter,
    phase: Phase,
    by: &str,
) -> Result<Action> {
    let ns = record.namespace().unwrap_or_default();
    let name = record.name_any();
    let queue = record.spec.queue.clone();
    for _ in 0..RESOLVE_ATTEMPTS {
        let at = now();
        let mut conds = current_conditions(&record);
        let verb = phase.as_str().to_lowercase();
        let message = format!("{verb} by {by}");
        conditions::set(
            &mut conds,
            Cond {
                type_: "Ready",
                status: true,
                reason: phase.as_str(),
                message: &message,
            },
            record.metadata.generation,
            &at,
        );
        if phase == Phase::Redriven {
            conditions::set(
                &mut conds,
                Cond {
                    type_: "Requeued",
                    status: true,
                    reason: "Requeued",
                    message: "the broker confirmed the job",
                },
                record.metadata.generation,
                &at,
            );
        }
        let patch = json!({"status": {
            "phase": phase,
            "resolvedBy": by,
            "resolvedAt": at,
            "observedGeneration": record.metadata.generation,
            "conditions": conds,
        }});
        match write_status(api, &record, patch).await {
            Ok(()) => {
                ctx.clear_failures(&record.uid().unwrap_or_default()).await;
                match phase {
                    Phase::Redriven => ctx.metrics.redrive(&ns, &queue, "success"),
                    _ => {
                        ctx.metrics
                            .drops
                            .get_or_create(&crate::metrics::QueueLabels {
                                namespace: ns.clone(),
                                queue: queue.clone(),
                            })
                            .inc();
                    }
                }
                let mut note = format!("{} {verb} by {by}", record.spec.job.id);
                if let Some(n) = record.spec.note.as_deref().filter(|n| !n.is_empty()) {
                    note.push_str(&format!(": {n}"));
                }
                tracing::info!(namespace = %ns, name = %name, job = %record.spec.job.id, by, phase = phase.as_str(), "record resolved");
                ctx.publish(
                    &record,
                    event(EventType::Normal, phase.as_str(), "Resolve", note),
                )
                .await;
                return Ok(Action::await_change());
            }
            Err(e) if e.is_conflict() => {
                let Some(fresh) = api.get_opt(&name).await? else {
                    return Ok(Action::await_change());
                };
                match decide::after_conflict(fresh.phase()) {
                    AfterConflict::RetryWrite => record = fresh,
                    AfterConflict::Lost => {
                        let winner = fresh
                            .status
                            .as_ref()
                            .and_then(|s| s.resolved_by.clone())
                            .unwrap_or_default();
                        if phase == Phase::Redriven {
                            ctx.metrics.redrive(&ns, &queue, "conflict");
                        }
                        tracing::info!(namespace = %ns, name = %name, job = %fresh.spec.job.id, "resolution lost the race");
                        ctx.publish(
                            &fresh,
                            event(
                                EventType::Normal,
                                "ResolveConflict",
                                "Resolve",
                                format!(
                                    "already {} by {winner}; this resolver ({}) lost the race",
                                    fresh.phase().as_str().to_lowercase(),
                                    phase.as_str().to_lowercase()
                                ),
                            ),
                        )
                        .await;
                        return Ok(Action::await_change());
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
    // Still racing after many rounds: hand it back to the queue; the enqueued-set prevents a
    // second requeue from this process.
    Ok(Action::requeue(std::time::Duration::from_secs(1)))
}

/// Status merge patch guarded by the record's resourceVersion (the compare-and-swap).
async fn write_status(
    api: &Api<DeadLetter>,
    record: &DeadLetter,
    mut patch: serde_json::Value,
) -> Result<()> {
    let rv = record
        .resource_version()
        .ok_or(Error::MissingField("metadata.resourceVersion"))?;
    patch["metadata"] = json!({"resourceVersion": rv});
    api.patch_status(
        &record.name_any(),
        &PatchParams::apply(MANAGER),
        &Patch::Merge(patch),
    )
    .await?;
    Ok(())
}

fn current_conditions(
    record: &DeadLetter,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    record
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default()
}

fn now() -> Time {
    Time(jiff::Timestamp::now())
}
