//! `make chaos`: the whole system under faults at once, checked against its invariants.
//!
//! One run owns its control plane (so it can restart kube-apiserver and etcd), a durable
//! redis-server behind toxiproxy (a link it can cut or black-hole), a RabbitMQ node, and two operator replicas
//! with leader election. Producers dead-letter jobs into both brokers while humans decide
//! (kubectl dlq, GitOps server-side apply, the `--queue --rate` replay) and seeded faults hit
//! every component. Then it waits for the system to settle and checks, from the brokers'
//! contents and a watch history: nothing lost, one record per dead message, one resolution per
//! decision, every redriven job on its target, no phase going backwards, no panics.

mod faults;
mod history;
mod proxy;
mod report;
mod setup;
mod workload;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use self::faults::KINDS;
pub use self::history::History;
pub use self::proxy::{Cut, Toxiproxy};
pub use self::report::Report;

/// The size and seed of a run.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    pub faults: usize,
    pub messages: usize,
    pub seed: u64,
    /// Pause between two faults, at most (a random part of it).
    pub max_gap: Duration,
    /// How long the system gets to settle after the last fault.
    pub settle: Duration,
    /// Where report.json and the operators' logs go.
    pub out: PathBuf,
    /// The fault kinds to inject (`CHAOS_KINDS`, comma-separated; all by default).
    pub kinds: Vec<&'static str>,
}

impl ChaosConfig {
    /// `CHAOS_FAULTS`, `CHAOS_MESSAGES`, `CHAOS_SEED` (a fresh one when unset), `CHAOS_OUT`,
    /// over the given defaults.
    pub fn from_env(faults: usize, messages: usize) -> ChaosConfig {
        let num = |k: &str, d: u64| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let fresh = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let out = std::env::var_os("CHAOS_OUT")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::workspace_root().join("target/chaos"));
        ChaosConfig {
            faults: num("CHAOS_FAULTS", faults as u64) as usize,
            messages: num("CHAOS_MESSAGES", messages as u64) as usize,
            seed: num("CHAOS_SEED", fresh % 1_000_000_000),
            max_gap: Duration::from_secs(4),
            settle: Duration::from_secs(60),
            out,
            kinds: kinds_from_env(),
        }
    }
}

fn kinds_from_env() -> Vec<&'static str> {
    let wanted = std::env::var("CHAOS_KINDS").unwrap_or_default();
    let picked: Vec<&'static str> = KINDS
        .into_iter()
        .filter(|k| wanted.split(',').any(|w| w.trim() == *k))
        .collect();
    if picked.is_empty() {
        KINDS.to_vec()
    } else {
        picked
    }
}

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

/// The fault schedule: every kind once (shuffled), then weighted picks.
pub fn schedule(n: usize, kinds: &[&'static str], rng: &mut Rng) -> Vec<&'static str> {
    let mut first: Vec<&'static str> = kinds.to_vec();
    for i in (1..first.len()).rev() {
        first.swap(i, rng.below(i as u64 + 1) as usize);
    }
    // Weights: cheap faults more often than the slow ones (pause ≈ 30 s, RabbitMQ ≈ 10 s).
    let weighted: Vec<(&'static str, u64)> = [
        ("operator_sigkill", 5),
        ("leader_pause", 1),
        ("apiserver_restart", 3),
        ("redis_restart", 3),
        ("broker_cut", 2),
        ("broker_partition", 2),
        ("etcd_restart", 2),
        ("rabbitmq_restart", 1),
    ]
    .into_iter()
    .filter(|(k, _)| kinds.contains(k))
    .collect();
    let total: u64 = weighted.iter().map(|w| w.1).sum();
    let mut out: Vec<&'static str> = first.into_iter().take(n).collect();
    while out.len() < n {
        let mut r = rng.below(total);
        for &(k, w) in &weighted {
            if r < w {
                out.push(k);
                break;
            }
            r -= w;
        }
    }
    out
}

/// Runs one chaos run and returns its report (also written to `out/report.json`).
pub async fn run(cfg: ChaosConfig) -> Report {
    let started = Instant::now();
    crate::report(&format!(
        "chaos: seed {} ({} faults, {} messages); repeat with CHAOS_SEED={}",
        cfg.seed, cfg.faults, cfg.messages, cfg.seed
    ));
    let env = setup::Env::start(&cfg).await;
    let report = env.run(&cfg, started).await;
    report.write(&cfg.out);
    report
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
