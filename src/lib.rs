//! deadletter-operator: every job a queue consumer gave up on becomes a `DeadLetter` resource
//! that a human redrives or drops, once, with a signed decision.
//!
//! The decisions and their effects are computed purely in `dlq_core` (see
//! docs/architecture.md); this crate carries them out: [`controller`] (watches, one store per
//! kind, compare-and-swap writes), [`target`] (where redrive puts a job back, one file per
//! backend), [`source`] (collecting a broker's dead messages into records), [`metrics`] and
//! [`server`].

pub mod alert;
pub mod controller;
pub mod error;
pub mod failpoint;
pub mod https;
pub mod metrics;
pub mod secret;
pub mod server;
pub mod source;
pub mod target;

pub use error::{Error, Result};
