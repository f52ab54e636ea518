//! The apiserver side of the core's rules, shared by producers, `kubectl dlq` and the operator:
//! [`park`] (create a record once, with its cycle) and [`events`] (publish an
//! [`dlq_core::events::EventPlan`]).

pub mod admission;
pub mod ceiling;
pub mod events;
pub mod park;
pub mod quota;
pub mod retry;

pub use park::{ParkError, ParkOutcome, ParkRequest, Parker, park};
