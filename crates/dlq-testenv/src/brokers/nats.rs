//! nats-server with JetStream.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};

/// A nats-server with JetStream on a free loopback port; restartable with the same store.
pub struct Nats {
    pub port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

/// A lock that a panicking test cannot poison for the next one.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Nats {
    pub fn start() -> Nats {
        let port = super::child::port();
        let n = Nats {
            port,
            dir: super::child::temp_dir("nats", port),
            child: Mutex::new(None),
        };
        n.restart();
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port with the same store.
    pub fn restart(&self) {
        let mut slot = lock(&self.child);
        assert!(slot.is_none(), "nats-server already running");
        let bin = super::child::which("nats-server").unwrap_or_else(|| {
            panic!(
                "nats-server not found: run scripts/ensure-deps.sh (apt-get install nats-server)"
            )
        });
        let log = self.dir.join("nats.log");
        let child = crate::plane::spawn_guarded(
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
        .unwrap_or_else(|e| panic!("starting nats-server: {e}"));
        *slot = Some(child);
        drop(slot);
        super::child::wait_listening(self.port, 30, "nats-server", &log);
    }

    /// Kills it hard, like a crashed server.
    pub fn stop(&self) {
        super::child::stop_child(&mut lock(&self.child));
        super::child::wait_closed(self.port, 10);
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url())
            .await
            .unwrap_or_else(|e| panic!("connecting to nats at {}: {e}", self.url()))
    }

    pub async fn js(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        super::child::stop_child(&mut lock(&self.child));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
