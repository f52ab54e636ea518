//! Builds a DeadLetterQueue's [`BodyStore`] from `spec.bodies` and its Secret, and keeps it
//! (its HTTP client and connections) between parks and redrives; a changed spec or Secret gets
//! a new one.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use kube::{Client, ResourceExt};
use object_store::ObjectStore;
use tokio::sync::Mutex;

use dlq_core::api::{BodiesSpec, DeadLetterQueue, SecretKeyRef};

use super::{Bodies, BodyError, BodyStore, Pending};
use crate::secret::{SecretError, read_secret};

/// How long a cached store is trusted before its Secret is read again.
const SECRET_TTL: Duration = Duration::from_secs(30);

struct Entry {
    hash: u64,
    checked: Instant,
    store: Arc<BodyStore>,
}

/// The operator's [`Bodies`]: one store per queue, rebuilt when its spec or Secret changes.
pub struct BodyCache {
    client: Client,
    entries: Mutex<HashMap<(String, String), Entry>>,
    /// The parks waiting with a body, shared by every queue's store: a place may be spelled two
    /// ways (`BodiesSpec::location`), so each sweep keeps what any park is waiting with.
    pending: Pending,
}

impl BodyCache {
    pub fn new(client: Client) -> Self {
        BodyCache {
            client,
            entries: Mutex::new(HashMap::new()),
            pending: Pending::default(),
        }
    }

    async fn get(&self, queue: &DeadLetterQueue) -> Result<Option<Arc<BodyStore>>, BodyError> {
        let Some(spec) = &queue.spec.bodies else {
            return Ok(None);
        };
        let ns = queue.namespace().unwrap_or_default();
        let key = (ns.clone(), queue.name_any());
        let spec_hash = hash(&serde_json::to_string(spec).unwrap_or_default());
        {
            let entries = self.entries.lock().await;
            if let Some(e) = entries.get(&key)
                && e.hash == spec_hash
                && e.checked.elapsed() < SECRET_TTL
            {
                return Ok(Some(e.store.clone()));
            }
        }
        let secrets = read_credentials(&self.client, &ns, spec).await?;
        let hash = hash(&(spec_hash, &secrets));
        let mut entries = self.entries.lock().await;
        if let Some(e) = entries.get_mut(&key)
            && e.hash == hash
        {
            e.checked = Instant::now();
            return Ok(Some(e.store.clone()));
        }
        let mut store =
            BodyStore::new(build(spec, &secrets)?, spec.clone()).with_pending(self.pending.clone());
        if spec.s3.is_some() {
            // SQS Extended Client objects live in the producer's bucket on the same endpoint.
            let (spec, secrets) = (spec.clone(), secrets.clone());
            store = store.with_buckets(Arc::new(move |bucket: &str| {
                let mut other = spec.clone();
                if let Some(s3) = other.s3.as_mut() {
                    s3.bucket = bucket.to_string();
                }
                build(&other, &secrets)
            }));
        }
        let store = Arc::new(store);
        entries.insert(
            key,
            Entry {
                hash,
                checked: Instant::now(),
                store: store.clone(),
            },
        );
        Ok(Some(store))
    }
}

impl Bodies for BodyCache {
    fn store<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Option<Arc<BodyStore>>, BodyError>> {
        Box::pin(self.get(queue))
    }
}

fn hash<T: Hash>(value: &T) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The credentials' Secret keys each backend reads (none: the platform's default chain).
fn credential_keys(spec: &BodiesSpec) -> (Option<&str>, &'static [&'static str]) {
    match (&spec.s3, &spec.gcs, &spec.azure) {
        (Some(s), _, _) => (
            s.credentials_secret_ref.as_ref().map(|r| r.name.as_str()),
            &["accessKeyId", "secretAccessKey", "sessionToken"],
        ),
        (_, Some(g), _) => (
            g.credentials_secret_ref.as_ref().map(|r| r.name.as_str()),
            &["serviceAccountKey"],
        ),
        (_, _, Some(a)) => (
            a.credentials_secret_ref.as_ref().map(|r| r.name.as_str()),
            &["accessKey"],
        ),
        _ => (None, &[]),
    }
}

/// The store's credentials from its Secret: key → value (optional keys may be absent).
async fn read_credentials(
    client: &Client,
    namespace: &str,
    spec: &BodiesSpec,
) -> Result<Vec<(String, String)>, BodyError> {
    let (Some(name), keys) = credential_keys(spec) else {
        return Ok(Vec::new());
    };
    let mut found = Vec::new();
    for key in keys {
        let r = SecretKeyRef {
            name: name.to_string(),
            key: key.to_string(),
        };
        match read_secret(client, namespace, &r).await {
            Ok((value, _)) => found.push((key.to_string(), value)),
            Err(SecretError::NoKey { .. }) if *key == "sessionToken" => {}
            Err(e) => return Err(BodyError::Config(e.to_string())),
        }
    }
    Ok(found)
}

#[cfg(feature = "object-stores")]
fn secret<'a>(secrets: &'a [(String, String)], key: &str) -> Option<&'a str> {
    secrets
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The object store `spec` names, with `secrets` (else the platform's default credentials).
fn build(
    spec: &BodiesSpec,
    secrets: &[(String, String)],
) -> Result<Arc<dyn ObjectStore>, BodyError> {
    if let Some(volume) = &spec.volume {
        std::fs::create_dir_all(&volume.path)
            .map_err(|e| BodyError::Config(format!("volume path {}: {e}", volume.path)))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(&volume.path)
            .map_err(|e| BodyError::Config(e.to_string()))?;
        return Ok(Arc::new(fs));
    }
    cloud(spec, secrets)
}

#[cfg(feature = "object-stores")]
fn cloud(
    spec: &BodiesSpec,
    secrets: &[(String, String)],
) -> Result<Arc<dyn ObjectStore>, BodyError> {
    use object_store::aws::AmazonS3Builder;
    use object_store::azure::MicrosoftAzureBuilder;
    use object_store::gcp::GoogleCloudStorageBuilder;
    let config = |e: object_store::Error| BodyError::Config(e.to_string());
    if let Some(s3) = &spec.s3 {
        let mut b = AmazonS3Builder::from_env().with_bucket_name(&s3.bucket);
        if let Some(region) = &s3.region {
            b = b.with_region(region);
        }
        if let Some(endpoint) = &s3.endpoint {
            b = b
                .with_endpoint(endpoint.trim_end_matches('/'))
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if let (Some(id), Some(key)) = (
            secret(secrets, "accessKeyId"),
            secret(secrets, "secretAccessKey"),
        ) {
            b = b.with_access_key_id(id).with_secret_access_key(key);
            if let Some(token) = secret(secrets, "sessionToken") {
                b = b.with_token(token);
            }
        }
        return Ok(Arc::new(b.build().map_err(config)?));
    }
    if let Some(gcs) = &spec.gcs {
        let mut b = GoogleCloudStorageBuilder::from_env().with_bucket_name(&gcs.bucket);
        if let Some(key) = secret(secrets, "serviceAccountKey") {
            b = b.with_service_account_key(key);
        }
        return Ok(Arc::new(b.build().map_err(config)?));
    }
    if let Some(azure) = &spec.azure {
        let mut b = MicrosoftAzureBuilder::from_env()
            .with_account(&azure.account)
            .with_container_name(&azure.container);
        if let Some(key) = secret(secrets, "accessKey") {
            b = b.with_access_key(key);
        }
        return Ok(Arc::new(b.build().map_err(config)?));
    }
    Err(BodyError::Config(
        "spec.bodies names no store (s3, gcs, azure or volume)".into(),
    ))
}

#[cfg(not(feature = "object-stores"))]
fn cloud(_: &BodiesSpec, _: &[(String, String)]) -> Result<Arc<dyn ObjectStore>, BodyError> {
    Err(BodyError::Config(
        "this operator was built without the object-stores feature: only spec.bodies.volume works"
            .into(),
    ))
}
