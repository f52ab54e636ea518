//! The test environment of deadletter-operator (dev-only): everything the integration tests,
//! `make demo`, `make cluster` and `make bench` run against, all real.
//!
//! - [`plane`]: a throwaway etcd + kube-apiserver ([`plane::ControlPlane`]), and the process
//!   helpers it is built from (free ports, children that die with the test).
//! - [`cluster`]: the control plane shared by one test binary ([`plane()`]), a fresh namespace
//!   per test, the CRDs; [`setup`] is what most tests start with.
//! - [`operator`]: the operator under test as a process ([`Operator`]).
//! - [`fixtures`]: dlq.dev objects as tests create, decide and wait on them.
//! - [`brokers`]: redis-server, RabbitMQ, nats-server, ElasticMQ (SQS) and an HTTP(S) sink.
//! - [`backends`]: each backend behind one trait (its broker, its queue spec, dead messages in,
//!   what redrive delivered, down and back, its failpoint), for the scenarios every backend
//!   must pass (`tests/backends.rs`).
//! - [`chaos`]: `make chaos`: every component faulted during a parking storm, invariants checked.
//! - [`browser`]: headless Chromium over WebDriver, for the page tests of `kubectl dlq ui`.
//! - [`chart`]: helm, promtool and rendered-manifest helpers for the packaging tests.
//! - [`paths`]: the checkout and the workspace's built binaries ([`bin`]).
//! - [`node`]: a real node (kubelet, containerd, kube-proxy, CNI) beside the plane, and
//!   [`image`]: the operator image as an OCI archive, built without a Docker daemon.
//!
//! Binaries of other packages are not visible through `env!("CARGO_BIN_EXE_…")`: build them
//! first with `cargo build --workspace --bins` (`make test` does).

pub mod backends;
pub mod brokers;
pub mod browser;
pub mod chaos;
pub mod chart;
pub mod cluster;
pub mod fixtures;
pub mod flux;
pub mod image;
pub mod node;
pub mod operator;
pub mod paths;
pub mod plane;
pub mod replays;
pub mod ui_page;

use std::io::Write;
use std::time::Duration;

pub use cluster::{
    CRDS, Plane, admin_client, apply_crds, audited_plane, install_crds, kubectl_dlq,
    kubectl_dlq_on, namespace, node_plane, plane, setup, setup_on,
};
pub use fixtures::{
    LIST, alerts_per_record, condition, create_dlq, create_offline_queue, create_queue,
    create_secret, decide, events_for, list_target, record, redrive_many, setup_redis_queue,
    unplaced, wait_phase, wait_ready,
};
pub use operator::Operator;
pub use paths::{bin, workspace_root};

/// The body of a plain-HTTP `POST {base}{path}` with a JSON `body` (HTTP/1.0: no chunked
/// answer, the server closes): for local servers without a client crate here (etcd's gateway).
pub async fn http_post(base: &str, path: &str, body: &str) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes())
        .await
        .expect("sending the request");
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer)
        .await
        .expect("reading the answer");
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {}", String::from_utf8_lossy(&answer)));
    answer.split_off(split + 4)
}

/// A line straight to the process's stderr, past the test harness's capture, so CI logs show
/// it (measurements, skipped checks, kept logs).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Polls `check` every 100 ms until it returns Some, or panics after `secs` with `what`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
