//! redis-server.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

/// A real redis-server on a free loopback port; stopped on drop (and by the kernel if the test
/// process dies).
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    /// Append-only file, fsync per write: what it acknowledged survives a SIGKILL.
    durable: bool,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(false)
    }

    /// One whose acknowledged writes survive [`Redis::stop`] + [`Redis::restart`] (AOF with
    /// `appendfsync always`), for the chaos harness's broker restarts.
    pub fn start_durable() -> Redis {
        Self::start_with(true)
    }

    fn start_with(durable: bool) -> Redis {
        let port = super::port();
        let dir = std::env::temp_dir().join(format!("dlq-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("creating the redis dir {}: {e}", dir.display()));
        let mut r = Redis {
            port,
            child: None,
            dir,
            durable,
        };
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts (again) on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "redis already running");
        let bin = super::which("redis-server").unwrap_or_else(|| {
            panic!(
                "redis-server not found: run scripts/ensure-deps.sh (apt-get install redis-server)"
            )
        });
        let aof: &[&str] = if self.durable {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        let child = crate::plane::spawn_guarded(
            Command::new(bin)
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", ""])
                .args(aof)
                .arg("--dir")
                .arg(&self.dir),
            &self.dir.join("redis.log"),
        )
        .unwrap_or_else(|e| panic!("starting redis-server: {e}"));
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not listen on {}", self.port);
    }

    /// Stops it hard, like a crashed broker.
    pub fn stop(&mut self) {
        super::stop_child(&mut self.child);
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("a valid redis URL")
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("connecting to redis at {}: {e}", self.url()))
    }

    /// Every element of list `key`, head first.
    pub async fn list(&self, key: &str) -> Vec<Vec<u8>> {
        let mut c = self.conn().await;
        redis::cmd("LRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("LRANGE {key}: {e}"))
    }

    /// HLEN of `key`.
    pub async fn hash_len(&self, key: &str) -> usize {
        let mut c = self.conn().await;
        redis::cmd("HLEN")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("HLEN {key}: {e}"))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
