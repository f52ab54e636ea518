//! The queues' sealing keys: the age identities named by `spec.protection.seal.keys`, read from
//! their Secrets into a [`Keyring`] (`dlq_core::seal`). Errors and logs name the Secret and
//! key, never the value; a [`Keyring`]'s `Debug` shows recipients only.
//!
//! The reveal API loads a queue's keys with [`load`] and opens a record with
//! `dlq_core::seal::open(record, &keyring)`, as the redrive does.

use futures::future::BoxFuture;
use kube::{Client, ResourceExt};

use dlq_core::api::{DeadLetterQueue, SecretKeyRef};
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
    /// The recipients to publish in `status.protection.recipients`: none while the first key
    /// cannot be read, so parkers wait instead of sealing to a key being retired.
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

/// Reads the keys' Secrets on every call (a key removed or rotated takes effect at once).
pub struct SecretKeys {
    client: Client,
}

impl SecretKeys {
    pub fn new(client: Client) -> Self {
        SecretKeys { client }
    }
}

impl Keys for SecretKeys {
    fn load<'a>(&'a self, queue: &'a DeadLetterQueue) -> BoxFuture<'a, Loaded> {
        Box::pin(load(&self.client, queue))
    }
}

/// No keys at all: every sealed record is refused as `SealKeyMissing` (in-process tests).
pub struct NoKeys;

impl Keys for NoKeys {
    fn load<'a>(&'a self, _queue: &'a DeadLetterQueue) -> BoxFuture<'a, Loaded> {
        Box::pin(async { Loaded::default() })
    }
}

/// Reads the queue's keys (`spec.protection.seal.keys`) from their Secrets in the queue's
/// namespace. A queue without sealing has none.
pub async fn load(client: &Client, queue: &DeadLetterQueue) -> Loaded {
    let namespace = queue.namespace().unwrap_or_default();
    let refs = queue
        .spec
        .protection
        .as_ref()
        .and_then(|p| p.seal.as_ref())
        .map(|s| s.keys.as_slice())
        .unwrap_or_default();
    let mut loaded = Loaded::default();
    for (i, key) in refs.iter().enumerate() {
        let r = SecretKeyRef {
            name: key.secret_name.clone(),
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
