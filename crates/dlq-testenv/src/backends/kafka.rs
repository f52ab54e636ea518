//! Kafka: topic `orders-<ns>` (the target, and the origin a dead letter names) and its
//! dead-letter topic `orders-<ns>.DLT` (the source), filled as Spring Kafka's
//! DeadLetterPublishingRecoverer does.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::Client;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::{Kafka, shared_kafka};
use crate::fixtures::create_dlq;

/// A Kafka node: the binary's shared one, or this test's own.
enum Node {
    Shared(&'static Kafka),
    Own(Kafka),
}

pub struct KafkaBackend {
    node: Node,
    /// The worker's topic: the target's, and the origin of every dead letter.
    topic: String,
    /// Its dead-letter topic, the source's.
    dlt: String,
    /// The source's consumer group.
    group: String,
}

/// What Spring Kafka's DeadLetterPublishingRecoverer adds to a record it dead-letters.
pub fn spring_headers(origin: &str, offset: i64) -> Vec<(String, Vec<u8>)> {
    vec![
        (
            "kafka_dlt-original-topic".into(),
            origin.as_bytes().to_vec(),
        ),
        (
            "kafka_dlt-original-partition".into(),
            0i32.to_be_bytes().to_vec(),
        ),
        (
            "kafka_dlt-original-offset".into(),
            offset.to_be_bytes().to_vec(),
        ),
        (
            "kafka_dlt-original-timestamp".into(),
            1_700_000_000_000i64.to_be_bytes().to_vec(),
        ),
        (
            "kafka_dlt-exception-fqcn".into(),
            b"java.lang.IllegalStateException".to_vec(),
        ),
        ("kafka_dlt-exception-message".into(), b"gave up".to_vec()),
    ]
}

impl KafkaBackend {
    fn kafka(&self) -> &Kafka {
        match &self.node {
            Node::Shared(k) => k,
            Node::Own(k) => k,
        }
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.kafka().bootstrap());
        c
    }

    async fn create_topics(&self) {
        let admin: AdminClient<DefaultClientContext> = self
            .config()
            .create()
            .unwrap_or_else(|e| panic!("a Kafka admin client: {e}"));
        let topics: Vec<NewTopic<'_>> = [&self.topic, &self.dlt]
            .iter()
            .map(|n| NewTopic::new(n, 1, TopicReplication::Fixed(1)))
            .collect();
        let out = admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .unwrap_or_else(|e| panic!("creating topics: {e}"));
        for r in out {
            if let Err((name, e)) = r {
                assert!(
                    e == rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                    "creating topic {name}: {e}"
                );
            }
        }
    }

    /// Low and high watermarks of partition 0 of `topic`.
    fn watermarks(&self, topic: &str) -> (i64, i64) {
        let c: BaseConsumer = self
            .config()
            .set("group.id", &self.group)
            .create()
            .unwrap_or_else(|e| panic!("a Kafka consumer: {e}"));
        c.fetch_watermarks(topic, 0, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("watermarks of {topic}: {e}"))
    }
}

impl Backend for KafkaBackend {
    const NAME: &'static str = "kafka";

    async fn start(ns: &str, broker: Broker) -> Self {
        let node = match broker {
            Broker::Shared => Node::Shared(shared_kafka()),
            Broker::Own => Node::Own(Kafka::start()),
        };
        let b = KafkaBackend {
            node,
            topic: format!("orders-{ns}"),
            dlt: format!("orders-{ns}.DLT"),
            group: format!("dlq-{ns}"),
        };
        b.create_topics().await;
        b
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        let mut spec = json!({"target": {"kafka": {
            "bootstrapServers": self.kafka().bootstrap(),
            "topic": self.topic,
        }}});
        if with_source {
            spec["source"] = json!({"kafka": {"topics": [self.dlt], "groupId": self.group}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!("kafka {} topic {}", self.kafka().bootstrap(), self.topic)
    }

    /// Every message of the worker's topic, read from the start by partition (no group join).
    async fn delivered(&self) -> Vec<Delivered> {
        let (low, high) = self.watermarks(&self.topic);
        let mut got = Vec::new();
        if high <= low {
            return got;
        }
        let consumer: StreamConsumer = self
            .config()
            .set("group.id", format!("{}-reader", self.group))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap_or_else(|e| panic!("a Kafka consumer: {e}"));
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, 0, Offset::Beginning)
            .unwrap_or_else(|e| panic!("assigning {}: {e}", self.topic));
        consumer
            .assign(&tpl)
            .unwrap_or_else(|e| panic!("assigning {}: {e}", self.topic));
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), consumer.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("{} has messages up to {high} but none came", self.topic)
                })
                .unwrap_or_else(|e| panic!("reading {}: {e}", self.topic));
            let headers: BTreeMap<String, String> = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|x| {
                            let v = x.value.map(String::from_utf8_lossy).unwrap_or_default();
                            (x.key.to_string(), v.into_owned())
                        })
                        .collect()
                })
                .unwrap_or_default();
            got.push(Delivered {
                payload: m.payload().unwrap_or_default().to_vec(),
                headers,
            });
            if m.offset() + 1 >= high {
                return got;
            }
        }
    }

    fn stop(&mut self) {
        match &self.node {
            Node::Own(k) => k.stop(),
            Node::Shared(_) => panic!("the shared Kafka is never stopped"),
        }
    }

    async fn restart(&mut self) {
        self.kafka().restart();
    }
}

impl Source for KafkaBackend {
    const FAILPOINT: &'static str = "kafka-before-commit";

    /// Each job on the dead-letter topic with Spring's headers (original topic and offset `i`)
    /// and its key; its record's job id is the dead letter's own position.
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let producer: FutureProducer = self
            .config()
            .set("acks", "all")
            .create()
            .unwrap_or_else(|e| panic!("a Kafka producer: {e}"));
        let mut sent = Vec::new();
        for (i, payload) in payloads.into_iter().enumerate() {
            let headers = super::contract::header_map(&self.headers());
            let mut h = OwnedHeaders::new();
            let spring = spring_headers(&self.topic, i as i64);
            for (k, v) in &spring {
                h = h.insert(Header {
                    key: k,
                    value: Some(v),
                });
            }
            for (k, v) in &headers {
                h = h.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let key = format!("order-{i}");
            let delivery = producer
                .send(
                    FutureRecord::to(&self.dlt)
                        .key(key.as_bytes())
                        .payload(&payload)
                        .headers(h),
                    Duration::from_secs(10),
                )
                .await
                .unwrap_or_else(|(e, _)| panic!("producing to {}: {e}", self.dlt));
            sent.push(Sent {
                job_id: format!(
                    "kafka-{}-{}-{}",
                    self.dlt, delivery.partition, delivery.offset
                ),
                payload,
                headers,
            });
        }
        sent
    }

    /// Dead letters past the source group's committed offset.
    async fn pending_dead(&self) -> usize {
        let (low, high) = self.watermarks(&self.dlt);
        let c: BaseConsumer = self
            .config()
            .set("group.id", &self.group)
            .create()
            .unwrap_or_else(|e| panic!("a Kafka consumer: {e}"));
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.dlt, 0);
        let committed = c
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("committed offsets of {}: {e}", self.group));
        let at = match committed.find_partition(&self.dlt, 0).map(|p| p.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => low,
        };
        usize::try_from(high - at).unwrap_or(0)
    }
}
