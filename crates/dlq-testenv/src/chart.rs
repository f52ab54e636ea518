//! Helpers of the packaging tests (`tests/chart_*.rs`, `tests/dockerfile.rs`): the real tools
//! (helm, promtool, built by `tools/build.sh`), rendering the chart, reading rendered objects,
//! applying them to the shared control plane, and the operator's RBAC as data.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::cluster::Plane;
use crate::paths::workspace_root;

/// The user-facing roles the chart ships (issue 7, item 2).
pub const USER_ROLES: [&str; 4] = [
    "dlq-viewer",
    "dlq-decider",
    "dlq-parker",
    "dlq-payload-reader",
];

/// `charts/deadletter-operator` of the checkout.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("charts/deadletter-operator")
}

// ---------------------------------------------------------------------------------------------
// tools

/// helm, and what helm renders for; promtool on demand ([`Tools::promtool`]).
pub struct Tools {
    pub helm: PathBuf,
    /// The kube-apiserver version the test plane runs; helm renders for it.
    pub kube_version: String,
    /// HELM_{CACHE,CONFIG,DATA}_HOME, so helm never touches the user's own configuration.
    pub helm_home: PathBuf,
}

impl Tools {
    /// promtool, built (once) by `tools/build.sh promtool` when a test first asks: only the
    /// alert tests need it, and on a cold machine the other chart tests need not wait for it.
    pub fn promtool(&self) -> &'static Path {
        static PROMTOOL: OnceLock<PathBuf> = OnceLock::new();
        PROMTOOL.get_or_init(|| built("promtool"))
    }
}

/// `name`, built (once) by `tools/build.sh name`.
fn built(name: &str) -> PathBuf {
    let dirs =
        crate::plane::tool_dirs(&[name]).unwrap_or_else(|e| panic!("building {name} failed: {e}"));
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not in {dirs:?}"))
}

/// The tools, helm built (once) by `tools/build.sh helm`.
pub fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let version_file = workspace_root().join("tools/kube/VERSION");
        let kube_version = std::fs::read_to_string(&version_file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", version_file.display()))
            .trim()
            .to_string();
        Tools {
            helm: built("helm"),
            kube_version,
            helm_home: crate::paths::target_tmp_dir().join("helm-home"),
        }
    })
}

/// A fresh directory under the system temp dir, unique to this process and call.
pub fn scratch_dir(what: &str) -> PathBuf {
    crate::paths::sweep_stale_scratch();
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "dlq-chart-{}-{what}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("creating the scratch dir {}: {e}", dir.display()));
    dir
}

/// A Helm release name unique within this test process (cluster-scoped names derive from it).
pub fn release(prefix: &str) -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}", SEQ.fetch_add(1, Ordering::SeqCst))
}

/// A helm command with its own cache, config and data dirs.
pub fn helm() -> Command {
    let t = tools();
    let mut cmd = Command::new(&t.helm);
    for (var, sub) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        cmd.env(var, t.helm_home.join(sub));
    }
    cmd
}

/// Exit status, stdout and stderr of a finished command, for assertion messages.
pub fn show(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `cmd` to completion with `input` on its stdin (none: /dev/null).
pub fn run(cmd: &mut Command, input: Option<&str>) -> Output {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {:?}: {e}", cmd.get_program()));
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin
            .write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("writing the stdin of {:?}: {e}", cmd.get_program()));
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for {:?}: {e}", cmd.get_program()))
}

/// Runs `cmd`, panics with its output unless it succeeds, returns stdout.
pub fn check(what: &str, cmd: &mut Command, input: Option<&str>) -> String {
    let out = run(cmd, input);
    assert!(out.status.success(), "{what} failed: {}", show(&out));
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{what}: output not UTF-8: {e}"))
}

// ---------------------------------------------------------------------------------------------
// rendering

/// `helm template` of the chart as release `name` in `namespace` with `values` (YAML).
pub fn render(name: &str, namespace: &str, values: &str) -> Vec<Value> {
    let dir = scratch_dir("values");
    let file = dir.join("values.yaml");
    std::fs::write(&file, values).expect("writing values.yaml");
    let yaml = check(
        "helm template",
        helm()
            .args(["template", name])
            .arg(chart_dir())
            .args(["--namespace", namespace, "--kube-version"])
            .arg(&tools().kube_version)
            .arg("--values")
            .arg(&file),
        None,
    );
    let _ = std::fs::remove_dir_all(dir);
    documents(&yaml)
}

/// The non-empty documents of a multi-document YAML stream.
pub fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

pub fn kind_of(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

pub fn name_of(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or("")
}

pub fn namespace_of(doc: &Value) -> &str {
    doc["metadata"]["namespace"].as_str().unwrap_or("")
}

/// (kind, namespace, name) of every rendered object.
pub fn inventory(docs: &[Value]) -> BTreeSet<(String, String, String)> {
    docs.iter()
        .map(|d| {
            (
                kind_of(d).to_string(),
                namespace_of(d).to_string(),
                name_of(d).to_string(),
            )
        })
        .collect()
}

/// The one object of `kind`; panics unless there is exactly one.
pub fn only<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| kind_of(d) == kind).collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind}: {found:#?}");
    found[0]
}

/// The object `kind` `namespace/name`; panics when missing.
pub fn find<'a>(docs: &'a [Value], kind: &str, namespace: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| kind_of(d) == kind && namespace_of(d) == namespace && name_of(d) == name)
        .unwrap_or_else(|| panic!("no {kind} {namespace}/{name} in {:#?}", inventory(docs)))
}

/// The objects of any of `kinds`.
pub fn of_kinds(docs: &[Value], kinds: &[&str]) -> Vec<Value> {
    docs.iter()
        .filter(|d| kinds.contains(&kind_of(d)))
        .cloned()
        .collect()
}

/// The objects as one `v1/List`, for `kubectl apply -f -`.
pub fn as_list(docs: &[Value]) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": docs}).to_string()
}

// ---------------------------------------------------------------------------------------------
// RBAC as data

/// RBAC rules normalised for comparison: (apiGroup, resource, resourceNames, verbs).
pub type Grant = (String, String, Vec<String>, BTreeSet<String>);

/// The rules of a Role or ClusterRole, one [`Grant`] per group and resource.
pub fn grants(rules: &Value) -> BTreeSet<Grant> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = BTreeSet::new();
    for rule in rules.as_array().expect("rules is a list") {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                let mut names = strings(&rule["resourceNames"]);
                names.sort();
                out.insert((
                    group.clone(),
                    resource,
                    names,
                    strings(&rule["verbs"]).into_iter().collect(),
                ));
            }
        }
    }
    out
}

pub fn grant(group: &str, resource: &str, names: &[&str], verbs: &[&str]) -> Grant {
    (
        group.to_string(),
        resource.to_string(),
        names.iter().map(|s| s.to_string()).collect(),
        verbs.iter().map(|s| s.to_string()).collect(),
    )
}

/// Exactly what the operator does against the API in a namespace it watches.
pub fn operator_grants() -> BTreeSet<Grant> {
    [
        grant(
            "dlq.dev",
            "deadletters",
            &[],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        grant("dlq.dev", "deadletters/status", &[], &["patch"]),
        grant(
            "dlq.dev",
            "deadletterreplays",
            &[],
            &["get", "list", "watch"],
        ),
        grant("dlq.dev", "deadletterreplays/status", &[], &["patch"]),
        grant(
            "dlq.dev",
            "deadletterqueues",
            &[],
            &["get", "list", "watch"],
        ),
        grant("dlq.dev", "deadletterqueues/status", &[], &["patch"]),
        grant(
            "dlq.dev",
            "deadlettergroups",
            &[],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        grant("dlq.dev", "deadlettergroups/status", &[], &["patch"]),
        grant("events.k8s.io", "events", &[], &["create", "patch"]),
        grant("", "resourcequotas", &[], &["get", "list", "watch"]),
        grant("", "secrets", &[], &["get"]),
    ]
    .into_iter()
    .collect()
}

/// The `--max-records` ledger ConfigMap `ledger` (named after the Lease), in the operator's own
/// namespace only, and the Event it publishes there when the ceiling is reached.
pub fn records_ledger_grants(ledger: &str) -> BTreeSet<Grant> {
    [
        grant("", "configmaps", &[], &["create"]),
        grant(
            "",
            "configmaps",
            &[ledger],
            &["get", "list", "watch", "patch"],
        ),
        grant("events.k8s.io", "events", &[], &["create", "patch"]),
    ]
    .into_iter()
    .collect()
}

/// The operator's Lease (named after the release), in its own namespace only.
pub fn leader_election_grants(lease: &str) -> BTreeSet<Grant> {
    [
        grant("coordination.k8s.io", "leases", &[], &["create"]),
        grant(
            "coordination.k8s.io",
            "leases",
            &[lease],
            &["get", "update", "patch"],
        ),
    ]
    .into_iter()
    .collect()
}

// ---------------------------------------------------------------------------------------------
// the control plane

/// A fresh namespace with extra labels.
pub async fn labelled_namespace(client: &Client, prefix: &str, labels: &[(&str, &str)]) -> String {
    let ns = crate::cluster::namespace(client, prefix).await;
    if !labels.is_empty() {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        Api::<Namespace>::all(client.clone())
            .patch(
                &ns,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .unwrap_or_else(|e| panic!("labelling namespace {ns}: {e}"));
    }
    ns
}

/// The CRDs the chart ships, applied and Established.
pub async fn chart_crds(client: &Client) {
    let path = chart_dir().join("crds/dlq.dev.yaml");
    let yaml = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    crate::cluster::apply_crds(client, &yaml).await;
}

/// `kubectl apply --dry-run=server` of `docs`; returns stderr (warnings) on success.
pub fn dry_run_apply(plane: &Plane, docs: &[Value]) -> String {
    let out = run(
        plane
            .kubectl()
            .args(["apply", "--dry-run=server", "-o", "name", "-f", "-"]),
        Some(&as_list(docs)),
    );
    assert!(
        out.status.success(),
        "the apiserver refused rendered manifests: {}",
        show(&out)
    );
    let applied = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        applied.lines().count(),
        docs.len(),
        "kubectl should report one line per object: {applied}"
    );
    // kubectl's note about objects another manager (helm) created is not a finding.
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.contains("last-applied-configuration"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `kubectl apply` of `docs`; panics unless it succeeds.
pub fn apply(plane: &Plane, docs: &[Value]) {
    check(
        "kubectl apply",
        plane.kubectl().args(["apply", "-f", "-"]),
        Some(&as_list(docs)),
    );
}

/// Waits (up to 60s) until `probe` holds: RBAC and admission policies reach the apiserver's
/// caches a moment after they are written. The probe's error is the last reason it did not.
pub async fn until_ok<F, Fut>(what: &str, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match probe().await {
            Ok(()) => return,
            Err(last) if Instant::now() > deadline => {
                panic!("{what}: still not so after 60s: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
