//! Reading credentials from Secrets, for targets and sources. Errors name the Secret and key,
//! never the value.

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};

use dlq_core::api::SecretKeyRef;

/// Why a Secret's key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("reading secret {name}: {reason}")]
    Read {
        name: String,
        reason: String,
        #[source]
        source: kube::Error,
    },
    #[error("secret {0} not found")]
    NotFound(String),
    #[error("secret {name} has no key {key}")]
    NoKey { name: String, key: String },
    #[error("secret {name} key {key} is not UTF-8")]
    NotUtf8 { name: String, key: String },
}

/// Reads one key of a Secret as trimmed UTF-8, with the Secret's resourceVersion.
pub async fn read_secret(
    client: &Client,
    namespace: &str,
    r: &SecretKeyRef,
) -> Result<(String, String), SecretError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = api
        .get_opt(&r.name)
        .await
        .map_err(|source| SecretError::Read {
            name: r.name.clone(),
            reason: kube_reason(&source),
            source,
        })?
        .ok_or_else(|| SecretError::NotFound(r.name.clone()))?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(|| SecretError::NoKey {
            name: r.name.clone(),
            key: r.key.clone(),
        })?;
    let value = String::from_utf8(bytes).map_err(|_| SecretError::NotUtf8 {
        name: r.name.clone(),
        key: r.key.clone(),
    })?;
    Ok((
        value.trim().to_string(),
        secret.resource_version().unwrap_or_default(),
    ))
}

/// The apiserver's reason and code, without the request details.
fn kube_reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.reason, s.code),
        other => other.to_string(),
    }
}

/// The Secrets one connection is read from, all in its queue's namespace, with the versions
/// read: a cache hashes them to notice a rotated Secret.
pub struct SecretReads<'a> {
    client: &'a Client,
    namespace: &'a str,
    versions: Vec<String>,
}

impl<'a> SecretReads<'a> {
    pub fn new(client: &'a Client, namespace: &'a str) -> Self {
        SecretReads {
            client,
            namespace,
            versions: Vec::new(),
        }
    }

    /// One key's value; its Secret's version is noted.
    pub async fn value(&mut self, r: &SecretKeyRef) -> Result<String, SecretError> {
        let (value, version) = read_secret(self.client, self.namespace, r).await?;
        self.versions.push(version);
        Ok(value)
    }

    /// The versions of every Secret read so far, in the order read.
    pub fn versions(&self) -> &[String] {
        &self.versions
    }
}
