//! Builds a DeadLetterQueue's [`Target`] from its spec and Secret, and keeps it (and its broker
//! connection) between redrives: connecting per record would make the broker handshake the
//! bottleneck of a bulk replay.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};
use tokio::sync::Mutex;

use crate::api::{DeadLetterQueue, SecretKeyRef, TargetSpec};
use crate::queue::amqp::AmqpTarget;
use crate::queue::http::HttpTarget;
use crate::queue::nats::NatsTarget;
use crate::queue::redis::{RedisKey, RedisTarget};
use crate::queue::{QueueError, Target};

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

    /// The target of `queue`, reusing the cached one while its spec and Secret are unchanged.
    pub async fn get(&self, queue: &DeadLetterQueue) -> Result<Arc<dyn Target>, QueueError> {
        let ns = queue.namespace().unwrap_or_default();
        let key = (ns.clone(), queue.name_any());
        let spec_hash = hash(&serde_json::to_string(&queue.spec.target).unwrap_or_default());
        {
            let entries = self.entries.lock().await;
            if let Some(e) = entries.get(&key)
                && e.spec_hash == spec_hash
                && e.checked.elapsed() < SECRET_TTL
            {
                return Ok(e.target.clone());
            }
        }
        let secrets = read_target_secrets(&self.client, &ns, &queue.spec.target).await?;
        let secret_hash = hash(&secrets);
        let mut entries = self.entries.lock().await;
        if let Some(e) = entries.get_mut(&key)
            && e.spec_hash == spec_hash
            && e.secret_hash == secret_hash
        {
            e.checked = Instant::now();
            return Ok(e.target.clone());
        }
        let target = build(&queue.spec.target, &secrets)?;
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

/// Reads one key of a Secret as trimmed UTF-8, with its resourceVersion. Errors name the Secret
/// and key, never the value.
pub async fn read_secret(
    client: &Client,
    namespace: &str,
    r: &SecretKeyRef,
) -> Result<(String, String), QueueError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = api.get_opt(&r.name).await.map_err(|e| {
        QueueError::Config(format!("reading secret {}: {}", r.name, kube_reason(&e)))
    })?;
    let secret =
        secret.ok_or_else(|| QueueError::Config(format!("secret {} not found", r.name)))?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(|| QueueError::Config(format!("secret {} has no key {}", r.name, r.key)))?;
    let value = String::from_utf8(bytes)
        .map_err(|_| QueueError::Config(format!("secret {} key {} is not UTF-8", r.name, r.key)))?;
    Ok((
        value.trim().to_string(),
        secret.resource_version().unwrap_or_default(),
    ))
}

fn kube_reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.reason, s.code),
        other => other.to_string(),
    }
}

fn hash<T: Hash>(v: &T) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
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
    versions: Vec<String>,
}

/// Reads every Secret `target` names.
pub async fn read_target_secrets(
    client: &Client,
    namespace: &str,
    target: &TargetSpec,
) -> Result<TargetSecrets, QueueError> {
    let mut s = TargetSecrets::default();
    let mut read = async |r: &SecretKeyRef| -> Result<String, QueueError> {
        let (value, version) = read_secret(client, namespace, r).await?;
        s.versions.push(version);
        Ok(value)
    };
    let (mut url, mut token, mut ca) = (None, None, None);
    if let Some(redis) = &target.redis {
        url = Some(read(&redis.url_secret_ref).await?);
    } else if let Some(amqp) = &target.amqp {
        url = Some(read(&amqp.url_secret_ref).await?);
    } else if let Some(nats) = &target.nats {
        url = match (&nats.url, &nats.url_secret_ref) {
            (_, Some(r)) => Some(read(r).await?),
            (Some(plain), None) => Some(plain.clone()),
            (None, None) => {
                return Err(QueueError::Config(
                    "nats target needs url or urlSecretRef".into(),
                ));
            }
        };
    } else if let Some(http) = &target.http {
        if let Some(r) = &http.bearer_token_secret_ref {
            token = Some(read(r).await?);
        }
        if let Some(r) = &http.ca_secret_ref {
            ca = Some(read(r).await?);
        }
    } else {
        return Err(QueueError::Config("spec.target names no backend".into()));
    }
    s.url = url;
    s.token = token;
    s.ca = ca;
    Ok(s)
}

fn build(target: &TargetSpec, secrets: &TargetSecrets) -> Result<Arc<dyn Target>, QueueError> {
    let url = || {
        secrets
            .url
            .as_deref()
            .ok_or_else(|| QueueError::Config("the target's URL is missing".into()))
    };
    if let Some(redis) = &target.redis {
        let key = match (&redis.list, &redis.stream) {
            (Some(list), None) => RedisKey::List(list.clone()),
            (None, Some(stream)) => RedisKey::Stream(stream.clone()),
            _ => {
                return Err(QueueError::Config(
                    "redis target needs exactly one of list or stream".into(),
                ));
            }
        };
        return Ok(Arc::new(RedisTarget::new(url()?, key)?));
    }
    if let Some(amqp) = &target.amqp {
        return Ok(Arc::new(AmqpTarget::new(amqp, url()?)?));
    }
    if let Some(nats) = &target.nats {
        return Ok(Arc::new(NatsTarget::new(nats, url()?)?));
    }
    if let Some(http) = &target.http {
        return Ok(Arc::new(HttpTarget::new(
            &http.url,
            secrets.token.as_deref(),
            secrets.ca.as_deref(),
        )?));
    }
    Err(QueueError::Config("spec.target names no backend".into()))
}
