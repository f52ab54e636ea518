//! The `DeadLetterQueue` kind (`dlq.dev/v1alpha1`): where a queue's jobs go back to
//! ([`TargetSpec`]), where dead messages are collected from ([`SourceSpec`]), its capacity,
//! alerts, groups, HTTP parking and payload protection, and what the operator reports of it.
//! The backends' specs are beside it, in `queue/target.rs` and `queue/source.rs`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube_derive::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

mod bodies;
mod source;
mod target;

pub use bodies::*;
pub use source::*;
pub use target::*;

/// A logical queue: where redriven jobs go, where dead messages come from, and policies.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "dlq.dev",
    version = "v1alpha1",
    kind = "DeadLetterQueue",
    namespaced,
    shortname = "dlq",
    category = "dlq-all",
    status = "DeadLetterQueueStatus",
    printcolumn = r#"{"name":"Target","type":"string","jsonPath":".status.target"}"#,
    printcolumn = r#"{"name":"Parked","type":"integer","jsonPath":".status.parked"}"#,
    printcolumn = r#"{"name":"Redriven","type":"integer","jsonPath":".status.redriven"}"#,
    printcolumn = r#"{"name":"Dropped","type":"integer","jsonPath":".status.dropped"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("!has(self.target.sidekiq) || has(self.target.sidekiq.urlSecretRef) || (has(self.source) && has(self.source.sidekiq) && has(self.source.sidekiq.urlSecretRef))").message("spec.target.sidekiq needs urlSecretRef, or a spec.source.sidekiq with one"),
    validation = kube::core::Rule::new("!has(self.source) || !has(self.source.sidekiq) || has(self.source.sidekiq.urlSecretRef) || (has(self.target.sidekiq) && has(self.target.sidekiq.urlSecretRef))").message("spec.source.sidekiq needs urlSecretRef, or a spec.target.sidekiq with one"),
)]
pub struct DeadLetterQueueSpec {
    /// Where redrive puts jobs back.
    pub target: TargetSpec,
    /// Optional: collect a broker's dead messages and park them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,
    /// A hard limit: at most this many Parked records (and admitted parkings not yet counted).
    /// Beyond it parkings are refused and sources leave dead messages in their broker until
    /// records are resolved. Defaults to 5000 (see docs/operations.md, "Capacity").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), default = "default_max_parked")]
    pub max_parked: Option<i64>,
    /// Per-record Alertmanager alerts of this queue's records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alerts: Option<AlertSettings>,
    /// Its failure groups (`DeadLetterGroup`): how many at most, and the tiers' thresholds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<GroupSettings>,
    /// Accept parkings over HTTP (CloudEvents or a plain body) at the operator's park
    /// endpoint; the queue's `status.address` then says where.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpParkSpec>,
    /// Payload protection: sealing new records' payload and headers, and more JSON paths to
    /// mask wherever a payload is shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protection: Option<Protection>,
    /// A body store: dead messages above `thresholdBytes` are kept in an object store (or a
    /// volume), the record holding a reference and a digest (`spec.job.body`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bodies: Option<BodiesSpec>,
    /// Dual control: replays of this queue need approvals by others than their author before
    /// they decide anything (see `dlq_core::replay::approvals`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvals: Option<crate::replay::ApprovalPolicy>,
}

/// `spec.alerts` of a DeadLetterQueue: per-record alerts of its records.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AlertSettings {
    /// Raise alerts for parked records (default true when an Alertmanager is configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// `group` (default): one `DeadLetterGroupParked` alert per failure group, silenced by
    /// its acknowledgement; `record`: one `DeadLetterParked` per parked record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per: Option<AlertPer>,
    /// The `severity` label per failure kind (default `warning`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<Severities>,
    /// Extra labels on every alert of this queue (for routing to a team).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    #[x_kube(
        validation = kube::core::Rule::new("self.all(k, k.matches('^[a-zA-Z_][a-zA-Z0-9_]{0,127}$'))").message("alerts.labels names must be Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*)"),
        validation = kube::core::Rule::new("self.all(k, !(k in ['alertname', 'namespace', 'queue', 'deadletter', 'job', 'failure_kind', 'severity', 'service_version']))").message("alerts.labels cannot set alertname, namespace, queue, deadletter, job, failure_kind, severity or service_version: the operator sets them"),
        validation = kube::core::Rule::new("self.all(k, size(self[k]) <= 256)").message("alerts.labels values are at most 256 characters"),
    )]
    pub labels: BTreeMap<String, String>,
}

/// What one parked-alert stands for.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AlertPer {
    Group,
    Record,
}

/// The severity label per failure kind.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct Severities {
    #[serde(rename = "Invalid", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub invalid: Option<String>,
    #[serde(rename = "Transient", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub transient: Option<String>,
}

/// A queue's `spec.groups`: the bound on its groups and its tier thresholds.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GroupSettings {
    /// Most groups of this queue (default 100); records of further groups are counted in one
    /// `overflow` group, announced by a Warning Event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max: Option<i32>,
    /// A group parking at least this many records a minute is `critical` (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub critical_per_minute: Option<i64>,
    /// A group parking at least this many records an hour is `warning` (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub warning_per_hour: Option<i64>,
}

/// A queue's payload protection (see `dlq_core::seal` and `dlq_core::mask`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Protection {
    /// Seal every new record's payload and headers to the queue's current age recipient.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<SealSpec>,
    /// JSON paths (`$.card.number`, `$.items[*].pan`) whose values are masked wherever a
    /// payload is shown; card numbers (Luhn-valid digit runs) always are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(min = 1, max = 256)))]
    pub mask: Vec<String>,
}

/// The queue's age identity: one (`identitySecretRef`), or several while rotating (`keys`: the
/// first seals new records, the others only open older ones; retire one once its count in
/// `status.protection.records` is 0).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("has(self.identitySecretRef) != has(self.keys)").message("spec.protection.seal names one identity (identitySecretRef) or, while rotating, a list (keys): exactly one of them")
)]
pub struct SealSpec {
    /// The Secret holding the queue's identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_secret_ref: Option<SealKeyRef>,
    /// Several identities while rotating: the first seals new records.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 8))]
    pub keys: Vec<SealKeyRef>,
}

impl SealSpec {
    /// The identities in order (the first seals new records), whichever form names them.
    pub fn key_refs(&self) -> &[SealKeyRef] {
        match &self.identity_secret_ref {
            Some(one) => std::slice::from_ref(one),
            None => &self.keys,
        }
    }
}

/// A Secret (same namespace) holding an age X25519 identity (`AGE-SECRET-KEY-1...`, as
/// `age-keygen` or `kubectl dlq seal-key` writes it).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SealKeyRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The Secret's key; default `identity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

/// The Secret key an identity is read from when a [`SealKeyRef`] names none.
pub const DEFAULT_SEAL_KEY: &str = "identity";

impl SealKeyRef {
    pub fn key(&self) -> &str {
        self.key.as_deref().unwrap_or(DEFAULT_SEAL_KEY)
    }
}

/// What the operator publishes about a queue's protection: public values only.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProtectionStatus {
    /// The recipient parkers seal new records to (the first identity's, once its Secret was
    /// read; absent while it cannot be, so parkers wait rather than seal to a retiring key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipient: Option<String>,
    /// Records sealed to each recipient (any phase), every readable identity's listed, 0
    /// included: a key can be retired at 0.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub records: BTreeMap<String, i64>,
}

impl DeadLetterQueue {
    /// Whether the queue asks for sealing.
    pub fn seals(&self) -> bool {
        self.spec
            .protection
            .as_ref()
            .and_then(|p| p.seal.as_ref())
            .is_some_and(|s| !s.key_refs().is_empty())
    }

    /// The recipient new records are sealed to, as the operator published it.
    pub fn seal_recipient(&self) -> Option<&str> {
        self.status
            .as_ref()?
            .protection
            .as_ref()?
            .recipient
            .as_deref()
    }

    /// The queue's extra JSON paths to mask.
    pub fn mask_paths(&self) -> &[String] {
        self.spec
            .protection
            .as_ref()
            .map(|p| p.mask.as_slice())
            .unwrap_or_default()
    }
}

/// Who may park into a queue over HTTP.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HttpParkSpec {
    /// The audience a caller's bearer token must carry (a projected ServiceAccount token's
    /// `audience`). Default: the queue's URL path, `/v1/namespaces/{ns}/queues/{name}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub audience: Option<String>,
    /// Park requests without a token too, from inside the cluster only: from the addresses
    /// the operator was given with `--park-anonymous-from` (the chart's
    /// `parkEndpoint.anonymousFrom`, usually the pod network). Off by default: a token checked
    /// with a TokenReview and a SubjectAccessReview for `create deadletters` in the queue's
    /// namespace.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_anonymous: bool,
}

impl DeadLetterQueue {
    /// The audience HTTP parkers' tokens must carry, when the queue accepts HTTP.
    pub fn http_audience(&self) -> Option<String> {
        let http = self.spec.http.as_ref()?;
        Some(http.audience.clone().unwrap_or_else(|| {
            park_path(
                self.metadata.namespace.as_deref().unwrap_or_default(),
                self.metadata.name.as_deref().unwrap_or_default(),
            )
        }))
    }
}

/// The park endpoint's path for a queue.
pub fn park_path(namespace: &str, queue: &str) -> String {
    format!("/v1/namespaces/{namespace}/queues/{queue}")
}

/// Where an Addressable receives events (Knative's duck type `status.address`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Address {
    pub url: String,
    /// The audience a sender's token must carry (Knative's `address.audience`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// The CA certificates (PEM) that issued the endpoint's certificate, so that a sender such
    /// as Knative's dispatcher trusts it without cluster-wide configuration (Knative's
    /// `address.CACerts`).
    #[serde(rename = "CACerts", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    pub ca_certs: Option<String>,
}

/// Default for `maxParked`: at 64 KiB payloads about 330 MiB of etcd (68 KB a record,
/// measured), a sixth of etcd's default 2 GiB quota; at 1 KiB about 10 MiB (docs/operations.md,
/// "Capacity"). The schema sets it, so a queue created without one shows it.
pub const DEFAULT_MAX_PARKED: i64 = 5_000;

fn default_max_parked() -> Option<i64> {
    Some(DEFAULT_MAX_PARKED)
}

impl DeadLetterQueueSpec {
    pub fn max_parked(&self) -> i64 {
        self.max_parked.unwrap_or(DEFAULT_MAX_PARKED)
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Resolved records are deleted this long after resolution (Go duration, e.g. `720h`).
    /// Parked records are never deleted.
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('0s')").message("retention.resolvedFor must be a duration such as 720h"))]
    #[schemars(length(max = 32))]
    pub resolved_for: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterQueueStatus {
    #[serde(default)]
    pub parked: i64,
    #[serde(default)]
    pub redriven: i64,
    #[serde(default)]
    pub dropped: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_parked_at: Option<Time>,
    /// The target in words, for `kubectl get dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The same counters per failure kind (`Transient`, `Invalid`), for `kubectl dlq stats`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failure_kinds: BTreeMap<String, KindCounts>,
    /// Blocks of slots under `maxParked` granted to parker processes, by block id: a parking
    /// storm reserves many slots in one compare-and-swap and spends them without writing the
    /// queue again. Records parked in a block carry its id in the annotation
    /// `dlq.dev/slot-block`; the operator counts them and removes the block once every slot is
    /// seen or it is too old to be used (see `dlq_core::capacity`).
    // Atomic for field management: per-key managedFields entries made every write of a storm
    // slower (600 parkings: 14.8 KB of managedFields, 6.8 s; atomic: 0.5 KB, 4.7 s).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub blocks: BTreeMap<String, SlotBlock>,
    /// Where to POST events to park them, once `spec.http` is set and the operator serves its
    /// park endpoint (this makes the queue a Knative Addressable: a `deadLetterSink`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Address>,
    /// The queue's sealing recipients and how many records each sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protection: Option<ProtectionStatus>,
    /// Dead messages still waiting in the source's broker beyond the records: what a storm
    /// holds past `maxParked`. Written by the source's backlog sampler alone (a merge patch of
    /// this field only), so the counters' writes never overwrite it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<QueueBacklog>,
    /// What the HTTP park endpoint refused: it has no backlog, the senders hold the events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpParkStatus>,
}

/// A queue's `status.backlog`: the dead messages its source's broker still holds.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct QueueBacklog {
    /// How many; absent when the broker cannot say (Pub/Sub), never a made-up 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<i64>,
    /// When the broker was last asked and answered. A broker that stops answering keeps the
    /// last number with its old time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<Time>,
}

impl QueueBacklog {
    /// The number for a person: `14,968`, or `unknown`.
    pub fn shown(&self) -> String {
        self.messages
            .map_or_else(|| "unknown".to_string(), thousands)
    }
}

/// A queue's `status.http`: the park endpoint's refusals.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HttpParkStatus {
    /// Parkings answered 429 (the queue at `maxParked`) in the last minute: events the senders
    /// still hold and will send again.
    #[serde(default)]
    pub refused_last_minute: i64,
}

/// `n` with thousands separated by commas, as an on-call engineer reads a storm's size.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A block of slots one parker process holds (see `DeadLetterQueueStatus::blocks`).
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "camelCase")]
pub struct SlotBlock {
    /// Slots granted.
    #[serde(default)]
    pub size: i64,
    /// When granted (Unix seconds, the parker's clock).
    #[serde(default)]
    pub at: i64,
    /// Records of the block the operator has counted (they are in `parked` or resolved).
    #[serde(default)]
    pub counted: i64,
}

/// One failure kind's records of a queue, as the operator last counted them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KindCounts {
    #[serde(default)]
    pub parked: i64,
    #[serde(default)]
    pub redriven: i64,
    #[serde(default)]
    pub dropped: i64,
    /// Cleared (null) once nothing of this kind is parked.
    #[serde(default)]
    pub oldest_parked_at: Option<Time>,
}

/// The label Knative finds Addressable CRDs by (and grants its resolver read on).
pub const LABEL_ADDRESSABLE: &str = "duck.knative.dev/addressable";

/// The DeadLetterQueue CRD, labelled Addressable: a queue can be a Knative `deadLetterSink`.
/// (On the CRD only: kube-derive's `label` would also put it on every queue `new` makes.)
pub fn queue_crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube_core::CustomResourceExt;
    let mut crd = DeadLetterQueue::crd();
    crd.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(LABEL_ADDRESSABLE.into(), "true".into());
    crd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlog_reads_with_thousands_separated_and_unknown_as_unknown() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(175_000), "175,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(-14_968), "-14,968");
        let known = QueueBacklog {
            messages: Some(14_968),
            observed_at: None,
        };
        assert_eq!(known.shown(), "14,968");
        assert_eq!(QueueBacklog::default().shown(), "unknown", "never 0");
    }
}
