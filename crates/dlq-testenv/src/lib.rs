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
//! Without feature `harness` (on by default) only [`plane`] and [`paths`] are built: what
//! `make demo` needs.
//!
//! Binaries of other packages are not visible through `env!("CARGO_BIN_EXE_…")`: build them
//! first with `cargo build --workspace --bins` (`make test` does).

#[cfg(feature = "harness")]
pub mod admission;
#[cfg(feature = "harness")]
pub mod alloc;
#[cfg(feature = "harness")]
pub mod backends;
#[cfg(feature = "harness")]
pub mod brokers;
#[cfg(feature = "harness")]
pub mod browser;
#[cfg(feature = "harness")]
pub mod chaos;
#[cfg(feature = "harness")]
pub mod chart;
#[cfg(feature = "harness")]
pub mod cluster;
#[cfg(feature = "harness")]
pub mod fixtures;
#[cfg(feature = "harness")]
pub mod flux;
#[cfg(feature = "harness")]
pub mod harness;
#[cfg(feature = "harness")]
pub mod image;
#[cfg(feature = "harness")]
pub mod node;
#[cfg(feature = "harness")]
pub mod operator;
pub mod paths;
pub mod plane;
#[cfg(feature = "harness")]
pub mod replays;
#[cfg(feature = "harness")]
pub mod reveal;
#[cfg(feature = "harness")]
pub mod ui_page;

#[cfg(feature = "harness")]
pub use cluster::{
    CRDS, Plane, admin_client, apply_crds, audited_plane, install_crds, kubectl_dlq,
    kubectl_dlq_on, namespace, node_plane, plane, quota_plane, setup, setup_on,
};
#[cfg(feature = "harness")]
pub use fixtures::{
    LIST, alerts_per_record, condition, create_dlq, create_offline_queue, create_queue,
    create_secret, decide, events_for, in_phase, list_target, record, redrive_many,
    setup_redis_queue, unplaced, wait_phase, wait_ready,
};
#[cfg(feature = "harness")]
pub use harness::{eventually, http_post, report};
#[cfg(feature = "harness")]
pub use operator::Operator;
pub use paths::{bin, workspace_root};
