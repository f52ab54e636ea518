//! Where a queue's dead messages are collected from: at most one broker (`spec.source`).

use kube_derive::KubeSchema;
use serde::{Deserialize, Serialize};

use super::target::{AwsCredentialsRef, KafkaSecurity, SecretKeyRef};

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
    /// This Sidekiq's `dead_max_jobs` (default 10000), where it drops the oldest dead jobs:
    /// above half of it the source moves its oldest dead jobs into a list of its own that
    /// Sidekiq never trims, and parks from there first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub dead_max_jobs: Option<i64>,
}

/// Sidekiq's own default `dead_max_jobs`.
pub const DEFAULT_DEAD_MAX_JOBS: u64 = 10_000;

impl SidekiqSourceSpec {
    /// The size at which this Sidekiq trims its dead set.
    pub fn dead_max_jobs(&self) -> u64 {
        self.dead_max_jobs
            .and_then(|n| u64::try_from(n).ok())
            .filter(|n| *n > 0)
            .unwrap_or(DEFAULT_DEAD_MAX_JOBS)
    }
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
