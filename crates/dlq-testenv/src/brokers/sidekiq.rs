//! A real Sidekiq process (Debian's `ruby-sidekiq`, 6.4) running the test worker
//! `tests/fixtures/sidekiq/worker.rb` on a test's own redis-server, and Sidekiq's own client
//! (`tests/fixtures/sidekiq/enqueue.rb`) to enqueue jobs.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// One `sidekiq` process; killed on drop (and by the kernel if the test process dies).
pub struct Sidekiq {
    child: Option<Child>,
    dir: PathBuf,
    /// Its process id, which the worker writes beside each job it performs.
    pub pid: u32,
}

fn fixture(name: &str) -> PathBuf {
    crate::paths::workspace_root()
        .join("tests/fixtures/sidekiq")
        .join(name)
}

fn missing(what: &str) -> String {
    format!("{what} not found: run scripts/ensure-deps.sh (apt-get install ruby ruby-sidekiq)")
}

impl Sidekiq {
    /// Starts `sidekiq` with `concurrency` threads on the Redis at `redis_url`, and waits until
    /// it has announced itself in Redis (its `processes` heartbeat).
    pub async fn start(redis_url: &str, concurrency: usize) -> Sidekiq {
        Self::start_with(redis_url, concurrency, None).await
    }

    /// As [`Sidekiq::start`], with Sidekiq's `dead_max_jobs` (where it trims the dead set,
    /// dropping the oldest jobs) set to `dead_max_jobs` instead of its default 10,000.
    pub async fn start_trimming_at(
        redis_url: &str,
        concurrency: usize,
        dead_max_jobs: usize,
    ) -> Sidekiq {
        Self::start_with(redis_url, concurrency, Some(dead_max_jobs)).await
    }

    async fn start_with(
        redis_url: &str,
        concurrency: usize,
        dead_max_jobs: Option<usize>,
    ) -> Sidekiq {
        let bin =
            super::child::which("sidekiq").unwrap_or_else(|| panic!("{}", missing("sidekiq")));
        static STARTED: AtomicU16 = AtomicU16::new(0);
        let dir = super::child::temp_dir("sidekiq", STARTED.fetch_add(1, Ordering::Relaxed));
        let log = dir.join("sidekiq.log");
        let mut cmd = Command::new(bin);
        cmd.arg("-r")
            .arg(fixture("worker.rb"))
            .args(["-c", &concurrency.to_string(), "-q", "default"])
            .env("REDIS_URL", redis_url)
            .current_dir(&dir);
        if let Some(n) = dead_max_jobs {
            cmd.env("SIDEKIQ_DEAD_MAX_JOBS", n.to_string());
        }
        let child = crate::plane::spawn_guarded(&mut cmd, &log)
            .unwrap_or_else(|e| panic!("starting sidekiq: {e}"));
        let pid = child.id();
        let s = Sidekiq {
            child: Some(child),
            dir,
            pid,
        };
        s.wait_booted(redis_url).await;
        s
    }

    async fn wait_booted(&self, redis_url: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = redis::Client::open(redis_url).expect("a valid redis URL");
        while Instant::now() < deadline {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                let n: redis::RedisResult<usize> = redis::cmd("SCARD")
                    .arg("processes")
                    .query_async(&mut c)
                    .await;
                if n.is_ok_and(|n| n > 0) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("sidekiq did not boot within 60 s; log:\n{}", self.log());
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sidekiq.log")).unwrap_or_default()
    }

    /// Enqueues SettleJob for payments `<prefix>-0` .. `<prefix>-(count-1)` with Sidekiq's own
    /// client (one `push_bulk`); their jids.
    pub fn enqueue(redis_url: &str, count: usize, prefix: &str) -> Vec<String> {
        let ruby = super::child::which("ruby").unwrap_or_else(|| panic!("{}", missing("ruby")));
        let out = Command::new(ruby)
            .arg(fixture("enqueue.rb"))
            .args([&count.to_string(), prefix])
            .env("REDIS_URL", redis_url)
            .output()
            .unwrap_or_else(|e| panic!("running enqueue.rb: {e}"));
        assert!(
            out.status.success(),
            "enqueue.rb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Sidekiq {
    fn drop(&mut self) {
        super::child::stop_child(&mut self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
