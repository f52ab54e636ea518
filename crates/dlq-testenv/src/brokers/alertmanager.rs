//! A real Alertmanager (Debian's `prometheus-alertmanager`), clustering off, routing every
//! alert to a webhook receiver inside the test, grouped by namespace and queue, with 1 s
//! group_wait/group_interval so notifications arrive quickly.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use super::http::HttpSink;

const BIN: &str = "/usr/bin/prometheus-alertmanager";

/// A running Alertmanager and its webhook receiver; stopped on drop.
pub struct Alertmanager {
    pub port: u16,
    /// Receives every notification (`POST /hook`).
    pub webhook: HttpSink,
    child: Option<Child>,
    dir: PathBuf,
}

impl Alertmanager {
    pub fn start() -> Alertmanager {
        let webhook = HttpSink::start(None);
        let port = super::child::port();
        let dir = super::child::temp_dir("alertmanager", port);
        let config = format!(
            r#"route:
  receiver: hook
  group_by: [namespace, queue]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {}
        send_resolved: true
"#,
            webhook.url("/hook")
        );
        std::fs::write(dir.join("alertmanager.yml"), config).expect("writing alertmanager.yml");
        let mut am = Alertmanager {
            port,
            webhook,
            child: None,
            dir,
        };
        am.restart();
        am
    }

    /// The base URL the operator is given.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port, with no memory of earlier alerts.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "alertmanager already running");
        assert!(
            std::path::Path::new(BIN).is_file(),
            "{BIN} not found: run scripts/ensure-deps.sh (apt-get install prometheus-alertmanager)"
        );
        let data = self.dir.join("data");
        let _ = std::fs::remove_dir_all(&data);
        let log = self.dir.join("alertmanager.log");
        let child = crate::plane::spawn_guarded(
            Command::new(BIN)
                .arg(format!(
                    "--config.file={}",
                    self.dir.join("alertmanager.yml").display()
                ))
                .arg(format!("--storage.path={}", data.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
                .arg("--cluster.listen-address="),
            &log,
        )
        .unwrap_or_else(|e| panic!("starting alertmanager: {e}"));
        self.child = Some(child);
        super::child::wait_listening(self.port, 30, "alertmanager", &log);
    }

    /// Stops it hard: every alert it held is forgotten.
    pub fn stop(&mut self) {
        super::child::stop_child(&mut self.child);
        super::child::wait_closed(self.port, 5);
    }

    /// Every webhook notification received so far, parsed.
    pub fn notifications(&self) -> Vec<serde_json::Value> {
        self.webhook
            .posts()
            .iter()
            .filter_map(|p| serde_json::from_slice(&p.body).ok())
            .collect()
    }

    /// The alerts Alertmanager currently holds as active (`GET /api/v2/alerts`).
    pub fn active_alerts(&self) -> Vec<serde_json::Value> {
        let get = || -> Option<Vec<serde_json::Value>> {
            let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            write!(
                s,
                "GET /api/v2/alerts?active=true&silenced=false&inhibited=false HTTP/1.0\r\nHost: localhost\r\n\r\n"
            )
            .ok()?;
            let mut out = String::new();
            s.read_to_string(&mut out).ok()?;
            let (_, body) = out.split_once("\r\n\r\n")?;
            serde_json::from_str(body).ok()
        };
        get().unwrap_or_default()
    }
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        self.stop();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
