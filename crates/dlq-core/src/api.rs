//! The `dlq.dev/v1alpha1` API under one path, for the operator, the plugin and the tests: the
//! `DeadLetter` and `DeadLetterQueue` kinds (each in its own module) and the CRDs.
//!
//! Only a facade: nothing inside the core names it, since a module that both re-exports the
//! kinds and is used by them is a cycle (`scripts/module-cycles.sh`).

pub use crate::crds::crds_yaml;
pub use crate::dead_letter::*;
pub use crate::queue::*;
