//! redis-server.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

/// How long a test's Redis command waits for its answer.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// A real redis-server on a free loopback port; stopped on drop (and by the kernel if the test
/// process dies).
pub struct Redis {
    pub port: u16,
    /// The address it listens on: loopback, or a test node's address that pods reach.
    pub host: IpAddr,
    child: Option<Child>,
    dir: PathBuf,
    /// Append-only file, fsync per write: what it acknowledged survives a SIGKILL.
    durable: bool,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(false)
    }

    /// One listening on `host` (a local address, e.g. a test node's, so that pods reach it).
    pub fn start_on(host: IpAddr) -> Redis {
        Self::start_at(host, false)
    }

    /// One whose acknowledged writes survive [`Redis::stop`] + [`Redis::restart`] (AOF with
    /// `appendfsync always`), for the chaos harness's broker restarts.
    pub fn start_durable() -> Redis {
        Self::start_with(true)
    }

    fn start_with(durable: bool) -> Redis {
        Self::start_at(IpAddr::V4(Ipv4Addr::LOCALHOST), durable)
    }

    fn start_at(host: IpAddr, durable: bool) -> Redis {
        let port = super::child::port();
        let dir = std::env::temp_dir().join(format!("dlq-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("creating the redis dir {}: {e}", dir.display()));
        let mut r = Redis {
            port,
            host,
            child: None,
            dir,
            durable,
        };
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!(
            "redis://{}/",
            std::net::SocketAddr::new(self.host, self.port)
        )
    }

    /// Starts (again) on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "redis already running");
        let bin = super::child::which("redis-server").unwrap_or_else(|| {
            panic!(
                "redis-server not found: run scripts/ensure-deps.sh (apt-get install redis-server)"
            )
        });
        // Redis refuses non-loopback clients without a password ("protected mode"); a test
        // node's address is local to this machine, its pods are the clients.
        let protected = if self.host.is_loopback() { "yes" } else { "no" };
        let aof: &[&str] = if self.durable {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        let child = crate::plane::spawn_guarded(
            Command::new(bin)
                .args([
                    "--port",
                    &self.port.to_string(),
                    "--bind",
                    &self.host.to_string(),
                ])
                .args(["--save", "", "--protected-mode", protected])
                .args(aof)
                .arg("--dir")
                .arg(&self.dir),
            &self.dir.join("redis.log"),
        )
        .unwrap_or_else(|e| panic!("starting redis-server: {e}"));
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect((self.host, self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not listen on {}", self.port);
    }

    /// Stops it hard, like a crashed broker.
    pub fn stop(&mut self) {
        super::child::stop_child(&mut self.child);
    }

    /// A connection that waits up to [`RESPONSE_TIMEOUT`] for an answer: redis' own default,
    /// 500 ms, timed out an LPUSH of a large body on a loaded 2-core machine (`make test`).
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        redis::Client::open(self.url())
            .expect("a valid redis URL")
            .get_multiplexed_async_connection_with_config(&config)
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
