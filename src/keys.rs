//! The queues' sealing keys: the age identities named by `spec.protection.seal` (`identitySecretRef`, or `keys` while rotating), read from
//! their Secrets into a [`Keyring`] (`dlq_core::seal`). Errors and logs name the Secret and
//! key, never the value; a [`Keyring`]'s `Debug` shows recipients only.
//!
//! The reveal API loads a queue's keys with [`load`] and opens a record through
//! `crate::body::payload`, as the redrive does.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use kube::{Client, ResourceExt};

use dlq_core::api::{DeadLetterQueue, SealKeyRef, SecretKeyRef};
use dlq_core::seal::Keyring;

use crate::secret::read_secret;

/// A queue's keys as read: the identities that could be read, in the queue's order, and why
/// the others could not (Secret and key named, never a value).
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub keyring: Keyring,
    /// One line per key that could not be read.
    pub problems: Vec<String>,
    /// Whether the first key (the one new records are sealed to) was read.
    pub current_read: bool,
}

impl Loaded {
    /// The recipients to count in `status.protection.records`, the first published as
    /// `status.protection.recipient`: none while the first key cannot be read, so parkers wait
    /// instead of sealing to a key being retired.
    pub fn published(&self) -> Vec<String> {
        if self.current_read {
            self.keyring.recipients()
        } else {
            Vec::new()
        }
    }
}

/// Gives a DeadLetterQueue's keys. The operator's is [`SecretKeys`]; tests give fakes.
pub trait Keys: Send + Sync {
    fn load<'a>(&'a self, queue: &'a DeadLetterQueue) -> BoxFuture<'a, Loaded>;
}

/// Reads a queue's key Secrets at most once per [`KEYS_REUSE`] for the same list of keys, so a
/// bulk redrive of sealed records does not read them once per record; a changed list of keys
/// is read at once, a changed Secret within [`KEYS_REUSE`].
pub struct SecretKeys {
    client: Client,
    read: Mutex<HashMap<(String, String), KeysRead>>,
}

/// When a queue's keys were read, which keys, and what was read.
type KeysRead = (Instant, Vec<SealKeyRef>, Loaded);

/// How long [`SecretKeys`] reuses what it read.
pub const KEYS_REUSE: Duration = Duration::from_secs(2);

impl SecretKeys {
    pub fn new(client: Client) -> Self {
        SecretKeys {
            client,
            read: Mutex::default(),
        }
    }

    fn reuse(&self, key: &(String, String), refs: &[SealKeyRef]) -> Option<Loaded> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let (at, keys, loaded) = read.get(key)?;
        (at.elapsed() < KEYS_REUSE && keys.as_slice() == refs).then(|| loaded.clone())
    }

    async fn load_reusing(&self, queue: &DeadLetterQueue) -> Loaded {
        let key = (queue.namespace().unwrap_or_default(), queue.name_any());
        let refs = key_refs(queue);
        if let Some(loaded) = self.reuse(&key, refs) {
            return loaded;
        }
        let loaded = load(&self.client, queue).await;
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        read.retain(|_, (at, _, _)| at.elapsed() < KEYS_REUSE);
        read.insert(key, (Instant::now(), refs.to_vec(), loaded.clone()));
        loaded
    }
}

impl Keys for SecretKeys {
    fn load<'a>(&'a self, queue: &'a DeadLetterQueue) -> BoxFuture<'a, Loaded> {
        Box::pin(self.load_reusing(queue))
    }
}

/// The queue's identities (`spec.protection.seal`: `identitySecretRef` or `keys`).
fn key_refs(queue: &DeadLetterQueue) -> &[SealKeyRef] {
    queue
        .spec
        .protection
        .as_ref()
        .and_then(|p| p.seal.as_ref())
        .map(|s| s.key_refs())
        .unwrap_or_default()
}

/// No keys at all: every sealed record is refused as `SealKeyMissing` (in-process tests).
pub struct NoKeys;

impl Keys for NoKeys {
    fn load<'a>(&'a self, _queue: &'a DeadLetterQueue) -> BoxFuture<'a, Loaded> {
        Box::pin(async { Loaded::default() })
    }
}

/// Reads the queue's keys (`spec.protection.seal`) from their Secrets in the queue's
/// namespace. A queue without sealing has none.
pub async fn load(client: &Client, queue: &DeadLetterQueue) -> Loaded {
    let namespace = queue.namespace().unwrap_or_default();
    let refs = key_refs(queue);
    let mut loaded = Loaded::default();
    for (i, key) in refs.iter().enumerate() {
        let r = SecretKeyRef {
            name: key.name.clone(),
            key: key.key().to_string(),
        };
        let read = match read_secret(client, &namespace, &r).await {
            Ok((identity, _version)) => loaded
                .keyring
                .add(&identity)
                .map_err(|e| format!("secret {} key {}: {e}", r.name, r.key)),
            Err(e) => Err(e.to_string()),
        };
        match read {
            Ok(_) if i == 0 => loaded.current_read = true,
            Ok(_) => {}
            Err(problem) => {
                tracing::warn!(namespace = %namespace, queue = %queue.name_any(), secret = %r.name, key = %r.key, problem = %problem, "a sealing key cannot be read");
                loaded.problems.push(problem);
            }
        }
    }
    loaded
}
