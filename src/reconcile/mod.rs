//! The reconcilers: a signed decision on a record carried out once ([`record`]), a queue's
//! counters, readiness and retention ([`queue`]), a runbook paced step by step ([`replay`]).
//! They share a [`Context`] ([`context`]; the watch caches in [`views`]); each owns its error,
//! and one policy ([`error_policy`]) counts any of them; the process wiring that runs them is
//! [`crate::run`].

pub mod aggregate;
mod ahead;
mod claims;
pub mod context;
pub mod error;
pub mod groups;
pub mod kept_groups;
pub mod queue;
pub mod record;
pub mod replay;
pub mod views;

pub use context::{Context, LIST_WAIT, Mechanisms, Settings, UnknownMechanism, action};
pub use error::ReconcileError;
pub(crate) use error::error_policy;

#[cfg(test)]
mod tests;
