//! Kafka target: produce the untouched record back to its original topic (or the configured
//! one) with `acks=all` and an idempotent producer, answering once every in-sync replica has it.
//!
//! Value and key go back byte for byte; headers come back from the job headers through
//! `dlq_core::headers::kafka` (the codec the source parks with), without the dead-letter
//! bookkeeping headers. The partition is the original one only when `keepPartition` is set;
//! otherwise the key picks it, as it did for the original producer.
//!
//! [`KafkaConn`] (servers, TLS, SASL) is shared with the source.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tokio::sync::OnceCell;

use dlq_core::api::{KafkaTargetSpec, Route};
use dlq_core::headers::kafka as codec;

use super::{JobMessage, Target, TargetError};
use crate::broker::kafka::KafkaConn;

/// A redrive answered within this, or it is `BrokerUnreachable`.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Produces redriven jobs to one topic (or the topic each record came from).
pub struct KafkaTarget {
    topic: String,
    route: Route,
    keep_partition: bool,
    conn: KafkaConn,
    producer: OnceCell<FutureProducer>,
}

impl KafkaTarget {
    pub fn new(spec: &KafkaTargetSpec, conn: KafkaConn) -> KafkaTarget {
        KafkaTarget {
            topic: spec.topic.clone(),
            route: spec.route.unwrap_or_default(),
            keep_partition: spec.keep_partition.unwrap_or(false),
            conn,
            producer: OnceCell::new(),
        }
    }

    async fn producer(&self) -> Result<&FutureProducer, TargetError> {
        self.producer
            .get_or_try_init(|| async {
                self.conn
                    .producer(SEND_TIMEOUT)
                    .map_err(|e| TargetError::Config(format!("creating the Kafka producer: {e}")))
            })
            .await
    }

    /// The topic and partition `job` goes to.
    pub fn destination(&self, job: &JobMessage) -> (String, Option<i32>) {
        let origin = job.origin.as_ref();
        let topic = match (self.route, origin.and_then(|o| o.topic.as_ref())) {
            (Route::Origin, Some(t)) => t.clone(),
            _ => self.topic.clone(),
        };
        let partition = match self.keep_partition {
            true => origin.and_then(|o| o.partition),
            false => None,
        };
        (topic, partition)
    }

    async fn send(&self, job: &JobMessage) -> Result<(), TargetError> {
        let (key, headers) =
            codec::from_headers(&job.headers_with_key()).map_err(TargetError::Invalid)?;
        let mut out = OwnedHeaders::new_with_capacity(headers.len());
        for (name, value) in &headers {
            out = out.insert(Header {
                key: name,
                value: value.as_deref(),
            });
        }
        let (topic, partition) = self.destination(job);
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(out);
        if !job.null_payload {
            record = record.payload(&job.payload[..]);
        }
        if let Some(k) = key.as_deref() {
            record = record.key(k);
        }
        if let Some(p) = partition {
            record = record.partition(p);
        }
        let producer = self.producer().await?;
        match producer.send(record, SEND_TIMEOUT).await {
            Ok(d) => {
                tracing::debug!(topic = %topic, partition = d.partition, offset = d.offset, job = %job.id, "redriven to kafka");
                Ok(())
            }
            Err((e, _)) => Err(classify(&topic, e)),
        }
    }
}

/// Timeouts and transport errors are `Unreachable` (retried); what the broker answered is
/// `Refused`.
fn classify(topic: &str, e: KafkaError) -> TargetError {
    use rdkafka::types::RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::MessageTimedOut
            | C::RequestTimedOut
            | C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::QueueFull
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition,
        )
        | None => TargetError::Unreachable(format!("producing to {topic}: {e}")),
        Some(_) => TargetError::Refused(format!("producing to {topic}: {e}")),
    }
}

impl Target for KafkaTarget {
    fn describe(&self) -> String {
        format!("kafka {} topic {}", self.conn.bootstrap_servers, self.topic)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        self.send(job).boxed()
    }

    fn carries_null_payload(&self) -> bool {
        true
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        async move {
            let producer = self.producer().await?;
            let producer = producer.clone();
            let topic = self.topic.clone();
            tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(Some(&topic), Duration::from_secs(5))
                    .map(|_| ())
                    .map_err(|e| TargetError::Unreachable(format!("metadata of {topic}: {e}")))
            })
            .await
            .map_err(|e| TargetError::Unreachable(format!("metadata probe: {e}")))?
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Origin;

    fn job(origin: Option<Origin>) -> JobMessage {
        JobMessage {
            id: "j".into(),
            payload: vec![1, 2].into(),
            null_payload: false,
            headers: Default::default(),
            origin,
            idempotency_key: None,
            key_header: None,
        }
    }

    #[test]
    fn origin_topic_and_partition_only_when_asked() {
        let spec = KafkaTargetSpec {
            bootstrap_servers: "k:9092".into(),
            topic: "retry".into(),
            ..Default::default()
        };
        let origin = Some(Origin {
            topic: Some("orders".into()),
            partition: Some(2),
            ..Origin::default()
        });
        let t = KafkaTarget::new(&spec, KafkaConn::default());
        assert_eq!(t.destination(&job(origin.clone())), ("orders".into(), None));
        assert_eq!(t.destination(&job(None)), ("retry".into(), None));
        let keep = KafkaTarget::new(
            &KafkaTargetSpec {
                keep_partition: Some(true),
                route: Some(Route::Origin),
                ..spec.clone()
            },
            KafkaConn::default(),
        );
        assert_eq!(
            keep.destination(&job(origin.clone())),
            ("orders".into(), Some(2))
        );
        let fixed = KafkaTarget::new(
            &KafkaTargetSpec {
                route: Some(Route::Target),
                ..spec
            },
            KafkaConn::default(),
        );
        assert_eq!(fixed.destination(&job(origin)).0, "retry");
    }
}
