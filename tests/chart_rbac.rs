//! Production packaging (issue 7), the operator's RBAC as the chart grants it: asked of the real
//! apiserver's authorizer (SubjectAccessReview), and lived with by the real operator.
//!
//! Each test works in its own namespaces and its own Helm release name, so that cluster-scoped
//! objects (ClusterRoles, bindings) of one test never meet another test's.

use std::path::PathBuf;

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{Action, DeadLetter, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::chart::{
    USER_ROLES, apply, chart_crds, kind_of, name_of, namespace_of, of_kinds, only, operator_grants,
    release, render, scratch_dir, until_ok,
};
use dlq_testenv::{
    LIST, Operator, Plane, create_queue, decide, eventually, list_target, wait_phase,
};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// The kinds that make up the operator's RBAC.
const RBAC_KINDS: [&str; 5] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
];

/// The operator's ServiceAccount: (namespace, name).
type Sa<'a> = (&'a str, &'a str);

/// Does the operator's ServiceAccount get `verb` on `resource` (`res` or `res/sub`)?
async fn can(
    client: &Client,
    (sa_ns, sa): Sa<'_>,
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

/// Waits until the ServiceAccount may watch deadletters in `ns` (RBAC reaches the authorizer's
/// cache a moment after it is written).
async fn wait_until_it_can_watch(client: &Client, me: Sa<'_>, ns: &str, what: &str) {
    until_ok(what, || async move {
        can(client, me, "watch", "dlq.dev", "deadletters", ns, "")
            .await
            .then_some(())
            .ok_or_else(|| "cannot watch deadletters".to_string())
    })
    .await;
}

/// The operator's own RBAC objects (not the user roles) of a render.
fn operator_rbac(docs: &[Value]) -> Vec<Value> {
    of_kinds(docs, &RBAC_KINDS)
        .into_iter()
        .filter(|d| !USER_ROLES.contains(&name_of(d)))
        .collect()
}

/// What the operator never needs, in namespace `payments` or its own `ns`.
fn never_needed<'a>(
    ns: &'a str,
    sa: &'a str,
) -> Vec<(&'a str, &'a str, &'a str, &'a str, &'a str)> {
    vec![
        ("update", "dlq.dev", "deadletters", "payments", ""),
        ("update", "dlq.dev", "deadletters/status", "payments", ""),
        ("create", "dlq.dev", "deadletterreplays", "payments", ""),
        ("patch", "dlq.dev", "deadletterreplays", "payments", ""),
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
        ("get", "coordination.k8s.io", "leases", "payments", sa),
        ("create", "coordination.k8s.io", "leases", "payments", ""),
        (
            "update",
            "coordination.k8s.io",
            "leases",
            ns,
            "someone-else",
        ),
        ("delete", "coordination.k8s.io", "leases", ns, sa),
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
    ]
}

/// No namespace listed: a ClusterRole gives everything the operator does, everywhere, its
/// Lease in its own namespace, and nothing else.
async fn assert_cluster_wide_rbac_is_exact(client: &Client, plane: &Plane, elsewhere: &str) {
    let ns = dlq_testenv::namespace(client, "chart-rbac").await;
    let rel = release("rb");
    let sa = format!("{rel}-deadletter-operator");
    apply(plane, &operator_rbac(&render(&rel, &ns, "")));
    let me = (ns.as_str(), sa.as_str());
    wait_until_it_can_watch(
        client,
        me,
        elsewhere,
        "the operator's ClusterRole is in effect",
    )
    .await;
    for (group, resource, _, verbs) in operator_grants() {
        for verb in &verbs {
            for target in [elsewhere, ""] {
                if resource == "secrets" && target.is_empty() {
                    continue;
                }
                assert!(
                    can(client, me, verb, &group, &resource, target, "").await,
                    "operator cannot {verb} {group}/{resource} in {target:?}"
                );
            }
        }
    }
    for verb in ["create", "update", "patch"] {
        let name = if verb == "create" { "" } else { sa.as_str() };
        assert!(
            can(client, me, verb, "coordination.k8s.io", "leases", &ns, name).await,
            "operator cannot {verb} its lease"
        );
    }
    for (verb, group, resource, target, name) in never_needed(&ns, &sa) {
        assert!(
            !can(client, me, verb, group, resource, target, name).await,
            "operator may {verb} {group}/{resource} {target}/{name}, which it never needs"
        );
    }
}

/// Listed namespaces: Roles there, nothing anywhere else.
async fn assert_listed_namespaces_confine_the_rbac(
    client: &Client,
    plane: &Plane,
    elsewhere: &str,
) {
    let ns = dlq_testenv::namespace(client, "chart-rbac").await;
    let a = dlq_testenv::namespace(client, "chart-watched").await;
    let b = dlq_testenv::namespace(client, "chart-watched").await;
    let rel = release("rb");
    let sa = format!("{rel}-deadletter-operator");
    let values = format!("watchNamespaces: [{a}, {b}]\nleaderElection: {{enabled: true}}\n");
    apply(plane, &operator_rbac(&render(&rel, &ns, &values)));
    let me = (ns.as_str(), sa.as_str());
    wait_until_it_can_watch(client, me, &b, "the operator's Roles are in effect").await;
    for (group, resource, _, verbs) in operator_grants() {
        for verb in &verbs {
            for watched in [&a, &b] {
                assert!(
                    can(client, me, verb, &group, &resource, watched, "").await,
                    "operator cannot {verb} {group}/{resource} in watched {watched}"
                );
            }
            for target in [elsewhere, ""] {
                assert!(
                    !can(client, me, verb, &group, &resource, target, "").await,
                    "operator may {verb} {group}/{resource} in unwatched {target:?}"
                );
            }
        }
    }
    assert!(
        can(
            client,
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

#[tokio::test]
async fn operator_rbac_allows_what_the_operator_does_and_nothing_else() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let elsewhere = dlq_testenv::namespace(&client, "chart-elsewhere").await;
    assert_cluster_wide_rbac_is_exact(&client, plane, &elsewhere).await;
    assert_listed_namespaces_confine_the_rbac(&client, plane, &elsewhere).await;
}

// ---------------------------------------------------------------------------------------------
// the operator itself, running with exactly the chart's RBAC

/// A copy of the admin kubeconfig that impersonates `user` in `groups`, as the operator's Pod
/// would authenticate with its ServiceAccount token.
fn impersonating_kubeconfig(plane: &Plane, user: &str, groups: &[String]) -> PathBuf {
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

/// What a release of the chart installs for the operator in `op_ns`, watching `app_ns`.
struct Release {
    /// Its ServiceAccount, (Cluster)Roles and bindings, as rendered.
    rbac: Vec<Value>,
    /// The ServiceAccount's name.
    sa: String,
    /// The Lease the Deployment's operator elects its leader on.
    lease: String,
    /// The Deployment's `--max-records`, if any.
    max_records: Option<String>,
}

/// Renders release `name` (with `extra` values) and applies its RBAC (nothing else: the
/// operator runs here).
fn install_rbac(plane: &Plane, name: &str, op_ns: &str, app_ns: &str, extra: &str) -> Release {
    let values = format!(
        "watchNamespaces: [{app_ns}]\nuserRoles: {{create: false}}\nadmissionPolicy: {{enabled: false}}\n{extra}"
    );
    let docs = render(name, op_ns, &values);
    let rbac = of_kinds(&docs, &RBAC_KINDS);
    apply(plane, &rbac);
    let sa = name_of(only(&rbac, "ServiceAccount")).to_string();
    let args = &only(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"];
    let arg = |flag: &str| {
        args.as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .find_map(|a| a.strip_prefix(flag))
            .map(str::to_string)
    };
    let lease = arg("--lease-name=").expect("the chart passes --lease-name");
    let max_records = arg("--max-records=");
    Release {
        rbac,
        sa,
        lease,
        max_records,
    }
}

/// The operator as the release's Deployment would run it: as its ServiceAccount, electing a
/// leader on its Lease.
fn start_operator_as(plane: &Plane, release: &Release, op_ns: &str, app_ns: &str) -> Operator {
    let user = format!("system:serviceaccount:{op_ns}:{}", release.sa);
    let groups = vec![
        "system:serviceaccounts".to_string(),
        format!("system:serviceaccounts:{op_ns}"),
        "system:authenticated".to_string(),
    ];
    let kubeconfig = impersonating_kubeconfig(plane, &user, &groups);
    let mut op_args = vec![
        "--leader-election=true".to_string(),
        format!("--lease-namespace={op_ns}"),
        format!("--lease-name={}", release.lease),
    ];
    if let Some(max) = &release.max_records {
        op_args.push(format!("--max-records={max}"));
    }
    let op_args: Vec<&str> = op_args.iter().map(String::as_str).collect();
    let kc = kubeconfig.to_string_lossy().to_string();
    Operator::start_with(app_ns, &op_args, &[("KUBECONFIG", kc.as_str())])
}

/// Parks job `id` on queue `relayer`; returns the record's name.
async fn park_job(client: &Client, ns: &str, id: &str, payload: &str) -> String {
    let job = Job {
        id: id.into(),
        payload: Some(payload.into()),
        ..Job::default()
    };
    park(client.clone(), ns, ParkRequest::new("relayer", job))
        .await
        .expect("park")
        .record()
        .name_any()
}

/// The chart's Roles without the rule on deadletters/status in `app_ns`.
fn without_status_rule(rbac: &[Value], app_ns: &str) -> Vec<Value> {
    let mut broken = rbac.to_vec();
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
    broken
}

#[tokio::test]
async fn operator_with_exactly_the_charts_rbac_parks_redrives_and_retains() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    dlq_testenv::install_crds(&client).await;
    let op_ns = dlq_testenv::namespace(&client, "rbac-e2e-op").await;
    let app_ns = dlq_testenv::namespace(&client, "rbac-e2e-app").await;
    let release = install_rbac(plane, &release("e2e"), &op_ns, &app_ns, "");
    let redis = Redis::start();
    create_queue(
        &client,
        &app_ns,
        &redis.url(),
        list_target(),
        json!({"retention": {"resolvedFor": "2s"}}),
    )
    .await;
    let op = start_operator_as(plane, &release, &op_ns, &app_ns);

    // Park, redrive and retention, with nothing forbidden.
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &app_ns);
    let r1 = park_job(&client, &app_ns, "rbac/1", "p1").await;
    wait_phase(&records, &r1, Phase::Parked, 30).await;
    decide(&records, &r1, Action::Redrive, "ops").await;
    wait_phase(&records, &r1, Phase::Redriven, 30).await;
    assert_eq!(redis.list(LIST).await, vec![b"p1".to_vec()]);
    eventually(
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

    // Remove one rule (status writes) from the chart's Role: the operator fails visibly. A
    // record is marked without a status write (its managed fields cleared), so it is the
    // resolution that needs the rule: the job goes back, the resolution's write is refused and
    // retried, and once the rule is back the record is Redriven without a second enqueue.
    apply(plane, &without_status_rule(&release.rbac, &app_ns));
    let r2 = park_job(&client, &app_ns, "rbac/2", "p2").await;
    wait_phase(&records, &r2, Phase::Parked, 30).await;
    decide(&records, &r2, Action::Redrive, "ops").await;
    eventually(
        30,
        "the operator to report the missing permission",
        || async {
            let errors = op.metric("dlq_reconcile_errors_total", &[("kind", "KubeApi")]);
            (errors > 0.0 && op.logs().contains("forbidden")).then_some(())
        },
    )
    .await;
    let r = records.get(&r2).await.expect("record");
    let status = r.status.clone().unwrap_or_default();
    assert_eq!(
        (r.phase(), status.resolved_by),
        (Phase::Parked, None),
        "without the status rule no resolution is written"
    );
    apply(plane, &release.rbac);
    wait_phase(&records, &r2, Phase::Redriven, 60).await;
    let sent = redis.list(LIST).await;
    assert_eq!(
        sent.iter().filter(|j| j.as_slice() == b"p2").count(),
        1,
        "one enqueue of the job whose resolution was refused: {sent:?}"
    );
}

/// `maxRecords` (issue 58) with exactly the chart's RBAC: the operator counts its records into
/// its ledger ConfigMap in its own namespace and says the ceiling there, and its sources park
/// no more than the ceiling, nothing forbidden.
#[tokio::test]
async fn the_records_ceiling_needs_nothing_beyond_the_charts_rbac() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    dlq_testenv::install_crds(&client).await;
    let op_ns = dlq_testenv::namespace(&client, "rbac-ceil-op").await;
    let app_ns = dlq_testenv::namespace(&client, "rbac-ceil-app").await;
    let release = install_rbac(plane, &release("ceil"), &op_ns, &app_ns, "maxRecords: 5\n");
    assert_eq!(release.max_records.as_deref(), Some("5"));
    let redis = Redis::start();
    create_queue(
        &client,
        &app_ns,
        &redis.url(),
        list_target(),
        json!({"source": {"redis": {"list": "relayer:dead"}}}),
    )
    .await;
    {
        let mut c = redis.conn().await;
        for i in 0..8 {
            let env = json!({"id": format!("ceil/{i}"), "payload": "{}"});
            let _: () = redis::cmd("LPUSH")
                .arg("relayer:dead")
                .arg(env.to_string())
                .query_async(&mut c)
                .await
                .expect("LPUSH");
        }
    }
    let op = start_operator_as(plane, &release, &op_ns, &app_ns);
    let ledger = format!("{}-records", release.lease);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &op_ns);
    eventually(60, "the ledger to count 5 records", || async {
        let cm = maps.get_opt(&ledger).await.ok()??;
        (cm.data?.get("records")? == "5").then_some(())
    })
    .await;
    eventually(30, "a MaxRecordsReached Event on the ledger", || async {
        let e = dlq_testenv::events_for(&client, &op_ns, &ledger, "MaxRecordsReached").await;
        (!e.is_empty()).then_some(())
    })
    .await;
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &app_ns);
    let listed = records.list(&Default::default()).await.expect("list");
    assert_eq!(listed.items.len(), 5, "exactly the ceiling");
    assert!(
        !op.logs().contains("forbidden"),
        "the chart's RBAC is enough:\n{}",
        op.logs()
    );
}

/// With the park endpoint (issue 33) the operator may ask the apiserver who a caller is and
/// what it may do (TokenReview, SubjectAccessReview: cluster-scoped, so a ClusterRole even
/// with watchNamespaces), and nothing more: no tokens of its own making, no impersonation.
#[tokio::test]
async fn park_endpoint_rbac_reviews_callers_and_nothing_else() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    chart_crds(&client).await;
    let ns = dlq_testenv::namespace(&client, "chart-rbac-park").await;
    let app = dlq_testenv::namespace(&client, "chart-park-app").await;
    let rel = release("rp");
    let sa = format!("{rel}-deadletter-operator");
    let values = format!(
        "watchNamespaces: [{app}]\nparkEndpoint: {{enabled: true, tlsSecretName: park-tls}}\n"
    );
    apply(plane, &operator_rbac(&render(&rel, &ns, &values)));
    let me = (ns.as_str(), sa.as_str());
    let admin = &client;
    until_ok(
        "the park endpoint's ClusterRole is in effect",
        || async move {
            can(
                admin,
                me,
                "create",
                "authentication.k8s.io",
                "tokenreviews",
                "",
                "",
            )
            .await
            .then_some(())
            .ok_or_else(|| "cannot create tokenreviews".to_string())
        },
    )
    .await;
    assert!(
        can(
            &client,
            me,
            "create",
            "authorization.k8s.io",
            "subjectaccessreviews",
            "",
            ""
        )
        .await,
        "cannot ask SubjectAccessReviews"
    );
    for (verb, group, resource, target) in [
        ("create", "", "serviceaccounts/token", app.as_str()),
        ("impersonate", "", "users", ""),
        ("list", "", "secrets", app.as_str()),
    ] {
        assert!(
            !can(&client, me, verb, group, resource, target, "").await,
            "operator may {verb} {group}/{resource} in {target:?}"
        );
    }
    // The leader's EndpointSlice for the park Service: that one, in its own namespace.
    let service = format!("{sa}-park");
    let slices = "endpointslices";
    let discovery = "discovery.k8s.io";
    for (verb, target, name, allowed) in [
        ("create", ns.as_str(), "", true),
        ("patch", ns.as_str(), service.as_str(), true),
        ("get", ns.as_str(), service.as_str(), true),
        ("patch", ns.as_str(), "kubernetes", false),
        ("delete", ns.as_str(), service.as_str(), false),
        ("create", app.as_str(), "", false),
    ] {
        assert_eq!(
            can(&client, me, verb, discovery, slices, target, name).await,
            allowed,
            "{verb} endpointslices {name:?} in {target}"
        );
    }
}
