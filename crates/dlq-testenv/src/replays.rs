//! DeadLetterReplays as the rules and admission tests send them: untyped objects, so a test can
//! send what the typed client would never build (a blank `by`, a bad rate).

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::GroupVersionKind;
use serde_json::json;

/// The DeadLetterReplays of `ns`, untyped.
pub fn replays(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("dlq.dev", "v1alpha1", "DeadLetterReplay"),
        "deadletterreplays",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// A dry-run replay `name` of queue `relayer`'s timeouts, signed by `by`.
pub fn replay(name: &str, by: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterReplay",
        "metadata": {"name": name},
        "spec": {"queue": "relayer", "selector": {"reasonContains": "timeout"}, "rate": "20/s",
                 "dryRun": true, "by": by, "note": "INC-1234"},
    }))
    .expect("a DeadLetterReplay")
}
