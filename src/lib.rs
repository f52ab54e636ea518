//! deadletter-operator: every job a queue consumer gave up on becomes a `DeadLetter` resource
//! that a human redrives or drops, once, with a signed decision.

pub mod api;
pub mod testenv;
