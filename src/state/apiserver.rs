//! The one writer: every request the reconcilers make of the apiserver goes through
//! [`Apiserver`], small enough that tests put a fake behind it and drive the reconcilers
//! in-process (conflicts, lost races and crashes become deterministic).

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;

use dlq_core::api::{DeadLetter, DeadLetterQueue, DeadLetterStatus, LABEL_QUEUE};
use dlq_core::event_series::Occurrences;
use dlq_core::events::EventPlan;
use dlq_core::group::LABEL_GROUP;
use dlq_core::groups::DeadLetterGroup;
use dlq_core::plan::QueueStatusWrite;
use dlq_core::replay::{
    ANNOTATION_REPLAY_UID, DeadLetterReplay, DeadLetterReplayStatus, LABEL_REPLAY,
};

/// A replay's decision on one record: what, by whom, why, and which replay (the label).
pub struct Signature<'a> {
    pub action: dlq_core::api::Action,
    pub by: &'a str,
    pub note: &'a str,
    pub replay: &'a str,
    pub replay_uid: &'a str,
}

/// What a standing replay passed through, as its status says it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PassedThrough {
    pub passed_through: i64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sample: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passed_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

/// A page of records and the next page's token (None after the last).
pub type RecordPage = (Vec<DeadLetter>, Option<String>);

/// Which page of a failure group's undecided records [`Apiserver::list_undecided`] reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupPage {
    pub namespace: String,
    pub queue: String,
    pub group: String,
    pub limit: u32,
    pub continue_token: Option<String>,
}

/// The undecided Parked records, as a field selector (the CRD's selectable fields; an unset
/// `spec.action` selects as empty).
pub const UNDECIDED: &str = "status.phase=Parked,spec.action=";

/// Names per page of [`Apiserver::record_names`]: metadata only, so a page stays small.
const NAMES_PAGE: u32 = 500;

/// Field manager of every status write the operator makes.
pub const MANAGER: &str = "deadletter-operator";

/// What the reconcilers read from and write to the apiserver.
pub trait Apiserver: Send + Sync {
    /// A record read fresh (not from the watch cache): its full payload, its latest version.
    fn get_record<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DeadLetter>, kube::Error>>;

    /// One page of the undecided Parked records of failure group `group` of queue `queue` in
    /// `namespace` (labels `dlq.dev/queue` and `dlq.dev/group`; fields `status.phase=Parked`,
    /// no `spec.action`), read from etcd: at most `limit`, after `continue_token`; with the next
    /// page's token (None after the last). Whole records: what a replay sends ahead needs their
    /// jobs, which the operator's summaries do not keep.
    fn list_undecided<'a>(
        &'a self,
        page: &'a GroupPage,
    ) -> BoxFuture<'a, Result<RecordPage, kube::Error>>;

    /// The names of the records in `namespace` whose labels match `labels` (a label selector),
    /// read from etcd in pages of metadata: what a run's start checks the cache against.
    fn record_names<'a>(
        &'a self,
        namespace: &'a str,
        labels: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, kube::Error>>;

    /// Merge-patches a record's status, guarded by its resourceVersion (compare-and-swap): a
    /// 409 means someone else wrote first.
    fn write_record_status<'a>(
        &'a self,
        record: &'a DeadLetter,
        status: &'a DeadLetterStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Clears a record's managed fields (a merge patch of `metadata.managedFields: [{}]`),
    /// guarded by its resourceVersion (a 409 means it changed since it was read); answers the
    /// new resourceVersion. With none left the apiserver tracks no manager of later updates
    /// (only a server-side apply starts again): a parked record then costs etcd 0.7 KB and the
    /// apiserver's watch cache about 10 KB less (docs/benchmarks.md, "Record size"). The facts
    /// they guarded stay guarded by the CRD's immutability rules.
    fn clear_managed_fields<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<Option<String>, kube::Error>>;

    /// Merge-patches a queue's status (its counters are recomputed on every write).
    fn write_queue_status<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        status: &'a QueueStatusWrite,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Deletes exactly this version of a record (uid + resourceVersion preconditions).
    fn delete_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Publishes an Event about `regarding`; failures are logged, never fatal.
    fn publish<'a>(&'a self, regarding: ObjectReference, event: &'a EventPlan)
    -> BoxFuture<'a, ()>;

    /// Creates one Event about `regarding` standing for `series` (None: one occurrence), as a
    /// storm's series begins (`dlq_core::event_series`); answers its name for
    /// [`Apiserver::patch_series`].
    fn create_event<'a>(
        &'a self,
        regarding: ObjectReference,
        event: &'a EventPlan,
        series: Option<Occurrences>,
    ) -> BoxFuture<'a, Result<String, kube::Error>>;

    /// Merge-patches the series (count, last observation) of Event `name` in `namespace`: a
    /// storm's later records, one write every few seconds instead of one each.
    fn patch_series<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        series: Occurrences,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Signs a record for a replay (`spec.action`/`by`/`note` and the replay's label), guarded
    /// by the record's resourceVersion: a 409 means it changed since it was read.
    fn sign_record<'a>(
        &'a self,
        record: &'a DeadLetter,
        signature: &'a Signature<'a>,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Takes a replay's decision back (`action`/`by`/`note` removed), guarded by the record's
    /// resourceVersion; the label stays, so the record counts as withdrawn.
    fn withdraw_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Merge-patches a replay's status (only the leader writes it).
    fn write_replay_status<'a>(
        &'a self,
        replay: &'a DeadLetterReplay,
        status: &'a DeadLetterReplayStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Writes what a standing replay passed through (`passedThrough`, `sample`, `passedAt`)
    /// and nothing else of its status: the write a pass waits for before its acknowledgement.
    fn write_replay_passed<'a>(
        &'a self,
        replay: &'a DeadLetterReplay,
        passed: &'a PassedThrough,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// The DeadLetterGroups of one queue (label `dlq.dev/queue`).
    fn list_groups<'a>(
        &'a self,
        namespace: &'a str,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DeadLetterGroup>, kube::Error>>;

    /// Writes a group's status; with `create`, first applies the object itself (labels and
    /// owner), as a group the operator does not know to exist yet.
    fn apply_group<'a>(
        &'a self,
        group: &'a DeadLetterGroup,
        create: bool,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Deletes a group (a 404 counts as done).
    fn delete_group<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;

    /// Labels a record parked before failure groups existed with its group. Unguarded: the
    /// group is a function of immutable facts, so every writer writes the same value.
    fn label_group<'a>(
        &'a self,
        record: &'a DeadLetter,
        group: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;
}

/// The real apiserver.
pub struct KubeApiserver {
    client: Client,
    recorder: Recorder,
    reporter: Reporter,
}

impl KubeApiserver {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        KubeApiserver {
            recorder: Recorder::new(client.clone(), reporter.clone()),
            client,
            reporter,
        }
    }

    fn records(&self, namespace: &str) -> Api<DeadLetter> {
        Api::namespaced(self.client.clone(), namespace)
    }
}

/// A merge patch of `status` on `object`'s status subresource, under the operator's manager.
async fn merge_status<K>(
    client: &Client,
    object: &K,
    status: &impl serde::Serialize,
) -> Result<(), kube::Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let ns = object.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(client.clone(), &ns);
    api.patch_status(
        &object.name_any(),
        &merge_params(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .map(|_| ())
}

fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    }
}

impl Apiserver for KubeApiserver {
    fn get_record<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DeadLetter>, kube::Error>> {
        async move { self.records(namespace).get_opt(name).await }.boxed()
    }

    fn list_undecided<'a>(
        &'a self,
        page: &'a GroupPage,
    ) -> BoxFuture<'a, Result<RecordPage, kube::Error>> {
        async move {
            let labels = format!("{LABEL_QUEUE}={},{LABEL_GROUP}={}", page.queue, page.group);
            let mut lp = ListParams::default()
                .labels(&labels)
                .fields(UNDECIDED)
                .limit(page.limit);
            if let Some(token) = &page.continue_token {
                lp = lp.continue_token(token);
            }
            let list = self.records(&page.namespace).list(&lp).await?;
            let next = list.metadata.continue_.filter(|t| !t.is_empty());
            Ok((list.items, next))
        }
        .boxed()
    }

    fn record_names<'a>(
        &'a self,
        namespace: &'a str,
        labels: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, kube::Error>> {
        async move {
            let api = self.records(namespace);
            let mut names = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let mut lp = ListParams::default().labels(labels).limit(NAMES_PAGE);
                if let Some(t) = &token {
                    lp = lp.continue_token(t);
                }
                let page = api.list_metadata(&lp).await?;
                names.extend(page.items.into_iter().filter_map(|m| m.metadata.name));
                token = page.metadata.continue_.filter(|t| !t.is_empty());
                if token.is_none() {
                    return Ok(names);
                }
            }
        }
        .boxed()
    }

    fn write_record_status<'a>(
        &'a self,
        record: &'a DeadLetter,
        status: &'a DeadLetterStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let ns = record.namespace().unwrap_or_default();
            let patch = json!({
                "metadata": {"resourceVersion": record.resource_version()},
                "status": status,
            });
            self.records(&ns)
                .patch_status(&record.name_any(), &merge_params(), &Patch::Merge(patch))
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn clear_managed_fields<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<Option<String>, kube::Error>> {
        async move {
            let ns = record.namespace().unwrap_or_default();
            let patch = json!({
                "metadata": {"resourceVersion": record.resource_version(), "managedFields": [{}]},
            });
            self.records(&ns)
                .patch_metadata(&record.name_any(), &merge_params(), &Patch::Merge(patch))
                .await
                .map(|cleared| cleared.metadata.resource_version)
        }
        .boxed()
    }

    fn write_queue_status<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        status: &'a QueueStatusWrite,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        merge_status(&self.client, queue, status).boxed()
    }

    fn delete_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: record.uid(),
                    resource_version: record.resource_version(),
                }),
                ..DeleteParams::default()
            };
            let ns = record.namespace().unwrap_or_default();
            self.records(&ns)
                .delete(&record.name_any(), &dp)
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn publish<'a>(
        &'a self,
        regarding: ObjectReference,
        event: &'a EventPlan,
    ) -> BoxFuture<'a, ()> {
        async move {
            dlq_client::events::publish(
                &self.client,
                &self.recorder,
                &self.reporter,
                &regarding,
                event,
            )
            .await
        }
        .boxed()
    }

    fn create_event<'a>(
        &'a self,
        regarding: ObjectReference,
        event: &'a EventPlan,
        series: Option<Occurrences>,
    ) -> BoxFuture<'a, Result<String, kube::Error>> {
        async move {
            dlq_client::events::create(&self.client, &self.reporter, &regarding, event, series)
                .await
        }
        .boxed()
    }

    fn patch_series<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        series: Occurrences,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        dlq_client::events::patch_series(&self.client, namespace, name, series).boxed()
    }

    fn sign_record<'a>(
        &'a self,
        record: &'a DeadLetter,
        signature: &'a Signature<'a>,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let patch = json!({
            "metadata": {
                "resourceVersion": record.resource_version(),
                "labels": {LABEL_REPLAY: signature.replay},
                "annotations": {ANNOTATION_REPLAY_UID: signature.replay_uid},
            },
            "spec": {"action": signature.action, "by": signature.by, "note": signature.note},
        });
        self.patch_record(record, patch)
    }

    fn withdraw_record<'a>(
        &'a self,
        record: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let patch = json!({
            "metadata": {"resourceVersion": record.resource_version()},
            "spec": {"action": null, "by": null, "note": null},
        });
        self.patch_record(record, patch)
    }

    fn write_replay_status<'a>(
        &'a self,
        replay: &'a DeadLetterReplay,
        status: &'a DeadLetterReplayStatus,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        merge_status(&self.client, replay, status).boxed()
    }

    fn write_replay_passed<'a>(
        &'a self,
        replay: &'a DeadLetterReplay,
        passed: &'a PassedThrough,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        merge_status(&self.client, replay, passed).boxed()
    }

    fn list_groups<'a>(
        &'a self,
        namespace: &'a str,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DeadLetterGroup>, kube::Error>> {
        async move {
            let api: Api<DeadLetterGroup> = Api::namespaced(self.client.clone(), namespace);
            let lp = ListParams::default().labels(&format!("{LABEL_QUEUE}={queue}"));
            Ok(api.list(&lp).await?.items)
        }
        .boxed()
    }

    fn apply_group<'a>(
        &'a self,
        group: &'a DeadLetterGroup,
        create: bool,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let ns = group.namespace().unwrap_or_default();
            let api: Api<DeadLetterGroup> = Api::namespaced(self.client.clone(), &ns);
            let name = group.name_any();
            let params = PatchParams::apply(MANAGER).force();
            if create {
                let mut object = group.clone();
                object.status = None;
                object.metadata.managed_fields = None;
                object.metadata.resource_version = None;
                api.patch(&name, &params, &Patch::Apply(&object)).await?;
            }
            let status = json!({
                "apiVersion": "dlq.dev/v1alpha1",
                "kind": "DeadLetterGroup",
                "metadata": {"name": name},
                "status": group.status,
            });
            api.patch_status(&name, &params, &Patch::Apply(&status))
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn delete_group<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let api: Api<DeadLetterGroup> = Api::namespaced(self.client.clone(), namespace);
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        }
        .boxed()
    }

    fn label_group<'a>(
        &'a self,
        record: &'a DeadLetter,
        group: &'a str,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        let patch = json!({"metadata": {"labels": {LABEL_GROUP: group}}});
        self.patch_record(record, patch)
    }
}

impl KubeApiserver {
    /// A merge patch of a record's spec/metadata (the patch carries its own precondition).
    fn patch_record<'a>(
        &'a self,
        record: &'a DeadLetter,
        patch: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let ns = record.namespace().unwrap_or_default();
            self.records(&ns)
                .patch(&record.name_any(), &merge_params(), &Patch::Merge(patch))
                .await
                .map(|_| ())
        }
        .boxed()
    }
}

/// The reference an Event about `obj` points at.
pub fn reference(obj: &impl Resource<DynamicType = ()>) -> ObjectReference {
    obj.object_ref(&())
}

/// Whether the apiserver answered 409 Conflict (a lost compare-and-swap).
pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

#[cfg(test)]
pub(crate) mod fake;
