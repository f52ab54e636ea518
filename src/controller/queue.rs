//! The DeadLetterQueue reconciler: counters, target readiness, retention of resolved records.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{Context, MANAGER};
use crate::api::{DeadLetter, DeadLetterQueue, Phase};
use crate::conditions::{self, Cond};
use crate::decide;
use crate::error::{Error, Result};
use crate::metrics::{PhaseLabels, QueueLabels};

/// Counts of one queue's records.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub parked: i64,
    pub redriven: i64,
    pub dropped: i64,
    pub oldest_parked_at: Option<Timestamp>,
}

/// Tallies records of one queue. Pure.
pub fn count<'a>(records: impl IntoIterator<Item = &'a DeadLetter>) -> Counts {
    let mut c = Counts::default();
    for r in records {
        match r.phase() {
            Phase::Parked => {
                c.parked += 1;
                let parked_at = r.metadata.creation_timestamp.as_ref().map(|t| t.0);
                if let Some(at) = parked_at
                    && c.oldest_parked_at.is_none_or(|o| at < o)
                {
                    c.oldest_parked_at = Some(at);
                }
            }
            Phase::Redriven => c.redriven += 1,
            Phase::Dropped => c.dropped += 1,
        }
    }
    c
}

pub async fn reconcile(queue: Arc<DeadLetterQueue>, ctx: Arc<Context>) -> Result<Action> {
    let ns = queue
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = queue.name_any();
    let records: Vec<Arc<DeadLetter>> = ctx
        .records
        .state()
        .into_iter()
        .filter(|r| r.spec.queue == name && r.namespace().as_deref() == Some(ns.as_str()))
        .collect();

    let now = Timestamp::now();
    let deleted = retain(&ctx, &queue, &ns, &records, now).await;
    let live = records
        .iter()
        .filter(|r| !deleted.contains(&r.name_any()))
        .map(|r| r.as_ref());
    let counts = count(live);

    ctx.metrics.touch_queue(&ns, &name);
    let labels = |phase: Phase| PhaseLabels {
        namespace: ns.clone(),
        queue: name.clone(),
        phase: phase.as_str().into(),
    };
    ctx.metrics
        .records
        .get_or_create(&labels(Phase::Parked))
        .set(counts.parked);
    ctx.metrics
        .records
        .get_or_create(&labels(Phase::Redriven))
        .set(counts.redriven);
    ctx.metrics
        .records
        .get_or_create(&labels(Phase::Dropped))
        .set(counts.dropped);
    let oldest_age = counts
        .oldest_parked_at
        .map(|at| now.duration_since(at).as_secs().max(0))
        .unwrap_or(0);
    ctx.metrics
        .oldest_parked_age
        .get_or_create(&QueueLabels {
            namespace: ns.clone(),
            queue: name.clone(),
        })
        .set(oldest_age);

    let (ready, reason, message, target) = match ctx.targets.get(&queue).await {
        Ok(target) => match target.probe().await {
            Ok(()) => (
                true,
                "TargetReachable",
                "target answered".to_string(),
                target.describe(),
            ),
            Err(e) => (false, e.reason(), e.to_string(), target.describe()),
        },
        Err(e) => (false, e.reason(), e.to_string(), String::new()),
    };
    let mut conds = queue
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions::set(
        &mut conds,
        Cond {
            type_: "Ready",
            status: ready,
            reason,
            message: &message,
        },
        queue.metadata.generation,
        &Time(now),
    );
    let status = json!({"status": {
        "parked": counts.parked,
        "redriven": counts.redriven,
        "dropped": counts.dropped,
        "oldestParkedAt": counts.oldest_parked_at.map(Time),
        "target": target,
        "observedGeneration": queue.metadata.generation,
        "conditions": conds,
    }});
    let api: Api<DeadLetterQueue> = Api::namespaced(ctx.client.clone(), &ns);
    api.patch_status(&name, &PatchParams::apply(MANAGER), &Patch::Merge(status))
        .await?;
    Ok(Action::requeue(ctx.settings.queue_resync))
}

/// Deletes resolved records older than `retention.resolvedFor`; never a Parked one. Returns the
/// names deleted.
async fn retain(
    ctx: &Context,
    queue: &DeadLetterQueue,
    ns: &str,
    records: &[Arc<DeadLetter>],
    now: Timestamp,
) -> Vec<String> {
    let Some(keep) = queue
        .spec
        .retention
        .as_ref()
        .and_then(|r| decide::parse_duration(&r.resolved_for))
    else {
        return Vec::new();
    };
    let api: Api<DeadLetter> = Api::namespaced(ctx.client.clone(), ns);
    let mut deleted = Vec::new();
    for r in records {
        let resolved_at = r
            .status
            .as_ref()
            .and_then(|s| s.resolved_at.as_ref())
            .map(|t| t.0);
        if !decide::retention_expired(r.phase(), resolved_at, keep, now) {
            continue;
        }
        let name = r.name_any();
        // Guarded by uid + resourceVersion: we delete exactly the resolved version we looked at.
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: r.uid(),
                resource_version: r.resource_version(),
            }),
            ..DeleteParams::default()
        };
        match api.delete(&name, &dp).await {
            Ok(_) => {
                tracing::info!(namespace = ns, name = %name, job = %r.spec.job.id, phase = r.phase().as_str(), "retention deleted resolved record");
                deleted.push(name);
            }
            Err(e) => {
                tracing::debug!(namespace = ns, name = %name, error = %e, "retention delete skipped")
            }
        }
    }
    deleted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DeadLetterSpec, DeadLetterStatus, FailureKind, Job};

    fn record(phase: Option<Phase>, created: i64) -> DeadLetter {
        let mut r = DeadLetter::new(
            "r",
            DeadLetterSpec {
                queue: "q".into(),
                cycle: 1,
                job: Job {
                    id: "j".into(),
                    ..Job::default()
                },
                intent: None,
                deliveries: 1,
                reason: String::new(),
                failure_kind: FailureKind::Transient,
                service_version: None,
                failed_at: Time(Timestamp::from_second(created).unwrap()),
                action: None,
                by: None,
                note: None,
            },
        );
        r.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        r.status = phase.map(|p| DeadLetterStatus {
            phase: Some(p),
            ..Default::default()
        });
        r
    }

    #[test]
    fn counts_treat_unwritten_phase_as_parked() {
        let rs = [
            record(None, 300),
            record(Some(Phase::Parked), 100),
            record(Some(Phase::Redriven), 50),
            record(Some(Phase::Dropped), 10),
        ];
        let c = count(rs.iter());
        assert_eq!((c.parked, c.redriven, c.dropped), (2, 1, 1));
        assert_eq!(
            c.oldest_parked_at,
            Some(Timestamp::from_second(100).unwrap())
        );
        assert_eq!(count([].iter()), Counts::default());
    }
}
