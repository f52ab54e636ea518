//! Production packaging (issue 7), the chart's admission policy, live: a real `helm install`
//! on the real control plane, and decisions made as different users.
//!
//! The test works in its own namespace and Helm release name, so that the cluster-scoped policy
//! never meets another test's objects.

use std::path::{Path, PathBuf};

use dlq_testenv::Plane;
use dlq_testenv::chart::{
    apply, chart_crds, chart_dir, check, helm, release, run, scratch_dir, show, until_ok,
};
use dlq_testenv::replays::{replay, replays};
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

/// The GitOps group the admission test exempts.
const GITOPS_GROUP: &str = "dlq-tests:gitops";

fn dead_letters(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("dlq.dev", "v1alpha1", "DeadLetter"),
        "deadletters",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// A parked record `name`, with `decision` merged into its spec.
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

/// Merges `decision` into record `name`'s spec as `client`; the apiserver's refusal on error.
async fn decide(
    client: &Client,
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

/// Labels record `name` as `client` (metadata, not a decision).
async fn decide_labels(
    client: &Client,
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

fn field<'a>(obj: &'a DynamicObject, key: &str) -> Option<&'a str> {
    obj.data["spec"][key].as_str()
}

/// The chart installed as release `rel` in `ns` with `values`: `helm install`, `upgrade`
/// and `uninstall` of it against the shared plane.
struct HelmRelease<'a> {
    rel: &'a str,
    ns: &'a str,
    values: PathBuf,
    kubeconfig: &'a Path,
}

impl<'a> HelmRelease<'a> {
    fn install(plane: &'a Plane, rel: &'a str, ns: &'a str, values: &str) -> HelmRelease<'a> {
        let file = scratch_dir("admission").join("values.yaml");
        std::fs::write(&file, values).expect("values");
        let release = HelmRelease {
            rel,
            ns,
            values: file,
            kubeconfig: &plane.kubeconfig,
        };
        release.helm("install", &[]);
        release
    }

    /// `helm <verb>` of the chart with the release's values and `extra` arguments.
    fn helm(&self, verb: &str, extra: &[&str]) {
        check(
            &format!("helm {verb}"),
            helm()
                .args([verb, self.rel])
                .arg(chart_dir())
                .args(["--namespace", self.ns, "--skip-crds", "--kubeconfig"])
                .arg(self.kubeconfig)
                .arg("--values")
                .arg(&self.values)
                .args(extra),
            None,
        );
    }

    fn uninstall(self) {
        check(
            "helm uninstall",
            helm()
                .args([
                    "uninstall",
                    self.rel,
                    "--namespace",
                    self.ns,
                    "--kubeconfig",
                ])
                .arg(self.kubeconfig),
            None,
        );
        let _ = std::fs::remove_dir_all(self.values.parent().expect("dir"));
    }
}

/// alice and the GitOps group may decide; mallory may only look; the worker parks.
fn bind_users(plane: &Plane, ns: &str) {
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
            bind("bob-decides", "dlq-decider", user("bob")),
            bind(
                "gitops-decides",
                "dlq-decider",
                json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": GITOPS_GROUP}),
            ),
            bind("mallory-views", "dlq-viewer", user("mallory")),
            bind("worker-parks", "dlq-parker", user("worker")),
        ],
    );
}

/// The clients of the people and controllers of the scenario.
struct Users {
    alice: Client,
    /// A second decider: the second pair of eyes on alice's replays.
    bob: Client,
    mallory: Client,
    /// A GitOps controller, in the bypass group.
    flux: Client,
    worker: Client,
}

impl Users {
    async fn new(plane: &Plane) -> Users {
        Users {
            alice: plane.client_as("alice", &[]).await,
            bob: plane.client_as("bob", &[]).await,
            mallory: plane.client_as("mallory", &[]).await,
            flux: plane.client_as("flux", &[GITOPS_GROUP]).await,
            worker: plane.client_as("worker", &[]).await,
        }
    }
}

/// Waits until both alice's role and the policy are in effect: signing as bob is refused.
async fn wait_until_policy_in_effect(alice: &Client, ns: &str) {
    let mut attempt = 0;
    until_ok("the signed-decisions policy is in effect", || {
        attempt += 1;
        async move {
            let try_note =
                json!({"action": "drop", "by": "bob", "note": format!("probe {attempt}")});
            match decide(alice, ns, "probe", try_note).await {
                Err(s) if s.message.contains("spec.by must be your own user name") => Ok(()),
                Err(s) => Err(format!("{} {}", s.code, s.message)),
                Ok(_) => Err("accepted".into()),
            }
        }
    })
    .await;
}

/// alice signs her own decision; signing as bob is refused by the policy, and mallory (no
/// dlq-decider) by RBAC before the policy is asked.
async fn assert_only_own_signatures(users: &Users, records: &Api<DynamicObject>, ns: &str) {
    let decided = decide(
        &users.alice,
        ns,
        "pi-alice",
        json!({"action": "redrive", "by": "alice", "note": "payer re-signed, INC-1234"}),
    )
    .await
    .expect("alice signing as alice is accepted");
    assert_eq!(field(&decided, "by"), Some("alice"));
    assert_eq!(field(&decided, "action"), Some("redrive"));

    // alice signs as bob: refused, and the message says who she is and what `by` holds.
    let refused = decide(
        &users.alice,
        ns,
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

    let forbidden = decide(
        &users.mallory,
        ns,
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
}

/// A GitOps controller applies carol's committed decision under her name; nobody else may
/// rewrite it, while metadata stays editable.
async fn assert_gitops_signs_for_its_authors(users: &Users, ns: &str) {
    let applied = decide(
        &users.flux,
        ns,
        "pi-carol",
        json!({"action": "drop", "by": "carol", "note": "duplicate, see PR 42"}),
    )
    .await
    .expect("a member of the bypass group may sign as carol");
    assert_eq!(field(&applied, "by"), Some("carol"));

    // Rewriting the justification of carol's decision is a change of the decision too.
    let refused = decide(
        &users.alice,
        ns,
        "pi-carol",
        json!({"note": "not a duplicate"}),
    )
    .await
    .expect_err("alice may not edit carol's decision");
    assert!(
        refused.message.contains("you are alice, spec.by is carol"),
        "{}",
        refused.message
    );
    // Metadata changes are not decisions.
    decide_labels(&users.alice, ns, "pi-carol")
        .await
        .expect("labelling a record needs no signature");
}

/// Creating a record with a decision is held to the same rule; an undecided one (also with
/// null decision fields) needs no signature.
async fn assert_creation_held_to_the_same_rule(users: &Users, ns: &str) {
    let worker_records = dead_letters(&users.worker, ns);
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
    assert_null_decision_fields_are_no_decision(users, &worker_records, ns).await;
}

/// Clients that serialise an absent decision as null (nullable fields) park just the same,
/// and deciding on such a record is judged like any other.
async fn assert_null_decision_fields_are_no_decision(
    users: &Users,
    worker_records: &Api<DynamicObject>,
    ns: &str,
) {
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
        &users.alice,
        ns,
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
        &users.alice,
        ns,
        "pi-nulls",
        json!({"action": "drop", "by": "alice"}),
    )
    .await
    .expect("alice signs over null fields");
}

/// A replay is signed like a record: created or changed (but for `stop`) only in one's own
/// name, unless a GitOps controller applies it; the operator's ServiceAccount signs records in
/// the replay's name.
async fn assert_replays_are_signed_and_carried_out_in_their_name(
    plane: &Plane,
    users: &Users,
    ns: &str,
    rel: &str,
) {
    let alice = replays(&users.alice, ns);
    until_ok("the signed-replays policy is in effect", || async {
        match alice
            .create(&PostParams::default(), &replay("as-bob", "bob"))
            .await
        {
            Err(kube::Error::Api(s)) if s.message.contains("you are alice, spec.by is bob") => {
                Ok(())
            }
            Err(e) => Err(e.to_string()),
            Ok(_) => Err("accepted".into()),
        }
    })
    .await;
    alice
        .create(&PostParams::default(), &replay("inc-alice", "alice"))
        .await
        .expect("alice's own replay");
    replays(&users.flux, ns)
        .create(&PostParams::default(), &replay("inc-carol", "carol"))
        .await
        .expect("GitOps applies carol's committed replay");
    let merge = |patch: Value| Patch::Merge(json!({ "spec": patch }));
    let refused = alice
        .patch(
            "inc-carol",
            &PatchParams::default(),
            &merge(json!({"dryRun": false})),
        )
        .await
        .expect_err("alice may not start carol's replay");
    assert!(
        format!("{refused}").contains("you are alice, spec.by is carol"),
        "{refused}"
    );
    alice
        .patch(
            "inc-carol",
            &PatchParams::default(),
            &merge(json!({"stop": true})),
        )
        .await
        .expect("anyone who may patch replays may stop one");
    let _ = replays(&users.mallory, ns)
        .create(&PostParams::default(), &replay("inc-mallory", "mallory"))
        .await
        .expect_err("a viewer creates no replay");

    let sa = format!("system:serviceaccount:{ns}:{rel}-deadletter-operator");
    let groups = [
        "system:serviceaccounts".to_string(),
        format!("system:serviceaccounts:{ns}"),
    ];
    let operator = plane
        .client_as(&sa, &[groups[0].as_str(), groups[1].as_str()])
        .await;
    let signed = decide(
        &operator,
        ns,
        "pi-parked",
        json!({"action": "redrive", "by": "carol", "note": "replay inc-carol: INC-1234"}),
    )
    .await
    .expect("the operator signs a record in its replay's name");
    assert_eq!(field(&signed, "by"), Some("carol"));
}

/// An approval of `replay` by `by`, as `kubectl dlq approve` appends it.
fn approval(by: &str) -> Value {
    json!({"by": by, "at": "2026-12-08T10:00:00Z", "note": "INC-1234 reviewed"})
}

/// Sets replay `name`'s approvals to `approvals` as `client` (a merge patch replaces the list,
/// as a client appending to it sends it); the apiserver's refusal in words on error.
async fn approve(client: &Client, ns: &str, name: &str, approvals: Value) -> Result<(), String> {
    replays(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"approvals": approvals}})),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Issue 59 item 1, dual control: alice cannot approve her own replay, approve it as bob, or
/// widen it once approved; bob approves in his own name, once; a GitOps applier's approvals in
/// others' names are refused while the chart does not trust them (gitopsApprovals: false).
async fn assert_approvals_are_signed_by_a_second_person(users: &Users, ns: &str) {
    let alice = replays(&users.alice, ns);
    alice
        .create(&PostParams::default(), &replay("inc-approve", "alice"))
        .await
        .expect("alice's replay");
    until_ok("the replay-approvals policy is in effect", || async {
        match approve(&users.alice, ns, "inc-approve", json!([approval("bob")])).await {
            Err(e)
                if e.contains(
                    "an approval must be in your own name: you are alice, the approval is by bob",
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
            Ok(()) => Err("accepted".into()),
        }
    })
    .await;
    let own = approve(&users.alice, ns, "inc-approve", json!([approval("alice")]))
        .await
        .expect_err("alice may not approve her own replay");
    assert!(
        own.contains("the author of replay inc-approve (alice) cannot approve it"),
        "{own}"
    );
    approve(&users.bob, ns, "inc-approve", json!([approval("bob")]))
        .await
        .expect("bob approves alice's replay in his own name");
    let twice = approve(
        &users.bob,
        ns,
        "inc-approve",
        json!([approval("bob"), {"by": "bob", "at": "2026-12-08T10:05:00Z"}]),
    )
    .await
    .expect_err("bob may not approve twice");
    assert!(
        twice.contains("one approval per person: bob already approved replay inc-approve"),
        "{twice}"
    );
    let widened = alice
        .patch(
            "inc-approve",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"selector": {"reasonContains": "t"}, "max": 100000}})),
        )
        .await
        .expect_err("alice may not widen the replay bob approved");
    assert!(
        widened
            .to_string()
            .contains("replay inc-approve is approved"),
        "{widened}"
    );
    let stored = alice.get("inc-approve").await.expect("inc-approve");
    assert_eq!(
        stored.data["spec"]["approvals"],
        json!([approval("bob")]),
        "only bob's approval is stored"
    );
    assert_eq!(
        stored.data["spec"]["selector"],
        json!({"reasonContains": "timeout"})
    );
    alice
        .patch(
            "inc-approve",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"dryRun": false}})),
        )
        .await
        .expect("the approved dry run is run as approved");
    alice
        .patch(
            "inc-approve",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"stop": true}})),
        )
        .await
        .expect("an approved replay can still be stopped");

    let mut applied = replay("inc-gitops", "carol");
    applied.data["spec"]["approvals"] = json!([approval("dave")]);
    let refused = replays(&users.flux, ns)
        .create(&PostParams::default(), &applied)
        .await
        .expect_err("a GitOps applier's approval in dave's name is refused by default");
    assert!(
        refused.to_string().contains(
            "an approval must be in your own name: you are flux, the approval is by dave"
        ),
        "{refused}"
    );
}

/// `admissionPolicy.gitopsApprovals: true` (helm upgrade): the applier's manifest may carry
/// approvals in others' names (the pull request's review), never the author's own.
async fn assert_gitops_approvals_count_where_the_chart_says(
    release: &HelmRelease<'_>,
    users: &Users,
) {
    release.helm(
        "upgrade",
        &["--set", "admissionPolicy.gitopsApprovals=true"],
    );
    let flux = replays(&users.flux, release.ns);
    let mut applied = replay("inc-gitops", "carol");
    applied.data["spec"]["approvals"] = json!([approval("dave")]);
    until_ok("the applier's approvals are trusted", || async {
        flux.create(&PostParams::default(), &applied)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await;
    let mut own = replay("inc-gitops-own", "carol");
    own.data["spec"]["approvals"] = json!([approval("carol")]);
    let refused = flux
        .create(&PostParams::default(), &own)
        .await
        .expect_err("the author's own approval is refused, even from the applier");
    assert!(
        refused.to_string().contains("(carol) cannot approve it"),
        "{refused}"
    );
}

/// Turning the policy off in values (helm upgrade) removes it: alice's signing as bob goes
/// through.
async fn assert_policy_can_be_turned_off(
    plane: &Plane,
    release: &HelmRelease<'_>,
    users: &Users,
    records: &Api<DynamicObject>,
) {
    release.helm("upgrade", &["--set", "admissionPolicy.enabled=false"]);
    let policy = run(
        plane.kubectl().args([
            "get",
            "validatingadmissionpolicy",
            &format!("{}-deadletter-operator-signed-decisions", release.rel),
        ]),
        None,
    );
    assert!(
        !policy.status.success() && show(&policy).contains("NotFound"),
        "the policy should be gone after the upgrade: {}",
        show(&policy)
    );
    until_ok("the policy no longer applies", || async {
        decide(
            &users.alice,
            release.ns,
            "pi-bob",
            json!({"action": "redrive", "by": "bob"}),
        )
        .await
        .map(|_| ())
        .map_err(|s| format!("{} {}", s.code, s.message))
    })
    .await;
    assert_eq!(
        field(&records.get("pi-bob").await.expect("pi-bob"), "by"),
        Some("bob")
    );
}

/// Acknowledging a failure group silences its alert: alice may acknowledge in her own name,
/// a forged or unsigned acknowledgement is refused, taking one back needs no signature.
async fn assert_acknowledgements_are_signed(admin: &Client, users: &Users, ns: &str) {
    use dlq_core::groups::{DeadLetterGroup, DeadLetterGroupSpec};
    let groups: Api<DeadLetterGroup> = Api::namespaced(admin.clone(), ns);
    let mut g = DeadLetterGroup::new("relayer-3f9a1c07d2", DeadLetterGroupSpec::default());
    g.metadata.labels = Some(
        [("dlq.dev/group".to_string(), "3f9a1c07d2".to_string())]
            .into_iter()
            .collect(),
    );
    groups
        .create(&PostParams::default(), &g)
        .await
        .expect("a group");
    let alice: Api<DeadLetterGroup> = Api::namespaced(users.alice.clone(), ns);
    let ack =
        |by: &str| Patch::Merge(json!({"spec": {"acknowledged": {"by": by, "note": "INC-1234"}}}));
    let mut forged = None;
    until_ok(
        "the signed-acknowledgements policy is in effect",
        || async {
            match alice
                .patch("relayer-3f9a1c07d2", &PatchParams::default(), &ack("bob"))
                .await
            {
                Err(kube::Error::Api(s)) if s.message.contains("you are alice") => Ok(()),
                Err(e) => Err(e.to_string()),
                Ok(_) => Err("accepted".into()),
            }
        },
    )
    .await;
    let err = alice
        .patch("relayer-3f9a1c07d2", &PatchParams::default(), &ack("bob"))
        .await
        .expect_err("alice acknowledging as bob is refused");
    if let kube::Error::Api(s) = err {
        forged = Some((s.code, s.message));
    }
    let (code, message) = forged.unwrap_or_default();
    assert_eq!(code, 403);
    assert!(
        message.contains(
            "spec.acknowledged.by must be your own user name: you are alice, spec.acknowledged.by is bob"
        ),
        "{message}"
    );
    let unsigned = alice
        .patch("relayer-3f9a1c07d2", &PatchParams::default(), &ack(" "))
        .await
        .expect_err("an unsigned acknowledgement is refused");
    assert!(unsigned.to_string().contains("signed"), "{unsigned}");
    let acked = alice
        .patch("relayer-3f9a1c07d2", &PatchParams::default(), &ack("alice"))
        .await
        .expect("alice acknowledges in her own name");
    assert_eq!(
        acked.spec.acknowledged.map(|a| a.by).as_deref(),
        Some("alice")
    );
    alice
        .patch(
            "relayer-3f9a1c07d2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"acknowledged": null}})),
        )
        .await
        .expect("taking an acknowledgement back needs no signature");
}

#[tokio::test]
async fn admission_policy_makes_every_decision_signed_by_its_author() {
    let plane = dlq_testenv::plane();
    let admin = plane.client().await;
    chart_crds(&admin).await;
    let ns = dlq_testenv::namespace(&admin, "chart-admission").await;
    let rel = release("adm");
    // A real `helm install` of the chart. The policy binding is scoped to this test's
    // namespace through watchNamespaces; this is the only test that installs the user roles.
    let values = format!(
        "watchNamespaces: [{ns}]\nadmissionPolicy:\n  bypassGroups: [\"{GITOPS_GROUP}\"]\n"
    );
    let release = HelmRelease::install(plane, &rel, &ns, &values);
    bind_users(plane, &ns);
    let records = dead_letters(&admin, &ns);
    for name in ["probe", "pi-alice", "pi-bob", "pi-carol"] {
        records
            .create(&PostParams::default(), &dead_letter(name, json!({})))
            .await
            .expect("an undecided record is created by anyone allowed to");
    }
    let users = Users::new(plane).await;

    wait_until_policy_in_effect(&users.alice, &ns).await;
    assert_only_own_signatures(&users, &records, &ns).await;
    assert_gitops_signs_for_its_authors(&users, &ns).await;
    assert_creation_held_to_the_same_rule(&users, &ns).await;
    assert_replays_are_signed_and_carried_out_in_their_name(plane, &users, &ns, &rel).await;
    assert_acknowledgements_are_signed(&admin, &users, &ns).await;
    assert_approvals_are_signed_by_a_second_person(&users, &ns).await;
    assert_gitops_approvals_count_where_the_chart_says(&release, &users).await;
    assert_policy_can_be_turned_off(plane, &release, &users, &records).await;
    release.uninstall();
}
