//! deadletter-operator: every job a queue consumer gave up on becomes a `DeadLetter` resource
//! that a human redrives or drops, once, with a signed decision.
//!
//! The decisions and their effects are computed purely in `dlq_core` (see
//! docs/architecture.md); this crate carries them out, in layers whose arrows run one way, down
//! (`make deps-check`: `scripts/module-arrows.sh` holds the same table and checks this one):
//!
//! 6. [`run`] wires the process.
//! 5. [`reconcile`] (the reconcilers), [`source`] (a broker's dead messages into records),
//!    [`alert`] (per-record alerts) and [`reveal`] (the reveal API) side by side.
//! 4. [`pass`]: pass-through, the standing replays' dead messages straight to their targets
//!    (the sources offer, the replay controller covers).
//! 3. [`state`] (what they share), [`targets`] (where a redrive puts a job back, one file per
//!    backend), [`server`] (the probes and `/metrics`), [`keys`] (the queues' sealing keys) and
//!    [`body`] (the body store).
//! 2. [`broker`]: what a backend's source and target both need (connection, codec, refusals).
//! 1. [`metrics`], [`access`], [`secret`], [`https`], [`serving_tls`] and [`failpoint`].

pub mod access;
pub mod alert;
pub mod body;
pub mod broker;
pub mod failpoint;
pub mod https;
pub mod keys;
pub mod metrics;
pub mod pass;
pub mod reconcile;
pub mod reveal;
pub mod run;
pub mod secret;
pub mod server;
pub mod serving_tls;
pub mod source;
pub mod state;
pub mod targets;
/// The unit tests count what they hold (a large dead message kept from its own buffer).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: dlq_testenv::alloc::Counting = dlq_testenv::alloc::Counting;
