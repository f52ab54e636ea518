//! Real brokers for the backend tests: RabbitMQ (Debian's rabbitmq-server), nats-server with
//! JetStream, and a small HTTP(S) sink. Each runs as a child on free loopback ports with its
//! data in a temp dir, and dies with the test process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use deadletter::api::DeadLetterQueue;
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::which;

fn temp_dir(kind: &str, port: u16) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dlq-{kind}-{}-{port}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("broker dir");
    dir
}

fn wait_listening(port: u16, secs: u64, what: &str, log: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what} did not listen on {port} within {secs}s; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Spawns `cmd` from a thread that lives as long as the test process, so a broker shared by
/// several tests is not killed (PR_SET_PDEATHSIG) when the test that started it ends.
fn spawn_detached_from_test(mut cmd: Command, log: PathBuf) -> Child {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let child = deadletter::testenv::spawn_guarded(&mut cmd, &log);
        let _ = tx.send(child);
        loop {
            std::thread::park();
        }
    });
    rx.recv().expect("spawner thread").expect("starting broker")
}

fn stop_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

// ---------------------------------------------------------------- RabbitMQ

/// A RabbitMQ node (no plugins) with its own epmd, on free loopback ports.
pub struct Rabbit {
    pub port: u16,
    dist_port: u16,
    epmd_port: u16,
    node: String,
    dir: PathBuf,
    epmd: Mutex<Option<Child>>,
    beam: Mutex<Option<Child>>,
    shared: bool,
}

/// RabbitMQ shared by every test of one binary; tests isolate themselves by queue names.
pub fn shared_rabbit() -> &'static Rabbit {
    static RABBIT: OnceLock<Rabbit> = OnceLock::new();
    RABBIT.get_or_init(|| Rabbit::start_with(true))
}

impl Rabbit {
    /// A node for one test (it can be stopped and restarted).
    pub fn start() -> Rabbit {
        Self::start_with(false)
    }

    fn start_with(shared: bool) -> Rabbit {
        let script = PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server");
        assert!(
            script.is_file(),
            "rabbitmq-server not installed: run scripts/ensure-deps.sh (apt-get install rabbitmq-server)"
        );
        let port = deadletter::testenv::free_port().expect("port");
        let dist_port = deadletter::testenv::free_port().expect("port");
        let epmd_port = deadletter::testenv::free_port().expect("port");
        let dir = temp_dir("rabbit", port);
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("enabled_plugins");
        let r = Rabbit {
            port,
            dist_port,
            epmd_port,
            node: format!("dlqtest{}x{port}@localhost", std::process::id()),
            dir,
            epmd: Mutex::new(None),
            beam: Mutex::new(None),
            shared,
        };
        let epmd = which("epmd")
            .or_else(|| {
                std::fs::read_dir("/usr/lib/erlang")
                    .ok()?
                    .filter_map(|e| e.ok())
                    .map(|e| e.path().join("bin/epmd"))
                    .find(|p| p.is_file())
            })
            .expect("epmd (erlang-base) not found");
        let mut cmd = Command::new(epmd);
        cmd.args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"]);
        let log = r.dir.join("epmd.log");
        let child = if shared {
            spawn_detached_from_test(cmd, log.clone())
        } else {
            deadletter::testenv::spawn_guarded(&mut cmd, &log).expect("starting epmd")
        };
        *r.epmd.lock().unwrap() = Some(child);
        wait_listening(epmd_port, 10, "epmd", &log);
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Starts the node (again, with the same name and data).
    pub fn restart(&self) {
        let mut slot = self.beam.lock().unwrap();
        assert!(slot.is_none(), "rabbitmq already running");
        let d = |p: &str| self.dir.join(p);
        let mut cmd = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
        cmd.env("HOME", &self.dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", d("plugins-expand"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", d("rabbitmq-env.conf"))
            .env("RABBITMQ_PID_FILE", d("rabbit.pid"))
            // exec the VM in place (no signal-proxy shell), so the kill-on-exit guard reaches it.
            .env("RABBITMQ_ALLOW_INPUT", "true")
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "-noinput");
        let log = d("rabbitmq.log");
        let child = if self.shared {
            spawn_detached_from_test(cmd, log.clone())
        } else {
            deadletter::testenv::spawn_guarded(&mut cmd, &log).expect("starting rabbitmq-server")
        };
        *slot = Some(child);
        drop(slot);
        wait_listening(self.port, 90, "rabbitmq-server", &log);
        // The port opens a moment before the broker accepts logins.
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = self.url();
        while Instant::now() < deadline {
            let ok = std::thread::scope(|s| {
                s.spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(async {
                            lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                                .await
                                .is_ok()
                        })
                })
                .join()
                .unwrap_or(false)
            });
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("rabbitmq-server did not accept AMQP connections");
    }

    /// Kills the node hard, like a crashed broker.
    pub fn stop(&self) {
        stop_child(&mut self.beam.lock().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub async fn conn(&self) -> lapin::Connection {
        lapin::Connection::connect(&self.url(), lapin::ConnectionProperties::default())
            .await
            .expect("amqp connection")
    }

    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn = self.conn().await;
        let ch = conn.create_channel().await.expect("channel");
        (conn, ch)
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        stop_child(&mut self.beam.lock().unwrap());
        stop_child(&mut self.epmd.lock().unwrap());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Declares a durable queue with `args` (e.g. x-dead-letter-exchange).
pub async fn declare_queue(ch: &lapin::Channel, name: &str, args: lapin::types::FieldTable) {
    ch.queue_declare(
        name.into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declaring queue {name}: {e}"));
}

pub async fn declare_exchange(ch: &lapin::Channel, name: &str, kind: lapin::ExchangeKind) {
    ch.exchange_declare(
        name.into(),
        kind,
        lapin::options::ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring exchange {name}: {e}"));
}

/// Messages ready in `queue`.
pub async fn queue_depth(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("queue {queue}: {e}"))
    .message_count()
}

/// Takes every message now in `queue` (acking them).
pub async fn drain(ch: &lapin::Channel, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
    {
        out.push(m);
    }
    out
}

// ---------------------------------------------------------------- NATS

/// A nats-server with JetStream on a free loopback port; restartable with the same store.
pub struct Nats {
    pub port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Nats {
    pub fn start() -> Nats {
        let port = deadletter::testenv::free_port().expect("port");
        let n = Nats {
            port,
            dir: temp_dir("nats", port),
            child: Mutex::new(None),
        };
        n.restart();
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn restart(&self) {
        let mut slot = self.child.lock().unwrap();
        assert!(slot.is_none(), "nats-server already running");
        let bin = which("nats-server").unwrap_or_else(|| {
            panic!(
                "nats-server not found: run scripts/ensure-deps.sh (apt-get install nats-server)"
            )
        });
        let log = self.dir.join("nats.log");
        let child = deadletter::testenv::spawn_guarded(
            Command::new(bin)
                .args([
                    "-js",
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-sd",
                ])
                .arg(self.dir.join("store")),
            &log,
        )
        .expect("starting nats-server");
        *slot = Some(child);
        drop(slot);
        wait_listening(self.port, 30, "nats-server", &log);
    }

    pub fn stop(&self) {
        stop_child(&mut self.child.lock().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url()).await.expect("nats client")
    }

    pub async fn js(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        stop_child(&mut self.child.lock().unwrap());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------- HTTP

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

impl TestCa {
    pub fn new() -> TestCa {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca).unwrap();
        let chain = vec![CertificateDer::from_pem_slice(cert.pem().as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
        TestCa {
            ca_pem: ca.pem(),
            server: Arc::new(server),
        }
    }
}

/// A small HTTP/1.1 server that records every request and answers with a settable status.
pub struct HttpSink {
    pub port: u16,
    tls: Option<Arc<rustls::ServerConfig>>,
    pub status: Arc<AtomicU16>,
    pub body: Arc<Mutex<String>>,
    pub received: Arc<Mutex<Vec<Received>>>,
    running: Mutex<Option<Arc<AtomicBool>>>,
}

impl HttpSink {
    pub fn start(tls: Option<&TestCa>) -> HttpSink {
        let s = HttpSink {
            port: deadletter::testenv::free_port().expect("port"),
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
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.method == "POST")
            .cloned()
            .collect()
    }

    pub fn restart(&self) {
        let mut slot = self.running.lock().unwrap();
        assert!(slot.is_none(), "sink already running");
        let listener = TcpListener::bind(("127.0.0.1", self.port)).expect("binding the sink");
        listener.set_nonblocking(true).expect("nonblocking");
        let alive = Arc::new(AtomicBool::new(true));
        *slot = Some(alive.clone());
        let (tls, status, body, received) = (
            self.tls.clone(),
            self.status.clone(),
            self.body.clone(),
            self.received.clone(),
        );
        std::thread::spawn(move || {
            while alive.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (tls, status, body, received, alive) = (
                            tls.clone(),
                            status.clone(),
                            body.clone(),
                            received.clone(),
                            alive.clone(),
                        );
                        std::thread::spawn(move || {
                            let _ = stream.set_nonblocking(false);
                            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                            match tls {
                                Some(cfg) => {
                                    let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                                        return;
                                    };
                                    let mut s = rustls::StreamOwned::new(conn, stream);
                                    serve(&mut s, &status, &body, &received, &alive);
                                }
                                None => {
                                    let mut s = stream;
                                    serve(&mut s, &status, &body, &received, &alive);
                                }
                            }
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(_) => break,
                }
            }
        });
    }

    /// Closes the port: new connections are refused until [`HttpSink::restart`].
    pub fn stop(&self) {
        if let Some(alive) = self.running.lock().unwrap().take() {
            alive.store(false, Ordering::SeqCst);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for HttpSink {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves keep-alive requests on one connection until it closes or the sink stops.
fn serve<S: Read + Write>(
    s: &mut S,
    status: &AtomicU16,
    body: &Mutex<String>,
    received: &Mutex<Vec<Received>>,
    alive: &AtomicBool,
) {
    let mut reader = BufReader::new(s);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_string();
        let path = parts.next().unwrap_or_default().to_string();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
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
        let mut data = vec![0u8; len];
        if reader.read_exact(&mut data).is_err() {
            return;
        }
        if !alive.load(Ordering::SeqCst) {
            return;
        }
        received.lock().unwrap().push(Received {
            method: method.clone(),
            path,
            headers,
            body: data,
        });
        let code = status.load(Ordering::SeqCst);
        let text = body.lock().unwrap().clone();
        let reply = if method == "HEAD" {
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

// ---------------------------------------------------------------- fixtures

/// A Secret with one key.
pub async fn create_secret(client: &Client, ns: &str, name: &str, key: &str, value: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name}, "stringData": {key: value}
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("creating secret {name}: {e}"));
}

/// A DeadLetterQueue `name` with `spec` as given.
pub async fn create_dlq(client: &Client, ns: &str, name: &str, spec: serde_json::Value) {
    let q: DeadLetterQueue = serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap();
    Api::<DeadLetterQueue>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &q)
        .await
        .unwrap_or_else(|e| panic!("creating DeadLetterQueue {name}: {e}"));
}

/// Creates `n` records, waits until each is Parked, decides them all at once, and returns the
/// seconds from the decisions until every record is Redriven.
pub async fn redrive_many(
    api: &Api<deadletter::api::DeadLetter>,
    n: usize,
    make: impl Fn(usize) -> deadletter::api::DeadLetter,
) -> f64 {
    use deadletter::api::{Action, Phase};
    use kube::api::ListParams;
    let creates = (0..n).map(|i| {
        let api = api.clone();
        let r = make(i);
        async move {
            api.create(&PostParams::default(), &r)
                .await
                .expect("creating record")
        }
    });
    let names: Vec<String> = futures::future::join_all(creates)
        .await
        .iter()
        .map(kube::ResourceExt::name_any)
        .collect();
    let all_in = |phase: Phase| {
        let api = api.clone();
        async move {
            let items = api.list(&ListParams::default()).await.ok()?.items;
            (items.len() >= n
                && items
                    .iter()
                    .all(|r| r.status.as_ref().and_then(|s| s.phase) == Some(phase)))
            .then_some(())
        }
    };
    super::eventually(120, "all records Parked", || all_in(Phase::Parked)).await;
    let started = Instant::now();
    futures::future::join_all(
        names
            .iter()
            .map(|name| super::decide(api, name, Action::Redrive, "ops")),
    )
    .await;
    super::eventually(300, "all records Redriven", || all_in(Phase::Redriven)).await;
    started.elapsed().as_secs_f64()
}

/// Waits until DeadLetterQueue `name` says Ready=`want`; returns its Ready message.
pub async fn wait_ready(client: &Client, ns: &str, name: &str, want: bool, secs: u64) -> String {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let status = if want { "True" } else { "False" };
    super::eventually(secs, &format!("queue {name} Ready={status}"), || async {
        let q = queues.get(name).await.ok()?;
        q.status?
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready" && c.status == status)
            .map(|c| format!("{}: {}", c.reason, c.message))
    })
    .await
}
