//! Shared test support: one real control plane per test binary, a fresh namespace per test.
//!
//! The plane is a `dlq-testenv` child whose stdin we hold open; when this test process exits
//! in any way (pass, panic, Ctrl-C, SIGKILL) the pipe closes and the plane stops itself.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};

pub struct Plane {
    pub kubeconfig: PathBuf,
    pub server: String,
    pub bin_dirs: Vec<PathBuf>,
    // Held, never read: dropping them (at process exit) stops the plane.
    _child: Mutex<Child>,
    _stdin: Mutex<ChildStdin>,
}

static PLANE: OnceLock<Plane> = OnceLock::new();

fn say(line: &str) {
    // Straight to the process's stderr, past the test harness's capture, so CI logs show it.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The shared control plane, started on first use.
pub fn plane() -> &'static Plane {
    PLANE.get_or_init(|| {
        let bin_dirs = deadletter::testenv::tool_dirs(&["kube", "etcd"])
            .unwrap_or_else(|e| panic!("building the control-plane tools failed: {e}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_dlq-testenv"))
            .arg("--until-stdin-closes")
            .env(
                "DLQ_TOOLS_BIN",
                std::env::join_paths(&bin_dirs).expect("paths"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning dlq-testenv");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (mut kubeconfig, mut server) = (None, String::new());
        for line in stdout.lines() {
            let line = line.expect("reading dlq-testenv");
            if let Some(p) = line.strip_prefix("KUBECONFIG=") {
                kubeconfig = Some(PathBuf::from(p));
            } else if let Some(s) = line.strip_prefix("server=") {
                server = s.to_string();
            } else if line == "ready" {
                break;
            }
        }
        let kubeconfig =
            kubeconfig.expect("dlq-testenv exited before it was ready; see its error above");
        let plane = Plane {
            kubeconfig,
            server,
            bin_dirs,
            _child: Mutex::new(child),
            _stdin: Mutex::new(stdin),
        };
        let version = plane
            .kubectl()
            .args(["get", "--raw", "/version"])
            .output()
            .expect("kubectl");
        let v: serde_json::Value = serde_json::from_slice(&version.stdout).unwrap_or_default();
        say(&format!(
            "test control plane: kube-apiserver {} at {} (etcd, RBAC, ValidatingAdmissionPolicy)",
            v["gitVersion"].as_str().unwrap_or("?"),
            plane.server
        ));
        plane
    })
}

impl Plane {
    /// kubectl bound to the admin kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.bin("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dirs
            .iter()
            .map(|d| d.join(name))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{name} not in {:?}", self.bin_dirs))
    }

    pub async fn config(&self) -> Config {
        let kc = Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig");
        Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .expect("config")
    }

    /// An admin client (group system:masters).
    pub async fn client(&self) -> Client {
        Client::try_from(self.config().await).expect("client")
    }

    /// A client that impersonates `user` (in `groups`), as `kubectl --as` does.
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> Client {
        let mut config = self.config().await;
        config.auth_info.impersonate = Some(user.to_string());
        if !groups.is_empty() {
            config.auth_info.impersonate_groups =
                Some(groups.iter().map(|g| g.to_string()).collect());
        }
        Client::try_from(config).expect("client")
    }
}

/// A fresh namespace for one test: `<prefix>-<n>`.
pub async fn namespace(client: &Client, prefix: &str) -> String {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let name = format!("{prefix}-{}-{n}", std::process::id() % 100_000);
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))
    .expect("namespace");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("creating namespace");
    name
}

/// Applies CRDs (multi-document YAML) and waits until each is Established.
pub async fn apply_crds(client: &Client, yaml: &str) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply("dlq-tests").force();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc).expect("yaml");
        if value.is_null() {
            continue;
        }
        let crd: CustomResourceDefinition = serde_yaml::from_value(value).expect("crd");
        let name = crd.metadata.name.clone().expect("crd name");
        api.patch(&name, &pp, &Patch::Apply(&crd))
            .await
            .expect("applying crd");
        tokio::time::timeout(
            Duration::from_secs(30),
            await_condition(api.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .expect("crd not established in 30s")
        .expect("watching crd");
    }
}

use serde::Deserialize;
