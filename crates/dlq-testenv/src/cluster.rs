//! One real control plane per test binary, a fresh namespace per test.
//!
//! The plane is a `dlq-testenv` child whose stdin we hold open; when the test process exits in
//! any way (pass, panic, Ctrl-C, SIGKILL) the pipe closes and the plane stops itself.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};
use serde::Deserialize;

use crate::harness::report;

/// The CRDs as checked in (`crds/dlq.dev.yaml`).
pub const CRDS: &str = include_str!("../../../crds/dlq.dev.yaml");

/// The control plane shared by every test of one test binary.
pub struct Plane {
    /// Admin kubeconfig (client cert in group system:masters).
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`
    pub server: String,
    /// Dirs holding kube-apiserver, kubectl and etcd.
    pub bin_dirs: Vec<PathBuf>,
    /// With a real node ([`node_plane`]): its containerd socket, to import images into.
    pub containerd: Option<PathBuf>,
    /// With a real node: seconds from starting it to the Node being Ready.
    pub node_ready_secs: Option<f64>,
    /// etcd's client URL (`http://127.0.0.1:<port>`, no TLS): tests read raw stored values.
    pub etcd_url: Option<String>,
    /// With [`audited_plane`]: the apiserver's audit log.
    pub audit_log: Option<PathBuf>,
    /// The plane's state dir (`pki/` holds its certificates, the front proxy's among them).
    pub dir: PathBuf,
    // Held, never read: dropping them (at process exit) stops the plane.
    _child: Mutex<Child>,
    _stdin: Mutex<ChildStdin>,
}

static PLANE: OnceLock<Plane> = OnceLock::new();

/// The shared control plane, started on first use.
pub fn plane() -> &'static Plane {
    PLANE.get_or_init(|| {
        let plane = start_plane(&[]);
        let version = plane
            .kubectl()
            .args(["get", "--raw", "/version"])
            .output()
            .expect("running kubectl get --raw /version");
        let v: serde_json::Value = serde_json::from_slice(&version.stdout).unwrap_or_default();
        report(&format!(
            "test control plane: kube-apiserver {} at {} (etcd, RBAC, ValidatingAdmissionPolicy)",
            v["gitVersion"].as_str().unwrap_or("?"),
            plane.server
        ));
        plane
    })
}

/// The control plane with a real node (`dlq-testenv --node`, see [`crate::node`]) shared by
/// the tests of one binary, started on first use. Needs root.
pub fn node_plane() -> &'static Plane {
    static NODE_PLANE: OnceLock<Plane> = OnceLock::new();
    NODE_PLANE.get_or_init(|| {
        let plane = start_plane(&["--node"]);
        report(&format!(
            "test node: Ready {:.1}s after its start; apiserver at {}",
            plane.node_ready_secs.unwrap_or_default(),
            plane.server
        ));
        plane
    })
}

/// A control plane writing its audit log (request and response bodies; Secrets' only as
/// metadata), shared by the tests of one binary, started on first use.
pub fn audited_plane() -> &'static Plane {
    static AUDITED_PLANE: OnceLock<Plane> = OnceLock::new();
    AUDITED_PLANE.get_or_init(|| {
        let plane = start_plane(&["--audit"]);
        report(&format!(
            "test control plane with audit log {} at {}",
            plane
                .audit_log
                .as_deref()
                .unwrap_or(Path::new("?"))
                .display(),
            plane.server
        ));
        plane
    })
}

/// A control plane whose ResourceQuotas are counted (kube-controller-manager's `resourcequota`
/// controller beside the apiserver, as in every real cluster), shared by the tests of one
/// binary, started on first use.
pub fn quota_plane() -> &'static Plane {
    static QUOTA_PLANE: OnceLock<Plane> = OnceLock::new();
    QUOTA_PLANE.get_or_init(|| {
        let plane = start_plane(&["--quota-controller"]);
        report(&format!(
            "test control plane with kube-controller-manager's resourcequota controller at {}",
            plane.server
        ));
        plane
    })
}

/// Starts `dlq-testenv --until-stdin-closes <extra>` and reads its announcement up to `ready`.
fn start_plane(extra: &[&str]) -> Plane {
    let tools: &[&str] = if extra.contains(&"--node") {
        &["kube", "etcd", "cni", "pause"]
    } else if extra.contains(&"--quota-controller") {
        crate::plane::PLANE_TOOLS_WITH_QUOTAS
    } else {
        crate::plane::PLANE_TOOLS_WITH_KUBECTL
    };
    let bin_dirs = crate::plane::tool_dirs(tools)
        .unwrap_or_else(|e| panic!("building the control-plane tools failed: {e}"));
    let mut child = Command::new(crate::paths::bin("dlq-testenv"))
        .arg("--until-stdin-closes")
        .args(extra)
        .env(
            "DLQ_TOOLS_BIN",
            std::env::join_paths(&bin_dirs).expect("tool dirs joinable as a PATH"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning dlq-testenv");
    let stdin = child.stdin.take().expect("dlq-testenv stdin is piped");
    let stdout = BufReader::new(child.stdout.take().expect("dlq-testenv stdout is piped"));
    let (mut kubeconfig, mut server) = (None, String::new());
    let (mut containerd, mut node_ready_secs, mut etcd_url) = (None, None, None);
    let (mut audit_log, mut dir) = (None, PathBuf::new());
    for line in stdout.lines() {
        let line = line.expect("reading dlq-testenv's output");
        if let Some(p) = line.strip_prefix("KUBECONFIG=") {
            kubeconfig = Some(PathBuf::from(p));
        } else if let Some(s) = line.strip_prefix("server=") {
            server = s.to_string();
        } else if let Some(s) = line.strip_prefix("containerd=") {
            containerd = Some(PathBuf::from(s));
        } else if let Some(s) = line.strip_prefix("etcd=") {
            etcd_url = Some(s.to_string());
        } else if let Some(s) = line.strip_prefix("dir=") {
            dir = PathBuf::from(s);
        } else if let Some(s) = line.strip_prefix("audit=") {
            audit_log = Some(PathBuf::from(s));
        } else if let Some(s) = line.strip_prefix("node_ready_secs=") {
            node_ready_secs = s.parse().ok();
        } else if line == "ready" {
            break;
        }
    }
    Plane {
        kubeconfig: kubeconfig
            .expect("dlq-testenv exited before it was ready; see its error above"),
        server,
        bin_dirs,
        containerd,
        node_ready_secs,
        etcd_url,
        audit_log,
        dir,
        _child: Mutex::new(child),
        _stdin: Mutex::new(stdin),
    }
}

impl Plane {
    /// kubectl bound to the admin kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.tool("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// One of the Go-built tools next to the apiserver (kubectl, etcd, kube-apiserver).
    pub fn tool(&self, name: &str) -> PathBuf {
        self.bin_dirs
            .iter()
            .map(|d| d.join(name))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{name} not in {:?}", self.bin_dirs))
    }

    /// The raw value etcd stores under `key` (e.g. `/registry/dlq.dev/deadletters/NS/NAME`),
    /// read through etcd's JSON gateway (`POST /v3/kv/range`) past the apiserver: what a reader
    /// of etcd's data sees. None when the key does not exist.
    pub async fn etcd_value(&self, key: &str) -> Option<Vec<u8>> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let url = self
            .etcd_url
            .as_deref()
            .expect("dlq-testenv announced no etcd URL");
        let body = serde_json::json!({ "key": b64.encode(key) }).to_string();
        let answer = crate::harness::http_post(url, "/v3/kv/range", &body).await;
        let v: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_else(|e| {
            panic!(
                "etcd answered no JSON ({e}): {}",
                String::from_utf8_lossy(&answer)
            )
        });
        let value = v["kvs"].get(0)?["value"].as_str()?;
        Some(b64.decode(value).expect("etcd values are base64"))
    }

    /// The client configuration of the admin kubeconfig.
    pub async fn config(&self) -> Config {
        admin_config(&self.kubeconfig).await
    }

    /// An admin client (group system:masters).
    pub async fn client(&self) -> Client {
        admin_client(&self.kubeconfig).await
    }

    /// A client that impersonates `user` (in `groups`), as `kubectl --as` does.
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> Client {
        let mut config = self.config().await;
        config.auth_info.impersonate = Some(user.to_string());
        if !groups.is_empty() {
            config.auth_info.impersonate_groups =
                Some(groups.iter().map(|g| g.to_string()).collect());
        }
        Client::try_from(config).expect("an impersonating client")
    }
}

/// The client configuration of the admin kubeconfig at `path` (any plane's, e.g. one a test
/// or the chaos harness started for itself).
pub async fn admin_config(path: &Path) -> Config {
    let kc = Kubeconfig::read_from(path).expect("reading the admin kubeconfig");
    Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("a client config from the admin kubeconfig")
}

/// An admin client (group system:masters) from the kubeconfig at `path`.
pub async fn admin_client(path: &Path) -> Client {
    Client::try_from(admin_config(path).await).expect("an admin client")
}

/// A fresh namespace for one test: `<prefix>-<pid>-<n>`.
pub async fn namespace(client: &Client, prefix: &str) -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let n = SEQ.fetch_add(1, Ordering::SeqCst);
    let name = format!("{prefix}-{}-{n}", std::process::id() % 100_000);
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))
    .expect("a Namespace object");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
    name
}

/// Applies CRDs (multi-document YAML) and waits until each is Established.
pub async fn apply_crds(client: &Client, yaml: &str) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply("dlq-tests").force();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc).expect("CRD YAML");
        if value.is_null() {
            continue;
        }
        let crd: CustomResourceDefinition =
            serde_yaml::from_value(value).expect("a CustomResourceDefinition");
        let name = crd.metadata.name.clone().expect("the CRD has a name");
        api.patch(&name, &pp, &Patch::Apply(&crd))
            .await
            .unwrap_or_else(|e| panic!("applying CRD {name}: {e}"));
        tokio::time::timeout(
            Duration::from_secs(30),
            await_condition(api.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .unwrap_or_else(|_| panic!("CRD {name} not established in 30s"))
        .unwrap_or_else(|e| panic!("watching CRD {name}: {e}"));
    }
}

/// Installs the dlq.dev CRDs once per test binary.
pub async fn install_crds(client: &Client) {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| apply_crds(client, CRDS)).await;
}

/// What most tests start with: an admin client of the shared plane, the dlq.dev CRDs
/// installed, and a fresh namespace `<prefix>-…` of their own.
pub async fn setup(prefix: &str) -> (Client, String) {
    setup_on(plane(), prefix).await
}

/// [`setup`] on `plane` (e.g. [`audited_plane`]); one plane per test binary, as the CRDs are
/// installed once.
pub async fn setup_on(plane: &Plane, prefix: &str) -> (Client, String) {
    let client = plane.client().await;
    install_crds(&client).await;
    let ns = namespace(&client, prefix).await;
    (client, ns)
}

/// Runs `kubectl-dlq -n NS args…` as the admin against the shared control plane:
/// (success, stdout, stderr).
pub fn kubectl_dlq(ns: &str, args: &[&str]) -> (bool, String, String) {
    kubectl_dlq_on(plane(), ns, args)
}

/// [`kubectl_dlq`] against `plane`.
pub fn kubectl_dlq_on(plane: &Plane, ns: &str, args: &[&str]) -> (bool, String, String) {
    let kubeconfig = plane.kubeconfig.to_string_lossy().into_owned();
    let out = std::process::Command::new(crate::paths::bin("kubectl-dlq"))
        .args(["--kubeconfig", &kubeconfig, "-n", ns])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("kubectl-dlq does not run: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
