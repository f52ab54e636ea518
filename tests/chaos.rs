//! The short chaos run of `make test` (`make chaos` is the long one): ≈ 15 faults of every
//! kind during a few hundred dead messages, and every invariant must hold.

use dlq_testenv::chaos::{ChaosConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_chaos_run_keeps_every_invariant() {
    let mut cfg = ChaosConfig::from_env(15, 300);
    cfg.max_gap = std::time::Duration::from_secs(2);
    cfg.out = dlq_testenv::workspace_root().join("target/chaos-short");
    let report = run(cfg).await;
    dlq_testenv::report(&report.table());
    assert!(report.passed(), "an invariant failed:\n{}", report.table());
    assert!(report.faults_total >= 15, "{}", report.table());
}
