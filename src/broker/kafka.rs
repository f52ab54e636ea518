//! Kafka, for its source (a dead-letter topic) and its target: how to reach a cluster (servers,
//! TLS and SASL, with the Secrets read) and the librdkafka settings every client shares.

use std::time::Duration;

use kube::Client;
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;

use dlq_core::api::{KafkaSecurity, SecretKeyRef};

use crate::secret::{SecretError, read_secret};

/// SASL user and password read from a Secret. No `Debug`: it must not reach a log line.
#[derive(Clone, Hash, PartialEq, Eq)]
pub struct SaslCredentials {
    pub username: String,
    pub password: String,
}

/// How to reach a Kafka cluster: servers, TLS and SASL, with the secrets already read.
#[derive(Clone, Default)]
pub struct KafkaConn {
    pub bootstrap_servers: String,
    pub protocol: Option<String>,
    pub sasl_mechanism: Option<String>,
    pub credentials: Option<SaslCredentials>,
    /// PEM CA certificates (else the system roots).
    pub ca_pem: Option<String>,
}

impl KafkaConn {
    pub fn new(
        servers: &str,
        security: Option<&KafkaSecurity>,
        credentials: Option<SaslCredentials>,
        ca_pem: Option<String>,
    ) -> KafkaConn {
        KafkaConn {
            bootstrap_servers: servers.to_string(),
            protocol: security.and_then(|s| s.protocol.clone()),
            sasl_mechanism: security.and_then(|s| s.sasl_mechanism.clone()),
            credentials,
            ca_pem,
        }
    }

    /// librdkafka settings every client of this connection shares. librdkafka's own logs go
    /// to its log callback, which never prints configuration values.
    pub fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("client.id", "deadletter-operator")
            .set("socket.timeout.ms", "10000")
            .set("reconnect.backoff.max.ms", "2000");
        if let Some(p) = &self.protocol {
            c.set("security.protocol", p.to_ascii_lowercase());
        }
        if let Some(creds) = &self.credentials {
            c.set(
                "sasl.mechanism",
                self.sasl_mechanism.as_deref().unwrap_or("PLAIN"),
            )
            .set("sasl.username", &creds.username)
            .set("sasl.password", &creds.password);
        }
        if let Some(ca) = &self.ca_pem {
            c.set("ssl.ca.pem", ca);
        }
        c
    }

    /// An idempotent `acks=all` producer; a send not confirmed within `timeout` fails.
    pub fn producer(&self, timeout: Duration) -> Result<FutureProducer, KafkaError> {
        self.config()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("message.timeout.ms", timeout.as_millis().to_string())
            .create()
    }
}

/// The keys of a Kafka SASL credentials Secret.
pub const KAFKA_USERNAME: &str = "username";
pub const KAFKA_PASSWORD: &str = "password";

/// Reads the SASL credentials and CA a Kafka connection names, with the Secrets' versions.
pub async fn read_kafka_secrets(
    client: &Client,
    namespace: &str,
    security: Option<&KafkaSecurity>,
) -> Result<(Option<SaslCredentials>, Option<String>, Vec<String>), SecretError> {
    let mut versions = Vec::new();
    let Some(security) = security else {
        return Ok((None, None, versions));
    };
    let sasl = match &security.credentials_secret_ref {
        Some(r) => {
            let key = |k: &str| SecretKeyRef {
                name: r.name.clone(),
                key: k.to_string(),
            };
            let (username, version) = read_secret(client, namespace, &key(KAFKA_USERNAME)).await?;
            let (password, _) = read_secret(client, namespace, &key(KAFKA_PASSWORD)).await?;
            versions.push(version);
            Some(SaslCredentials { username, password })
        }
        None => None,
    };
    let ca = match &security.ca_secret_ref {
        Some(r) => {
            let (pem, version) = read_secret(client, namespace, r).await?;
            versions.push(version);
            Some(pem)
        }
        None => None,
    };
    Ok((sasl, ca, versions))
}

/// The consumer group's lag on `topics`: per partition, the high watermark minus the group's
/// committed offset (minus the low watermark where the group has committed nothing), summed.
/// Blocking (librdkafka's calls wait up to `timeout` each): run it off the async threads.
/// `consumer` carries the group's `group.id` and never subscribes, so it never joins the group.
pub fn consumer_lag(
    consumer: &rdkafka::consumer::BaseConsumer,
    topics: &[String],
    timeout: Duration,
) -> Result<i64, KafkaError> {
    use rdkafka::consumer::Consumer;
    use rdkafka::{Offset, TopicPartitionList};
    let mut partitions = TopicPartitionList::new();
    let mut watermarks = Vec::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
        for t in metadata.topics() {
            for p in t.partitions() {
                partitions.add_partition(topic, p.id());
                let (low, high) = consumer.fetch_watermarks(topic, p.id(), timeout)?;
                watermarks.push((topic.clone(), p.id(), low, high));
            }
        }
    }
    let committed = consumer.committed_offsets(partitions, timeout)?;
    let mut lag = 0i64;
    for (topic, partition, low, high) in watermarks {
        let from = match committed
            .find_partition(&topic, partition)
            .map(|e| e.offset())
        {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        lag += (high - from).max(0);
    }
    Ok(lag)
}
