//! Every backend behind one trait, so that a scenario every backend must pass (park from the
//! source, redrive byte for byte, broker down and back, a crash between park and ack, many
//! redrives) is written once, in `tests/backends.rs`, and run against each: Redis, RabbitMQ,
//! NATS JetStream, Kafka, SQS (ElasticMQ), Google Cloud Pub/Sub (pstest), Sidekiq and, as a
//! target only, HTTP.
//!
//! A backend owns its broker (a fresh one, or the binary's shared one isolated by names when
//! the scenario never stops it), the DeadLetterQueue `relayer` that points at it, and the
//! reading of what redrive delivered. The [`Source`] side adds the dead-letter place a failing
//! worker fills and the failpoint between a park and its acknowledgement.
//!
//! The target address and the origin a source records are one place (the worker's queue,
//! topic, subject or list), so a parked message redriven back lands where [`Backend::delivered`]
//! reads, whichever of the two routes it took.

mod amqp;
mod contract;
mod http;
#[cfg(feature = "kafka")]
mod kafka;
mod nats;
mod pubsub;
mod redis;
mod sidekiq;
#[cfg(feature = "sqs")]
mod sqs;

pub use self::amqp::RabbitBackend;
pub use self::contract::{
    Backend, Broker, Delivered, KEY_HEADER, Sent, Source, binary, header_map, split_key,
};
pub use self::http::HttpBackend;
#[cfg(feature = "kafka")]
pub use self::kafka::KafkaBackend;
pub use self::nats::NatsBackend;
pub use self::pubsub::PubsubBackend;
pub use self::redis::RedisBackend;
pub use self::sidekiq::SidekiqBackend;
#[cfg(feature = "sqs")]
pub use self::sqs::SqsBackend;
