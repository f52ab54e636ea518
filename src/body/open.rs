//! Sealed stored bodies opened as they stream in from the store (`dlq_core::seal::body_reader`
//! over [`BodyStore::stream`]'s checked chunks): a redrive holds the plaintext it sends and a
//! chunk, a reveal a chunk. The ciphertext is never held whole.

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{AsyncReadExt, StreamExt, TryStreamExt};

use dlq_core::api::BodyRef;
use dlq_core::conditions::reason;
use dlq_core::seal::{self, BodyOpenError, Keyring, OpenError};

use super::{BodyError, BodyStore};

/// Plaintext read at a time from a sealed body as it streams out.
const CHUNK: usize = 64 * 1024;

/// Why a sealed stored body could not be opened: the store's reason (missing, changed,
/// unreachable) or the seal's (no key, damaged).
#[derive(Debug, thiserror::Error)]
pub enum OpenFailed {
    #[error(transparent)]
    Body(BodyError),
    #[error(transparent)]
    Seal(OpenError),
}

impl OpenFailed {
    /// Short reason for conditions and Events: the store's, or the seal's (`SealKeyMissing`,
    /// `SealBroken`).
    pub fn reason(&self) -> &'static str {
        match self {
            OpenFailed::Body(e) => e.reason(),
            OpenFailed::Seal(e) => seal_reason(e),
        }
    }
}

/// The reason of a job that did not open: its key gone, or its ciphertext damaged.
pub fn seal_reason(e: &OpenError) -> &'static str {
    match e {
        OpenError::KeyMissing { .. } => reason::SEAL_KEY_MISSING,
        OpenError::Corrupt { .. } => reason::SEAL_BROKEN,
    }
}

impl From<OpenFailed> for BodyError {
    fn from(e: OpenFailed) -> Self {
        match e {
            OpenFailed::Body(e) => e,
            OpenFailed::Seal(e) => BodyError::Seal(e.to_string()),
        }
    }
}

impl BodyStore {
    /// The plaintext of the body `want` names as it streams in, checked, and opened with
    /// `keyring` when it is sealed: what a reader of the body sees.
    pub async fn plaintext(
        &self,
        job: &str,
        want: &BodyRef,
        keyring: &Keyring,
    ) -> Result<BoxStream<'static, Result<Bytes, BodyError>>, BodyError> {
        let Some(recipient) = &want.recipient else {
            return self.stream(job, want).await;
        };
        let opened = self.open(job, want, recipient, keyring).await?;
        Ok(opened.map_err(BodyError::from).boxed())
    }

    /// The plaintext of the sealed body `want` names as it streams in, a chunk at a time. An
    /// error item ends it (the store's check of size and digest comes at the ciphertext's end,
    /// before the last chunk is handed out).
    pub async fn open(
        &self,
        job: &str,
        want: &BodyRef,
        recipient: &str,
        keyring: &Keyring,
    ) -> Result<BoxStream<'static, Result<Bytes, OpenFailed>>, OpenFailed> {
        let reader = self.reader(job, want, recipient, keyring).await?;
        let named = (job.to_string(), recipient.to_string());
        let chunks = futures::stream::unfold(Some((reader, named)), |state| async move {
            let (mut reader, named) = state?;
            let mut chunk = vec![0; CHUNK];
            match reader.read(&mut chunk).await {
                Ok(0) => None,
                Ok(n) => {
                    chunk.truncate(n);
                    Some((Ok(Bytes::from(chunk)), Some((reader, named))))
                }
                Err(e) => Some((Err(read_failed(&named.0, &named.1, e)), None)),
            }
        });
        Ok(chunks.boxed())
    }

    /// The whole plaintext of the sealed body `want` names, read into one buffer as it streams
    /// in (what a redrive sends): checked and opened, or an error and nothing.
    pub async fn fetch_opened(
        &self,
        job: &str,
        want: &BodyRef,
        recipient: &str,
        keyring: &Keyring,
    ) -> Result<Vec<u8>, OpenFailed> {
        let mut chunks = self.open(job, want, recipient, keyring).await?;
        // The plaintext is shorter than its ciphertext, which the record names (trusted only up
        // to what the queue keeps). Read a chunk at a time: futures' `read_to_end` zeroes its
        // spare room again after every wait, which is quadratic in a large buffer.
        let capacity = u64::try_from(want.size).unwrap_or(0).min(self.spec().max());
        let mut plain = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(chunk) => plain.extend_from_slice(&chunk),
                Err(e) => return Err(self.blame(job, want, e).await),
            }
        }
        Ok(plain)
    }

    /// The first `keep` bytes of the plaintext of the body `want` names and its length, after
    /// reading all of it (so it was checked, and opened, to its end).
    pub async fn head(
        &self,
        job: &str,
        want: &BodyRef,
        keyring: &Keyring,
        keep: usize,
    ) -> Result<(Vec<u8>, u64), BodyError> {
        let Some(recipient) = &want.recipient else {
            return kept_head(self.stream(job, want).await?, keep).await;
        };
        let opened = self.open(job, want, recipient, keyring).await?;
        match kept_head(opened, keep).await {
            Ok(head) => Ok(head),
            Err(e) => Err(self.blame(job, want, e).await.into()),
        }
    }

    /// Why a sealed body did not open, as its record says it: a chunk that does not
    /// authenticate in an object whose size or digest differ from the record's is the store's
    /// fault (`BodyCorrupt`, found by reading it through again, kept nowhere), else the seal's.
    async fn blame(&self, job: &str, want: &BodyRef, failed: OpenFailed) -> OpenFailed {
        if let OpenFailed::Seal(OpenError::Corrupt { .. }) = failed
            && let Err(e) = self.check(job, want).await
        {
            return OpenFailed::Body(e);
        }
        failed
    }

    async fn reader(
        &self,
        job: &str,
        want: &BodyRef,
        recipient: &str,
        keyring: &Keyring,
    ) -> Result<impl futures::AsyncRead + Unpin + Send + 'static, OpenFailed> {
        let sealed = self
            .stream(job, want)
            .await
            .map_err(OpenFailed::Body)?
            .map_err(std::io::Error::other)
            .into_async_read();
        seal::body_reader(job, sealed, recipient, keyring)
            .await
            .map_err(|e| match e {
                BodyOpenError::Open(e) => OpenFailed::Seal(e),
                BodyOpenError::Read(e) => read_failed(job, recipient, e),
            })
    }
}

/// A read error of a sealed body: the store's own error when it is one (it travels through
/// the reader as an `io::Error`), else the seal's (a chunk that does not authenticate).
fn read_failed(job: &str, recipient: &str, e: std::io::Error) -> OpenFailed {
    match e.get_ref().and_then(|e| e.downcast_ref::<BodyError>()) {
        Some(body) => OpenFailed::Body(body.clone()),
        None => OpenFailed::Seal(OpenError::Corrupt {
            job: job.to_string(),
            recipient: recipient.to_string(),
            why: e.to_string(),
        }),
    }
}

/// The first `keep` bytes of a body's `plaintext` and its length.
async fn kept_head<E>(
    mut plaintext: BoxStream<'static, Result<Bytes, E>>,
    keep: usize,
) -> Result<(Vec<u8>, u64), E> {
    let mut head = Vec::with_capacity(keep);
    let mut len = 0u64;
    while let Some(chunk) = plaintext.next().await {
        let chunk = chunk?;
        let room = keep - head.len();
        head.extend_from_slice(&chunk[..chunk.len().min(room)]);
        len += chunk.len() as u64;
    }
    Ok((head, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    /// A sealed body opens to its exact bytes, whole or a chunk at a time. One that does not
    /// open is blamed where the fault is: an object changed in the store (its digest differs
    /// from the record's) is `BodyCorrupt` though its first sign is a chunk that does not
    /// authenticate; an object the record names exactly that does not open is the seal's; a key
    /// gone is `KeyMissing` before anything is read.
    #[tokio::test]
    async fn a_sealed_body_opens_as_it_streams_and_a_failure_is_blamed_where_it_is() {
        let (memory, _) = crate::body::InMemory::new();
        let store = &memory.store;
        let (keys, recipient) = crate::body::test_keys();
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sealed = seal::seal_body("j", &body, &recipient).expect("sealed");
        let kept = store
            .put(Bytes::from(sealed.clone()), Some(&recipient))
            .await
            .expect("kept");
        let want = kept.body.clone();
        let whole = store.fetch_opened("j", &want, &recipient, &keys).await;
        assert!(whole.expect("opens") == body, "the exact bytes");
        let chunks: Vec<Bytes> = store
            .open("j", &want, &recipient, &keys)
            .await
            .expect("opens")
            .try_collect()
            .await
            .expect("every chunk");
        assert!(chunks.iter().all(|c| c.len() <= CHUNK));
        assert!(
            chunks.concat() == body,
            "the exact bytes, a chunk at a time"
        );

        let (other, _) = crate::body::test_keys();
        let gone = store.fetch_opened("j", &want, &recipient, &other).await;
        assert!(matches!(
            gone,
            Err(OpenFailed::Seal(OpenError::KeyMissing { .. }))
        ));

        let mut flipped = sealed;
        flipped[200_000] ^= 1;
        let (inner, key) = store.locate("j", &want).expect("located");
        inner
            .put(&key, Bytes::from(flipped.clone()).into())
            .await
            .expect("changed by hand");
        let changed = store.fetch_opened("j", &want, &recipient, &keys).await;
        assert!(
            matches!(&changed, Err(OpenFailed::Body(e)) if e.reason() == reason::BODY_CORRUPT),
            "{changed:?}"
        );
        let head = store.head("j", &want, &keys, 10).await;
        assert_eq!(head.map_err(|e| e.reason()), Err(reason::BODY_CORRUPT));

        let broken = store
            .put(Bytes::from(flipped), Some(&recipient))
            .await
            .expect("kept as it is");
        let opened = store
            .fetch_opened("j", &broken.body, &recipient, &keys)
            .await;
        assert!(
            matches!(&opened, Err(OpenFailed::Seal(OpenError::Corrupt { .. }))),
            "{opened:?}"
        );
        let head = store.head("j", &broken.body, &keys, 10).await;
        assert_eq!(head.map_err(|e| e.reason()), Err(reason::BODY_SEAL_BROKEN));
    }
}
