//! deadletter-operator: every job a queue consumer gave up on becomes a `DeadLetter` resource
//! that a human redrives or drops, once, with a signed decision.
//!
//! The decisions and their effects are computed purely in `dlq_core` (see
//! docs/architecture.md); this crate carries them out, in layers whose arrows run one way
//! (`make deps-check`): [`run`] wires the process; beneath it [`reconcile`] (the reconcilers),
//! [`source`] (collecting a broker's dead messages into records) and [`alert`] (per-record
//! alerts) stand side by side; beneath those, [`state`] (what they share) and [`target`] (where
//! redrive puts a job back, one file per backend) and [`keys`] (the queues' sealing keys); [`metrics`], [`server`], [`secret`],
//! [`https`] and [`failpoint`] at the bottom.

pub mod access;
pub mod alert;
pub mod body;
pub mod broker;
pub mod failpoint;
pub mod https;
pub mod keys;
pub mod metrics;
pub mod reconcile;
pub mod reveal;
pub mod run;
pub mod secret;
pub mod server;
pub mod serving_tls;
pub mod source;
pub mod state;
pub mod target;
/// The unit tests count what they hold (a large dead message kept from its own buffer).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: dlq_testenv::alloc::Counting = dlq_testenv::alloc::Counting;
