//! Where a queue's redriven jobs go: exactly one backend (`spec.target`), and the Secret
//! references a backend's credentials are read from.

use kube_derive::KubeSchema;
use serde::{Deserialize, Serialize};

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

/// A key of a Secret in the DeadLetterQueue's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct SecretKeyRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

#[cfg(test)]
mod tests {
    use super::*;

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
