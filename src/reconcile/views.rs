//! The watch caches the reconcilers read beside the record index: queues, failure groups and
//! replays. One part of the [`Context`](super::Context), so that what reads only them (an Event
//! to fold, a group's acknowledgement, what standing replays passed through) takes only them.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use dlq_core::api::{DeadLetter, DeadLetterQueue};
use dlq_core::events::EventPlan;
use dlq_core::groups::DeadLetterGroup;
use dlq_core::replay::DeadLetterReplay;
use k8s_openapi::api::core::v1::ObjectReference;

use super::aggregate;
use crate::state::apiserver;

/// DeadLetterQueues, DeadLetterGroups and DeadLetterReplays as the operator's watches see them.
pub struct Views {
    /// DeadLetterQueues: the only way the operator reads them.
    pub queues: Store<DeadLetterQueue>,
    /// DeadLetterGroups (their acknowledgements); None in tests that do not watch them.
    pub groups: Option<Store<DeadLetterGroup>>,
    /// DeadLetterReplays (what standing replays passed through, for the groups); None in tests
    /// that do not watch them.
    pub replays: Option<Store<DeadLetterReplay>>,
}

impl Views {
    /// The queues alone; the group and replay watches are added by [`super::Context`]'s
    /// builders.
    pub fn new(queues: Store<DeadLetterQueue>) -> Self {
        Views {
            queues,
            groups: None,
            replays: None,
        }
    }

    /// The queue `name` in `namespace`.
    pub fn queue(&self, namespace: &str, name: &str) -> Option<Arc<DeadLetterQueue>> {
        self.queues.get(&ObjectRef::new(name).within(namespace))
    }

    /// The DeadLetterGroup `name` in `namespace`; None without a group watch.
    pub fn group(&self, namespace: &str, name: &str) -> Option<Arc<DeadLetterGroup>> {
        self.groups
            .as_ref()?
            .get(&ObjectRef::new(name).within(namespace))
    }

    /// Whether there is a group watch: without one, no group is known to be missing.
    pub fn watches_groups(&self) -> bool {
        self.groups.is_some()
    }

    /// What the standing replays of queue `ns/queue` passed through, by failure group (from
    /// their status, so it outlives the runs and this process).
    pub fn passed_through(&self, ns: &str, queue: &str) -> BTreeMap<String, i64> {
        let mut by_group = BTreeMap::new();
        let Some(store) = &self.replays else {
            return by_group;
        };
        for r in store.state() {
            let passed = r.status.as_ref().map_or(0, |s| s.passed_through);
            if passed == 0 || r.namespace().as_deref() != Some(ns) || r.spec.queue != queue {
                continue;
            }
            if let Some(group) = r.spec.selector().group {
                *by_group.entry(group).or_insert(0) += passed;
            }
        }
        by_group
    }

    /// `event` as the aggregator takes it, when it may be folded: a Normal resolution Event
    /// or a `Parked` about a record (with its failure group, computed from its facts as the
    /// groups are).
    pub(super) fn pending(
        &self,
        obj: &DeadLetter,
        regarding: &ObjectReference,
        event: &EventPlan,
    ) -> Option<aggregate::Pending> {
        let series = dlq_core::events::in_series(event);
        if !series && !dlq_core::events::aggregatable(event) {
            return None;
        }
        let queue = obj.spec.queue.clone();
        let namespace = obj.namespace()?;
        let group = series.then(|| dlq_core::group::Key::of(obj).fingerprint());
        let group_ref = group.as_deref().and_then(|g| {
            let object = self.group(&namespace, &dlq_core::groups::group_name(&queue, g))?;
            Some(apiserver::reference(object.as_ref()))
        });
        Some(aggregate::Pending {
            queue_ref: self
                .queue(&namespace, &queue)
                .map(|q| apiserver::reference(q.as_ref())),
            namespace,
            queue,
            name: obj.metadata.name.clone().unwrap_or_default(),
            regarding: regarding.clone(),
            group,
            group_ref,
            plan: event.clone(),
        })
    }
}
