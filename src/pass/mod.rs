//! Pass-through: while a standing replay runs, a source passes a dead message of its failure
//! group straight from the broker to the queue's target instead of making a record of it
//! ([`standing`]).

pub mod standing;
