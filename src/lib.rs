//! deadletter-operator: every job a queue consumer gave up on becomes a `DeadLetter` resource
//! that a human redrives or drops, once, with a signed decision.
//!
//! The pure core is [`decide`]; [`controller`] holds the thin I/O shells around it; queue
//! backends live behind [`queue::Target`].

pub mod api;
pub mod bridge;
pub mod cli;
pub mod conditions;
pub mod controller;
pub mod decide;
pub mod error;
pub mod failpoint;
pub mod metrics;
pub mod park;
pub mod queue;
pub mod server;
pub mod targets;
pub mod testenv;

pub use error::{Error, Result};
