//! What functions over many records read of one ([`Facts`]), so that they run on a whole
//! `DeadLetter` (the CLI, tests) and on the operator's summary of it (`record::Summary`) alike.
//! Its own module: the failure group's key is made of these facts, and the record's summary
//! holds its group, so neither `group` nor `record` may hold the trait.

use jiff::Timestamp;

use crate::dead_letter::{Action, FailureKind, Phase};

/// The facts of a record that functions over many records read.
pub trait Facts {
    fn name(&self) -> &str;
    fn queue(&self) -> &str;
    fn job_id(&self) -> &str;
    fn cycle(&self) -> i32;
    /// The phase as readers take it: a record not yet marked is Parked.
    fn phase(&self) -> Phase;
    fn action(&self) -> Option<Action>;
    fn failure_kind(&self) -> FailureKind;
    fn reason(&self) -> &str;
    fn failed_at(&self) -> Timestamp;
    fn service_version(&self) -> Option<&str>;
    fn error_class(&self) -> Option<&str>;
    /// Its failure group, computed from its immutable facts ([`crate::group::Key`]). Never the
    /// `dlq.dev/group` label: anyone who may edit a record may edit its labels, and a forged
    /// label must not move a record into another group's counts or replays.
    fn group(&self) -> std::borrow::Cow<'_, str>;
    /// When the apiserver created it (None only for an object never stored).
    fn created(&self) -> Option<Timestamp>;
    fn resolved_at(&self) -> Option<Timestamp>;
    /// The replay that signed it: its name (label) and uid (annotation).
    fn signed_by_replay(&self) -> (Option<&str>, Option<&str>);
    /// Whether a `Requeued=False` condition stands for the current spec (generation).
    fn requeue_failing(&self) -> bool;
}
