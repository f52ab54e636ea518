//! The one fake [`Apiserver`] of the in-process tests (tests only): it holds records with
//! resourceVersions and answers like the real one (compare-and-swap status writes, signatures
//! and withdrawals, deletes guarded by uid + resourceVersion), remembers every write and Event,
//! (an Event series with its count as its patches leave it), and can be told to interfere: a
//! rival resolution before the next write, unrelated writes that bump the version, a failing
//! write.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, DeadLetterStatus, LABEL_QUEUE, Phase};
use dlq_core::event_series::Occurrences;
use dlq_core::events::EventPlan;
use dlq_core::group::LABEL_GROUP;
use dlq_core::groups::DeadLetterGroup;
use dlq_core::plan::QueueStatusWrite;
use dlq_core::replay::{
    ANNOTATION_REPLAY_UID, DeadLetterReplay, DeadLetterReplayStatus, LABEL_REPLAY,
};

use super::{Apiserver, GroupPage, PassedThrough, Signature};

/// (namespace, name) of a record.
type Key = (String, String);

/// The managed fields entry a create leaves (the parker's server-side apply).
pub fn creator() -> ManagedFieldsEntry {
    ManagedFieldsEntry {
        manager: Some("dlq-parker".into()),
        operation: Some("Apply".into()),
        ..ManagedFieldsEntry::default()
    }
}

fn key_of(record: &DeadLetter) -> Key {
    (
        record.metadata.namespace.clone().unwrap_or_default(),
        record.metadata.name.clone().unwrap_or_default(),
    )
}

/// A lock that a failed assertion in another test cannot poison.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An apiserver error with `code` (409 is a Conflict, as the real one says).
pub fn api_error(code: u16) -> kube::Error {
    let reason = match code {
        404 => "NotFound",
        409 => "Conflict",
        _ => "InternalError",
    };
    kube::Error::Api(
        kube::core::Status::failure("fake", reason)
            .with_code(code)
            .boxed(),
    )
}

/// Applies a merge patch of `status` onto `into`, as the apiserver does.
fn merge(into: &mut DeadLetterStatus, status: &DeadLetterStatus) {
    if status.phase.is_some() {
        into.phase = status.phase;
    }
    if status.resolved_by.is_some() {
        into.resolved_by = status.resolved_by.clone();
    }
    if status.resolved_at.is_some() {
        into.resolved_at = status.resolved_at.clone();
    }
    if status.observed_generation.is_some() {
        into.observed_generation = status.observed_generation;
    }
    if !status.conditions.is_empty() {
        into.conditions = status.conditions.clone();
    }
}

/// An Event created with [`Apiserver::create_event`] as the fake holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeriesEvent {
    /// The name of what it is about.
    pub regarding: Option<String>,
    pub plan: EventPlan,
    /// What its series says (1 without one).
    pub count: u32,
}

/// One Event write, as the apiserver would count it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventWrite {
    /// [`Apiserver::publish`]: one Event, about the named object.
    Published(Option<String>),
    /// [`Apiserver::create_event`]: the Event's name and its count.
    Created(String, u32),
    /// [`Apiserver::patch_series`]: the Event's name and its new count.
    Patched(String, u32),
}

/// Records by namespace and name, each with a resourceVersion from one counter, and what was
/// asked of it.
#[derive(Default)]
pub struct FakeApiserver {
    records: Mutex<BTreeMap<Key, DeadLetter>>,
    version: AtomicU64,
    /// Record status writes that landed, in order.
    writes: Mutex<Vec<DeadLetterStatus>>,
    /// Queue status writes, in order: (queue name, status).
    queue_writes: Mutex<Vec<(String, QueueStatusWrite)>>,
    /// Names of the records deleted.
    deleted: Mutex<Vec<String>>,
    /// Events published: (the name of what they are about, the Event).
    events: Mutex<Vec<(Option<String>, EventPlan)>>,
    /// Events created with [`Apiserver::create_event`], by name, as their patches left them.
    series: Mutex<BTreeMap<String, SeriesEvent>>,
    /// Every Event write (publish, create, patch of a series), in order.
    event_writes: Mutex<Vec<EventWrite>>,
    /// Names of the records a replay signed successfully, in order.
    signed: Mutex<Vec<String>>,
    /// The pages of undecided records listed, in order.
    listed: Mutex<Vec<GroupPage>>,
    /// Replay status writes, in order.
    replay_statuses: Mutex<Vec<DeadLetterReplayStatus>>,
    /// Names of the records labelled with their group, in order.
    group_labelled: Mutex<Vec<String>>,
    /// Names of the records whose managed fields were cleared, in order.
    cleared: Mutex<Vec<String>>,
    /// DeadLetterGroups by namespace and name.
    groups: Mutex<BTreeMap<Key, DeadLetterGroup>>,
    /// Group writes, in order: (name, whether it was a create).
    group_writes: Mutex<Vec<(String, bool)>>,
    /// Before the next record status write, "alice" resolves that record as this phase.
    pub race: Mutex<Option<Phase>>,
    /// The next N record status writes find the version bumped by an unrelated write.
    pub bumps: AtomicU32,
    /// The next record status write fails with a 500 (as if the apiserver went away).
    pub fail_next_write: AtomicBool,
    /// The next N record status writes fail with a 500 (etcd restarting for a while).
    pub failing_writes: AtomicU32,
}

impl FakeApiserver {
    /// An apiserver holding `records`, versioned "1", "2", … in the order given. A record
    /// given without status or managed fields is as a create left it (see [`Self::park`]);
    /// one given with a status stands for a record marked already, as it is.
    pub fn holding(records: impl IntoIterator<Item = DeadLetter>) -> Arc<Self> {
        let fake = FakeApiserver::default();
        for r in records {
            fake.park(r);
        }
        Arc::new(fake)
    }

    /// A record parked now (as a source would create it), versioned next. Without status or
    /// managed fields it gets its creator's entry, as every create does (the mark clears it).
    pub fn park(&self, mut record: DeadLetter) {
        if record.status.is_none() && record.metadata.managed_fields.is_none() {
            record.metadata.managed_fields = Some(vec![creator()]);
        }
        self.bump(&mut record);
        lock(&self.records).insert(key_of(&record), record);
    }

    fn bump(&self, record: &mut DeadLetter) {
        let v = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        record.metadata.resource_version = Some(v.to_string());
    }

    /// A user's edit of record `name` (a changed decision): a new resourceVersion.
    pub fn edit(&self, name: &str, change: impl FnOnce(&mut DeadLetter)) {
        let mut records = lock(&self.records);
        let Some(r) = records
            .values_mut()
            .find(|r| r.metadata.name.as_deref() == Some(name))
        else {
            panic!("the fake apiserver holds no record {name}");
        };
        change(r);
        self.bump(r);
    }

    /// Every record it holds, by namespace and name.
    pub fn all(&self) -> Vec<DeadLetter> {
        lock(&self.records).values().cloned().collect()
    }

    /// Record `name` (of any namespace) as it is stored now.
    pub fn get(&self, name: &str) -> Option<DeadLetter> {
        lock(&self.records)
            .values()
            .find(|r| r.metadata.name.as_deref() == Some(name))
            .cloned()
    }

    /// The first record it holds (the tests of one record hold one).
    pub fn current(&self) -> DeadLetter {
        lock(&self.records)
            .values()
            .next()
            .cloned()
            .unwrap_or_else(|| panic!("the fake apiserver holds no record"))
    }

    /// The record status writes that landed.
    pub fn writes(&self) -> Vec<DeadLetterStatus> {
        lock(&self.writes).clone()
    }

    /// The queue status writes: (queue name, status).
    pub fn queue_writes(&self) -> Vec<(String, QueueStatusWrite)> {
        lock(&self.queue_writes).clone()
    }

    /// Names of the records deleted, in order.
    pub fn deleted(&self) -> Vec<String> {
        lock(&self.deleted).clone()
    }

    /// The Events published, with the name of what each is about.
    pub fn published(&self) -> Vec<(Option<String>, EventPlan)> {
        lock(&self.events).clone()
    }

    /// The Events published.
    pub fn events(&self) -> Vec<EventPlan> {
        lock(&self.events).iter().map(|(_, e)| e.clone()).collect()
    }

    /// The Events created as series, by name, with the count their last patch left.
    pub fn series(&self) -> BTreeMap<String, SeriesEvent> {
        lock(&self.series).clone()
    }

    /// Every Event write, in order.
    pub fn event_writes(&self) -> Vec<EventWrite> {
        lock(&self.event_writes).clone()
    }

    /// The reasons of the Events published, in order.
    pub fn reasons(&self) -> Vec<&'static str> {
        lock(&self.events).iter().map(|(_, e)| e.reason).collect()
    }

    /// Names of the records signed by a replay, in order.
    pub fn signed(&self) -> Vec<String> {
        lock(&self.signed).clone()
    }

    /// The pages of undecided records listed, in order.
    pub fn listed(&self) -> Vec<GroupPage> {
        lock(&self.listed).clone()
    }

    /// Names of the records whose managed fields were cleared, in order.
    pub fn cleared(&self) -> Vec<String> {
        lock(&self.cleared).clone()
    }

    /// Names of the records labelled with their group, in order.
    pub fn group_labelled(&self) -> Vec<String> {
        lock(&self.group_labelled).clone()
    }

    /// The DeadLetterGroups it holds, by name.
    pub fn groups(&self) -> BTreeMap<String, DeadLetterGroup> {
        lock(&self.groups)
            .iter()
            .map(|((_, name), g)| (name.clone(), g.clone()))
            .collect()
    }

    /// Group writes, in order: (name, whether it created the group).
    pub fn group_writes(&self) -> Vec<(String, bool)> {
        lock(&self.group_writes).clone()
    }

    /// Every replay status written, oldest first.
    pub fn all_replay_statuses(&self) -> Vec<DeadLetterReplayStatus> {
        lock(&self.replay_statuses).clone()
    }

    /// The last replay status written.
    pub fn last_replay_status(&self) -> DeadLetterReplayStatus {
        lock(&self.replay_statuses)
            .last()
            .cloned()
            .unwrap_or_else(|| panic!("no replay status was written"))
    }

    /// Resolves every decided record as its decision says, as the record reconciler would.
    pub fn carry_out_decisions(&self) {
        let mut records = lock(&self.records);
        for r in records.values_mut() {
            let phase = match r.spec.action {
                Some(Action::Redrive) => Phase::Redriven,
                Some(Action::Drop) => Phase::Dropped,
                None => continue,
            };
            r.status.get_or_insert_default().phase = Some(phase);
            self.bump(r);
        }
    }

    /// What a rival resolver or an unrelated writer did just before a write to `stored`.
    fn interfere(&self, stored: &mut DeadLetter) {
        if let Some(phase) = lock(&self.race).take() {
            let status = stored.status.get_or_insert_default();
            status.phase = Some(phase);
            status.resolved_by = Some("alice".into());
            self.bump(stored);
        } else if self
            .bumps
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.bump(stored);
        }
    }

    /// Applies `change` to the stored `record` when the caller's resourceVersion is current.
    fn cas(
        &self,
        record: &DeadLetter,
        change: impl FnOnce(&mut DeadLetter),
    ) -> Result<(), kube::Error> {
        let mut records = lock(&self.records);
        let stored = records
            .get_mut(&key_of(record))
            .ok_or_else(|| api_error(404))?;
        if stored.metadata.resource_version != record.metadata.resource_version {
            return Err(api_error(409));
        }
        change(stored);
        self.bump(stored);
        Ok(())
    }
}

impl Apiserver for FakeApiserver {
    fn get_record<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DeadLetter>, kube::Error>> {
        let found = lock(&self.records)
            .get(&(namespace.to_string(), name.to_string()))
            .cloned();
        async move { Ok(found) }.boxed()
    }

    fn record_names<'a>(
        &'a self,
        namespace: &'a str,
        labels: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, kube::Error>> {
        let wanted: Vec<(&str, &str)> = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let names = lock(&self.records)
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .filter(|(_, r)| {
                let have = r.metadata.labels.as_ref();
                wanted
                    .iter()
                    .all(|(k, v)| have.and_then(|l| l.get(*k)).is_some_and(|x| x == v))
            })
            .map(|((_, name), _)| name.clone())
            .collect();
        async move { Ok(names) }.boxed()
    }

    fn list_undecided<'a>(
        &'a self,
        page: &'a GroupPage,
    ) -> BoxFuture<'a, Result<super::RecordPage, kube::Error>> {
        let labelled = |r: &DeadLetter, label: &str, value: &str| {
            r.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label))
                .is_some_and(|v| v == value)
        };
        let after = page.continue_token.clone().unwrap_or_default();
        let limit = usize::try_from(page.limit).unwrap_or(usize::MAX).max(1);
        let mut items: Vec<DeadLetter> = lock(&self.records)
            .iter()
            .filter(|((ns, name), _)| *ns == page.namespace && *name > after)
            .map(|(_, r)| r)
            .filter(|r| labelled(r, LABEL_QUEUE, &page.queue))
            .filter(|r| labelled(r, LABEL_GROUP, &page.group))
            .filter(|r| r.phase() == Phase::Parked && r.spec.action.is_none())
            .take(limit + 1)
            .cloned()
            .collect();
        let next = (items.len() > limit).then(|| {
            items.truncate(limit);
            items
                .last()
                .and_then(|r| r.metadata.name.clone())
                .unwrap_or_default()
        });
        lock(&self.listed).push(page.clone());
        async move { Ok((items, next)) }.boxed()
    }

    fn write_record_status<'a>(
        &'a self,
        record: &'a DeadLetter,
        status: &'a DeadLetterStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let failing = self
            .failing_writes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let result = if self.fail_next_write.swap(false, Ordering::SeqCst) || failing {
            Err(api_error(500))
        } else {
            if let Some(stored) = lock(&self.records).get_mut(&key_of(record)) {
                self.interfere(stored);
            }
            self.cas(record, |stored| {
                merge(stored.status.get_or_insert_default(), status)
            })
        };
        if result.is_ok() {
            lock(&self.writes).push(status.clone());
        }
        async move { result }.boxed()
    }

    fn clear_managed_fields<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<Option<String>, kube::Error>> {
        let result = self
            .cas(record, |stored| stored.metadata.managed_fields = None)
            .map(|()| {
                let name = record.metadata.name.clone().unwrap_or_default();
                let version = self.get(&name).and_then(|r| r.metadata.resource_version);
                lock(&self.cleared).push(name);
                version
            });
        async move { result }.boxed()
    }

    fn write_queue_status<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        status: &'a QueueStatusWrite,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let name = queue.metadata.name.clone().unwrap_or_default();
        lock(&self.queue_writes).push((name, status.clone()));
        async { Ok(()) }.boxed()
    }

    fn delete_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let mut records = lock(&self.records);
        let key = key_of(record);
        let result = match records.get(&key) {
            None => Err(api_error(404)),
            Some(stored)
                if record.metadata.uid.is_some() && stored.metadata.uid != record.metadata.uid =>
            {
                Err(api_error(409))
            }
            Some(stored)
                if record.metadata.resource_version.is_some()
                    && stored.metadata.resource_version != record.metadata.resource_version =>
            {
                Err(api_error(409))
            }
            Some(_) => {
                records.remove(&key);
                lock(&self.deleted).push(key.1);
                Ok(())
            }
        };
        async move { result }.boxed()
    }

    fn publish<'a>(
        &'a self,
        regarding: ObjectReference,
        event: &'a EventPlan,
    ) -> BoxFuture<'a, ()> {
        lock(&self.event_writes).push(EventWrite::Published(regarding.name.clone()));
        lock(&self.events).push((regarding.name, event.clone()));
        async {}.boxed()
    }

    fn create_event<'a>(
        &'a self,
        regarding: ObjectReference,
        event: &'a EventPlan,
        series: Option<Occurrences>,
    ) -> BoxFuture<'a, Result<String, kube::Error>> {
        let mut held = lock(&self.series);
        let name = format!(
            "{}.{}",
            regarding.name.clone().unwrap_or_default(),
            held.len()
        );
        let count = series.map_or(1, |s| s.count);
        held.insert(
            name.clone(),
            SeriesEvent {
                regarding: regarding.name,
                plan: event.clone(),
                count,
            },
        );
        lock(&self.event_writes).push(EventWrite::Created(name.clone(), count));
        async move { Ok(name) }.boxed()
    }

    fn patch_series<'a>(
        &'a self,
        _namespace: &'a str,
        name: &'a str,
        series: Occurrences,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let result = match lock(&self.series).get_mut(name) {
            Some(held) => {
                held.count = series.count;
                lock(&self.event_writes).push(EventWrite::Patched(name.into(), series.count));
                Ok(())
            }
            None => Err(api_error(404)),
        };
        async move { result }.boxed()
    }

    fn sign_record<'a>(
        &'a self,
        record: &'a DeadLetter,
        signature: &'a Signature<'a>,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let result = self.cas(record, |r| {
            r.spec.action = Some(signature.action);
            r.spec.by = Some(signature.by.to_string());
            r.spec.note = Some(signature.note.to_string());
            r.metadata
                .labels
                .get_or_insert_default()
                .insert(LABEL_REPLAY.into(), signature.replay.into());
            r.metadata
                .annotations
                .get_or_insert_default()
                .insert(ANNOTATION_REPLAY_UID.into(), signature.replay_uid.into());
        });
        if result.is_ok() {
            lock(&self.signed).push(key_of(record).1);
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

    fn write_replay_passed<'a>(
        &'a self,
        _replay: &'a DeadLetterReplay,
        passed: &'a PassedThrough,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        // As a merge patch of those fields lands on the last status.
        let mut statuses = lock(&self.replay_statuses);
        let mut status = statuses.last().cloned().unwrap_or_default();
        status.passed_through = passed.passed_through;
        if !passed.sample.is_empty() {
            status.sample = passed.sample.clone();
        }
        if passed.passed_at.is_some() {
            status.passed_at = passed.passed_at.clone();
        }
        statuses.push(status);
        async { Ok(()) }.boxed()
    }

    fn list_groups<'a>(
        &'a self,
        namespace: &'a str,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DeadLetterGroup>, kube::Error>> {
        let found = lock(&self.groups)
            .iter()
            .filter(|((ns, _), g)| {
                ns == namespace
                    && g.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(LABEL_QUEUE))
                        .is_some_and(|q| q == queue)
            })
            .map(|(_, g)| g.clone())
            .collect();
        async move { Ok(found) }.boxed()
    }

    fn apply_group<'a>(
        &'a self,
        group: &'a DeadLetterGroup,
        create: bool,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let key = (
            group.metadata.namespace.clone().unwrap_or_default(),
            group.metadata.name.clone().unwrap_or_default(),
        );
        let mut groups = lock(&self.groups);
        let result = match groups.get_mut(&key) {
            Some(stored) => {
                stored.status = group.status.clone();
                Ok(())
            }
            None if create => {
                groups.insert(key.clone(), group.clone());
                Ok(())
            }
            None => Err(api_error(404)),
        };
        if result.is_ok() {
            lock(&self.group_writes).push((key.1, create));
        }
        async move { result }.boxed()
    }

    fn delete_group<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        lock(&self.groups).remove(&(namespace.to_string(), name.to_string()));
        async { Ok(()) }.boxed()
    }

    fn label_group<'a>(
        &'a self,
        record: &'a DeadLetter,
        group: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let mut records = lock(&self.records);
        let result = match records.get_mut(&key_of(record)) {
            Some(stored) => {
                stored
                    .metadata
                    .labels
                    .get_or_insert_default()
                    .insert(LABEL_GROUP.into(), group.into());
                self.bump(stored);
                lock(&self.group_labelled).push(key_of(record).1);
                Ok(())
            }
            None => Err(api_error(404)),
        };
        async move { result }.boxed()
    }

    fn write_replay_status<'a>(
        &'a self,
        _replay: &'a DeadLetterReplay,
        status: &'a DeadLetterReplayStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        lock(&self.replay_statuses).push(status.clone());
        async { Ok(()) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::events::{action, reason};

    /// A series as the reconciler tests count it: created with its count, patched, every
    /// write remembered; a patch of an Event it does not hold is a 404 (gone).
    #[tokio::test]
    async fn an_event_series_is_created_patched_and_counted() {
        let api = FakeApiserver::default();
        let about = ObjectReference {
            name: Some("relayer".into()),
            ..ObjectReference::default()
        };
        let plan = EventPlan::warning(reason::PARKED, action::PARK, "a storm").once();
        let at = jiff::Timestamp::UNIX_EPOCH;
        let series = |count| Occurrences {
            count,
            last_observed: at,
        };
        let name = api
            .create_event(about, &plan, Some(series(12)))
            .await
            .expect("created");
        api.patch_series("payments", &name, series(40))
            .await
            .expect("patched");
        assert!(
            api.patch_series("payments", "gone", series(1))
                .await
                .is_err()
        );
        let held = api.series();
        assert_eq!(held[&name].count, 40);
        assert_eq!(held[&name].regarding.as_deref(), Some("relayer"));
        assert_eq!(held[&name].plan, plan);
        assert_eq!(
            api.event_writes(),
            [
                EventWrite::Created(name.clone(), 12),
                EventWrite::Patched(name, 40)
            ]
        );
    }
}
