//! The park Service reaches only the leader: it has no selector, and the replica that leads
//! points its EndpointSlice at itself. A standby could not park (the queue store, job index and
//! parker run only while leading), and a Knative dead-letter delivery answered 503 by a
//! standby is not always retried, so senders must never be sent there.
//!
//! Every new leader writes the slice (server-side apply, one field manager), so a failover
//! moves the Service within the Lease's takeover time; until then the old address refuses or
//! times out and senders retry, as with any endpoint that went away.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

/// The field manager of the slice, and its `managed-by` label.
const MANAGER: &str = "deadletter-operator.dlq.dev";
/// Longest wait between attempts to write the slice while the apiserver refuses.
const RETRY_CAP: Duration = Duration::from_secs(30);

/// Where the leader is reached: the Service to point, and this replica's address.
#[derive(Clone, Debug)]
pub struct LeaderService {
    pub namespace: String,
    pub service: String,
    pub pod: String,
    pub ip: IpAddr,
    pub port: u16,
}

impl LeaderService {
    /// The EndpointSlice naming this replica as the Service's one endpoint.
    pub fn slice(&self) -> serde_json::Value {
        let family = if self.ip.is_ipv4() { "IPv4" } else { "IPv6" };
        serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": self.service,
                "namespace": self.namespace,
                "labels": {
                    "kubernetes.io/service-name": self.service,
                    "endpointslice.kubernetes.io/managed-by": MANAGER,
                },
            },
            "addressType": family,
            "endpoints": [{
                "addresses": [self.ip.to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "targetRef": {"kind": "Pod", "namespace": self.namespace, "name": self.pod},
            }],
            "ports": [{"name": "park", "port": self.port, "protocol": "TCP"}],
        })
    }

    /// Points the Service at this replica, retrying with capped backoff until the apiserver
    /// takes it (senders reach the old leader's address meanwhile, which refuses them).
    pub async fn point_here(&self, client: Client) {
        let api: Api<EndpointSlice> = Api::namespaced(client, &self.namespace);
        let params = PatchParams::apply(MANAGER).force();
        let mut wait = Duration::from_millis(250);
        loop {
            match api
                .patch(&self.service, &params, &Patch::Apply(self.slice()))
                .await
            {
                Ok(_) => {
                    tracing::info!(service = %self.service, ip = %self.ip, port = self.port, "the park Service points at this replica");
                    return;
                }
                Err(kube::Error::Api(e)) if e.code == 422 => {
                    // Not an outage: this address can never be an endpoint (e.g. loopback).
                    tracing::error!(service = %self.service, ip = %self.ip, error = %e, "the park Service cannot point at this replica's address; senders will not reach it");
                    return;
                }
                Err(e) => {
                    tracing::warn!(service = %self.service, error = %e, retry_in = ?wait, "cannot point the park Service at this replica");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RETRY_CAP);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slice_names_the_service_and_this_replica() {
        let s = LeaderService {
            namespace: "dlq-system".into(),
            service: "dlq-park".into(),
            pod: "dlq-0".into(),
            ip: "198.18.0.7".parse().unwrap(),
            port: 8443,
        };
        let slice = s.slice();
        assert_eq!(
            slice["metadata"]["labels"]["kubernetes.io/service-name"],
            "dlq-park"
        );
        assert_eq!(slice["addressType"], "IPv4");
        assert_eq!(slice["endpoints"][0]["addresses"][0], "198.18.0.7");
        assert_eq!(slice["endpoints"][0]["targetRef"]["name"], "dlq-0");
        assert_eq!(slice["ports"][0]["name"], "park");
        assert_eq!(slice["ports"][0]["port"], 8443);
        let v6 = LeaderService {
            ip: "fd00::7".parse().unwrap(),
            ..s
        };
        assert_eq!(v6.slice()["addressType"], "IPv6");
    }
}
