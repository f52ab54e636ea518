//! fake-gcs-server (github.com/fsouza/fake-gcs-server), a Google Cloud Storage emulator, as the
//! GCS server of the body-store tests (issue 48). Built by `tools/build.sh fake-gcs-server`
//! (`tools/fake-gcs-server`: a small main around upstream's `fakestorage` package from the
//! module its go.mod pins, cached outside the repo like versitygw; with `DLQ_TOOLS_BIN` set, one
//! of those dirs must hold `fake-gcs-server`). It runs on a free `127.0.0.1` port over plain
//! HTTP with its filesystem backend on a temp dir, and dies on drop (and with the thread that
//! started it if the test process dies).
//!
//! What a client has to know about it (fakestorage v1.56.1, checked by the tests below and
//! tests/bodies_clouds.rs):
//! - No authentication: any bearer token, or none, is accepted. object_store's GCS client is
//!   pointed at it by a service-account key JSON ([`GcsServer::service_account_key`]) with
//!   `gcs_base_url` (the server) and `disable_oauth: true` (an empty bearer, no token exchange,
//!   the private key never parsed; `private_key`, `private_key_id` and `client_email` must
//!   still be present).
//! - object_store speaks GCS's XML API for objects (`PUT`/`GET`/`DELETE /<bucket>/<key>`, list
//!   as `GET /<bucket>?list-type=2`; the JSON API only for what XML lacks). Upstream serves the
//!   XML API only for requests whose `Host` is its public host (`-public-host 127.0.0.1:<port>`
//!   here; otherwise `127.0.0.1:<port>` is taken as a virtual-host bucket name), and has no XML
//!   object upload at all (its issue #331: a plain `PUT /<bucket>/<key>` is answered
//!   `400 invalid uploadType`). tools/fake-gcs-server/main.go serves that PUT as upstream's own
//!   JSON media upload and answers it the XML way (ETag, x-goog-generation); everything else
//!   is upstream's. Its listing has no pages (every key in one answer). Not served either way:
//!   XML multipart uploads (object_store's `put_multipart`, which the body store uses above
//!   8 MiB), so bodies here stay below that.
//! - Buckets are made with the JSON API (`POST /storage/v1/b`, [`GcsServer::create_bucket`]);
//!   an upload to a missing bucket is refused (404).
//! - The helpers below use the JSON API directly (not object_store), so what the tests read back
//!   is the server's view, not the operator's client's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use serde_json::{Value, json};

use crate::plane::{TestenvError, find_binary, spawn_guarded, tool_dirs};

/// A fake-gcs-server (filesystem backend, plain HTTP) on a free loopback port; killed on drop.
pub struct GcsServer {
    port: u16,
    /// The scratch dir: the log and `root/` (the filesystem backend's buckets and objects).
    dir: PathBuf,
    child: Option<Child>,
}

impl GcsServer {
    /// Builds fake-gcs-server if needed (`tools/build.sh fake-gcs-server`, once), starts it on
    /// a fresh temp dir and a free loopback port, and waits until it answers. Panics, with its
    /// log, if it does not.
    pub fn start() -> GcsServer {
        Self::try_start().unwrap_or_else(|e| panic!("starting fake-gcs-server: {e}"))
    }

    /// [`GcsServer::start`] with the error returned.
    pub fn try_start() -> Result<GcsServer, TestenvError> {
        let dirs = tool_dirs(&["fake-gcs-server"])?;
        let bin = find_binary(&dirs, "fake-gcs-server")?;
        let port = crate::plane::free_port()?;
        let dir = super::child::temp_dir("gcs", port);
        crate::plane::io(
            "creating the GCS root",
            std::fs::create_dir_all(dir.join("root")),
        )?;
        let mut s = GcsServer {
            port,
            dir,
            child: None,
        };
        let mut cmd = Command::new(bin);
        cmd.args(["-host", "127.0.0.1", "-port", &port.to_string()])
            .args(["-public-host", &format!("127.0.0.1:{port}")])
            .arg("-filesystem-root")
            .arg(s.dir.join("root"));
        let log = s.log();
        s.child = Some(spawn_guarded(&mut cmd, &log)?);
        s.wait_listening(&log)?;
        Ok(s)
    }

    /// `http://127.0.0.1:<port>`: the base URL for GCS clients (object_store's `gcs_base_url`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// fake-gcs-server's own log (stdout and stderr).
    pub fn log(&self) -> PathBuf {
        self.dir.join("fake-gcs-server.log")
    }

    /// A service-account key JSON (a queue Secret's `serviceAccountKey`) that points
    /// object_store's GCS client at this server: `gcs_base_url` and `disable_oauth`, with
    /// placeholders for the fields the format requires and an emulator never checks.
    pub fn service_account_key(&self) -> String {
        json!({
            "type": "service_account",
            "private_key_id": "fake-gcs-server",
            "private_key": "unused: disable_oauth",
            "client_email": "dlq-tests@fake-gcs-server.invalid",
            "gcs_base_url": self.endpoint(),
            "disable_oauth": true,
        })
        .to_string()
    }

    /// Creates `bucket` (JSON API `buckets.insert`; one that exists already is fine).
    pub async fn create_bucket(&self, bucket: &str) {
        let url = format!("{}/storage/v1/b", self.endpoint());
        let answer = self
            .send(
                client()
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(json!({"name": bucket}).to_string()),
            )
            .await;
        let (status, body) = (answer.status(), text(answer).await);
        if !(status.is_success() || status == reqwest::StatusCode::CONFLICT) {
            panic!("creating bucket {bucket}: {status}: {body}");
        }
    }

    /// Stores `bytes` as `bucket/key` (JSON API media upload).
    pub async fn put_object(&self, bucket: &str, key: &str, bytes: impl Into<Vec<u8>>) {
        let url = format!(
            "{}/upload/storage/v1/b/{}/o?uploadType=media&name={}",
            self.endpoint(),
            encode(bucket),
            encode(key)
        );
        let request = client()
            .post(&url)
            .header("content-type", "application/octet-stream")
            .body(bytes.into());
        let answer = self.send(request).await;
        let status = answer.status();
        if !status.is_success() {
            panic!("uploading {bucket}/{key}: {status}: {}", text(answer).await);
        }
    }

    /// The body of `bucket/key`, or `None` if there is no such object.
    pub async fn get_object(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let answer = self
            .send(client().get(format!("{}?alt=media", self.object_url(bucket, key))))
            .await;
        let status = answer.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        if !status.is_success() {
            panic!("GET {bucket}/{key}: {status}: {}", text(answer).await);
        }
        match answer.bytes().await {
            Ok(bytes) => Some(bytes.to_vec()),
            Err(e) => panic!("reading GET {bucket}/{key}: {e}"),
        }
    }

    /// Deletes `bucket/key` (no error if it does not exist).
    pub async fn delete_object(&self, bucket: &str, key: &str) {
        let answer = self
            .send(client().delete(self.object_url(bucket, key)))
            .await;
        let status = answer.status();
        if !(status.is_success() || status == reqwest::StatusCode::NOT_FOUND) {
            panic!("DELETE {bucket}/{key}: {status}: {}", text(answer).await);
        }
    }

    /// Every object name of `bucket` starting with `prefix` (a plain string prefix, as GCS's
    /// own), sorted.
    pub async fn list_keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut page: Option<String> = None;
        loop {
            let mut url = format!(
                "{}/storage/v1/b/{}/o?prefix={}",
                self.endpoint(),
                encode(bucket),
                encode(prefix)
            );
            if let Some(token) = &page {
                url.push_str(&format!("&pageToken={}", encode(token)));
            }
            let answer = self.send(client().get(&url)).await;
            let status = answer.status();
            let body = text(answer).await;
            if !status.is_success() {
                panic!("listing {bucket}/{prefix}: {status}: {body}");
            }
            let listed: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("listing {bucket}/{prefix}: {e}: {body}"));
            for item in listed["items"].as_array().into_iter().flatten() {
                if let Some(name) = item["name"].as_str() {
                    keys.push(name.to_string());
                }
            }
            match listed["nextPageToken"].as_str() {
                Some(token) if !token.is_empty() => page = Some(token.to_string()),
                _ => break,
            }
        }
        keys.sort();
        keys
    }

    fn object_url(&self, bucket: &str, key: &str) -> String {
        format!(
            "{}/storage/v1/b/{}/o/{}",
            self.endpoint(),
            encode(bucket),
            encode(key)
        )
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> reqwest::Response {
        match request.timeout(Duration::from_secs(30)).send().await {
            Ok(answer) => answer,
            Err(e) => panic!(
                "fake-gcs-server on {}: {e}; log:\n{}",
                self.endpoint(),
                crate::plane::tail(&self.log(), 30)
            ),
        }
    }

    fn wait_listening(&mut self, log: &Path) -> Result<(), TestenvError> {
        super::child::wait_child_listening(&mut self.child, self.port, 30, "fake-gcs-server", log)
    }
}

impl Drop for GcsServer {
    fn drop(&mut self) {
        super::child::stop_child(&mut self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A plain-HTTP client. reqwest here has no TLS provider of its own (`rustls-no-provider`), and
/// building a client needs one even for plain HTTP: ring's, as the operator installs it.
pub(super) fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub(super) async fn text(answer: reqwest::Response) -> String {
    answer.text().await.unwrap_or_else(|e| format!("({e})"))
}

/// Percent-encodes everything but RFC 3986's unreserved characters (so `/` too: an object name
/// is one path segment of the JSON API).
pub(super) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::GcsServer;

    /// The helpers against the real server: a bucket, an object with a `/` in its name, its
    /// bytes back, the listing by prefix, a delete, and a missing object.
    #[tokio::test]
    async fn objects_round_trip_through_the_json_api() {
        let gcs = GcsServer::start();
        gcs.create_bucket("bkt").await;
        gcs.create_bucket("bkt").await;
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        gcs.put_object("bkt", "p/sha256/x", body.clone()).await;
        gcs.put_object("bkt", "q/y", b"other".to_vec()).await;
        assert_eq!(gcs.get_object("bkt", "p/sha256/x").await, Some(body));
        assert_eq!(gcs.list_keys("bkt", "p/").await, vec!["p/sha256/x"]);
        assert_eq!(gcs.list_keys("bkt", "").await.len(), 2);
        gcs.delete_object("bkt", "p/sha256/x").await;
        gcs.delete_object("bkt", "p/sha256/x").await;
        assert_eq!(gcs.get_object("bkt", "p/sha256/x").await, None);
        assert!(gcs.list_keys("bkt", "p/").await.is_empty());

        // The XML API upload tools/fake-gcs-server adds: an empty answer with the object's ETag
        // and generation, the bytes stored; a missing bucket is a 404, as on GCS.
        let xml = |bucket: &str| format!("{}/{bucket}/p%2Fsha256%2Fz", gcs.endpoint());
        let put = super::client()
            .put(xml("bkt"))
            .body(b"xml".to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(put.status(), 200);
        assert!(
            put.headers().contains_key("etag") && put.headers().contains_key("x-goog-generation")
        );
        assert!(put.text().await.unwrap().is_empty());
        assert_eq!(
            gcs.get_object("bkt", "p/sha256/z").await.as_deref(),
            Some(&b"xml"[..])
        );
        let missing = super::client()
            .put(xml("nope"))
            .body(b"x".to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);
    }
}
