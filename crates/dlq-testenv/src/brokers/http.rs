//! A small HTTP(S) sink: records every request and answers with a settable status.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// A lock that a panicking test cannot poison for the next one.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One request the sink received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// Header names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    /// The first value of header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A TLS identity for the sink: a CA (given to the operator through a Secret) and a serving
/// certificate for 127.0.0.1/localhost.
pub struct TestCa {
    pub ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCa {
    pub fn new() -> TestCa {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key"))
            .expect("self-signing the test CA");
        let params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .expect("serving certificate parameters");
        let key = KeyPair::generate().expect("serving key");
        let cert = params
            .signed_by(&key, &ca)
            .expect("signing the serving certificate");
        let chain = vec![
            CertificateDer::from_pem_slice(cert.pem().as_bytes())
                .expect("the serving certificate as DER"),
        ];
        let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes())
            .expect("the serving key as DER");
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions of the ring provider")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("a TLS server config");
        TestCa {
            ca_pem: ca.pem(),
            server: Arc::new(server),
        }
    }
}

/// What the serving threads share with the sink.
#[derive(Clone)]
struct Shared {
    tls: Option<Arc<rustls::ServerConfig>>,
    status: Arc<AtomicU16>,
    body: Arc<Mutex<String>>,
    received: Arc<Mutex<Vec<Received>>>,
}

/// A small HTTP/1.1 server that records every request and answers with a settable status.
pub struct HttpSink {
    pub port: u16,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// The status code of every answer (200 at start).
    pub status: Arc<AtomicU16>,
    /// The body of every answer ("ok" at start).
    pub body: Arc<Mutex<String>>,
    pub received: Arc<Mutex<Vec<Received>>>,
    running: Mutex<Option<Arc<AtomicBool>>>,
}

impl HttpSink {
    /// Plain HTTP, or HTTPS with the certificate of `tls`.
    pub fn start(tls: Option<&TestCa>) -> HttpSink {
        let s = HttpSink {
            port: super::child::port(),
            tls: tls.map(|t| t.server.clone()),
            status: Arc::new(AtomicU16::new(200)),
            body: Arc::new(Mutex::new("ok".into())),
            received: Arc::new(Mutex::new(Vec::new())),
            running: Mutex::new(None),
        };
        s.restart();
        s
    }

    pub fn url(&self, path: &str) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}{path}", self.port)
    }

    /// POSTs received so far.
    pub fn posts(&self) -> Vec<Received> {
        lock(&self.received)
            .iter()
            .filter(|r| r.method == "POST")
            .cloned()
            .collect()
    }

    /// Opens the port (again) and serves until [`HttpSink::stop`].
    pub fn restart(&self) {
        let mut slot = lock(&self.running);
        assert!(slot.is_none(), "sink already running");
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .unwrap_or_else(|e| panic!("binding the sink to port {}: {e}", self.port));
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let alive = Arc::new(AtomicBool::new(true));
        *slot = Some(alive.clone());
        let shared = Shared {
            tls: self.tls.clone(),
            status: self.status.clone(),
            body: self.body.clone(),
            received: self.received.clone(),
        };
        std::thread::spawn(move || accept_loop(listener, shared, alive));
    }

    /// Closes the port: new connections are refused until [`HttpSink::restart`].
    pub fn stop(&self) {
        if let Some(alive) = lock(&self.running).take() {
            alive.store(false, Ordering::SeqCst);
        }
        super::child::wait_closed(self.port, 5);
    }
}

impl Drop for HttpSink {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Accepts connections until `alive` turns false, one thread per connection.
fn accept_loop(listener: TcpListener, shared: Shared, alive: Arc<AtomicBool>) {
    while alive.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let (shared, alive) = (shared.clone(), alive.clone());
                std::thread::spawn(move || connection(stream, &shared, &alive));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => break,
        }
    }
}

/// One connection, in TLS when the sink has a certificate.
fn connection(stream: TcpStream, shared: &Shared, alive: &AtomicBool) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    match &shared.tls {
        Some(cfg) => {
            let Ok(conn) = rustls::ServerConnection::new(cfg.clone()) else {
                return;
            };
            serve(&mut rustls::StreamOwned::new(conn, stream), shared, alive);
        }
        None => {
            let mut stream = stream;
            serve(&mut stream, shared, alive);
        }
    }
}

/// One request off the wire: method, path, headers (names lower-cased) and body; None when
/// the connection closed.
fn read_request<R: BufRead>(reader: &mut R) -> Option<Received> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        let h = h.trim_end_matches(['\r', '\n']);
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some(Received {
        method,
        path,
        headers,
        body,
    })
}

/// Serves keep-alive requests on one connection until it closes or the sink stops.
fn serve<S: Read + Write>(s: &mut S, shared: &Shared, alive: &AtomicBool) {
    let mut reader = BufReader::new(s);
    while let Some(request) = read_request(&mut reader) {
        if !alive.load(Ordering::SeqCst) {
            return;
        }
        let head = request.method == "HEAD";
        lock(&shared.received).push(request);
        let code = shared.status.load(Ordering::SeqCst);
        let text = lock(&shared.body).clone();
        let reply = if head {
            format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n")
        } else {
            format!(
                "HTTP/1.1 {code} X\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{text}",
                text.len()
            )
        };
        let w = reader.get_mut();
        if w.write_all(reply.as_bytes()).is_err() || w.flush().is_err() {
            return;
        }
    }
}
