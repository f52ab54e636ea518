//! A ValidatingAdmissionPolicy that refuses some DeadLetter creates in one namespace (422
//! Invalid, a CEL rule), as a cluster's own policy would: how the tests make the apiserver
//! refuse a record for good.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::harness::eventually;

/// Refuses every DeadLetter created in `ns` for which CEL `allowed` is false, with `message`;
/// returns once a dry-run create of `probe` (a record it refuses) is refused, so the policy is
/// in effect. The policy's name, for [`unrefuse`].
pub async fn refuse(
    client: &kube::Client,
    ns: &str,
    name: &str,
    allowed: &str,
    message: &str,
    probe: Value,
) -> String {
    let name = format!("{name}-{ns}");
    let selector = json!({"matchLabels": {"kubernetes.io/metadata.name": ns}});
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "namespaceSelector": selector,
                "resourceRules": [{"apiGroups": ["dlq.dev"], "apiVersions": ["*"],
                                   "operations": ["CREATE"], "resources": ["deadletters"]}],
            },
            "validations": [{"expression": allowed, "message": message, "reason": "Invalid"}],
        },
    }))
    .expect("a policy");
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": selector}},
    }))
    .expect("a binding");
    let pp = PostParams::default();
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&pp, &policy)
        .await
        .expect("the policy created");
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .expect("the binding created");
    let probe: dlq_core::api::DeadLetter = serde_json::from_value(probe).expect("a probe record");
    let api: Api<dlq_core::api::DeadLetter> = Api::namespaced(client.clone(), ns);
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually(30, "the test's admission policy in effect", || async {
        match api.create(&dry, &probe).await {
            Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains(message) => Some(()),
            _ => None,
        }
    })
    .await;
    name
}

/// Removes the policy [`refuse`] made.
pub async fn unrefuse(client: &kube::Client, name: &str) {
    let dp = DeleteParams::default();
    let _ = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .delete(name, &dp)
        .await;
    let _ = Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .delete(name, &dp)
        .await;
}
