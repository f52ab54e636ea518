//! The `DeadLetter` kind (`dlq.dev/v1alpha1`): one parked job, the facts it was parked with,
//! and the one decision that resolves it.
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
    validation = kube::core::Rule::new("has(self.sealed) || (has(self.body) && !(has(self.body.external) && self.body.external)) || ((has(self.payloadNull) && self.payloadNull) ? !has(self.payload) && !has(self.payloadBase64) : has(self.payload) != has(self.payloadBase64))").message("exactly one of spec.job.payload, spec.job.payloadBase64, spec.job.payloadNull and spec.job.body must be set"),
    validation = kube::core::Rule::new("!has(self.body) || (has(self.body.external) && self.body.external) || (!has(self.payload) && !has(self.payloadBase64) && !(has(self.payloadNull) && self.payloadNull))").message("a job whose body is in the store holds no payload, payloadBase64 or payloadNull"),
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
    /// The payload kept in the queue's body store (`spec.bodies`) instead of in the record: a
    /// reference and the digest redrive checks before it sends a byte.
    // Boxed: most jobs are inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Box<BodyRef>>,
    /// The job's payload and headers sealed to the queue's age recipient (`dlq_core::seal`),
    /// instead of `payload`/`payloadBase64`/`payloadNull`/`headers`.
    // Boxed: most jobs are not sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<Box<SealedJob>>,
}

/// Where a job's payload is kept when it is too large for a record, and what it must be: the
/// exact bytes are `size` long and hash to `sha256` (of the stored object: the ciphertext when
/// `recipient` is set).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct BodyRef {
    /// `s3://bucket/key`, `gs://bucket/key`, `azure://account/container/key` or `volume://key`.
    #[serde(rename = "ref")]
    #[schemars(length(min = 1, max = 2048))]
    pub reference: String,
    /// Bytes of the stored object.
    #[schemars(range(min = 0))]
    pub size: i64,
    /// Lower-case hex SHA-256 of the stored object.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: String,
    /// The age recipient the object is sealed to (`spec.protection.seal`): the store holds
    /// ciphertext only, opened with that recipient's identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^age1[02-9ac-hj-np-z]+$")
    )]
    pub recipient: Option<String>,
    /// The object belongs to the producer (an SQS Extended Client pointer's S3 object): the
    /// record's payload is the pointer message itself, sent back untouched; this operator checks
    /// the object before a redrive and never deletes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub external: bool,
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
            || self.body.is_some()
    }

    /// The body in the store that holds this job's payload (not an external one, whose
    /// payload is inline).
    pub fn stored_body(&self) -> Option<&BodyRef> {
        self.body.as_deref().filter(|b| !b.external)
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

/// The DeadLetter CRD, whose `status` defaults to `{phase: Parked}`: the operator's mark writes
/// no status, and the apiserver serves a record whose status was never written as Parked (it
/// defaults what it reads from etcd), to `kubectl get`'s PHASE column, `-o yaml`, field
/// selectors and every reader alike. (Here, not in `DeadLetterStatus`'s schema: kube-derive
/// writes the root's `status` property itself.)
pub fn dead_letter_crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON;
    use kube_core::CustomResourceExt;
    let mut crd = DeadLetter::crd();
    for version in &mut crd.spec.versions {
        let status = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|s| s.properties.as_mut())
            .and_then(|p| p.get_mut("status"));
        if let Some(status) = status {
            status.default = Some(JSON(serde_json::json!({})));
            if let Some(phase) = status.properties.as_mut().and_then(|p| p.get_mut("phase")) {
                phase.default = Some(JSON(serde_json::json!(Phase::Parked.as_str())));
            }
        }
    }
    crd
}

impl DeadLetter {
    /// The phase, treating a record without one as Parked (the apiserver defaults it; a copy
    /// built in memory, or the tests' fake apiserver, does not).
    pub fn phase(&self) -> Phase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or(Phase::Parked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crd_serves_an_unwritten_status_as_parked() {
        let crd = serde_json::to_value(dead_letter_crd()).unwrap_or_default();
        let status =
            &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"];
        assert_eq!(status["default"], serde_json::json!({}));
        assert_eq!(status["properties"]["phase"]["default"], "Parked");
    }

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
}
