//! The body store: dead messages too large for a record kept in an object store (S3, GCS,
//! Azure Blob) or on a volume, per queue (`spec.bodies`). [`BodyStore`] puts, fetches (checked
//! against the record's size and digest while it streams in) and sweeps; [`Bodies`] gives a
//! queue's store ([`cache::BodyCache`] in the operator, [`NoBodies`] in tests without one).
//! The rules (what goes where, keys, what a sweep deletes) are `dlq_core::body`'s.

pub mod cache;
pub mod open;
pub mod payload;
pub mod sweep;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use dlq_core::api::{BodiesSpec, BodyRef, DeadLetterQueue};
use dlq_core::body::{self, BodyCheck, Stored, Verifier};
use dlq_core::conditions::reason;

/// Bodies above this go up in parts of this size (S3's parts are at least 5 MiB), so no
/// request holds the whole body and a failed part is retried alone.
const PART_BYTES: usize = 8 * 1024 * 1024;

/// Puts `bytes` at `path`: one PUT up to [`PART_BYTES`], parts of that size above (the bench's
/// ceiling puts its objects the same way).
pub async fn put_object(
    store: &dyn ObjectStore,
    path: &Path,
    bytes: Bytes,
) -> Result<(), object_store::Error> {
    if bytes.len() <= PART_BYTES {
        store.put(path, PutPayload::from(bytes)).await?;
        return Ok(());
    }
    let upload = store.put_multipart(path).await?;
    let mut write = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
    let mut offset = 0;
    while offset < bytes.len() {
        let end = (offset + PART_BYTES).min(bytes.len());
        write.put(bytes.slice(offset..end));
        offset = end;
    }
    write.finish().await?;
    Ok(())
}

/// Parts a sealed upload has in flight at once (each [`PART_BYTES`]).
const PARTS_IN_FLIGHT: usize = 2;

/// Plaintext sealed at a time: its ciphertext is written to the part being filled at once.
const SEAL_PIECE: usize = 1024 * 1024;

/// Seals `plain` into `write` a piece at a time, waiting while [`PARTS_IN_FLIGHT`] parts are
/// being sent; the ciphertext's digest and size.
async fn seal_into(
    write: &mut WriteMultipart,
    plain: &[u8],
    job: &str,
    recipient: &str,
) -> Result<(String, u64), BodyError> {
    use sha2::Digest;
    let seal = |e: dlq_core::seal::SealError| BodyError::Seal(e.to_string());
    let mut sealer = dlq_core::seal::BodySealer::new(job, recipient).map_err(seal)?;
    let mut hasher = sha2::Sha256::new();
    let mut size = 0u64;
    for piece in plain.chunks(SEAL_PIECE) {
        sealer.seal(piece).map_err(seal)?;
        let sealed = sealer.take();
        hasher.update(&sealed);
        size += sealed.len() as u64;
        write
            .wait_for_capacity(PARTS_IN_FLIGHT)
            .await
            .map_err(unreachable)?;
        write.write(&sealed);
    }
    let sealed = sealer.finish().map_err(seal)?;
    hasher.update(&sealed);
    size += sealed.len() as u64;
    write.write(&sealed);
    Ok((hex::encode(hasher.finalize()), size))
}

/// A name no other staged upload has: the job's, the time and a count, hashed.
fn staging_name(job: &str) -> String {
    use sha2::Digest;
    static STAGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STAGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let now = jiff::Timestamp::now().as_nanosecond();
    let seed = format!("{job}/{now}/{}/{n}", std::process::id());
    hex::encode(&sha2::Sha256::digest(seed.as_bytes())[..16])
}

/// Why a body could not be kept or read. `reason()` names it on conditions and Events.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    /// The record's object is not in the store (deleted by hand, a lifecycle rule, another
    /// bucket).
    #[error("the body of job {job} is missing from the store: {reference}")]
    Missing { job: String, reference: String },
    /// The object is there but is not the body the record names.
    #[error(transparent)]
    Corrupt(#[from] BodyCheck),
    /// An external reference names an object the queue does not declare (its S3 store's bucket
    /// and prefix, `externalBuckets`): refused before anything is read.
    #[error(
        "the body of job {job} names an object outside the queue's store and its spec.bodies.s3.externalBuckets; not read: {reference}"
    )]
    Outside { job: String, reference: String },
    /// The store did not answer, or refused (credentials, permissions).
    #[error("body store unreachable: {0}")]
    Unreachable(String),
    /// `spec.bodies` cannot be used (a Secret missing, a backend not built in).
    #[error("body store misconfigured: {0}")]
    Config(String),
    /// The job's body could not be sealed or opened.
    #[error("{0}")]
    Seal(String),
    /// The record's body is in a store, but its queue has no `spec.bodies` (any more).
    #[error(
        "job {job} has its body in a store ({reference}), but DeadLetterQueue {queue} has no spec.bodies"
    )]
    NoStore {
        job: String,
        reference: String,
        queue: String,
    },
}

impl BodyError {
    /// Short reason for conditions, Events and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            BodyError::Missing { .. } => reason::BODY_MISSING,
            BodyError::Corrupt(_) => reason::BODY_CORRUPT,
            BodyError::Outside { .. } => reason::BODY_OUTSIDE_STORE,
            BodyError::Unreachable(_) => reason::BODY_STORE_UNREACHABLE,
            BodyError::Config(_) | BodyError::NoStore { .. } => reason::BODY_STORE_MISCONFIGURED,
            BodyError::Seal(_) => reason::BODY_SEAL_BROKEN,
        }
    }
}

fn unreachable(e: object_store::Error) -> BodyError {
    BodyError::Unreachable(e.to_string())
}

/// Opens another bucket of the store's S3 endpoint with the store's credentials: an SQS
/// Extended Client's object lives in the producer's bucket.
pub type OpenBucket = Arc<dyn Fn(&str) -> Result<Arc<dyn ObjectStore>, BodyError> + Send + Sync>;

/// One queue's store: where its objects live and under which prefix.
pub struct BodyStore {
    store: Arc<dyn ObjectStore>,
    spec: BodiesSpec,
    /// Digests of bodies kept whose records are not created yet (a park waiting for room can
    /// wait longer than `orphansAfter`): the sweep keeps them.
    pending: Pending,
    /// How to read other buckets (S3 stores only), and those opened so far.
    open_bucket: Option<OpenBucket>,
    buckets: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

/// Digests of bodies kept whose records are not created yet, with how many parks hold each.
pub type Pending = Arc<Mutex<HashMap<String, usize>>>;

/// A body kept in the store, its record not yet created: while this lives, the sweep keeps the
/// object whatever its age.
pub struct Kept {
    pub body: BodyRef,
    pending: Pending,
}

impl Drop for Kept {
    fn drop(&mut self) {
        let mut pending = lock(&self.pending);
        if let Some(n) = pending.get_mut(&self.body.sha256) {
            *n -= 1;
            if *n == 0 {
                pending.remove(&self.body.sha256);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding it leaves a plain map behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for BodyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BodyStore({}{})",
            self.spec.base_uri(),
            self.spec.prefix()
        )
    }
}

impl BodyStore {
    pub fn new(store: Arc<dyn ObjectStore>, spec: BodiesSpec) -> Self {
        BodyStore {
            store,
            spec,
            pending: Arc::default(),
            open_bucket: None,
            buckets: Mutex::default(),
        }
    }

    /// This store, counting the bodies it keeps for records not yet created in `pending`, the
    /// map of every store of the process: any sweep keeps what a park into any store is waiting
    /// with, since two spellings of one place are two stores.
    pub fn with_pending(mut self, pending: Pending) -> Self {
        self.pending = pending;
        self
    }

    /// This store, able to read external objects in other buckets through `open`.
    pub fn with_buckets(mut self, open: OpenBucket) -> Self {
        self.open_bucket = Some(open);
        self
    }

    pub fn spec(&self) -> &BodiesSpec {
        &self.spec
    }

    /// Keeps `bytes` (already sealed when the queue seals: `recipient`) and returns the
    /// reference its record holds. Always written, even when an object of that digest exists:
    /// the write renews its age, so the sweep cannot take it before its record is created.
    pub async fn put(&self, bytes: Bytes, recipient: Option<&str>) -> Result<Kept, BodyError> {
        let sha256 = body::sha256_hex(&bytes);
        let kept = self.pending_kept(&sha256, bytes.len() as u64, recipient);
        let path = Path::from(body::object_key(&self.spec.prefix(), &sha256));
        put_object(self.store.as_ref(), &path, bytes)
            .await
            .map_err(unreachable)?;
        Ok(kept)
    }

    /// Keeps `plain` sealed to `recipient`, sealing it a piece at a time on its way up (each
    /// part goes as soon as it is sealed), so neither the ciphertext nor the plaintext is held a
    /// second time: at most one part being filled and [`PARTS_IN_FLIGHT`] being sent. Its key is
    /// its ciphertext's digest, known only at the end, so it is written under the store's
    /// staging directory and then moved to its key (a copy in the store, for S3, GCS and
    /// Azure). A body of one part or less is sealed whole, as before.
    pub async fn put_sealed(
        &self,
        plain: Bytes,
        job: &str,
        recipient: &str,
    ) -> Result<Kept, BodyError> {
        let seal = |e: dlq_core::seal::SealError| BodyError::Seal(e.to_string());
        if plain.len() <= PART_BYTES {
            let sealed = dlq_core::seal::seal_body(job, &plain, recipient).map_err(seal)?;
            drop(plain);
            return self.put(Bytes::from(sealed), Some(recipient)).await;
        }
        let staged = Path::from(body::staging_key(&self.spec.prefix(), &staging_name(job)));
        let upload = self
            .store
            .put_multipart(&staged)
            .await
            .map_err(unreachable)?;
        let mut write = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let (sha256, size) = match seal_into(&mut write, &plain, job, recipient).await {
            Ok(sealed) => sealed,
            Err(e) => {
                // Nothing half-written is left behind (an S3 upload's parts are dropped).
                let _ = write.abort().await;
                return Err(e);
            }
        };
        write.finish().await.map_err(unreachable)?;
        let kept = self.pending_kept(&sha256, size, Some(recipient));
        let path = Path::from(body::object_key(&self.spec.prefix(), &sha256));
        self.store
            .rename(&staged, &path)
            .await
            .map_err(unreachable)?;
        Ok(kept)
    }

    /// The guard of the object of digest `sha256` about to be written, counted as pending from
    /// now on so the sweep keeps it.
    fn pending_kept(&self, sha256: &str, size: u64, recipient: Option<&str>) -> Kept {
        *lock(&self.pending).entry(sha256.to_string()).or_default() += 1;
        Kept {
            body: body::body_ref(&self.spec, sha256, size, recipient),
            pending: self.pending.clone(),
        }
    }

    /// Digests of bodies kept by parks still in progress (see [`Kept`]), in every store sharing
    /// this one's map.
    pub fn pending(&self) -> Vec<String> {
        lock(&self.pending).keys().cloned().collect()
    }

    /// The body `want` names, checked while it streams in: its exact bytes, or an error and
    /// nothing. `job` names it in errors.
    pub async fn fetch(&self, job: &str, want: &BodyRef) -> Result<Vec<u8>, BodyError> {
        let (store, key) = self.locate(job, want)?;
        let missing = || BodyError::Missing {
            job: job.to_string(),
            reference: want.reference.clone(),
        };
        let got = match store.get(&key).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Err(missing()),
            Err(e) => return Err(unreachable(e)),
        };
        let mut verifier = Verifier::new(job, want);
        let capacity = usize::try_from(want.size)
            .unwrap_or(0)
            .min(got.meta.size as usize);
        let mut bytes = Vec::with_capacity(capacity);
        let mut stream = got.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(unreachable)?;
            verifier.update(&chunk)?;
            bytes.extend_from_slice(&chunk);
        }
        verifier.finish()?;
        Ok(bytes)
    }

    /// The body `want` names as it streams in, each chunk checked as it comes: an error item
    /// ends it as soon as the object is longer than the record says, and at its end when its
    /// size or digest differ (so a reader sees the error before it could take the bytes as
    /// whole). Holds one chunk at a time. `job` names it in errors.
    pub async fn stream(
        &self,
        job: &str,
        want: &BodyRef,
    ) -> Result<futures::stream::BoxStream<'static, Result<Bytes, BodyError>>, BodyError> {
        let (store, key) = self.locate(job, want)?;
        let got = match store.get(&key).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(BodyError::Missing {
                    job: job.to_string(),
                    reference: want.reference.clone(),
                });
            }
            Err(e) => return Err(unreachable(e)),
        };
        let state = (got.into_stream(), Some(Verifier::new(job, want)));
        let checked = futures::stream::unfold(state, |(mut inner, verifier)| async move {
            let mut verifier = verifier?;
            match inner.next().await {
                Some(Ok(chunk)) => match verifier.update(&chunk) {
                    Ok(()) => Some((Ok(chunk), (inner, Some(verifier)))),
                    Err(e) => Some((Err(BodyError::from(e)), (inner, None))),
                },
                Some(Err(e)) => Some((Err(unreachable(e)), (inner, None))),
                None => match verifier.finish() {
                    Ok(()) => None,
                    Err(e) => Some((Err(BodyError::from(e)), (inner, None))),
                },
            }
        });
        Ok(checked.boxed())
    }

    /// Whether the object `want` names is there with its size and digest, read through and
    /// kept nowhere (an external body: its bytes are not sent, and may be gigabytes).
    pub async fn check(&self, job: &str, want: &BodyRef) -> Result<(), BodyError> {
        let mut chunks = self.stream(job, want).await?;
        while let Some(chunk) = chunks.next().await {
            chunk?;
        }
        Ok(())
    }

    /// The reference of an SQS Extended Client's object (`s3://<bucket>/<key>`): its size and
    /// digest read from the store's endpoint with the store's credentials, `external` so the
    /// object is only ever checked, never written or deleted here.
    pub async fn describe_external(
        &self,
        job: &str,
        reference: &str,
    ) -> Result<BodyRef, BodyError> {
        use sha2::Digest;
        let mut described = BodyRef {
            reference: reference.to_string(),
            external: true,
            ..BodyRef::default()
        };
        let (store, key) = self.locate(job, &described)?;
        let got = match store.get(&key).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(BodyError::Missing {
                    job: job.to_string(),
                    reference: reference.to_string(),
                });
            }
            Err(e) => return Err(unreachable(e)),
        };
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        let mut chunks = got.into_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(unreachable)?;
            size += chunk.len() as u64;
            hasher.update(&chunk);
        }
        described.size = i64::try_from(size).unwrap_or(i64::MAX);
        described.sha256 = hex::encode(hasher.finalize());
        Ok(described)
    }

    /// The store and key of the object `want` names: the queue's own, or for an external
    /// object (an SQS Extended Client pointer's) the bucket its `s3://` URI names, when the queue
    /// allows it (`dlq_core::body::external_object`); decided before anything is read.
    fn locate(&self, job: &str, want: &BodyRef) -> Result<(Arc<dyn ObjectStore>, Path), BodyError> {
        let missing = || BodyError::Missing {
            job: job.to_string(),
            reference: want.reference.clone(),
        };
        if want.external {
            let (bucket, key) =
                body::external_object(&self.spec, &want.reference).ok_or_else(|| {
                    BodyError::Outside {
                        job: job.to_string(),
                        reference: want.reference.clone(),
                    }
                })?;
            return Ok((self.bucket(bucket)?, Path::from(key)));
        }
        let key = body::key_of_body(&self.spec, want).ok_or_else(missing)?;
        Ok((self.store.clone(), Path::from(key)))
    }

    /// Bucket `name` of the store's S3 endpoint, with the store's credentials.
    fn bucket(&self, name: &str) -> Result<Arc<dyn ObjectStore>, BodyError> {
        if self.spec.s3.as_ref().is_some_and(|s| s.bucket == name) {
            return Ok(self.store.clone());
        }
        let open = self.open_bucket.as_ref().ok_or_else(|| {
            BodyError::Config(format!(
                "bucket {name} is outside this body store, and only an S3 store reads others"
            ))
        })?;
        let mut buckets = lock(&self.buckets);
        if let Some(store) = buckets.get(name) {
            return Ok(store.clone());
        }
        let store = open(name)?;
        buckets.insert(name.to_string(), store.clone());
        Ok(store)
    }

    /// Every object under the store's prefix with its age.
    pub async fn list(&self) -> Result<Vec<Stored>, BodyError> {
        let prefix = self.spec.prefix();
        let now = jiff::Timestamp::now().as_second();
        let mut stored = Vec::new();
        for dir in [body::OBJECTS_DIR, body::STAGING_DIR] {
            let under = Path::from(format!("{prefix}{dir}"));
            let mut listed = self.store.list(Some(&under));
            while let Some(meta) = listed.next().await {
                let meta = meta.map_err(unreachable)?;
                stored.push(Stored {
                    key: meta.location.to_string(),
                    age_secs: now - meta.last_modified.timestamp(),
                });
            }
        }
        Ok(stored)
    }

    pub async fn delete(&self, key: &str) -> Result<(), BodyError> {
        match self.store.delete(&Path::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(unreachable(e)),
        }
    }
}

/// Gives a DeadLetterQueue's body store. The operator's is [`cache::BodyCache`].
pub trait Bodies: Send + Sync {
    /// The store of `queue`; None when it has no `spec.bodies`.
    fn store<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Option<Arc<BodyStore>>, BodyError>>;
}

/// A fresh age identity as a queue's keyring, and its recipient (in-process tests of sealed
/// bodies).
#[cfg(test)]
pub fn test_keys() -> (dlq_core::seal::Keyring, String) {
    let (file, recipient) = dlq_core::seal::generate_identity();
    let mut keys = dlq_core::seal::Keyring::default();
    keys.add(&file).expect("a key");
    (keys, recipient)
}

/// Every queue's store one in memory (in-process tests of what keeps and reads bodies).
#[cfg(test)]
pub struct InMemory {
    pub store: Arc<BodyStore>,
}

#[cfg(test)]
impl InMemory {
    /// A volume-shaped store in memory, and its `spec.bodies`.
    pub fn new() -> (Arc<InMemory>, BodiesSpec) {
        let spec = BodiesSpec {
            volume: Some(dlq_core::api::VolumeBodies {
                path: "/bodies".into(),
            }),
            ..BodiesSpec::default()
        };
        let memory = Arc::new(object_store::memory::InMemory::new());
        let store = Arc::new(BodyStore::new(memory, spec.clone()));
        (Arc::new(InMemory { store }), spec)
    }
}

#[cfg(test)]
impl Bodies for InMemory {
    fn store<'a>(
        &'a self,
        _: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Option<Arc<BodyStore>>, BodyError>> {
        let store = self.store.clone();
        Box::pin(async move { Ok(Some(store)) })
    }
}

/// No queue has a store (tests without one; a queue that names one is refused).
pub struct NoBodies;

impl Bodies for NoBodies {
    fn store<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
    ) -> BoxFuture<'a, Result<Option<Arc<BodyStore>>, BodyError>> {
        Box::pin(async move {
            match queue.spec.bodies {
                None => Ok(None),
                Some(_) => Err(BodyError::Config(
                    "this process keeps no body stores".into(),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::VolumeBodies;

    fn volume(dir: &std::path::Path) -> BodyStore {
        std::fs::create_dir_all(dir).expect("a scratch directory");
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir).expect("a directory");
        BodyStore::new(
            Arc::new(fs),
            BodiesSpec {
                volume: Some(VolumeBodies {
                    path: dir.display().to_string(),
                }),
                orphans_after: Some("10s".into()),
                ..BodiesSpec::default()
            },
        )
    }

    /// A sealed body larger than a part is sealed on its way up (staged, then moved to the key
    /// of its ciphertext's digest): it comes back as one age file its key opens to the exact
    /// bytes, and nothing is left staged. A staged upload a crash left behind is swept.
    #[tokio::test]
    async fn a_large_sealed_body_is_sealed_on_its_way_up() {
        let dir = std::env::temp_dir().join(format!("dlq-sealed-{}", std::process::id()));
        let store = volume(&dir);
        let (file, recipient) = dlq_core::seal::generate_identity();
        let mut keys = dlq_core::seal::Keyring::default();
        keys.add(&file).expect("a key");
        let body: Vec<u8> = (0..(20 << 20) + 7).map(|i: u32| (i % 251) as u8).collect();
        let kept = store
            .put_sealed(Bytes::from(body.clone()), "j", &recipient)
            .await
            .expect("kept");
        let reference = kept.body.clone();
        assert_eq!(reference.recipient.as_deref(), Some(recipient.as_str()));
        let sealed = store.fetch("j", &reference).await.expect("fetched");
        assert_eq!(reference.size, sealed.len() as i64);
        assert!(
            !sealed.windows(64).any(|w| w == &body[..64]),
            "ciphertext only"
        );
        let opened = store
            .fetch_opened("j", &reference, &recipient, &keys)
            .await
            .expect("opens");
        assert!(opened == body, "the exact bytes");
        let (head, len) = store
            .head("j", &reference, &keys, 100)
            .await
            .expect("a head");
        assert_eq!((&head[..], len), (&body[..100], body.len() as u64));
        let listed = store.list().await.expect("listed");
        assert_eq!(listed.len(), 1, "nothing left staged: {listed:?}");

        let crashed = dir.join(dlq_core::body::staging_key("", "left-by-a-crash"));
        std::fs::write(&crashed, b"half").expect("a staged upload");
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&crashed)
            .and_then(|f| f.set_modified(hour_ago))
            .expect("aged");
        let referenced = || Some(vec![Box::from(reference.sha256.as_str())]);
        assert_eq!(sweep::sweep(&store, referenced).await.expect("swept"), 1);
        assert!(!crashed.exists());
        drop(kept);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The volume store (a PVC in production) keeps, fetches, checks and sweeps for real on
    /// the file system: a 20 MiB body goes up in parts and comes back exact; a changed or
    /// missing file is refused; a body still being parked is kept by the sweep whatever its age.
    #[tokio::test]
    async fn a_volume_keeps_checks_and_sweeps_bodies() {
        let dir = std::env::temp_dir().join(format!("dlq-bodies-{}", std::process::id()));
        let store = volume(&dir);
        let body: Vec<u8> = (0..20 << 20).map(|i: u32| (i % 251) as u8).collect();
        let kept = store
            .put(Bytes::from(body.clone()), None)
            .await
            .expect("kept");
        let reference = kept.body.clone();
        assert_eq!(reference.size, body.len() as i64);
        assert!(reference.reference.starts_with("volume://sha256/"));
        assert_eq!(store.fetch("j", &reference).await.expect("fetched"), body);

        let path = dir.join(reference.reference.trim_start_matches("volume://"));
        let mut changed = body.clone();
        changed[7] ^= 1;
        std::fs::write(&path, &changed).expect("changed by hand");
        let err = store.fetch("j", &reference).await.expect_err("corrupt");
        assert_eq!(err.reason(), reason::BODY_CORRUPT);
        std::fs::remove_file(&path).expect("deleted by hand");
        let err = store.fetch("j", &reference).await.expect_err("missing");
        assert_eq!(err.reason(), reason::BODY_MISSING);

        // An hour-old object no record names: kept while its park is in progress, swept after.
        let small = store
            .put(Bytes::from_static(b"x"), None)
            .await
            .expect("kept");
        let small_path = dir.join(small.body.reference.trim_start_matches("volume://"));
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&small_path)
            .and_then(|f| f.set_modified(hour_ago))
            .expect("aged");
        let none = || Some(Vec::new());
        assert_eq!(
            sweep::sweep(&store, none).await.expect("swept"),
            0,
            "its park is in progress"
        );
        drop(small);
        assert_eq!(
            sweep::sweep(&store, || None).await.expect("swept"),
            0,
            "nothing deleted without the records' digests"
        );
        assert_eq!(
            sweep::sweep(&store, none).await.expect("swept"),
            1,
            "an orphan"
        );
        assert!(!small_path.exists());
        drop(kept);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
