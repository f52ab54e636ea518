//! Replays as code (issue 20), end to end with a real Flux: decisions committed to git as
//! DeadLetterReplays, pulled by source-controller from a git server on loopback, applied by
//! kustomize-controller with server-side apply under its own ServiceAccount (in the admission
//! policy's bypass group), carried out by the operator under the chart's RBAC and policy.
//!
//! One Flux for every case, in order: a single-record decision and a dry run, then the real
//! replay, then a manifest that outlives its record (retention deleted it).

use std::time::{Duration, Instant};

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{DeadLetter, DeadLetterQueue, FailureKind, Job, Phase};
use dlq_core::replay::{DeadLetterReplay, ReplayPhase};
use dlq_testenv::chart::{apply, of_kinds, release, render, scratch_dir};
use dlq_testenv::flux::{self, Flux};
use dlq_testenv::{LIST, Operator, eventually, setup_redis_queue};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The ServiceAccount kustomize-controller applies the repository as.
const APPLIER: &str = "flux-applier";

/// The repository's manifests: the single-record decision (a replay naming the record) and
/// the incident replay, dry-run first.
fn manifests(ns: &str, record: &str, dry_run: bool) -> Vec<(String, String)> {
    let decision = format!(
        "apiVersion: dlq.dev/v1alpha1\nkind: DeadLetterReplay\nmetadata: {{name: pi-0001-settle, namespace: {ns}}}\nspec:\n  queue: relayer\n  selector: {{names: [{record}]}}\n  action: redrive\n  by: carol\n  note: \"payer re-signed, INC-1200\"\n"
    );
    let replay = format!(
        "apiVersion: dlq.dev/v1alpha1\nkind: DeadLetterReplay\nmetadata: {{name: inc-1234, namespace: {ns}}}\nspec:\n  queue: relayer\n  selector: {{failureKind: Transient, reasonContains: timeout}}\n  action: redrive\n  rate: 20/s\n  max: 5000\n  stopWhen: {{failureRatio: 0.2, window: 20, newParked: 10}}\n  dryRun: {dry_run}\n  by: carol\n  note: \"node fixed; INC-1234\"\n"
    );
    let kustomization = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [decisions/pi-0001-settle.yaml, replays/inc-1234.yaml]\n";
    vec![
        ("payments/decisions/pi-0001-settle.yaml".into(), decision),
        ("payments/replays/inc-1234.yaml".into(), replay),
        ("payments/kustomization.yaml".into(), kustomization.into()),
    ]
}

async fn park_one(client: &Client, ns: &str, id: &str, reason: &str) -> String {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: id.into(),
            payload: Some(format!("{{\"job\":\"{id}\"}}")),
            ..Job::default()
        },
    );
    r.reason = reason.into();
    r.failure_kind = FailureKind::Transient;
    park(client.clone(), ns, r)
        .await
        .expect("parked")
        .record()
        .name_any()
}

/// The chart's operator RBAC and admission policies for `ns`, Flux's applier in the bypass
/// group; the operator runs as its ServiceAccount (impersonated), so both are really in force.
fn install_chart_security(ns: &str) -> String {
    let rel = release("gitops");
    let values = format!(
        "watchNamespaces: [{ns}]\nleaderElection: {{enabled: false}}\nreplicaCount: 1\nadmissionPolicy:\n  bypassGroups: [\"system:serviceaccounts:{ns}\"]\n"
    );
    let docs = render(&rel, ns, &values);
    let wanted = [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    apply(dlq_testenv::plane(), &of_kinds(&docs, &wanted));
    let applier = json!([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": APPLIER, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": APPLIER, "namespace": ns},
         "rules": [
            {"apiGroups": ["dlq.dev"], "resources": ["deadletterreplays"],
             "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
            {"apiGroups": ["dlq.dev"], "resources": ["deadletters"],
             "verbs": ["get", "list", "watch", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": APPLIER, "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": APPLIER},
         "subjects": [{"kind": "ServiceAccount", "name": APPLIER, "namespace": ns}]}
    ]);
    apply(dlq_testenv::plane(), applier.as_array().expect("documents"));
    format!("system:serviceaccount:{ns}:{rel}-deadletter-operator")
}

/// A kubeconfig that acts as `user` (a ServiceAccount, with its groups).
fn kubeconfig_as(user: &str, ns: &str) -> std::path::PathBuf {
    let admin = std::fs::read_to_string(&dlq_testenv::plane().kubeconfig).expect("kubeconfig");
    let mut kc: serde_yaml::Value = serde_yaml::from_str(&admin).expect("kubeconfig YAML");
    for u in kc["users"].as_sequence_mut().expect("users") {
        u["user"]["as"] = user.into();
        u["user"]["as-groups"] = serde_yaml::to_value([
            "system:serviceaccounts".to_string(),
            format!("system:serviceaccounts:{ns}"),
        ])
        .expect("groups");
    }
    let path = scratch_dir("gitops-operator").join("kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&kc).expect("YAML")).expect("kubeconfig");
    path
}

/// Flux's source and Kustomization for the repository's `payments/` directory.
fn flux_objects(flux: &Flux, ns: &str) -> serde_json::Value {
    json!([
        {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository",
         "metadata": {"name": "decisions", "namespace": ns},
         "spec": {"url": flux.url, "ref": {"branch": flux::BRANCH}, "interval": "2s", "timeout": "20s"}},
        {"apiVersion": "kustomize.toolkit.fluxcd.io/v1", "kind": "Kustomization",
         "metadata": {"name": "payments", "namespace": ns},
         "spec": {"sourceRef": {"kind": "GitRepository", "name": "decisions"},
                  "path": "./payments", "interval": "2s", "retryInterval": "2s", "timeout": "30s",
                  "prune": true, "serviceAccountName": APPLIER, "targetNamespace": ns}}
    ])
}

async fn wait_applied(client: &Client, ns: &str, sha: &str, flux: &Flux) {
    let api = flux::kustomizations(client, ns);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Ok(k) = api.get("payments").await {
            match flux::applied(&k, sha) {
                Ok(()) => return,
                Err(why) => last = why,
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("Flux did not apply {sha}: {last}\n{}", flux.logs());
}

async fn wait_replay(
    api: &Api<DeadLetterReplay>,
    name: &str,
    phase: ReplayPhase,
) -> DeadLetterReplay {
    eventually(60, &format!("replay {name} {}", phase.as_str()), || async {
        api.get_opt(name)
            .await
            .ok()
            .flatten()
            .filter(|r| r.phase() == phase)
    })
    .await
}

/// `kubectl get dlr -n NS -o wide`, as docs/operations.md shows it.
fn kubectl_get_dlr(ns: &str) -> String {
    let out = dlq_testenv::plane()
        .kubectl()
        .args(["get", "dlr", "-n", ns, "-o", "wide"])
        .output()
        .expect("kubectl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn decisions_committed_to_git_are_applied_by_flux_and_carried_out_signed() {
    let started = Instant::now();
    let (client, ns, redis) =
        setup_redis_queue("gitops", json!({"retention": {"resolvedFor": "1h"}})).await;
    let single = park_one(&client, &ns, "pi_0001/settle", "payer had not signed").await;
    for i in 0..5 {
        park_one(
            &client,
            &ns,
            &format!("pi_01{i:02}/settle"),
            "timeout talking to the node",
        )
        .await;
    }
    let operator_sa = install_chart_security(&ns);
    let _op = Operator::start_on(&kubeconfig_as(&operator_sa, &ns), &ns, &[], &[]);
    let flux = Flux::start(&client, &ns).await;
    let flux_ready = started.elapsed();
    apply(
        dlq_testenv::plane(),
        flux_objects(&flux, &ns).as_array().expect("documents"),
    );
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    // 1. A pull request with the single-record decision and the incident's dry run.
    let files = manifests(&ns, &single, true);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, t)| (p.as_str(), t.as_str()))
        .collect();
    let sha = flux.commit(
        &refs,
        &[],
        "INC-1234: redrive pi_0001; dry run of the timeouts",
    );
    wait_applied(&client, &ns, &sha, &flux).await;
    let decision = wait_replay(&replays, "pi-0001-settle", ReplayPhase::Completed).await;
    assert_eq!(decision.status.as_ref().map(|s| s.redriven), Some(1));
    let r = records.get(&single).await.expect("the record");
    assert_eq!(r.phase(), Phase::Redriven);
    assert_eq!(
        r.status.and_then(|s| s.resolved_by).as_deref(),
        Some("carol"),
        "signed as committed"
    );
    let dry = wait_replay(&replays, "inc-1234", ReplayPhase::DryRun).await;
    let status = dry.status.clone().unwrap_or_default();
    assert_eq!(status.selected, 5, "the reviewer's count");
    assert_eq!(status.first_names.len(), 5);
    assert_eq!(redis.list(LIST).await.len(), 1, "a dry run decides nothing");
    let dry_run_view = kubectl_get_dlr(&ns);

    // 2. The reviewed replay: dryRun flipped in a second commit.
    let files = manifests(&ns, &single, false);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, t)| (p.as_str(), t.as_str()))
        .collect();
    let sha = flux.commit(&refs, &[], "INC-1234: replay the timeouts");
    wait_applied(&client, &ns, &sha, &flux).await;
    let done = wait_replay(&replays, "inc-1234", ReplayPhase::Completed).await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(
        (status.selected, status.decided, status.redriven),
        (5, 5, 5),
        "{status:?}"
    );
    for r in records
        .list(&ListParams::default())
        .await
        .expect("records")
        .items
    {
        assert_eq!(r.phase(), Phase::Redriven, "{}", r.name_any());
        assert_eq!(r.spec.by.as_deref(), Some("carol"));
    }
    assert_eq!(redis.list(LIST).await.len(), 6);
    let replay_view = kubectl_get_dlr(&ns);

    // 3. Retention deletes the resolved records; the manifests stay in git. The next sync
    //    stays Ready and recreates nothing. (Kept an hour until now: at 1 s from the start, a
    //    loaded machine's retention deleted the single record before step 1 could read it.)
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    queues
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"retention": {"resolvedFor": "1s"}}})),
        )
        .await
        .expect("shortening the queue's retention");
    eventually(45, "retention to delete the resolved records", || async {
        records
            .list(&ListParams::default())
            .await
            .ok()
            .filter(|l| l.items.is_empty())
            .map(|_| ())
    })
    .await;
    let sha = flux.commit(
        &[("payments/NOTES.md", "INC-1234 closed\n")],
        &[],
        "INC-1234: closed",
    );
    wait_applied(&client, &ns, &sha, &flux).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        records.get_opt(&single).await.expect("get").is_none(),
        "the record is not recreated"
    );
    let kept = replays
        .get("pi-0001-settle")
        .await
        .expect("the decision replay");
    assert_eq!(
        kept.phase(),
        ReplayPhase::Completed,
        "the decision log stays"
    );
    assert_eq!(kept.status.map(|s| s.redriven), Some(1));
    assert_eq!(redis.list(LIST).await.len(), 6, "nothing redriven twice");

    dlq_testenv::report(&format!(
        "gitops: Flux up in {:.1}s, whole test {:.1}s\n-- dry run --\n{dry_run_view}-- replay --\n{replay_view}",
        flux_ready.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
}
