//! Apache Kafka in KRaft mode (one node that is both broker and controller), for the Kafka
//! tests. Its classpath is resolved by `tools/build.sh kafka` (Maven, cached outside the repo);
//! it runs on free loopback ports with its log dir in a temp dir, formatted once, so a restart
//! keeps every topic and committed offset, like a real broker coming back.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The cluster id the storage is formatted with (any base64 UUID).
const CLUSTER_ID: &str = "ZGxxLWthZmthLXRlc3QwMA";

/// A Kafka node on free loopback ports; restartable on the same ports and data.
pub struct Kafka {
    pub port: u16,
    controller_port: u16,
    dir: PathBuf,
    classpath: String,
    child: Mutex<Option<Child>>,
    shared: bool,
}

/// Kafka shared by every test of one binary (the JVM takes seconds to start); tests isolate
/// themselves by topic and group names, and never stop it.
pub fn shared_kafka() -> &'static Kafka {
    static KAFKA: OnceLock<Kafka> = OnceLock::new();
    KAFKA.get_or_init(|| Kafka::start_with(true, None))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn classpath() -> String {
    let dirs =
        crate::plane::tool_dirs(&["kafka"]).unwrap_or_else(|e| panic!("resolving Kafka: {e}"));
    let lib = dirs
        .iter()
        .map(|d| d.join("lib"))
        .find(|l| has_kafka(l))
        .unwrap_or_else(|| {
            panic!(
                "no Kafka lib/ in {dirs:?}: run `tools/build.sh kafka` (and add the directory it \
                 prints to DLQ_TOOLS_BIN when that is set)"
            )
        });
    format!("{}/*", lib.display())
}

fn has_kafka(lib: &std::path::Path) -> bool {
    std::fs::read_dir(lib).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with("kafka_2.13-"))
    })
}

impl Kafka {
    /// A node for one test (it can be stopped and restarted).
    pub fn start() -> Kafka {
        Self::start_with(false, None)
    }

    /// A node for one test whose broker takes messages up to `bytes` (`message.max.bytes`,
    /// about 1 MB by default; a topic's `max.message.bytes` follows it unless set).
    pub fn start_with_max_message(bytes: usize) -> Kafka {
        Self::start_with(false, Some(bytes))
    }

    fn start_with(shared: bool, max_message: Option<usize>) -> Kafka {
        let (port, controller_port) = (super::child::port(), super::child::port());
        let dir = super::child::temp_dir("kafka", port);
        let conf = format!(
            "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.voters=1@127.0.0.1:{controller_port}\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
             controller.listener.names=CONTROLLER\n\
             inter.broker.listener.name=PLAINTEXT\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
             log.dirs={}\n\
             num.partitions=1\n\
             auto.create.topics.enable=true\n\
             offsets.topic.replication.factor=1\n\
             offsets.topic.num.partitions=1\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             share.coordinator.state.topic.replication.factor=1\n\
             share.coordinator.state.topic.min.isr=1\n\
             group.initial.rebalance.delay.ms=0\n",
            dir.join("data").display()
        );
        let conf = match max_message {
            Some(bytes) => format!(
                "{conf}message.max.bytes={bytes}\nreplica.fetch.max.bytes={bytes}\n\
                 socket.request.max.bytes={}\n",
                bytes.max(100 << 20) + (1 << 20)
            ),
            None => conf,
        };
        std::fs::write(dir.join("server.properties"), conf)
            .unwrap_or_else(|e| panic!("writing the Kafka config: {e}"));
        let k = Kafka {
            port,
            controller_port,
            classpath: classpath(),
            dir,
            child: Mutex::new(None),
            shared,
        };
        k.format();
        k.restart();
        k
    }

    fn java(&self) -> Command {
        let java = super::child::which("java").unwrap_or_else(|| {
            panic!("java not found: run scripts/ensure-deps.sh (apt-get install openjdk-17-jre-headless)")
        });
        let mut cmd = Command::new(java);
        cmd.args([
            "-Xmx512m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Xshare:auto",
        ])
        .arg("-cp")
        .arg(&self.classpath);
        cmd
    }

    /// Formats the log dir for KRaft (once; a restart keeps the data). A format that did not
    /// finish (the JVM killed from outside, as seen once in CI with the exit status unknown)
    /// is retried once on an empty data dir, saying so.
    fn format(&self) {
        let first = self.format_once();
        let Err(why) = first else { return };
        eprintln!("formatting Kafka storage failed ({why}); retrying once on an empty data dir");
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
        if let Err(again) = self.format_once() {
            panic!("formatting Kafka storage failed twice; first: {why}; then: {again}");
        }
    }

    /// One run of `kafka-storage format`; Err carries the exit status and the tool's output.
    fn format_once(&self) -> Result<(), String> {
        let log = self.dir.join("format.log");
        let mut cmd = self.java();
        cmd.args(["kafka.tools.StorageTool", "format", "-t", CLUSTER_ID, "-c"])
            .arg(self.dir.join("server.properties"));
        let mut child = crate::plane::spawn_guarded(&mut cmd, &log)
            .unwrap_or_else(|e| panic!("formatting Kafka storage: {e}"));
        let status = child
            .wait()
            .unwrap_or_else(|e| panic!("waiting for the Kafka storage format: {e}"));
        if status.success() {
            return Ok(());
        }
        Err(format!(
            "{status}; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        ))
    }

    /// `127.0.0.1:<port>`: the bootstrap servers.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same ports and data.
    pub fn restart(&self) {
        let mut slot = lock(&self.child);
        assert!(slot.is_none(), "Kafka already running");
        let log = self.dir.join("kafka.log");
        let mut cmd = self.java();
        cmd.arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"));
        let child = if self.shared {
            super::child::spawn_detached_from_test(cmd, log.clone())
        } else {
            crate::plane::spawn_guarded(&mut cmd, &log)
                .unwrap_or_else(|e| panic!("starting Kafka: {e}"))
        };
        *slot = Some(child);
        drop(slot);
        super::child::wait_listening(self.port, 90, "Kafka", &log);
        super::child::wait_listening(self.controller_port, 10, "Kafka controller", &log);
    }

    /// Kills it hard, like a crashed broker.
    pub fn stop(&self) {
        assert!(!self.shared, "the shared Kafka is never stopped");
        super::child::stop_child(&mut lock(&self.child));
        super::child::wait_closed(self.port, 10);
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        super::child::stop_child(&mut lock(&self.child));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
