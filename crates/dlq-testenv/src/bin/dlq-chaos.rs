//! `make chaos`: one chaos run (CHAOS_FAULTS, CHAOS_MESSAGES, CHAOS_SEED); prints the table,
//! writes target/chaos/report.json, and exits 1 when an invariant failed.

use dlq_testenv::chaos::{ChaosConfig, run};

#[tokio::main]
async fn main() {
    let cfg = ChaosConfig::from_env(100, 5000);
    let out = cfg.out.clone();
    let report = run(cfg).await;
    println!("{}", report.table());
    println!("report: {}", out.join("report.json").display());
    if !report.passed() {
        eprintln!("chaos: an invariant failed (see the table)");
        std::process::exit(1);
    }
}
