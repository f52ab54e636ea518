//! ElasticMQ, an SQS-compatible server (Java), for the SQS tests. Its classpath is resolved by
//! `tools/build.sh elasticmq` (Maven, cached outside the repo); it runs on a free loopback port
//! with queues in memory, so a restart starts empty.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The account id ElasticMQ puts in queue URLs and ARNs.
pub const ACCOUNT: &str = "000000000000";
/// The region ElasticMQ puts in ARNs (and the tests sign with).
pub const REGION: &str = "us-east-1";

/// An ElasticMQ server on a free loopback port; restartable on the same port.
pub struct ElasticMq {
    pub port: u16,
    dir: PathBuf,
    classpath: String,
    child: Mutex<Option<Child>>,
    shared: bool,
}

/// ElasticMQ shared by every test of one binary (the JVM takes seconds to start); tests isolate
/// themselves by queue names, and never stop it.
pub fn shared_elasticmq() -> &'static ElasticMq {
    static MQ: OnceLock<ElasticMq> = OnceLock::new();
    MQ.get_or_init(|| ElasticMq::start_with(true))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ElasticMq {
    /// A server for one test (it can be stopped and restarted).
    pub fn start() -> ElasticMq {
        Self::start_with(false)
    }

    fn start_with(shared: bool) -> ElasticMq {
        let dirs = crate::plane::tool_dirs(&["elasticmq"])
            .unwrap_or_else(|e| panic!("resolving ElasticMQ: {e}"));
        // With DLQ_TOOLS_BIN set, tool_dirs returns those dirs: one of them must hold lib/.
        let lib = dirs
            .iter()
            .map(|d| d.join("lib"))
            .find(|l| l.is_dir())
            .unwrap_or_else(|| {
                panic!(
                    "no ElasticMQ lib/ in {dirs:?}: run `tools/build.sh elasticmq` (and add the \
                     directory it prints to DLQ_TOOLS_BIN when that is set)"
                )
            });
        let port = super::child::port();
        let dir = super::child::temp_dir("elasticmq", port);
        let conf = format!(
            r#"include classpath("application.conf")
pekko.loglevel = "WARNING"
node-address {{ protocol = "http", host = "127.0.0.1", port = {port}, context-path = "" }}
rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = "127.0.0.1", sqs-limits = strict }}
rest-stats {{ enabled = false }}
generate-node-address = false
aws {{ region = "{REGION}", accountId = "{ACCOUNT}" }}
"#
        );
        std::fs::write(dir.join("elasticmq.conf"), conf)
            .unwrap_or_else(|e| panic!("writing the ElasticMQ config: {e}"));
        let e = ElasticMq {
            port,
            classpath: format!("{}/*", lib.display()),
            dir,
            child: Mutex::new(None),
            shared,
        };
        e.restart();
        e
    }

    /// `http://127.0.0.1:<port>`: the endpoint override for the SDK.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The URL of queue `name`.
    pub fn queue_url(&self, name: &str) -> String {
        format!("{}/{ACCOUNT}/{name}", self.endpoint())
    }

    /// The ARN of queue `name`.
    pub fn queue_arn(&self, name: &str) -> String {
        format!("arn:aws:sqs:{REGION}:{ACCOUNT}:{name}")
    }

    /// Starts (again) on the same port, with no queues.
    pub fn restart(&self) {
        let mut slot = lock(&self.child);
        assert!(slot.is_none(), "ElasticMQ already running");
        let java = super::child::which("java").unwrap_or_else(|| {
            panic!("java not found: run scripts/ensure-deps.sh (apt-get install openjdk-17-jre-headless)")
        });
        let log = self.dir.join("elasticmq.log");
        let mut cmd = Command::new(java);
        cmd.arg(format!(
            "-Dconfig.file={}",
            self.dir.join("elasticmq.conf").display()
        ))
        .args(["-Xss1m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
        .arg("-cp")
        .arg(&self.classpath)
        .arg("org.elasticmq.server.Main");
        let child = if self.shared {
            super::child::spawn_detached_from_test(cmd, log.clone())
        } else {
            crate::plane::spawn_guarded(&mut cmd, &log)
                .unwrap_or_else(|e| panic!("starting ElasticMQ: {e}"))
        };
        *slot = Some(child);
        drop(slot);
        super::child::wait_listening(self.port, 60, "ElasticMQ", &log);
    }

    /// Kills it hard, like a crashed server.
    pub fn stop(&self) {
        assert!(!self.shared, "the shared ElasticMQ is never stopped");
        super::child::stop_child(&mut lock(&self.child));
        super::child::wait_closed(self.port, 10);
    }
}

impl Drop for ElasticMq {
    fn drop(&mut self) {
        super::child::stop_child(&mut lock(&self.child));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
