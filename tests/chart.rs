//! Production packaging (issue 7): the Helm chart, its RBAC and admission policy, the alert
//! rules and the Dockerfile, checked with the real tools (helm, promtool, hadolint) and against
//! the real control plane (kube-apiserver + etcd). Nothing is mocked.
//!
//! Each test works in its own namespaces and its own Helm release name, so that cluster-scoped
//! objects (ClusterRoles, admission policies) of one test never meet another test's.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde::Deserialize;
use serde_json::{Value, json};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The prometheus-operator release whose CRDs (ServiceMonitor, PrometheusRule) the rendered
/// monitoring objects are checked against. Fetched with `go mod download` at test time.
const PROMETHEUS_OPERATOR: &str = "github.com/prometheus-operator/prometheus-operator@v0.85.0";
/// The user-facing roles the chart ships (issue 7, item 2).
const USER_ROLES: [&str; 3] = ["dlq-viewer", "dlq-decider", "dlq-parker"];
/// The GitOps group the admission test exempts.
const GITOPS_GROUP: &str = "dlq-tests:gitops";

fn chart_dir() -> PathBuf {
    Path::new(ROOT).join("charts/deadletter-operator")
}

/// Straight to the process's stderr, past the harness's capture, so CI logs show it.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

// ---------------------------------------------------------------------------------------------
// tools

struct Tools {
    helm: PathBuf,
    promtool: PathBuf,
    /// The kube-apiserver version the test plane runs; helm renders for it.
    kube_version: String,
    /// HELM_{CACHE,CONFIG,DATA}_HOME, so helm never touches the user's own configuration.
    helm_home: PathBuf,
}

fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let dirs = deadletter::testenv::tool_dirs(&["helm", "promtool"])
            .unwrap_or_else(|e| panic!("building helm/promtool failed: {e}"));
        let find = |name: &str| {
            dirs.iter()
                .map(|d| d.join(name))
                .find(|p| p.is_file())
                .unwrap_or_else(|| panic!("{name} not in {dirs:?}"))
        };
        let kube_version = std::fs::read_to_string(Path::new(ROOT).join("tools/kube/VERSION"))
            .expect("tools/kube/VERSION")
            .trim()
            .to_string();
        Tools {
            helm: find("helm"),
            promtool: find("promtool"),
            kube_version,
            helm_home: Path::new(env!("CARGO_TARGET_TMPDIR")).join("helm-home"),
        }
    })
}

/// A fresh directory under the system temp dir, unique to this process and call.
fn scratch_dir(what: &str) -> PathBuf {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "dlq-chart-{}-{what}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a scratch dir");
    dir
}

/// A Helm release name unique within this test process (cluster-scoped names derive from it).
fn release(prefix: &str) -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}", SEQ.fetch_add(1, Ordering::SeqCst))
}

fn helm() -> Command {
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

fn show(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn run(cmd: &mut Command, input: Option<&str>) -> Output {
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
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(input.as_bytes()).expect("writing stdin");
    }
    child.wait_with_output().expect("waiting for a child")
}

/// Runs `cmd`, panics with its output unless it succeeds, returns stdout.
fn check(what: &str, cmd: &mut Command, input: Option<&str>) -> String {
    let out = run(cmd, input);
    assert!(out.status.success(), "{what} failed: {}", show(&out));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

// ---------------------------------------------------------------------------------------------
// rendering

/// `helm template` of the chart as release `name` in `namespace` with `values` (YAML).
fn render(name: &str, namespace: &str, values: &str) -> Vec<Value> {
    let dir = scratch_dir("values");
    let file = dir.join("values.yaml");
    std::fs::write(&file, values).expect("writing values");
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

fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_of(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

fn name_of(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or("")
}

fn namespace_of(doc: &Value) -> &str {
    doc["metadata"]["namespace"].as_str().unwrap_or("")
}

/// (kind, namespace, name) of every rendered object.
fn inventory(docs: &[Value]) -> BTreeSet<(String, String, String)> {
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

fn only<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| kind_of(d) == kind).collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind}: {found:#?}");
    found[0]
}

fn find<'a>(docs: &'a [Value], kind: &str, namespace: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| kind_of(d) == kind && namespace_of(d) == namespace && name_of(d) == name)
        .unwrap_or_else(|| panic!("no {kind} {namespace}/{name} in {:#?}", inventory(docs)))
}

fn as_list(docs: &[Value]) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": docs}).to_string()
}

/// RBAC rules normalised for comparison: (apiGroup, resource, resourceNames, verbs).
type Grant = (String, String, Vec<String>, BTreeSet<String>);

fn grants(rules: &Value) -> BTreeSet<Grant> {
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
    for rule in rules.as_array().expect("rules") {
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

fn grant(group: &str, resource: &str, names: &[&str], verbs: &[&str]) -> Grant {
    (
        group.to_string(),
        resource.to_string(),
        names.iter().map(|s| s.to_string()).collect(),
        verbs.iter().map(|s| s.to_string()).collect(),
    )
}

/// Exactly what the operator does against the API in a namespace it watches.
fn operator_grants() -> BTreeSet<Grant> {
    [
        grant(
            "dlq.dev",
            "deadletters",
            &[],
            &["get", "list", "watch", "create", "delete"],
        ),
        grant("dlq.dev", "deadletters/status", &[], &["patch"]),
        grant(
            "dlq.dev",
            "deadletterqueues",
            &[],
            &["get", "list", "watch"],
        ),
        grant("dlq.dev", "deadletterqueues/status", &[], &["patch"]),
        grant("events.k8s.io", "events", &[], &["create", "patch"]),
        grant("", "secrets", &[], &["get"]),
    ]
    .into_iter()
    .collect()
}

/// The operator's Lease (named after the release), in its own namespace only.
fn leader_election_grants(lease: &str) -> BTreeSet<Grant> {
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
async fn labelled_namespace(
    client: &kube::Client,
    prefix: &str,
    labels: &[(&str, &str)],
) -> String {
    let ns = support::namespace(client, prefix).await;
    if !labels.is_empty() {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        Api::<Namespace>::all(client.clone())
            .patch(
                &ns,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .expect("labelling the namespace");
    }
    ns
}

async fn chart_crds(client: &kube::Client) {
    let yaml = std::fs::read_to_string(chart_dir().join("crds/dlq.dev.yaml")).expect("chart CRDs");
    support::apply_crds(client, &yaml).await;
}

/// The ServiceMonitor and PrometheusRule CRDs from the prometheus-operator Go module, or why
/// they cannot be had (no Go, no network and no module cache).
fn monitoring_crds() -> &'static Result<String, String> {
    static CRDS: OnceLock<Result<String, String>> = OnceLock::new();
    CRDS.get_or_init(|| {
        let dir = scratch_dir("gomod");
        let out = Command::new("go")
            .args(["mod", "download", "-json", PROMETHEUS_OPERATOR])
            .current_dir(&dir)
            .env("GO111MODULE", "on")
            .env("GOFLAGS", "-mod=mod")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run go: {e}"))?;
        let _ = std::fs::remove_dir_all(dir);
        let info: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let Some(module) = info["Dir"].as_str() else {
            return Err(format!(
                "go mod download {PROMETHEUS_OPERATOR} failed: {} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        };
        let mut yaml = String::new();
        for kind in ["servicemonitors", "prometheusrules"] {
            let path = Path::new(module)
                .join("example/prometheus-operator-crd")
                .join(format!("monitoring.coreos.com_{kind}.yaml"));
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            yaml.push_str("---\n");
            yaml.push_str(&text);
        }
        Ok(yaml)
    })
}

/// `kubectl apply --dry-run=server` of `docs`; returns stderr (warnings) on success.
fn dry_run_apply(plane: &support::Plane, docs: &[Value]) -> String {
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

fn apply(plane: &support::Plane, docs: &[Value]) {
    check(
        "kubectl apply",
        plane.kubectl().args(["apply", "-f", "-"]),
        Some(&as_list(docs)),
    );
}

fn dead_letters(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("dlq.dev", "v1alpha1", "DeadLetter"),
        "deadletters",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn dead_letter(name: &str, decision: Value) -> DynamicObject {
    let mut spec = json!({
        "queue": "relayer",
        "cycle": 1,
        "job": {"id": format!("{name}/settle"), "payload": "{\"intent\":\"pi\"}"},
        "intent": {"id": name, "state": "created"},
        "deliveries": 3,
        "reason": "no luck after 3 deliveries",
        "failureKind": "Transient",
        "serviceVersion": "relayer@1.4.2",
        "failedAt": "2026-11-29T10:00:00Z",
    });
    if let (Some(spec), Some(decision)) = (spec.as_object_mut(), decision.as_object()) {
        spec.extend(decision.clone());
    }
    serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetter",
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("a DeadLetter")
}

async fn decide(
    client: &kube::Client,
    ns: &str,
    name: &str,
    decision: Value,
) -> Result<DynamicObject, kube::core::Status> {
    dead_letters(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": decision})),
        )
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) => *status,
            other => panic!("expected an API answer, got {other}"),
        })
}

fn field<'a>(obj: &'a DynamicObject, key: &str) -> Option<&'a str> {
    obj.data["spec"][key].as_str()
}

/// Does the operator's ServiceAccount get `verb` on `resource` (`res` or `res/sub`)?
async fn can(
    client: &kube::Client,
    (sa_ns, sa): (&str, &str),
    verb: &str,
    group: &str,
    resource: &str,
    namespace: &str,
    name: &str,
) -> bool {
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let review: SubjectAccessReview = serde_json::from_value(json!({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {
            "user": format!("system:serviceaccount:{sa_ns}:{sa}"),
            "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{sa_ns}"), "system:authenticated"],
            "resourceAttributes": {
                "verb": verb, "group": group, "resource": resource, "subresource": subresource,
                "namespace": namespace, "name": name,
            },
        },
    }))
    .expect("a SubjectAccessReview");
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("SubjectAccessReview");
    answer.status.is_some_and(|s| s.allowed)
}

/// Waits until `probe` holds (RBAC and admission policies reach the apiserver's caches a
/// moment after they are written).
async fn eventually<F, Fut>(what: &str, mut probe: F)
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

// ---------------------------------------------------------------------------------------------
// tests: chart files

#[test]
fn chart_ships_exactly_the_generated_crds() {
    let generated = std::fs::read_to_string(Path::new(ROOT).join("crds/dlq.dev.yaml"))
        .expect("crds/dlq.dev.yaml");
    let shipped =
        std::fs::read_to_string(chart_dir().join("crds/dlq.dev.yaml")).expect("chart CRDs");
    assert!(
        generated == shipped,
        "charts/deadletter-operator/crds/dlq.dev.yaml differs from crds/dlq.dev.yaml: \
         run `make chart-crds` and commit the copy"
    );
    let names: Vec<String> = documents(&shipped)
        .iter()
        .map(|d| name_of(d).to_string())
        .collect();
    assert_eq!(names, ["deadletters.dlq.dev", "deadletterqueues.dlq.dev"]);
}

#[test]
fn helm_lint_passes_and_refuses_bad_values() {
    let lint = |extra: &[&str]| {
        run(
            helm()
                .args(["lint", "--strict", "--kube-version"])
                .arg(&tools().kube_version)
                .arg(chart_dir())
                .args(extra),
            None,
        )
    };
    let out = lint(&[]);
    assert!(out.status.success(), "default values: {}", show(&out));
    let values = scratch_dir("lint").join("values.yaml");
    std::fs::write(
        &values,
        NON_DEFAULT_VALUES.replace("{a}", "a").replace("{b}", "b"),
    )
    .expect("values");
    let out = lint(&["--values", values.to_str().expect("path")]);
    let _ = std::fs::remove_dir_all(values.parent().expect("dir"));
    assert!(out.status.success(), "non-default values: {}", show(&out));

    // A typo in a value name is caught by values.schema.json, not silently ignored.
    let out = lint(&["--set", "watchNamespace={payments}"]);
    assert!(
        !out.status.success(),
        "a misspelt value must fail: {}",
        show(&out)
    );
    assert!(show(&out).contains("watchNamespace"), "{}", show(&out));

    // Values the templates refuse (helm lint reports `fail` only as INFO; template fails).
    let template = |set: &str| {
        run(
            helm()
                .args(["template", "x"])
                .arg(chart_dir())
                .arg("--kube-version")
                .arg(&tools().kube_version)
                .args(["--set", set]),
            None,
        )
    };
    for (set, refusal) in [
        // two active replicas without leader election would both reconcile
        (
            "leaderElection.enabled=false",
            "replicaCount > 1 needs leaderElection.enabled=true",
        ),
        (
            "metrics.serviceMonitor.enabled=true,metrics.service.enabled=false",
            "metrics.serviceMonitor.enabled needs metrics.service.enabled",
        ),
        (
            "userRoles.viewer.aggregateTo={cluster-admin}",
            "/userRoles/viewer/aggregateTo",
        ),
        (
            "admissionPolicy.validationActions={Allow}",
            "validationActions",
        ),
    ] {
        let out = template(set);
        assert!(
            !out.status.success() && show(&out).contains(refusal),
            "--set {set} must be refused with {refusal:?}: {}",
            show(&out)
        );
    }
    let out = template("leaderElection.enabled=false,replicaCount=1");
    assert!(
        out.status.success(),
        "one replica needs no election: {}",
        show(&out)
    );
}

// ---------------------------------------------------------------------------------------------
// tests: rendered manifests against the apiserver

#[tokio::test]
async fn default_render_is_locked_down_and_accepted_by_the_apiserver() {
    let plane = support::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = labelled_namespace(
        &client,
        "chart-default",
        &[
            ("pod-security.kubernetes.io/enforce", "restricted"),
            ("pod-security.kubernetes.io/warn", "restricted"),
        ],
    )
    .await;
    let rel = release("d");
    let full = format!("{rel}-deadletter-operator");
    let docs = render(&rel, &ns, "");

    let expected: BTreeSet<(String, String, String)> = [
        ("ServiceAccount", ns.as_str(), full.clone()),
        ("Deployment", &ns, full.clone()),
        ("PodDisruptionBudget", &ns, full.clone()),
        ("Service", &ns, format!("{full}-metrics")),
        ("ClusterRole", "", full.clone()),
        ("ClusterRoleBinding", "", full.clone()),
        ("Role", &ns, format!("{full}-leader-election")),
        ("RoleBinding", &ns, format!("{full}-leader-election")),
        ("ClusterRole", "", "dlq-viewer".into()),
        ("ClusterRole", "", "dlq-decider".into()),
        ("ClusterRole", "", "dlq-parker".into()),
        (
            "ValidatingAdmissionPolicy",
            "",
            format!("{full}-signed-decisions"),
        ),
        (
            "ValidatingAdmissionPolicyBinding",
            "",
            format!("{full}-signed-decisions"),
        ),
    ]
    .into_iter()
    .map(|(k, n, name)| (k.to_string(), n.to_string(), name))
    .collect();
    assert_eq!(inventory(&docs), expected, "default render");

    // The Deployment: two replicas electing a leader, probes, restricted security context.
    let deploy = only(&docs, "Deployment");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], full.as_str());
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(
        args,
        [
            "run",
            "--metrics-addr=0.0.0.0:8080",
            "--leader-election=true",
            &format!("--lease-name={full}"),
            "--log-format=json"
        ]
    );
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().unwrap_or(""), e))
        .collect();
    assert_eq!(
        env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert!(
        !env.contains_key("WATCH_NAMESPACES"),
        "no namespaces listed: the operator watches all"
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["ports"][0]["containerPort"], 8080);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert!(c["resources"]["requests"]["cpu"].is_string(), "{c:#}");
    assert!(c["resources"]["requests"]["memory"].is_string(), "{c:#}");
    assert_eq!(
        only(&docs, "PodDisruptionBudget")["spec"]["maxUnavailable"],
        1
    );

    // The operator's RBAC is exactly what it uses (cluster-wide, as no namespace is listed).
    assert_eq!(
        grants(&find(&docs, "ClusterRole", "", &full)["rules"]),
        operator_grants()
    );
    assert_eq!(
        grants(&find(&docs, "Role", &ns, &format!("{full}-leader-election"))["rules"]),
        leader_election_grants(&full)
    );

    // User roles: viewer reads, decider decides, parker parks; nobody but the operator deletes.
    let viewer = find(&docs, "ClusterRole", "", "dlq-viewer");
    assert_eq!(
        grants(&viewer["rules"]),
        [
            grant("dlq.dev", "deadletters", &[], &["get", "list", "watch"]),
            grant(
                "dlq.dev",
                "deadletterqueues",
                &[],
                &["get", "list", "watch"]
            ),
        ]
        .into_iter()
        .collect()
    );
    let decider = find(&docs, "ClusterRole", "", "dlq-decider");
    assert_eq!(
        grants(&decider["rules"]),
        [
            grant(
                "dlq.dev",
                "deadletters",
                &[],
                &["get", "list", "watch", "patch", "update"]
            ),
            grant(
                "dlq.dev",
                "deadletterqueues",
                &[],
                &["get", "list", "watch"]
            ),
        ]
        .into_iter()
        .collect()
    );
    let parker = find(&docs, "ClusterRole", "", "dlq-parker");
    assert_eq!(
        grants(&parker["rules"]),
        [
            grant(
                "dlq.dev",
                "deadletters",
                &[],
                &["get", "list", "watch", "create", "patch"]
            ),
            grant(
                "dlq.dev",
                "deadletterqueues",
                &[],
                &["get", "list", "watch"]
            ),
        ]
        .into_iter()
        .collect()
    );
    let aggregated = |role: &Value| -> BTreeSet<String> {
        role["metadata"]["labels"]
            .as_object()
            .expect("labels")
            .iter()
            .filter_map(|(k, v)| {
                (v == "true")
                    .then(|| k.strip_prefix("rbac.authorization.k8s.io/aggregate-to-"))
                    .flatten()
                    .map(String::from)
            })
            .collect()
    };
    // Payloads may hold personal or payment data: not in `view` unless asked for.
    assert_eq!(
        aggregated(viewer),
        ["admin", "edit"].map(String::from).into()
    );
    assert_eq!(aggregated(decider), ["admin"].map(String::from).into());
    assert!(aggregated(parker).is_empty());

    // The policy is on and cluster-wide by default.
    let binding = only(&docs, "ValidatingAdmissionPolicyBinding");
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert!(binding["spec"]["matchResources"].is_null(), "{binding:#}");

    // Every object is accepted by the real apiserver (RBAC escalation checks, schemas,
    // CEL type checks of the policy), and the pod template draws no PodSecurity warning.
    let warnings = dry_run_apply(plane, &docs);
    assert!(
        !warnings.contains("Warning"),
        "warnings from the apiserver: {warnings}"
    );

    // PodSecurity "restricted" is enforced on Pods: the operator's pod is admitted in a
    // namespace that enforces it, and the same pod without its security context is not.
    apply(plane, &[only(&docs, "ServiceAccount").clone()]);
    let as_pod = |spec: &Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "operator-pod", "namespace": ns},
               "spec": spec})
    };
    dry_run_apply(plane, &[as_pod(pod)]);
    let mut loose = pod.clone();
    loose["containers"][0]
        .as_object_mut()
        .expect("container")
        .remove("securityContext");
    let out = run(
        plane
            .kubectl()
            .args(["apply", "--dry-run=server", "-f", "-"]),
        Some(&as_list(&[as_pod(&loose)])),
    );
    assert!(
        !out.status.success() && show(&out).contains("violates PodSecurity"),
        "a pod without the security context must be refused by PodSecurity: {}",
        show(&out)
    );
}

/// Non-default values: `{a}` and `{b}` are replaced by the watched namespaces.
const NON_DEFAULT_VALUES: &str = r#"
replicaCount: 3
image:
  digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
watchNamespaces: ["{a}", "{b}", "{a}"]
admissionPolicy:
  enabled: false
  bypassGroups: [system:serviceaccounts:argocd]
metrics:
  serviceMonitor:
    enabled: true
    labels: {release: kube-prometheus-stack}
prometheusRule:
  enabled: true
  labels: {release: kube-prometheus-stack}
  additionalRuleLabels: {team: payments}
  disabled: {DLQTransientParked: true}
  storm: {invalidPerMinute: 1000, transientPerMinute: 250}
networkPolicy:
  enabled: true
  metricsFrom:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
  apiServer: {cidrs: [10.0.0.1/32]}
userRoles:
  viewer: {aggregateTo: [view, edit, admin]}
extraEnv:
  - {name: RUST_LOG, value: debug}
"#;

#[tokio::test]
async fn non_default_render_is_namespaced_and_accepted_by_the_apiserver() {
    let plane = support::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = labelled_namespace(
        &client,
        "chart-custom",
        &[("pod-security.kubernetes.io/warn", "restricted")],
    )
    .await;
    let a = support::namespace(&client, "chart-watched").await;
    let b = support::namespace(&client, "chart-watched").await;
    let rel = release("c");
    let full = format!("{rel}-deadletter-operator");
    let docs = render(
        &rel,
        &ns,
        &NON_DEFAULT_VALUES.replace("{a}", &a).replace("{b}", &b),
    );

    let kinds: BTreeSet<&str> = docs.iter().map(kind_of).collect();
    for kind in ["ServiceMonitor", "PrometheusRule", "NetworkPolicy"] {
        assert!(kinds.contains(kind), "{kind} enabled but not rendered");
    }
    for kind in [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ClusterRoleBinding",
    ] {
        assert!(!kinds.contains(kind), "{kind} rendered although disabled");
    }
    // Nothing cluster-wide for the operator: only the three user roles are ClusterRoles.
    let cluster_roles: BTreeSet<&str> = docs
        .iter()
        .filter(|d| kind_of(d) == "ClusterRole")
        .map(name_of)
        .collect();
    assert_eq!(cluster_roles, USER_ROLES.into());
    // One Role + RoleBinding per watched namespace (the duplicate is dropped), bound to the
    // ServiceAccount in the release namespace, and the Lease role in the release namespace.
    for watched in [&a, &b] {
        assert_eq!(
            grants(&find(&docs, "Role", watched, &full)["rules"]),
            operator_grants()
        );
        let rb = find(&docs, "RoleBinding", watched, &full);
        assert_eq!(
            rb["subjects"],
            json!([{"kind": "ServiceAccount", "name": full, "namespace": ns}])
        );
        assert_eq!(rb["roleRef"]["name"], full.as_str());
    }
    assert_eq!(
        docs.iter()
            .filter(|d| kind_of(d) == "Role" && name_of(d) == full)
            .count(),
        2
    );
    assert_eq!(
        grants(&find(&docs, "Role", &ns, &format!("{full}-leader-election"))["rules"]),
        leader_election_grants(&full)
    );
    let deploy = only(&docs, "Deployment");
    assert_eq!(deploy["spec"]["replicas"], 3);
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert!(
        c["image"].as_str().is_some_and(|i| i
            .ends_with("@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")),
        "{c:#}"
    );
    let watch = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "WATCH_NAMESPACES")
        .expect("WATCH_NAMESPACES");
    assert_eq!(watch["value"], format!("{a},{b}"));
    let sm = only(&docs, "ServiceMonitor");
    assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
    let rules = &only(&docs, "PrometheusRule")["spec"]["groups"][0]["rules"];
    let alerts: Vec<&str> = rules
        .as_array()
        .expect("rules")
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert!(
        !alerts.contains(&"DLQTransientParked"),
        "disabled alert rendered"
    );
    for rule in rules.as_array().expect("rules") {
        assert_eq!(rule["labels"]["team"], "payments", "{rule:#}");
        if rule["alert"] == "DLQInvalidStorm" {
            assert!(
                rule["expr"].as_str().is_some_and(|e| e.ends_with("> 1000")),
                "{rule:#}"
            );
        }
    }

    // Against the apiserver: the monitoring CRDs come from the prometheus-operator module;
    // without them, only those two kinds are skipped, loudly.
    let docs: Vec<Value> = match monitoring_crds() {
        Ok(crds) => {
            support::apply_crds(&client, crds).await;
            docs
        }
        Err(why) => {
            say(&format!(
                "SKIPPED: the server-side dry run of ServiceMonitor and PrometheusRule \
                 (their CRDs are unavailable: {why})"
            ));
            docs.into_iter()
                .filter(|d| !["ServiceMonitor", "PrometheusRule"].contains(&kind_of(d)))
                .collect()
        }
    };
    let warnings = dry_run_apply(plane, &docs);
    assert!(
        !warnings.contains("Warning"),
        "warnings from the apiserver: {warnings}"
    );
}

#[tokio::test]
async fn operator_rbac_allows_what_the_operator_does_and_nothing_else() {
    let plane = support::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let rbac_only = |docs: Vec<Value>| -> Vec<Value> {
        docs.into_iter()
            .filter(|d| {
                [
                    "ServiceAccount",
                    "ClusterRole",
                    "ClusterRoleBinding",
                    "Role",
                    "RoleBinding",
                ]
                .contains(&kind_of(d))
                    && !USER_ROLES.contains(&name_of(d))
            })
            .collect()
    };
    let elsewhere = support::namespace(&client, "chart-elsewhere").await;

    // All namespaces: a ClusterRole.
    let ns = support::namespace(&client, "chart-rbac").await;
    let rel = release("rb");
    let sa = format!("{rel}-deadletter-operator");
    apply(plane, &rbac_only(render(&rel, &ns, "")));
    let me = (ns.as_str(), sa.as_str());
    eventually("the operator's ClusterRole is in effect", || {
        let client = client.clone();
        let elsewhere = elsewhere.clone();
        async move {
            can(
                &client,
                me,
                "watch",
                "dlq.dev",
                "deadletters",
                &elsewhere,
                "",
            )
            .await
            .then_some(())
            .ok_or_else(|| "cannot watch deadletters".to_string())
        }
    })
    .await;
    for (group, resource, _, verbs) in operator_grants() {
        for verb in &verbs {
            for target in [elsewhere.as_str(), ""] {
                if resource == "secrets" && target.is_empty() {
                    continue;
                }
                assert!(
                    can(&client, me, verb, &group, &resource, target, "").await,
                    "operator cannot {verb} {group}/{resource} in {target:?}"
                );
            }
        }
    }
    for verb in ["create", "update", "patch"] {
        let name = if verb == "create" { "" } else { sa.as_str() };
        assert!(
            can(
                &client,
                me,
                verb,
                "coordination.k8s.io",
                "leases",
                &ns,
                name
            )
            .await,
            "operator cannot {verb} its lease"
        );
    }
    let denied: &[(&str, &str, &str, &str, &str)] = &[
        ("update", "dlq.dev", "deadletters", "payments", ""),
        ("patch", "dlq.dev", "deadletters", "payments", ""),
        ("update", "dlq.dev", "deadletters/status", "payments", ""),
        ("deletecollection", "dlq.dev", "deadletters", "payments", ""),
        ("create", "dlq.dev", "deadletterqueues", "payments", ""),
        ("patch", "dlq.dev", "deadletterqueues", "payments", ""),
        ("delete", "dlq.dev", "deadletterqueues", "payments", ""),
        ("list", "", "secrets", "payments", ""),
        ("watch", "", "secrets", "payments", ""),
        ("get", "", "configmaps", "payments", ""),
        ("list", "", "pods", "payments", ""),
        ("create", "", "events", "payments", ""),
        ("delete", "events.k8s.io", "events", "payments", ""),
        ("get", "coordination.k8s.io", "leases", "payments", &sa),
        ("create", "coordination.k8s.io", "leases", "payments", ""),
        (
            "update",
            "coordination.k8s.io",
            "leases",
            &ns,
            "someone-else",
        ),
        ("delete", "coordination.k8s.io", "leases", &ns, &sa),
        (
            "create",
            "apiextensions.k8s.io",
            "customresourcedefinitions",
            "",
            "",
        ),
        (
            "create",
            "rbac.authorization.k8s.io",
            "rolebindings",
            "payments",
            "",
        ),
    ];
    for (verb, group, resource, target, name) in denied {
        assert!(
            !can(&client, me, verb, group, resource, target, name).await,
            "operator may {verb} {group}/{resource} {target}/{name}, which it never needs"
        );
    }

    // Listed namespaces: Roles there, nothing anywhere else.
    let ns = support::namespace(&client, "chart-rbac").await;
    let a = support::namespace(&client, "chart-watched").await;
    let b = support::namespace(&client, "chart-watched").await;
    let rel = release("rb");
    let sa = format!("{rel}-deadletter-operator");
    apply(
        plane,
        &rbac_only(render(
            &rel,
            &ns,
            &format!("watchNamespaces: [{a}, {b}]\nleaderElection: {{enabled: true}}\n"),
        )),
    );
    let me = (ns.as_str(), sa.as_str());
    eventually("the operator's Roles are in effect", || {
        let client = client.clone();
        let b = b.clone();
        async move {
            can(&client, me, "watch", "dlq.dev", "deadletters", &b, "")
                .await
                .then_some(())
                .ok_or_else(|| "cannot watch deadletters".to_string())
        }
    })
    .await;
    for (group, resource, _, verbs) in operator_grants() {
        for verb in &verbs {
            for watched in [&a, &b] {
                assert!(
                    can(&client, me, verb, &group, &resource, watched, "").await,
                    "operator cannot {verb} {group}/{resource} in watched {watched}"
                );
            }
            for target in [elsewhere.as_str(), ""] {
                assert!(
                    !can(&client, me, verb, &group, &resource, target, "").await,
                    "operator may {verb} {group}/{resource} in unwatched {target:?}"
                );
            }
        }
    }
    assert!(
        can(
            &client,
            me,
            "patch",
            "coordination.k8s.io",
            "leases",
            &ns,
            &sa
        )
        .await,
        "operator cannot patch its lease"
    );
}

// ---------------------------------------------------------------------------------------------
// tests: the admission policy, live

#[tokio::test]
async fn admission_policy_makes_every_decision_signed_by_its_author() {
    let plane = support::plane();
    let admin = plane.client().await;
    chart_crds(&admin).await;
    let ns = support::namespace(&admin, "chart-admission").await;
    let rel = release("adm");
    let kubeconfig = plane.kubeconfig.to_str().expect("kubeconfig path");
    // A real `helm install` of the chart. The policy binding is scoped to this test's
    // namespace through watchNamespaces; this is the only test that installs the user roles.
    let values = format!(
        "watchNamespaces: [{ns}]\nadmissionPolicy:\n  bypassGroups: [\"{GITOPS_GROUP}\"]\n"
    );
    let values_file = scratch_dir("admission").join("values.yaml");
    std::fs::write(&values_file, values).expect("values");
    check(
        "helm install",
        helm()
            .args(["install", &rel])
            .arg(chart_dir())
            .args([
                "--namespace",
                &ns,
                "--skip-crds",
                "--kubeconfig",
                kubeconfig,
            ])
            .arg("--values")
            .arg(&values_file),
        None,
    );

    // alice and the GitOps group may decide; mallory may only look; the worker parks.
    let bind = |name: &str, role: &str, subject: Value| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": ns},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
               "subjects": [subject]})
    };
    let user =
        |n: &str| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": n});
    apply(
        plane,
        &[
            bind("alice-decides", "dlq-decider", user("alice")),
            bind(
                "gitops-decides",
                "dlq-decider",
                json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": GITOPS_GROUP}),
            ),
            bind("mallory-views", "dlq-viewer", user("mallory")),
            bind("worker-parks", "dlq-parker", user("worker")),
        ],
    );
    let records = dead_letters(&admin, &ns);
    for name in ["probe", "pi-alice", "pi-bob", "pi-carol"] {
        records
            .create(&PostParams::default(), &dead_letter(name, json!({})))
            .await
            .expect("an undecided record is created by anyone allowed to");
    }
    let alice = plane.client_as("alice", &[]).await;
    let mallory = plane.client_as("mallory", &[]).await;
    let flux = plane.client_as("flux", &[GITOPS_GROUP]).await;
    let worker = plane.client_as("worker", &[]).await;

    // Wait until both alice's role and the policy are in effect: signing as bob is refused.
    let mut attempt = 0;
    eventually("the signed-decisions policy is in effect", || {
        attempt += 1;
        let alice = alice.clone();
        let ns = ns.clone();
        async move {
            let try_note =
                json!({"action": "drop", "by": "bob", "note": format!("probe {attempt}")});
            match decide(&alice, &ns, "probe", try_note).await {
                Err(s) if s.message.contains("spec.by must be your own user name") => Ok(()),
                Err(s) => Err(format!("{} {}", s.code, s.message)),
                Ok(_) => Err("accepted".into()),
            }
        }
    })
    .await;

    // alice signs her own decision: accepted.
    let decided = decide(
        &alice,
        &ns,
        "pi-alice",
        json!({"action": "redrive", "by": "alice", "note": "payer re-signed, INC-1234"}),
    )
    .await
    .expect("alice signing as alice is accepted");
    assert_eq!(field(&decided, "by"), Some("alice"));
    assert_eq!(field(&decided, "action"), Some("redrive"));

    // alice signs as bob: refused, and the message says who she is and what `by` holds.
    let refused = decide(
        &alice,
        &ns,
        "pi-bob",
        json!({"action": "redrive", "by": "bob"}),
    )
    .await
    .expect_err("alice signing as bob must be refused");
    assert_eq!(refused.code, 403, "{refused:?}");
    assert!(
        refused
            .message
            .contains("spec.by must be your own user name: you are alice, spec.by is bob"),
        "{}",
        refused.message
    );
    let untouched = records.get("pi-bob").await.expect("pi-bob");
    assert_eq!(
        field(&untouched, "action"),
        None,
        "refused change was stored"
    );

    // mallory has no dlq-decider: RBAC forbids before the policy is even asked.
    let forbidden = decide(
        &mallory,
        &ns,
        "pi-bob",
        json!({"action": "drop", "by": "mallory"}),
    )
    .await
    .expect_err("mallory is not a decider");
    assert_eq!(forbidden.code, 403, "{forbidden:?}");
    assert!(
        forbidden
            .message
            .contains("cannot patch resource \"deadletters\""),
        "expected an RBAC refusal: {}",
        forbidden.message
    );

    // A GitOps controller applies carol's committed decision under her name: accepted.
    let applied = decide(
        &flux,
        &ns,
        "pi-carol",
        json!({"action": "drop", "by": "carol", "note": "duplicate, see PR 42"}),
    )
    .await
    .expect("a member of the bypass group may sign as carol");
    assert_eq!(field(&applied, "by"), Some("carol"));

    // Rewriting the justification of carol's decision is a change of the decision too.
    let refused = decide(&alice, &ns, "pi-carol", json!({"note": "not a duplicate"}))
        .await
        .expect_err("alice may not edit carol's decision");
    assert!(
        refused.message.contains("you are alice, spec.by is carol"),
        "{}",
        refused.message
    );
    // Metadata changes are not decisions.
    decide_labels(&alice, &ns, "pi-carol")
        .await
        .expect("labelling a record needs no signature");

    // Creating a record with a decision is held to the same rule.
    let worker_records = dead_letters(&worker, &ns);
    let err = worker_records
        .create(
            &PostParams::default(),
            &dead_letter("pi-pre", json!({"action": "drop", "by": "alice"})),
        )
        .await
        .expect_err("a parker may not create a record decided in alice's name");
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err}")
    };
    assert!(
        status.message.contains("you are worker, spec.by is alice"),
        "{}",
        status.message
    );
    worker_records
        .create(&PostParams::default(), &dead_letter("pi-parked", json!({})))
        .await
        .expect("parking an undecided record needs no signature");
    // Clients that serialise an absent decision as null (nullable fields) park just the same,
    // and deciding on such a record is judged like any other.
    let nulls = json!({"by": null, "note": null});
    worker_records
        .create(
            &PostParams::default(),
            &dead_letter("pi-nulls", nulls.clone()),
        )
        .await
        .expect("a record with null decision fields needs no signature");
    worker_records
        .patch(
            "pi-nulls",
            &PatchParams::apply("dlq-tests-worker").force(),
            &Patch::Apply(dead_letter("pi-nulls", nulls)),
        )
        .await
        .expect("re-applying null decision fields is no decision");
    let refused = decide(
        &alice,
        &ns,
        "pi-nulls",
        json!({"action": "drop", "by": "bob"}),
    )
    .await
    .expect_err("signing as bob over null fields is refused");
    assert!(
        refused.message.contains("you are alice, spec.by is bob"),
        "{}",
        refused.message
    );
    decide(
        &alice,
        &ns,
        "pi-nulls",
        json!({"action": "drop", "by": "alice"}),
    )
    .await
    .expect("alice signs over null fields");

    // Turn the policy off in values (helm upgrade): alice's signing as bob goes through.
    check(
        "helm upgrade",
        helm()
            .args(["upgrade", &rel])
            .arg(chart_dir())
            .args([
                "--namespace",
                &ns,
                "--skip-crds",
                "--kubeconfig",
                kubeconfig,
            ])
            .arg("--values")
            .arg(&values_file)
            .args(["--set", "admissionPolicy.enabled=false"]),
        None,
    );
    let policy = run(
        plane.kubectl().args([
            "get",
            "validatingadmissionpolicy",
            &format!("{rel}-deadletter-operator-signed-decisions"),
        ]),
        None,
    );
    assert!(
        !policy.status.success() && show(&policy).contains("NotFound"),
        "the policy should be gone after the upgrade: {}",
        show(&policy)
    );
    eventually("the policy no longer applies", || {
        let alice = alice.clone();
        let ns = ns.clone();
        async move {
            decide(
                &alice,
                &ns,
                "pi-bob",
                json!({"action": "redrive", "by": "bob"}),
            )
            .await
            .map(|_| ())
            .map_err(|s| format!("{} {}", s.code, s.message))
        }
    })
    .await;
    assert_eq!(
        field(&records.get("pi-bob").await.expect("pi-bob"), "by"),
        Some("bob")
    );

    check(
        "helm uninstall",
        helm().args([
            "uninstall",
            &rel,
            "--namespace",
            &ns,
            "--kubeconfig",
            kubeconfig,
        ]),
        None,
    );
    let _ = std::fs::remove_dir_all(values_file.parent().expect("dir"));
}

async fn decide_labels(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<DynamicObject, kube::Error> {
    dead_letters(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"triage": "seen"}}})),
        )
        .await
}

// ---------------------------------------------------------------------------------------------
// tests: alert rules

/// GitHub's anchor for a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn alert_rules_pass_promtool_and_each_alert_is_tested_and_documented() {
    let t = tools();
    let docs = render(
        "deadletter-operator",
        "dlq-system",
        "prometheusRule:\n  enabled: true\n",
    );
    let rule = only(&docs, "PrometheusRule");
    let dir = scratch_dir("promtool");
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml::to_string(&rule["spec"]).expect("rules YAML"),
    )
    .expect("writing rules.yaml");
    let out = check(
        "promtool check rules",
        Command::new(&t.promtool)
            .args(["check", "rules", "rules.yaml"])
            .current_dir(&dir),
        None,
    );
    assert!(out.contains("SUCCESS"), "{out}");

    // The unit tests next to the chart, run against the rendered rules.
    let mut tests = Vec::new();
    for entry in std::fs::read_dir(chart_dir().join("tests")).expect("chart tests dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
            tests.push(path);
        }
    }
    assert!(!tests.is_empty(), "no promtool tests in the chart's tests/");
    let mut test = Command::new(&t.promtool);
    test.args(["test", "rules"]).current_dir(&dir);
    for path in &tests {
        test.arg(path.file_name().expect("name"));
    }
    check("promtool test rules", &mut test, None);

    // Which alerts the unit tests expect to fire, and to stay quiet, somewhere.
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for path in &tests {
        let text = std::fs::read_to_string(path).expect("test file");
        let doc: Value = serde_yaml::from_str(&text).expect("test YAML");
        for case in doc["tests"].as_array().expect("tests") {
            for art in case["alert_rule_test"].as_array().into_iter().flatten() {
                let name = art["alertname"].as_str().expect("alertname").to_string();
                if art["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()) {
                    fires.insert(name);
                } else {
                    quiet.insert(name);
                }
            }
        }
    }

    // Runbooks: the anchors of every heading in the README and docs/.
    let mut anchors = BTreeSet::new();
    let mut markdown = vec![Path::new(ROOT).join("README.md")];
    if let Ok(dir) = std::fs::read_dir(Path::new(ROOT).join("docs")) {
        markdown.extend(dir.filter_map(|e| e.ok().map(|e| e.path())));
    }
    for file in markdown {
        if let Ok(text) = std::fs::read_to_string(&file) {
            for line in text.lines() {
                if let Some(heading) = line.strip_prefix('#') {
                    anchors.insert(anchor(heading.trim_start_matches('#')));
                }
            }
        }
    }

    let rules = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules");
    let mut severities = BTreeSet::new();
    for r in rules {
        let alert = r["alert"].as_str().expect("only alerting rules");
        let severity = r["labels"]["severity"].as_str().unwrap_or("");
        assert!(
            ["warning", "critical"].contains(&severity),
            "{alert}: severity {severity:?}"
        );
        severities.insert(severity);
        assert!(
            r["annotations"]["summary"]
                .as_str()
                .is_some_and(|s| !s.is_empty()),
            "{alert} has no summary"
        );
        let slug = format!("alert-{}", alert.to_lowercase());
        assert_eq!(
            r["annotations"]["runbook_url"],
            format!("https://github.com/deadletter-operator/deadletter-operator#{slug}"),
            "{alert}"
        );
        assert!(
            anchors.contains(&slug),
            "{alert}: no runbook heading `Alert: {alert}` in README.md or docs/"
        );
        assert!(
            fires.contains(alert),
            "{alert}: no promtool case where it fires"
        );
        assert!(
            quiet.contains(alert),
            "{alert}: no promtool case where it stays quiet"
        );
    }
    assert_eq!(
        severities,
        ["critical", "warning"].into(),
        "alerts are tiered"
    );
    for kind in ["Invalid", "Transient"] {
        for tier in ["Parked", "Storm"] {
            let name = format!("DLQ{kind}{tier}");
            assert!(
                rules.iter().any(|r| r["alert"] == name.as_str()),
                "{name} missing: invalid and transient are alerted separately"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// tests: the Dockerfile

fn hadolint() -> PathBuf {
    let cache = std::env::var_os("DLQ_TOOLS_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(|c| Path::new(&c).join("deadletter-operator/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/deadletter-operator/tools"))
        });
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("hadolint"))
                .collect()
        })
        .unwrap_or_default();
    candidates.extend(cache.map(|c| c.join("hadolint/bin/hadolint")));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("hadolint not found on PATH nor in the tools cache: run `bash scripts/ensure-deps.sh`")
        })
}

#[test]
fn dockerfile_is_hadolint_clean_and_builds_a_non_root_image() {
    let hadolint = hadolint();
    let lint = |input: Option<&str>| {
        let mut cmd = Command::new(&hadolint);
        cmd.args(["--no-color", "--config", ".hadolint.yaml"])
            .arg(if input.is_some() { "-" } else { "Dockerfile" })
            .current_dir(ROOT);
        run(&mut cmd, input)
    };
    let out = lint(None);
    assert!(out.status.success(), "hadolint: {}", show(&out));

    // The linter really lints with this configuration: a sloppy Dockerfile fails.
    let out = lint(Some(
        "FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nCMD [\"curl\"]\n",
    ));
    assert!(
        !out.status.success() && show(&out).contains("DL3007"),
        "hadolint must flag a :latest base image: {}",
        show(&out)
    );

    let text = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).expect("Dockerfile");
    let instructions: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let froms: Vec<&&str> = instructions
        .iter()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert!(froms.len() >= 2, "multi-stage build expected: {froms:?}");
    assert!(
        text.contains("cargo build --release --locked --bin deadletter-operator --bin kubectl-dlq"),
        "a locked release build of both binaries"
    );
    assert!(
        !text.contains("--features") && !text.contains("--all-features"),
        "test-only features (failpoints) in the image"
    );
    let final_stage = text
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .expect("final stage");
    let user = final_stage
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("the final stage sets USER");
    assert!(
        !["root", "0", "0:0", "root:root"].contains(&user.trim()),
        "runs as root: USER {user}"
    );
    for bin in ["deadletter-operator", "kubectl-dlq"] {
        assert!(
            final_stage.contains(bin) && final_stage.contains("/usr/local/bin/"),
            "{bin} not copied into /usr/local/bin of the final image"
        );
    }
    let ignore =
        std::fs::read_to_string(Path::new(ROOT).join(".dockerignore")).expect(".dockerignore");
    for entry in ["target", ".git"] {
        assert!(
            ignore.lines().any(|l| l.trim() == entry),
            ".dockerignore must exclude {entry}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// the operator itself, running with exactly the chart's RBAC

/// A copy of the admin kubeconfig that impersonates `user` in `groups`, as the operator's Pod
/// would authenticate with its ServiceAccount token.
fn impersonating_kubeconfig(plane: &support::Plane, user: &str, groups: &[String]) -> PathBuf {
    let text = std::fs::read_to_string(&plane.kubeconfig).expect("kubeconfig");
    let mut kc: serde_yaml::Value = serde_yaml::from_str(&text).expect("kubeconfig yaml");
    let u = &mut kc["users"][0]["user"];
    u["as"] = serde_yaml::Value::from(user);
    u["as-groups"] = serde_yaml::Value::from(groups.to_vec());
    let dir = scratch_dir("kubeconfig");
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&kc).expect("yaml")).expect("writing kubeconfig");
    path
}

#[tokio::test]
async fn operator_with_exactly_the_charts_rbac_parks_redrives_and_retains() {
    use deadletter::api::{Action, DeadLetter, Job, Phase};
    use deadletter::park::{ParkRequest, park};
    use kube::ResourceExt;

    let plane = support::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    support::install_crds(&client).await;
    let op_ns = support::namespace(&client, "rbac-e2e-op").await;
    let app_ns = support::namespace(&client, "rbac-e2e-app").await;
    let name = release("e2e");
    let values = format!(
        "watchNamespaces: [{app_ns}]\nuserRoles: {{create: false}}\nadmissionPolicy: {{enabled: false}}\n"
    );
    let docs: Vec<Value> = render(&name, &op_ns, &values)
        .into_iter()
        .filter(|d| {
            [
                "ServiceAccount",
                "Role",
                "RoleBinding",
                "ClusterRole",
                "ClusterRoleBinding",
            ]
            .contains(&kind_of(d))
        })
        .collect();
    apply(plane, &docs);
    let sa = name_of(only(&docs, "ServiceAccount")).to_string();
    let deployment = render(&name, &op_ns, &values);
    let args = only(&deployment, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        .clone();
    let lease = args
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix("--lease-name="))
        .expect("the chart passes --lease-name")
        .to_string();
    let user = format!("system:serviceaccount:{op_ns}:{sa}");
    let groups = vec![
        "system:serviceaccounts".to_string(),
        format!("system:serviceaccounts:{op_ns}"),
        "system:authenticated".to_string(),
    ];
    let kubeconfig = impersonating_kubeconfig(plane, &user, &groups);
    let redis = support::Redis::start();
    support::create_queue(
        &client,
        &app_ns,
        &redis.url(),
        support::list_target(),
        json!({"retention": {"resolvedFor": "2s"}}),
    )
    .await;
    let op_args = [
        "--leader-election=true",
        "--lease-namespace",
        op_ns.as_str(),
        "--lease-name",
        lease.as_str(),
    ];
    let kc = kubeconfig.to_string_lossy().to_string();
    let op = support::Operator::start_with(&app_ns, &op_args, &[("KUBECONFIG", kc.as_str())]);

    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &app_ns);
    let parked = park(
        client.clone(),
        &app_ns,
        ParkRequest::new(
            "relayer",
            Job {
                id: "rbac/1".into(),
                payload: Some("p1".into()),
                ..Job::default()
            },
        ),
    )
    .await
    .expect("park");
    let r1 = parked.record().name_any();
    support::wait_phase(&records, &r1, Phase::Parked, 30).await;
    support::decide(&records, &r1, Action::Redrive, "ops").await;
    support::wait_phase(&records, &r1, Phase::Redriven, 30).await;
    assert_eq!(redis.list(support::LIST).await, vec![b"p1".to_vec()]);
    support::eventually(
        60,
        "retention to delete the resolved record with the chart's RBAC",
        || async { records.get_opt(&r1).await.ok()?.is_none().then_some(()) },
    )
    .await;
    assert!(
        !op.logs().contains("forbidden"),
        "the chart's RBAC is enough:\n{}",
        op.logs()
    );

    // Remove one rule (status writes) from the chart's Role: the operator fails visibly.
    let mut broken: Vec<Value> = docs.clone();
    for d in broken
        .iter_mut()
        .filter(|d| kind_of(d) == "Role" && namespace_of(d) == app_ns)
    {
        let rules = d["rules"].as_array_mut().expect("rules");
        rules.retain(|r| {
            !r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x == "deadletters/status"))
        });
    }
    apply(plane, &broken);
    let parked = park(
        client.clone(),
        &app_ns,
        ParkRequest::new(
            "relayer",
            Job {
                id: "rbac/2".into(),
                payload: Some("p2".into()),
                ..Job::default()
            },
        ),
    )
    .await
    .expect("park");
    let r2 = parked.record().name_any();
    support::eventually(
        30,
        "the operator to report the missing permission",
        || async {
            let errors = op.metric("dlq_reconcile_errors_total", &[("kind", "KubeApi")]);
            (errors > 0.0 && op.logs().contains("forbidden")).then_some(())
        },
    )
    .await;
    let r = records.get(&r2).await.expect("record");
    assert!(
        r.status.is_none(),
        "without the status rule nothing is written"
    );
    apply(plane, &docs);
    support::wait_phase(&records, &r2, Phase::Parked, 60).await;
}
