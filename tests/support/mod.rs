//! Shared test support: one real control plane per test binary, a fresh namespace per test.
//!
//! The plane is a `dlq-testenv` child whose stdin we hold open; when this test process exits
//! in any way (pass, panic, Ctrl-C, SIGKILL) the pipe closes and the plane stops itself.
#![allow(dead_code)]
pub mod brokers;

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

pub fn report(line: &str) {
    say(line)
}

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

/// The CRDs as checked in.
pub const CRDS: &str = include_str!("../../crds/dlq.dev.yaml");

/// Installs the dlq.dev CRDs once per test binary.
pub async fn install_crds(client: &Client) {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| apply_crds(client, CRDS)).await;
}

/// A real redis-server on a free loopback port; stopped on drop (and by the kernel if the test
/// process dies).
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
}

impl Redis {
    pub fn start() -> Redis {
        let port = deadletter::testenv::free_port().expect("port");
        let dir = std::env::temp_dir().join(format!("dlq-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut r = Redis {
            port,
            child: None,
            dir,
        };
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts (again) on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "redis already running");
        let bin = which("redis-server").unwrap_or_else(|| {
            panic!(
                "redis-server not found: run scripts/ensure-deps.sh (apt-get install redis-server)"
            )
        });
        let child = deadletter::testenv::spawn_guarded(
            Command::new(bin)
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(&self.dir),
            &self.dir.join("redis.log"),
        )
        .expect("starting redis-server");
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not listen on {}", self.port);
    }

    /// Stops it hard, like a crashed broker.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection")
    }

    pub async fn list(&self, key: &str) -> Vec<Vec<u8>> {
        let mut c = self.conn().await;
        redis::cmd("LRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query_async(&mut c)
            .await
            .expect("LRANGE")
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// A `deadletter-operator run` process watching one namespace, without leader election.
pub struct Operator {
    child: Option<Child>,
    pub metrics_port: u16,
    pub log: PathBuf,
}

impl Operator {
    pub fn start(ns: &str) -> Operator {
        Self::start_with(ns, &[], &[])
    }

    pub fn start_with(ns: &str, args: &[&str], env: &[(&str, &str)]) -> Operator {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let metrics_port = deadletter::testenv::free_port().expect("port");
        let log =
            std::env::temp_dir().join(format!("dlq-operator-{}-{ns}-{n}.log", std::process::id()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_deadletter-operator"));
        cmd.arg("run");
        if !args.iter().any(|a| a.starts_with("--leader-election")) {
            cmd.arg("--leader-election=false");
        }
        cmd.arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
            .arg(format!("--watch-namespaces={ns}"))
            .arg("--backoff-cap-seconds=2")
            .args(args)
            .env("KUBECONFIG", &plane().kubeconfig)
            .env("POD_NAME", format!("op-{n}"))
            .env("RUST_LOG", "info,kube=warn,lapin=error");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = deadletter::testenv::spawn_guarded(&mut cmd, &log).expect("starting operator");
        let op = Operator {
            child: Some(child),
            metrics_port,
            log,
        };
        for _ in 0..200 {
            if op.http_get("/readyz").is_some_and(|b| b.starts_with("ok")) {
                return op;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("operator not ready; log:\n{}", op.logs());
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET a path on the metrics port; None when not answering.
    pub fn http_get(&self, path: &str) -> Option<String> {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
    }

    /// The value of one metric sample line, e.g. `dlq_redrives_total{...,result="success"}`;
    /// sums every series whose labels contain all of `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let body = self.http_get("/metrics").unwrap_or_default();
        body.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter(|l| {
                let (series, _) = l.rsplit_once(' ').unwrap_or((l, ""));
                series.split(['{', '}']).next() == Some(name)
                    && labels
                        .iter()
                        .all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
            })
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Graceful stop (SIGTERM), as Kubernetes does.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        deadletter::testenv::terminate(&mut c, Duration::from_secs(10));
        c.wait().ok()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            say(&format!("operator log kept at {}", self.log.display()));
        }
    }
}

/// Polls `check` every 100 ms until it returns Some, or panics after `secs` with `what`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---- DeadLetter fixtures shared by the test binaries ----

use deadletter::api::{Action, DeadLetter, DeadLetterQueue, Phase};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use serde_json::json;

/// The list the `relayer` queue redrives onto.
pub const LIST: &str = "relayer:jobs";

/// A Secret with the Redis URL and a DeadLetterQueue `relayer` targeting `target`.
pub async fn create_queue(
    client: &Client,
    ns: &str,
    url: &str,
    target: serde_json::Value,
    extra: serde_json::Value,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "redis"}, "stringData": {"url": url}
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let mut spec = json!({"target": {"redis": target}});
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    let q: DeadLetterQueue = serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
        "metadata": {"name": "relayer"}, "spec": spec
    }))
    .unwrap();
    Api::<DeadLetterQueue>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &q)
        .await
        .unwrap();
}

pub fn list_target() -> serde_json::Value {
    json!({"urlSecretRef": {"name": "redis", "key": "url"}, "list": LIST})
}

pub async fn decide(api: &Api<DeadLetter>, name: &str, action: Action, by: &str) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"action": action, "by": by}})),
    )
    .await
    .expect("setting the decision");
}

pub async fn wait_phase(api: &Api<DeadLetter>, name: &str, phase: Phase, secs: u64) -> DeadLetter {
    eventually(secs, &format!("{name} to be {phase:?}"), || async {
        api.get(name)
            .await
            .ok()
            .filter(|r| r.status.as_ref().and_then(|s| s.phase) == Some(phase))
    })
    .await
}

pub async fn events_for(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

pub fn condition(r: &DeadLetter, type_: &str) -> Option<(String, String, String)> {
    r.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// A record as a parker would create it: `payload` as UTF-8 text when it is, else base64.
pub fn record(name: &str, id: &str, payload: &[u8], headers: &[(&str, &str)]) -> DeadLetter {
    use base64::Engine;
    use deadletter::api::{DeadLetterSpec, FailureKind, Job};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let (text, b64) = match std::str::from_utf8(payload) {
        Ok(t) => (Some(t.to_string()), None),
        Err(_) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(payload)),
        ),
    };
    DeadLetter::new(
        name,
        DeadLetterSpec {
            queue: "relayer".into(),
            cycle: 1,
            job: Job {
                id: id.into(),
                payload: text,
                payload_base64: b64,
                headers: headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                origin: None,
            },
            intent: None,
            deliveries: 3,
            reason: "no luck".into(),
            failure_kind: FailureKind::Transient,
            service_version: None,
            failed_at: Time(jiff::Timestamp::now()),
            action: None,
            by: None,
            note: None,
        },
    )
}
