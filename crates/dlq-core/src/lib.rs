//! The pure core of deadletter-operator.
//!
//! Everything here is a function of its inputs: the `dlq.dev` API types (one module per kind:
//! [`dead_letter`], [`queue`], [`replay`], [`groups`]; [`api`] re-exports the first two), what to do with a
//! record ([`decide`]), the whole outcome of a reconcile as data ([`plan`]: the status to write,
//! the Events to publish, the metric changes), the park rules ([`park`]: validation, naming,
//! cycles) and one park's plan ([`park_plan`]: what a parker asks once and carries out; and
//! [`source_plan`]: what a source asks once of a dead message it read), and
//! the codecs shared by sources and targets ([`headers`], [`envelope`], [`sidekiq`]). No kube
//! client, no async runtime, no broker crate: the operator carries plans out.

// kube-derive's generated code names `::kube::core` and `::kube::KubeSchema` (the facade
// crate), even for rules on the generated root type. The core has no kube client, so inside it
// `::kube` is this crate, re-exporting kube-core and the derive.
extern crate self as kube;
#[doc(hidden)]
pub mod core {
    pub use kube_core::*;
}
#[doc(hidden)]
pub use kube_derive::KubeSchema;

pub mod alert;
pub mod api;
pub mod body;
pub mod capacity;
pub mod ceiling;
pub mod cloudevent;
pub mod conditions;
pub mod crds;
pub mod dead_letter;
pub mod decide;
pub mod duration;
pub mod envelope;
pub mod event_series;
pub mod events;
pub mod facts;
pub mod group;
pub mod groups;
pub mod headers;
pub mod history;
pub mod json;
pub mod mask;
pub mod park;
pub mod park_plan;
pub mod plan;
pub mod queue;
pub mod record;
pub mod replay;
pub mod reveal;
pub mod seal;
pub mod sidekiq;
pub mod source_plan;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
