//! The reconcilers driven in-process: the fake apiserver (`state::apiserver::fake`:
//! resourceVersions, 409s, a failing write) and a fake target make conflicts, lost races,
//! requeue failures and crashes deterministic, without sleeps. The real-apiserver tests live in
//! `tests/`. One file per subject: `record` (the records reconciler), `queue` (the queue
//! reconciler's counters, readiness, `Full` and retention), `groups` (its failure groups); the
//! fixtures they share are here.

mod groups;
mod queue;
mod record;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use kube::runtime::controller::Action as ReconcileAction;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, DeadLetterStatus, Phase};
use dlq_core::conditions;
use dlq_core::testing::RecordBuilder;

use super::{Context, ReconcileError, Settings};
use crate::metrics::Metrics;
use crate::state::apiserver::fake::FakeApiserver;
use crate::targets::{JobMessage, Target, TargetError, Targets};

const NS: &str = "payments";
const NAME: &str = "pi-0003-settle-5d41402a-1";

/// A broker that records what it was given, or refuses (requeues and probes) while `down`.
#[derive(Default)]
pub(super) struct FakeTarget {
    pub(super) received: Mutex<Vec<JobMessage>>,
    pub(super) down: AtomicBool,
}

impl FakeTarget {
    fn refusal(&self) -> Result<(), TargetError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(TargetError::Unreachable("connection refused".into()));
        }
        Ok(())
    }
}

impl Target for FakeTarget {
    fn describe(&self) -> String {
        "fake".into()
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        async move {
            self.refusal()?;
            self.received
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(job.clone());
            Ok(())
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        async move { self.refusal() }.boxed()
    }
}

impl<T: Target + 'static> Targets for Arc<T> {
    fn target<'a>(
        &'a self,
        _queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Arc<dyn Target>, TargetError>> {
        let target: Arc<dyn Target> = self.clone();
        async move { Ok(target) }.boxed()
    }
}

/// The one record of these tests: job `pi_0003/settle`, with a header, decided by "ops" when
/// `action` is given.
fn record(action: Option<Action>) -> DeadLetter {
    let r = RecordBuilder::job("pi_0003/settle")
        .named(NAME)
        .payload(r#"{"intent":"pi_0003"}"#)
        .header("x-trace", "abc")
        .reason("no luck after 3 deliveries")
        .uid("uid-1");
    match action {
        Some(action) => r.decided(action, "ops").build(),
        None => r.build(),
    }
}

/// A store as it is after its first list (shared with the replay tests).
pub(super) fn store_of<K>(objects: &[K]) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o.clone()));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    store
}

fn queue() -> DeadLetterQueue {
    let mut q = DeadLetterQueue::new("relayer", Default::default());
    q.metadata.namespace = Some(NS.into());
    q
}

/// A fresh operator process (empty memory) over `apiserver`'s records, `target` and `queues`.
pub(super) fn context(
    apiserver: &Arc<FakeApiserver>,
    target: &Arc<FakeTarget>,
    queues: &[DeadLetterQueue],
    settings: Settings,
) -> Arc<Context> {
    Arc::new(Context::new(
        apiserver.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&apiserver.all()),
        store_of(queues),
        Metrics::default(),
        settings,
    ))
}

/// A metric's value from the process's `/metrics` text (0 when absent).
fn metric(ctx: &Context, series: &str) -> f64 {
    let text = ctx.metrics.encode();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

// The queue and groups tests' queue and records.

/// Queue `relayer` of at most `max_parked` records, whose resolved records go after an hour.
fn limited_queue(max_parked: i64) -> DeadLetterQueue {
    let mut q = DeadLetterQueue::new(
        "relayer",
        dlq_core::api::DeadLetterQueueSpec {
            max_parked: Some(max_parked),
            retention: Some(dlq_core::api::Retention {
                resolved_for: "1h".into(),
            }),
            ..Default::default()
        },
    );
    q.metadata.namespace = Some(NS.into());
    q.metadata.generation = Some(4);
    q
}

/// One record of job `job`, stored `ago` seconds before `now`.
fn queued(job: &str, kind: dlq_core::api::FailureKind, now: i64, ago: i64) -> RecordBuilder {
    RecordBuilder::job(job)
        .named(job)
        .uid(&format!("uid-{job}"))
        .failure_kind(kind)
        .created(dlq_core::testing::at(now - ago))
}

/// A queue's records in every state retention and the counters tell apart, `now` in seconds.
fn queue_records(now: i64) -> Vec<DeadLetter> {
    use dlq_core::api::FailureKind::{Invalid, Transient};
    let at = |ago: i64| dlq_core::testing::at(now - ago);
    const H: i64 = 3600;
    vec![
        // Parked records are never deleted, even one carrying a stale resolvedAt.
        queued("parked-old", Transient, now, 3 * H)
            .resolved(Phase::Parked, "nobody", at(2 * H))
            .build(),
        queued("parked-invalid", Invalid, now, H)
            .phase(Phase::Parked)
            .build(),
        // Not marked yet: counted as Parked.
        queued("unmarked", Transient, now, 1800).build(),
        queued("redriven-old", Transient, now, 4 * H)
            .resolved(Phase::Redriven, "ops", at(2 * H))
            .build(),
        queued("dropped-old", Invalid, now, 4 * H)
            .resolved(Phase::Dropped, "ops", at(3 * H))
            .build(),
        queued("redriven-recent", Transient, now, 4 * H)
            .resolved(Phase::Redriven, "ops", at(600))
            .build(),
        // Cycle 1 of a job whose cycle 2 is parked: it goes last, so it stays.
        queued("again", Transient, now, 5 * H)
            .named("again-1")
            .uid("uid-again-1")
            .resolved(Phase::Redriven, "ops", at(2 * H))
            .build(),
        queued("again", Transient, now, 600)
            .named("again-2")
            .uid("uid-again-2")
            .cycle(2)
            .phase(Phase::Parked)
            .build(),
    ]
}
