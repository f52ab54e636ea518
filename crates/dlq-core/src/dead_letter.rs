//! The `dlq.dev/v1alpha1` API: `DeadLetter` (one parked job) and `DeadLetterQueue` (where it
//! came from and goes back to).
//!
//! The rules that protect a record (immutable facts, signed decisions, one resolution) are CEL
//! rules in the CRD, so the apiserver refuses a bad `kubectl edit` before the operator sees it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube_derive::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Largest UTF-8 payload a record holds, in bytes (the CRD bounds characters to the same number).
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;
/// `payloadBase64` length for [`MAX_PAYLOAD_BYTES`] of raw bytes.
pub const MAX_PAYLOAD_BASE64_LEN: usize = MAX_PAYLOAD_BYTES.div_ceil(3) * 4;
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_VALUE_LEN: usize = 8192;
pub const MAX_JOB_ID_LEN: usize = 253;

/// Label with the DeadLetterQueue name.
pub const LABEL_QUEUE: &str = "dlq.dev/queue";
/// Label `transient` or `invalid`.
pub const LABEL_FAILURE_KIND: &str = "dlq.dev/failure-kind";
/// Label with the hash of `queue/jobId`: selects every cycle of one job.
pub const LABEL_JOB_KEY: &str = "dlq.dev/job-key";
/// Annotation with the broker's identity of the dead message a source parked (see
/// `park::ParkRequest::message`).
pub const ANNOTATION_SOURCE_MESSAGE: &str = "dlq.dev/source-message";
/// Annotation with the id of the block of slots (`DeadLetterQueueStatus::blocks`) a record was
/// parked in.
pub const ANNOTATION_SLOT_BLOCK: &str = "dlq.dev/slot-block";
/// Longest source message identity kept; longer ones are hashed.
pub const MAX_SOURCE_MESSAGE_LEN: usize = 253;

/// One parking of a job that a consumer gave up on. Only `action`/`by`/`note` are meant to change.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dlq.dev",
    version = "v1alpha1",
    kind = "DeadLetter",
    namespaced,
    shortname = "dl",
    category = "dlq-all",
    status = "DeadLetterStatus",
    printcolumn = r#"{"name":"Job","type":"string","jsonPath":".spec.job.id"}"#,
    printcolumn = r##"{"name":"#","type":"integer","jsonPath":".spec.deliveries","description":"deliveries in this cycle"}"##,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Intent","type":"string","jsonPath":".spec.intent.state","description":"business state when parked"}"#,
    printcolumn = r#"{"name":"By","type":"string","jsonPath":".spec.by"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".spec.reason"}"#,
    printcolumn = r#"{"name":"Cycle","type":"integer","jsonPath":".spec.cycle","priority":1}"#,
    printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".spec.failureKind","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    selectable = ".status.phase",
    selectable = ".spec.action",
    validation = kube::core::Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase == 'Parked' || ((has(self.spec.action) ? self.spec.action : '') == (has(oldSelf.spec.action) ? oldSelf.spec.action : '') && (has(self.spec.by) ? self.spec.by : '') == (has(oldSelf.spec.by) ? oldSelf.spec.by : '') && (has(self.spec.note) ? self.spec.note : '') == (has(oldSelf.spec.note) ? oldSelf.spec.note : ''))"
    ).message(kube::core::Message::Expression(
        "'record is not parked: ' + self.spec.job.id + ' is ' + oldSelf.status.phase.lowerAscii()".into()
    )).reason(kube::core::Reason::FieldValueForbidden).field_path(".spec")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.queue == oldSelf.queue").message("spec.queue is immutable"),
    validation = kube::core::Rule::new("self.cycle == oldSelf.cycle").message("spec.cycle is immutable"),
    validation = kube::core::Rule::new("self.job == oldSelf.job").message("spec.job is immutable: redrive sends the job untouched"),
    validation = kube::core::Rule::new("has(self.intent) == has(oldSelf.intent) && (!has(self.intent) || self.intent == oldSelf.intent)").message("spec.intent is immutable: it is the business state when the job was parked"),
    validation = kube::core::Rule::new("self.deliveries == oldSelf.deliveries").message("spec.deliveries is immutable"),
    validation = kube::core::Rule::new("self.reason == oldSelf.reason").message("spec.reason is immutable"),
    validation = kube::core::Rule::new("self.failureKind == oldSelf.failureKind").message("spec.failureKind is immutable"),
    validation = kube::core::Rule::new("has(self.serviceVersion) == has(oldSelf.serviceVersion) && (!has(self.serviceVersion) || self.serviceVersion == oldSelf.serviceVersion)").message("spec.serviceVersion is immutable"),
    validation = kube::core::Rule::new("self.failedAt == oldSelf.failedAt").message("spec.failedAt is immutable"),
    validation = kube::core::Rule::new("has(self.errorClass) == has(oldSelf.errorClass) && (!has(self.errorClass) || self.errorClass == oldSelf.errorClass)").message("spec.errorClass is immutable"),
    validation = kube::core::Rule::new("!has(self.action) || (has(self.by) && self.by.trim() != '')").message("every decision must be signed: set spec.by when spec.action is set"),
)]
pub struct DeadLetterSpec {
    /// The DeadLetterQueue (same namespace) the job came from and returns to.
    #[schemars(length(min = 1, max = 63))]
    pub queue: String,
    /// 1 + the highest cycle of earlier records of this job.
    #[schemars(range(min = 1))]
    pub cycle: i32,
    /// The job exactly as the consumer received it.
    pub job: Job,
    /// The business object's state when the job was parked. Opaque to the operator.
    // Boxed, like `Job::origin`: every cached record pays for what is inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent: Option<Box<IntentSnapshot>>,
    /// Deliveries in this cycle.
    #[schemars(range(min = 0))]
    pub deliveries: i32,
    /// Why the consumer gave up, in words.
    #[schemars(length(max = 1024))]
    pub reason: String,
    pub failure_kind: FailureKind,
    /// Which consumer version gave up (e.g. `relayer@1.4.2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub service_version: Option<String>,
    /// What kind of error the consumer met (an exception class, `x-death`'s reason, a NATS
    /// advisory kind): part of the record's failure group (`dlq.dev/group`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub error_class: Option<String>,
    pub failed_at: Time,
    /// The human decision. Set together with `by`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    /// Who decided. Required whenever `action` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub by: Option<String>,
    /// Why, for the record (ticket, incident).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub note: Option<String>,
}

/// The untouched job. Exactly one of `payload` (UTF-8), `payloadBase64` (any bytes) or
/// `payloadNull` (no value at all: a Kafka tombstone).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("has(self.sealed) || ((has(self.payloadNull) && self.payloadNull) ? !has(self.payload) && !has(self.payloadBase64) : has(self.payload) != has(self.payloadBase64))").message("exactly one of spec.job.payload, spec.job.payloadBase64 and spec.job.payloadNull must be set"),
    validation = kube::core::Rule::new("!has(self.sealed) || (!has(self.payload) && !has(self.payloadBase64) && !has(self.payloadNull) && !has(self.headers))").message("a sealed job holds its payload and headers only in spec.job.sealed: payload, payloadBase64, payloadNull and headers must not be set"),
)]
pub struct Job {
    #[schemars(length(min = 1, max = 253))]
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 262144))]
    pub payload: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 349528), regex(pattern = r"^[A-Za-z0-9+/]*={0,2}$"))]
    pub payload_base64: Option<String>,
    /// The message had no value at all, which a Kafka consumer tells from an empty one (a
    /// tombstone deletes its key in a compacted topic): redrive sends no value either.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub payload_null: bool,
    /// Original message headers, carried back on redrive.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    #[x_kube(validation = kube::core::Rule::new("self.all(k, size(k) <= 256 && size(self[k]) <= 8192)").message("header names are at most 256 characters and values at most 8192"))]
    pub headers: BTreeMap<String, String>,
    /// Where the broker says the job was published before it died (RabbitMQ `x-death`, the
    /// JetStream message's subject). Part of the immutable job, so it cannot be edited to send a
    /// job elsewhere; redrive goes back there unless the target's `route` is `target`.
    // Boxed: most jobs have none, and inline it would cost each cached record 0.2 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Box<Origin>>,
    /// The job's payload and headers sealed to the queue's age recipient (`dlq_core::seal`),
    /// instead of `payload`/`payloadBase64`/`payloadNull`/`headers`.
    // Boxed: most jobs are not sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<Box<SealedJob>>,
}

/// A job's content (payload, payloadBase64, payloadNull, headers) as one age file encrypted to
/// an X25519 recipient: opened only with that recipient's identity.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SealedJob {
    /// The age recipient (`age1...`) it is sealed to: which of the queue's keys opens it.
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^age1[02-9ac-hj-np-z]+$")
    )]
    pub recipient: String,
    /// Base64 of the binary age file; its plaintext is the JSON of the job's content.
    #[schemars(
        length(min = 1, max = 1048576),
        regex(pattern = r"^[A-Za-z0-9+/]*={0,2}$")
    )]
    pub ciphertext: String,
}

/// The address a broker-collected job had before it died. Each backend reads only its fields.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Origin {
    /// AMQP: the exchange the job was published to (`""` is the default exchange).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub exchange: Option<String>,
    /// AMQP: the routing key it was published with (the first of `x-death`'s routing-keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub routing_key: Option<String>,
    /// AMQP: the queue whose consumer gave up on it. Sidekiq: the queue the job ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub queue: Option<String>,
    /// Sidekiq: the job's class (the worker that gave up on it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub class: Option<String>,
    /// NATS: the JetStream stream that held it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub stream: Option<String>,
    /// NATS: the subject it was published on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub subject: Option<String>,
    /// NATS: its stream sequence; tells a JetStream duplicate of the dead message itself from a
    /// newer copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub sequence: Option<i64>,
    /// SQS: the ARN of the queue the message was moved from (`DeadLetterQueueSourceArn`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub queue_arn: Option<String>,
    /// Kafka: the topic the record was consumed from before it was dead-lettered (Spring's
    /// `kafka_dlt-original-topic`, Connect's `__connect.errors.topic`). Pub/Sub: the topic of
    /// the subscription that gave up on it (`projects/<p>/topics/<t>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub topic: Option<String>,
    /// Pub/Sub: the subscription that gave up on it (`projects/<p>/subscriptions/<s>`, from
    /// `CloudPubSubDeadLetterSourceSubscription` and its project).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub subscription: Option<String>,
    /// Pub/Sub: the message's ordering key, published with it again on redrive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub ordering_key: Option<String>,
    /// Kafka: its partition there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub partition: Option<i32>,
    /// Kafka: its offset there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub offset: Option<i64>,
}

impl Job {
    /// A job of `id` carrying `bytes` untouched: as `payload` when they are UTF-8 text, else as
    /// `payloadBase64`. Every source builds its jobs this way.
    pub fn from_bytes(id: impl Into<String>, bytes: &[u8]) -> Job {
        use base64::Engine;
        let (payload, payload_base64) = match std::str::from_utf8(bytes) {
            Ok(text) => (Some(text.to_string()), None),
            Err(_) => (
                None,
                Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
            ),
        };
        Job {
            id: id.into(),
            payload,
            payload_base64,
            ..Job::default()
        }
    }

    /// A job of `id` whose message had no value (a Kafka tombstone), not an empty one.
    pub fn null_value(id: impl Into<String>) -> Job {
        Job {
            id: id.into(),
            payload_null: true,
            ..Job::default()
        }
    }

    /// The payload bytes exactly as parked (none for a [`Job::payload_null`] job).
    pub fn payload_bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        use base64::Engine;
        match (&self.payload, &self.payload_base64) {
            (Some(text), _) => Ok(text.as_bytes().to_vec()),
            (None, Some(b64)) => base64::engine::general_purpose::STANDARD.decode(b64),
            (None, None) => Ok(Vec::new()),
        }
    }

    /// Whether the (possibly stripped) job still carries its payload (a null one counts).
    /// A sealed job counts: its payload is in `sealed`.
    pub fn has_payload(&self) -> bool {
        self.payload.is_some()
            || self.payload_base64.is_some()
            || self.payload_null
            || self.sealed.is_some()
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct IntentSnapshot {
    #[schemars(length(max = 253))]
    pub id: String,
    #[schemars(length(max = 253))]
    pub state: String,
}

/// Invalid: the message itself is unusable (fix the producer). Transient: retries ran out.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    Transient,
    Invalid,
}

impl FailureKind {
    pub const ALL: [FailureKind; 2] = [FailureKind::Transient, FailureKind::Invalid];

    /// The API's spelling (`Transient`, `Invalid`).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Transient => "Transient",
            FailureKind::Invalid => "Invalid",
        }
    }

    /// Lower-case form used in labels and metrics.
    pub fn label(self) -> &'static str {
        match self {
            FailureKind::Transient => "transient",
            FailureKind::Invalid => "invalid",
        }
    }
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Redrive,
    Drop,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default,
)]
pub enum Phase {
    #[default]
    Parked,
    Redriven,
    Dropped,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Parked => "Parked",
            Phase::Redriven => "Redriven",
            Phase::Dropped => "Dropped",
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl DeadLetter {
    /// The phase, treating a record the operator has not yet seen as Parked.
    pub fn phase(&self) -> Phase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or(Phase::Parked)
    }
}

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
    pub alerts: Option<crate::alert::AlertSettings>,
    /// Its failure groups (`DeadLetterGroup`): how many at most, and the tiers' thresholds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<crate::groups::GroupSettings>,
    /// Accept parkings over HTTP (CloudEvents or a plain body) at the operator's park
    /// endpoint; the queue's `status.address` then says where.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpParkSpec>,
    /// Payload protection: sealing new records' payload and headers, and more JSON paths to
    /// mask wherever a payload is shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protection: Option<Protection>,
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

/// Exactly one backend.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("[has(self.redis), has(self.amqp), has(self.nats), has(self.http), has(self.sqs), has(self.kafka), has(self.sidekiq), has(self.pubsub)].filter(x, x).size() == 1").message("spec.target needs exactly one backend (redis, amqp, nats, http, sqs, kafka, sidekiq or pubsub)"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.idempotencyKeyHeader) || self.idempotencyKeyHeader.matches('^[A-Za-z0-9_.-]*$')").message("spec.target.idempotencyKeyHeader must be a header name (letters, digits, '-', '_', '.'), or empty for none"))]
pub struct TargetSpec {
    /// The header every redrive adds beside the job's own headers, carrying its idempotency
    /// key (the record's uid and cycle: the same for every enqueue of one redrive), so a
    /// consumer can drop a repeated delivery. Unset: `Idempotency-Key`; empty: none. A Redis
    /// list or a Sidekiq queue, which carry no headers, never get it; a job that already has a
    /// header of that name keeps its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub idempotency_key_header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amqp: Option<AmqpTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqs: Option<SqsTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidekiq: Option<SidekiqTargetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pubsub: Option<PubsubTargetSpec>,
}

/// Push the job's JSON, untouched, onto `queue:<its queue>` and add the queue to `queues`,
/// atomically, as Sidekiq's own client enqueues: an unmodified Sidekiq process runs it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SidekiqTargetSpec {
    /// Secret key holding the `redis://` URL Sidekiq uses; defaults to the sidekiq source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    /// The redis-namespace prefix Sidekiq runs under (keys become `<namespace>:queue:<q>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub namespace: Option<String>,
}

/// The header a redrive's idempotency key goes in when a queue does not name one.
pub const DEFAULT_IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

impl TargetSpec {
    /// The header carrying a redrive's idempotency key; None when the queue turned it off.
    pub fn idempotency_key_header(&self) -> Option<&str> {
        match self.idempotency_key_header.as_deref() {
            None => Some(DEFAULT_IDEMPOTENCY_KEY_HEADER),
            Some("") => None,
            Some(name) => Some(name),
        }
    }
}

/// LPUSH onto `list` (a BRPOP/BLMOVE consumer sees FIFO order) or XADD onto `stream`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("has(self.list) != has(self.stream)").message("redis target needs exactly one of list or stream"))]
pub struct RedisTargetSpec {
    pub url_secret_ref: SecretKeyRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub list: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub stream: Option<String>,
}

/// Where a redriven job that carries an `origin` goes.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "camelCase")]
pub enum Route {
    /// Back to the job's origin (x-death exchange + routing key, or the JetStream subject) when
    /// the record has one; to the target's own address otherwise.
    #[default]
    Origin,
    /// Always to the target's own address.
    Target,
}

/// Publish to `exchange` with `routingKey`: persistent, mandatory (an unroutable job is a
/// failure, not a silent drop), and confirmed by the broker.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AmqpTargetSpec {
    /// Secret key holding the `amqp://` or `amqps://` URL (with credentials and vhost).
    pub url_secret_ref: SecretKeyRef,
    /// `""` is the default exchange, which routes by queue name.
    #[serde(default)]
    #[schemars(length(max = 255))]
    pub exchange: String,
    #[schemars(length(max = 255))]
    pub routing_key: String,
    /// `origin` (default): records collected from RabbitMQ go back to their x-death exchange and
    /// routing key; `target`: always `exchange` + `routingKey`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
}

/// Publish to `subject`; with `jetStream` (the default) wait for the stream's PubAck.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("has(self.url) != has(self.urlSecretRef)").message("nats target needs exactly one of url or urlSecretRef"),
    validation = kube::core::Rule::new("!has(self.url) || !self.url.contains('@')").message("credentials belong in a Secret: use urlSecretRef for a URL with a user, password or token"),
)]
pub struct NatsTargetSpec {
    /// `nats://host:4222` (comma-separate several servers); no credentials here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub url: Option<String>,
    /// Secret key holding the URL, e.g. `nats://user:password@host:4222`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    #[schemars(length(min = 1, max = 1024))]
    pub subject: String,
    /// Publish through JetStream and wait for the PubAck (default true). `false` is a core NATS
    /// publish, confirmed only by the server's flush: nothing stores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jet_stream: Option<bool>,
    /// `origin` (default): records collected from JetStream go back to their original subject;
    /// `target`: always `subject`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
}

impl NatsTargetSpec {
    pub fn jet_stream(&self) -> bool {
        self.jet_stream.unwrap_or(true)
    }
}

/// POST the payload with its headers to the consumer's own endpoint; 2xx is success.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.url.matches('^https?://[^/@?#]+([/?#].*)?$')").message("http target url must be http(s)://host[:port]/path without credentials (use bearerTokenSecretRef)"),
    validation = kube::core::Rule::new("!has(self.caSecretRef) || self.url.startsWith('https://')").message("caSecretRef needs an https:// url"),
)]
pub struct HttpTargetSpec {
    #[schemars(length(min = 1, max = 2048))]
    pub url: String,
    /// Secret key holding a token sent as `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_token_secret_ref: Option<SecretKeyRef>,
    /// Secret key holding PEM CA certificates to trust instead of the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

/// `SendMessage` to `queueUrl` (or, with `route: origin`, to the queue a collected record was
/// moved from), confirmed by SQS's answer. Credentials from `credentialsSecretRef`, else the
/// default AWS chain (IRSA / web identity, environment, instance role).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.queueUrl.matches('^https?://[^/@?#]+/[^?#@]+$')").message("sqs queueUrl must be http(s)://host/account/queue without credentials"),
    validation = kube::core::Rule::new("!has(self.endpoint) || self.endpoint.matches('^https?://[^/@?#]+/?$')").message("sqs endpoint must be http(s)://host[:port] without credentials"),
)]
pub struct SqsTargetSpec {
    /// e.g. `https://sqs.eu-west-1.amazonaws.com/123456789012/relayer` (`.fifo` for FIFO).
    #[schemars(length(min = 1, max = 1024))]
    pub queue_url: String,
    /// AWS region; defaults to the one in `queueUrl` (`sqs.<region>.amazonaws.com`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// Endpoint override (an SQS-compatible server, a VPC endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<AwsCredentialsRef>,
    /// `origin` (default): records collected from an SQS dead-letter queue go back to the queue
    /// they were moved from (`DeadLetterQueueSourceArn`); `target`: always `queueUrl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
}

/// A Secret holding `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and optionally
/// `AWS_SESSION_TOKEN` (the variable names, so the same Secret can feed `envFrom`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct AwsCredentialsRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Long-poll an SQS dead-letter queue (one a RedrivePolicy feeds). A message is deleted only
/// once its record exists. Region, endpoint and credentials default to the sqs target's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.queueUrl.matches('^https?://[^/@?#]+/[^?#@]+$')").message("sqs queueUrl must be http(s)://host/account/queue without credentials"),
    validation = kube::core::Rule::new("!has(self.endpoint) || self.endpoint.matches('^https?://[^/@?#]+/?$')").message("sqs endpoint must be http(s)://host[:port] without credentials"),
)]
pub struct SqsSourceSpec {
    #[schemars(length(min = 1, max = 1024))]
    pub queue_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<AwsCredentialsRef>,
}

/// Publish to the topic a collected record's subscription reads (or, with `route: target` or for
/// a record without one, to `topic`), and wait for the server's message id. Credentials from
/// `credentialsSecretRef` (a service-account key), else the pod's workload identity (ADC);
/// `PUBSUB_EMULATOR_HOST` in the operator's environment connects to an emulator instead.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PubsubTargetSpec {
    /// The Google Cloud project of `topic` (when it is a bare topic id).
    #[schemars(length(min = 1, max = 64))]
    pub project: String,
    /// A topic id or `projects/<p>/topics/<t>`; needed for records without an origin topic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub topic: Option<String>,
    /// Secret key holding a service-account key (JSON); defaults to the pubsub source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretKeyRef>,
    /// `origin` (default): records collected from a dead-letter subscription go back to the topic
    /// of the subscription that gave up on them; `target`: always `topic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
}

/// Pull a subscription on a dead-letter topic (one a subscription's dead-letter policy feeds).
/// A message is acknowledged only once its record exists. Credentials default to the pubsub
/// target's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PubsubSourceSpec {
    /// The Google Cloud project of `subscription` (when it is a bare subscription id).
    #[schemars(length(min = 1, max = 64))]
    pub project: String,
    /// A subscription id or `projects/<p>/subscriptions/<s>`.
    #[schemars(length(min = 1, max = 1024))]
    pub subscription: String,
    /// Secret key holding a service-account key (JSON); else the target's, else the pod's
    /// workload identity (ADC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretKeyRef>,
    /// The attribute holding the job id (default: the message id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub job_id_attribute: Option<String>,
}

/// Produce to `topic` (or, with `route: origin`, to the topic a collected record was consumed
/// from) with `acks=all` and an idempotent producer; confirmed once every in-sync replica has it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!self.bootstrapServers.contains('@')").message("kafka bootstrapServers are host:port[,host:port] without credentials (use security.credentialsSecretRef)"))]
pub struct KafkaTargetSpec {
    /// `host:port[,host:port...]`.
    #[schemars(length(min = 1, max = 2048))]
    pub bootstrap_servers: String,
    #[schemars(length(min = 1, max = 249))]
    pub topic: String,
    /// `origin` (default): records collected from a dead-letter topic go back to their original
    /// topic; `target`: always `topic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
    /// Produce to the record's original partition (default false: the key picks it, as it did
    /// for the original producer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_partition: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security: Option<KafkaSecurity>,
}

/// TLS and SASL settings of a Kafka connection; secrets stay in Secrets.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSecurity {
    /// `PLAINTEXT` (default), `SSL`, `SASL_PLAINTEXT` or `SASL_SSL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^(PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL)$"))]
    pub protocol: Option<String>,
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (default `PLAIN` when SASL is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^(PLAIN|SCRAM-SHA-256|SCRAM-SHA-512)$"))]
    pub sasl_mechanism: Option<String>,
    /// A Secret holding `username` and `password` for SASL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<AwsCredentialsRef>,
    /// Secret key holding PEM CA certificates to trust instead of the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

/// Consume dead-letter topics (Spring's `<topic>.DLT`, Kafka Connect's
/// `errors.deadletterqueue.topic.name`) in a consumer group. An offset is committed only once
/// the record exists. Servers and security default to the kafka target's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSourceSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub bootstrap_servers: Option<String>,
    #[schemars(length(min = 1, max = 32))]
    pub topics: Vec<String>,
    /// Consumer group (default `deadletter-operator`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 249))]
    pub group_id: Option<String>,
    /// Where a message that can never be a record (over the payload limit) is copied before
    /// its offset is committed; default `<topic>.rejected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 249))]
    pub rejected_topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security: Option<KafkaSecurity>,
}

/// A key of a Secret in the DeadLetterQueue's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct SecretKeyRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Exactly one broker to collect dead messages from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("[has(self.redis), has(self.amqp), has(self.nats), has(self.sqs), has(self.kafka), has(self.sidekiq), has(self.pubsub)].filter(x, x).size() == 1").message("spec.source needs exactly one broker (redis, amqp, nats, sqs, kafka, sidekiq or pubsub)"))]
pub struct SourceSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amqp: Option<AmqpSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqs: Option<SqsSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidekiq: Option<SidekiqSourceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pubsub: Option<PubsubSourceSpec>,
}

/// Collect Sidekiq's `dead` sorted set (jobs that exhausted their retries): each job's exact
/// JSON becomes a record, and leaves the set only once its record exists.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SidekiqSourceSpec {
    /// Secret key holding the `redis://` URL Sidekiq uses; defaults to the sidekiq target's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    /// The redis-namespace prefix Sidekiq runs under (the set is then `<namespace>:dead`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub namespace: Option<String>,
    /// Only dead jobs of these Sidekiq queues (default: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 255)))]
    pub queues: Vec<String>,
    /// Only dead jobs of these job classes (default: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 255)))]
    pub classes: Vec<String>,
}

/// Drain a Redis list that consumers push dead jobs onto (see docs/backends.md, "Source: the dead-list envelope").
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RedisSourceSpec {
    /// Defaults to the target's URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    #[schemars(length(min = 1, max = 512))]
    pub list: String,
}

/// Consume a RabbitMQ queue fed by a dead-letter exchange; `x-death` gives deliveries, reason
/// and origin. Messages are acknowledged only once their record exists.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AmqpSourceSpec {
    /// Defaults to the amqp target's URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    #[schemars(length(min = 1, max = 255))]
    pub queue: String,
}

/// What the NATS bridge does with a stream message once its record exists.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "camelCase")]
pub enum OnParked {
    /// Delete it from the stream (the record holds it now).
    #[default]
    Delete,
    /// Leave it in the stream, e.g. a limits-based stream other consumers still read.
    Keep,
}

/// Collect messages a JetStream consumer gave up on (MAX_DELIVERIES advisories).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("!(has(self.url) && has(self.urlSecretRef))").message("nats source takes at most one of url and urlSecretRef"),
    validation = kube::core::Rule::new("!has(self.url) || !self.url.contains('@')").message("credentials belong in a Secret: use urlSecretRef for a URL with a user, password or token"),
)]
pub struct NatsSourceSpec {
    /// Defaults to the nats target's server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    #[schemars(length(min = 1, max = 255))]
    pub stream: String,
    /// The durable consumer whose MaxDeliver the jobs exceeded.
    #[schemars(length(min = 1, max = 255))]
    pub consumer: String,
    /// `delete` (default) removes the message from the stream after parking; `keep` leaves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_parked: Option<OnParked>,
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

/// The CRDs as YAML documents, as `deadletter-operator crds` prints them and `crds/` holds them.
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    use kube_core::CustomResourceExt;
    Ok(format!(
        "---\n{}---\n{}---\n{}---\n{}",
        serde_yaml::to_string(&DeadLetter::crd())?,
        serde_yaml::to_string(&queue_crd())?,
        serde_yaml::to_string(&crate::replay::DeadLetterReplay::crd())?,
        serde_yaml::to_string(&crate::groups::DeadLetterGroup::crd())?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_from_bytes_keep_text_as_text_and_bytes_as_base64() {
        let text = Job::from_bytes("a", "héllo".as_bytes());
        assert_eq!(text.payload.as_deref(), Some("héllo"));
        assert_eq!(text.payload_base64, None);
        let raw = [0xff, 0x00, 0x80];
        let bin = Job::from_bytes("b", &raw);
        assert_eq!(bin.payload, None);
        assert_eq!(bin.payload_bytes().expect("base64"), raw);
        assert_eq!(Job::from_bytes("c", b"").payload.as_deref(), Some(""));
    }

    #[test]
    fn the_idempotency_key_header_has_a_default_and_can_be_turned_off() {
        let mut target = TargetSpec::default();
        assert_eq!(target.idempotency_key_header(), Some("Idempotency-Key"));
        target.idempotency_key_header = Some("X-Dedupe".into());
        assert_eq!(target.idempotency_key_header(), Some("X-Dedupe"));
        target.idempotency_key_header = Some(String::new());
        assert_eq!(target.idempotency_key_header(), None);
    }
}
