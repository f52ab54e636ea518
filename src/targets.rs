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

use crate::api::{DeadLetterQueue, SecretKeyRef};
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
        let (url, secret_version) = match &queue.spec.target.redis {
            Some(redis) => read_secret(&self.client, &ns, &redis.url_secret_ref).await?,
            None => return Err(QueueError::Config("spec.target names no backend".into())),
        };
        let secret_hash = hash(&(secret_version, &url));
        let mut entries = self.entries.lock().await;
        if let Some(e) = entries.get_mut(&key)
            && e.spec_hash == spec_hash
            && e.secret_hash == secret_hash
        {
            e.checked = Instant::now();
            return Ok(e.target.clone());
        }
        let target = build(queue, &url)?;
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

fn build(queue: &DeadLetterQueue, url: &str) -> Result<Arc<dyn Target>, QueueError> {
    if let Some(redis) = &queue.spec.target.redis {
        let key = match (&redis.list, &redis.stream) {
            (Some(list), None) => RedisKey::List(list.clone()),
            (None, Some(stream)) => RedisKey::Stream(stream.clone()),
            _ => {
                return Err(QueueError::Config(
                    "redis target needs exactly one of list or stream".into(),
                ));
            }
        };
        return Ok(Arc::new(RedisTarget::new(url, key)?));
    }
    Err(QueueError::Config("spec.target names no backend".into()))
}
