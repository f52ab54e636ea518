//! The replay controller driven in-process against a fake apiserver holding a queue's records:
//! pace, resuming after a restart without deciding twice, stop with withdrawal, dry run.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use dlq_core::api::{
    Action, DeadLetter, DeadLetterQueue, DeadLetterSpec, DeadLetterStatus, FailureKind, Job, Phase,
};
use dlq_core::events::EventPlan;
use dlq_core::plan::QueueStatusWrite;
use dlq_core::replay::{
    ANNOTATION_REPLAY_UID, DeadLetterReplay, DeadLetterReplaySpec, DeadLetterReplayStatus,
    LABEL_REPLAY, ReplayPhase, ReplaySelector,
};

use super::{Replays, reconcile};
use crate::metrics::Metrics;
use crate::reconcile::tests::store_of;
use crate::reconcile::{Context, Settings};
use crate::state::apiserver::{Apiserver, Signature};
use crate::target::{Target, TargetError, Targets};

const NS: &str = "payments";

fn api_error(code: u16) -> kube::Error {
    kube::Error::Api(
        kube::core::Status::failure("fake", "fake")
            .with_code(code)
            .boxed(),
    )
}

/// An apiserver holding a queue's records, with resourceVersions like the real one.
#[derive(Default)]
struct Fake {
    records: Mutex<BTreeMap<String, DeadLetter>>,
    version: AtomicU64,
    /// Every successful signature, by record name.
    signed: Mutex<Vec<String>>,
    statuses: Mutex<Vec<DeadLetterReplayStatus>>,
    events: Mutex<Vec<EventPlan>>,
}

impl Fake {
    fn holding(records: Vec<DeadLetter>) -> Arc<Fake> {
        let fake = Fake::default();
        for mut r in records {
            fake.bump(&mut r);
            fake.records
                .lock()
                .expect("lock")
                .insert(r.metadata.name.clone().unwrap_or_default(), r);
        }
        Arc::new(fake)
    }

    fn bump(&self, r: &mut DeadLetter) {
        let v = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        r.metadata.resource_version = Some(v.to_string());
    }

    fn all(&self) -> Vec<DeadLetter> {
        self.records
            .lock()
            .expect("lock")
            .values()
            .cloned()
            .collect()
    }

    /// Applies `change` to the stored record when the caller's version is current.
    fn cas(
        &self,
        record: &DeadLetter,
        change: impl FnOnce(&mut DeadLetter),
    ) -> Result<(), kube::Error> {
        let mut records = self.records.lock().expect("lock");
        let name = record.metadata.name.clone().unwrap_or_default();
        let stored = records.get_mut(&name).ok_or_else(|| api_error(404))?;
        if stored.metadata.resource_version != record.metadata.resource_version {
            return Err(api_error(409));
        }
        change(stored);
        self.bump(stored);
        Ok(())
    }

    /// The operator carries out every decision (as the DeadLetter reconciler would).
    fn carry_out_all(&self) {
        for r in self.records.lock().expect("lock").values_mut() {
            if r.spec.action.is_some() {
                r.status.get_or_insert_default().phase = Some(Phase::Redriven);
            }
        }
    }

    fn last_status(&self) -> DeadLetterReplayStatus {
        self.statuses
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("a status write")
    }
}

impl Apiserver for Fake {
    fn get_record<'a>(
        &'a self,
        _namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DeadLetter>, kube::Error>> {
        async move { Ok(self.records.lock().expect("lock").get(name).cloned()) }.boxed()
    }

    fn write_record_status<'a>(
        &'a self,
        _record: &'a DeadLetter,
        _status: &'a DeadLetterStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async { Ok(()) }.boxed()
    }

    fn write_queue_status<'a>(
        &'a self,
        _queue: &'a DeadLetterQueue,
        _status: &'a QueueStatusWrite,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async { Ok(()) }.boxed()
    }

    fn delete_record<'a>(&'a self, _r: &'a DeadLetter) -> BoxFuture<'a, Result<(), kube::Error>> {
        async { Ok(()) }.boxed()
    }

    fn publish<'a>(&'a self, _r: ObjectReference, event: &'a EventPlan) -> BoxFuture<'a, ()> {
        self.events.lock().expect("lock").push(event.clone());
        async {}.boxed()
    }

    fn sign_record<'a>(
        &'a self,
        record: &'a DeadLetter,
        s: &'a Signature<'a>,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let result = self.cas(record, |r| {
            r.spec.action = Some(s.action);
            r.spec.by = Some(s.by.to_string());
            r.spec.note = Some(s.note.to_string());
            r.metadata
                .labels
                .get_or_insert_default()
                .insert(LABEL_REPLAY.into(), s.replay.into());
            r.metadata
                .annotations
                .get_or_insert_default()
                .insert(ANNOTATION_REPLAY_UID.into(), s.replay_uid.into());
        });
        if result.is_ok() {
            let name = record.metadata.name.clone().unwrap_or_default();
            self.signed.lock().expect("lock").push(name);
        }
        async move { result }.boxed()
    }

    fn withdraw_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let result = self.cas(record, |r| {
            r.spec.action = None;
            r.spec.by = None;
            r.spec.note = None;
        });
        async move { result }.boxed()
    }

    fn write_replay_status<'a>(
        &'a self,
        _replay: &'a DeadLetterReplay,
        status: &'a DeadLetterReplayStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        self.statuses.lock().expect("lock").push(status.clone());
        async { Ok(()) }.boxed()
    }
}

/// Replays never requeue themselves: no broker is needed.
struct NoTargets;

impl Targets for NoTargets {
    fn target<'a>(
        &'a self,
        _queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Arc<dyn Target>, TargetError>> {
        async { Err(TargetError::Unreachable("no broker in this test".into())) }.boxed()
    }
}

fn record(name: &str, failed: i64, created: i64) -> DeadLetter {
    let mut r = DeadLetter::new(
        name,
        DeadLetterSpec {
            queue: "relayer".into(),
            cycle: 1,
            job: Job {
                id: name.into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
            intent: None,
            deliveries: 3,
            reason: "timeout".into(),
            failure_kind: FailureKind::Transient,
            service_version: None,
            failed_at: Time(jiff::Timestamp::from_second(failed).expect("time")),
            action: None,
            by: None,
            note: None,
        },
    );
    r.metadata.namespace = Some(NS.into());
    r.metadata.generation = Some(1);
    r.metadata.creation_timestamp =
        Some(Time(jiff::Timestamp::from_second(created).expect("time")));
    r
}

fn queue() -> DeadLetterQueue {
    let mut q = DeadLetterQueue::new("relayer", Default::default());
    q.metadata.namespace = Some(NS.into());
    q
}

fn replay(rate: &str) -> DeadLetterReplay {
    let mut r = DeadLetterReplay::new(
        "inc-1234",
        DeadLetterReplaySpec {
            queue: "relayer".into(),
            selector: Some(ReplaySelector {
                reason_contains: Some("timeout".into()),
                ..ReplaySelector::default()
            }),
            action: None,
            rate: Some(rate.into()),
            max: None,
            stop_when: None,
            dry_run: None,
            by: "carol".into(),
            note: Some("INC-1234".into()),
            settle_seconds: Some(60),
            stop: None,
        },
    );
    r.metadata.namespace = Some(NS.into());
    r.metadata.uid = Some("replay-uid".into());
    r.metadata.generation = Some(1);
    r
}

/// A replay that started ten seconds ago (its pace allows a full burst).
fn started(mut r: DeadLetterReplay, selected: i64) -> DeadLetterReplay {
    let ago = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(10);
    r.status = Some(DeadLetterReplayStatus {
        phase: Some(ReplayPhase::Running),
        selected,
        started_at: Some(Time(ago)),
        ..Default::default()
    });
    r
}

/// A fresh operator process over the fake's current records.
fn process(fake: &Arc<Fake>) -> Arc<Replays> {
    let ctx = Context::new(
        fake.clone(),
        Arc::new(NoTargets),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of(&[queue()]),
        Metrics::default(),
        Settings::default(),
    );
    Arc::new(Replays::new(Arc::new(ctx)))
}

/// Five matching records parked long ago, one that does not match, one parked just now.
fn queue_records() -> Vec<DeadLetter> {
    let now = jiff::Timestamp::now().as_second();
    let mut other = record("other", 1, 1);
    other.spec.reason = "bad json".into();
    let mut records: Vec<DeadLetter> = (0..5)
        .map(|i| record(&format!("r{i}"), 10 + i, 1))
        .collect();
    records.push(other);
    records.push(record("fresh", 1, now + 5));
    records
}

#[tokio::test]
async fn the_pace_and_a_restart_decide_each_record_once_oldest_first() {
    let fake = Fake::holding(queue_records());
    let replay = Arc::new(started(replay("1/s"), 5));
    // One process whose cache never catches up: its memory keeps it from signing again.
    let first = process(&fake);
    reconcile(replay.clone(), first.clone())
        .await
        .expect("step");
    assert_eq!(
        *fake.signed.lock().expect("lock"),
        ["r0", "r1"],
        "a burst is two seconds' worth"
    );
    reconcile(replay.clone(), first.clone())
        .await
        .expect("step");
    reconcile(replay.clone(), first).await.expect("step");
    // A new leader: memory empty, the records say what was decided; nothing is left.
    reconcile(replay.clone(), process(&fake))
        .await
        .expect("step");
    let signed = fake.signed.lock().expect("lock").clone();
    assert_eq!(
        signed,
        ["r0", "r1", "r2", "r3", "r4"],
        "each once, oldest failure first"
    );
    assert_eq!(
        fake.last_status().phase,
        Some(ReplayPhase::Running),
        "waiting for outcomes"
    );
    let r0 = fake
        .all()
        .into_iter()
        .find(|r| r.metadata.name.as_deref() == Some("r0"))
        .expect("r0");
    assert_eq!(r0.spec.by.as_deref(), Some("carol"));
    assert_eq!(r0.spec.note.as_deref(), Some("replay inc-1234: INC-1234"));
    assert_eq!(r0.spec.action, Some(Action::Redrive));

    fake.carry_out_all();
    reconcile(replay, process(&fake)).await.expect("step");
    let status = fake.last_status();
    assert_eq!(status.phase, Some(ReplayPhase::Completed));
    assert_eq!(
        (status.selected, status.decided, status.redriven),
        (5, 5, 5)
    );
    let summary = status.summary.expect("summary");
    assert!(
        summary.contains("selected 5, decided 5, redriven 5, failing 0"),
        "{summary}"
    );
    assert!(summary.ends_with("; completed"), "{summary}");
    let reasons: Vec<&str> = fake
        .events
        .lock()
        .expect("lock")
        .iter()
        .map(|e| e.reason)
        .collect();
    assert_eq!(reasons, ["Replay"], "the decision record, on the queue");
}

#[tokio::test]
async fn stop_withdraws_what_was_not_carried_out() {
    let fake = Fake::holding(queue_records());
    let mut replay = started(replay("1.5/s"), 5);
    reconcile(Arc::new(replay.clone()), process(&fake))
        .await
        .expect("step");
    assert_eq!(fake.signed.lock().expect("lock").len(), 3);
    replay.spec.stop = Some(true);
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    let status = fake.last_status();
    assert_eq!(status.phase, Some(ReplayPhase::Stopped));
    assert_eq!(
        status.stop_reason.as_deref(),
        Some("stopped on request (spec.stop)")
    );
    assert_eq!(
        (status.decided, status.withdrawn, status.skipped),
        (3, 3, 2)
    );
    assert!(
        fake.all().iter().all(|r| r.spec.action.is_none()),
        "withdrawn"
    );
    let events = fake.events.lock().expect("lock").clone();
    assert!(events.iter().all(|e| e.reason == "ReplayStopped"));
}

#[tokio::test]
async fn a_dry_run_counts_and_names_but_decides_nothing() {
    let fake = Fake::holding(queue_records());
    let mut replay = replay("5/s");
    replay.spec.dry_run = Some(true);
    reconcile(Arc::new(replay), process(&fake))
        .await
        .expect("step");
    let status = fake.last_status();
    assert_eq!(status.phase, Some(ReplayPhase::DryRun));
    assert_eq!(
        status.selected, 6,
        "the fresh record matches too: nothing is frozen yet"
    );
    assert_eq!(status.first_names, ["fresh", "r0", "r1", "r2", "r3", "r4"]);
    assert!(fake.signed.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn a_missing_queue_keeps_the_replay_pending() {
    let fake = Fake::holding(queue_records());
    let ctx = Context::new(
        fake.clone(),
        Arc::new(NoTargets),
        crate::state::records::RecordIndex::listed_with(&fake.all()),
        store_of::<DeadLetterQueue>(&[]),
        Metrics::default(),
        Settings::default(),
    );
    let replays = Arc::new(Replays::new(Arc::new(ctx)));
    reconcile(Arc::new(replay("5/s")), replays)
        .await
        .expect("step");
    let status = fake.last_status();
    assert_eq!(status.phase, Some(ReplayPhase::Pending));
    assert_eq!(status.conditions[0].reason, "QueueNotFound");
}
