//! Google Cloud Pub/Sub, for its source (a subscription on a dead-letter topic) and its target:
//! how to reach it (the emulator, a service-account key or workload identity) and its resource
//! names.

use super::backend::{ConnectError, SharedSide, Sides, shared_secret};
use crate::secret::SecretReads;

/// The environment variable every Google client reads to talk to an emulator instead.
pub const EMULATOR_HOST: &str = "PUBSUB_EMULATOR_HOST";
/// The prefix of the attributes Pub/Sub adds when it dead-letters a message.
pub const DEAD_LETTER_PREFIX: &str = "CloudPubSubDeadLetter";

/// How to reach Pub/Sub: the emulator named by `PUBSUB_EMULATOR_HOST` (plaintext, no
/// credentials), else Google with a service-account key or the pod's workload identity (ADC).
/// No `Debug`: the key must not reach a log line.
#[derive(Clone, Default)]
pub struct PubsubConn {
    /// A service-account key (JSON), from a Secret.
    pub key: Option<String>,
}

impl PubsubConn {
    /// `http://<host:port>` when `PUBSUB_EMULATOR_HOST` is set.
    pub fn emulator() -> Option<String> {
        std::env::var(EMULATOR_HOST)
            .ok()
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.contains("://") {
                    h
                } else {
                    format!("http://{h}")
                }
            })
    }

    /// The endpoint override and the credentials to connect with.
    pub fn settings(
        &self,
    ) -> Result<(Option<String>, google_cloud_auth::credentials::Credentials), String> {
        use google_cloud_auth::credentials;
        if let Some(endpoint) = Self::emulator() {
            return Ok((
                Some(endpoint),
                credentials::anonymous::Builder::new().build(),
            ));
        }
        let creds = match &self.key {
            Some(json) => {
                let value: serde_json::Value = serde_json::from_str(json)
                    .map_err(|e| format!("the service-account key is not JSON: {e}"))?;
                credentials::service_account::Builder::new(value)
                    .build()
                    .map_err(|e| format!("the service-account key is unusable: {e}"))?
            }
            None => credentials::Builder::default()
                .build()
                .map_err(|e| format!("no application default credentials: {e}"))?,
        };
        Ok((None, creds))
    }
}

/// `projects/<project>/<kind>/<name>` unless `name` is a full resource name already.
pub fn resource_name(project: &str, kind: &str, name: &str) -> String {
    if name.starts_with("projects/") {
        name.to_string()
    } else {
        format!("projects/{project}/{kind}/{name}")
    }
}

impl PubsubConn {
    /// A side's key Secret, else the queue's other Pub/Sub side's (both reach one project),
    /// else none: workload identity, or the emulator.
    pub async fn read<Own: SharedSide>(
        secrets: &mut SecretReads<'_>,
        sides: Sides<'_, Own>,
    ) -> Result<PubsubConn, ConnectError> {
        let key = shared_secret(secrets, sides).await?;
        Ok(PubsubConn { key })
    }
}
