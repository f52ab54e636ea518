//! Pass-through: while a standing replay runs, a source passes a dead message of its failure
//! group straight from the broker to the queue's target (enqueue, then the source acks)
//! instead of making a record of it; what passed is written into the replay's status.
//!
//! The replay controller (leader only) covers and uncovers ([`Standing`]); the sources (leader
//! only too) offer every message before parking it, through [`PassThrough`]. A message passes
//! only while its replay is running here: a stop, a bound or the end of the run uncovers it,
//! and the next message parks as before. An enqueue that fails parks the message instead, so
//! it stays visible as a record (which the replay then decides, and whose failing enqueue
//! counts toward its `failureRatio`).
//!
//! `max` bounds the records a replay decides and the messages it passes together: both take
//! from one [`Cover`]'s budget. A pass is written into the replay's status ([`PassLog`])
//! before the source acknowledges it, passes waiting together sharing one write: the decision
//! log never says less than what reached the target, whenever the operator dies.
//!
//! Built in `crate::run`; below the sources and the reconcilers, it reaches the targets
//! directly (`crate::targets::enqueue`) and names neither of them.

pub mod cover;
pub mod standing;

pub use cover::{Cover, LAPSE, NoLog, PassLog, Tally};
pub use standing::{PassThrough, Passed, Standing};
