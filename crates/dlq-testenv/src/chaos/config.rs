//! A run's size, seed and fault kinds (from the environment), and its fault schedule.

use std::path::PathBuf;
use std::time::Duration;

use super::faults::KINDS;
use super::shared::Rng;

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
    /// Dead messages of the storm a standing redrive drains during the faults (`CHAOS_STORM`;
    /// 0: no storm).
    pub storm: usize,
}

impl ChaosConfig {
    /// `CHAOS_FAULTS`, `CHAOS_MESSAGES`, `CHAOS_SEED` (a fresh one when unset), `CHAOS_OUT`,
    /// `CHAOS_STORM` (the default message count unless set), over the given defaults.
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
            .unwrap_or_else(|| crate::paths::workspace_root().join("target/chaos"));
        ChaosConfig {
            faults: num("CHAOS_FAULTS", faults as u64) as usize,
            messages: num("CHAOS_MESSAGES", messages as u64) as usize,
            seed: num("CHAOS_SEED", fresh % 1_000_000_000),
            max_gap: Duration::from_secs(4),
            settle: Duration::from_secs(60),
            out,
            kinds: kinds_from_env(),
            storm: num("CHAOS_STORM", messages as u64) as usize,
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
