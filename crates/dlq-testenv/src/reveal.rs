//! The reveal API registered with the audited test plane as a cluster would: an APIService
//! `v1alpha1.payloads.dlq.dev` backed by a Service that points at the operator on loopback,
//! with a serving certificate from a CA of its own.

use base64::Engine;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use crate::cluster::audited_plane;
use crate::harness::eventually;

/// The reveal API's Service (an ExternalName to loopback, where the operator serves it).
pub const REVEAL_SERVICE: &str = "dlq-reveal";

/// A serving certificate for Service [`REVEAL_SERVICE`] in `ns` from a CA of its own, written
/// as tls.crt/tls.key into a fresh dir: (the dir, the CA's PEM for the APIService's caBundle).
pub fn reveal_certificate(ns: &str) -> (std::path::PathBuf, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    fn fail<T>(what: &str, e: rcgen::Error) -> T {
        panic!("the reveal API's {what}: {e}")
    }
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| fail("CA", e));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap_or_else(|e| fail("CA key", e));
    let ca = CertifiedIssuer::self_signed(ca, ca_key).unwrap_or_else(|e| fail("CA", e));
    let key = KeyPair::generate().unwrap_or_else(|e| fail("key", e));
    let cert = CertificateParams::new(vec![format!("{REVEAL_SERVICE}.{ns}.svc")])
        .and_then(|p| p.signed_by(&key, &ca))
        .unwrap_or_else(|e| fail("certificate", e));
    let dir = std::env::temp_dir().join(format!("dlq-reveal-{}-{ns}", std::process::id()));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("tls.crt"), cert.pem()))
        .and_then(|()| std::fs::write(dir.join("tls.key"), key.serialize_pem()));
    if let Err(e) = written {
        panic!(
            "writing the reveal API's certificate into {}: {e}",
            dir.display()
        );
    }
    (dir, ca.pem())
}

/// The APIService `v1alpha1.payloads.dlq.dev` pointing at the operator on loopback `port`,
/// once the apiserver says it is Available.
pub async fn register_reveal_api(client: &Client, ns: &str, port: u16, ca_pem: &str) {
    let apply = |doc: serde_json::Value| crate::chart::apply(audited_plane(), &[doc]);
    apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": REVEAL_SERVICE, "namespace": ns},
        "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                 "ports": [{"name": "https", "port": port, "targetPort": port}]},
    }));
    apply(json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": "v1alpha1.payloads.dlq.dev"},
        "spec": {
            "group": "payloads.dlq.dev", "version": "v1alpha1",
            "service": {"namespace": ns, "name": REVEAL_SERVICE, "port": port},
            "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem),
            "groupPriorityMinimum": 1000, "versionPriority": 15,
        },
    }));
    let services: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "apiregistration.k8s.io",
            "v1",
            "APIService",
        )),
    );
    eventually(60, "the APIService Available", || async {
        let s = services.get("v1alpha1.payloads.dlq.dev").await.ok()?;
        let conditions = s.data["status"]["conditions"].as_array()?.clone();
        conditions
            .iter()
            .any(|c| c["type"] == "Available" && c["status"] == "True")
            .then_some(())
    })
    .await;
}
