//! Real brokers for the backend tests: redis-server, RabbitMQ (Debian's rabbitmq-server),
//! nats-server with JetStream, ElasticMQ (SQS-compatible), Kafka (KRaft), Google's Pub/Sub test
//! server (pstest), the body store's object stores (versitygw for S3, fake-gcs-server for GCS,
//! Azurite's blob service for Azure), a small HTTP(S) sink, Alertmanager, and a Sidekiq process
//! (Debian's ruby-sidekiq) running the test worker. Each runs as a child on free loopback ports
//! with its data in a temp dir, and dies with the test process.

mod alertmanager;
pub mod azurite;
mod child;
pub mod elasticmq;
pub mod gcs;
mod http;
pub mod kafka;
mod nats;
pub mod pstest;
mod rabbit;
mod redis_server;
pub mod s3;
mod sidekiq;

pub use self::alertmanager::Alertmanager;
pub use self::azurite::AzuriteServer;
pub use self::child::which;
pub use self::elasticmq::{ElasticMq, shared_elasticmq};
pub use self::gcs::GcsServer;
pub use self::http::{HttpSink, Received, TestCa};
pub use self::kafka::{Kafka, shared_kafka};
pub use self::nats::Nats;
pub use self::pstest::Pstest;
pub use self::rabbit::{
    Rabbit, declare_exchange, declare_queue, drain, queue_depth, quorum_args, shared_rabbit,
    worker_rejects,
};
pub use self::redis_server::Redis;
pub use self::s3::S3Server;
pub use self::sidekiq::Sidekiq;
