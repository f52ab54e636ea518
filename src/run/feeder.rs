//! Feeds the records controller: holds whole (stripped: [`super::held::strip`]) only the
//! records with something to do, and wakes the controller for them.
//!
//! - A record with a decision to carry out is held at once: decisions never wait.
//! - A record whose only work is its first mark is held while fewer than [`MARK_QUOTA`] such
//!   records are; the others wait in arrival order, as summaries in the index, and are held
//!   (rebuilt from their summary) as marks complete. An operator started over 100,000 unmarked
//!   records held all of them whole (and a queued reconcile each) until marked. A record held
//!   for [`MARK_STALE`] without being marked (its mark keeps failing) stops counting, so a
//!   few records that cannot be marked never hold the others back.
//! - A record with nothing to do (waiting for a decision, resolved) is not held.
//!
//! It also wakes each queue's counter when one of its records changes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::watcher::Event;

use dlq_core::api::{DeadLetter, DeadLetterQueue, Phase};
use dlq_core::decide::Decision;
use dlq_core::record::Interner;

use crate::state::records::RecordIndex;

/// Records held for their first mark at once, at most: enough to keep the records
/// controller's 32 reconciles busy while the watch brings back the marks that free room.
pub const MARK_QUOTA: usize = 512;
/// How long a record held for its mark counts against [`MARK_QUOTA`].
pub const MARK_STALE: Duration = Duration::from_secs(30);

/// (namespace, name).
type Key = (Arc<str>, Box<str>);

/// What a record calls for, as the feeder sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    None,
    /// Only its first mark.
    Mark,
    /// A decision (or an unsigned one to refuse).
    Decision,
}

fn work_of(dl: &DeadLetter) -> Work {
    match dlq_core::decide::for_record(dl) {
        Decision::Done | Decision::Wait => Work::None,
        Decision::MarkParked => Work::Mark,
        Decision::Redrive { .. } | Decision::Drop { .. } | Decision::Refuse { .. } => {
            Work::Decision
        }
    }
}

/// A record in the controller's store.
#[derive(Debug, Clone, Copy)]
struct Held {
    generation: Option<i64>,
    /// Held only for its mark, and counted against the quota (not stale yet).
    mark_only: bool,
    since: Instant,
}

/// The held records and the ones waiting for room, as of one view of the records.
struct Quota {
    /// Records held for their mark at once, at most ([`MARK_QUOTA`]; unbounded when the
    /// quota is switched off).
    limit: usize,
    held: HashMap<Key, Held>,
    /// How many of `held` are there only for their mark.
    marking: usize,
    waiting: VecDeque<Key>,
    /// When held records were last checked for staleness (at most once a second: a full
    /// quota is asked for room at every event of a backlog).
    checked: Option<Instant>,
}

impl Quota {
    fn new(limit: usize) -> Self {
        Quota {
            limit,
            held: HashMap::new(),
            marking: 0,
            waiting: VecDeque::new(),
            checked: None,
        }
    }

    fn hold(&mut self, key: Key, held: Held) -> Option<Held> {
        let before = self.held.insert(key, held);
        self.marking += usize::from(held.mark_only);
        self.marking -= usize::from(before.is_some_and(|b| b.mark_only));
        before
    }

    fn release(&mut self, key: &Key) -> bool {
        match self.held.remove(key) {
            Some(b) => {
                self.marking -= usize::from(b.mark_only);
                true
            }
            None => false,
        }
    }

    /// Whether another record may be held for its mark. When the quota is full, records
    /// held longer than [`MARK_STALE`] stop counting.
    fn has_room(&mut self) -> bool {
        let now = Instant::now();
        let due = self
            .checked
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
        if self.marking >= self.limit && due {
            self.checked = Some(now);
            for held in self.held.values_mut() {
                if held.mark_only && now.duration_since(held.since) >= MARK_STALE {
                    held.mark_only = false;
                    self.marking -= 1;
                }
            }
        }
        self.marking < self.limit
    }
}

/// Sends the controllers their wakes; owns the records controller's store.
pub struct Feeder {
    store: Writer<DeadLetter>,
    index: RecordIndex,
    records: UnboundedSender<ObjectRef<DeadLetter>>,
    queues: UnboundedSender<ObjectRef<DeadLetterQueue>>,
    live: Quota,
    /// The quota being rebuilt by a list in progress.
    listing: Option<Quota>,
    /// Queues whose records a list in progress brought, by namespace (woken once it completes).
    listed_queues: HashMap<Arc<str>, HashSet<String>>,
    namespaces: Interner,
}

impl Feeder {
    pub fn new(
        store: Writer<DeadLetter>,
        index: RecordIndex,
        records: UnboundedSender<ObjectRef<DeadLetter>>,
        queues: UnboundedSender<ObjectRef<DeadLetterQueue>>,
    ) -> Self {
        Feeder {
            store,
            index,
            records,
            queues,
            live: Quota::new(MARK_QUOTA),
            listing: None,
            listed_queues: HashMap::new(),
            namespaces: Interner::default(),
        }
    }

    /// Without the quota of first marks: every unmarked record is held at once (the
    /// bench's A/B of what the quota buys).
    pub fn without_mark_quota(mut self) -> Self {
        self.live.limit = usize::MAX;
        self
    }

    fn key(&mut self, dl: &DeadLetter) -> Option<Key> {
        let ns = dl.metadata.namespace.as_deref()?;
        let name = dl.metadata.name.as_deref()?;
        Some((self.namespaces.get(ns), Box::from(name)))
    }

    /// Applies one watch event, after the index has (the index is read to rebuild records
    /// that waited for room).
    pub fn observe(&mut self, event: Event<DeadLetter>) {
        match event {
            Event::Init => {
                tracing::debug!("the record watch re-lists");
                self.listing = Some(Quota::new(self.live.limit));
                self.listed_queues.clear();
                self.store.apply_watcher_event(&Event::Init);
            }
            Event::InitApply(dl) => self.listed(dl),
            Event::InitDone => {
                tracing::debug!("the record watch's list is complete");
                self.store.apply_watcher_event(&Event::InitDone);
                if let Some(quota) = self.listing.take() {
                    self.live = quota;
                }
                for (ns, queues) in std::mem::take(&mut self.listed_queues) {
                    for queue in queues {
                        self.wake_queue(&ns, &queue);
                    }
                }
                self.fill();
            }
            Event::Apply(dl) => self.applied(dl),
            Event::Delete(dl) => self.deleted(dl),
        }
    }

    /// A record of a list in progress.
    fn listed(&mut self, mut dl: DeadLetter) {
        let Some(key) = self.key(&dl) else { return };
        let queues = self.listed_queues.entry(key.0.clone()).or_default();
        if !queues.contains(&dl.spec.queue) {
            queues.insert(dl.spec.queue.clone());
        }
        let Some(quota) = self.listing.as_mut() else {
            return;
        };
        let mark_only = match work_of(&dl) {
            Work::None => return,
            Work::Mark if !quota.has_room() => {
                quota.waiting.push_back(key);
                return;
            }
            Work::Mark => true,
            Work::Decision => {
                tracing::debug!(name = %key.1, "a decided record listed");
                false
            }
        };
        let held = Held {
            generation: dl.metadata.generation,
            mark_only,
            since: Instant::now(),
        };
        quota.hold(key.clone(), held);
        let wakes = self
            .live
            .held
            .get(&key)
            .is_none_or(|b| b.generation != held.generation);
        super::held::strip(&mut dl);
        self.store
            .apply_watcher_event(&Event::InitApply(dl.clone()));
        if wakes {
            // The live store too: a list only reaches the store at its end, and kube's
            // controller drops a wake for an object its store lacks (ObjectNotFound). On a
            // re-list (the apiserver restarted) the store is ready, so the wake ran at once
            // against the old store and was lost: records decided while the watch was down
            // stayed Parked with no attempt (issue 44).
            self.store.apply_watcher_event(&Event::Apply(dl));
            self.wake(&key);
        }
    }

    fn applied(&mut self, dl: DeadLetter) {
        let Some(key) = self.key(&dl) else { return };
        self.wake_queue(&key.0, &dl.spec.queue);
        let work = work_of(&dl);
        let mark_only = match work {
            Work::None => {
                if self.live.release(&key) {
                    self.store.apply_watcher_event(&Event::Delete(dl));
                    self.fill();
                }
                return;
            }
            Work::Mark if !self.live.held.contains_key(&key) && !self.live.has_room() => {
                self.live.waiting.push_back(key);
                return;
            }
            Work::Mark => true,
            Work::Decision => {
                tracing::debug!(name = %key.1, "a decided record watched");
                false
            }
        };
        self.hold(key, dl, mark_only);
        if work == Work::Decision {
            // A record that was held only for its mark may have left room.
            self.fill();
        }
    }

    /// Holds `dl` in the store; wakes the controller when it is new there or its spec changed.
    fn hold(&mut self, key: Key, mut dl: DeadLetter, mark_only: bool) {
        let before = self.live.held.get(&key).copied();
        let held = Held {
            generation: dl.metadata.generation,
            // A record already held keeps its place, stale or not.
            mark_only: before.map_or(mark_only, |b| b.mark_only && mark_only),
            since: before.map_or_else(Instant::now, |b| b.since),
        };
        self.live.hold(key.clone(), held);
        super::held::strip(&mut dl);
        self.store.apply_watcher_event(&Event::Apply(dl));
        if before.is_none_or(|b| b.generation != held.generation) {
            self.wake(&key);
        }
    }

    fn deleted(&mut self, dl: DeadLetter) {
        let Some(key) = self.key(&dl) else { return };
        self.wake_queue(&key.0, &dl.spec.queue);
        if self.live.release(&key) {
            self.store.apply_watcher_event(&Event::Delete(dl));
            self.fill();
        }
    }

    /// Takes the decided records the periodic re-list found ([`super::decided`]). One this
    /// feeder does not hold (its event was lost), or holds at an older generation, is held and
    /// woken; one it holds is woken again when `nudge` says it was not attempted lately. A
    /// record the watch already saw resolved is skipped: the list is older than that event.
    /// The copy held drops the job's bytes, so the reconcile reads the record fresh before
    /// acting (the list may be older than the watch's view of a record it does not hold).
    pub fn resync(&mut self, decided: Vec<super::decided::Listed>) {
        for (mut dl, nudge) in decided {
            let Some(key) = self.key(&dl) else { continue };
            let resolved = self
                .index
                .get(&key.0, &key.1)
                .is_some_and(|s| s.status_phase.is_some_and(|p| p != Phase::Parked));
            if resolved || work_of(&dl) != Work::Decision {
                continue;
            }
            match self.live.held.get(&key) {
                Some(held) if held.generation >= dl.metadata.generation => {
                    if nudge {
                        self.wake(&key);
                    }
                }
                _ => {
                    tracing::info!(namespace = %key.0, name = %key.1, "a decided record the watch did not bring; acting on it from the re-list");
                    dl.spec.job.payload = None;
                    dl.spec.job.payload_base64 = None;
                    dl.spec.job.sealed = None;
                    dl.spec.job.payload_null = false;
                    dl.spec.job.headers = Default::default();
                    self.hold(key, dl, false);
                }
            }
        }
    }

    /// Holds waiting records, oldest first, while there is room. A waiting record marked,
    /// decided or deleted meanwhile is skipped: its own event said so. Also called on a timer,
    /// so records whose marks keep failing free their room without any event.
    pub fn fill(&mut self) {
        while self.live.has_room() {
            let Some(key) = self.live.waiting.pop_front() else {
                return;
            };
            if self.live.held.contains_key(&key) {
                continue;
            }
            let Some(summary) = self.index.get(&key.0, &key.1) else {
                continue;
            };
            if !summary.needs_mark {
                continue;
            }
            self.hold(key, summary.to_record(), true);
        }
    }

    fn wake(&self, key: &Key) {
        let _ = self
            .records
            .unbounded_send(ObjectRef::new(&key.1).within(&key.0));
    }

    fn wake_queue(&self, ns: &str, queue: &str) {
        let _ = self.queues.unbounded_send(ObjectRef::new(queue).within(ns));
    }

    #[cfg(test)]
    fn counts(&self) -> (usize, usize, usize) {
        (
            self.live.held.len(),
            self.live.marking,
            self.live.waiting.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::{Action, DeadLetterStatus, Job, Phase};
    use dlq_core::park::{ParkRequest, new_record};
    use futures::StreamExt;
    use futures::channel::mpsc::{UnboundedReceiver, unbounded};
    use kube::runtime::reflector::{self, Store};

    fn record(i: usize) -> DeadLetter {
        let req = ParkRequest::new(
            "relayer",
            Job {
                id: format!("order-{i}"),
                payload: Some("{}".into()),
                ..Job::default()
            },
        );
        let mut r = new_record(&req, 1);
        r.metadata.namespace = Some("payments".into());
        r.metadata.uid = Some(format!("uid-{i}"));
        r.metadata.generation = Some(1);
        // As the create left it: its creator's entry, which the mark clears.
        r.metadata.managed_fields = Some(vec![crate::state::apiserver::fake::creator()]);
        r
    }

    /// As the apiserver serves it after the mark: no managed fields, Parked by default.
    fn marked(mut r: DeadLetter) -> DeadLetter {
        r.metadata.managed_fields = None;
        r.status = Some(DeadLetterStatus {
            phase: Some(Phase::Parked),
            ..Default::default()
        });
        r
    }

    fn decided(mut r: DeadLetter) -> DeadLetter {
        r.spec.action = Some(Action::Redrive);
        r.spec.by = Some("ops".into());
        r.metadata.generation = Some(2);
        r
    }

    struct Rig {
        feeder: Feeder,
        index: RecordIndex,
        store: Store<DeadLetter>,
        wakes: UnboundedReceiver<ObjectRef<DeadLetter>>,
        _queues: UnboundedReceiver<ObjectRef<DeadLetterQueue>>,
    }

    impl Rig {
        fn new() -> Self {
            Rig::with(std::convert::identity)
        }

        /// A rig whose feeder is `configure`d.
        fn with(configure: impl FnOnce(Feeder) -> Feeder) -> Self {
            let (store, writer) = reflector::store();
            let (tx, wakes) = unbounded();
            let (qtx, queues) = unbounded();
            let index = RecordIndex::default();
            Rig {
                feeder: configure(Feeder::new(writer, index.clone(), tx, qtx)),
                index,
                store,
                wakes,
                _queues: queues,
            }
        }

        fn event(&mut self, event: Event<DeadLetter>) {
            self.index.observe(&event);
            self.feeder.observe(event);
        }

        fn list(&mut self, records: impl IntoIterator<Item = DeadLetter>) {
            self.event(Event::Init);
            for r in records {
                self.event(Event::InitApply(r));
            }
            self.event(Event::InitDone);
        }

        fn woken(&mut self) -> Vec<String> {
            let mut names = Vec::new();
            while let Some(Some(r)) = self.wakes.next().now_or_never() {
                names.push(r.name);
            }
            names
        }
    }

    use futures::FutureExt;

    #[test]
    fn unmarked_records_beyond_the_quota_wait_and_are_held_as_marks_complete() {
        let mut rig = Rig::new();
        let n = MARK_QUOTA + 3;
        rig.list((0..n).map(record));
        assert_eq!(rig.feeder.counts(), (MARK_QUOTA, MARK_QUOTA, 3));
        assert_eq!(rig.store.len(), MARK_QUOTA, "only the quota is held whole");
        assert_eq!(rig.woken().len(), MARK_QUOTA);

        // Two marks come back: two waiting records take their place, rebuilt from the index.
        rig.event(Event::Apply(marked(record(0))));
        rig.event(Event::Apply(marked(record(1))));
        assert_eq!(rig.feeder.counts(), (MARK_QUOTA, MARK_QUOTA, 1));
        let woken = rig.woken();
        assert_eq!(woken.len(), 2);
        let next = rig
            .store
            .get(&ObjectRef::new(&woken[0]).within("payments"))
            .expect("held");
        assert_eq!(
            next.metadata.uid.as_deref(),
            Some(&*format!("uid-{MARK_QUOTA}"))
        );
        assert!(next.status.is_none());
        assert!(dlq_core::decide::needs_mark(&next), "held to be marked");
    }

    #[test]
    fn without_the_quota_every_unmarked_record_is_held() {
        let mut rig = Rig::with(Feeder::without_mark_quota);
        let n = MARK_QUOTA + 3;
        rig.list((0..n).map(record));
        assert_eq!(rig.feeder.counts(), (n, n, 0));
        assert_eq!(rig.store.len(), n);
        assert_eq!(rig.woken().len(), n);
    }

    #[test]
    fn a_decision_is_held_at_once_even_when_the_quota_is_full() {
        let mut rig = Rig::new();
        rig.list((0..MARK_QUOTA).map(record));
        rig.woken();
        let d = decided(marked(record(MARK_QUOTA + 7)));
        rig.event(Event::Apply(d.clone()));
        assert_eq!(rig.woken(), [d.metadata.name.clone().unwrap_or_default()]);
        assert_eq!(rig.store.len(), MARK_QUOTA + 1);
        // Resolved: released, nothing left waiting to fill with.
        let mut done = d;
        done.status = Some(DeadLetterStatus {
            phase: Some(Phase::Redriven),
            ..Default::default()
        });
        rig.event(Event::Apply(done));
        assert_eq!(rig.store.len(), MARK_QUOTA);
        assert!(rig.woken().is_empty());
    }

    #[test]
    fn status_writes_wake_nothing_and_a_new_generation_wakes_once() {
        let mut rig = Rig::new();
        rig.list([decided(marked(record(1)))]);
        assert_eq!(rig.woken().len(), 1);
        let mut failing = decided(marked(record(1)));
        failing.metadata.resource_version = Some("9".into());
        rig.event(Event::Apply(failing));
        assert!(rig.woken().is_empty(), "a status write (same generation)");
        let mut again = decided(marked(record(1)));
        again.metadata.generation = Some(3);
        rig.event(Event::Apply(again));
        assert_eq!(rig.woken().len(), 1);
    }

    #[test]
    fn a_relist_wakes_only_what_changed_and_drops_what_is_done() {
        let mut rig = Rig::new();
        rig.list([decided(marked(record(1))), record(2)]);
        assert_eq!(rig.woken().len(), 2);
        rig.list([decided(marked(record(1))), marked(record(2)), record(3)]);
        assert_eq!(
            rig.woken(),
            [record(3).metadata.name.clone().unwrap_or_default()]
        );
        assert_eq!(rig.store.len(), 2);
        assert_eq!(rig.feeder.counts(), (2, 1, 0));
    }

    #[test]
    fn records_waiting_and_then_deleted_or_decided_are_not_held_twice() {
        let mut rig = Rig::new();
        rig.list((0..MARK_QUOTA + 2).map(record));
        rig.woken();
        // The first waiting one is deleted, the second decided (held at once).
        rig.event(Event::Delete(record(MARK_QUOTA)));
        let d = decided(record(MARK_QUOTA + 1));
        rig.event(Event::Apply(d));
        assert_eq!(rig.woken().len(), 1);
        rig.event(Event::Apply(marked(record(0))));
        assert!(rig.woken().is_empty(), "nothing left waiting");
        assert_eq!(rig.feeder.counts(), (MARK_QUOTA, MARK_QUOTA - 1, 0));
    }

    /// The records controller as `run_scope` builds it (woken by bare references, reading the
    /// feeder's store), over the rig's store; returns the names it reconciled, as they come.
    fn records_controller(rig: &mut Rig) -> futures::channel::mpsc::UnboundedReceiver<String> {
        use kube::runtime::controller::{Action as Then, Controller};
        // The feeder's wakes go to the controller from now on.
        let wakes = std::mem::replace(&mut rig.wakes, unbounded().1);
        let (seen_tx, seen) = unbounded();
        let controller =
            Controller::for_shared_stream(futures::stream::pending(), rig.store.clone())
                .reconcile_on(wakes)
                .run(
                    move |dl: Arc<DeadLetter>, seen: Arc<UnboundedSender<String>>| {
                        let _ = seen.unbounded_send(dl.metadata.name.clone().unwrap_or_default());
                        futures::future::ready(Ok::<_, std::convert::Infallible>(
                            Then::await_change(),
                        ))
                    },
                    |_, _, _| Then::await_change(),
                    Arc::new(seen_tx),
                )
                .for_each(|_| futures::future::ready(()));
        tokio::spawn(controller);
        seen
    }

    /// The next name `seen` reconciles, waiting at most 5 s.
    async fn next_reconciled(
        seen: &mut futures::channel::mpsc::UnboundedReceiver<String>,
    ) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(5), seen.next())
            .await
            .ok()
            .flatten()
    }

    #[tokio::test]
    async fn a_decision_a_relist_brings_is_reconciled() {
        let mut rig = Rig::new();
        let mut seen = records_controller(&mut rig);
        rig.list([marked(record(1))]);
        // The watch was down while record 1 was decided (an apiserver restart): the re-list
        // brings the decision. The store is ready, so the wake runs at once.
        let d = decided(marked(record(1)));
        let name = d.metadata.name.clone().unwrap_or_default();
        rig.event(Event::Init);
        rig.event(Event::InitApply(d));
        // The rest of the list is still on its way: the controller runs the wake meanwhile.
        tokio::time::sleep(Duration::from_millis(300)).await;
        rig.event(Event::InitDone);
        assert_eq!(next_reconciled(&mut seen).await, Some(name));
    }

    #[test]
    fn a_relisted_decision_the_watch_missed_is_held_read_fresh_and_woken() {
        let mut rig = Rig::new();
        rig.list([marked(record(1)), marked(record(2))]);
        assert!(rig.woken().is_empty());
        // The watch never brought record 1's decision; the re-list does.
        let d = decided(marked(record(1)));
        let name = d.metadata.name.clone().unwrap_or_default();
        rig.feeder.resync(vec![(d.clone(), false)]);
        assert_eq!(rig.woken(), std::slice::from_ref(&name));
        let held = rig
            .store
            .get(&ObjectRef::new(&name).within("payments"))
            .expect("held");
        assert!(
            !held.spec.job.has_payload(),
            "the reconcile reads it fresh before acting"
        );
        // Listed again: held already, woken only when not attempted lately.
        rig.feeder.resync(vec![(d.clone(), false)]);
        assert!(rig.woken().is_empty());
        rig.feeder.resync(vec![(d, true)]);
        assert_eq!(rig.woken(), [name]);
    }

    #[test]
    fn a_relisted_decision_the_watch_saw_resolved_is_left_alone() {
        let mut rig = Rig::new();
        let d = decided(marked(record(1)));
        let mut done = d.clone();
        done.status = Some(DeadLetterStatus {
            phase: Some(Phase::Redriven),
            ..Default::default()
        });
        rig.list([done]);
        rig.woken();
        rig.feeder.resync(vec![(d, true)]);
        assert!(rig.woken().is_empty(), "the list is older than the watch");
        assert_eq!(rig.store.len(), 0);
    }

    #[test]
    fn records_whose_marks_keep_failing_stop_holding_the_quota() {
        let mut rig = Rig::new();
        rig.list((0..MARK_QUOTA + 2).map(record));
        rig.woken();
        rig.feeder.fill();
        assert!(rig.woken().is_empty(), "the quota is full of fresh marks");
        let long_ago = Instant::now() - MARK_STALE;
        for held in rig.feeder.live.held.values_mut() {
            held.since = long_ago;
        }
        rig.feeder.live.checked = None;
        rig.feeder.fill();
        assert_eq!(rig.woken().len(), 2, "the waiting records are held");
        assert_eq!(
            rig.store.len(),
            MARK_QUOTA + 2,
            "the stale ones are still held, and retried"
        );
        assert_eq!(rig.feeder.counts(), (MARK_QUOTA + 2, 2, 0));
    }
}
