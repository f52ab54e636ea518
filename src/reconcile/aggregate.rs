//! Folds the Events that come in numbers, so that a bulk resolution or a parking storm costs
//! the apiserver a few Event writes instead of one a record.
//!
//! Normal resolution Events per (namespace, queue, reason), as client-go's event aggregator
//! does: the first Event of a quiet queue goes out at once about its record; while resolutions
//! keep coming, each [`PERIOD`] publishes one Event about the queue with the count and the
//! names instead of one write per record (a redrive otherwise costs an Event write on top of
//! its status compare-and-swap).
//!
//! `Parked`, the one Warning folded, per (namespace, queue, failure group, reason): the policy
//! is `dlq_core::event_series`. A trickle's records get their own Event, published by their
//! reconcile at once ([`Aggregator::take`] hands it back); a storm (more than
//! `STORM_ABOVE` a second) becomes one Event series about the group's DeadLetterGroup (the
//! queue while the group object is not known), which this task creates and patches at its
//! ticks (`series.count`, `series.lastObservedTime`) and finishes once the storm is over.
//! Every other Warning never passes through here (`dlq_core::events::aggregatable`,
//! `in_series`).
//!
//! Events are a view, the records' status is the truth: a crash loses at most one period of
//! summaries and a series' count since its last write, never a resolution or a record.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use tokio::sync::mpsc;

use dlq_core::event_series::{Arrival, SeriesKey, SeriesWrite, Storms, Written};
use dlq_core::events::{EventPlan, in_series, summary};

use crate::state::apiserver::Apiserver;

/// How long resolutions of one queue are gathered into one Event; how often series are
/// written.
pub const PERIOD: Duration = Duration::from_secs(1);

/// One foldable Event about a record.
#[derive(Debug, Clone)]
pub struct Pending {
    pub namespace: String,
    pub queue: String,
    /// The record's name, listed in the summary.
    pub name: String,
    pub regarding: ObjectReference,
    /// The queue's reference, which the summary is about (the record's when unknown).
    pub queue_ref: Option<ObjectReference>,
    /// The record's failure group (fingerprint): a `Parked` series is per group.
    pub group: Option<String>,
    /// The group's DeadLetterGroup, which a `Parked` series is about when the operator knows
    /// it (else the queue's).
    pub group_ref: Option<ObjectReference>,
    pub plan: EventPlan,
}

type Key = (String, String, &'static str);

/// Where [`super::Context::carry_out`] sends foldable Events.
#[derive(Clone)]
pub struct Aggregator {
    tx: mpsc::UnboundedSender<Pending>,
    storms: ParkedStorms,
}

impl Aggregator {
    /// Starts the aggregating task; it ends (after a last flush) when every handle is dropped.
    pub fn spawn(apiserver: Arc<dyn Apiserver>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let storms = ParkedStorms::default();
        tokio::spawn(run(apiserver, rx, storms.clone(), PERIOD));
        Aggregator { tx, storms }
    }

    /// Takes `event` to fold; gives back what the caller publishes itself now: a trickle's
    /// `Parked` Event, or any Event once the task is gone.
    pub fn take(&self, event: Pending) -> Option<Pending> {
        if self.tx.is_closed() {
            tracing::warn!("event aggregator gone; publishing directly");
            return Some(event);
        }
        if in_series(&event.plan) {
            return self.storms.arrive(event);
        }
        self.tx.send(event).err().map(|e| {
            tracing::warn!("event aggregator gone; publishing directly");
            e.0
        })
    }
}

/// This process's `Parked` storms (`dlq_core::event_series::Storms`) on its clock: the
/// reconciles ask it about each `Parked` Event, the task writes the series.
#[derive(Clone, Default)]
pub struct ParkedStorms {
    storms: Arc<Mutex<Storms<Pending>>>,
    clock: Clock,
}

impl ParkedStorms {
    /// `event` back when it is to be published as it is, None when a series counts it.
    fn arrive(&self, event: Pending) -> Option<Pending> {
        let key = SeriesKey {
            namespace: event.namespace.clone(),
            queue: event.queue.clone(),
            group: event.group.clone(),
            reason: event.plan.reason,
        };
        let name = event.name.clone();
        match self.lock().arrive(key, &name, event, self.clock.now()) {
            Arrival::Own(event) => Some(event),
            Arrival::Folded => None,
        }
    }

    /// A lock that a panic elsewhere cannot poison for good.
    fn lock(&self) -> MutexGuard<'_, Storms<Pending>> {
        self.storms
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Wall time as the runtime's clock moves it: the series' times, and the storms' pace in
/// tests whose clock is paused.
#[derive(Clone, Copy)]
struct Clock {
    wall: Timestamp,
    at: tokio::time::Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            wall: Timestamp::now(),
            at: tokio::time::Instant::now(),
        }
    }
}

impl Clock {
    fn now(&self) -> Timestamp {
        SignedDuration::try_from(self.at.elapsed())
            .ok()
            .and_then(|d| self.wall.checked_add(d).ok())
            .unwrap_or(self.wall)
    }
}

/// The task: open periods per key; an Event for a key without an open period is published at
/// once and opens one; each tick flushes what the periods gathered and closes quiet ones, then
/// writes the series that are due.
pub async fn run(
    apiserver: Arc<dyn Apiserver>,
    mut rx: mpsc::UnboundedReceiver<Pending>,
    storms: ParkedStorms,
    period: Duration,
) {
    let mut open: HashMap<Key, Vec<Pending>> = HashMap::new();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            got = rx.recv() => match got {
                Some(p) => {
                    let key = (p.namespace.clone(), p.queue.clone(), p.plan.reason);
                    match open.get_mut(&key) {
                        Some(gathered) => gathered.push(p),
                        None => {
                            apiserver.publish(p.regarding.clone(), &p.plan).await;
                            open.insert(key, Vec::new());
                        }
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                flush(apiserver.as_ref(), &mut open).await;
                write_series(apiserver.as_ref(), &storms).await;
            }
        }
    }
    flush(apiserver.as_ref(), &mut open).await;
    tracing::debug!("event aggregator stopped");
}

/// Carries out what the storms ask for now and tells them how each write went.
async fn write_series(apiserver: &dyn Apiserver, storms: &ParkedStorms) {
    let writes = storms.lock().tick(storms.clock.now());
    for write in writes {
        match write {
            SeriesWrite::Own(p) => apiserver.publish(p.regarding, &p.plan).await,
            SeriesWrite::Create {
                key,
                about,
                plan,
                occurrences,
            } => {
                let count = occurrences.map_or(1, |o| o.count);
                let regarding = about
                    .group_ref
                    .or(about.queue_ref)
                    .unwrap_or(about.regarding);
                let outcome = match apiserver.create_event(regarding, &plan, occurrences).await {
                    Ok(name) => {
                        tracing::info!(namespace = %key.namespace, queue = %key.queue, group = key.group.as_deref().unwrap_or("-"), reason = key.reason, count, event = %name, "storm: events folded into one series");
                        Written::Created(name)
                    }
                    Err(error) => {
                        tracing::warn!(%error, namespace = %key.namespace, queue = %key.queue, reason = key.reason, "creating an event series failed");
                        Written::Failed
                    }
                };
                storms.lock().written(&key, count, outcome);
            }
            SeriesWrite::Patch {
                key,
                event,
                occurrences,
            } => {
                let outcome = match apiserver
                    .patch_series(&key.namespace, &event, occurrences)
                    .await
                {
                    Ok(()) => Written::Patched,
                    Err(kube::Error::Api(s)) if s.code == 404 => Written::Gone,
                    Err(error) => {
                        tracing::warn!(%error, namespace = %key.namespace, event = %event, "patching an event series failed");
                        Written::Failed
                    }
                };
                storms.lock().written(&key, occurrences.count, outcome);
            }
        }
    }
}

/// Publishes each period's gathering: a single Event as it was, several as one summary.
async fn flush(apiserver: &dyn Apiserver, open: &mut HashMap<Key, Vec<Pending>>) {
    let keys: Vec<Key> = open.keys().cloned().collect();
    for key in keys {
        let gathered = open.get_mut(&key).map(std::mem::take).unwrap_or_default();
        match gathered.len() {
            0 => {
                open.remove(&key);
            }
            1 => {
                for p in gathered {
                    apiserver.publish(p.regarding, &p.plan).await;
                }
            }
            _ => {
                let names: Vec<String> = gathered.iter().map(|p| p.name.clone()).collect();
                let first = &gathered[0];
                let regarding = first
                    .queue_ref
                    .clone()
                    .unwrap_or_else(|| first.regarding.clone());
                let plan = summary(&key.1, first.plan.reason, first.plan.action, &names);
                tracing::info!(namespace = %key.0, queue = %key.1, reason = key.2, count = names.len(), "resolution events aggregated");
                apiserver.publish(regarding, &plan).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::apiserver::fake::FakeApiserver;
    use dlq_core::events::{EventType, action, reason};

    fn pending(queue: &str, name: &str, plan: EventPlan) -> Pending {
        let named = |n: &str| ObjectReference {
            name: Some(n.into()),
            ..ObjectReference::default()
        };
        Pending {
            namespace: "payments".into(),
            queue: queue.into(),
            name: name.into(),
            regarding: named(name),
            queue_ref: Some(named(queue)),
            group: Some("3f9a1c07d2".into()),
            group_ref: None,
            plan,
        }
    }

    fn redriven() -> EventPlan {
        EventPlan::normal(reason::REDRIVEN, action::REDRIVE, "redriven by ops")
    }

    #[tokio::test(start_paused = true)]
    async fn a_bulk_resolution_becomes_one_event_per_window() {
        let api = Arc::new(FakeApiserver::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(api.clone(), rx, ParkedStorms::default(), PERIOD));
        for i in 0..200 {
            let _ = tx.send(pending("relayer", &format!("r{i}"), redriven()));
        }
        let _ = tx.send(pending("other", "o1", redriven()));
        tokio::time::sleep(PERIOD * 3).await;
        drop(tx);
        let _ = task.await;
        let published = api.published();
        // r0 and o1 at once about their records; r1..r199 as one summary about the queue.
        assert_eq!(published.len(), 3, "{published:?}");
        assert_eq!(published[0].0.as_deref(), Some("r0"));
        let summary = published
            .iter()
            .find(|(n, _)| n.as_deref() == Some("relayer"))
            .map(|(_, p)| p.clone());
        let summary = summary.unwrap_or_else(redriven);
        assert!(
            summary
                .note
                .starts_with("199 records of queue relayer redriven: r1, r2"),
            "{}",
            summary.note
        );
        assert_eq!(summary.type_, EventType::Normal);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_resolution_keeps_its_own_event() {
        let api = Arc::new(FakeApiserver::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(api.clone(), rx, ParkedStorms::default(), PERIOD));
        let _ = tx.send(pending("relayer", "a", redriven()));
        tokio::time::sleep(PERIOD * 3).await;
        // The period closed: the next one is published at once too.
        let _ = tx.send(pending("relayer", "b", redriven()));
        tokio::time::sleep(PERIOD / 2).await;
        let _ = tx.send(pending("relayer", "c", redriven()));
        drop(tx);
        let _ = task.await;
        let names: Vec<Option<String>> = api.published().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            vec![Some("a".into()), Some("b".into()), Some("c".into())]
        );
    }
}
