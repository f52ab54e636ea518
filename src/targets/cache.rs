//! Builds a DeadLetterQueue's [`Target`] from its spec and Secret, and keeps it (and its broker
//! connection) between redrives: connecting per record would make the broker handshake the
//! bottleneck of a bulk replay. A changed queue gets a new target (the old connection closes
//! when its last redrive ends); a deleted queue's target is dropped by [`TargetCache::prune`].

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use tokio::sync::Mutex;

use dlq_core::api::{BodiesSpec, DeadLetterQueue, DeadLetterQueueSpec, TargetSpec};

use crate::broker::backend::{Sides, TargetBackend, Unserved};
#[cfg(feature = "kafka")]
use crate::broker::kafka::{KafkaConn, SaslCredentials};
#[cfg(feature = "pubsub")]
use crate::broker::pubsub::PubsubConn;
#[cfg(feature = "sqs")]
use crate::broker::sqs::AwsKeys;
use crate::broker::{amqp, nats, redis};
use crate::secret::SecretReads;
use crate::targets::amqp::AmqpTarget;
use crate::targets::http::HttpTarget;
#[cfg(feature = "kafka")]
use crate::targets::kafka::KafkaTarget;
use crate::targets::nats::NatsTarget;
#[cfg(feature = "pubsub")]
use crate::targets::pubsub::PubsubTarget;
use crate::targets::redis::{RedisKey, RedisTarget};
use crate::targets::sidekiq::SidekiqTarget;
#[cfg(feature = "sqs")]
use crate::targets::sqs::SqsTarget;
use crate::targets::{Target, TargetError, Targets};

/// How long a cached target is trusted before its Secret is read again.
const SECRET_TTL: Duration = Duration::from_secs(30);

struct Entry {
    spec_hash: u64,
    secret_hash: u64,
    checked: Instant,
    target: Arc<dyn Target>,
}

pub struct TargetCache {
    client: Client,
    entries: Mutex<HashMap<(String, String), Entry>>,
}

impl TargetCache {
    pub fn new(client: Client) -> Self {
        TargetCache {
            client,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Drops the targets (and so the connections) of queues no longer in `queues`.
    pub async fn prune(&self, queues: &Store<DeadLetterQueue>) {
        self.entries.lock().await.retain(|(ns, name), _| {
            let keep = queues.get(&ObjectRef::new(name).within(ns)).is_some();
            if !keep {
                tracing::info!(namespace = %ns, queue = %name, "closing the target of a deleted DeadLetterQueue");
            }
            keep
        });
    }

    /// The target of `queue`, reusing the cached one while its spec and Secret are unchanged.
    pub async fn get(&self, queue: &DeadLetterQueue) -> Result<Arc<dyn Target>, TargetError> {
        let ns = queue.namespace().unwrap_or_default();
        let key = (ns.clone(), queue.name_any());
        // A sidekiq target may take its URL from the sidekiq source.
        let sidekiq_source = queue.spec.source.as_ref().and_then(|s| s.sidekiq.as_ref());
        // The Kafka target sizes its producer by the body store's maxBytes.
        let max_body = queue.spec.bodies.as_ref().map(|b| b.max());
        let spec_hash = hash(
            &serde_json::to_string(&(&queue.spec.target, sidekiq_source, max_body))
                .unwrap_or_default(),
        );
        {
            let entries = self.entries.lock().await;
            if let Some(e) = entries.get(&key)
                && e.spec_hash == spec_hash
                && e.checked.elapsed() < SECRET_TTL
            {
                return Ok(e.target.clone());
            }
        }
        let secrets = read_target_secrets(&self.client, &ns, &queue.spec).await?;
        let secret_hash = hash(&secrets);
        let mut entries = self.entries.lock().await;
        if let Some(e) = entries.get_mut(&key)
            && e.spec_hash == spec_hash
            && e.secret_hash == secret_hash
        {
            e.checked = Instant::now();
            return Ok(e.target.clone());
        }
        let target = build(&queue.spec.target, queue.spec.bodies.as_ref(), &secrets)?;
        entries.insert(
            key,
            Entry {
                spec_hash,
                secret_hash,
                checked: Instant::now(),
                target: target.clone(),
            },
        );
        Ok(target)
    }
}

fn hash<T: Hash>(v: &T) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

impl Targets for TargetCache {
    fn target<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Arc<dyn Target>, TargetError>> {
        self.get(queue).boxed()
    }
}

/// What a target reads from Secrets; hashed (never shown) to notice a rotated Secret. No
/// `Debug`, so it cannot end up in a log line.
#[derive(Default, Hash)]
pub struct TargetSecrets {
    /// The broker URL (from a Secret, or the spec's plain `url` for NATS).
    pub url: Option<String>,
    /// HTTP bearer token.
    pub token: Option<String>,
    /// HTTP CA bundle (PEM).
    pub ca: Option<String>,
    /// SQS static keys (else the default AWS chain).
    #[cfg(feature = "sqs")]
    pub aws: Option<AwsKeys>,
    /// Kafka SASL user and password.
    #[cfg(feature = "kafka")]
    pub sasl: Option<SaslCredentials>,
    /// Pub/Sub service-account key (JSON; else the pod's workload identity).
    #[cfg(feature = "pubsub")]
    pub google_key: Option<String>,
    versions: Vec<String>,
}

/// Reads every Secret the queue's target names, through its backend's rules in
/// `crate::broker` (a Sidekiq or Pub/Sub target may take its source's).
pub async fn read_target_secrets(
    client: &Client,
    namespace: &str,
    spec: &DeadLetterQueueSpec,
) -> Result<TargetSecrets, TargetError> {
    let mut reads = SecretReads::new(client, namespace);
    let mut s = TargetSecrets::default();
    read_backend(&mut reads, spec, &mut s).await?;
    s.versions = reads.versions().to_vec();
    Ok(s)
}

/// Fills `s` from the Secrets of the backend `spec.target` names.
async fn read_backend(
    reads: &mut SecretReads<'_>,
    spec: &DeadLetterQueueSpec,
    s: &mut TargetSecrets,
) -> Result<(), TargetError> {
    match backend_of(&spec.target)? {
        TargetBackend::Redis(t) => s.url = Some(redis::target_url(reads, t).await?),
        TargetBackend::Amqp(t) => s.url = Some(amqp::target_url(reads, t).await?),
        TargetBackend::Sidekiq(t) => {
            s.url = Some(redis::sidekiq_target_url(reads, Sides::of(t, spec)).await?);
        }
        TargetBackend::Nats(t) => s.url = Some(nats::target_url(reads, t).await?),
        TargetBackend::Http(t) => (s.token, s.ca) = HttpTarget::secrets(reads, t).await?,
        #[cfg(feature = "sqs")]
        TargetBackend::Sqs(t) => s.aws = crate::broker::sqs::target_keys(reads, t).await?,
        #[cfg(feature = "kafka")]
        TargetBackend::Kafka(t) => {
            let security = t.security.as_ref();
            (s.sasl, s.ca) = crate::broker::kafka::read_kafka_secrets(reads, security)
                .await
                .map_err(crate::broker::backend::ConnectError::from)?;
        }
        #[cfg(feature = "pubsub")]
        TargetBackend::Pubsub(t) => {
            let conn = PubsubConn::read(reads, Sides::of(t, spec)).await?;
            s.google_key = conn.key;
        }
    }
    Ok(())
}

/// The backend `target` names, when this build serves it.
fn backend_of(target: &TargetSpec) -> Result<TargetBackend<'_>, TargetError> {
    TargetBackend::of(target).map_err(|why| match why {
        Unserved::Unnamed => TargetError::Config("spec.target names no backend".into()),
        Unserved::NotBuilt(backend) => TargetError::Config(crate::broker::not_built(backend)),
    })
}

/// The target `target` names; `bodies` is the queue's body store, whose `maxBytes` the Kafka
/// producer is sized for.
#[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
fn build(
    target: &TargetSpec,
    bodies: Option<&BodiesSpec>,
    secrets: &TargetSecrets,
) -> Result<Arc<dyn Target>, TargetError> {
    let url = || {
        secrets
            .url
            .as_deref()
            .ok_or_else(|| TargetError::Config("the target's URL is missing".into()))
    };
    Ok(match backend_of(target)? {
        TargetBackend::Redis(redis) => {
            let key = match (&redis.list, &redis.stream) {
                (Some(list), None) => RedisKey::List(list.clone()),
                (None, Some(stream)) => RedisKey::Stream(stream.clone()),
                _ => {
                    return Err(TargetError::Config(
                        "redis target needs exactly one of list or stream".into(),
                    ));
                }
            };
            Arc::new(RedisTarget::new(url()?, key)?)
        }
        TargetBackend::Amqp(amqp) => Arc::new(AmqpTarget::new(amqp, url()?)?),
        TargetBackend::Sidekiq(sidekiq) => {
            Arc::new(SidekiqTarget::new(url()?, sidekiq.namespace.as_deref())?)
        }
        TargetBackend::Nats(nats) => Arc::new(NatsTarget::new(nats, url()?)?),
        TargetBackend::Http(http) => Arc::new(HttpTarget::new(
            &http.url,
            secrets.token.as_deref(),
            secrets.ca.as_deref(),
        )?),
        #[cfg(feature = "sqs")]
        TargetBackend::Sqs(sqs) => Arc::new(SqsTarget::new(sqs, secrets.aws.clone())),
        #[cfg(feature = "kafka")]
        TargetBackend::Kafka(kafka) => {
            let conn = KafkaConn::new(
                &kafka.bootstrap_servers,
                kafka.security.as_ref(),
                secrets.sasl.clone(),
                secrets.ca.clone(),
            )
            .with_bodies(bodies);
            Arc::new(KafkaTarget::new(kafka, conn))
        }
        #[cfg(feature = "pubsub")]
        TargetBackend::Pubsub(pubsub) => {
            Arc::new(PubsubTarget::new(pubsub, secrets.google_key.clone()))
        }
    })
}

#[cfg(all(test, not(all(feature = "kafka", feature = "sqs", feature = "pubsub"))))]
mod not_built_tests {
    use super::*;

    /// A build without a backend refuses a target naming it, and says which feature it lacks.
    #[test]
    fn a_target_whose_backend_was_not_built_names_the_feature() {
        let specs = [
            #[cfg(not(feature = "kafka"))]
            (
                "kafka",
                serde_json::json!({"kafka": {"bootstrapServers": "k:9092", "topic": "t"}}),
            ),
            #[cfg(not(feature = "sqs"))]
            (
                "sqs",
                serde_json::json!({"sqs": {"queueUrl": "http://127.0.0.1:9324/1/q"}}),
            ),
            #[cfg(not(feature = "pubsub"))]
            (
                "pubsub",
                serde_json::json!({"pubsub": {"project": "p", "topic": "t"}}),
            ),
        ];
        for (backend, spec) in specs {
            let spec: TargetSpec = serde_json::from_value(spec).expect("target spec");
            let err = build(&spec, None, &TargetSecrets::default())
                .err()
                .expect("refused");
            assert_eq!(err.reason(), "TargetMisconfigured");
            assert!(
                err.to_string()
                    .contains(&format!("cargo feature `{backend}`")),
                "{err}"
            );
        }
    }
}
