//! Proves the test control plane is a real kube-apiserver: CEL validation, optimistic
//! concurrency and RBAC behave as in a cluster.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;

const WIDGET_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.test.dlq.dev}
spec:
  group: test.dlq.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
            x-kubernetes-validations:
            - rule: self.size <= 10
              message: size must be at most 10
"#;

fn widgets(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("test.dlq.dev", "v1", "Widget"),
        "widgets",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn widget(name: &str, size: i64) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "test.dlq.dev/v1", "kind": "Widget",
        "metadata": {"name": name}, "spec": {"size": size}
    }))
    .unwrap()
}

#[tokio::test]
async fn cel_rule_rejects_a_violating_object() {
    let plane = dlq_testenv::plane();
    let client = plane.client().await;
    dlq_testenv::apply_crds(&client, WIDGET_CRD).await;
    let ns = dlq_testenv::namespace(&client, "cel").await;
    let api = widgets(&client, &ns);
    api.create(&PostParams::default(), &widget("small", 3))
        .await
        .expect("a valid widget is accepted");
    let err = api
        .create(&PostParams::default(), &widget("big", 11))
        .await
        .expect_err("a widget over the CEL bound must be refused");
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err}")
    };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(
        status.message.contains("size must be at most 10"),
        "{}",
        status.message
    );
}

#[tokio::test]
async fn stale_resource_version_gets_409() {
    let client = dlq_testenv::plane().client().await;
    let ns = dlq_testenv::namespace(&client, "cas").await;
    let api: Api<ConfigMap> = Api::namespaced(client, &ns);
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "c"}, "data": {"v": "1"}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &cm).await.unwrap();
    let stale = created.metadata.resource_version.clone().unwrap();
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"v": "2"}})),
    )
    .await
    .unwrap();
    let err = api
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"resourceVersion": stale}, "data": {"v": "3"}
            })),
        )
        .await
        .expect_err("a patch with a stale resourceVersion must conflict");
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err}")
    };
    assert_eq!(status.code, 409, "{status:?}");
    assert_eq!(api.get("c").await.unwrap().data.unwrap()["v"], "2");
}

#[tokio::test]
async fn rbac_forbids_alice_until_a_role_allows_her() {
    let plane = dlq_testenv::plane();
    let admin = plane.client().await;
    dlq_testenv::apply_crds(&admin, WIDGET_CRD).await;
    let ns = dlq_testenv::namespace(&admin, "rbac").await;
    let alice = plane.client_as("alice", &[]).await;

    let err = widgets(&alice, &ns)
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .expect_err("alice has no role yet");
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err}")
    };
    assert_eq!(status.code, 403, "{status:?}");

    let rbac = format!(
        r#"{{"apiVersion":"v1","kind":"List","items":[
        {{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"Role","metadata":{{"name":"widgets","namespace":"{ns}"}},
          "rules":[{{"apiGroups":["test.dlq.dev"],"resources":["widgets"],"verbs":["create"]}}]}},
        {{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding","metadata":{{"name":"alice-widgets","namespace":"{ns}"}},
          "roleRef":{{"apiGroup":"rbac.authorization.k8s.io","kind":"Role","name":"widgets"}},
          "subjects":[{{"apiGroup":"rbac.authorization.k8s.io","kind":"User","name":"alice"}}]}}]}}"#
    );
    let mut apply = plane.kubectl();
    apply
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped());
    let mut child = apply.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), rbac.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(
        child.wait().unwrap().success(),
        "kubectl apply of the role failed"
    );

    // RBAC changes are visible to the authorizer within moments; retry briefly.
    let mut last = None;
    for _ in 0..50 {
        match widgets(&alice, &ns)
            .create(&PostParams::default(), &widget("w", 1))
            .await
        {
            Ok(_) => return,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("alice still cannot create widgets: {last:?}");
}
