//! The body store's rules, without I/O: when a dead message's payload goes to the queue's
//! store (`spec.bodies`) instead of the record, what its object is called, how a fetched
//! object is checked before a byte of it is sent, and which objects a sweep may delete.
//!
//! Objects are content-addressed (`<prefix>sha256/<hex>`): one body parked twice is stored
//! once, and a record's reference names exactly the bytes it was parked with.

use std::collections::HashSet;

use sha2::{Digest, Sha256};

use crate::dead_letter::{BodyRef, Job, MAX_PAYLOAD_BYTES};
use crate::park::ParkRequest;
use crate::queue::BodiesSpec;

/// The directory of the content-addressed objects under the store's prefix.
pub const OBJECTS_DIR: &str = "sha256/";

/// The directory of bodies being sealed on their way in: a sealed body's digest (its key) is
/// known only once its ciphertext is all written, so it is written here and then moved to its
/// key. What a crash leaves here is swept like an orphan.
pub const STAGING_DIR: &str = "staging/";

/// The key of staged upload `name` under `prefix`.
pub fn staging_key(prefix: &str, name: &str) -> String {
    format!("{prefix}{STAGING_DIR}{name}")
}

/// What becomes of a payload of `size` bytes (headers included) on a queue with `bodies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In the record, as before.
    Inline,
    /// In the store; the record holds a [`BodyRef`].
    Store,
    /// Over the queue's `maxBytes` (or over a record's limit without a store): kept in the
    /// broker with a `Rejected` Event.
    TooLarge { limit: u64 },
}

/// Where a payload of `size` bytes goes (`size` counts the headers too: they travel with it).
pub fn placement(bodies: Option<&BodiesSpec>, size: u64) -> Placement {
    let Some(bodies) = bodies else {
        return if size as usize > MAX_PAYLOAD_BYTES {
            Placement::TooLarge {
                limit: MAX_PAYLOAD_BYTES as u64,
            }
        } else {
            Placement::Inline
        };
    };
    if size > bodies.max() {
        Placement::TooLarge {
            limit: bodies.max(),
        }
    } else if size > bodies.threshold() {
        Placement::Store
    } else {
        Placement::Inline
    }
}

/// The bytes a job's payload and headers take (the size [`placement`] weighs).
pub fn job_size(job: &Job) -> u64 {
    let payload = job.payload.as_ref().map_or(0, String::len)
        + job.payload_base64.as_ref().map_or(0, |b| b.len() / 4 * 3);
    let headers: usize = job.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    (payload + headers) as u64
}

/// The bytes a request's payload and headers take, `message` being the source's message when
/// the payload is still only there ([`ParkRequest::of_message`]).
pub fn request_size(req: &ParkRequest, message: &[u8]) -> u64 {
    let left = if req.payload_in_message {
        message.len() as u64
    } else {
        0
    };
    job_size(&req.job) + left
}

/// The object key of a body with digest `sha256` under `prefix` (empty, or ending in `/`).
pub fn object_key(prefix: &str, sha256: &str) -> String {
    format!("{prefix}{OBJECTS_DIR}{sha256}")
}

/// The digest an object key names, when it is one of the store's own objects.
pub fn digest_of_key<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
    let digest = key.strip_prefix(prefix)?.strip_prefix(OBJECTS_DIR)?;
    (digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit())).then_some(digest)
}

/// The reference a record holds for the object of `sha256` in the store of `bodies`.
pub fn reference(bodies: &BodiesSpec, sha256: &str) -> String {
    let key = object_key(&bodies.prefix(), sha256);
    match bodies.volume {
        Some(_) => format!("volume://{key}"),
        None => format!("{}/{key}", bodies.base_uri()),
    }
}

/// The object key in the store of `bodies` of the body `want` names: the key its reference
/// names when that is this store's, else (a record parked before the queue's store moved) its
/// digest's key under this store's prefix, where the same bytes are found once copied (keys
/// are content-addressed and every read is checked against size and digest). None for a
/// reference that names anything but a body of its own digest (a record can read no other
/// object of the bucket).
pub fn key_of_body(bodies: &BodiesSpec, want: &BodyRef) -> Option<String> {
    let own = format!("{OBJECTS_DIR}{}", want.sha256);
    if want.sha256.len() != 64 || !want.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let named = match bodies.volume {
        Some(_) => want.reference.strip_prefix("volume://"),
        None => want
            .reference
            .strip_prefix(&bodies.base_uri())
            .and_then(|rest| rest.strip_prefix('/')),
    };
    match named {
        Some(key) if key == own || key.ends_with(&format!("/{own}")) => Some(key.to_string()),
        Some(_) => None,
        None => Some(object_key(&bodies.prefix(), &want.sha256)),
    }
}

/// A body's reference from its bytes' digest and length.
pub fn body_ref(bodies: &BodiesSpec, sha256: &str, size: u64, recipient: Option<&str>) -> BodyRef {
    BodyRef {
        reference: reference(bodies, sha256),
        size: i64::try_from(size).unwrap_or(i64::MAX),
        sha256: sha256.to_string(),
        recipient: recipient.map(str::to_string),
        external: false,
    }
}

/// Hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Base64 characters decoded per block (a multiple of 4: only the last block may be padded).
const BASE64_BLOCK: usize = 4096;

/// `payloadBase64` text (standard, padded) decoded into the text's own buffer: a large binary
/// body on its way to the store is not held a second time beside its base64. Each block is
/// copied aside before its bytes (3/4 of it at most) are written at or before where it was
/// read. Text that is not base64 comes back exactly as it was: the blocks before the bad one
/// are full and unpadded, so their base64 is the encoding of what they decoded to.
pub fn decode_base64_in_place(text: String) -> Result<Vec<u8>, String> {
    use base64::Engine;
    let engine = &base64::engine::general_purpose::STANDARD;
    if !text.len().is_multiple_of(4) {
        return Err(text);
    }
    let mut buf = text.into_bytes();
    let mut block = [0u8; BASE64_BLOCK];
    let mut out = [0u8; BASE64_BLOCK / 4 * 3];
    let (mut read, mut written) = (0, 0);
    while read < buf.len() {
        let n = (buf.len() - read).min(BASE64_BLOCK);
        block[..n].copy_from_slice(&buf[read..read + n]);
        let last = read + n == buf.len();
        // Padding ends the text: a padded block before the last is not base64 as a whole.
        let decoded = match block[n - 1] == b'=' && !last {
            true => None,
            false => engine.decode_slice(&block[..n], &mut out).ok(),
        };
        let Some(got) = decoded else {
            let mut text = engine.encode(&buf[..written]);
            text.push_str(&String::from_utf8_lossy(&buf[read..]));
            return Err(text);
        };
        buf[written..written + got].copy_from_slice(&out[..got]);
        read += n;
        written += got;
    }
    buf.truncate(written);
    Ok(buf)
}

/// An SQS Extended Client pointer: the producer put the body in S3 and sent this instead. Its
/// object belongs to the producer: a record references it (`external`), never copies or
/// deletes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtendedPointer {
    pub bucket: String,
    pub key: String,
    /// The size the producer declared (`ExtendedPayloadSize`, or `SQSLargePayloadSize` of the
    /// older clients).
    pub declared_size: Option<u64>,
}

impl ExtendedPointer {
    /// The reference a record holds: `s3://<bucket>/<key>`.
    pub fn reference(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }
}

/// The message attributes the Extended Clients mark an offloaded body with (the current
/// clients' first, the 1.x Java client's second).
pub const EXTENDED_SIZE_ATTRIBUTES: [&str; 2] = ["ExtendedPayloadSize", "SQSLargePayloadSize"];

/// The pointer an SQS message `body` is, when its attributes carry one of
/// [`EXTENDED_SIZE_ATTRIBUTES`] and the body is the clients' JSON:
/// `["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":..,"s3Key":..}]`
/// (or the bare object of the 1.x client). Anything else is an ordinary message.
pub fn extended_pointer(
    body: &str,
    attributes: &std::collections::BTreeMap<String, crate::headers::sqs::Attribute>,
) -> Option<ExtendedPointer> {
    let size = EXTENDED_SIZE_ATTRIBUTES
        .iter()
        .find_map(|name| attributes.get(*name))?;
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    let fields = match &value {
        serde_json::Value::Array(pair) => match pair.as_slice() {
            [serde_json::Value::String(class), fields] if class.ends_with("PayloadS3Pointer") => {
                fields
            }
            _ => return None,
        },
        object @ serde_json::Value::Object(_) => object,
        _ => return None,
    };
    let bucket = fields.get("s3BucketName")?.as_str()?;
    let key = fields.get("s3Key")?.as_str()?;
    if bucket.is_empty() || key.is_empty() {
        return None;
    }
    Some(ExtendedPointer {
        bucket: bucket.to_string(),
        key: key.to_string(),
        declared_size: size.string_value.as_deref()?.trim().parse().ok(),
    })
}

/// The reference of an external object (`s3://<bucket>/<key>`) as bucket and key.
pub fn split_external(reference: &str) -> Option<(&str, &str)> {
    let (bucket, key) = reference.strip_prefix("s3://")?.split_once('/')?;
    (!bucket.is_empty() && !key.is_empty()).then_some((bucket, key))
}

/// The bucket and key of the external object `reference` names when the queue of `bodies`
/// allows it ([`BodiesSpec::external_places`]: its S3 store's bucket and prefix, its
/// `externalBuckets`), decided before anything is read. None for any other object, and for a
/// key with an empty, `.` or `..` segment (a posix-backed gateway resolves those elsewhere): a
/// record, hand-made or not, gets the operator to read no object the queue did not declare.
pub fn external_object<'r>(bodies: &BodiesSpec, reference: &'r str) -> Option<(&'r str, &'r str)> {
    let (bucket, key) = split_external(reference)?;
    if key
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return None;
    }
    bodies
        .external_places()
        .iter()
        .any(|(b, prefix)| *b == bucket && key.starts_with(prefix.as_str()))
        .then_some((bucket, key))
}

/// Why a fetched object is not the body its record names: redrive sends nothing of it. It says
/// only what the record says: the object's own size and digest are not the record's to learn
/// (a hand-made record could otherwise measure any object it may name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyCheck {
    #[error("the body of job {job} in the store is not the {want} bytes its record says")]
    Size { job: String, want: i64 },
    #[error("the body of job {job} in the store does not have the SHA-256 its record says")]
    Digest { job: String },
}

/// Checks a body while it streams in: feed each chunk to [`Verifier::update`], then
/// [`Verifier::finish`] says whether the whole matched its reference. A size past the
/// reference's fails at once, so a wrong object is never read to its end.
pub struct Verifier {
    hasher: Sha256,
    seen: u64,
    want: BodyRef,
    job: String,
}

impl Verifier {
    pub fn new(job: &str, want: &BodyRef) -> Self {
        Verifier {
            hasher: Sha256::new(),
            seen: 0,
            want: want.clone(),
            job: job.to_string(),
        }
    }

    pub fn update(&mut self, chunk: &[u8]) -> Result<(), BodyCheck> {
        self.seen += chunk.len() as u64;
        if self.seen > self.want.size.max(0).unsigned_abs() {
            return Err(self.size_error());
        }
        self.hasher.update(chunk);
        Ok(())
    }

    pub fn finish(self) -> Result<(), BodyCheck> {
        if self.seen != self.want.size.max(0).unsigned_abs() {
            return Err(self.size_error());
        }
        if hex::encode(self.hasher.finalize()) != self.want.sha256 {
            return Err(BodyCheck::Digest { job: self.job });
        }
        Ok(())
    }

    fn size_error(&self) -> BodyCheck {
        BodyCheck::Size {
            job: self.job.clone(),
            want: self.want.size,
        }
    }
}

/// One object the sweep sees: its key and its age in seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub key: String,
    pub age_secs: i64,
}

/// The objects a sweep deletes: the store's own (`<prefix>sha256/<hex>`) whose digest is not in
/// `referenced` and that are older than `orphans_after_secs` (an upload whose record is not yet
/// seen is younger), and staged uploads (`<prefix>staging/`) as old (one is moved to its key as
/// soon as it is written). Anything else under the prefix is not ours and stays.
///
/// `referenced` must hold the digest of every body any record of any queue names, and of every
/// park still in progress, whatever place their queues name: a place is spelled by its endpoint
/// (`localhost` or `127.0.0.1`, a regional endpoint or the default chain), so two queues may
/// share objects without their specs saying so. Keys are content-addressed, so a digest kept
/// by a record elsewhere keeps at most a copy of the same bytes a while longer.
pub fn sweep<'a>(
    prefix: &str,
    stored: &'a [Stored],
    referenced: &HashSet<&str>,
    orphans_after_secs: i64,
) -> Vec<&'a str> {
    stored
        .iter()
        .filter(|o| o.age_secs >= orphans_after_secs)
        .filter(|o| {
            let staged = o
                .key
                .strip_prefix(prefix)
                .and_then(|k| k.strip_prefix(STAGING_DIR))
                .is_some_and(|name| !name.is_empty());
            staged || digest_of_key(prefix, &o.key).is_some_and(|d| !referenced.contains(d))
        })
        .map(|o| o.key.as_str())
        .collect()
}

/// One sweep of a place several queues may keep their bodies in ([`BodiesSpec::location`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedSweep<Q> {
    /// The queue whose store sweeps it: the one that keeps orphans longest.
    pub by: Q,
    /// Every queue naming the place the same way.
    pub queues: Vec<Q>,
}

/// The sweeps of `queues` (each with its `spec.bodies`): one per place as spelled, by the queue
/// keeping orphans longest, so a place is not listed once per queue. What a sweep keeps does
/// not depend on this grouping: every record's digest is kept ([`sweep`]), so a place spelled
/// two ways, swept twice, loses nothing.
pub fn shared_sweeps<'s, Q: Clone>(
    queues: impl IntoIterator<Item = (Q, &'s BodiesSpec)>,
) -> Vec<SharedSweep<Q>> {
    let mut places: std::collections::BTreeMap<String, (i64, SharedSweep<Q>)> =
        std::collections::BTreeMap::new();
    for (queue, spec) in queues {
        let after = spec.orphans_after_secs();
        match places.entry(spec.location()) {
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert((
                    after,
                    SharedSweep {
                        by: queue.clone(),
                        queues: vec![queue],
                    },
                ));
            }
            std::collections::btree_map::Entry::Occupied(mut e) => {
                let (longest, sweep) = e.get_mut();
                if after > *longest {
                    *longest = after;
                    sweep.by = queue.clone();
                }
                sweep.queues.push(queue);
            }
        }
    }
    places.into_values().map(|(_, sweep)| sweep).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{S3Bodies, VolumeBodies};

    /// Queues in one bucket and prefix (or one volume) are swept once, with every one of their
    /// records, by the queue keeping orphans longest; another prefix, bucket or endpoint is
    /// another place.
    #[test]
    fn queues_sharing_a_place_share_one_sweep() {
        let s3 =
            |bucket: &str, prefix: Option<&str>, endpoint: Option<&str>, after: &str| BodiesSpec {
                s3: Some(S3Bodies {
                    bucket: bucket.into(),
                    prefix: prefix.map(Into::into),
                    endpoint: endpoint.map(Into::into),
                    ..S3Bodies::default()
                }),
                orphans_after: Some(after.into()),
                ..BodiesSpec::default()
            };
        let volume = |path: &str| BodiesSpec {
            volume: Some(VolumeBodies { path: path.into() }),
            ..BodiesSpec::default()
        };
        let specs = [
            ("pay/a", s3("b", None, None, "10s")),
            ("ord/b", s3("b", Some("/"), None, "2h")),
            ("pay/c", s3("b", Some("x/"), None, "1h")),
            ("pay/d", s3("b", None, Some("http://127.0.0.1:9000/"), "1h")),
            ("pay/e", s3("other", None, None, "1h")),
            ("pay/f", volume("/var/lib/dlq/bodies")),
            ("ord/g", volume("/var/lib/dlq/bodies/")),
        ];
        let sweeps = shared_sweeps(specs.iter().map(|(q, s)| (*q, s)));
        let mut got: Vec<(&str, Vec<&str>)> =
            sweeps.iter().map(|s| (s.by, s.queues.clone())).collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                ("ord/b", vec!["pay/a", "ord/b"]),
                ("pay/c", vec!["pay/c"]),
                ("pay/d", vec!["pay/d"]),
                ("pay/e", vec!["pay/e"]),
                ("pay/f", vec!["pay/f", "ord/g"]),
            ]
        );
    }

    /// A message's bytes are copied into its job up to what a record holds; above that they
    /// are left in the message (its size still weighed) until the parker places them.
    #[test]
    fn a_message_too_large_for_a_record_leaves_its_payload_in_the_message() {
        let job = || Job {
            id: "j".into(),
            headers: [("h".to_string(), "v".to_string())].into(),
            ..Job::default()
        };
        let small = ParkRequest::of_message("q", job(), b"\xff\x00");
        assert!(!small.payload_in_message);
        assert_eq!(small.job.payload_base64.as_deref(), Some("/wA="));
        assert_eq!(
            request_size(&small, b"\xff\x00"),
            job_size(&small.job),
            "in the job only"
        );

        let big = vec![b'x'; MAX_PAYLOAD_BYTES + 1];
        let mut left = ParkRequest::of_message("q", job(), &big);
        assert!(left.payload_in_message);
        assert_eq!(left.job.payload, None);
        assert_eq!(left.job.headers.len(), 1);
        assert_eq!(request_size(&left, &big), big.len() as u64 + 2);
        left.fill_payload(&big);
        assert!(!left.payload_in_message);
        assert_eq!(left.job.payload.as_deref().map(str::len), Some(big.len()));
        assert_eq!(
            request_size(&left, &big),
            big.len() as u64 + 2,
            "counted once"
        );
    }

    fn noise(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn base64_decodes_in_its_own_buffer() {
        use base64::Engine;
        let engine = &base64::engine::general_purpose::STANDARD;
        for len in [0, 1, 2, 3, 4, 100, 3071, 3072, 3073, 6144, 6145, 100_000] {
            let bytes = noise(len);
            let text = engine.encode(&bytes);
            let at = text.as_ptr();
            let decoded = decode_base64_in_place(text).unwrap();
            assert_eq!(decoded, bytes, "{len} bytes");
            assert_eq!(decoded.as_ptr(), at, "{len} bytes: the text's own buffer");
        }
    }

    #[test]
    fn what_is_not_base64_comes_back_exactly() {
        use base64::Engine;
        let engine = &base64::engine::general_purpose::STANDARD;
        let long = engine.encode(noise(10_000));
        let mut bad_end = long.clone();
        bad_end.replace_range(long.len() - 2.., "!!");
        // Padding where the first block ends: each block alone decodes, the whole does not.
        let mut padded_inside = engine.encode(noise(3072 * 2));
        padded_inside.replace_range(4094..4096, "==");
        // Characters of several bytes, inside a later block and across the first block's end.
        let mut wide = engine.encode(noise(9000));
        wide.replace_range(8000..8005, "é√");
        let mut straddling = engine.encode(noise(9000));
        straddling.replace_range(4095..4097, "é");
        for text in [
            bad_end,
            padded_inside,
            wide,
            straddling,
            "abc".into(),
            "ab=c".into(),
        ] {
            assert!(text.len().is_multiple_of(4) || text == "abc");
            assert!(
                engine.decode(&text).is_err(),
                "not base64 to the crate either"
            );
            assert_eq!(decode_base64_in_place(text.clone()), Err(text));
        }
    }

    fn s3() -> BodiesSpec {
        BodiesSpec {
            s3: Some(S3Bodies {
                bucket: "dlq-bodies".into(),
                prefix: Some("payments".into()),
                ..S3Bodies::default()
            }),
            ..BodiesSpec::default()
        }
    }

    #[test]
    fn payloads_go_inline_to_the_store_or_stay_in_the_broker_by_size() {
        let bodies = s3();
        assert_eq!(placement(Some(&bodies), 65_536), Placement::Inline);
        assert_eq!(placement(Some(&bodies), 65_537), Placement::Store);
        assert_eq!(placement(Some(&bodies), 100 << 20), Placement::Store);
        assert_eq!(
            placement(Some(&bodies), (100 << 20) + 1),
            Placement::TooLarge { limit: 100 << 20 }
        );
        assert_eq!(placement(None, 262_144), Placement::Inline);
        assert_eq!(
            placement(None, 262_145),
            Placement::TooLarge { limit: 262_144 }
        );
    }

    #[test]
    fn references_name_the_content_and_lead_back_to_the_key() {
        let bodies = s3();
        let digest = sha256_hex(b"body");
        let r = reference(&bodies, &digest);
        assert_eq!(r, format!("s3://dlq-bodies/payments/sha256/{digest}"));
        let want = |reference: &str| BodyRef {
            reference: reference.into(),
            size: 4,
            sha256: digest.clone(),
            ..BodyRef::default()
        };
        let key = key_of_body(&bodies, &want(&r)).expect("ours");
        assert_eq!(key, format!("payments/sha256/{digest}"));
        assert_eq!(digest_of_key("payments/", &key), Some(digest.as_str()));
        let volume = BodiesSpec {
            volume: Some(VolumeBodies {
                path: "/var/lib/dlq".into(),
            }),
            ..BodiesSpec::default()
        };
        let v = reference(&volume, &digest);
        assert_eq!(v, format!("volume://sha256/{digest}"));
        assert_eq!(key_of_body(&volume, &want(&v)), Some(v[9..].to_string()));
        // Parked under an older prefix of the same bucket: read where its reference says.
        let older = format!("s3://dlq-bodies/2025/sha256/{digest}");
        let key = key_of_body(&bodies, &want(&older));
        assert_eq!(key, Some(format!("2025/sha256/{digest}")));
        // Parked in another store: its digest's key in this one (its objects copied here).
        let moved = format!("gs://old-bucket/x/sha256/{digest}");
        let key = key_of_body(&bodies, &want(&moved));
        assert_eq!(key, Some(format!("payments/sha256/{digest}")));
        // Any other key of the bucket, or a digest that is not one: none.
        for other in [
            "s3://dlq-bodies/payments/secrets.json".to_string(),
            format!("s3://dlq-bodies/payments/sha256/{digest}/../../x"),
            format!("s3://dlq-bodies/payments/xsha256/{digest}"),
        ] {
            assert_eq!(key_of_body(&bodies, &want(&other)), None, "{other}");
        }
        let mut short = want(&r);
        short.sha256 = "ab".into();
        assert_eq!(key_of_body(&bodies, &short), None);
    }

    #[test]
    fn a_body_is_checked_by_size_and_digest_while_it_streams() {
        let want = body_ref(&s3(), &sha256_hex(b"hello world"), 11, None);
        let mut ok = Verifier::new("j", &want);
        ok.update(b"hello ").expect("fits");
        ok.update(b"world").expect("fits");
        assert_eq!(ok.finish(), Ok(()));

        let mut longer = Verifier::new("j", &want);
        assert!(matches!(
            longer.update(b"hello world!"),
            Err(BodyCheck::Size { want: 11, .. })
        ));
        let mut shorter = Verifier::new("j", &want);
        shorter.update(b"hello").expect("fits");
        assert!(matches!(shorter.finish(), Err(BodyCheck::Size { .. })));
        let mut changed = Verifier::new("j", &want);
        changed.update(b"hello World").expect("fits");
        assert!(matches!(changed.finish(), Err(BodyCheck::Digest { .. })));
    }

    #[test]
    fn extended_client_pointers_are_recognised_by_body_and_attribute() {
        use crate::headers::sqs::Attribute;
        let number = |v: &str| Attribute {
            data_type: "Number".into(),
            string_value: Some(v.into()),
            binary_value: None,
        };
        let current = std::collections::BTreeMap::from([(
            "ExtendedPayloadSize".to_string(),
            number("5242880"),
        )]);
        let body = r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"B","s3Key":"K/1"}]"#;
        let p = extended_pointer(body, &current).expect("a pointer");
        assert_eq!(p.reference(), "s3://B/K/1");
        assert_eq!(p.declared_size, Some(5_242_880));
        assert_eq!(split_external(&p.reference()), Some(("B", "K/1")));
        let older = std::collections::BTreeMap::from([(
            "SQSLargePayloadSize".to_string(),
            number("300000"),
        )]);
        let bare = r#"{"s3BucketName":"B","s3Key":"K"}"#;
        assert_eq!(
            extended_pointer(bare, &older).map(|p| p.reference()),
            Some("s3://B/K".into())
        );
        // The same JSON without the attribute is a message like any other, and so is anything
        // else with it.
        assert_eq!(extended_pointer(body, &Default::default()), None);
        assert_eq!(extended_pointer(r#"{"intent":"pi_1"}"#, &current), None);
        assert_eq!(
            extended_pointer(r#"["Other",{"s3BucketName":"B","s3Key":"K"}]"#, &current),
            None
        );
        assert_eq!(extended_pointer("not json", &current), None);
    }

    /// An external reference is read only where the queue says Extended Client objects live:
    /// its S3 store's bucket and prefix, or a declared bucket and prefix; never another bucket,
    /// another prefix, a segment that climbs out, or any object of a store that is not S3.
    #[test]
    fn external_objects_are_read_only_where_the_queue_declares_them() {
        let mut bodies = s3();
        let allowed = |b: &BodiesSpec, r: &'static str| external_object(b, r);
        assert_eq!(
            allowed(&bodies, "s3://dlq-bodies/payments/k/1"),
            Some(("dlq-bodies", "payments/k/1"))
        );
        for refused in [
            "s3://vault/vault/creds.json",
            "s3://dlq-bodies/other/k",
            "s3://dlq-bodies/paymentsx/k",
            "s3://dlq-bodies/payments/../vault/creds.json",
            "s3://dlq-bodies/payments//k",
            "gs://dlq-bodies/payments/k",
        ] {
            assert_eq!(allowed(&bodies, refused), None, "{refused}");
        }
        let s3 = bodies.s3.as_mut().expect("s3");
        s3.external_buckets = vec![
            crate::queue::ExternalBucket {
                bucket: "producer".into(),
                prefix: Some("/offloaded".into()),
            },
            crate::queue::ExternalBucket {
                bucket: "whole".into(),
                prefix: None,
            },
        ];
        assert_eq!(
            allowed(&bodies, "s3://producer/offloaded/u-1"),
            Some(("producer", "offloaded/u-1"))
        );
        assert_eq!(
            allowed(&bodies, "s3://whole/any/key"),
            Some(("whole", "any/key"))
        );
        assert_eq!(allowed(&bodies, "s3://producer/elsewhere/u-1"), None);
        assert_eq!(allowed(&bodies, "s3://vault/vault/creds.json"), None);
        let volume = BodiesSpec {
            volume: Some(VolumeBodies { path: "/v".into() }),
            ..BodiesSpec::default()
        };
        assert_eq!(allowed(&volume, "s3://dlq-bodies/payments/k"), None);
    }

    /// A body that is not the record's is refused with what the record says, never with the
    /// size or digest of the object found: those are not the record's to learn.
    #[test]
    fn a_refused_body_names_nothing_of_the_object_found() {
        let want = body_ref(&s3(), &sha256_hex(b"hello world"), 11, None);
        let found = b"a secret of 29 bytes, really";
        let mut longer = Verifier::new("j", &want);
        let size = longer.update(found).expect_err("too long").to_string();
        let mut same_size = Verifier::new("j", &want);
        same_size.update(b"hello World").expect("fits");
        let digest = same_size.finish().expect_err("another digest").to_string();
        let other = sha256_hex(b"hello World");
        for text in [&size, &digest] {
            assert!(!text.contains("29") && !text.contains(&other), "{text}");
        }
        assert!(size.contains("11 bytes"), "{size}");
    }

    #[test]
    fn the_sweep_deletes_only_old_unreferenced_objects_of_its_own() {
        let kept = sha256_hex(b"kept");
        let orphan = sha256_hex(b"orphan");
        let young = sha256_hex(b"young");
        let stored = vec![
            Stored {
                key: object_key("payments/", &kept),
                age_secs: 7200,
            },
            Stored {
                key: object_key("payments/", &orphan),
                age_secs: 7200,
            },
            Stored {
                key: object_key("payments/", &young),
                age_secs: 30,
            },
            Stored {
                key: "payments/README".into(),
                age_secs: 7200,
            },
            Stored {
                key: "payments/sha256/not-a-digest".into(),
                age_secs: 7200,
            },
            Stored {
                key: staging_key("payments/", "left-by-a-crash"),
                age_secs: 7200,
            },
            Stored {
                key: staging_key("payments/", "being-moved"),
                age_secs: 1,
            },
        ];
        let referenced = HashSet::from([kept.as_str()]);
        let swept = sweep("payments/", &stored, &referenced, 3600);
        let left = staging_key("payments/", "left-by-a-crash");
        assert_eq!(
            swept,
            vec![object_key("payments/", &orphan).as_str(), left.as_str()]
        );
    }
}
