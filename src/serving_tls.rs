//! The TLS of the park endpoint and the reveal API: the certificate and key from a directory (`tls.crt`, `tls.key`: a
//! Secret of type `kubernetes.io/tls` mounted, as cert-manager writes them), re-read every
//! minute so a renewed certificate is served without a restart. Handshakes run beside the
//! accept loop, so a slow client never holds up the others.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How often the certificate files are read again.
const RELOAD: Duration = Duration::from_secs(60);
/// Longest TLS handshake before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections handshaken but not yet taken by the server.
const BACKLOG: usize = 256;

/// Why the certificate cannot be served; names files, never their content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {0}: {1}")]
    Read(PathBuf, io::Error),
    #[error("{0} holds no PEM certificate")]
    NoCertificate(PathBuf),
    #[error("{0} holds no PEM private key")]
    NoKey(PathBuf),
    #[error("the private key in {0} is not usable: {1}")]
    BadKey(PathBuf, String),
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// The certificate and key in `dir`.
fn load(dir: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let crt_pem = std::fs::read(&crt).map_err(|e| TlsError::Read(crt.clone(), e))?;
    let key_pem = std::fs::read(&key).map_err(|e| TlsError::Read(key.clone(), e))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&crt_pem)
        .filter_map(Result::ok)
        .collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate(crt));
    }
    let private =
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoKey(key.clone()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&private)
        .map_err(|e| TlsError::BadKey(key, e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

/// The certificate currently served.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|k| k.clone())
    }
}

/// Whether `dir` holds a usable certificate and key (to refuse a bad flag at start, before a
/// server that needs more setup is built).
pub fn check(dir: &Path) -> Result<(), TlsError> {
    load(dir).map(|_| ())
}

/// A rustls server config serving the certificate in `dir`, re-read every [`RELOAD`].
pub fn server_config(dir: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    build(dir, None)
}

/// [`server_config`] that also asks clients for a certificate and accepts only ones issued by
/// `client_ca` (PEM); a client without one is let in, to be told apart by the handler (the
/// reveal API's front proxy presents one, nothing else needs to).
pub fn server_config_verifying(
    dir: &Path,
    client_ca: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    build(dir, Some(client_ca))
}

fn build(dir: &Path, client_ca: Option<&str>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let current = Arc::new(Current(RwLock::new(load(dir)?)));
    reload_every_minute(dir, current.clone());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(pem) => builder.with_client_cert_verifier(client_verifier(pem, provider)?),
    };
    let mut config = builder.with_cert_resolver(current);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Verifies client certificates against the PEM CAs in `pem`; no certificate is allowed too.
fn client_verifier(
    pem: &str,
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()).filter_map(Result::ok) {
        roots
            .add(cert)
            .map_err(|e| TlsError::Setup(format!("client CA: {e}")))?;
    }
    if roots.is_empty() {
        return Err(TlsError::Setup(
            "the client CA holds no PEM certificate".into(),
        ));
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Setup(format!("client CA: {e}")))
}

/// Re-reads the certificate in `dir` into `current` every [`RELOAD`].
fn reload_every_minute(dir: &Path, current: Arc<Current>) {
    let dir = dir.to_path_buf();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RELOAD).await;
            match load(&dir) {
                Ok(key) => {
                    if let Ok(mut k) = current.0.write() {
                        *k = key;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, dir = %dir.display(), "re-reading a serving certificate failed; serving the previous one")
                }
            }
        }
    });
}

/// A listener handing out connections whose TLS handshake is done (for `axum::serve`).
pub struct TlsListener {
    addr: SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (tx, ready) = tokio::sync::mpsc::channel(BACKLOG);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        tracing::warn!(error = %e, "accepting a park endpoint connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, ready) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = ready.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
                if tx.is_closed() {
                    return;
                }
            }
        });
        Ok(TlsListener { addr, ready })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop ended (the server is going away): accept nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_cert(dir: &Path, name: &str) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec![name.to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        std::fs::write(dir.join("tls.crt"), cert.pem()).expect("tls.crt");
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).expect("tls.key");
    }

    #[tokio::test]
    async fn a_mounted_secret_is_served_and_a_broken_one_says_which_file() {
        let dir = std::env::temp_dir().join(format!("dlq-park-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let missing = server_config(&dir).expect_err("no files yet");
        assert!(missing.to_string().contains("tls.crt"), "{missing}");
        write_cert(&dir, "localhost");
        assert!(server_config(&dir).is_ok());
        std::fs::write(dir.join("tls.key"), "not a key").expect("write");
        let broken = server_config(&dir).expect_err("no key");
        assert!(broken.to_string().contains("tls.key"), "{broken}");
        assert!(
            !broken.to_string().contains("not a key"),
            "never the content"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
