//! `make chaos`: the whole system under faults at once, checked against its invariants.
//!
//! One run owns its control plane (so it can restart kube-apiserver and etcd), a durable
//! redis-server behind toxiproxy (a link it can cut or black-hole), a RabbitMQ node, and two operator replicas
//! with leader election. Producers dead-letter jobs into both brokers while humans decide
//! (kubectl dlq, GitOps server-side apply, the `--queue --rate` replay) and seeded faults hit
//! every component. Then it waits for the system to settle and checks, from the brokers'
//! contents and a watch history: nothing lost, one record per dead message, one resolution per
//! decision, every redriven job on its target, no phase going backwards, no panics.
//!
//! Beside them, a storm (issue 47): a dead list many times its queue's `maxParked`, one
//! standing redrive made while the queue is Full, its messages passing straight to the target
//! through the same faults; nothing lost, repeats only with the same idempotency key.

mod config;
mod faults;
mod history;
mod proxy;
mod report;
mod setup;
mod shared;
mod storm;
mod workload;

use std::time::Instant;

pub use self::config::{ChaosConfig, schedule};
pub use self::faults::KINDS;
pub use self::history::History;
pub use self::proxy::{Cut, Toxiproxy};
pub use self::report::Report;
pub use self::shared::{Rng, Spawner};
pub use self::storm::StormOutcome;

/// Runs one chaos run and returns its report (also written to `out/report.json`).
pub async fn run(cfg: ChaosConfig) -> Report {
    let started = Instant::now();
    crate::harness::report(&format!(
        "chaos: seed {} ({} faults, {} messages); repeat with CHAOS_SEED={}",
        cfg.seed, cfg.faults, cfg.messages, cfg.seed
    ));
    let env = setup::Env::start(&cfg).await;
    let report = env.run(&cfg, started).await;
    report.write(&cfg.out);
    report
}
