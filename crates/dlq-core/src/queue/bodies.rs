//! `spec.bodies` of a DeadLetterQueue: the object store that holds dead messages too large to
//! sit in a record (the claim check: the body in a bucket, a reference and a digest in etcd).

use serde::{Deserialize, Serialize};

use kube_derive::KubeSchema;

/// Payloads (with their headers) above this many bytes go to the store by default.
pub const DEFAULT_THRESHOLD_BYTES: i64 = 64 * 1024;
/// The largest dead message a queue with a store keeps by default (100 MiB).
pub const DEFAULT_MAX_BYTES: i64 = 100 * 1024 * 1024;
/// How long an object no record references is kept by default (a crash between its upload
/// and its record's create leaves one behind).
pub const DEFAULT_ORPHANS_AFTER: &str = "1h";
/// Shortest `orphansAfter`: an object must outlive the record watch's lag behind its create.
/// (A park that waits for room keeps its object from the sweep however long it waits.)
pub const MIN_ORPHANS_AFTER_SECS: i64 = 10;

/// Where a queue keeps large bodies: exactly one of `s3`, `gcs`, `azure` or `volume`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("(has(self.s3) ? 1 : 0) + (has(self.gcs) ? 1 : 0) + (has(self.azure) ? 1 : 0) + (has(self.volume) ? 1 : 0) == 1").message("spec.bodies needs exactly one of s3, gcs, azure and volume"),
    validation = kube::core::Rule::new("(has(self.thresholdBytes) ? self.thresholdBytes : 65536) <= (has(self.maxBytes) ? self.maxBytes : 104857600)").message("spec.bodies.thresholdBytes must not exceed maxBytes"),
)]
pub struct BodiesSpec {
    /// Payloads with headers above this many bytes go to the store (default 65536; at most
    /// 262144, the most a record holds inline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 262144))]
    pub threshold_bytes: Option<i64>,
    /// The largest dead message kept (default 104857600, 100 MiB; at most 5 GiB). Larger ones
    /// stay in the broker with a `Rejected` Event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 5368709120_i64))]
    pub max_bytes: Option<i64>,
    /// An object no record references is deleted once it is this old (Go duration, default
    /// `1h`, at least `10s`; keep it above the longest watch lag you expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('10s')").message("spec.bodies.orphansAfter must be a duration of at least 10s"))]
    pub orphans_after: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Bodies>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gcs: Option<GcsBodies>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub azure: Option<AzureBodies>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeBodies>,
}

impl BodiesSpec {
    pub fn threshold(&self) -> u64 {
        self.threshold_bytes
            .unwrap_or(DEFAULT_THRESHOLD_BYTES)
            .max(0)
            .unsigned_abs()
    }

    pub fn max(&self) -> u64 {
        self.max_bytes
            .unwrap_or(DEFAULT_MAX_BYTES)
            .max(1)
            .unsigned_abs()
    }

    /// Seconds after which an unreferenced object is swept.
    pub fn orphans_after_secs(&self) -> i64 {
        let text = self
            .orphans_after
            .as_deref()
            .unwrap_or(DEFAULT_ORPHANS_AFTER);
        crate::duration::parse_duration(text)
            .map(|d| d.as_secs().min(i64::MAX as u64) as i64)
            .unwrap_or(3600)
            .max(MIN_ORPHANS_AFTER_SECS)
    }

    /// The object-key prefix inside the bucket or volume (empty, or ending in `/`).
    pub fn prefix(&self) -> String {
        let p = match (&self.s3, &self.gcs, &self.azure) {
            (Some(s), _, _) => s.prefix.as_deref(),
            (_, Some(g), _) => g.prefix.as_deref(),
            (_, _, Some(a)) => a.prefix.as_deref(),
            _ => None,
        };
        normal_prefix(p)
    }

    /// Where the store's objects live as the spec spells it (endpoint, bucket or container,
    /// volume path, prefix): queues with the same location are swept once. Another spelling
    /// (`localhost` for `127.0.0.1`) may still be the same place, so nothing that keeps objects
    /// depends on it (the sweep keeps every record's digest, whatever its queue).
    pub fn location(&self) -> String {
        let place = match (&self.s3, &self.gcs, &self.azure, &self.volume) {
            (Some(s), _, _, _) => format!(
                "s3://{}@{}",
                s.bucket,
                s.endpoint.as_deref().unwrap_or("aws").trim_end_matches('/')
            ),
            (_, _, _, Some(v)) => format!("volume://{}", v.path.trim_end_matches('/')),
            _ => self.base_uri(),
        };
        format!("{place}/{}", self.prefix())
    }

    /// The S3 buckets and key prefixes SQS Extended Client objects may be read from: this
    /// store's own bucket and prefix, then its `externalBuckets` (none for another backend).
    pub fn external_places(&self) -> Vec<(&str, String)> {
        let Some(s3) = &self.s3 else {
            return Vec::new();
        };
        let declared = s3
            .external_buckets
            .iter()
            .map(|e| (e.bucket.as_str(), normal_prefix(e.prefix.as_deref())));
        std::iter::once((s3.bucket.as_str(), self.prefix()))
            .chain(declared)
            .collect()
    }

    /// The URI scheme and container of the store's references (`s3://bucket`, `gs://bucket`,
    /// `azure://account/container`, `volume://`).
    pub fn base_uri(&self) -> String {
        match (&self.s3, &self.gcs, &self.azure) {
            (Some(s), _, _) => format!("s3://{}", s.bucket),
            (_, Some(g), _) => format!("gs://{}", g.bucket),
            (_, _, Some(a)) => format!("azure://{}/{}", a.account, a.container),
            _ => "volume://".into(),
        }
    }
}

/// A key prefix as keys start with it: empty, or its segments and a `/`.
fn normal_prefix(prefix: Option<&str>) -> String {
    let p = prefix.unwrap_or("").trim_matches('/');
    if p.is_empty() {
        String::new()
    } else {
        format!("{p}/")
    }
}

/// Amazon S3 or an S3-compatible store. Credentials from `credentialsSecretRef` (keys
/// `accessKeyId`, `secretAccessKey`, optionally `sessionToken`), else the default AWS chain
/// (IRSA / web identity, environment, instance role).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("!has(self.endpoint) || self.endpoint.matches('^https?://[^/@?#]+/?$')").message("s3 endpoint must be http(s)://host[:port] without credentials"),
)]
pub struct S3Bodies {
    #[schemars(length(min = 3, max = 63))]
    pub bucket: String,
    /// Key prefix, e.g. `payments/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub prefix: Option<String>,
    /// An S3-compatible endpoint or a VPC endpoint; path-style addressing is used with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<BodiesSecretRef>,
    /// Where SQS Extended Client pointers may name their objects besides this store's own bucket
    /// and prefix (the default, and all there is without this list). A record naming any other
    /// object is refused unread: the operator reads no object of its credentials' reach that the
    /// queue did not declare.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub external_buckets: Vec<ExternalBucket>,
}

/// A bucket (on the store's endpoint, with its credentials) and key prefix that producers'
/// SQS Extended Clients offload bodies to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ExternalBucket {
    #[schemars(length(min = 3, max = 63))]
    pub bucket: String,
    /// Only keys under this prefix (whole path segments); absent: the whole bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub prefix: Option<String>,
}

/// Google Cloud Storage. Credentials from `credentialsSecretRef` (key `serviceAccountKey`, a
/// service-account key's JSON), else the pod's workload identity.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GcsBodies {
    #[schemars(length(min = 3, max = 222))]
    pub bucket: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<BodiesSecretRef>,
}

/// Azure Blob Storage. Credentials from `credentialsSecretRef` (key `accessKey`), else the
/// pod's workload identity.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AzureBodies {
    #[schemars(length(min = 3, max = 24))]
    pub account: String,
    #[schemars(length(min = 3, max = 63))]
    pub container: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<BodiesSecretRef>,
}

/// A directory on a volume mounted into the operator's pod (a PVC): the embedded store for a
/// single-replica install.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.path.startsWith('/') && !self.path.contains('..')").message("spec.bodies.volume.path must be an absolute path without '..'"))]
pub struct VolumeBodies {
    #[schemars(length(min = 1, max = 1024))]
    pub path: String,
}

/// A Secret in the DeadLetterQueue's namespace whose keys are the store's credentials.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct BodiesSecretRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}
