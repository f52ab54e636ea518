//! versitygw, Versity's S3 gateway, as the S3-compatible server of the body-store tests (issue
//! 48). Built from its Go module by `tools/build.sh versitygw` (`tools/versitygw/go.mod`, cached
//! outside the repo like toxiproxy; with `DLQ_TOOLS_BIN` set, one of those dirs must hold
//! `versitygw`). It runs its posix backend on a temp dir, on a free `127.0.0.1` port, with a
//! root access key and secret generated per server (passed in its environment,
//! `ROOT_ACCESS_KEY_ID`/`ROOT_SECRET_ACCESS_KEY`, not its command line), region
//! [`REGION`]. No IAM service: versitygw runs in single-account mode and only the root key is
//! accepted.
//!
//! What a client has to know about it (versitygw v1.8.0, checked by hand and by the tests
//! below):
//! - Path-style addressing only (`http://127.0.0.1:PORT/<bucket>/<key>`): virtual-host style
//!   needs `--virtual-domain`, which is not set. object_store's S3 client is path-style unless
//!   told otherwise; plain HTTP to loopback needs `with_allow_http(true)`.
//! - SigV4 with an `x-amz-content-sha256` header on every request (a request without it is
//!   refused with `InvalidRequest`, even if signed; curl's `--aws-sigv4` alone fails).
//!   object_store always sends it.
//! - Buckets: under the posix backend a bucket is a directory of the root (any directory made
//!   there by hand is listed as a bucket), but such a bucket has none of the ownership/ACL
//!   extended attributes that CreateBucket writes. [`S3Server::create_bucket`] therefore uses
//!   the S3 CreateBucket call itself (a SigV4-signed `PUT /<bucket>`, signed here with ring,
//!   since object_store has no bucket calls); creating a bucket that exists is not an error.
//! - Objects are plain files (`<root>/<bucket>/<key>`, the key split on `/`); the ETag and
//!   checksums are extended attributes (`user.etag`, ...), so the temp dir must be on a
//!   filesystem with user xattrs (ext4 and xfs are; old tmpfs is not). As on a filesystem, a key
//!   cannot be both an object and a "directory" of other keys (`a` and `a/b`).
//! - ETags are MD5s of the body for a single PUT, and `"<md5 of the parts' md5s>-<parts>"` for a
//!   multipart upload, as on AWS. Multipart uploads (object_store's `put_multipart`, 5 MiB
//!   parts) work; the parts are staged under `<bucket>/.sgwtmp` and never listed.
//! - Started with `--keep-alive` (versitygw closes every connection after one response
//!   otherwise, which no real S3 does): clients pool connections, and a [`S3Server::stop`]
//!   breaks the pooled ones as an outage would.
//!
//! Every request is written to its access log ([`S3Server::requests_for`]), so a test can see
//! which objects a client asked for.
//!
//! [`S3Server::stop`] kills it (connections refused: an unreachable bucket), [`S3Server::pause`]
//! stops it with SIGSTOP (connections accepted by the kernel, never answered: a hanging one);
//! [`S3Server::restart`] and [`S3Server::resume`] undo them, with the objects kept on disk. It
//! dies on drop, and with the thread that started it if the test process dies.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};
use ring::hmac;
use sha2::{Digest, Sha256};

use crate::plane::{TestenvError, find_binary, spawn_guarded, tool_dirs};

/// The region versitygw is started with, and clients sign with.
pub const REGION: &str = "us-east-1";

/// A versitygw S3 server (posix backend) on a free loopback port; killed on drop.
pub struct S3Server {
    port: u16,
    bin: PathBuf,
    /// The scratch dir: the log, and `root/` (the buckets).
    dir: PathBuf,
    access_key: String,
    secret_key: String,
    child: Option<Child>,
}

impl S3Server {
    /// Builds versitygw if needed (`tools/build.sh versitygw`, once), starts it on a fresh temp
    /// dir and a free loopback port, and waits until it listens. Panics, with its log, if it
    /// does not.
    pub fn start() -> S3Server {
        Self::try_start().unwrap_or_else(|e| panic!("starting versitygw: {e}"))
    }

    /// [`S3Server::start`] with the error returned.
    pub fn try_start() -> Result<S3Server, TestenvError> {
        let dirs = tool_dirs(&["versitygw"])?;
        let bin = find_binary(&dirs, "versitygw")?;
        let port = crate::plane::free_port()?;
        let dir = super::child::temp_dir("s3", port);
        crate::plane::io(
            "creating the S3 root",
            std::fs::create_dir_all(dir.join("root")),
        )?;
        let mut s = S3Server {
            port,
            bin,
            dir,
            access_key: format!("DLQ{}", random_hex(9)?.to_uppercase()),
            secret_key: random_hex(20)?,
            child: None,
        };
        s.try_restart()?;
        Ok(s)
    }

    /// `http://127.0.0.1:<port>`: the endpoint for path-style S3 clients.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id while it runs (a bench reads its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The root user's access key id.
    pub fn access_key(&self) -> &str {
        &self.access_key
    }

    /// The root user's secret access key.
    pub fn secret_key(&self) -> &str {
        &self.secret_key
    }

    /// The directory of bucket `bucket` on disk (`<root>/<bucket>`), to look at what was stored.
    pub fn bucket_dir(&self, bucket: &str) -> PathBuf {
        self.dir.join("root").join(bucket)
    }

    /// versitygw's own log (stdout and stderr).
    pub fn log(&self) -> PathBuf {
        self.dir.join("versitygw.log")
    }

    /// versitygw's access log: a line per request (bucket, operation, key, status, ...).
    pub fn access_log(&self) -> PathBuf {
        self.dir.join("access.log")
    }

    /// The access log's lines of requests on `key` of `bucket`, any operation: what a client
    /// asked of that object, whatever it was told.
    pub fn requests_for(&self, bucket: &str, key: &str) -> Vec<String> {
        let log = std::fs::read_to_string(self.access_log()).unwrap_or_default();
        log.lines()
            .filter(|l| {
                let fields: Vec<&str> = l.split(' ').collect();
                fields.get(1) == Some(&bucket) && fields.contains(&key)
            })
            .map(str::to_string)
            .collect()
    }

    /// An object_store builder for `bucket` on this server: endpoint, root keys, region,
    /// path-style, plain HTTP allowed. Add retry or client options before `build()`.
    pub fn store_builder(&self, bucket: &str) -> AmazonS3Builder {
        install_ring_provider();
        AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region(REGION)
            .with_bucket_name(bucket)
            .with_access_key_id(&self.access_key)
            .with_secret_access_key(&self.secret_key)
    }

    /// The client the helpers below use: [`S3Server::store_builder`] with few, quick retries, so
    /// a helper called while the server is stopped fails in about a second.
    pub fn store(&self, bucket: &str) -> AmazonS3 {
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_millis(500),
                base: 2.0,
            },
            max_retries: 2,
            retry_timeout: Duration::from_secs(5),
        };
        self.store_builder(bucket)
            .with_retry(retry)
            .build()
            .unwrap_or_else(|e| panic!("an S3 client for {bucket} on {}: {e}", self.endpoint()))
    }

    /// A Secret `name` in `ns` with this server's keys as a body store reads them
    /// (`accessKeyId`, `secretAccessKey`).
    pub async fn credentials_secret(&self, client: &kube::Client, ns: &str, name: &str) {
        use k8s_openapi::api::core::v1::Secret;
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            string_data: Some(
                [
                    ("accessKeyId".to_string(), self.access_key().to_string()),
                    ("secretAccessKey".to_string(), self.secret_key().to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let api: kube::Api<Secret> = kube::Api::namespaced(client.clone(), ns);
        if let Err(e) = api.create(&Default::default(), &secret).await {
            panic!("the S3 credentials Secret {ns}/{name}: {e}");
        }
    }

    /// Creates `bucket` with S3's CreateBucket (a bucket that exists already is fine).
    pub async fn create_bucket(&self, bucket: &str) {
        let (status, body) = self.signed("PUT", bucket).await;
        if !(status.is_success() || body.contains("BucketAlreadyOwnedByYou")) {
            panic!("CreateBucket {bucket}: {status}: {body}");
        }
    }

    /// Deletes `bucket` with S3's DeleteBucket (it must be empty, as on AWS).
    pub async fn delete_bucket(&self, bucket: &str) {
        let (status, body) = self.signed("DELETE", bucket).await;
        if !status.is_success() {
            panic!("DeleteBucket {bucket}: {status}: {body}");
        }
    }

    /// Stores `bytes` as `bucket/key` in one PUT.
    pub async fn put_object(&self, bucket: &str, key: &str, bytes: impl Into<Vec<u8>>) {
        self.store(bucket)
            .put(&ObjectPath::from(key), PutPayload::from(bytes.into()))
            .await
            .unwrap_or_else(|e| panic!("PUT {bucket}/{key}: {e}"));
    }

    /// Stores `bytes` as `bucket/key` with a multipart upload of `part_size`-byte parts (S3's
    /// minimum is 5 MiB for every part but the last), two parts in flight at a time.
    pub async fn put_object_multipart(
        &self,
        bucket: &str,
        key: &str,
        bytes: &[u8],
        part_size: usize,
    ) {
        let what = || format!("multipart PUT {bucket}/{key}");
        let upload = self
            .store(bucket)
            .put_multipart(&ObjectPath::from(key))
            .await;
        let mut writer = WriteMultipart::new_with_chunk_size(or_panic(upload, what), part_size);
        for chunk in bytes.chunks(part_size) {
            or_panic(writer.wait_for_capacity(2).await, what);
            writer.write(chunk);
        }
        or_panic(writer.finish().await, what);
    }

    /// The body of `bucket/key`, or `None` if there is no such object.
    pub async fn get_object(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let store = self.store(bucket);
        let got = match store.get(&ObjectPath::from(key)).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return None,
            Err(e) => panic!("GET {bucket}/{key}: {e}"),
        };
        let bytes = got
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("reading GET {bucket}/{key}: {e}"));
        Some(bytes.to_vec())
    }

    /// Deletes `bucket/key` (no error if it does not exist, as on S3).
    pub async fn delete_object(&self, bucket: &str, key: &str) {
        match self.store(bucket).delete(&ObjectPath::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => panic!("DELETE {bucket}/{key}: {e}"),
        }
    }

    /// Every key of `bucket` under `prefix`, sorted. The prefix is object_store's: whole path
    /// segments (`"a/b"` lists `a/b/...`, not `a/bc`); `""` lists the whole bucket.
    pub async fn list_keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let prefix = (!prefix.is_empty()).then(|| ObjectPath::from(prefix));
        let mut keys: Vec<String> = self
            .store(bucket)
            .list(prefix.as_ref())
            .map_ok(|meta| meta.location.to_string())
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("LIST {bucket} {prefix:?}: {e}"));
        keys.sort();
        keys
    }

    /// Kills it (SIGKILL): connections are refused until [`S3Server::restart`].
    pub fn stop(&mut self) {
        super::child::stop_child(&mut self.child);
        super::child::wait_closed(self.port, 10);
    }

    /// Starts it again on the same port and root, with every bucket and object kept. Panics,
    /// with its log, if it does not listen.
    pub fn restart(&mut self) {
        self.try_restart()
            .unwrap_or_else(|e| panic!("restarting versitygw: {e}"));
    }

    /// [`S3Server::restart`] with the error returned.
    pub fn try_restart(&mut self) -> Result<(), TestenvError> {
        if self.child.is_some() {
            return Err(TestenvError::Setup("versitygw is already running".into()));
        }
        let log = self.log();
        let mut cmd = Command::new(&self.bin);
        cmd.env("ROOT_ACCESS_KEY_ID", &self.access_key)
            .env("ROOT_SECRET_ACCESS_KEY", &self.secret_key)
            .args(["--port", &format!("127.0.0.1:{}", self.port)])
            .arg("--access-log")
            .arg(self.access_log())
            .args(["--region", REGION, "--keep-alive", "--quiet", "posix"])
            .arg(self.dir.join("root"));
        self.child = Some(spawn_guarded(&mut cmd, &log)?);
        self.wait_listening(&log)
    }

    /// Freezes it (SIGSTOP): connections are accepted by the kernel and never answered, as with
    /// a partitioned endpoint, until [`S3Server::resume`].
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Undoes [`S3Server::pause`] (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let Some(pid) = self.child.as_ref().and_then(|c| i32::try_from(c.id()).ok()) else {
            panic!("versitygw is not running");
        };
        // SAFETY: a signal to our own child, which has not been reaped (we hold its Child).
        if unsafe { libc::kill(pid, signal) } != 0 {
            panic!(
                "signal {signal} to versitygw: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    fn wait_listening(&mut self, log: &Path) -> Result<(), TestenvError> {
        super::child::wait_child_listening(&mut self.child, self.port, 30, "versitygw", log)
    }

    /// One SigV4-signed request with an empty body on `/<path>` (the bucket calls object_store
    /// lacks); the status and body of the answer.
    async fn signed(&self, method: &str, path: &str) -> (reqwest::StatusCode, String) {
        install_ring_provider();
        let now = jiff::Timestamp::now();
        let (stamp, day) = (
            now.strftime("%Y%m%dT%H%M%SZ").to_string(),
            now.strftime("%Y%m%d").to_string(),
        );
        let host = format!("127.0.0.1:{}", self.port);
        let uri = format!("/{path}");
        let empty = hex::encode(Sha256::digest(b""));
        let signed_headers = "host;x-amz-content-sha256;x-amz-date";
        let canonical = format!(
            "{method}\n{uri}\n\nhost:{host}\nx-amz-content-sha256:{empty}\nx-amz-date:{stamp}\n\n\
             {signed_headers}\n{empty}"
        );
        let scope = format!("{day}/{REGION}/s3/aws4_request");
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let mac = |key: &[u8], data: &str| {
            hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data.as_bytes())
                .as_ref()
                .to_vec()
        };
        let mut key = mac(format!("AWS4{}", self.secret_key).as_bytes(), &day);
        for part in [REGION, "s3", "aws4_request"] {
            key = mac(&key, part);
        }
        let signature = hex::encode(mac(&key, &to_sign));
        let authorization = format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, \
             Signature={signature}",
            self.access_key
        );
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .unwrap_or_else(|e| panic!("HTTP method {method}: {e}"));
        let what = || format!("{method} {uri} on {host}");
        let answer = reqwest::Client::new()
            .request(method.clone(), format!("http://{host}{uri}"))
            .header("x-amz-date", &stamp)
            .header("x-amz-content-sha256", &empty)
            .header("authorization", authorization)
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let answer = or_panic(answer, what);
        let status = answer.status();
        (status, or_panic(answer.text().await, what))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // SIGKILL ends a stopped (paused) process too.
        super::child::stop_child(&mut self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// reqwest here has no TLS provider of its own (`rustls-no-provider`), and building a client
/// needs one even for plain HTTP: ring's, as the operator installs it.
fn install_ring_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The value, or a panic naming what failed: the helpers' way of failing a test.
fn or_panic<T, E: std::fmt::Display>(r: Result<T, E>, what: impl Fn() -> String) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{}: {e}", what()),
    }
}

fn random_hex(bytes: usize) -> Result<String, TestenvError> {
    use ring::rand::SecureRandom;
    let mut buf = vec![0u8; bytes];
    ring::rand::SystemRandom::new()
        .fill(&mut buf)
        .map_err(|_| TestenvError::Setup("no randomness for the S3 keys".into()))?;
    Ok(hex::encode(buf))
}

#[cfg(test)]
mod tests {
    use object_store::ObjectStoreExt;
    use object_store::path::Path;

    use std::time::Duration;

    use super::S3Server;

    /// A deterministic, non-repeating body: catches swapped or dropped parts, not only sizes.
    fn body(len: usize, seed: u32) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 24) as u8
            })
            .collect()
    }

    #[tokio::test]
    async fn objects_round_trip_byte_exact() {
        let mut s3 = S3Server::start();
        s3.create_bucket("bodies").await;
        s3.create_bucket("bodies").await; // again: fine
        assert!(s3.bucket_dir("bodies").is_dir());

        let five = body(5 << 20, 7);
        s3.put_object("bodies", "ns/q/one", five.clone()).await;
        s3.put_object("bodies", "ns/q/two", b"small".to_vec()).await;
        s3.put_object("bodies", "other/three", b"x".to_vec()).await;
        let got = s3.get_object("bodies", "ns/q/one").await;
        assert!(
            got.as_deref() == Some(five.as_slice()),
            "5 MiB body differs"
        );
        assert_eq!(
            s3.list_keys("bodies", "ns/q").await,
            ["ns/q/one", "ns/q/two"]
        );
        assert_eq!(s3.list_keys("bodies", "").await.len(), 3);
        assert_eq!(s3.get_object("bodies", "ns/q/none").await, None);

        s3.delete_object("bodies", "ns/q/one").await;
        s3.delete_object("bodies", "ns/q/one").await; // again: fine
        assert_eq!(s3.get_object("bodies", "ns/q/one").await, None);
        assert_eq!(s3.list_keys("bodies", "ns").await, ["ns/q/two"]);

        // Unreachable: refused while stopped, everything back after a restart.
        s3.stop();
        let down = s3.store("bodies").get(&Path::from("ns/q/two")).await;
        assert!(down.is_err(), "a stopped server answered");
        s3.restart();
        assert_eq!(
            s3.get_object("bodies", "ns/q/two").await.as_deref(),
            Some(&b"small"[..])
        );

        // A wrong secret is refused.
        let wrong = s3
            .store_builder("bodies")
            .with_secret_access_key("not-the-secret")
            .build()
            .unwrap();
        let wrong = wrong.get(&Path::from("ns/q/two")).await;
        assert!(wrong.is_err(), "a wrong secret was accepted");
    }

    #[tokio::test]
    async fn a_60_mib_multipart_upload_round_trips() {
        let s3 = S3Server::start();
        s3.create_bucket("big").await;
        let big = body(60 << 20, 11);
        s3.put_object_multipart("big", "blob", &big, 5 << 20).await;
        let meta = s3.store("big").head(&Path::from("blob")).await.unwrap();
        assert_eq!(meta.size, 60 << 20);
        // A multipart ETag, as on AWS: "<md5 of the parts' md5s>-<parts>".
        assert!(
            meta.e_tag.as_deref().is_some_and(|t| t.ends_with("-12\"")),
            "{:?}",
            meta.e_tag
        );
        let got = s3.get_object("big", "blob").await;
        assert!(
            got.as_deref() == Some(big.as_slice()),
            "60 MiB body differs"
        );
        assert_eq!(s3.list_keys("big", "").await, ["blob"]);
    }

    #[tokio::test]
    async fn a_paused_server_hangs_until_resumed() {
        let s3 = S3Server::start();
        s3.create_bucket("paused").await;
        s3.put_object("paused", "k", b"v".to_vec()).await;
        s3.pause();
        let store = s3.store("paused");
        let key = Path::from("k");
        let hung = tokio::time::timeout(Duration::from_millis(500), store.get(&key)).await;
        assert!(hung.is_err(), "a paused server answered");
        s3.resume();
        assert_eq!(
            s3.get_object("paused", "k").await.as_deref(),
            Some(&b"v"[..])
        );
    }
}
