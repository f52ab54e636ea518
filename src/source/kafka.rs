//! Kafka source: a consumer group reading dead-letter topics (Spring's `<topic>.DLT`, Kafka
//! Connect's dead letter queue) and parking each message; its offset is stored for commit only
//! once its record exists.
//!
//! Up to [`IN_FLIGHT`] messages are handled at once per source (their parks or pass-throughs
//! overlap; one at a time, a storm passed through at the pace of one produce round trip each),
//! and each offset is stored only once that message and every one before it are done, in offset
//! order, so the committed offset never passes a message without a record. The job id is
//! `kafka-<topic>-<partition>-<offset>` of the dead-letter message: a crash re-reads from the last commit and re-parks under the same id,
//! which parking deduplicates while the record is Parked. Offsets are committed by librdkafka
//! every second from what the source stored (`enable.auto.offset.store=false`).
//!
//! Each record carries the value and key untouched, the headers through
//! `dlq_core::headers::kafka`, the original topic/partition/offset as `origin` and the exception
//! as reason. A message over the payload limit is copied (key, value, headers, plus
//! [`REJECTED_REASON_HEADER`]) to the rejected topic, confirmed, and only then committed.

use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesOrdered;
use kube::Client;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use dlq_client::park::{ParkError, ParkRequest};
use dlq_core::api::{DeadLetterQueue, FailureKind, Job, KafkaSourceSpec, Origin};
use dlq_core::headers::kafka::{self as codec, Header as RawHeader};

use super::park_into::{ParkInto, SourceError, keep_running};
use crate::broker::backend::Sides;
use crate::broker::kafka::KafkaConn;
use crate::secret::SecretReads;

/// The consumer group when the spec names none.
pub const DEFAULT_GROUP: &str = "deadletter-operator";
/// The header a rejected copy carries: why it could not be a record.
pub const REJECTED_REASON_HEADER: &str = "dlq-rejected-reason";
/// A rejected copy is confirmed within this, or the source restarts and reads it again.
const REJECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Messages handled at once per source (one with the bench's `--disable=kafka_in_flight`). As
/// many as the Redis source parks at once: each pass-through waits for its produce's
/// confirmation (`linger.ms` 5 included), so one at a time a storm passed at ~150 messages/s.
pub const IN_FLIGHT: usize = 32;

/// One dead-letter message, as read from Kafka.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dead {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    /// None for a tombstone (no value at all), which is not an empty value.
    pub value: Option<bytes::Bytes>,
    pub headers: Vec<RawHeader>,
    /// Milliseconds since the epoch: when it was dead-lettered.
    pub timestamp: Option<i64>,
}

impl Dead {
    pub fn from_message(m: &BorrowedMessage<'_>) -> Dead {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|x| (x.key.to_string(), x.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Dead {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            value: m.payload().map(bytes::Bytes::copy_from_slice),
            headers,
            timestamp: m.timestamp().to_millis(),
        }
    }

    /// The value's bytes; none for a tombstone.
    pub fn bytes(&self) -> bytes::Bytes {
        self.value.clone().unwrap_or_default()
    }

    /// The job id: the dead-letter message's own address, so a re-read parks the same record.
    pub fn job_id(&self) -> String {
        format!("kafka-{}-{}-{}", self.topic, self.partition, self.offset)
    }
}

/// Turns one dead-letter message into a park request.
pub fn request_for(queue: &str, dead: &Dead) -> ParkRequest {
    let info = codec::dead_letter_info(&dead.headers);
    let (headers, lost) = codec::to_headers(dead.key.as_deref(), &dead.headers);
    let origin = info.topic.clone().map(|topic| Origin {
        topic: Some(topic),
        partition: info.partition,
        offset: info.offset,
        ..Origin::default()
    });
    let job = Job {
        headers,
        origin: origin.map(Box::new),
        ..Job::null_value(dead.job_id())
    };
    let req = match &dead.value {
        Some(value) => ParkRequest::of_message(
            queue,
            Job {
                payload_null: false,
                ..job
            },
            value,
        ),
        None => ParkRequest::new(queue, job),
    };
    let mut req = req.with_message(format!(
        "kafka:{}/{}/{}",
        dead.topic, dead.partition, dead.offset
    ));
    req.failed_at = dead
        .timestamp
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok());
    let from = info
        .topic
        .as_deref()
        .map_or_else(String::new, |t| format!(" from {t}"));
    req.error_class = info.error_class;
    req.reason = info.reason.unwrap_or_else(|| {
        format!(
            "dead-lettered{from} to {} (no exception header)",
            dead.topic
        )
    });
    if !lost.is_empty() {
        req.failure_kind = FailureKind::Invalid;
        req.reason = format!(
            "headers beyond what a record holds were left out ({}): {}",
            lost.join(", "),
            req.reason
        );
    }
    req
}

/// Runs one source until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: KafkaSourceSpec) {
    keep_running("kafka", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &KafkaSourceSpec,
) -> Result<(), SourceError> {
    let mut secrets = SecretReads::new(client, into.namespace());
    let conn = KafkaConn::for_source(&mut secrets, Sides::of(source, &queue.spec))
        .await?
        .with_bodies(queue.spec.bodies.as_ref());
    let group = source.group_id.as_deref().unwrap_or(DEFAULT_GROUP);
    let consumer: StreamConsumer = conn
        .consumer_config()
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.commit.interval.ms", "1000")
        .set("auto.offset.reset", "earliest")
        // A crashed operator's membership expires after this, then its replacement gets the
        // partitions (the default 45 s would stall a restart that long).
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "3000")
        .create()
        .map_err(SourceError::broker("creating the Kafka consumer"))?;
    let topics: Vec<&str> = source.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(SourceError::broker("subscribing to the dead-letter topics"))?;
    let producer = conn.producer(REJECT_TIMEOUT).map_err(SourceError::broker(
        "creating the Kafka producer for rejected messages",
    ))?;
    let in_flight = if into.tuning().kafka_in_flight {
        IN_FLIGHT
    } else {
        1
    };
    // Handled in offset order of completion: an offset is stored only after every earlier one.
    let mut handling = FuturesOrdered::new();
    loop {
        tokio::select! {
            biased;
            Some(done) = handling.next(), if !handling.is_empty() => {
                let dead: Dead = done?;
                crate::failpoint::hit("kafka-before-commit").await;
                consumer
                    // rd_kafka_offset_store stores `offset + 1`, the next to read: with `+ 1` here
                    // the commit skipped the next message, lost after a restart.
                    .store_offset(&dead.topic, dead.partition, dead.offset)
                    .map_err(SourceError::broker(
                        "storing the offset of a parked message",
                    ))?;
            }
            // librdkafka reconnects by itself; an error here (broker gone, topic not created
            // yet) is reported and the read goes on, nothing is skipped.
            m = consumer.recv(), if handling.len() < in_flight => match m {
                Ok(m) => {
                    let dead = Dead::from_message(&m);
                    let producer = &producer;
                    handling.push_back(async move {
                        handle(into, source, producer, &dead).await.map(|()| dead)
                    });
                }
                Err(e) => {
                    tracing::warn!(queue = %into.queue(), error = %e, "reading the dead-letter topics failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
        }
    }
}

/// Parks one message (retrying until it is a record, or provably never can be); a message that
/// can never be a record is copied to the rejected topic first. `Ok` means it may be committed.
async fn handle(
    into: &ParkInto,
    source: &KafkaSourceSpec,
    producer: &FutureProducer,
    dead: &Dead,
) -> Result<(), SourceError> {
    let req = request_for(into.queue(), dead);
    let parked = into
        .park_message(
            req,
            &dead.bytes(),
            "in the dead-letter topic (offset not committed)",
            || std::future::ready(()),
        )
        .await;
    let Err(why) = parked else {
        return Ok(());
    };
    let rejected = source
        .rejected_topic
        .clone()
        .unwrap_or_else(|| format!("{}.rejected", dead.topic));
    reject(producer, &rejected, dead, &why).await?;
    let kept_in = format!(
        "Kafka topic {rejected} (copy of {} partition {} offset {})",
        dead.topic, dead.partition, dead.offset
    );
    into.rejected(
        &why,
        dead.value.as_ref().map_or(0, bytes::Bytes::len),
        &kept_in,
    )
    .await;
    Ok(())
}

/// Copies `dead` untouched to `topic`, with why it was rejected, and waits for the broker.
async fn reject(
    producer: &FutureProducer,
    topic: &str,
    dead: &Dead,
    why: &ParkError,
) -> Result<(), SourceError> {
    let reason = why.to_string();
    let mut headers = OwnedHeaders::new_with_capacity(dead.headers.len() + 1);
    for (name, value) in &dead.headers {
        headers = headers.insert(Header {
            key: name,
            value: value.as_deref(),
        });
    }
    headers = headers.insert(Header {
        key: REJECTED_REASON_HEADER,
        value: Some(reason.as_bytes()),
    });
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
    if let Some(v) = dead.value.as_deref() {
        record = record.payload(v);
    }
    if let Some(k) = dead.key.as_deref() {
        record = record.key(k);
    }
    producer
        .send(record, REJECT_TIMEOUT)
        .await
        .map(|_| ())
        .map_err(|(e, _)| SourceError::Broker {
            context: format!("copying a rejected message to {topic}"),
            source: Box::new(e),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spring_dead_letters_become_records_with_origin_and_reason() {
        let dead = Dead {
            topic: "orders.DLT".into(),
            partition: 0,
            offset: 17,
            key: Some(vec![0, 255]),
            value: Some(bytes::Bytes::from_static(br#"{"order":1}"#)),
            headers: vec![
                ("kafka_dlt-original-topic".into(), Some(b"orders".to_vec())),
                (
                    "kafka_dlt-original-partition".into(),
                    Some(2i32.to_be_bytes().to_vec()),
                ),
                (
                    "kafka_dlt-original-offset".into(),
                    Some(99i64.to_be_bytes().to_vec()),
                ),
                (
                    "kafka_dlt-exception-fqcn".into(),
                    Some(b"java.lang.IllegalArgumentException".to_vec()),
                ),
                ("trace".into(), Some(b"t-1".to_vec())),
            ],
            timestamp: Some(1_700_000_000_000),
        };
        let req = request_for("orders", &dead);
        assert_eq!(req.job.id, "kafka-orders.DLT-0-17");
        assert_eq!(req.job.payload.as_deref(), Some(r#"{"order":1}"#));
        let origin = req.job.origin.clone().unwrap_or_default();
        assert_eq!(origin.topic.as_deref(), Some("orders"));
        assert_eq!((origin.partition, origin.offset), (Some(2), Some(99)));
        assert_eq!(req.reason, "java.lang.IllegalArgumentException");
        assert_eq!(
            req.error_class.as_deref(),
            Some("java.lang.IllegalArgumentException")
        );
        assert_eq!(
            req.job.headers.get("trace").map(String::as_str),
            Some("t-1")
        );
        assert!(req.job.headers.contains_key(codec::KEY_BASE64_HEADER));
        assert!(req.failed_at.is_some());
    }

    #[test]
    fn a_tombstone_is_a_null_job_not_an_empty_one() {
        let tombstone = Dead {
            topic: "orders.DLT".into(),
            key: Some(b"order-1".to_vec()),
            ..Dead::default()
        };
        let req = request_for("orders", &tombstone);
        assert!(req.job.payload_null);
        assert_eq!((req.job.payload, req.job.payload_base64), (None, None));
        let empty = Dead {
            value: Some(bytes::Bytes::new()),
            ..tombstone
        };
        let req = request_for("orders", &empty);
        assert!(!req.job.payload_null);
        assert_eq!(req.job.payload.as_deref(), Some(""));
    }
}
