//! The operator's records indexed by job (`dlq.dev/job-key` label), so its sources choose a
//! job's next cycle from what the watch already delivered instead of listing the job's
//! records on the apiserver before every create (`dlq_core::park::first_try`).
//!
//! Fed from the same watch events as the record store, before they reach it. Its view is a
//! prefix of the apiserver's history, like the store's; it is only trusted after the first
//! complete list (before that, sources take the listing path).
//!
//! A replay that sends a record's job ahead of its decision (`crate::reconcile::ahead`) says so
//! here first ([`JobIndex::redriving`]): until the watch shows the record decided or resolved,
//! the view shows it with a redrive decided, so a new death of its job parks as the next cycle
//! instead of being taken for the parked one (`dlq_core::park::answers_for_its_job`) and lost
//! once the record turns Redriven.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use kube::ResourceExt;
use kube::runtime::watcher::Event;

use dlq_core::api::{self, Action, DeadLetter, Phase};
use dlq_core::park::KnownCycle;

/// (namespace, job key) → the job's records. A Vec, not a map by name: almost every job has
/// one record, and a one-entry BTreeMap allocates a whole node (1.4 KiB a record, a quarter of
/// the operator's heap with 10,000 records parked).
type Jobs = HashMap<(String, String), Vec<KnownCycle>>;

#[derive(Default)]
struct State {
    /// The live view; None until the first initial list completed.
    live: Option<Jobs>,
    /// A re-list in progress (the live view stays in use until it completes).
    pending: Option<Jobs>,
    /// Records (namespace, name) whose job was sent ahead of their decision, until the watch
    /// shows them decided, resolved or deleted.
    redriving: HashSet<(String, String)>,
}

/// A cheap-to-clone handle on the index.
#[derive(Clone, Default)]
pub struct JobIndex {
    state: Arc<RwLock<State>>,
}

fn key_of(dl: &DeadLetter) -> Option<(String, String)> {
    let key = dl.labels().get(api::LABEL_JOB_KEY)?.clone();
    Some((dl.namespace().unwrap_or_default(), key))
}

fn insert(jobs: &mut Jobs, dl: &DeadLetter) {
    let Some(key) = key_of(dl) else {
        return;
    };
    let known = KnownCycle::of(dl);
    let records = jobs.entry(key).or_default();
    match records.iter_mut().find(|k| k.name == known.name) {
        Some(slot) => *slot = known,
        None => {
            // Room for exactly one more: the first push would otherwise reserve four.
            records.reserve_exact(1);
            records.push(known);
        }
    }
}

fn remove(jobs: &mut Jobs, dl: &DeadLetter) {
    if let Some(key) = key_of(dl)
        && let Some(records) = jobs.get_mut(&key)
    {
        let name = dl.name_any();
        records.retain(|k| k.name != name);
        if records.is_empty() {
            jobs.remove(&key);
        }
    }
}

impl JobIndex {
    /// Applies one watch event (call it for every event, in order, before the store sees it).
    pub fn observe(&self, event: &Event<DeadLetter>) {
        let Ok(mut state) = self.state.write() else {
            return;
        };
        match event {
            Event::Init => state.pending = Some(Jobs::new()),
            Event::InitApply(dl) => {
                if let Some(pending) = state.pending.as_mut() {
                    insert(pending, dl);
                }
            }
            Event::InitDone => {
                if let Some(done) = state.pending.take() {
                    state.live = Some(done);
                }
            }
            Event::Apply(dl) => {
                if let Some(live) = state.live.as_mut() {
                    insert(live, dl);
                }
                if dl.spec.action.is_some() || dl.phase() != Phase::Parked {
                    forget_redriving(&mut state, dl);
                }
            }
            Event::Delete(dl) => {
                if let Some(live) = state.live.as_mut() {
                    remove(live, dl);
                }
                forget_redriving(&mut state, dl);
            }
        }
    }

    /// Record `name` in `namespace` is having its job sent ahead of its decision: shown as
    /// decided (a redrive) until the watch shows it decided, resolved or deleted.
    pub fn redriving(&self, namespace: &str, name: &str) {
        if let Ok(mut state) = self.state.write() {
            state
                .redriving
                .insert((namespace.to_string(), name.to_string()));
        }
    }

    /// The records of job `key` in `namespace`, or None while the index is not yet synced
    /// (then the caller must list).
    pub fn cycles(&self, namespace: &str, key: &str) -> Option<Vec<KnownCycle>> {
        let state = self.state.read().ok()?;
        let live = state.live.as_ref()?;
        let mut cycles = live
            .get(&(namespace.to_string(), key.to_string()))
            .cloned()
            .unwrap_or_default();
        for known in cycles.iter_mut().filter(|k| k.action.is_none()) {
            // Its job may be on its queue again: a new death is the next cycle.
            if state
                .redriving
                .contains(&(namespace.to_string(), known.name.clone()))
            {
                known.action = Some(Action::Redrive);
            }
        }
        Some(cycles)
    }
}

/// The watch shows `dl` decided, resolved or gone: its own state says the rest.
fn forget_redriving(state: &mut State, dl: &DeadLetter) {
    if state.redriving.is_empty() {
        return;
    }
    let key = (dl.namespace().unwrap_or_default(), dl.name_any());
    state.redriving.remove(&key);
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Phase;
    use dlq_core::park::job_key;
    use dlq_core::testing::RecordBuilder;

    fn record(id: &str, cycle: i32) -> DeadLetter {
        RecordBuilder::job(id).cycle(cycle).build()
    }

    #[test]
    fn unsynced_until_the_first_list_completes() {
        let index = JobIndex::default();
        let key = job_key("relayer", "a");
        assert_eq!(index.cycles("payments", &key), None);
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(record("a", 1)));
        assert_eq!(index.cycles("payments", &key), None);
        index.observe(&Event::InitDone);
        let cycles = index.cycles("payments", &key).unwrap_or_default();
        assert_eq!(cycles.len(), 1);
        assert_eq!(cycles[0].phase, Phase::Parked);
    }

    #[test]
    fn follows_applies_and_deletes() {
        let index = JobIndex::default();
        index.observe(&Event::Init);
        index.observe(&Event::InitDone);
        let key = job_key("relayer", "a");
        index.observe(&Event::Apply(record("a", 1)));
        index.observe(&Event::Apply(record("a", 2)));
        assert_eq!(index.cycles("payments", &key).map(|c| c.len()), Some(2));
        index.observe(&Event::Delete(record("a", 1)));
        let cycles = index.cycles("payments", &key).unwrap_or_default();
        assert_eq!(cycles.iter().map(|c| c.cycle).collect::<Vec<_>>(), vec![2]);
        assert_eq!(index.cycles("other", &key).map(|c| c.len()), Some(0));
    }

    /// Issue 58 item 4: a record whose job was sent ahead of its decision is shown decided, so
    /// a new death of the job is its next cycle; once the watch shows it decided, its own
    /// state speaks again.
    #[test]
    fn a_record_sent_ahead_shows_a_redrive_until_the_watch_shows_its_decision() {
        let index = JobIndex::default();
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(record("a", 1)));
        index.observe(&Event::InitDone);
        let key = job_key("relayer", "a");
        let name = record("a", 1).name_any();
        let action = || index.cycles("payments", &key).unwrap_or_default()[0].action;
        assert_eq!(action(), None);
        index.redriving("payments", &name);
        assert_eq!(action(), Some(Action::Redrive), "its job may be back");
        let unrelated = RecordBuilder::job("a").cycle(1).build();
        index.observe(&Event::Apply(unrelated));
        assert_eq!(
            action(),
            Some(Action::Redrive),
            "an undecided write keeps it"
        );
        let dropped = RecordBuilder::job("a")
            .cycle(1)
            .decided(Action::Drop, "ops")
            .build();
        index.observe(&Event::Apply(dropped));
        assert_eq!(action(), Some(Action::Drop), "its own decision once seen");
        let state = index.state.read().expect("lock");
        assert!(state.redriving.is_empty(), "forgotten");
    }

    #[test]
    fn a_relist_keeps_the_old_view_until_done() {
        let index = JobIndex::default();
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(record("a", 1)));
        index.observe(&Event::InitDone);
        let key = job_key("relayer", "a");
        index.observe(&Event::Init);
        assert_eq!(index.cycles("payments", &key).map(|c| c.len()), Some(1));
        index.observe(&Event::InitDone);
        assert_eq!(index.cycles("payments", &key).map(|c| c.len()), Some(0));
    }
}
