//! Azurite (Microsoft's Azure Storage emulator, Node.js) as the Azure Blob server of the
//! body-store tests (issue 48). Installed from the npm registry by `tools/build.sh azurite`
//! (`tools/azurite/package.json` and its lock, `npm ci` into the tools cache; with
//! `DLQ_TOOLS_BIN` set, one of those dirs must hold `azurite-blob`). Only its blob service runs
//! (`azurite-blob`), on a free `127.0.0.1` port over plain HTTP, its data in a temp dir; it dies
//! on drop (and with the thread that started it if the test process dies). It needs `node` on
//! the PATH (Node.js >= 20: Azurite 3.35.0 is the last release that runs on 20; 3.36 wants 21,
//! 3.37 wants 22).
//!
//! What a client has to know about it (Azurite 3.35.0, checked by the tests below and
//! tests/bodies_clouds.rs):
//! - One account, the well-known [`ACCOUNT`] with key [`ACCOUNT_KEY`], in path style:
//!   `http://127.0.0.1:<port>/devstoreaccount1/<container>/<blob>`. Requests are signed with
//!   Shared Key as on Azure (the canonicalized resource is `/<account>` + the URL path, so the
//!   account appears twice).
//! - object_store's Azure client reaches it in its emulator mode: `AZURE_STORAGE_USE_EMULATOR=true`
//!   and `AZURITE_BLOB_STORAGE_URL=http://127.0.0.1:<port>` in the environment
//!   ([`AzuriteServer::operator_env`]); `MicrosoftAzureBuilder::from_env()` reads the first,
//!   its `build()` the second (default `http://127.0.0.1:10000`). The account and key given to
//!   the builder are used as they are (the well-known ones if none).
//! - Started with `--skipApiVersionCheck` (a client's `x-ms-version` newer than Azurite knows is
//!   otherwise refused) and `--disableTelemetry` (Azurite otherwise sends usage data to
//!   Application Insights: no network here, and none wanted from a test).
//! - Containers are made with Create Container ([`AzuriteServer::create_container`], Shared Key
//!   signed here with ring: object_store has no container calls).
//! - The helpers below sign their own Blob REST requests (not object_store), so what the tests
//!   read back is the server's view, not the operator's client's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ring::hmac;

use super::gcs::{client, encode, text};
use crate::plane::{TestenvError, find_binary, spawn_guarded, tool_dirs};

/// Azurite's well-known storage account.
pub const ACCOUNT: &str = "devstoreaccount1";
/// Azurite's well-known account key (base64), as Microsoft documents it.
pub const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
/// The Blob REST version the helpers speak.
const API_VERSION: &str = "2021-08-06";

/// Azurite's blob service on a free loopback port; killed on drop.
pub struct AzuriteServer {
    port: u16,
    /// The scratch dir: the log and `data/` (Azurite's databases and extents).
    dir: PathBuf,
    child: Option<Child>,
}

impl AzuriteServer {
    /// Installs Azurite if needed (`tools/build.sh azurite`, once), starts its blob service on
    /// a fresh temp dir and a free loopback port, and waits until it listens. Panics, with its
    /// log, if it does not.
    pub fn start() -> AzuriteServer {
        Self::try_start().unwrap_or_else(|e| panic!("starting Azurite: {e}"))
    }

    /// [`AzuriteServer::start`] with the error returned.
    pub fn try_start() -> Result<AzuriteServer, TestenvError> {
        if super::child::which("node").is_none() {
            return Err(TestenvError::Setup(
                "Azurite needs Node.js: 'node' is not on PATH; install Node.js >= 20 with npm \
                 (apt-get install nodejs npm, or https://nodejs.org)"
                    .into(),
            ));
        }
        let dirs = tool_dirs(&["azurite"])?;
        let bin = find_binary(&dirs, "azurite-blob")?;
        let port = crate::plane::free_port()?;
        let dir = super::child::temp_dir("azurite", port);
        crate::plane::io(
            "creating the Azurite dir",
            std::fs::create_dir_all(dir.join("data")),
        )?;
        let mut s = AzuriteServer {
            port,
            dir,
            child: None,
        };
        let mut cmd = Command::new(bin);
        cmd.args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .arg("--location")
            .arg(s.dir.join("data"))
            .args(["--skipApiVersionCheck", "--disableTelemetry", "--silent"]);
        let log = s.log();
        s.child = Some(spawn_guarded(&mut cmd, &log)?);
        s.wait_listening(&log)?;
        Ok(s)
    }

    /// `http://127.0.0.1:<port>`: the emulator URL object_store reads from
    /// `AZURITE_BLOB_STORAGE_URL` (the account is added as the first path segment).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Azurite's own log (stdout and stderr).
    pub fn log(&self) -> PathBuf {
        self.dir.join("azurite.log")
    }

    /// The environment that puts object_store's Azure client (the operator's) in emulator
    /// mode against this server.
    pub fn operator_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AZURE_STORAGE_USE_EMULATOR", "true".to_string()),
            ("AZURITE_BLOB_STORAGE_URL", self.endpoint()),
        ]
    }

    /// Creates `container` (Create Container; one that exists already is fine).
    pub async fn create_container(&self, container: &str) {
        let (status, body) = self
            .signed("PUT", container, &[("restype", "container")], &[], None)
            .await;
        if !(status.is_success() || body.contains("ContainerAlreadyExists")) {
            panic!("creating container {container}: {status}: {body}");
        }
    }

    /// Stores `bytes` as the block blob `container/key` (Put Blob).
    pub async fn put_object(&self, container: &str, key: &str, bytes: impl Into<Vec<u8>>) {
        let path = format!("{container}/{}", encode_path(key));
        let headers = [
            ("x-ms-blob-type", "BlockBlob"),
            ("content-type", "application/octet-stream"),
        ];
        let (status, body) = self
            .signed("PUT", &path, &[], &headers, Some(bytes.into()))
            .await;
        if !status.is_success() {
            panic!("Put Blob {container}/{key}: {status}: {body}");
        }
    }

    /// The body of `container/key`, or `None` if there is no such blob.
    pub async fn get_object(&self, container: &str, key: &str) -> Option<Vec<u8>> {
        let path = format!("{container}/{}", encode_path(key));
        let answer = self.request("GET", &path, &[], &[], None).await;
        let status = answer.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        if !status.is_success() {
            panic!(
                "Get Blob {container}/{key}: {status}: {}",
                text(answer).await
            );
        }
        match answer.bytes().await {
            Ok(bytes) => Some(bytes.to_vec()),
            Err(e) => panic!("reading Get Blob {container}/{key}: {e}"),
        }
    }

    /// Deletes `container/key` (no error if it does not exist).
    pub async fn delete_object(&self, container: &str, key: &str) {
        let path = format!("{container}/{}", encode_path(key));
        let (status, body) = self.signed("DELETE", &path, &[], &[], None).await;
        if !(status.is_success() || status == reqwest::StatusCode::NOT_FOUND) {
            panic!("Delete Blob {container}/{key}: {status}: {body}");
        }
    }

    /// Every blob name of `container` starting with `prefix`, sorted (List Blobs, every page).
    pub async fn list_keys(&self, container: &str, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut marker = String::new();
        loop {
            let mut query = vec![
                ("restype", "container"),
                ("comp", "list"),
                ("prefix", prefix),
            ];
            if !marker.is_empty() {
                query.push(("marker", &marker));
            }
            let (status, body) = self.signed("GET", container, &query, &[], None).await;
            if !status.is_success() {
                panic!("List Blobs {container}/{prefix}: {status}: {body}");
            }
            keys.extend(elements(&body, "Blob").map(|blob| {
                unescape(
                    elements(blob, "Name")
                        .next()
                        .unwrap_or_else(|| panic!("a Blob without a Name: {body}")),
                )
            }));
            let next = elements(&body, "NextMarker").next().unwrap_or("");
            if next.is_empty() {
                break;
            }
            marker = unescape(next);
        }
        keys.sort();
        keys
    }

    /// One Shared Key signed request; its status and body.
    async fn signed(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> (reqwest::StatusCode, String) {
        let answer = self.request(method, path, query, headers, body).await;
        (answer.status(), text(answer).await)
    }

    /// `method` on `/<account>/<path>?<query>`, signed with the account key (Shared Key).
    async fn request(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> reqwest::Response {
        let date = jiff::Timestamp::now()
            .strftime("%a, %d %b %Y %H:%M:%S GMT")
            .to_string();
        let url_path = format!("/{ACCOUNT}/{path}");
        let length = body.as_ref().map_or(0, Vec::len);
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map_or("", |(_, v)| *v)
        };
        let mut ms: Vec<(String, &str)> = vec![
            ("x-ms-date".into(), date.as_str()),
            ("x-ms-version".into(), API_VERSION),
        ];
        ms.extend(
            headers
                .iter()
                .filter(|(k, _)| k.to_ascii_lowercase().starts_with("x-ms-"))
                .map(|(k, v)| (k.to_ascii_lowercase(), *v)),
        );
        ms.sort();
        // An empty parameter (List Blobs' whole-container prefix) is left out of both.
        let query: Vec<(&str, &str)> = query
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .copied()
            .collect();
        let mut params: Vec<(String, &str)> = query
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), *v))
            .collect();
        params.sort();
        let mut to_sign = format!(
            "{method}\n\n\n{}\n\n{}\n\n\n\n\n\n\n",
            if length == 0 {
                String::new()
            } else {
                length.to_string()
            },
            header("content-type"),
        );
        for (k, v) in &ms {
            to_sign.push_str(&format!("{k}:{v}\n"));
        }
        to_sign.push_str(&format!("/{ACCOUNT}{url_path}"));
        for (k, v) in &params {
            to_sign.push_str(&format!("\n{k}:{v}"));
        }
        let key = STANDARD
            .decode(ACCOUNT_KEY)
            .unwrap_or_else(|e| panic!("the Azurite account key: {e}"));
        let signature = STANDARD.encode(hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, &key),
            to_sign.as_bytes(),
        ));
        let mut url = format!("{}{url_path}", self.endpoint());
        for (i, (k, v)) in query.iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&format!("{k}={}", encode(v)));
        }
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .unwrap_or_else(|e| panic!("HTTP method {method}: {e}"));
        let mut request = client()
            .request(method.clone(), &url)
            .header("authorization", format!("SharedKey {ACCOUNT}:{signature}"))
            .timeout(Duration::from_secs(30));
        for (k, v) in &ms {
            request = request.header(k.as_str(), *v);
        }
        for (k, v) in headers {
            if !k.to_ascii_lowercase().starts_with("x-ms-") {
                request = request.header(*k, *v);
            }
        }
        // Put Blob of zero bytes still says so (Content-Length: 0), as Azure wants.
        request = request.body(body.unwrap_or_default());
        match request.send().await {
            Ok(answer) => answer,
            Err(e) => panic!(
                "{method} {url} on Azurite: {e}; log:\n{}",
                crate::plane::tail(&self.log(), 30)
            ),
        }
    }

    fn wait_listening(&mut self, log: &Path) -> Result<(), TestenvError> {
        super::child::wait_child_listening(&mut self.child, self.port, 60, "Azurite", log)
    }
}

impl Drop for AzuriteServer {
    fn drop(&mut self) {
        super::child::stop_child(&mut self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A blob name as URL path segments (each percent-encoded, the `/`s kept).
fn encode_path(key: &str) -> String {
    key.split('/').map(encode).collect::<Vec<_>>().join("/")
}

/// The contents of every `<tag>...</tag>` in `xml`, in order (List Blobs' answer has no
/// attributes on the elements read here, nor nesting of a tag in itself).
fn elements<'a>(xml: &'a str, tag: &str) -> impl Iterator<Item = &'a str> + 'a {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut rest = xml;
    std::iter::from_fn(move || {
        let start = rest.find(&open)? + open.len();
        let end = start + rest[start..].find(&close)?;
        let found = &rest[start..end];
        rest = &rest[end + close.len()..];
        Some(found)
    })
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::AzuriteServer;

    /// The signed helpers against the real server: a container, a blob with a `/` in its name,
    /// its bytes back, the listing by prefix, a delete, and a missing blob.
    #[tokio::test]
    async fn blobs_round_trip_through_shared_key_requests() {
        let az = AzuriteServer::start();
        az.create_container("ctr").await;
        az.create_container("ctr").await;
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        az.put_object("ctr", "p/sha256/x", body.clone()).await;
        az.put_object("ctr", "q/y", b"other".to_vec()).await;
        assert_eq!(az.get_object("ctr", "p/sha256/x").await, Some(body));
        assert_eq!(az.list_keys("ctr", "p/").await, vec!["p/sha256/x"]);
        assert_eq!(az.list_keys("ctr", "").await.len(), 2);
        az.delete_object("ctr", "p/sha256/x").await;
        az.delete_object("ctr", "p/sha256/x").await;
        assert_eq!(az.get_object("ctr", "p/sha256/x").await, None);
        assert!(az.list_keys("ctr", "p/").await.is_empty());
    }
}
