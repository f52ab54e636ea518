//! Kafka, for its source (a dead-letter topic) and its target: how to reach a cluster (servers,
//! TLS and SASL, with the Secrets read) and the librdkafka settings every client shares.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;

use dlq_core::api::{KafkaSecurity, KafkaSourceSpec, SecretKeyRef};

use super::backend::{ConnectError, Sides};
use crate::secret::{SecretError, SecretReads};

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
    /// The largest message this client moves, when its queue keeps bodies in a store
    /// ([`KafkaConn::with_bodies`]); librdkafka's defaults (about 1 MB) otherwise.
    pub max_message_bytes: Option<u64>,
}

/// Room for a message's key, headers and record framing above its value.
const MESSAGE_OVERHEAD: u64 = 1 << 20;

/// librdkafka's ceiling for `message.max.bytes` and `max.partition.fetch.bytes`.
const LIBRDKAFKA_MAX: u64 = 1_000_000_000;

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
            max_message_bytes: None,
        }
    }

    /// Sized for the queue's body store: a dead message up to `spec.bodies.maxBytes` must be
    /// read from the dead-letter topic and produced back whole (librdkafka refuses a message
    /// over its `message.max.bytes`, 1 MB by default, before the broker sees it).
    pub fn with_bodies(mut self, bodies: Option<&dlq_core::api::BodiesSpec>) -> KafkaConn {
        self.max_message_bytes = bodies
            .map(|b| b.max().saturating_add(MESSAGE_OVERHEAD).min(LIBRDKAFKA_MAX))
            .filter(|m| *m > 1_000_000);
        self
    }

    /// A consumer's settings: [`KafkaConn::config`] and, for a queue with a body store, fetches
    /// large enough for its largest message (`fetch.max.bytes` follows `message.max.bytes`,
    /// set explicitly all the same).
    pub fn consumer_config(&self) -> ClientConfig {
        let mut c = self.config();
        if let Some(max) = self.max_message_bytes {
            c.set("fetch.max.bytes", max.to_string())
                .set("max.partition.fetch.bytes", max.to_string())
                .set("receive.message.max.bytes", (max + 512).to_string());
        }
        c
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
        if let Some(max) = self.max_message_bytes {
            c.set("message.max.bytes", max.to_string());
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

/// Reads the SASL credentials and CA a Kafka connection names.
pub async fn read_kafka_secrets(
    secrets: &mut SecretReads<'_>,
    security: Option<&KafkaSecurity>,
) -> Result<(Option<SaslCredentials>, Option<String>), SecretError> {
    let Some(security) = security else {
        return Ok((None, None));
    };
    let sasl = match &security.credentials_secret_ref {
        Some(r) => {
            let key = |k: &str| SecretKeyRef {
                name: r.name.clone(),
                key: k.to_string(),
            };
            let username = secrets.value(&key(KAFKA_USERNAME)).await?;
            let password = secrets.value(&key(KAFKA_PASSWORD)).await?;
            Some(SaslCredentials { username, password })
        }
        None => None,
    };
    let ca = match &security.ca_secret_ref {
        Some(r) => Some(secrets.value(r).await?),
        None => None,
    };
    Ok((sasl, ca))
}

impl KafkaConn {
    /// A source's servers and security: its own, else its queue's Kafka target's.
    pub async fn for_source(
        secrets: &mut SecretReads<'_>,
        sides: Sides<'_, KafkaSourceSpec>,
    ) -> Result<KafkaConn, ConnectError> {
        let servers = sides.either(
            |s| s.bootstrap_servers.as_ref(),
            |t| Some(&t.bootstrap_servers),
        );
        let Some(servers) = servers else {
            let why = "kafka source needs bootstrapServers (or a kafka target)";
            return Err(ConnectError::Unnamed(why.into()));
        };
        let security = sides.either(|s| s.security.as_ref(), |t| t.security.as_ref());
        let (sasl, ca) = read_kafka_secrets(secrets, security).await?;
        Ok(KafkaConn::new(servers, security, sasl, ca))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::BodiesSpec;

    /// A queue with a store moves messages up to its `maxBytes` (librdkafka's ceiling at most);
    /// one without keeps librdkafka's defaults.
    #[test]
    fn clients_are_sized_by_the_body_store() {
        let plain = KafkaConn::new("k:9092", None, None, None).with_bodies(None);
        assert_eq!(plain.config().get("message.max.bytes"), None);
        assert_eq!(plain.consumer_config().get("fetch.max.bytes"), None);
        let store = BodiesSpec {
            max_bytes: Some(64 << 20),
            ..BodiesSpec::default()
        };
        let sized = KafkaConn::new("k:9092", None, None, None).with_bodies(Some(&store));
        let want = ((64 << 20) + (1 << 20)).to_string();
        assert_eq!(sized.config().get("message.max.bytes"), Some(want.as_str()));
        let consumer = sized.consumer_config();
        assert_eq!(consumer.get("fetch.max.bytes"), Some(want.as_str()));
        assert_eq!(
            consumer.get("max.partition.fetch.bytes"),
            Some(want.as_str())
        );
        let huge = BodiesSpec {
            max_bytes: Some(5 << 30),
            ..BodiesSpec::default()
        };
        let capped = KafkaConn::new("k:9092", None, None, None).with_bodies(Some(&huge));
        assert_eq!(capped.max_message_bytes, Some(LIBRDKAFKA_MAX));
    }
}
