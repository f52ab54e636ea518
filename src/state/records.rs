//! The operator's view of every record, as summaries (`dlq_core::record::Summary`): what the
//! queue counters, retention, replays, alerts and the records feeder ([`crate::run::feeder`]) read.
//!
//! Fed from the record watch, like the job index. With 100,000 records a whole-record cache
//! held 2 KiB a record (RSS 227 MiB); a summary is a fraction of that. Records with something
//! to do are also held whole, but only those, in the records controller's store.
//!
//! Its view is a prefix of the apiserver's history. A re-list builds a new view beside the
//! live one and replaces it when complete.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use kube::runtime::watcher::Event;
use tokio::sync::watch;

use dlq_core::api::DeadLetter;
use dlq_core::record::{Interner, Summary};

/// namespace → name → summary.
type Records = HashMap<Arc<str>, HashMap<Box<str>, Arc<Summary>>>;

/// Deletes between two sweeps of the shared strings no summary holds any more.
const PRUNE_EVERY: u32 = 4096;

#[derive(Default)]
struct State {
    live: Records,
    /// A list in progress (the live view stays in use until it completes).
    pending: Option<Records>,
    strings: Interner,
    deletes: u32,
}

impl State {
    fn insert(records: &mut Records, strings: &mut Interner, dl: &DeadLetter) {
        let summary = Summary::of(dl, strings);
        let by_name = records.entry(summary.namespace.clone()).or_default();
        by_name.insert(summary.name.clone(), Arc::new(summary));
    }

    fn remove(&mut self, dl: &DeadLetter) {
        let (Some(ns), Some(name)) = (
            dl.metadata.namespace.as_deref(),
            dl.metadata.name.as_deref(),
        ) else {
            return;
        };
        if let Some(by_name) = self.live.get_mut(ns) {
            by_name.remove(name);
            if by_name.is_empty() {
                self.live.remove(ns);
            }
        }
        self.deletes += 1;
        if self.deletes >= PRUNE_EVERY {
            self.deletes = 0;
            self.strings.prune();
        }
    }
}

struct Inner {
    state: RwLock<State>,
    /// True once the first list completed.
    listed: watch::Sender<bool>,
    /// Bumped on every change (the alert sender wakes on it).
    changes: watch::Sender<u64>,
}

/// A cheap-to-clone handle on the index.
#[derive(Clone)]
pub struct RecordIndex {
    inner: Arc<Inner>,
}

impl Default for RecordIndex {
    fn default() -> Self {
        RecordIndex {
            inner: Arc::new(Inner {
                state: RwLock::default(),
                listed: watch::Sender::new(false),
                changes: watch::Sender::new(0),
            }),
        }
    }
}

impl RecordIndex {
    /// An index that has listed `records` (tests, and a process's first view in them).
    pub fn listed_with(records: &[DeadLetter]) -> Self {
        let index = RecordIndex::default();
        index.observe(&Event::Init);
        for r in records {
            index.observe(&Event::InitApply(r.clone()));
        }
        index.observe(&Event::InitDone);
        index
    }

    /// Applies one watch event (every event, in order).
    pub fn observe(&self, event: &Event<DeadLetter>) {
        {
            let Ok(mut guard) = self.inner.state.write() else {
                return;
            };
            let state = &mut *guard;
            match event {
                Event::Init => state.pending = Some(Records::new()),
                Event::InitApply(dl) => {
                    if let Some(pending) = state.pending.as_mut() {
                        State::insert(pending, &mut state.strings, dl);
                    }
                }
                Event::InitDone => {
                    if let Some(done) = state.pending.take() {
                        state.live = done;
                    }
                    state.strings.prune();
                }
                Event::Apply(dl) => State::insert(&mut state.live, &mut state.strings, dl),
                Event::Delete(dl) => state.remove(dl),
            }
        }
        match event {
            Event::InitDone => {
                self.inner.listed.send_replace(true);
                self.inner.changes.send_modify(|n| *n += 1);
            }
            Event::Apply(_) | Event::Delete(_) => self.inner.changes.send_modify(|n| *n += 1),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// Whether the first list has completed.
    pub fn listed(&self) -> bool {
        *self.inner.listed.borrow()
    }

    /// Resolves once the first list has completed.
    pub async fn wait_listed(&self) {
        let mut listed = self.inner.listed.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we wait.
        let _ = listed.wait_for(|l| *l).await;
    }

    /// A receiver that sees a new value after every change to the view.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    fn read<T>(&self, f: impl FnOnce(&Records) -> T) -> Option<T> {
        let state = self.inner.state.read().ok()?;
        Some(f(&state.live))
    }

    /// The records of queue `queue` in `ns`.
    pub fn queue(&self, ns: &str, queue: &str) -> Vec<Arc<Summary>> {
        self.read(|live| {
            live.get(ns).map_or_else(Vec::new, |by_name| {
                by_name
                    .values()
                    .filter(|s| &*s.queue == queue)
                    .cloned()
                    .collect()
            })
        })
        .unwrap_or_default()
    }

    /// One record by namespace and name.
    pub fn get(&self, ns: &str, name: &str) -> Option<Arc<Summary>> {
        self.read(|live| live.get(ns)?.get(name).cloned()).flatten()
    }

    /// Every record.
    pub fn all(&self) -> Vec<Arc<Summary>> {
        self.read(|live| live.values().flat_map(|m| m.values().cloned()).collect())
            .unwrap_or_default()
    }

    /// The digest of every stored body any record names, in every queue and namespace: what a
    /// sweep of any store keeps (`dlq_core::body::sweep`). None when the view cannot be read:
    /// an empty list would let a sweep delete every body.
    pub fn body_digests(&self) -> Option<Vec<Box<str>>> {
        self.read(|live| {
            live.values()
                .flat_map(HashMap::values)
                .filter_map(|s| s.body.clone())
                .collect()
        })
    }

    /// Every record (any phase) in one snapshot, and how many of them carry each slot block
    /// of `blocks` (`dlq.dev/slot-block`): what the `--max-records` ledger is reckoned from
    /// (`crate::state::ceiling`). None when the view cannot be read.
    pub fn tally(&self, blocks: &HashSet<&str>) -> Option<(i64, HashMap<String, i64>)> {
        self.read(|live| {
            let mut total = 0i64;
            let mut seen: HashMap<String, i64> = HashMap::new();
            for s in live.values().flat_map(HashMap::values) {
                total += 1;
                if let Some(b) = s.slot_block.as_deref()
                    && blocks.contains(b)
                {
                    *seen.entry(b.to_string()).or_default() += 1;
                }
            }
            (total, seen)
        })
    }

    pub fn len(&self) -> usize {
        self.read(|live| live.values().map(HashMap::len).sum())
            .unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Phase;
    use dlq_core::record::Facts;
    use dlq_core::testing::RecordBuilder;

    fn record(id: &str, queue: &str) -> DeadLetter {
        RecordBuilder::job(id).queue(queue).build()
    }

    fn with_body(id: &str, ns: &str, queue: &str, sha256: &str) -> DeadLetter {
        let mut r = RecordBuilder::job(id).namespace(ns).queue(queue).build();
        r.spec.job.body = Some(Box::new(dlq_core::api::BodyRef {
            reference: format!("s3://b/sha256/{sha256}"),
            size: 1,
            sha256: sha256.into(),
            ..Default::default()
        }));
        r
    }

    /// A sweep keeps what any record names: the digests of every queue in every namespace, not
    /// only of the queues whose spec spells the swept place the same way.
    #[test]
    fn body_digests_span_every_queue_and_namespace() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let index = RecordIndex::listed_with(&[
            with_body("1", "payments", "relayer", &a),
            with_body("2", "orders", "mirror", &b),
            with_body("3", "orders", "mirror", &a),
            record("inline", "relayer"),
        ]);
        let mut digests = index.body_digests().expect("readable");
        digests.sort();
        let want: Vec<Box<str>> = vec![a.as_str().into(), a.as_str().into(), b.as_str().into()];
        assert_eq!(digests, want);
    }

    #[test]
    fn not_listed_until_the_first_list_completes_and_a_relist_replaces_the_view_when_done() {
        let index = RecordIndex::default();
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(record("a", "relayer")));
        assert!(!index.listed());
        assert!(index.is_empty());
        index.observe(&Event::InitDone);
        assert!(index.listed());
        assert_eq!(index.len(), 1);
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(record("b", "relayer")));
        assert_eq!(index.len(), 1, "the old view serves until the list is done");
        assert!(
            index
                .get(
                    "payments",
                    &record("a", "relayer")
                        .metadata
                        .name
                        .clone()
                        .unwrap_or_default()
                )
                .is_some()
        );
        index.observe(&Event::InitDone);
        let names: Vec<String> = index.all().iter().map(|s| s.job_id.to_string()).collect();
        assert_eq!(names, ["b"]);
    }

    #[test]
    fn follows_applies_and_deletes_by_queue() {
        let index = RecordIndex::listed_with(&[record("a", "relayer"), record("b", "mailer")]);
        let changes = index.changes();
        let mut marked = record("a", "relayer");
        marked.status = Some(dlq_core::api::DeadLetterStatus {
            phase: Some(Phase::Redriven),
            ..Default::default()
        });
        index.observe(&Event::Apply(marked));
        assert!(
            changes.has_changed().unwrap_or(false),
            "a change wakes readers"
        );
        let relayer = index.queue("payments", "relayer");
        assert_eq!(relayer.len(), 1);
        assert_eq!(relayer[0].phase(), Phase::Redriven);
        assert!(index.queue("other", "relayer").is_empty());
        index.observe(&Event::Delete(record("b", "mailer")));
        assert!(index.queue("payments", "mailer").is_empty());
        assert_eq!(index.len(), 1);
    }
}
