//! One HTTP(S) client builder for everything the operator POSTs to (the http target,
//! Alertmanager): rustls with the public web roots or only a given PEM CA, HTTP/1.1, plain
//! `http://` allowed.

use std::sync::Arc;
use std::time::Duration;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why a client could not be built; the message names the CA's origin but never its content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{0} does not hold PEM certificates")]
    NotPem(String),
    #[error("{0} certificate rejected: {1}")]
    Rejected(String, String),
    #[error("{0} holds no PEM certificate")]
    Empty(String),
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// Trust store: the PEM certificates in `ca` (named `origin` in errors), or the web roots.
fn tls_config(ca: Option<&str>, origin: &str) -> Result<rustls::ClientConfig, TlsError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|_| TlsError::NotPem(origin.into()))?;
                roots
                    .add(cert)
                    .map_err(|e| TlsError::Rejected(origin.into(), e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(TlsError::Empty(origin.into()));
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A pooled client trusting `ca` (or the web roots), with a connect timeout.
pub fn client<B>(
    ca: Option<&str>,
    origin: &str,
    connect_timeout: Duration,
) -> Result<Client<HttpsConnector<HttpConnector>, B>, TlsError>
where
    B: hyper::body::Body + Send,
    B::Data: Send,
{
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config(ca, origin)?)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// Makes rustls' ring provider the process default. Clients that build their own TLS config
/// (Google's Pub/Sub client, which is built without its aws-lc-rs default) take the process
/// default; installed once at start, before any of them. A second call changes nothing.
pub fn install_crypto_provider() {
    // Err: a provider is installed already (a second call, or a test harness did it).
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// "source: cause: cause" — hyper's top-level error alone says little ("client error").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
