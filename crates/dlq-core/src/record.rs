//! What the operator remembers of every record ([`Summary`]), and the facts its counters,
//! retention, replays and alerts read ([`Facts`]), so those functions run on a whole
//! `DeadLetter` (the CLI, tests) and on the summary alike.
//!
//! A `DeadLetter` costs the operator's memory 720 bytes inline before any of its strings
//! (kube's `ObjectMeta` alone is 360), plus a reflector store's key holding second copies of
//! its name, uid and resourceVersion: with 100,000 records the records were most of the
//! operator's RSS. A summary keeps only what is read, with the namespace, queue and slot block
//! shared between records ([`Interner`]).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};

use crate::dead_letter::{
    ANNOTATION_SLOT_BLOCK, Action, DeadLetter, DeadLetterSpec, DeadLetterStatus, FailureKind,
    IntentSnapshot, Job, Phase,
};
use crate::group::LABEL_GROUP;
use crate::replay::{ANNOTATION_REPLAY_UID, LABEL_REPLAY};

pub use crate::facts::Facts;

fn get<'m>(m: &'m Option<BTreeMap<String, String>>, k: &str) -> Option<&'m str> {
    m.as_ref().and_then(|m| m.get(k)).map(String::as_str)
}

/// A failing requeue among `conditions`, observed at `generation` or later.
fn failing_at(conditions: &[Condition], generation: Option<i64>) -> bool {
    conditions.iter().any(|c| {
        c.type_ == crate::conditions::REQUEUED
            && c.status == "False"
            && c.observed_generation >= generation
    })
}

impl Facts for DeadLetter {
    fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }
    fn queue(&self) -> &str {
        &self.spec.queue
    }
    fn job_id(&self) -> &str {
        &self.spec.job.id
    }
    fn cycle(&self) -> i32 {
        self.spec.cycle
    }
    fn phase(&self) -> Phase {
        DeadLetter::phase(self)
    }
    fn action(&self) -> Option<Action> {
        self.spec.action
    }
    fn failure_kind(&self) -> FailureKind {
        self.spec.failure_kind
    }
    fn reason(&self) -> &str {
        &self.spec.reason
    }
    fn failed_at(&self) -> Timestamp {
        self.spec.failed_at.0
    }
    fn service_version(&self) -> Option<&str> {
        self.spec.service_version.as_deref()
    }
    fn error_class(&self) -> Option<&str> {
        self.spec.error_class.as_deref()
    }
    fn group(&self) -> std::borrow::Cow<'_, str> {
        crate::group::Key::of(self).fingerprint().into()
    }
    fn created(&self) -> Option<Timestamp> {
        self.metadata.creation_timestamp.as_ref().map(|t| t.0)
    }
    fn resolved_at(&self) -> Option<Timestamp> {
        self.status.as_ref()?.resolved_at.as_ref().map(|t| t.0)
    }
    fn signed_by_replay(&self) -> (Option<&str>, Option<&str>) {
        (
            get(&self.metadata.labels, LABEL_REPLAY),
            get(&self.metadata.annotations, ANNOTATION_REPLAY_UID),
        )
    }
    fn requeue_failing(&self) -> bool {
        let conditions = self.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
        failing_at(conditions, self.metadata.generation)
    }
}

/// Shares the strings many records hold alike (namespaces, queues, slot blocks), so 100,000
/// records of one queue hold its name once.
#[derive(Default)]
pub struct Interner {
    strings: HashSet<Arc<str>>,
}

impl Interner {
    pub fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(shared) = self.strings.get(s) {
            return shared.clone();
        }
        let shared: Arc<str> = Arc::from(s);
        self.strings.insert(shared.clone());
        shared
    }

    /// Forgets strings no summary holds any more (a finished slot block, a deleted queue).
    pub fn prune(&mut self) {
        self.strings.retain(|s| Arc::strong_count(s) > 1);
    }

    pub fn len(&self) -> usize {
        self.strings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }
}

/// The replay that signed a record (rare: boxed so other records pay one pointer).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SignedBy {
    replay: Option<Box<str>>,
    uid: Option<Box<str>>,
}

/// What the operator keeps of a record: enough to count it, retain it, select and follow it
/// in a replay, alert on it, and to mark it Parked ([`Summary::to_record`]). Not its job's
/// bytes, labels, annotations (but the slot block and the signing replay), nor conditions
/// that are not failing.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub name: Box<str>,
    pub namespace: Arc<str>,
    pub uid: Box<str>,
    pub resource_version: Box<str>,
    pub generation: Option<i64>,
    pub created: Option<Timestamp>,
    pub queue: Arc<str>,
    pub job_id: Box<str>,
    pub cycle: i32,
    pub deliveries: i32,
    pub reason: Box<str>,
    pub failure_kind: FailureKind,
    pub failed_at: Timestamp,
    pub service_version: Option<Box<str>>,
    pub error_class: Option<Box<str>>,
    /// Its failure group ([`Facts::group`]), shared by the group's records.
    pub group: Arc<str>,
    /// Whether its `dlq.dev/group` label holds exactly that group. Records parked before
    /// groups existed have none, and a hand-edited one is wrong, until the operator
    /// (re)labels them.
    pub group_labelled: bool,
    /// The business state when it failed (alerts describe it).
    pub intent: Option<Box<IntentSnapshot>>,
    pub action: Option<Action>,
    /// `status.phase` as read: None when no status was ever written (and the apiserver did not
    /// default it: the tests' fake).
    pub status_phase: Option<Phase>,
    /// Whether it still needs the operator's mark ([`crate::decide::needs_mark`], read before
    /// the managed fields it is told by are dropped).
    pub needs_mark: bool,
    pub resolved_at: Option<Timestamp>,
    /// Conditions with status False (alerts and replays read `Requeued=False`); usually none.
    pub failing: Box<[Condition]>,
    /// The block of slots it was parked in (`dlq.dev/slot-block`), shared with its block.
    pub slot_block: Option<Arc<str>>,
    /// The age recipient its job is sealed to (`spec.job.sealed.recipient`), shared with the
    /// queue's other records sealed to it: the queue counts records per key.
    pub sealed_to: Option<Arc<str>>,
    /// The SHA-256 of its body in the queue's store (`spec.job.body`, not an external one):
    /// the store's sweep keeps every object a record names.
    pub body: Option<Box<str>>,
    signed_by: Option<Box<SignedBy>>,
}

fn boxed(s: &str) -> Box<str> {
    Box::from(s)
}

impl Summary {
    /// The summary of `dl`, its shared strings taken from `strings`.
    pub fn of(dl: &DeadLetter, strings: &mut Interner) -> Summary {
        let meta = &dl.metadata;
        let spec = &dl.spec;
        let status = dl.status.as_ref();
        let (replay, uid) = dl.signed_by_replay();
        let group = strings.get(&dl.group());
        let signed_by = (replay.is_some() || uid.is_some()).then(|| {
            Box::new(SignedBy {
                replay: replay.map(boxed),
                uid: uid.map(boxed),
            })
        });
        Summary {
            name: boxed(meta.name.as_deref().unwrap_or_default()),
            namespace: strings.get(meta.namespace.as_deref().unwrap_or_default()),
            uid: boxed(meta.uid.as_deref().unwrap_or_default()),
            resource_version: boxed(meta.resource_version.as_deref().unwrap_or_default()),
            generation: meta.generation,
            created: dl.created(),
            queue: strings.get(&spec.queue),
            job_id: boxed(&spec.job.id),
            cycle: spec.cycle,
            deliveries: spec.deliveries,
            reason: boxed(&spec.reason),
            failure_kind: spec.failure_kind,
            failed_at: spec.failed_at.0,
            service_version: spec.service_version.as_deref().map(boxed),
            error_class: spec.error_class.as_deref().map(boxed),
            group: group.clone(),
            group_labelled: crate::group::labelled(dl) == Some(&*group),
            intent: spec.intent.clone(),
            action: spec.action,
            status_phase: status.and_then(|s| s.phase),
            needs_mark: crate::decide::needs_mark(dl),
            resolved_at: dl.resolved_at(),
            failing: status
                .map(|s| {
                    s.conditions
                        .iter()
                        .filter(|c| c.status == "False")
                        .cloned()
                        .collect()
                })
                .unwrap_or_default(),
            slot_block: get(&meta.annotations, ANNOTATION_SLOT_BLOCK).map(|b| strings.get(b)),
            sealed_to: spec.job.sealed.as_ref().map(|s| strings.get(&s.recipient)),
            body: spec.job.stored_body().map(|b| boxed(&b.sha256)),
            signed_by,
        }
    }

    /// A record holding what this summary keeps (no job bytes, no other labels or
    /// annotations, no managed fields but a stand-in while it needs its mark): enough to mark it, delete or sign exactly this version (uid and
    /// resourceVersion), or compute its alerts.
    pub fn to_record(&self) -> DeadLetter {
        let mut labels = BTreeMap::new();
        let mut annotations = BTreeMap::new();
        if let Some(s) = &self.signed_by {
            if let Some(r) = &s.replay {
                labels.insert(LABEL_REPLAY.to_string(), r.to_string());
            }
            if let Some(u) = &s.uid {
                annotations.insert(ANNOTATION_REPLAY_UID.to_string(), u.to_string());
            }
        }
        if let Some(b) = &self.slot_block {
            annotations.insert(ANNOTATION_SLOT_BLOCK.to_string(), b.to_string());
        }
        if self.group_labelled {
            labels.insert(LABEL_GROUP.to_string(), self.group.to_string());
        }
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let status =
            (self.status_phase.is_some() || self.resolved_at.is_some() || !self.failing.is_empty())
                .then(|| DeadLetterStatus {
                    phase: self.status_phase,
                    resolved_at: self.resolved_at.map(Time),
                    conditions: self.failing.to_vec(),
                    ..DeadLetterStatus::default()
                });
        DeadLetter {
            metadata: ObjectMeta {
                name: Some(self.name.to_string()),
                namespace: Some(self.namespace.to_string()),
                uid: nonempty(&self.uid),
                resource_version: nonempty(&self.resource_version),
                generation: self.generation,
                creation_timestamp: self.created.map(Time),
                labels: (!labels.is_empty()).then_some(labels),
                annotations: (!annotations.is_empty()).then_some(annotations),
                managed_fields: crate::decide::managed_fields_kept(self.needs_mark),
                ..ObjectMeta::default()
            },
            spec: DeadLetterSpec {
                queue: self.queue.to_string(),
                cycle: self.cycle,
                job: Job {
                    id: self.job_id.to_string(),
                    ..Job::default()
                },
                intent: self.intent.clone(),
                deliveries: self.deliveries,
                reason: self.reason.to_string(),
                failure_kind: self.failure_kind,
                service_version: self.service_version.as_deref().map(str::to_string),
                error_class: self.error_class.as_deref().map(str::to_string),
                failed_at: Time(self.failed_at),
                action: self.action,
                by: None,
                note: None,
            },
            status,
        }
    }
}

impl Facts for Summary {
    fn name(&self) -> &str {
        &self.name
    }
    fn queue(&self) -> &str {
        &self.queue
    }
    fn job_id(&self) -> &str {
        &self.job_id
    }
    fn cycle(&self) -> i32 {
        self.cycle
    }
    fn phase(&self) -> Phase {
        self.status_phase.unwrap_or(Phase::Parked)
    }
    fn action(&self) -> Option<Action> {
        self.action
    }
    fn failure_kind(&self) -> FailureKind {
        self.failure_kind
    }
    fn reason(&self) -> &str {
        &self.reason
    }
    fn failed_at(&self) -> Timestamp {
        self.failed_at
    }
    fn service_version(&self) -> Option<&str> {
        self.service_version.as_deref()
    }
    fn error_class(&self) -> Option<&str> {
        self.error_class.as_deref()
    }
    fn group(&self) -> std::borrow::Cow<'_, str> {
        (*self.group).into()
    }
    fn created(&self) -> Option<Timestamp> {
        self.created
    }
    fn resolved_at(&self) -> Option<Timestamp> {
        self.resolved_at
    }
    fn signed_by_replay(&self) -> (Option<&str>, Option<&str>) {
        self.signed_by
            .as_ref()
            .map_or((None, None), |s| (s.replay.as_deref(), s.uid.as_deref()))
    }
    fn requeue_failing(&self) -> bool {
        failing_at(&self.failing, self.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> DeadLetter {
        crate::testing::RecordBuilder::job("order-1")
            .payload("{\"secret\":1}")
            .message("redis/relayer:dead/7")
            .cycle(2)
            .uid("uid-1")
            .resource_version("42")
            .generation(2)
            .created(crate::testing::at(1_000))
            .intent("order-1", "paid")
            .service_version("v2")
            .error_class("PayerTimeout")
            .annotation(ANNOTATION_SLOT_BLOCK, "b-1")
            .build()
    }

    /// Every fact reads the same from the record and from its summary, and from the record
    /// the summary rebuilds.
    fn same_facts(a: &impl Facts, b: &impl Facts) {
        assert_eq!(a.name(), b.name());
        assert_eq!(a.queue(), b.queue());
        assert_eq!(a.job_id(), b.job_id());
        assert_eq!(a.cycle(), b.cycle());
        assert_eq!(a.phase(), b.phase());
        assert_eq!(a.action(), b.action());
        assert_eq!(a.failure_kind(), b.failure_kind());
        assert_eq!(a.reason(), b.reason());
        assert_eq!(a.failed_at(), b.failed_at());
        assert_eq!(a.service_version(), b.service_version());
        assert_eq!(a.error_class(), b.error_class());
        assert_eq!(a.group(), b.group());
        assert_eq!(a.created(), b.created());
        assert_eq!(a.resolved_at(), b.resolved_at());
        assert_eq!(a.signed_by_replay(), b.signed_by_replay());
        assert_eq!(a.requeue_failing(), b.requeue_failing());
    }

    #[test]
    fn a_summary_reads_like_its_record_and_rebuilds_it_without_the_job_bytes() {
        let mut strings = Interner::default();
        let r = record();
        let s = Summary::of(&r, &mut strings);
        same_facts(&r, &s);
        let rebuilt = s.to_record();
        same_facts(&r, &rebuilt);
        let links = crate::alert::Links::default();
        let alerts = crate::alert::current(&r, None, &links);
        assert!(!alerts.is_empty());
        assert!(alerts[0].annotations["description"].contains("order-1 was paid"));
        assert_eq!(
            alerts,
            crate::alert::current(&rebuilt, None, &links),
            "the same alerts, intent snapshot included"
        );
        assert_eq!(rebuilt.metadata.uid.as_deref(), Some("uid-1"));
        assert_eq!(rebuilt.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(rebuilt.metadata.generation, Some(2));
        assert!(!rebuilt.spec.job.has_payload(), "no job bytes are kept");
        assert_eq!(
            get(&rebuilt.metadata.annotations, ANNOTATION_SLOT_BLOCK),
            Some("b-1")
        );
        assert_eq!(rebuilt.status, None);
        assert!(
            !s.needs_mark,
            "no managed fields: not as a create leaves a record"
        );
        let mut created = r.clone();
        created.metadata.managed_fields = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                manager: Some("dlq-parker".into()),
                ..Default::default()
            },
        ]);
        let s = Summary::of(&created, &mut strings);
        assert!(s.needs_mark);
        assert!(
            crate::decide::needs_mark(&s.to_record()),
            "an unmarked record stays unmarked"
        );
    }

    #[test]
    fn a_signed_failing_resolved_record_keeps_those_facts() {
        let mut strings = Interner::default();
        let mut r = record();
        r.spec.action = Some(Action::Redrive);
        r.metadata
            .labels
            .get_or_insert_default()
            .insert(LABEL_REPLAY.into(), "night".into());
        r.metadata
            .annotations
            .get_or_insert_default()
            .insert(ANNOTATION_REPLAY_UID.into(), "r-uid".into());
        let failing = Condition {
            type_: crate::conditions::REQUEUED.into(),
            status: "False".into(),
            reason: "TargetUnreachable".into(),
            message: "connection refused".into(),
            observed_generation: Some(2),
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        };
        let ready = Condition {
            type_: crate::conditions::READY.into(),
            status: "True".into(),
            ..failing.clone()
        };
        r.status = Some(DeadLetterStatus {
            phase: Some(Phase::Parked),
            conditions: vec![ready, failing.clone()],
            ..DeadLetterStatus::default()
        });
        let s = Summary::of(&r, &mut strings);
        same_facts(&r, &s);
        assert_eq!(&*s.failing, [failing], "only the failing condition is kept");
        same_facts(&r, &s.to_record());

        r.status = Some(DeadLetterStatus {
            phase: Some(Phase::Redriven),
            resolved_at: Some(Time(Timestamp::from_second(2_000).expect("ts"))),
            ..DeadLetterStatus::default()
        });
        let s = Summary::of(&r, &mut strings);
        same_facts(&r, &s);
        same_facts(&r, &s.to_record());
    }

    #[test]
    fn a_record_parked_before_groups_existed_gets_its_group_computed_and_unlabelled() {
        let mut strings = Interner::default();
        let labelled = record();
        let mut r = record();
        if let Some(labels) = r.metadata.labels.as_mut() {
            labels.remove(LABEL_GROUP);
        }
        assert_eq!(r.group(), labelled.group(), "the same group, computed");
        let s = Summary::of(&r, &mut strings);
        assert!(!s.group_labelled);
        same_facts(&r, &s);
        let rebuilt = s.to_record();
        assert_eq!(get(&rebuilt.metadata.labels, LABEL_GROUP), None);
        same_facts(&r, &rebuilt);
        let s = Summary::of(&labelled, &mut strings);
        assert!(s.group_labelled);
        assert_eq!(
            get(&s.to_record().metadata.labels, LABEL_GROUP),
            Some(&*s.group)
        );
    }

    /// Issue 45 item 10: a decider edited `dlq.dev/group` to move a record into another group.
    #[test]
    fn a_forged_group_label_is_not_the_records_group_and_is_marked_for_restoring() {
        let mut strings = Interner::default();
        let honest = record();
        let mut forged = record();
        forged
            .metadata
            .labels
            .get_or_insert_default()
            .insert(LABEL_GROUP.into(), "0123456789".into());
        assert_eq!(forged.group(), honest.group(), "the facts decide");
        let s = Summary::of(&forged, &mut strings);
        assert_eq!(&*s.group, &*honest.group());
        assert!(!s.group_labelled, "the operator labels it again");
        let selector = crate::replay::ReplaySelector {
            group: Some("0123456789".into()),
            ..Default::default()
        };
        assert!(!selector.matches(&forged) && !selector.matches(&s));
        assert!(Summary::of(&honest, &mut strings).group_labelled);
    }

    #[test]
    fn records_of_one_queue_share_its_strings_until_none_holds_them() {
        let mut strings = Interner::default();
        let a = Summary::of(&record(), &mut strings);
        let b = Summary::of(&record(), &mut strings);
        assert!(Arc::ptr_eq(&a.queue, &b.queue));
        assert!(Arc::ptr_eq(&a.namespace, &b.namespace));
        assert!(Arc::ptr_eq(&a.group, &b.group));
        assert_eq!(strings.len(), 4, "namespace, queue, slot block, group");
        drop((a, b));
        strings.prune();
        assert!(strings.is_empty());
    }
}
