//! The whole outcome of a reconcile, as data: the status to write (typed, no hand-typed JSON),
//! the Events to publish and the metric changes. The operator carries a plan out; tests feed a
//! record in and assert the plan that comes out.
//!
//! Every status write is a compare-and-swap on the record's resourceVersion. Effects that must
//! happen once per transition (the resolution counters) are in [`Write::then`]: carried out
//! only when the write won; the `Parked` Event and count follow the mark's write the same way
//! ([`mark_parked`]).

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::capacity;
use crate::conditions::{self, Cond, reason};
use crate::dead_letter::{Action, DeadLetter, DeadLetterStatus, FailureKind, Phase};
use crate::events::{self, EventPlan};
use crate::facts::Facts;
use crate::queue::{DeadLetterQueue, DeadLetterQueueStatus, KindCounts};

/// Outcome of a redrive as `dlq_redrives_total{result}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RedriveResult {
    Success,
    Failure,
    Conflict,
}

impl RedriveResult {
    pub const ALL: [RedriveResult; 3] = [Self::Success, Self::Failure, Self::Conflict];

    pub fn label(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Conflict => "conflict",
        }
    }
}

/// Counts of one queue's records.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub parked: i64,
    pub redriven: i64,
    pub dropped: i64,
    pub oldest_parked_at: Option<Timestamp>,
    /// The same per failure kind (`Transient`, `Invalid`); empty inside a kind's own counts.
    pub kinds: BTreeMap<&'static str, Counts>,
}

impl Counts {
    fn add(&mut self, r: &impl Facts) {
        match r.phase() {
            Phase::Parked => {
                self.parked += 1;
                if let Some(at) = r.created()
                    && self.oldest_parked_at.is_none_or(|o| at < o)
                {
                    self.oldest_parked_at = Some(at);
                }
            }
            Phase::Redriven => self.redriven += 1,
            Phase::Dropped => self.dropped += 1,
        }
    }

    /// As the queue's status holds one kind.
    fn kind_status(&self) -> KindCounts {
        KindCounts {
            parked: self.parked,
            redriven: self.redriven,
            dropped: self.dropped,
            oldest_parked_at: self.oldest_parked_at.map(Time),
        }
    }
}

/// A change to the operator's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricChange {
    /// `dlq_parked_total` + 1.
    Parked {
        namespace: String,
        queue: String,
        failure_kind: FailureKind,
    },
    /// `dlq_redrives_total{result}` + 1.
    Redrive {
        namespace: String,
        queue: String,
        result: RedriveResult,
    },
    /// `dlq_drops_total` + 1.
    Dropped { namespace: String, queue: String },
    /// `dlq_records{phase}` and `dlq_oldest_parked_age_seconds` set from a fresh tally (and every
    /// counter series of the queue created at 0, so a first increase is visible to `rate()`).
    QueueGauges {
        namespace: String,
        queue: String,
        counts: Counts,
        oldest_parked_age_secs: i64,
    },
}

/// What to do after a reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Nothing until the object changes.
    AwaitChange,
    /// Look again after this long.
    RequeueAfter(Duration),
}

/// Events and metric changes to carry out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    pub events: Vec<EventPlan>,
    pub metrics: Vec<MetricChange>,
}

/// A status compare-and-swap, and what follows once it won.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    /// Sent as a merge patch: fields left `None` are not touched.
    pub status: DeadLetterStatus,
    /// Carried out only when the write succeeded.
    pub then: Effects,
}

/// Where a record stands, for the plans that need its identity.
struct Subject<'a> {
    namespace: String,
    queue: &'a str,
    job: &'a str,
}

fn subject(record: &DeadLetter) -> Subject<'_> {
    Subject {
        namespace: record.metadata.namespace.clone().unwrap_or_default(),
        queue: &record.spec.queue,
        job: &record.spec.job.id,
    }
}

fn conditions_of(record: &DeadLetter) -> Vec<Condition> {
    record
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default()
}

fn with_condition(record: &DeadLetter, cond: Cond<'_>, now: Timestamp) -> Vec<Condition> {
    let mut list = conditions_of(record);
    conditions::set(&mut list, cond, record.metadata.generation, &Time(now));
    list
}

/// What follows the mark of a new record ([`crate::decide::needs_mark`]) once its one write won:
/// announce it and count it (whoever parked it: the CLI, a producer's `park()`, or a source).
/// The write itself is no status: it clears the record's managed fields, guarded by its
/// resourceVersion (one winner), and the record reads Parked by the CRD's default.
pub fn mark_parked(record: &DeadLetter) -> Effects {
    let s = subject(record);
    let spec = &record.spec;
    let note = format!(
        "{} parked ({}, cycle {}, {} deliveries): {}",
        spec.job.id,
        spec.failure_kind.label(),
        spec.cycle,
        spec.deliveries,
        spec.reason
    );
    Effects {
        events: vec![EventPlan::warning(events::reason::PARKED, events::action::PARK, note).once()],
        metrics: vec![MetricChange::Parked {
            namespace: s.namespace,
            queue: s.queue.to_string(),
            failure_kind: spec.failure_kind,
        }],
    }
}

/// An unsigned decision (only reachable with a CRD older than the operator): say so on the
/// record and in a Warning Event.
pub fn refuse(record: &DeadLetter, why: &str, now: Timestamp) -> (Effects, DeadLetterStatus) {
    let effects = Effects {
        events: vec![EventPlan::warning(
            events::reason::DECISION_REFUSED,
            events::action::RESOLVE,
            why,
        )],
        metrics: Vec::new(),
    };
    let status = DeadLetterStatus {
        conditions: with_condition(
            record,
            Cond {
                type_: conditions::READY,
                status: false,
                reason: reason::UNSIGNED,
                message: why,
            },
            now,
        ),
        ..DeadLetterStatus::default()
    };
    (effects, status)
}

/// Why a requeue failed, as a condition reason and a message for the person reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequeueFailure {
    pub reason: &'static str,
    pub message: String,
}

/// A failed requeue: the record stays Parked, `Requeued=False` says why, a Warning Event and
/// the failure counter record it, and the record is retried after `retry_in`.
#[derive(Debug, Clone, PartialEq)]
pub struct FailurePlan {
    pub effects: Effects,
    /// None when the record already says exactly this: rewriting an unchanged condition would
    /// wake the watch and defeat the backoff.
    pub status: Option<DeadLetterStatus>,
    pub retry_in: Duration,
}

/// The plan after the `attempt`-th consecutive requeue failure of `record`.
pub fn requeue_failed(
    record: &DeadLetter,
    failure: &RequeueFailure,
    attempt: u32,
    backoff_cap: Duration,
    now: Timestamp,
) -> FailurePlan {
    let s = subject(record);
    // The message stays the same from one attempt to the next, so identical Events aggregate
    // into one series with a count and the condition is not rewritten.
    let effects = Effects {
        events: vec![EventPlan::warning(
            events::reason::REQUEUE_FAILED,
            events::action::REDRIVE,
            &failure.message,
        )],
        metrics: vec![MetricChange::Redrive {
            namespace: s.namespace,
            queue: s.queue.to_string(),
            result: RedriveResult::Failure,
        }],
    };
    let unchanged = record
        .status
        .as_ref()
        .and_then(|st| conditions::find(&st.conditions, conditions::REQUEUED))
        .is_some_and(|c| {
            c.status == "False"
                && c.reason == failure.reason
                && c.message == conditions::truncate(&failure.message, conditions::MAX_MESSAGE)
                && c.observed_generation == record.metadata.generation
        });
    let status = (!unchanged).then(|| DeadLetterStatus {
        phase: record
            .status
            .as_ref()
            .and_then(|st| st.phase)
            .or(Some(Phase::Parked)),
        conditions: with_condition(
            record,
            Cond {
                type_: conditions::REQUEUED,
                status: false,
                reason: failure.reason,
                message: &failure.message,
            },
            now,
        ),
        ..DeadLetterStatus::default()
    });
    FailurePlan {
        effects,
        status,
        retry_in: crate::decide::backoff(attempt.saturating_sub(1), backoff_cap),
    }
}

/// The resolution of `record` as `phase` (Redriven or Dropped), signed by `by`.
pub fn resolve(record: &DeadLetter, phase: Phase, by: &str, now: Timestamp) -> Write {
    let s = subject(record);
    let verb = phase.as_str().to_lowercase();
    let message = format!("{verb} by {by}");
    let mut conds = with_condition(
        record,
        Cond {
            type_: conditions::READY,
            status: true,
            reason: phase.as_str(),
            message: &message,
        },
        now,
    );
    // A drop that came after the broker confirmed the redrive (see
    // `decide::after_confirmation`): the record says what happened, and a Warning says why.
    let late_drop = phase == Phase::Redriven && record.spec.action == Some(Action::Drop);
    if phase == Phase::Redriven {
        let (reason, message) = if late_drop {
            (
                reason::REQUEUED_BEFORE_DROP,
                "the broker confirmed the job before the decision changed to drop",
            )
        } else {
            (reason::REQUEUED, "the broker confirmed the job")
        };
        conditions::set(
            &mut conds,
            Cond {
                type_: conditions::REQUEUED,
                status: true,
                reason,
                message,
            },
            record.metadata.generation,
            &Time(now),
        );
    }
    let mut note = format!("{} {verb} by {by}", s.job);
    if let Some(n) = record.spec.note.as_deref().filter(|n| !n.is_empty()) {
        note.push_str(": ");
        note.push_str(n);
    }
    let (event_reason, metric) = match phase {
        Phase::Redriven => (
            events::reason::REDRIVEN,
            MetricChange::Redrive {
                namespace: s.namespace,
                queue: s.queue.to_string(),
                result: RedriveResult::Success,
            },
        ),
        _ => (
            events::reason::DROPPED,
            MetricChange::Dropped {
                namespace: s.namespace,
                queue: s.queue.to_string(),
            },
        ),
    };
    let mut events = vec![EventPlan::normal(
        event_reason,
        events::action::RESOLVE,
        note,
    )];
    if late_drop {
        let dropper = record.spec.by.as_deref().unwrap_or_default();
        events.push(EventPlan::warning(
            events::reason::DECISION_TOO_LATE,
            events::action::RESOLVE,
            format!(
                "{}: the drop by {dropper} came after the broker confirmed the redrive by {by}; \
                 the job is on its target, so the record is Redriven",
                s.job
            ),
        ));
    }
    Write {
        status: DeadLetterStatus {
            phase: Some(phase),
            resolved_by: Some(by.to_string()),
            resolved_at: Some(Time(now)),
            observed_generation: record.metadata.generation,
            conditions: conds,
        },
        then: Effects {
            events,
            metrics: vec![metric],
        },
    }
}

/// Our resolution as `phase` lost the compare-and-swap to another resolver, who left `fresh`.
pub fn lost_race(fresh: &DeadLetter, phase: Phase) -> Effects {
    let s = subject(fresh);
    let winner = fresh
        .status
        .as_ref()
        .and_then(|st| st.resolved_by.clone())
        .unwrap_or_default();
    let note = format!(
        "already {} by {winner}; this resolver ({}) lost the race",
        fresh.phase().as_str().to_lowercase(),
        phase.as_str().to_lowercase()
    );
    let metrics = match phase {
        Phase::Redriven => vec![MetricChange::Redrive {
            namespace: s.namespace,
            queue: s.queue.to_string(),
            result: RedriveResult::Conflict,
        }],
        _ => Vec::new(),
    };
    Effects {
        events: vec![EventPlan::normal(
            events::reason::RESOLVE_CONFLICT,
            events::action::RESOLVE,
            note,
        )],
        metrics,
    }
}

/// Tallies records of one queue.
pub fn count<'a, R: Facts + 'a>(records: impl IntoIterator<Item = &'a R>) -> Counts {
    let mut c = Counts::default();
    for kind in FailureKind::ALL {
        c.kinds.insert(kind.as_str(), Counts::default());
    }
    for r in records {
        c.add(r);
        c.kinds.entry(r.failure_kind().as_str()).or_default().add(r);
    }
    c
}

/// Resolved records of a queue past its `retention.resolvedFor` at `now`; never a Parked one.
/// A job's cycle 1 goes last, once it is the job's only record: then "no cycle 1" means "no
/// records of this job", and a parker without a view of the job can create cycle 1 first
/// (one request) instead of listing the job's records (two).
pub fn expired<'a, R: Facts + 'a>(
    queue: &DeadLetterQueue,
    records: impl IntoIterator<Item = &'a R>,
    now: Timestamp,
) -> Vec<&'a R> {
    let Some(keep) = queue
        .spec
        .retention
        .as_ref()
        .and_then(|r| crate::duration::parse_duration(&r.resolved_for))
    else {
        return Vec::new();
    };
    let records: Vec<&R> = records.into_iter().collect();
    let mut per_job: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for r in &records {
        *per_job.entry(r.job_id()).or_default() += 1;
    }
    records
        .into_iter()
        .filter(|r| {
            let last_of_job = per_job.get(r.job_id()) == Some(&1);
            crate::decide::retention_expired(r.phase(), r.resolved_at(), keep, now)
                && (r.cycle() > 1 || last_of_job)
        })
        .collect()
}

/// Whether a queue's target answered, for its `Ready` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    pub reason: &'static str,
    pub message: String,
    /// The target in words (no credentials), for `kubectl get dlq`.
    pub target: String,
}

/// A queue's status write, sent as a merge patch without a resourceVersion (parkers add
/// `blocks` concurrently). Unlike a record's, every field is sent: `oldestParkedAt: null`
/// clears it once nothing is parked; `blocks` holds only the blocks it reckons, so blocks
/// added meanwhile survive.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatusWrite {
    pub parked: i64,
    pub redriven: i64,
    pub dropped: i64,
    pub oldest_parked_at: Option<Time>,
    pub target: String,
    pub observed_generation: Option<i64>,
    pub conditions: Vec<Condition>,
    pub failure_kinds: BTreeMap<String, KindCounts>,
    /// Blocks of slots: `{"counted": n}` merged into a block, or null to remove it.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub blocks: BTreeMap<String, Option<BlockCount>>,
    /// Where to POST events to park them ([`address`]); null removes it.
    pub address: Option<crate::queue::Address>,
    /// Sealing recipients and records per recipient ([`crate::seal::protection_write`]);
    /// null removes it.
    pub protection: Option<crate::seal::ProtectionWrite>,
    /// `Some(None)` (null) removes a `status.backlog` left by a source the queue no longer
    /// has; otherwise left out: the backlog's own writer keeps it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backlog: Option<Option<crate::queue::QueueBacklog>>,
}

/// The longest `status.address.CACerts` published: a bundle of a few PEM certificates.
pub const MAX_CA_CERTS: usize = 65_536;

/// A queue's `status.address` (Knative's Addressable duck type): its path at the park
/// endpoint's advertised base URL `park_url`, once the queue accepts HTTP (`spec.http`) and the
/// operator serves the endpoint; with `ca_certs`, the PEM of the CA that issued the endpoint's
/// certificate (left out when it is not PEM or not under [`MAX_CA_CERTS`]).
pub fn address(
    queue: &DeadLetterQueue,
    park_url: Option<&str>,
    ca_certs: Option<&str>,
) -> Option<crate::queue::Address> {
    let base = park_url?.trim_end_matches('/');
    let audience = queue.http_audience()?;
    let path = crate::queue::park_path(
        queue.metadata.namespace.as_deref().unwrap_or_default(),
        queue.metadata.name.as_deref().unwrap_or_default(),
    );
    let ca_certs = ca_certs
        .map(str::trim)
        .filter(|pem| pem.starts_with("-----BEGIN CERTIFICATE-----") && pem.len() < MAX_CA_CERTS)
        .map(|pem| format!("{pem}\n"));
    Some(crate::queue::Address {
        url: format!("{base}{path}"),
        audience: Some(audience),
        ca_certs,
    })
}

/// The part of a block the operator writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BlockCount {
    pub counted: i64,
}

/// The plan of one DeadLetterQueue reconcile: its status, its gauges, and the Event when it
/// becomes full.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePlan {
    pub status: QueueStatusWrite,
    pub metrics: Vec<MetricChange>,
    pub events: Vec<EventPlan>,
}

/// The status and gauges of `queue`, given its live records' `counts`, the blocks those
/// counts reckon (`dlq_core::capacity`, from the same snapshot) and its target's
/// `readiness`.
pub fn queue_status(
    queue: &DeadLetterQueue,
    counts: Counts,
    reckoned: capacity::Reckoning,
    readiness: Readiness,
    bounds: &capacity::Bounds,
    now: Timestamp,
) -> QueuePlan {
    let status = queue.status.as_ref();
    let mut conds = status
        .map(|s: &DeadLetterQueueStatus| s.conditions.clone())
        .unwrap_or_default();
    conditions::set(
        &mut conds,
        Cond {
            type_: conditions::READY,
            status: readiness.ready,
            reason: readiness.reason,
            message: &readiness.message,
        },
        queue.metadata.generation,
        &Time(now),
    );
    let reserved = reckoned.left(status);
    let events = fullness(queue, &mut conds, counts.parked + reserved, bounds, now);
    let oldest_parked_age_secs = counts
        .oldest_parked_at
        .map(|at| now.duration_since(at).as_secs().max(0))
        .unwrap_or(0);
    let metrics = vec![MetricChange::QueueGauges {
        namespace: queue.metadata.namespace.clone().unwrap_or_default(),
        queue: queue.metadata.name.clone().unwrap_or_default(),
        counts: counts.clone(),
        oldest_parked_age_secs,
    }];
    QueuePlan {
        status: QueueStatusWrite {
            parked: counts.parked,
            redriven: counts.redriven,
            dropped: counts.dropped,
            oldest_parked_at: counts.oldest_parked_at.map(Time),
            target: readiness.target,
            observed_generation: queue.metadata.generation,
            conditions: conds,
            failure_kinds: counts
                .kinds
                .iter()
                .map(|(k, c)| (k.to_string(), c.kind_status()))
                .collect(),
            blocks: reckoned
                .blocks
                .into_iter()
                .map(|(id, c)| (id, c.map(|counted| BlockCount { counted })))
                .collect(),
            address: None,
            protection: None,
            backlog: stale_backlog(queue),
        },
        metrics,
        events,
    }
}

/// A null for `status.backlog` when the queue has one but no source (removed since): nothing
/// samples it any more, and a frozen number would read as a storm still waiting.
fn stale_backlog(queue: &DeadLetterQueue) -> Option<Option<crate::queue::QueueBacklog>> {
    let has = queue.status.as_ref().is_some_and(|s| s.backlog.is_some());
    (has && queue.spec.source.is_none()).then_some(None)
}

/// Sets the `Full` condition from the slots `in_use` (parked + block slots left) under
/// `maxParked`, and the other `bounds` (a ResourceQuota on the namespace's records, the
/// operator's `--max-records`), naming the one that holds (maxParked first); a queue that
/// becomes full gets a Warning Event `QueueFull` once per transition.
fn fullness(
    queue: &DeadLetterQueue,
    conds: &mut Vec<Condition>,
    in_use: i64,
    bounds: &capacity::Bounds,
    now: Timestamp,
) -> Vec<EventPlan> {
    let limit = queue.spec.max_parked();
    let was_full = conditions::find(conds, conditions::FULL).is_some_and(|c| c.status == "True");
    let name = queue.metadata.name.as_deref().unwrap_or_default();
    let quota = bounds.quota.as_ref();
    let ceiling = bounds.ceiling.as_ref();
    let waits = "new dead messages stay in the broker until records are";
    let (full, reason, message) = if in_use >= limit {
        (
            true,
            reason::MAX_PARKED_REACHED,
            format!("{in_use} parked (or being parked) of maxParked {limit}: {waits} resolved"),
        )
    } else if let Some(q) = quota.filter(|q| q.exhausted()) {
        (
            true,
            reason::QUOTA_EXCEEDED,
            format!(
                "{}: {waits} deleted (resolved records count until retention deletes them)",
                q.describe()
            ),
        )
    } else if let Some(c) = ceiling.filter(|c| c.reached()) {
        (
            true,
            reason::MAX_RECORDS_REACHED,
            format!(
                "the operator's --max-records {}: {} records kept (or being parked) across the queues it watches: {waits} deleted",
                c.limit, c.held
            ),
        )
    } else {
        let mut message = format!("{in_use} parked (or being parked) of maxParked {limit}");
        if let Some(q) = quota {
            message.push_str("; ");
            message.push_str(&q.describe());
        }
        if let Some(c) = ceiling {
            message.push_str(&format!(
                "; {} records kept of the operator's --max-records {}",
                c.held, c.limit
            ));
        }
        (false, reason::BELOW_MAX_PARKED, message)
    };
    conditions::set(
        conds,
        Cond {
            type_: conditions::FULL,
            status: full,
            reason,
            message: &message,
        },
        queue.metadata.generation,
        &Time(now),
    );
    if full && !was_full {
        vec![EventPlan::warning(
            events::reason::QUEUE_FULL,
            events::action::PARK,
            format!("queue {name} is full: {message}"),
        )]
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventType;
    use crate::queue::Retention;
    use crate::testing::RecordBuilder;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("timestamp")
    }

    fn record(phase: Option<Phase>, created: i64) -> DeadLetter {
        let record = RecordBuilder::job("pi_0003/settle")
            .named("pi-0003-settle-5d41402a-1")
            .failed_at(at(created))
            .created(at(created));
        match phase {
            Some(phase) => record.phase(phase),
            None => record,
        }
        .build()
    }

    #[test]
    fn a_queue_that_accepts_http_is_addressable() {
        let mut q = DeadLetterQueue::new("relayer", Default::default());
        q.metadata.namespace = Some("payments".into());
        assert_eq!(
            address(&q, Some("https://dlq.example/"), None),
            None,
            "no spec.http"
        );
        q.spec.http = Some(crate::queue::HttpParkSpec::default());
        assert_eq!(address(&q, None, None), None, "no endpoint served");
        let a = address(&q, Some("https://dlq.example/"), None).expect("an address");
        assert_eq!(a.ca_certs, None);
        assert_eq!(
            a.url,
            "https://dlq.example/v1/namespaces/payments/queues/relayer"
        );
        assert_eq!(
            a.audience.as_deref(),
            Some("/v1/namespaces/payments/queues/relayer")
        );
    }

    #[test]
    fn an_address_carries_the_endpoints_ca_when_it_is_pem_and_bounded() {
        let mut q = DeadLetterQueue::new("relayer", Default::default());
        q.metadata.namespace = Some("payments".into());
        q.spec.http = Some(crate::queue::HttpParkSpec::default());
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n\n";
        let a = address(&q, Some("https://dlq.example"), Some(pem)).expect("an address");
        assert_eq!(
            a.ca_certs.as_deref(),
            Some("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
        );
        let yaml = serde_json::to_value(&a).expect("json");
        assert!(
            yaml.get("CACerts").is_some(),
            "Knative's field name: {yaml}"
        );
        for refused in [
            "not a certificate",
            &"-----BEGIN CERTIFICATE-----".repeat(3000),
        ] {
            let a = address(&q, Some("https://dlq.example"), Some(refused)).expect("an address");
            assert_eq!(a.ca_certs, None, "{}", &refused[..20]);
        }
    }

    #[test]
    fn parking_is_announced_and_counted_only_after_the_write() {
        let then = mark_parked(&record(None, 10));
        assert_eq!(then.events.len(), 1);
        let ev = &then.events[0];
        assert_eq!(
            (ev.type_, ev.reason, ev.once),
            (EventType::Warning, "Parked", true)
        );
        assert!(
            ev.note
                .starts_with("pi_0003/settle parked (transient, cycle 1, 3 deliveries)")
        );
        assert_eq!(
            then.metrics,
            vec![MetricChange::Parked {
                namespace: "payments".into(),
                queue: "relayer".into(),
                failure_kind: FailureKind::Transient
            }]
        );
    }

    #[test]
    fn a_resolution_is_signed_and_counted_once() {
        let mut r = record(Some(Phase::Parked), 10);
        r.spec.action = Some(Action::Redrive);
        r.spec.by = Some("ops".into());
        r.spec.note = Some("INC-1".into());
        let w = resolve(&r, Phase::Redriven, "ops", at(30));
        assert_eq!(w.status.phase, Some(Phase::Redriven));
        assert_eq!(w.status.resolved_by.as_deref(), Some("ops"));
        assert_eq!(w.status.resolved_at, Some(Time(at(30))));
        assert_eq!(w.status.observed_generation, Some(1));
        let requeued =
            conditions::find(&w.status.conditions, conditions::REQUEUED).expect("Requeued");
        assert_eq!(requeued.status, "True");
        assert_eq!(w.then.events[0].reason, "Redriven");
        assert_eq!(
            w.then.events[0].note,
            "pi_0003/settle redriven by ops: INC-1"
        );
        assert!(matches!(
            w.then.metrics[..],
            [MetricChange::Redrive {
                result: RedriveResult::Success,
                ..
            }]
        ));

        let d = resolve(&r, Phase::Dropped, "ops", at(30));
        assert!(conditions::find(&d.status.conditions, conditions::REQUEUED).is_none());
        assert_eq!(d.then.events[0].reason, "Dropped");
        assert!(matches!(d.then.metrics[..], [MetricChange::Dropped { .. }]));
    }

    #[test]
    fn a_drop_after_the_broker_confirmed_the_redrive_resolves_redriven_and_says_why() {
        let mut r = record(Some(Phase::Parked), 10);
        r.spec.action = Some(Action::Drop);
        r.spec.by = Some("bob".into());
        let w = resolve(&r, Phase::Redriven, "alice", at(30));
        assert_eq!(w.status.phase, Some(Phase::Redriven));
        assert_eq!(w.status.resolved_by.as_deref(), Some("alice"));
        let requeued =
            conditions::find(&w.status.conditions, conditions::REQUEUED).expect("Requeued");
        assert_eq!(requeued.reason, "RequeuedBeforeDrop");
        let reasons: Vec<_> = w.then.events.iter().map(|e| (e.type_, e.reason)).collect();
        assert_eq!(
            reasons,
            vec![
                (EventType::Normal, "Redriven"),
                (EventType::Warning, "DecisionTooLate")
            ]
        );
        assert!(w.then.events[1].note.contains("the drop by bob came after"));

        r.spec.action = Some(Action::Redrive);
        let w = resolve(&r, Phase::Redriven, "alice", at(30));
        assert_eq!(
            w.then.events.len(),
            1,
            "an ordinary redrive warns of nothing"
        );
    }

    #[test]
    fn a_lost_race_names_the_winner_and_counts_a_conflict_for_redrives_only() {
        let mut fresh = record(Some(Phase::Dropped), 10);
        if let Some(s) = fresh.status.as_mut() {
            s.resolved_by = Some("alice".into());
        }
        let e = lost_race(&fresh, Phase::Redriven);
        assert_eq!(e.events[0].reason, "ResolveConflict");
        assert_eq!(
            e.events[0].note,
            "already dropped by alice; this resolver (redriven) lost the race"
        );
        assert!(matches!(
            e.metrics[..],
            [MetricChange::Redrive {
                result: RedriveResult::Conflict,
                ..
            }]
        ));
        assert!(lost_race(&fresh, Phase::Dropped).metrics.is_empty());
    }

    #[test]
    fn repeated_requeue_failures_back_off_without_rewriting_the_condition() {
        let failure = RequeueFailure {
            reason: "BrokerUnreachable",
            message: "broker unreachable: connection refused".into(),
        };
        let cap = Duration::from_secs(60);
        let mut r = record(Some(Phase::Parked), 10);
        let first = requeue_failed(&r, &failure, 1, cap, at(20));
        assert_eq!(first.retry_in, Duration::from_secs(1));
        let status = first.status.expect("first failure writes the condition");
        assert_eq!(status.phase, Some(Phase::Parked));
        assert_eq!(first.effects.events[0].reason, "RequeueFailed");
        assert!(matches!(
            first.effects.metrics[..],
            [MetricChange::Redrive {
                result: RedriveResult::Failure,
                ..
            }]
        ));

        r.status = Some(status);
        let again = requeue_failed(&r, &failure, 4, cap, at(40));
        assert_eq!(
            again.status, None,
            "an unchanged condition is not rewritten"
        );
        assert_eq!(again.retry_in, Duration::from_secs(8));
        assert_eq!(
            again.effects.events.len(),
            1,
            "every failure is still an Event"
        );

        let other = RequeueFailure {
            reason: "BrokerRefused",
            ..failure
        };
        assert!(requeue_failed(&r, &other, 5, cap, at(50)).status.is_some());
    }

    #[test]
    fn refusing_an_unsigned_decision_says_why() {
        let (effects, status) = refuse(&record(None, 10), "unsigned", at(20));
        assert_eq!(effects.events[0].reason, "DecisionRefused");
        let ready = conditions::find(&status.conditions, conditions::READY).expect("Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "Unsigned")
        );
        assert_eq!(status.phase, None);
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
        assert_eq!(c.oldest_parked_at, Some(at(100)));
        assert_eq!(c.kinds["Transient"].parked, 2);
        assert_eq!(c.kinds["Invalid"], Counts::default());
        assert_eq!(count::<DeadLetter>([].iter()).parked, 0);
    }

    #[test]
    fn retention_selects_old_resolved_records_only() {
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        let resolved = |phase, when| {
            let mut r = record(Some(phase), 0);
            if let Some(s) = r.status.as_mut() {
                s.resolved_at = Some(Time(at(when)));
            }
            r
        };
        let mut rs = [
            resolved(Phase::Redriven, 100),
            resolved(Phase::Dropped, 5000),
            record(Some(Phase::Parked), 0),
        ];
        for (i, r) in rs.iter_mut().enumerate() {
            r.spec.job.id = format!("job-{i}");
        }
        assert!(
            expired(&queue, rs.iter(), at(10_000)).is_empty(),
            "no retention set"
        );
        queue.spec.retention = Some(Retention {
            resolved_for: "1h".into(),
        });
        let gone: Vec<_> = expired(&queue, rs.iter(), at(4000))
            .into_iter()
            .map(|r| r.phase())
            .collect();
        assert_eq!(gone, vec![Phase::Redriven]);
    }

    #[test]
    fn retention_deletes_a_jobs_cycle_one_last() {
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.spec.retention = Some(Retention {
            resolved_for: "1h".into(),
        });
        let cycle = |n| {
            let mut r = record(Some(Phase::Dropped), 0);
            r.spec.cycle = n;
            if let Some(s) = r.status.as_mut() {
                s.resolved_at = Some(Time(at(100)));
            }
            r
        };
        let both = [cycle(1), cycle(2)];
        let gone: Vec<i32> = expired(&queue, both.iter(), at(10_000))
            .into_iter()
            .map(|r| r.spec.cycle)
            .collect();
        assert_eq!(gone, vec![2], "cycle 1 waits for the job's other records");
        let alone = [cycle(1)];
        assert_eq!(expired(&queue, alone.iter(), at(10_000)).len(), 1);
    }

    #[test]
    fn the_counters_write_leaves_the_backlog_alone_but_clears_one_without_a_source() {
        use crate::queue::{QueueBacklog, SourceSpec};
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.status = Some(DeadLetterQueueStatus {
            backlog: Some(QueueBacklog {
                messages: Some(14_968),
                observed_at: None,
            }),
            ..Default::default()
        });
        let write = |q: &DeadLetterQueue| {
            let plan = queue_status(
                q,
                Counts::default(),
                capacity::Reckoning::default(),
                Readiness {
                    ready: true,
                    reason: "TargetReachable",
                    message: "ok".into(),
                    target: String::new(),
                },
                &capacity::Bounds::default(),
                at(100),
            );
            serde_json::to_value(&plan.status).expect("json")
        };
        let cleared = write(&queue);
        assert_eq!(
            cleared.get("backlog"),
            Some(&serde_json::Value::Null),
            "no source: nothing samples it any more"
        );
        queue.spec.source = Some(SourceSpec::default());
        let kept = write(&queue);
        assert!(
            kept.get("backlog").is_none(),
            "a merge patch without the field: the sampler's writer keeps it"
        );
        assert!(kept.get("http").is_none());
    }

    #[test]
    fn queue_status_clears_oldest_parked_and_reports_readiness() {
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.metadata.namespace = Some("payments".into());
        let plan = queue_status(
            &queue,
            Counts {
                redriven: 3,
                ..Counts::default()
            },
            capacity::Reckoning::default(),
            Readiness {
                ready: false,
                reason: "BrokerUnreachable",
                message: "down".into(),
                target: "redis list relayer:jobs".into(),
            },
            &capacity::Bounds::default(),
            at(100),
        );
        let json = serde_json::to_value(&plan.status).expect("json");
        assert_eq!(json["oldestParkedAt"], serde_json::Value::Null);
        assert_eq!(json["redriven"], 3);
        assert_eq!(json["conditions"][0]["reason"], "BrokerUnreachable");
        assert!(matches!(
            &plan.metrics[..],
            [MetricChange::QueueGauges {
                oldest_parked_age_secs: 0,
                ..
            }]
        ));
    }

    #[test]
    fn a_queue_reaching_max_parked_is_full_once_and_reckoned_blocks_are_removed() {
        use crate::queue::SlotBlock;
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.spec.max_parked = Some(3);
        let one = SlotBlock {
            size: 1,
            at: 1,
            counted: 0,
        };
        queue.status = Some(DeadLetterQueueStatus {
            blocks: [("a", one), ("b", one)]
                .into_iter()
                .map(|(n, b)| (n.to_string(), b))
                .collect(),
            ..Default::default()
        });
        let ready = || Readiness {
            ready: true,
            reason: "TargetReachable",
            message: "ok".into(),
            target: String::new(),
        };
        let counts = Counts {
            parked: 2,
            ..Counts::default()
        };
        // 2 counted + "b"'s slot still uncounted = 3: full.
        let plan = queue_status(
            &queue,
            counts.clone(),
            removed(&["a"]),
            ready(),
            &capacity::Bounds::default(),
            at(100),
        );
        let json = serde_json::to_value(&plan.status).expect("json");
        assert_eq!(json["blocks"], serde_json::json!({"a": null}));
        assert!(json.get("reservations").is_none());
        let full = conditions::find(&plan.status.conditions, conditions::FULL).expect("Full");
        assert_eq!(
            (full.status.as_str(), full.reason.as_str()),
            ("True", "MaxParkedReached")
        );
        assert_eq!(plan.events.len(), 1);
        assert_eq!(plan.events[0].reason, "QueueFull");
        assert!(
            plan.events[0].note.contains("stay in the broker"),
            "{}",
            plan.events[0].note
        );
        // Still full on the next pass: no second Event.
        if let Some(s) = queue.status.as_mut() {
            s.conditions = plan.status.conditions.clone();
        }
        let again = queue_status(
            &queue,
            counts,
            removed(&["a"]),
            ready(),
            &capacity::Bounds::default(),
            at(101),
        );
        assert!(again.events.is_empty());
        // Records resolved: not full.
        let freed = queue_status(
            &queue,
            Counts::default(),
            removed(&["a", "b"]),
            ready(),
            &capacity::Bounds::default(),
            at(102),
        );
        let full = conditions::find(&freed.status.conditions, conditions::FULL).expect("Full");
        assert_eq!(full.status, "False");
    }

    /// A reckoning removing the blocks `ids`.
    fn removed(ids: &[&str]) -> capacity::Reckoning {
        capacity::Reckoning {
            blocks: ids.iter().map(|id| (id.to_string(), None)).collect(),
        }
    }

    #[test]
    fn uncounted_block_slots_keep_a_queue_full_and_reckoned_blocks_are_written() {
        use crate::queue::SlotBlock;
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.spec.max_parked = Some(10);
        let block = |size, counted| SlotBlock {
            size,
            at: 100,
            counted,
        };
        queue.status = Some(DeadLetterQueueStatus {
            blocks: [("p-1", block(8, 0)), ("p-2", block(4, 0))]
                .into_iter()
                .map(|(n, b)| (n.to_string(), b))
                .collect(),
            ..Default::default()
        });
        let ready = Readiness {
            ready: true,
            reason: "TargetReachable",
            message: "ok".into(),
            target: String::new(),
        };
        // 5 of p-1's records counted (parked), p-2 all seen and removed: 5 + 3 = 8 of 10.
        let reckoned = capacity::Reckoning {
            blocks: [("p-1".to_string(), Some(5)), ("p-2".to_string(), None)].into(),
        };
        let counts = Counts {
            parked: 5,
            ..Counts::default()
        };
        let plan = queue_status(
            &queue,
            counts,
            reckoned,
            ready,
            &capacity::Bounds::default(),
            at(100),
        );
        let json = serde_json::to_value(&plan.status).expect("json");
        assert_eq!(
            json["blocks"],
            serde_json::json!({"p-1": {"counted": 5}, "p-2": null})
        );
        let full = conditions::find(&plan.status.conditions, conditions::FULL).expect("Full");
        assert_eq!(full.status, "False");
        assert!(full.message.starts_with("8 parked"), "{}", full.message);
    }

    #[test]
    fn a_queue_is_full_naming_the_quota_or_the_ceiling_that_refuses() {
        use crate::capacity::{Bounds, CeilingUse, QuotaUse};
        let mut queue = DeadLetterQueue::new("relayer", Default::default());
        queue.metadata.namespace = Some("payments".into());
        let ready = || Readiness {
            ready: true,
            reason: "TargetReachable",
            message: "ok".into(),
            target: String::new(),
        };
        let counts = Counts {
            parked: 50,
            ..Counts::default()
        };
        let quota = |used| QuotaUse {
            name: "dead-letters".into(),
            used: Some(used),
            hard: Some(50),
        };
        let full_of = |plan: &QueuePlan| {
            let c = conditions::find(&plan.status.conditions, conditions::FULL).expect("Full");
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        // The quota used up, far below maxParked: Full, naming the quota and its numbers.
        let bounds = Bounds {
            quota: Some(quota(50)),
            ceiling: None,
        };
        let plan = queue_status(
            &queue,
            counts.clone(),
            capacity::Reckoning::default(),
            ready(),
            &bounds,
            at(100),
        );
        let (status, reason, message) = full_of(&plan);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", "QuotaExceeded")
        );
        assert!(
            message
                .starts_with("ResourceQuota dead-letters: 50 of 50 count/deadletters.dlq.dev used"),
            "{message}"
        );
        assert_eq!(plan.events.len(), 1, "QueueFull once");
        assert!(plan.events[0].note.contains("dead-letters"));
        // Room again: not full, and the quota still said.
        queue.status = Some(DeadLetterQueueStatus {
            conditions: plan.status.conditions.clone(),
            ..Default::default()
        });
        let bounds = Bounds {
            quota: Some(quota(20)),
            ceiling: Some(CeilingUse {
                held: 30,
                limit: 100,
            }),
        };
        let plan = queue_status(
            &queue,
            counts.clone(),
            capacity::Reckoning::default(),
            ready(),
            &bounds,
            at(101),
        );
        let (status, reason, message) = full_of(&plan);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "BelowMaxParked")
        );
        assert_eq!(
            message,
            "50 parked (or being parked) of maxParked 5000; ResourceQuota dead-letters: 20 of 50 count/deadletters.dlq.dev used; 30 records kept of the operator's --max-records 100"
        );
        // The operator's ceiling reached: Full, naming it.
        let bounds = Bounds {
            quota: None,
            ceiling: Some(CeilingUse {
                held: 100,
                limit: 100,
            }),
        };
        let plan = queue_status(
            &queue,
            counts,
            capacity::Reckoning::default(),
            ready(),
            &bounds,
            at(102),
        );
        let (status, reason, message) = full_of(&plan);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", "MaxRecordsReached")
        );
        assert!(message.contains("--max-records 100"), "{message}");
    }
}
