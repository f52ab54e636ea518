//! RabbitMQ (Debian's rabbitmq-server, no plugins) with its own epmd.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

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

/// A lock that a panicking test cannot poison for the next one.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn epmd_binary() -> PathBuf {
    super::child::which("epmd")
        .or_else(|| {
            std::fs::read_dir("/usr/lib/erlang")
                .ok()?
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin/epmd"))
                .find(|p| p.is_file())
        })
        .expect("epmd (erlang-base) not found: run scripts/ensure-deps.sh")
}

impl Rabbit {
    /// A node for one test (it can be stopped and restarted).
    pub fn start() -> Rabbit {
        Self::start_with(false)
    }

    fn start_with(shared: bool) -> Rabbit {
        assert!(
            std::path::Path::new(RABBITMQ_SERVER).is_file(),
            "rabbitmq-server not installed: run scripts/ensure-deps.sh (apt-get install rabbitmq-server)"
        );
        let port = super::child::port();
        let dir = super::child::temp_dir("rabbit", port);
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("writing enabled_plugins");
        let r = Rabbit {
            port,
            dist_port: super::child::port(),
            epmd_port: super::child::port(),
            node: format!("dlqtest{}x{port}@localhost", std::process::id()),
            dir,
            epmd: Mutex::new(None),
            beam: Mutex::new(None),
            shared,
        };
        r.start_epmd();
        r.restart();
        r
    }

    fn spawn(&self, mut cmd: Command, log: PathBuf, what: &str) -> Child {
        if self.shared {
            super::child::spawn_detached_from_test(cmd, log)
        } else {
            crate::plane::spawn_guarded(&mut cmd, &log)
                .unwrap_or_else(|e| panic!("starting {what}: {e}"))
        }
    }

    fn start_epmd(&self) {
        let mut cmd = Command::new(epmd_binary());
        cmd.args([
            "-port",
            &self.epmd_port.to_string(),
            "-address",
            "127.0.0.1",
        ]);
        let log = self.dir.join("epmd.log");
        *lock(&self.epmd) = Some(self.spawn(cmd, log.clone(), "epmd"));
        super::child::wait_listening(self.epmd_port, 10, "epmd", &log);
    }

    /// The node's console output and its own logs (kept by harnesses that investigate a run).
    pub fn logs(&self) -> Vec<PathBuf> {
        let own = std::fs::read_dir(self.dir.join("log"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path());
        std::iter::once(self.dir.join("rabbitmq.log"))
            .chain(own)
            .collect()
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The rabbitmq-server command for this node, all its state in its own dir.
    fn server_command(&self) -> Command {
        let d = |p: &str| self.dir.join(p);
        let mut cmd = Command::new(RABBITMQ_SERVER);
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
        cmd
    }

    /// Starts the node (again, with the same name and data).
    pub fn restart(&self) {
        let log = self.dir.join("rabbitmq.log");
        let mut slot = lock(&self.beam);
        assert!(slot.is_none(), "rabbitmq already running");
        *slot = Some(self.spawn(self.server_command(), log.clone(), "rabbitmq-server"));
        drop(slot);
        super::child::wait_listening(self.port, 90, "rabbitmq-server", &log);
        self.wait_accepting_logins();
    }

    /// The port opens a moment before the broker accepts logins; on a loaded 2-core machine
    /// (the other test lane busy) its boot steps took more than 30 s once, so this waits as
    /// long as for the port, and says why when it gives up.
    fn wait_accepting_logins(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        let url = self.url();
        let mut last_error = String::new();
        while Instant::now() < deadline {
            let attempt = std::thread::scope(|s| {
                s.spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime for the login probe")
                        .block_on(async {
                            lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        })
                })
                .join()
                .unwrap_or_else(|_| Err("the login probe panicked".into()))
            });
            match attempt {
                Ok(()) => return,
                Err(e) => last_error = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "rabbitmq-server did not accept AMQP connections within 90s (last error: {last_error}); log:\n{}",
            std::fs::read_to_string(self.dir.join("rabbitmq.log")).unwrap_or_default()
        );
    }

    /// Stops the node cleanly and starts it again, so that everything declared so far survives
    /// a later hard kill. RabbitMQ 3.10's Ra keeps the names of its quorum queues in a DETS
    /// table that is saved every 3 minutes or at a clean stop: a node killed hard within 3
    /// minutes of declaring a quorum queue comes back without it (its messages stay on disk,
    /// unreachable, and every `basic.get` on it times out). Harnesses that kill the node call
    /// this once after declaring their queues.
    pub fn checkpoint(&self) {
        if let Some(mut beam) = lock(&self.beam).take() {
            crate::plane::terminate(&mut beam, Duration::from_secs(30));
        }
        super::child::wait_closed(self.port, 10);
        self.restart();
    }

    /// Kills the node hard, like a crashed broker.
    pub fn stop(&self) {
        super::child::stop_child(&mut lock(&self.beam));
        super::child::wait_closed(self.port, 10);
    }

    pub async fn conn(&self) -> lapin::Connection {
        lapin::Connection::connect(&self.url(), lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connecting to RabbitMQ at port {}: {e}", self.port))
    }

    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn = self.conn().await;
        let ch = conn
            .create_channel()
            .await
            .unwrap_or_else(|e| panic!("opening an AMQP channel: {e}"));
        (conn, ch)
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        super::child::stop_child(&mut lock(&self.beam));
        super::child::stop_child(&mut lock(&self.epmd));
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

/// Declares a durable exchange.
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

/// Arguments that declare a quorum queue (what docs/backends.md advises for dead-letter queues).
pub fn quorum_args() -> lapin::types::FieldTable {
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    args
}

/// A failing worker: takes the next message off `queue` (waiting up to 10 s for one) and
/// rejects it without requeue, so RabbitMQ dead-letters it.
pub async fn worker_rejects(ch: &lapin::Channel, queue: &str) {
    let m = crate::harness::eventually(10, "the worker to get a message", || async {
        ch.basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: false },
        )
        .await
        .ok()
        .flatten()
    })
    .await;
    m.delivery
        .acker
        .reject(lapin::options::BasicRejectOptions { requeue: false })
        .await
        .unwrap_or_else(|e| panic!("rejecting a message from {queue}: {e}"));
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
        .unwrap_or_else(|e| panic!("basic.get from {queue}: {e}"))
    {
        out.push(m);
    }
    out
}
