//! Payload sealing: a job's payload and headers encrypted to a queue's age X25519 recipient
//! before the record is created, so etcd, `kubectl get dl -o yaml` and the apiserver's audit log
//! hold only ciphertext.
//!
//! The cryptography is the `age` crate's (the format of `age-keygen` and SOPS): nothing here is
//! hand-rolled. A sealed job keeps `id` and `origin` readable and carries, in
//! [`SealedJob::ciphertext`], the base64 of one binary age file whose plaintext is the JSON of
//! [`Content`]: exactly the fields that would otherwise be plaintext (`payload`,
//! `payloadBase64`, `payloadNull`, `headers`).
//!
//! Pure: parkers call [`seal`], the operator's redrive and the reveal API call [`open`], both
//! with keys the caller read (recipients from the queue's status, identities from its Secrets).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use age::secrecy::ExposeSecret;
use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::dead_letter::{DeadLetter, Job, SealedJob};
use crate::park::ParkRequest;
use crate::queue::{SealKeyRef, SealSpec};

/// Longest `sealed.ciphertext` (base64): a 256 KiB payload with 64 headers of 8 KiB, as JSON,
/// sealed and encoded, fits.
pub const MAX_CIPHERTEXT_LEN: usize = 1_048_576;
/// Longest `sealed.recipient` (an X25519 recipient is 62 characters).
pub const MAX_RECIPIENT_LEN: usize = 128;

/// What a sealed job hides: the job's content, as it would otherwise be in the record.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Content {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub payload_null: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl Content {
    fn take_from(job: &mut Job) -> Content {
        Content {
            payload: job.payload.take(),
            payload_base64: job.payload_base64.take(),
            payload_null: std::mem::take(&mut job.payload_null),
            headers: std::mem::take(&mut job.headers),
        }
    }

    fn put_into(self, job: &mut Job) {
        job.payload = self.payload;
        job.payload_base64 = self.payload_base64;
        job.payload_null = self.payload_null;
        job.headers = self.headers;
    }
}

/// Why a job could not be sealed. Never carries the payload.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("not an age X25519 recipient (age1...): {0}")]
    Recipient(String),
    #[error("job {0} is already sealed")]
    AlreadySealed(String),
    #[error("sealing job {job}: {why}")]
    Encrypt { job: String, why: String },
    #[error(
        "job {job} sealed is {len} characters, more than the {max} a record holds: park a smaller payload"
    )]
    TooLarge { job: String, len: usize, max: usize },
}

/// Why a sealed job could not be opened. Never carries the payload or a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// None of the queue's keys is the record's: the key was removed from
    /// `spec.protection.seal.keys` or its Secret is gone. The record cannot be opened.
    #[error(
        "job {job} is sealed to {recipient}, and no key of the queue opens it (its Secret is gone or was removed from spec.protection.seal.keys)"
    )]
    KeyMissing { job: String, recipient: String },
    /// The ciphertext is not an age file the key opens (damaged, or not sealed by a parker).
    #[error("job {job} sealed to {recipient} does not open: {why}")]
    Corrupt {
        job: String,
        recipient: String,
        why: String,
    },
}

/// Why an identity could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("no AGE-SECRET-KEY-1... line in the identity")]
    Missing,
    #[error("not an age X25519 identity: {0}")]
    Invalid(&'static str),
}

/// The queue's identities, each with its recipient, in the queue's order (the first seals new
/// records). Its `Debug` shows recipients only.
#[derive(Clone, Default)]
pub struct Keyring {
    keys: Vec<(String, age::x25519::Identity)>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("recipients", &self.recipients())
            .finish()
    }
}

impl Keyring {
    /// Adds an identity given as `age-keygen` writes it (comment lines are skipped); returns its
    /// recipient.
    pub fn add(&mut self, identity_file: &str) -> Result<String, KeyError> {
        let identity = parse_identity(identity_file)?;
        let recipient = identity.to_public().to_string();
        self.keys.push((recipient.clone(), identity));
        Ok(recipient)
    }

    /// The recipients, in order: the first is the one new records are sealed to.
    pub fn recipients(&self) -> Vec<String> {
        self.keys.iter().map(|(r, _)| r.clone()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn identity_for(&self, recipient: &str) -> Option<&age::x25519::Identity> {
        self.keys
            .iter()
            .find(|(r, _)| r == recipient)
            .map(|(_, i)| i)
    }
}

fn parse_identity(text: &str) -> Result<age::x25519::Identity, KeyError> {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .ok_or(KeyError::Missing)?;
    age::x25519::Identity::from_str(line).map_err(KeyError::Invalid)
}

/// A fresh identity: (the identity file, as `age-keygen` writes it, and its recipient).
pub fn generate_identity() -> (String, String) {
    let identity = age::x25519::Identity::generate();
    let recipient = identity.to_public().to_string();
    let file = format!(
        "# public key: {recipient}\n{}\n",
        identity.to_string().expose_secret()
    );
    (file, recipient)
}

/// Whether `recipient` is an age X25519 recipient.
pub fn valid_recipient(recipient: &str) -> bool {
    age::x25519::Recipient::from_str(recipient).is_ok()
}

/// `job` with its content sealed to `recipient`: payload, payloadBase64, payloadNull and
/// headers replaced by `sealed`; id and origin untouched.
pub fn seal(job: &Job, recipient: &str) -> Result<Job, SealError> {
    if job.sealed.is_some() {
        return Err(SealError::AlreadySealed(job.id.clone()));
    }
    let to = age::x25519::Recipient::from_str(recipient)
        .map_err(|e| SealError::Recipient(e.to_string()))?;
    let mut sealed = job.clone();
    let content = Content::take_from(&mut sealed);
    let plaintext = serde_json::to_vec(&content).map_err(|e| SealError::Encrypt {
        job: job.id.clone(),
        why: e.to_string(),
    })?;
    let file = age::encrypt(&to, &plaintext).map_err(|e| SealError::Encrypt {
        job: job.id.clone(),
        why: e.to_string(),
    })?;
    let ciphertext = base64::engine::general_purpose::STANDARD.encode(file);
    if ciphertext.len() > MAX_CIPHERTEXT_LEN {
        return Err(SealError::TooLarge {
            job: job.id.clone(),
            len: ciphertext.len(),
            max: MAX_CIPHERTEXT_LEN,
        });
    }
    sealed.sealed = Some(Box::new(SealedJob {
        recipient: recipient.to_string(),
        ciphertext,
    }));
    Ok(sealed)
}

/// `req` as a queue that seals parks it: its job sealed to `recipient` ([`seal`]), and its
/// reason one that quotes nothing of the message's bytes, since the reason stays readable: the
/// request's [`ParkRequest::sealed_reason`] when it has one, and card numbers masked in
/// whatever reason is left (a consumer's own words may quote one).
pub fn seal_request(mut req: ParkRequest, recipient: &str) -> Result<ParkRequest, SealError> {
    req.job = seal(&req.job, recipient)?;
    if let Some(reason) = req.sealed_reason.take() {
        req.reason = reason;
    }
    req.reason = crate::mask::mask_cards(&req.reason);
    Ok(req)
}

/// The one entry point for opening a record: its job with the content restored exactly as it
/// was parked (payload bytes and headers byte for byte), opened with the key of the record's
/// recipient from `keyring` (the queue's identities). A job that is not sealed comes back as
/// it is. The operator's redrive and the reveal API (`deadletterpayloads`) both call this; a
/// record is never half-opened: either the whole content or an [`OpenError`].
pub fn open(record: &DeadLetter, keyring: &Keyring) -> Result<Job, OpenError> {
    open_job(&record.spec.job, keyring)
}

/// [`open`] for a job alone (what [`open`] does with `record.spec.job`).
pub fn open_job(job: &Job, keyring: &Keyring) -> Result<Job, OpenError> {
    let Some(sealed) = &job.sealed else {
        return Ok(job.clone());
    };
    let identity =
        keyring
            .identity_for(&sealed.recipient)
            .ok_or_else(|| OpenError::KeyMissing {
                job: job.id.clone(),
                recipient: sealed.recipient.clone(),
            })?;
    let corrupt = |why: String| OpenError::Corrupt {
        job: job.id.clone(),
        recipient: sealed.recipient.clone(),
        why,
    };
    let file = base64::engine::general_purpose::STANDARD
        .decode(&sealed.ciphertext)
        .map_err(|e| corrupt(format!("ciphertext is not base64: {e}")))?;
    let plaintext = age::decrypt(identity, &file).map_err(|e| corrupt(e.to_string()))?;
    // serde's own words would quote the opened content: say only what was wrong.
    let content: Content = serde_json::from_slice(&plaintext).map_err(|e| {
        corrupt(format!(
            "sealed content is not a job's content: {}",
            crate::park::json_error_without_values(&e)
        ))
    })?;
    let mut opened = job.clone();
    opened.sealed = None;
    content.put_into(&mut opened);
    Ok(opened)
}

/// A stored body (`dlq_core::body`) sealed to `recipient`: the binary age file the store
/// keeps, so it holds ciphertext only.
pub fn seal_body(job: &str, body: &[u8], recipient: &str) -> Result<Vec<u8>, SealError> {
    let to = age::x25519::Recipient::from_str(recipient)
        .map_err(|e| SealError::Recipient(e.to_string()))?;
    age::encrypt(&to, body).map_err(|e| SealError::Encrypt {
        job: job.to_string(),
        why: e.to_string(),
    })
}

/// A stored body sealed a piece at a time ([`seal_body`]'s age file, as a stream): each piece
/// written comes out as ciphertext at once ([`BodySealer::take`]), so a large body is sealed on
/// its way to the store without its ciphertext ever being held whole beside it.
pub struct BodySealer {
    job: String,
    writer: age::stream::StreamWriter<Sealed>,
    out: Sealed,
}

/// The ciphertext written so far and not yet taken.
#[derive(Clone, Default)]
struct Sealed(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Sealed {
    fn take(&self) -> Vec<u8> {
        // A panic while holding it leaves a plain buffer behind; keep using it.
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl std::io::Write for Sealed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut out = self.0.lock().unwrap_or_else(|e| e.into_inner());
        out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl BodySealer {
    /// A sealer of job `job`'s body to `recipient`.
    pub fn new(job: &str, recipient: &str) -> Result<Self, SealError> {
        let to = age::x25519::Recipient::from_str(recipient)
            .map_err(|e| SealError::Recipient(e.to_string()))?;
        let out = Sealed::default();
        let writer = age::Encryptor::with_recipients(std::iter::once(&to as &dyn age::Recipient))
            .map_err(|e| encrypt_failed(job, e))?
            .wrap_output(out.clone())
            .map_err(|e| encrypt_failed(job, e))?;
        Ok(BodySealer {
            job: job.to_string(),
            writer,
            out,
        })
    }

    /// Seals the next `piece` of the body.
    pub fn seal(&mut self, piece: &[u8]) -> Result<(), SealError> {
        use std::io::Write;
        self.writer
            .write_all(piece)
            .map_err(|e| encrypt_failed(&self.job, e))
    }

    /// The ciphertext sealed since the last take.
    pub fn take(&mut self) -> Vec<u8> {
        self.out.take()
    }

    /// Ends the age file: the ciphertext not yet taken.
    pub fn finish(self) -> Result<Vec<u8>, SealError> {
        self.writer
            .finish()
            .map_err(|e| encrypt_failed(&self.job, e))?;
        Ok(self.out.take())
    }
}

/// Sealing job `job` failed: `why`.
fn encrypt_failed(job: &str, why: impl fmt::Display) -> SealError {
    SealError::Encrypt {
        job: job.to_string(),
        why: why.to_string(),
    }
}

/// Why a sealed stored body did not open as it streamed in.
#[derive(Debug, thiserror::Error)]
pub enum BodyOpenError {
    /// No key of the queue is its recipient's, or its age header does not open with it.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Reading the ciphertext failed: the reader's own error, as it came.
    #[error("reading the sealed body failed: {0}")]
    Read(#[source] std::io::Error),
}

/// A sealed stored body's plaintext as its ciphertext (`sealed`) streams in: age's STREAM is
/// read and authenticated a 64 KiB chunk at a time, so neither is ever held whole (a redrive
/// keeps only the plaintext it sends, a reveal a chunk). A damaged chunk is an `InvalidData`
/// read error where it is; `sealed`'s own errors come through the reader as they are.
pub async fn body_reader<R>(
    job: &str,
    sealed: R,
    recipient: &str,
    keyring: &Keyring,
) -> Result<age::stream::StreamReader<R>, BodyOpenError>
where
    R: futures::io::AsyncBufRead + Unpin,
{
    let identity = keyring
        .identity_for(recipient)
        .ok_or_else(|| OpenError::KeyMissing {
            job: job.to_string(),
            recipient: recipient.to_string(),
        })?;
    let failed = |e: age::DecryptError| match e {
        age::DecryptError::Io(e) => BodyOpenError::Read(e),
        e => BodyOpenError::Open(OpenError::Corrupt {
            job: job.to_string(),
            recipient: recipient.to_string(),
            why: e.to_string(),
        }),
    };
    age::Decryptor::new_async_buffered(sealed)
        .await
        .map_err(failed)?
        .decrypt_async(std::iter::once(identity as &dyn age::Identity))
        .map_err(failed)
}

/// The queue's `status.protection`: the recipients read from its keys (`published`, the first
/// seals new records) and how many records each sealed (`sealed_to`: one entry per record
/// that is sealed). Every published recipient is counted, 0 included (so a key can be retired),
/// and so is a recipient no key has any more (its records cannot be opened).
pub fn protection_status<'a>(
    published: Vec<String>,
    sealed_to: impl IntoIterator<Item = &'a str>,
) -> crate::queue::ProtectionStatus {
    let mut records: BTreeMap<String, i64> = published.iter().map(|r| (r.clone(), 0)).collect();
    for recipient in sealed_to {
        *records.entry(recipient.to_string()).or_default() += 1;
    }
    crate::queue::ProtectionStatus {
        recipient: published.into_iter().next(),
        records,
    }
}

/// `status.protection` as a merge patch: [`protection_status`], with the recipients the queue
/// showed before and no longer counts set to null (a merge patch keeps a map's other keys), and
/// a recipient no longer published set to null.
#[derive(Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProtectionWrite {
    pub recipient: Option<String>,
    pub records: BTreeMap<String, Option<i64>>,
}

/// The merge patch that turns `before` into `now`.
pub fn protection_write(
    before: Option<&crate::queue::ProtectionStatus>,
    now: crate::queue::ProtectionStatus,
) -> ProtectionWrite {
    let mut records: BTreeMap<String, Option<i64>> = before
        .map(|b| b.records.keys().map(|k| (k.clone(), None)).collect())
        .unwrap_or_default();
    records.extend(now.records.into_iter().map(|(k, n)| (k, Some(n))));
    ProtectionWrite {
        recipient: now.recipient,
        records,
    }
}

/// Most keys a queue lists (the CRD's bound on `spec.protection.seal.keys`).
pub const MAX_KEYS: usize = 8;

/// What making Secret `name` a queue's sealing key (`kubectl dlq seal-key`) does, decided from
/// the queue's `spec.protection.seal` as it is now: so a run again after a failure, or after a
/// concurrent change of the keys, does the right thing once.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyAdded {
    /// The seal to write: `name` the only identity, or first before the older keys (rotation).
    Write(SealSpec),
    /// `name` seals new records already: nothing to write.
    AlreadyFirst,
    /// `name` is an older key of the queue, kept to open older records.
    AlreadyOlder,
    /// The queue lists [`MAX_KEYS`] already.
    Full,
}

/// [`KeyAdded`] for Secret `name` (its default key) and the queue's `seal`.
pub fn add_key(seal: Option<&SealSpec>, name: &str) -> KeyAdded {
    let old = seal.map(SealSpec::key_refs).unwrap_or_default();
    match old.iter().position(|k| k.name == name) {
        Some(0) => return KeyAdded::AlreadyFirst,
        Some(_) => return KeyAdded::AlreadyOlder,
        None if old.len() >= MAX_KEYS => return KeyAdded::Full,
        None => {}
    }
    let new = SealKeyRef {
        name: name.to_string(),
        key: None,
    };
    // One identity is `identitySecretRef`; a rotation lists them all in `keys`, new first.
    KeyAdded::Write(match old {
        [] => SealSpec {
            identity_secret_ref: Some(new),
            keys: Vec::new(),
        },
        _ => SealSpec {
            identity_secret_ref: None,
            keys: std::iter::once(new).chain(old.iter().cloned()).collect(),
        },
    })
}

/// The most an age file to one X25519 recipient adds to its plaintext: its header (about 210
/// bytes, plus the random "grease" stanza age adds, up to about 300), a 16-byte tag per 64 KiB
/// chunk, and the JSON around the content.
pub const SEAL_OVERHEAD: usize = 600;

/// About how many bytes of content a sealed job holds, never more: its ciphertext decoded, less
/// [`SEAL_OVERHEAD`]. A sealed job is then held like a plaintext one of about that size.
pub fn content_len(sealed: &SealedJob) -> usize {
    (sealed.ciphertext.len() / 4 * 3).saturating_sub(SEAL_OVERHEAD)
}

/// What a human sees instead of a sealed payload.
pub fn sealed_label(sealed: &SealedJob) -> String {
    format!("sealed (recipient {})", sealed.recipient)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        let mut job = Job::from_bytes("pi_0003/settle", br#"{"card":"4111111111111111"}"#);
        job.headers.insert("x-trace".into(), "abc".into());
        job
    }

    fn record(job: Job) -> DeadLetter {
        let mut record = crate::testing::RecordBuilder::job(&job.id).build();
        record.spec.job = job;
        record
    }

    #[test]
    fn a_new_key_goes_first_once_and_an_existing_one_is_not_added_again() {
        let named = |n: &str| SealKeyRef {
            name: n.into(),
            key: None,
        };
        let one = SealSpec {
            identity_secret_ref: Some(named("a")),
            keys: Vec::new(),
        };
        assert_eq!(
            add_key(None, "a"),
            KeyAdded::Write(one.clone()),
            "the first key is the identity"
        );
        let rotated = SealSpec {
            identity_secret_ref: None,
            keys: vec![named("b"), named("a")],
        };
        assert_eq!(add_key(Some(&one), "b"), KeyAdded::Write(rotated.clone()));
        assert_eq!(add_key(Some(&rotated), "b"), KeyAdded::AlreadyFirst);
        assert_eq!(add_key(Some(&rotated), "a"), KeyAdded::AlreadyOlder);
        let full = SealSpec {
            identity_secret_ref: None,
            keys: (0..MAX_KEYS).map(|i| named(&format!("k{i}"))).collect(),
        };
        assert_eq!(add_key(Some(&full), "new"), KeyAdded::Full);
        assert_eq!(add_key(Some(&full), "k0"), KeyAdded::AlreadyFirst);
    }

    #[test]
    fn sealed_hides_content_and_opens_byte_exact() {
        let (file, recipient) = generate_identity();
        let mut keys = Keyring::default();
        assert_eq!(keys.add(&file).unwrap(), recipient);
        let sealed = seal(&job(), &recipient).unwrap();
        let yaml = serde_json::to_string(&sealed).unwrap();
        assert!(!yaml.contains("4111111111111111"), "{yaml}");
        assert!(!yaml.contains("x-trace"), "{yaml}");
        assert!(sealed.payload.is_none() && sealed.headers.is_empty());
        assert_eq!(sealed.id, "pi_0003/settle");
        assert_eq!(open(&record(sealed), &keys).unwrap(), job());
    }

    #[test]
    fn a_stored_body_seals_to_ciphertext_and_opens_only_with_its_key() {
        let (file, recipient) = generate_identity();
        let mut keys = Keyring::default();
        keys.add(&file).unwrap();
        let body = vec![7u8; 300_000];
        let sealed = seal_body("j", &body, &recipient).unwrap();
        assert!(!sealed.windows(64).any(|w| w == &body[..64]));
        assert_eq!(open_body("j", &sealed, &recipient, &keys).unwrap(), body);
        let (_, other) = generate_identity();
        assert!(matches!(
            open_body("j", &sealed, &other, &keys),
            Err(BodyOpenError::Open(OpenError::KeyMissing { .. }))
        ));
        let mut flipped = sealed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(
            open_body("j", &flipped, &recipient, &keys),
            Err(BodyOpenError::Read(e)) if e.kind() == std::io::ErrorKind::InvalidData
        ));
        let mut header = sealed.clone();
        header[40] ^= 1;
        assert!(matches!(
            open_body("j", &header, &recipient, &keys),
            Err(BodyOpenError::Open(OpenError::Corrupt { .. }))
        ));
    }

    /// The whole plaintext of a sealed stored body, read through [`body_reader`].
    fn open_body(
        job: &str,
        sealed: &[u8],
        recipient: &str,
        keys: &Keyring,
    ) -> Result<Vec<u8>, BodyOpenError> {
        use futures::AsyncReadExt;
        futures::executor::block_on(async {
            let mut reader = body_reader(job, sealed, recipient, keys).await?;
            let mut plain = Vec::new();
            reader
                .read_to_end(&mut plain)
                .await
                .map_err(BodyOpenError::Read)?;
            Ok(plain)
        })
    }

    /// Sealed a piece at a time, a body is one age file its key opens, its ciphertext handed
    /// out as it is made (each take holds only what the pieces since the last one made).
    #[test]
    fn a_stored_body_sealed_in_pieces_opens_whole() {
        let (file, recipient) = generate_identity();
        let mut keys = Keyring::default();
        keys.add(&file).unwrap();
        let body: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut sealer = BodySealer::new("j", &recipient).unwrap();
        let mut sealed = Vec::new();
        for piece in body.chunks(100_000) {
            sealer.seal(piece).unwrap();
            let out = sealer.take();
            assert!(out.len() <= 2 * 100_000, "{} bytes at once", out.len());
            sealed.extend(out);
        }
        sealed.extend(sealer.finish().unwrap());
        assert_eq!(open_body("j", &sealed, &recipient, &keys).unwrap(), body);
        assert!(matches!(
            BodySealer::new("j", "age1nope"),
            Err(SealError::Recipient(_))
        ));
    }

    /// Nothing read from the message's bytes reaches a sealed record's readable reason: an
    /// Invalid envelope's parse error is described without the value, and a consumer's own
    /// reason has its card numbers masked.
    #[test]
    fn a_sealed_request_keeps_no_card_number_in_its_reason() {
        let (_, recipient) = generate_identity();
        let raw = br#"{"id":"j","payload":"p","headers":{"x-card":4242424242424242}}"#;
        let invalid =
            seal_request(crate::envelope::request_for("relayer", raw), &recipient).unwrap();
        assert!(!invalid.reason.contains("4242"), "{}", invalid.reason);
        assert!(invalid.reason.contains("wrong type"), "{}", invalid.reason);
        assert!(invalid.job.sealed.is_some() && invalid.job.payload.is_none());
        let mut told = ParkRequest::new("relayer", job());
        told.reason = "card 4242424242424242 declined".into();
        let told = seal_request(told, &recipient).unwrap();
        assert_eq!(told.reason, "card 424242******4242 declined");
    }

    #[test]
    fn content_len_never_overstates_the_plaintext() {
        let (_, recipient) = generate_identity();
        let mut most = 0;
        for size in [0usize, 1024, 65536] {
            let job = Job::from_bytes("j", "x".repeat(size).as_bytes());
            for _ in 0..64 {
                let sealed = seal(&job, &recipient).unwrap();
                let len = content_len(sealed.sealed.as_ref().unwrap());
                assert!(len <= size, "{size}: {len}");
                most = most.max(size - len);
            }
        }
        eprintln!("most understated: {most}");
        assert!(most <= SEAL_OVERHEAD, "{most}");
    }

    #[test]
    fn binary_and_null_payloads_round_trip() {
        let (file, recipient) = generate_identity();
        let mut keys = Keyring::default();
        keys.add(&file).unwrap();
        for job in [
            Job::from_bytes("b", &[0, 159, 146, 150, 255]),
            Job::null_value("n"),
        ] {
            let sealed = seal(&job, &recipient).unwrap();
            assert_eq!(open_job(&sealed, &keys).unwrap(), job);
        }
    }

    #[test]
    fn other_key_is_key_missing_and_plain_jobs_pass() {
        let (_, recipient) = generate_identity();
        let (other, _) = generate_identity();
        let mut keys = Keyring::default();
        keys.add(&other).unwrap();
        let sealed = seal(&job(), &recipient).unwrap();
        assert!(matches!(
            open_job(&sealed, &keys),
            Err(OpenError::KeyMissing { recipient: r, .. }) if r == recipient
        ));
        assert_eq!(open_job(&job(), &keys).unwrap(), job());
    }

    #[test]
    fn tampered_ciphertext_is_corrupt() {
        let (file, recipient) = generate_identity();
        let mut keys = Keyring::default();
        keys.add(&file).unwrap();
        let mut sealed = seal(&job(), &recipient).unwrap();
        if let Some(s) = sealed.sealed.as_mut() {
            let mut bytes = base64::engine::general_purpose::STANDARD
                .decode(&s.ciphertext)
                .unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            s.ciphertext = base64::engine::general_purpose::STANDARD.encode(bytes);
        }
        assert!(matches!(
            open_job(&sealed, &keys),
            Err(OpenError::Corrupt { .. })
        ));
    }

    #[test]
    fn protection_counts_every_key_and_orphans() {
        let status = protection_status(
            vec!["age1new".into(), "age1old".into()],
            ["age1old", "age1old", "age1gone"],
        );
        assert_eq!(status.recipient.as_deref(), Some("age1new"));
        assert_eq!(
            status.records,
            BTreeMap::from([
                ("age1gone".to_string(), 1),
                ("age1new".to_string(), 0),
                ("age1old".to_string(), 2)
            ])
        );
    }

    #[test]
    fn keyring_reads_age_keygen_files_and_hides_secrets_in_debug() {
        let (file, recipient) = generate_identity();
        let with_comments = format!("# created: 2026-12-03T00:00:00Z\n{file}");
        let mut keys = Keyring::default();
        assert_eq!(keys.add(&with_comments).unwrap(), recipient);
        let debug = format!("{keys:?}");
        assert!(debug.contains(&recipient) && !debug.contains("AGE-SECRET-KEY"));
        assert_eq!(keys.add("# only a comment\n"), Err(KeyError::Missing));
        assert!(keys.add("AGE-SECRET-KEY-1NOPE").is_err());
        assert!(seal(&job(), "age1nope").is_err());
        assert!(valid_recipient(&recipient) && !valid_recipient("age1nope"));
    }
}
