//! The operator's `--max-records` (the rules are `dlq_core::ceiling`, the parkers' side
//! `dlq_client::ceiling`): the leader's count of every record it watches into the ledger
//! ConfigMap, and what the queues' `Full` condition, the `dlq_records_held` gauge and the
//! `MaxRecordsReached` Event read of it.
//!
//! One counter per process, over every scope's record index ([`Ceiling::register`]): it waits
//! until each has listed, then writes the ledger whenever the records, the ledger (a parker
//! took a block) or the clock (a block expired) give it something to change, at most every
//! [`SETTLE`], from one snapshot of each index (`RecordIndex::tally`). It creates the ledger
//! when there is none; until then parkers under the ceiling wait (nothing is granted before
//! the first count).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::{Notify, watch};

use dlq_client::ceiling::Ceiling as Ledger;
use dlq_core::capacity::CeilingUse;
use dlq_core::ceiling::{self, reckon};
use dlq_core::events::{self, EventPlan};

use super::apiserver::{Apiserver, MANAGER, reference};
use super::records::RecordIndex;
use crate::metrics::Metrics;

/// Shortest time between two counts (a storm's records arrive one watch event at a time).
pub const SETTLE: Duration = Duration::from_millis(250);
/// Longest time between two counts: blocks expire with the clock, not with an event.
const TICK: Duration = Duration::from_secs(5);

/// The ceiling and its last count; cheap to clone.
#[derive(Clone)]
pub struct Ceiling {
    inner: Arc<Inner>,
}

struct Inner {
    ledger: Ledger,
    /// Every scope's record index.
    indexes: Mutex<Vec<RecordIndex>>,
    registered: watch::Sender<usize>,
    /// Records held (counted + slots granted and not yet seen) as last counted; None before.
    held: watch::Sender<Option<i64>>,
}

impl Ceiling {
    pub fn new(ledger: Ledger) -> Self {
        Ceiling {
            inner: Arc::new(Inner {
                ledger,
                indexes: Mutex::default(),
                registered: watch::Sender::new(0),
                held: watch::Sender::new(None),
            }),
        }
    }

    /// Where the ledger is and the ceiling, as the parkers are told it.
    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    /// A scope's record index, counted from now on.
    pub fn register(&self, records: RecordIndex) {
        self.lock().push(records);
        self.inner.registered.send_modify(|n| *n += 1);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecordIndex>> {
        // A panic while holding it leaves a plain list behind; keep using it.
        self.inner.indexes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ceiling and the records held at the last count; None before the first.
    pub fn use_now(&self) -> Option<CeilingUse> {
        let held = (*self.inner.held.borrow())?;
        Some(CeilingUse {
            held,
            limit: self.inner.ledger.limit,
        })
    }

    /// Sees every new count (the queues' `Full` is woken when the ceiling is reached or left).
    pub fn subscribe(&self) -> watch::Receiver<Option<i64>> {
        self.inner.held.subscribe()
    }

    /// Counts until `stop`, once `scopes` indexes are registered and have listed.
    pub async fn keep_count(
        self,
        client: Client,
        apiserver: Arc<dyn Apiserver>,
        metrics: Metrics,
        scopes: usize,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::select! {
            _ = self.count(client, apiserver, metrics, scopes) => {}
            _ = stop => {}
        }
    }

    async fn count(
        &self,
        client: Client,
        apiserver: Arc<dyn Apiserver>,
        metrics: Metrics,
        scopes: usize,
    ) {
        let _ = self
            .inner
            .registered
            .subscribe()
            .wait_for(|n| *n >= scopes)
            .await;
        let indexes = self.lock().clone();
        for index in &indexes {
            index.wait_listed().await;
        }
        metrics.records_ceiling.set(self.inner.ledger.limit);
        let api: Api<ConfigMap> = Api::namespaced(client, &self.inner.ledger.namespace);
        let (seen_tx, mut seen) = watch::channel::<Option<ConfigMap>>(None);
        let watching = watch_ledger(api.clone(), self.inner.ledger.name.clone(), seen_tx);
        let poke = Arc::new(Notify::new());
        let pokers = indexes.iter().map(|index| {
            let (mut changes, poke) = (index.changes(), poke.clone());
            async move {
                while changes.changed().await.is_ok() {
                    poke.notify_one();
                }
            }
        });
        let pokers = futures::future::join_all(pokers);
        let counting = async {
            let mut reached = false;
            let mut current: Option<ConfigMap> = None;
            loop {
                // The watch's view, unless this process's own write is newer.
                if let Some(watched) = seen.borrow_and_update().clone()
                    && newer(&watched, current.as_ref())
                {
                    current = Some(watched);
                }
                current = self.count_once(&api, &indexes, current).await;
                let held = current
                    .as_ref()
                    .and_then(|cm| ceiling::Ledger::read(cm.data.iter().flatten()).held());
                self.inner.held.send_replace(held);
                if let Some(held) = held {
                    metrics.records_held.set(held);
                    let now = held >= self.inner.ledger.limit;
                    if now
                        && !reached
                        && let Some(cm) = &current
                    {
                        let note = format!(
                            "the operator keeps {held} records (or slots being parked) across the queues it watches, at its --max-records of {}: new dead messages stay in their brokers until records are deleted",
                            self.inner.ledger.limit
                        );
                        tracing::warn!(
                            held,
                            limit = self.inner.ledger.limit,
                            "--max-records reached; parking waits"
                        );
                        let event = EventPlan::warning(
                            events::reason::MAX_RECORDS_REACHED,
                            events::action::PARK,
                            note,
                        );
                        apiserver.publish(reference(cm), &event).await;
                    }
                    reached = now;
                }
                tokio::select! {
                    _ = poke.notified() => {}
                    _ = seen.changed() => {}
                    _ = tokio::time::sleep(TICK) => {}
                }
                tokio::time::sleep(SETTLE).await;
            }
        };
        tokio::select! {
            _ = watching => {}
            _ = pokers => {}
            _ = counting => {}
        }
    }

    /// One count into the ledger `current` (None: there is none yet, so it is created);
    /// returns the ledger as written, or as it was when nothing changed or the write failed.
    async fn count_once(
        &self,
        api: &Api<ConfigMap>,
        indexes: &[RecordIndex],
        current: Option<ConfigMap>,
    ) -> Option<ConfigMap> {
        let ledger = current
            .as_ref()
            .map(|cm| ceiling::Ledger::read(cm.data.iter().flatten()))
            .unwrap_or_default();
        let ids: HashSet<&str> = ledger.blocks.keys().map(String::as_str).collect();
        let (mut records, mut seen) = (0i64, HashMap::<String, i64>::new());
        for index in indexes {
            let (total, blocks) = index.tally(&ids)?;
            records += total;
            for (id, n) in blocks {
                *seen.entry(id).or_default() += n;
            }
        }
        let limit = self.inner.ledger.limit;
        let now = jiff::Timestamp::now().as_second();
        let write = reckon(
            &ledger,
            records,
            limit,
            |id| seen.get(id).copied().unwrap_or(0),
            now,
        );
        let name = &self.inner.ledger.name;
        let Some(cm) = current else {
            let data: std::collections::BTreeMap<String, String> = write
                .into_iter()
                .filter_map(|(k, v)| Some((k, v?)))
                .collect();
            let fresh: ConfigMap = match serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": MANAGER}},
                "data": data,
            })) {
                Ok(cm) => cm,
                Err(e) => {
                    tracing::warn!(error = %e, "the records ledger cannot be written");
                    return None;
                }
            };
            let pp = PostParams {
                field_manager: Some(MANAGER.into()),
                ..PostParams::default()
            };
            return match api.create(&pp, &fresh).await {
                Ok(created) => {
                    tracing::info!(ledger = %name, records, limit, "records ledger created");
                    Some(created)
                }
                Err(e) => {
                    // 409: it exists after all; the watch brings it.
                    tracing::debug!(ledger = %name, error = %e, "creating the records ledger failed");
                    None
                }
            };
        };
        if !ceiling::changes(&write, cm.data.iter().flatten()) {
            return Some(cm);
        }
        let pp = PatchParams {
            field_manager: Some(MANAGER.into()),
            ..PatchParams::default()
        };
        match api
            .patch(name, &pp, &Patch::Merge(json!({ "data": write })))
            .await
        {
            Ok(updated) => {
                tracing::debug!(ledger = %name, records, "records counted");
                Some(updated)
            }
            // Deleted meanwhile: made again at the next count.
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => {
                tracing::debug!(ledger = %name, error = %e, "writing the records count failed; next turn");
                Some(cm)
            }
        }
    }
}

/// Whether `watched` is a later version of the ledger than `current` (or there is none).
fn newer(watched: &ConfigMap, current: Option<&ConfigMap>) -> bool {
    let version = |cm: &ConfigMap| {
        cm.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
    };
    match current {
        None => true,
        Some(c) => match (version(watched), version(c)) {
            (Some(w), Some(c)) => w > c,
            _ => true,
        },
    }
}

/// Watches the ledger ConfigMap `name` into `seen` (a deleted one is noticed by the next
/// write, which then makes it again).
async fn watch_ledger(api: Api<ConfigMap>, name: String, seen: watch::Sender<Option<ConfigMap>>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    watcher(api, config)
        .default_backoff()
        .for_each(|event| {
            match event {
                Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => {
                    seen.send_replace(Some(cm));
                }
                Ok(
                    watcher::Event::Delete(_) | watcher::Event::Init | watcher::Event::InitDone,
                ) => {}
                Err(e) => {
                    tracing::warn!(ledger = %name, error = %e, "watching the records ledger failed; retrying")
                }
            }
            futures::future::ready(())
        })
        .await;
}
