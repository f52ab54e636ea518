//! Production packaging (issue 7), the chart itself: the CRDs it ships, `helm lint`, and what
//! it renders with default and non-default values, checked with the real helm and against the
//! real control plane (kube-apiserver + etcd). Nothing is mocked.
//!
//! Each test works in its own namespaces and its own Helm release name, so that cluster-scoped
//! objects (ClusterRoles, admission policies) of one test never meet another test's.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use dlq_testenv::chart::{
    USER_ROLES, apply, as_list, chart_crds, chart_dir, documents, dry_run_apply, find, grant,
    grants, helm, inventory, kind_of, labelled_namespace, leader_election_grants, name_of,
    of_kinds, only, operator_grants, records_ledger_grants, release, render, run, scratch_dir,
    show, tools,
};
use dlq_testenv::{Plane, workspace_root};
use serde_json::{Value, json};

/// The prometheus-operator release whose CRDs (ServiceMonitor, PrometheusRule) the rendered
/// monitoring objects are checked against. Fetched with `go mod download` at test time.
const PROMETHEUS_OPERATOR: &str = "github.com/prometheus-operator/prometheus-operator@v0.85.0";

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
alertmanager:
  urls: [http://alertmanager-operated.monitoring:9093]
  lease: 2m
  tokenSecretRef: {name: alertmanager-token, key: token}
extraEnv:
  - {name: RUST_LOG, value: debug}
"#;

fn non_default_values(a: &str, b: &str) -> String {
    NON_DEFAULT_VALUES.replace("{a}", a).replace("{b}", b)
}

// ---------------------------------------------------------------------------------------------
// chart files

#[test]
fn chart_ships_exactly_the_generated_crds() {
    let generated = std::fs::read_to_string(workspace_root().join("crds/dlq.dev.yaml"))
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
    assert_eq!(
        names,
        [
            "deadletters.dlq.dev",
            "deadletterqueues.dlq.dev",
            "deadletterreplays.dlq.dev",
            "deadlettergroups.dlq.dev"
        ]
    );
}

#[test]
fn chart_packages_the_repositorys_apache_license() {
    let root = std::fs::read_to_string(workspace_root().join("LICENSE")).expect("LICENSE");
    assert!(
        root.contains("Apache License") && root.contains("Version 2.0, January 2004"),
        "LICENSE is the Apache License 2.0 every manifest declares"
    );
    let shipped = std::fs::read_to_string(chart_dir().join("LICENSE")).expect("chart LICENSE");
    assert!(
        root == shipped,
        "charts/deadletter-operator/LICENSE differs from LICENSE: copy it"
    );
    let chart = std::fs::read_to_string(chart_dir().join("Chart.yaml")).expect("Chart.yaml");
    assert!(chart.contains("artifacthub.io/license: Apache-2.0"));
    assert!(
        chart.contains("/blob/main/LICENSE"),
        "Chart.yaml links the LICENSE"
    );
}

/// `helm lint --strict` of the chart with `extra` arguments.
fn lint(extra: &[&str]) -> Output {
    run(
        helm()
            .args(["lint", "--strict", "--kube-version"])
            .arg(&tools().kube_version)
            .arg(chart_dir())
            .args(extra),
        None,
    )
}

/// `helm template` of the chart with one `--set`.
fn template_with(set: &str) -> Output {
    run(
        helm()
            .args(["template", "x"])
            .arg(chart_dir())
            .arg("--kube-version")
            .arg(&tools().kube_version)
            .args(["--set", set]),
        None,
    )
}

#[test]
fn helm_lint_passes_and_refuses_bad_values() {
    let out = lint(&[]);
    assert!(out.status.success(), "default values: {}", show(&out));
    let values = scratch_dir("lint").join("values.yaml");
    std::fs::write(&values, non_default_values("a", "b")).expect("values");
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
        let out = template_with(set);
        assert!(
            !out.status.success() && show(&out).contains(refusal),
            "--set {set} must be refused with {refusal:?}: {}",
            show(&out)
        );
    }
    let out = template_with("leaderElection.enabled=false,replicaCount=1");
    assert!(
        out.status.success(),
        "one replica needs no election: {}",
        show(&out)
    );
}

// ---------------------------------------------------------------------------------------------
// the default render

/// What the chart renders with default values as release `full` in `ns`.
fn default_inventory(ns: &str, full: &str) -> BTreeSet<(String, String, String)> {
    let full = full.to_string();
    [
        ("ServiceAccount", ns, full.clone()),
        ("Deployment", ns, full.clone()),
        ("PodDisruptionBudget", ns, full.clone()),
        ("Service", ns, format!("{full}-metrics")),
        ("ClusterRole", "", full.clone()),
        ("ClusterRoleBinding", "", full.clone()),
        ("Role", ns, format!("{full}-leader-election")),
        ("RoleBinding", ns, format!("{full}-leader-election")),
        ("ClusterRole", "", "dlq-viewer".into()),
        ("ClusterRole", "", "dlq-decider".into()),
        ("ClusterRole", "", "dlq-parker".into()),
        ("ClusterRole", "", "dlq-payload-reader".into()),
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
        (
            "ValidatingAdmissionPolicy",
            "",
            format!("{full}-signed-replays"),
        ),
        (
            "ValidatingAdmissionPolicyBinding",
            "",
            format!("{full}-signed-replays"),
        ),
        (
            "ValidatingAdmissionPolicy",
            "",
            format!("{full}-replay-approvals"),
        ),
        (
            "ValidatingAdmissionPolicyBinding",
            "",
            format!("{full}-replay-approvals"),
        ),
        (
            "ValidatingAdmissionPolicy",
            "",
            format!("{full}-signed-acknowledgements"),
        ),
        (
            "ValidatingAdmissionPolicyBinding",
            "",
            format!("{full}-signed-acknowledgements"),
        ),
    ]
    .into_iter()
    .map(|(k, n, name)| (k.to_string(), n.to_string(), name))
    .collect()
}

/// The Deployment: two replicas electing a leader, probes, restricted security context.
/// Returns its pod spec.
fn assert_deployment_locked_down<'a>(docs: &'a [Value], full: &str) -> &'a Value {
    let deploy = only(docs, "Deployment");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], full);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let c = &pod["containers"][0];
    assert_default_args_and_env(c, full);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["ports"][0]["containerPort"], 8080);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert!(c["resources"]["requests"]["cpu"].is_string(), "{c:#}");
    assert!(c["resources"]["requests"]["memory"].is_string(), "{c:#}");
    assert_eq!(
        only(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"],
        1
    );
    pod
}

/// The container's arguments and environment with default values.
fn assert_default_args_and_env(c: &Value, full: &str) {
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
}

/// The `rbac.authorization.k8s.io/aggregate-to-<role>` labels set to "true".
fn aggregated(role: &Value) -> BTreeSet<String> {
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
}

/// User roles: viewer reads, decider decides, parker parks; nobody but the operator deletes.
fn assert_user_roles(docs: &[Value]) {
    let queues_read = grant(
        "dlq.dev",
        "deadletterqueues",
        &[],
        &["get", "list", "watch"],
    );
    let viewer = find(docs, "ClusterRole", "", "dlq-viewer");
    assert_eq!(
        grants(&viewer["rules"]),
        [
            grant("dlq.dev", "deadletters", &[], &["get", "list", "watch"]),
            queues_read.clone(),
            grant(
                "dlq.dev",
                "deadletterreplays",
                &[],
                &["get", "list", "watch"]
            ),
            grant(
                "dlq.dev",
                "deadlettergroups",
                &[],
                &["get", "list", "watch"]
            ),
        ]
        .into_iter()
        .collect()
    );
    let decider = find(docs, "ClusterRole", "", "dlq-decider");
    assert_eq!(
        grants(&decider["rules"]),
        [
            grant(
                "dlq.dev",
                "deadletters",
                &[],
                &["get", "list", "watch", "patch", "update"]
            ),
            queues_read.clone(),
            grant(
                "dlq.dev",
                "deadletterreplays",
                &[],
                &["get", "list", "watch", "create", "patch", "update"]
            ),
            grant(
                "dlq.dev",
                "deadlettergroups",
                &[],
                &["get", "list", "watch", "patch", "update"]
            ),
        ]
        .into_iter()
        .collect()
    );
    let parker = find(docs, "ClusterRole", "", "dlq-parker");
    assert_eq!(
        grants(&parker["rules"]),
        [
            grant(
                "dlq.dev",
                "deadletters",
                &[],
                &["get", "list", "watch", "create", "patch"]
            ),
            queues_read,
            // the reservation under maxParked: a compare-and-swap on the queue's status
            grant("dlq.dev", "deadletterqueues/status", &[], &["get", "patch"]),
        ]
        .into_iter()
        .collect()
    );
    // Payloads may hold personal or payment data: not in `view` unless asked for.
    assert_eq!(
        aggregated(viewer),
        ["admin", "edit"].map(String::from).into()
    );
    assert_eq!(aggregated(decider), ["admin"].map(String::from).into());
    assert!(aggregated(parker).is_empty());
    // Revealing payloads is its own role, in no built-in one: the viewer sees sealed jobs sealed.
    let reader = find(docs, "ClusterRole", "", "dlq-payload-reader");
    assert_eq!(
        grants(&reader["rules"]),
        [
            grant("payloads.dlq.dev", "deadletterpayloads", &[], &["get"]),
            grant(
                "payloads.dlq.dev",
                "deadletterpayloads/unmasked",
                &[],
                &["get"]
            ),
        ]
        .into_iter()
        .collect()
    );
    assert!(aggregated(reader).is_empty());
}

/// PodSecurity "restricted" is enforced on Pods: the operator's pod is admitted in a namespace
/// that enforces it, and the same pod without its security context is not.
fn assert_pod_security_admits_only_the_locked_down_pod(
    plane: &Plane,
    docs: &[Value],
    ns: &str,
    pod: &Value,
) {
    apply(plane, &[only(docs, "ServiceAccount").clone()]);
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

#[tokio::test]
async fn default_render_is_locked_down_and_accepted_by_the_apiserver() {
    let plane = dlq_testenv::plane();
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
    assert_eq!(
        inventory(&docs),
        default_inventory(&ns, &full),
        "default render"
    );

    let pod = assert_deployment_locked_down(&docs, &full);

    // The operator's RBAC is exactly what it uses (cluster-wide, as no namespace is listed).
    assert_eq!(
        grants(&find(&docs, "ClusterRole", "", &full)["rules"]),
        operator_grants()
    );
    assert_eq!(
        grants(&find(&docs, "Role", &ns, &format!("{full}-leader-election"))["rules"]),
        leader_election_grants(&full)
    );
    assert_user_roles(&docs);

    // The policies (records, replays) are on and cluster-wide by default.
    for binding in of_kinds(&docs, &["ValidatingAdmissionPolicyBinding"]) {
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
        assert!(binding["spec"]["matchResources"].is_null(), "{binding:#}");
    }

    // Every object is accepted by the real apiserver (RBAC escalation checks, schemas,
    // CEL type checks of the policy), and the pod template draws no PodSecurity warning.
    accepted_without_warnings(plane, &docs);
    assert_pod_security_admits_only_the_locked_down_pod(plane, &docs, &ns, pod);
}

// ---------------------------------------------------------------------------------------------
// a non-default render

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

/// The optional kinds follow their values, and nothing cluster-wide is rendered for the
/// operator: only the three user roles are ClusterRoles.
fn assert_optional_kinds(docs: &[Value]) {
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
    let cluster_roles: BTreeSet<&str> = docs
        .iter()
        .filter(|d| kind_of(d) == "ClusterRole")
        .map(name_of)
        .collect();
    assert_eq!(cluster_roles, USER_ROLES.into());
}

/// One Role + RoleBinding per watched namespace (the duplicate is dropped), bound to the
/// ServiceAccount in the release namespace, and the Lease role in the release namespace.
fn assert_namespaced_rbac(docs: &[Value], ns: &str, full: &str, watched: [&str; 2]) {
    for watched in watched {
        assert_eq!(
            grants(&find(docs, "Role", watched, full)["rules"]),
            operator_grants()
        );
        let rb = find(docs, "RoleBinding", watched, full);
        assert_eq!(
            rb["subjects"],
            json!([{"kind": "ServiceAccount", "name": full, "namespace": ns}])
        );
        assert_eq!(rb["roleRef"]["name"], full);
    }
    assert_eq!(
        docs.iter()
            .filter(|d| kind_of(d) == "Role" && name_of(d) == full)
            .count(),
        2
    );
    assert_eq!(
        grants(&find(docs, "Role", ns, &format!("{full}-leader-election"))["rules"]),
        leader_election_grants(full)
    );
}

/// Replicas, the image digest and the watched namespaces reach the Deployment.
fn assert_deployment_values(docs: &[Value], a: &str, b: &str) {
    let deploy = only(docs, "Deployment");
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
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "--alertmanager-url=http://alertmanager-operated.monitoring:9093",
        "--alert-lease=2m",
        "--alertmanager-token-file=/etc/deadletter-operator/alertmanager/token/token",
    ] {
        assert!(args.contains(&want), "{want} in {args:?}");
    }
    let volumes = &deploy["spec"]["template"]["spec"]["volumes"];
    assert_eq!(
        volumes[0]["secret"]["secretName"], "alertmanager-token",
        "{volumes:#}"
    );
    assert_eq!(c["volumeMounts"][0]["name"], "alertmanager-token");
}

/// The ServiceMonitor's labels, and the PrometheusRule's labels, disabled alert and storm
/// thresholds.
fn assert_monitoring_values(docs: &[Value]) {
    let sm = only(docs, "ServiceMonitor");
    assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
    let rules = &only(docs, "PrometheusRule")["spec"]["groups"][0]["rules"];
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
}

/// `docs` with the monitoring CRDs installed; without them, only those two kinds are
/// skipped, loudly.
async fn with_monitoring_crds(client: &kube::Client, docs: Vec<Value>) -> Vec<Value> {
    match monitoring_crds() {
        Ok(crds) => {
            dlq_testenv::apply_crds(client, crds).await;
            docs
        }
        Err(why) => {
            dlq_testenv::report(&format!(
                "SKIPPED: the server-side dry run of ServiceMonitor and PrometheusRule \
                 (their CRDs are unavailable: {why})"
            ));
            docs.into_iter()
                .filter(|d| !["ServiceMonitor", "PrometheusRule"].contains(&kind_of(d)))
                .collect()
        }
    }
}

#[tokio::test]
async fn non_default_render_is_namespaced_and_accepted_by_the_apiserver() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = labelled_namespace(
        &client,
        "chart-custom",
        &[("pod-security.kubernetes.io/warn", "restricted")],
    )
    .await;
    let a = dlq_testenv::namespace(&client, "chart-watched").await;
    let b = dlq_testenv::namespace(&client, "chart-watched").await;
    let rel = release("c");
    let full = format!("{rel}-deadletter-operator");
    let docs = render(&rel, &ns, &non_default_values(&a, &b));

    assert_optional_kinds(&docs);
    assert_namespaced_rbac(&docs, &ns, &full, [&a, &b]);
    assert_deployment_values(&docs, &a, &b);
    assert_monitoring_values(&docs);

    // Against the apiserver: the monitoring CRDs come from the prometheus-operator module.
    let docs = with_monitoring_crds(&client, docs).await;
    accepted_without_warnings(plane, &docs);
}

/// The HTTP park endpoint (issue 33): its port, flags, certificate mount and Service; the
/// cluster-wide reviews it asks; Knative's read of queues, aggregated by label; all accepted
/// by the apiserver. Without a TLS Secret the chart refuses to render.
#[tokio::test]
async fn park_endpoint_render_serves_tls_reviews_tokens_and_lets_knative_resolve_queues() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = dlq_testenv::namespace(&client, "chart-park").await;
    let rel = release("p");
    let full = format!("{rel}-deadletter-operator");
    let docs = render(
        &rel,
        &ns,
        "parkEndpoint: {enabled: true, tlsSecretName: dlq-park-tls, anonymousFrom: [198.18.0.0/16, 'fd00::/8']}\nknative: {addressableResolver: {enabled: true}}\nnetworkPolicy: {enabled: true}\n",
    );
    let deploy = only(&docs, "Deployment");
    let pod = &deploy["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let url = format!("--park-url=https://{full}-park.{ns}.svc:8443");
    for want in [
        "--park-addr=0.0.0.0:8443",
        "--park-tls-dir=/etc/deadletter-operator/park-tls",
        "--park-anonymous-from=198.18.0.0/16,fd00::/8",
        url.as_str(),
    ] {
        assert!(args.contains(&want), "{want} in {args:?}");
    }
    // The Service has no selector: the leader points it at itself.
    let service = format!("--park-service={full}-park");
    assert!(args.contains(&service.as_str()), "{args:?}");
    assert!(
        c["env"]
            .as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "POD_IP"
                && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"),
        "{c:#}"
    );
    let park_service = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == format!("{full}-park"))
        .expect("the park Service");
    assert!(
        park_service["spec"]["selector"].is_null(),
        "{park_service:#}"
    );
    assert_container_port(c, "park", 8443);
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "dlq-park-tls");
    assert_eq!(
        c["volumeMounts"][0]["mountPath"],
        "/etc/deadletter-operator/park-tls"
    );
    let service = docs
        .iter()
        .find(|d| kind_of(d) == "Service" && name_of(d) == format!("{full}-park"))
        .expect("the park Service");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "park");
    let role = |name: String| {
        docs.iter()
            .find(|d| kind_of(d) == "ClusterRole" && name_of(d) == name)
            .unwrap_or_else(|| panic!("ClusterRole {name}"))
            .clone()
    };
    let reviews = role(format!("{full}-park-endpoint"));
    let resources: Vec<&str> = reviews["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(|r| r["resources"].as_array().expect("resources").iter())
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(resources, ["tokenreviews", "subjectaccessreviews"]);
    let knative = role(format!("{full}-knative-addressable-resolver"));
    assert_eq!(
        knative["metadata"]["labels"]["duck.knative.dev/addressable"],
        "true"
    );
    assert_ingress_to(&docs, "park");
    accepted_without_warnings(plane, &docs);

    let refused = template_with("parkEndpoint.enabled=true");
    assert!(!refused.status.success(), "rendered without a TLS Secret");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("parkEndpoint.tlsSecretName"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// The reveal API (issue 32): its port, flags and certificate mount on every replica, a Service
/// selecting the pods, the APIService with its caBundle, the delegated authentication and
/// authorization bindings, the NetworkPolicy's port; accepted by the apiserver. Without a
/// certificate, or without a way for the apiserver to trust it, the chart refuses to render.
#[tokio::test]
async fn reveal_api_render_registers_the_api_service_and_delegates_auth() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = dlq_testenv::namespace(&client, "chart-reveal").await;
    let rel = release("v");
    let full = format!("{rel}-deadletter-operator");
    let ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    let docs = render(
        &rel,
        &ns,
        &format!(
            "revealApi: {{enabled: true, tlsSecretName: dlq-reveal-tls, caBundle: {ca:?}}}\nnetworkPolicy: {{enabled: true}}\n"
        ),
    );
    let pod = &only(&docs, "Deployment")["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "--reveal-addr=0.0.0.0:9443",
        "--reveal-tls-dir=/etc/deadletter-operator/reveal-tls",
    ] {
        assert!(args.contains(&want), "{want} in {args:?}");
    }
    assert_container_port(c, "reveal", 9443);
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "dlq-reveal-tls");
    let service = find(&docs, "Service", &ns, &format!("{full}-reveal"));
    assert_eq!(service["spec"]["ports"][0]["port"], 443);
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "reveal");
    assert_eq!(
        service["spec"]["selector"]["app.kubernetes.io/instance"],
        rel.as_str(),
        "every replica serves it: {service:#}"
    );
    let api = find(&docs, "APIService", "", "v1alpha1.payloads.dlq.dev");
    assert_eq!(api["spec"]["service"]["name"], format!("{full}-reveal"));
    assert_eq!(api["spec"]["service"]["namespace"], ns.as_str());
    use base64::Engine;
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(api["spec"]["caBundle"].as_str().expect("caBundle"))
        .expect("base64");
    assert_eq!(bundle, ca.as_bytes());
    let delegator = find(
        &docs,
        "ClusterRoleBinding",
        "",
        &format!("{full}-reveal-auth-delegator"),
    );
    assert_eq!(delegator["roleRef"]["name"], "system:auth-delegator");
    let reader = find(
        &docs,
        "RoleBinding",
        "kube-system",
        &format!("{full}-reveal-authentication-reader"),
    );
    assert_eq!(
        reader["roleRef"]["name"],
        "extension-apiserver-authentication-reader"
    );
    assert_eq!(reader["subjects"][0]["namespace"], ns.as_str());
    assert_ingress_to(&docs, "reveal");
    // Kept apart from the apiserver's real APIService list: a dry run only.
    accepted_without_warnings(plane, &docs);

    let injected = render(
        &release("vi"),
        &ns,
        "revealApi: {enabled: true, tlsSecretName: t, certManagerCertificate: dlq-system/dlq-reveal}\n",
    );
    let api = find(&injected, "APIService", "", "v1alpha1.payloads.dlq.dev");
    assert_eq!(
        api["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "dlq-system/dlq-reveal"
    );
    assert!(api["spec"]["caBundle"].is_null());
    for (set, refusal) in [
        ("revealApi.enabled=true", "revealApi.tlsSecretName"),
        (
            "revealApi.enabled=true,revealApi.tlsSecretName=t",
            "revealApi.caBundle",
        ),
    ] {
        let out = template_with(set);
        assert!(
            !out.status.success() && show(&out).contains(refusal),
            "--set {set} must be refused with {refusal:?}: {}",
            show(&out)
        );
    }
}

/// `bodyVolume` (issue 48): one replica gets a PersistentVolumeClaim mounted where a queue's
/// `spec.bodies.volume.path` points, kept on uninstall, and a Recreate rollout (a ReadWriteOnce
/// volume attaches to one pod); two replicas on such a volume are refused.
#[tokio::test]
async fn body_volume_render_mounts_a_kept_claim_for_one_replica() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = dlq_testenv::namespace(&client, "chart-bodies").await;
    let rel = release("b");
    let full = format!("{rel}-deadletter-operator");
    let docs = render(
        &rel,
        &ns,
        "replicaCount: 1\nbodyVolume: {enabled: true, size: 2Gi, storageClassName: fast}\n",
    );
    let claim = only(&docs, "PersistentVolumeClaim");
    assert_eq!(claim["metadata"]["name"], format!("{full}-bodies"));
    assert_eq!(
        claim["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    assert_eq!(claim["spec"]["resources"]["requests"]["storage"], "2Gi");
    assert_eq!(claim["spec"]["storageClassName"], "fast");
    let deployment = only(&docs, "Deployment");
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
    let pod = &deployment["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "bodies")
        .expect("the bodies volume");
    assert_eq!(
        volume["persistentVolumeClaim"]["claimName"],
        format!("{full}-bodies")
    );
    let mounts = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m["name"] == "bodies"
                && m["mountPath"] == "/var/lib/deadletter-operator/bodies"),
        "{mounts:?}"
    );
    accepted_without_warnings(plane, &docs);
    let out = template_with("bodyVolume.enabled=true");
    assert!(
        !out.status.success() && show(&out).contains("ReadWriteMany"),
        "two replicas on a ReadWriteOnce volume must be refused: {}",
        show(&out)
    );
    let out = template_with("bodyVolume.enabled=true,bodyVolume.accessModes={ReadWriteMany}");
    assert!(out.status.success(), "{}", show(&out));
}

/// `maxRecords` and `recordQuotas` (issue 58): the ceiling reaches the operator with a Role for
/// its one ledger ConfigMap (and the Event it publishes there) in the release namespace, and
/// each listed namespace gets a ResourceQuota on DeadLetter records; the apiserver takes them.
/// The default render has none of it.
#[tokio::test]
async fn record_bounds_render_a_ceiling_and_quotas_per_namespace() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = dlq_testenv::namespace(&client, "chart-bounds").await;
    let a = dlq_testenv::namespace(&client, "chart-quota-a").await;
    let b = dlq_testenv::namespace(&client, "chart-quota-b").await;
    let rel = release("q");
    let full = format!("{rel}-deadletter-operator");
    let ledger = format!("{full}-records");
    let docs = render(
        &rel,
        &ns,
        &format!(
            "maxRecords: 100000\nrecordQuotas:\n  - {{namespace: {a}, records: 5000}}\n  - {{namespace: {b}, records: 20000}}\n"
        ),
    );
    let deployment = only(&docs, "Deployment");
    let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--max-records=100000"), "{args:?}");
    assert!(
        args.contains(&format!("--lease-name={full}").as_str()),
        "the ledger is named after the Lease: {args:?}"
    );
    assert_eq!(
        grants(&find(&docs, "Role", &ns, &ledger)["rules"]),
        records_ledger_grants(&ledger)
    );
    let binding = find(&docs, "RoleBinding", &ns, &ledger);
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": full, "namespace": ns}])
    );
    for (quota_ns, records) in [(&a, "5000"), (&b, "20000")] {
        let quota = find(&docs, "ResourceQuota", quota_ns, &ledger);
        assert_eq!(
            quota["spec"]["hard"],
            json!({"count/deadletters.dlq.dev": records}),
            "{quota:#}"
        );
    }
    assert_eq!(of_kinds(&docs, &["ResourceQuota"]).len(), 2);
    accepted_without_warnings(plane, &docs);

    let defaults = render(&rel, &ns, "");
    assert!(of_kinds(&defaults, &["ResourceQuota"]).is_empty());
    assert!(
        !defaults
            .iter()
            .any(|d| kind_of(d) == "Role" && name_of(d) == ledger),
        "no ledger Role without maxRecords"
    );
    let default_args =
        only(&defaults, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
            .to_string();
    assert!(!default_args.contains("--max-records"), "{default_args}");
    for bad in [
        "maxRecords=-1",
        "recordQuotas[0].namespace=Not_A_Namespace,recordQuotas[0].records=5",
        "recordQuotas[0].namespace=payments",
    ] {
        let out = template_with(bad);
        assert!(!out.status.success(), "{bad} must be refused");
    }
}

/// The NetworkPolicy lets traffic in to the container port named `port`.
fn assert_ingress_to(docs: &[Value], port: &str) {
    let policy = only(docs, "NetworkPolicy");
    assert!(
        policy["spec"]["ingress"]
            .as_array()
            .expect("ingress")
            .iter()
            .any(|i| i["ports"][0]["port"] == port),
        "{policy:#}"
    );
}

/// The apiserver takes `docs` (a server-side dry run) without a warning.
fn accepted_without_warnings(plane: &Plane, docs: &[Value]) {
    let warnings = dry_run_apply(plane, docs);
    assert!(
        !warnings.contains("Warning"),
        "warnings from the apiserver: {warnings}"
    );
}

/// The container declares port `name` as `number`.
fn assert_container_port(c: &Value, name: &str, number: u16) {
    assert!(
        c["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == name && p["containerPort"] == number),
        "{c:#}"
    );
}
