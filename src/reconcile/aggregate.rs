//! Aggregates Normal resolution Events per (namespace, queue, reason) during bulk
//! resolutions, as client-go's event aggregator does: the first Event of a quiet queue goes
//! out at once about its record; while resolutions keep coming, each [`PERIOD`] publishes one
//! Event about the queue with the count and the names instead of one write per record (a
//! redrive otherwise costs an Event write on top of its status compare-and-swap). Warnings
//! never pass through here (`dlq_core::events::aggregatable`).
//!
//! Events are a view, the records' status is the truth: a crash loses at most one period of
//! summaries, never a resolution.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::sync::mpsc;

use dlq_core::events::{EventPlan, summary};

use crate::state::apiserver::Apiserver;

/// How long resolutions of one queue are gathered into one Event.
pub const PERIOD: Duration = Duration::from_secs(1);

/// One aggregatable Event about a record.
#[derive(Debug)]
pub struct Pending {
    pub namespace: String,
    pub queue: String,
    /// The record's name, listed in the summary.
    pub name: String,
    pub regarding: ObjectReference,
    /// The queue's reference, which the summary is about (the record's when unknown).
    pub queue_ref: Option<ObjectReference>,
    pub plan: EventPlan,
}

type Key = (String, String, &'static str);

/// Where [`super::Context::carry_out`] sends aggregatable Events.
#[derive(Clone)]
pub struct Aggregator {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Aggregator {
    /// Starts the aggregating task; it ends (after a last flush) when every handle is dropped.
    pub fn spawn(apiserver: Arc<dyn Apiserver>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(apiserver, rx, PERIOD));
        Aggregator { tx }
    }

    /// Queues `event`; gives it back when the task is gone (the caller then publishes it
    /// itself).
    pub fn send(&self, event: Pending) -> Result<(), Box<Pending>> {
        self.tx.send(event).map_err(|e| Box::new(e.0))
    }
}

/// The task: open periods per key; an Event for a key without an open period is published at
/// once and opens one; each tick flushes what the periods gathered and closes quiet ones.
pub async fn run(
    apiserver: Arc<dyn Apiserver>,
    mut rx: mpsc::UnboundedReceiver<Pending>,
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
            _ = tick.tick() => flush(apiserver.as_ref(), &mut open).await,
        }
    }
    flush(apiserver.as_ref(), &mut open).await;
    tracing::debug!("event aggregator stopped");
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
        let task = tokio::spawn(run(api.clone(), rx, PERIOD));
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
        let task = tokio::spawn(run(api.clone(), rx, PERIOD));
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
