//! What the parts of a chaos run share: the seeded generator, the target stream, the one thread that
//! spawns every child, and a lock that outlives a panicked holder. It names no other part of the run.

use std::sync::{Mutex, MutexGuard};

pub const REDIS_JOBS: &str = "relayer:jobs";

/// A small seeded generator (splitmix64): the same seed gives the same faults in the same
/// order at the same offsets.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

type Job = Box<dyn FnOnce() + Send>;

/// One long-lived thread that starts every child process of a run. Children die with the
/// thread that spawned them (`PR_SET_PDEATHSIG`), so they must not be spawned from tokio's
/// blocking pool, whose idle threads exit after a few seconds.
pub struct Spawner {
    tx: std::sync::mpsc::Sender<Job>,
}

impl Spawner {
    pub fn new() -> Spawner {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::spawn(move || {
            for job in rx {
                job();
            }
        });
        Spawner { tx }
    }

    /// Runs `f` on the spawner thread; Err with the panic message when it panicked.
    pub async fn run<T, F>(&self, f: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            });
            let _ = done.send(r);
        });
        self.tx
            .send(job)
            .map_err(|_| "the spawner thread is gone".to_string())?;
        result
            .await
            .unwrap_or_else(|_| Err("the spawner thread dropped a job".into()))
    }
}

impl Default for Spawner {
    fn default() -> Self {
        Self::new()
    }
}
