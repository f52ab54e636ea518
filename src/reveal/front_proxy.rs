//! Who is asking the reveal API, as the apiserver vouches for it. The apiserver authenticates
//! the caller, then proxies the request with its front-proxy client certificate and the user in
//! headers (`X-Remote-User`, `X-Remote-Group`, `X-Remote-Extra-*`). Those headers are believed
//! only on a connection whose certificate the front-proxy CA issued to an allowed name; both,
//! and the header names, come from `kube-system/extension-apiserver-authentication`, which the
//! apiserver publishes for every aggregated API.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

/// The ConfigMap the apiserver publishes its front-proxy settings in.
pub const CONFIG_MAP: (&str, &str) = ("kube-system", "extension-apiserver-authentication");

/// Why the front-proxy settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FrontProxyError {
    #[error("reading ConfigMap kube-system/extension-apiserver-authentication: {0}")]
    Read(#[source] kube::Error),
    #[error(
        "ConfigMap kube-system/extension-apiserver-authentication has no {0}: the apiserver runs without --requestheader-client-ca-file, so it cannot proxy to an aggregated API"
    )]
    Missing(&'static str),
    #[error(
        "ConfigMap kube-system/extension-apiserver-authentication key {0} is not a JSON list of strings: {1}"
    )]
    NotAList(&'static str, #[source] serde_json::Error),
}

/// Why a request's caller is not known; answered 401.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error("no client certificate: only the apiserver's front proxy may call this API")]
    NoCertificate,
    #[error("the client certificate's name {0:?} is not an allowed front-proxy name")]
    NameNotAllowed(String),
    #[error("the front proxy named no user")]
    NoUser,
}

/// The apiserver's front-proxy settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontProxy {
    /// PEM: the CA issuing the front proxy's client certificate.
    pub client_ca: String,
    /// Names (CN) the front proxy's certificate may have; empty: any the CA issued.
    allowed_names: Vec<String>,
    username_headers: Vec<String>,
    group_headers: Vec<String>,
    extra_prefixes: Vec<String>,
    uid_headers: Vec<String>,
}

impl FrontProxy {
    /// Reads the settings the apiserver published.
    pub async fn load(client: &Client) -> Result<Self, FrontProxyError> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), CONFIG_MAP.0);
        let cm = api.get(CONFIG_MAP.1).await.map_err(FrontProxyError::Read)?;
        Self::parse(&cm.data.unwrap_or_default())
    }

    /// The settings in the ConfigMap's `data`.
    pub fn parse(data: &BTreeMap<String, String>) -> Result<Self, FrontProxyError> {
        let list = |key: &'static str| -> Result<Vec<String>, FrontProxyError> {
            match data.get(key) {
                None => Ok(Vec::new()),
                Some(v) => serde_json::from_str(v).map_err(|e| FrontProxyError::NotAList(key, e)),
            }
        };
        let client_ca = data
            .get("requestheader-client-ca-file")
            .filter(|v| !v.trim().is_empty())
            .ok_or(FrontProxyError::Missing("requestheader-client-ca-file"))?
            .clone();
        let username_headers = list("requestheader-username-headers")?;
        if username_headers.is_empty() {
            return Err(FrontProxyError::Missing("requestheader-username-headers"));
        }
        Ok(FrontProxy {
            client_ca,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
            uid_headers: list("requestheader-uid-headers")?,
        })
    }

    /// The caller of a request that came with `headers` on a connection whose verified client
    /// certificate is `certificate` (DER; rustls checked it against [`FrontProxy::client_ca`]).
    pub fn caller(
        &self,
        certificate: Option<&[u8]>,
        headers: &HeaderMap,
    ) -> Result<UserInfo, Unauthenticated> {
        let certificate = certificate.ok_or(Unauthenticated::NoCertificate)?;
        let name = common_name(certificate).unwrap_or_default();
        if !self.allowed_names.is_empty() && !self.allowed_names.contains(&name) {
            return Err(Unauthenticated::NameNotAllowed(name));
        }
        let username = first(headers, &self.username_headers).ok_or(Unauthenticated::NoUser)?;
        let groups: Vec<String> = self
            .group_headers
            .iter()
            .flat_map(|h| values(headers, h))
            .collect();
        Ok(UserInfo {
            username: Some(username),
            groups: Some(groups),
            uid: first(headers, &self.uid_headers),
            extra: Some(self.extra(headers)).filter(|e| !e.is_empty()),
        })
    }

    /// `X-Remote-Extra-<key>` headers by key (lower case, percent-decoded, as the apiserver
    /// encodes them).
    fn extra(&self, headers: &HeaderMap) -> BTreeMap<String, Vec<String>> {
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, value) in headers {
            let name = name.as_str();
            let Some(key) = self.extra_prefixes.iter().find_map(|p| {
                let p = p.to_ascii_lowercase();
                name.strip_prefix(p.as_str())
            }) else {
                continue;
            };
            if let Ok(value) = value.to_str() {
                extra
                    .entry(percent_decode(key))
                    .or_default()
                    .push(value.to_string());
            }
        }
        extra
    }
}

/// The first non-empty value of any of `names`.
fn first(headers: &HeaderMap, names: &[String]) -> Option<String> {
    names
        .iter()
        .flat_map(|n| values(headers, n))
        .find(|v| !v.is_empty())
}

fn values(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_string)
        .collect()
}

/// `%XX` sequences decoded (extra keys may hold characters a header name cannot).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The certificate's subject common name.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn settings() -> FrontProxy {
        let data: BTreeMap<String, String> = [
            (
                "requestheader-client-ca-file",
                "-----BEGIN CERTIFICATE-----",
            ),
            ("requestheader-allowed-names", r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            (
                "requestheader-extra-headers-prefix",
                r#"["X-Remote-Extra-"]"#,
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        FrontProxy::parse(&data).unwrap()
    }

    fn certificate(cn: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_user_comes_from_the_headers_of_an_allowed_front_proxy_only() {
        let fp = settings();
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", HeaderValue::from_static("alice"));
        h.append("x-remote-group", HeaderValue::from_static("payments"));
        h.append(
            "x-remote-group",
            HeaderValue::from_static("system:authenticated"),
        );
        h.insert(
            "x-remote-extra-scopes%2fa",
            HeaderValue::from_static("read"),
        );
        let user = fp
            .caller(Some(&certificate("front-proxy-client")), &h)
            .unwrap();
        assert_eq!(user.username.as_deref(), Some("alice"));
        assert_eq!(user.groups.unwrap(), ["payments", "system:authenticated"]);
        assert_eq!(user.extra.unwrap()["scopes/a"], ["read"]);

        assert_eq!(fp.caller(None, &h), Err(Unauthenticated::NoCertificate));
        assert_eq!(
            fp.caller(Some(&certificate("mallory")), &h),
            Err(Unauthenticated::NameNotAllowed("mallory".into()))
        );
        assert_eq!(
            fp.caller(Some(&certificate("front-proxy-client")), &HeaderMap::new()),
            Err(Unauthenticated::NoUser)
        );
    }

    #[test]
    fn an_apiserver_without_a_front_proxy_is_named() {
        let err = FrontProxy::parse(&BTreeMap::new()).unwrap_err();
        assert!(
            err.to_string().contains("--requestheader-client-ca-file"),
            "{err}"
        );
    }
}
