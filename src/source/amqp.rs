//! AMQP source bridge: consumes a RabbitMQ queue fed by a dead-letter exchange, with manual
//! acknowledgements, and parks each message before acking it. A crash (or a lost connection)
//! between the two leaves the message unacked, so RabbitMQ delivers it again and parking
//! deduplicates it.
//!
//! What becomes of a message (headers map as described in [`crate::broker::amqp`]):
//! - `x-death` (the most recent entry) gives `deliveries` (its count, or a quorum queue's
//!   `x-delivery-count` + 1 when the broker kept it, on the DLQ's first delivery only;
//!   RabbitMQ 3.10 drops that header when it dead-letters, so there a delivery-limit death
//!   counts 1), the reason in words, the time and `spec.job.origin` (queue, exchange, first
//!   routing key), so redrive returns the job where it was published.
//! - the job id is the `message-id` property; without one it is `amqp-` + a hash of the body,
//!   headers and x-death entry, so a redelivered copy of the same message dedupes.
//! - "unparseable" means the message is not a RabbitMQ dead letter (no usable `x-death`), or its
//!   headers exceed what a record holds: it is parked as `Invalid` with its exact bytes.
//! - a message that can never be a record (over the payload limit) is copied to
//!   `<queue>.rejected` (declared durable) and only then acked: it is never dropped.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use kube::Client;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection};
use sha2::{Digest, Sha256};

use dlq_client::park::ParkRequest;
use dlq_core::api::{self, AmqpSourceSpec, DeadLetterQueue, FailureKind, Job, Origin};

use super::park_into::{ParkInto, SourceError, keep_running};
use crate::broker::BrokerError;
use crate::broker::amqp::{AmqpConn, carried_headers, classify};
use crate::broker::backend::{Sides, source_url};
use crate::secret::SecretReads;

/// Headers RabbitMQ changes between copies of one death (see [`message_identity`]).
const UNSTABLE_HEADERS: &[&str] = &["x-death", "x-delivery-count"];

/// Unacked messages in flight at once (the channel's prefetch).
const PREFETCH: u16 = 32;

/// The most recent `x-death` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    pub queue: String,
    pub reason: String,
    pub exchange: String,
    pub routing_keys: Vec<String>,
    pub count: i64,
    pub time: Option<u64>,
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn number(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::Timestamp(n) => i64::try_from(*n).ok(),
        _ => None,
    }
}

/// Why a message carries no usable `x-death` (it then parks as Invalid, with this as reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeathError {
    #[error("no headers, so no x-death")]
    NoHeaders,
    #[error("no x-death header")]
    Missing,
    #[error("x-death is not an array")]
    NotAnArray,
    #[error("x-death has no entry")]
    Empty,
    #[error("x-death entry has no {0}")]
    NoField(&'static str),
}

/// Reads the most recent `x-death` entry, or says why there is none.
pub fn last_death(props: &BasicProperties) -> Result<Death, DeathError> {
    let table = props.headers().as_ref().ok_or(DeathError::NoHeaders)?;
    let deaths = match table.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice(),
        Some(_) => return Err(DeathError::NotAnArray),
        None => return Err(DeathError::Missing),
    };
    let Some(AMQPValue::FieldTable(entry)) = deaths.first() else {
        return Err(DeathError::Empty);
    };
    let e = entry.inner();
    let get = |k: &str| e.get(k).and_then(text);
    let queue = get("queue").ok_or(DeathError::NoField("queue"))?;
    let reason = get("reason").ok_or(DeathError::NoField("reason"))?;
    let exchange = get("exchange").unwrap_or_default();
    let routing_keys = match e.get("routing-keys") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    let count = e.get("count").and_then(number).unwrap_or(1);
    let time = match e.get("time") {
        Some(AMQPValue::Timestamp(t)) => Some(*t),
        _ => None,
    };
    Ok(Death {
        queue,
        reason,
        exchange,
        routing_keys,
        count,
        time,
    })
}

/// Deliveries in this cycle: the dead-letter count, or what a quorum queue counted. On a copy
/// the dead-letter queue hands out `again` (its connection to the bridge closed unacked), an
/// `x-delivery-count` is the dead-letter queue's own count, if that is a quorum queue, so only
/// the x-death count is left to go by.
pub fn deliveries(death: &Death, props: &BasicProperties, again: bool) -> i32 {
    let counted = props
        .headers()
        .as_ref()
        .filter(|_| !again)
        .and_then(|t| t.inner().get("x-delivery-count"))
        .and_then(number)
        // x-delivery-count is the number of earlier deliveries; the last one counts too.
        .map(|n| n + 1)
        .unwrap_or(0);
    let n = if death.reason == "delivery_limit" {
        counted.max(death.count)
    } else {
        death.count.max(counted)
    };
    i32::try_from(n.max(0)).unwrap_or(i32::MAX)
}

/// The x-death reason in words.
pub fn reason_in_words(death: &Death, deliveries: i32) -> String {
    let q = &death.queue;
    let what = match death.reason.as_str() {
        "rejected" => format!(
            "rejected by a consumer of queue {q} without requeue ({} time{})",
            death.count,
            if death.count == 1 { "" } else { "s" }
        ),
        "expired" => format!("expired in queue {q} (message TTL) before a consumer acked it"),
        "maxlen" => format!("dropped from queue {q}: the queue was over its length limit"),
        "delivery_limit" if deliveries > death.count.try_into().unwrap_or(i32::MAX) => format!(
            "delivered {deliveries} times from queue {q} without an ack: its delivery limit was reached"
        ),
        "delivery_limit" => format!(
            "redelivered from queue {q} without an ack until its delivery limit was reached"
        ),
        other => format!("dead-lettered from queue {q} ({other})"),
    };
    let ex = if death.exchange.is_empty() {
        "the default exchange".to_string()
    } else {
        format!("exchange {}", death.exchange)
    };
    match death.routing_keys.first() {
        Some(rk) => format!("{what}; published to {ex} with routing key {rk}"),
        None => format!("{what}; published to {ex}"),
    }
}

fn job_id(data: &[u8], props: &BasicProperties, headers: &BTreeMap<String, String>) -> String {
    if let Some(id) = props.message_id() {
        let id = id.as_str().trim();
        if !id.is_empty() && id.len() <= api::MAX_JOB_ID_LEN {
            return id.to_string();
        }
    }
    let mut h = Sha256::new();
    h.update(data);
    h.update(
        serde_json::to_string(headers)
            .unwrap_or_default()
            .as_bytes(),
    );
    if let Ok(d) = last_death(props) {
        h.update(format!("{}/{}/{:?}", d.queue, d.reason, d.time).as_bytes());
    }
    format!("amqp-{}", hex::encode(&h.finalize()[..8]))
}

/// This one dead-lettering of a message, as far as its bytes tell: body, message id, every
/// header but `x-death` and `x-delivery-count`, and the latest x-death entry's queue, reason
/// and count (RabbitMQ writes a new entry for each death, and a redrive drops the old ones).
/// Not its time: a quorum queue's at-least-once dead-lettering forwards a message again after
/// a node restart or a lost confirm, stamping the copy with a new time, and that copy is the
/// same death. Not `x-delivery-count`: a quorum dead-letter queue stamps it on a message it
/// hands out again after the bridge's connection closed unacked, and that is a re-read.
/// Only probably unique, so it is matched against resolved records only when a later death of
/// the same message must differ from it (see [`Bridge::handle`]).
fn message_identity(data: &[u8], props: &BasicProperties) -> String {
    let mut h = Sha256::new();
    h.update(data);
    h.update(format!("{:?}", props.message_id()).as_bytes());
    if let Some(headers) = props.headers() {
        for (name, value) in headers.inner() {
            if !UNSTABLE_HEADERS.contains(&name.as_str()) {
                h.update(format!("{name:?}={value:?};").as_bytes());
            }
        }
    }
    if let Ok(d) = last_death(props) {
        h.update(format!("{}/{}/{}", d.queue, d.reason, d.count).as_bytes());
    }
    format!("amqp:{}", hex::encode(&h.finalize()[..16]))
}

/// Turns one dead-lettered message into a park request (see the module doc); `again`: RabbitMQ
/// flagged the delivery redelivered.
pub fn request_for(queue: &str, data: &[u8], props: &BasicProperties, again: bool) -> ParkRequest {
    let carried = carried_headers(props);
    let id = job_id(data, props, &carried.headers);
    let death = last_death(props);
    let origin = death.as_ref().ok().map(|d| Origin {
        exchange: Some(d.exchange.clone()),
        routing_key: d.routing_keys.first().cloned(),
        queue: Some(d.queue.clone()),
        ..Origin::default()
    });
    let mut req = ParkRequest::of_message(
        queue,
        Job {
            id,
            headers: carried.headers,
            origin: origin.map(Box::new),
            ..Job::default()
        },
        data,
    );
    match death {
        Ok(d) => {
            req.deliveries = deliveries(&d, props, again);
            req.reason = reason_in_words(&d, req.deliveries);
            // `rejected`, `expired`, `maxlen` or `delivery_limit`: why RabbitMQ dead-lettered it.
            req.error_class = dlq_core::group::bounded_error_class(&d.reason);
            req.failed_at = d
                .time
                .and_then(|t| i64::try_from(t).ok())
                .and_then(|t| jiff::Timestamp::from_second(t).ok());
        }
        Err(why) => {
            req.failure_kind = FailureKind::Invalid;
            req.reason = format!("not a RabbitMQ dead letter ({why}); parked with its exact bytes");
        }
    }
    let mut req = req.with_message(message_identity(data, props));
    if !carried.lost.is_empty() {
        req.failure_kind = FailureKind::Invalid;
        req.reason = format!(
            "headers beyond what a record holds were left out ({}): {}",
            carried.lost.join(", "),
            req.reason
        );
    }
    req
}

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: AmqpSourceSpec) {
    keep_running("amqp", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &AmqpSourceSpec,
) -> Result<(), SourceError> {
    let (ns, name) = (into.namespace(), into.queue());
    let mut secrets = SecretReads::new(client, ns);
    let url = source_url(&mut secrets, Sides::of(source, &queue.spec)).await?;
    let conn = Arc::new(
        AmqpConn::connect(&url)
            .await
            .map_err(SourceError::broker("connecting to RabbitMQ"))?,
    );
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| SourceError::broker("RabbitMQ")(classify(&e)))?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| SourceError::broker("RabbitMQ")(classify(&e)))?;
    let dead = ShortString::try_new(source.queue.clone())
        .map_err(|_| SourceError::Config(format!("queue name {} is too long", source.queue)))?;
    let tag = ShortString::try_new(format!("deadletter-operator/{ns}/{name}"))
        .unwrap_or_else(|_| ShortString::from("deadletter-operator"));
    let mut consumer = ch
        .basic_consume(
            dead,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            SourceError::broker(format!("consuming queue {}", source.queue))(classify(&e))
        })?;
    tracing::info!(namespace = %ns, queue = %name, amqp_queue = %source.queue, "amqp source bridge consuming");
    let ctx = Arc::new(Bridge {
        into: into.clone(),
        rejected: format!("{}.rejected", source.queue),
        url,
        conn,
        channel: ch.clone(),
        keys_on: queue.spec.target.idempotency_key_header().is_some(),
    });
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery.map_err(|e| SourceError::broker("RabbitMQ")(classify(&e)))?;
        let ctx = ctx.clone();
        // Unacked, it is not in RabbitMQ's ready count: the backlog counts it till it is acked.
        let held = super::backlog::BACKLOGS.holding(ns, name);
        // The prefetch bounds how many of these run at once.
        tokio::spawn(async move {
            ctx.handle(delivery).await;
            drop(held);
        });
    }
    Ok(())
}

struct Bridge {
    into: ParkInto,
    rejected: String,
    /// For the rejected-copy publisher only; never logged.
    url: String,
    /// Held so the consumer's connection lives as long as any handler.
    #[allow(dead_code)]
    conn: Arc<Connection>,
    /// The channel the deliveries came on: once it is closed, RabbitMQ has requeued them.
    channel: lapin::Channel,
    /// Whether the queue's redrives carry an idempotency key, which makes a redriven job's
    /// next death differ from its last in its headers, so an unflagged copy matching a record
    /// by [`message_identity`] is that record's death sent twice, never a new one.
    keys_on: bool,
}

impl Bridge {
    async fn handle(&self, mut delivery: Delivery) {
        // Moved out, not copied: a large body goes to the store from this one buffer.
        let data = bytes::Bytes::from(std::mem::take(&mut delivery.data));
        let mut req = request_for(
            self.into.queue(),
            &data,
            &delivery.properties,
            delivery.redelivered,
        );
        // A copy RabbitMQ did not flag is still this death when at-least-once dead-lettering
        // forwarded it twice; with the queue's idempotency key on, every redrive stamps a key
        // of its own on the job, so a later death of it can never hash like an earlier one.
        req.redelivered = delivery.redelivered || self.keys_on;
        let job = req.job.id.clone();
        let (ns, queue) = (self.into.namespace(), self.into.queue());
        if !self.channel.status().connected() {
            // RabbitMQ requeued it when the channel closed and hands it out again flagged
            // redelivered; parking this stale copy as a first delivery could race that one.
            tracing::debug!(namespace = %ns, queue = %queue, job = %job, "channel closed before parking; RabbitMQ delivers the message again");
            return;
        }
        crate::failpoint::hit("amqp-before-park").await;
        let parked = self
            .into
            .park_message(req, &data, "unacked in RabbitMQ", || async {})
            .await;
        if let Err(e) = parked {
            if let Err(copy) = self.copy_to_rejected(&data, &delivery).await {
                tracing::error!(namespace = %ns, queue = %queue, job = %job, error = %copy, "copying to the rejected queue failed; the message stays unacked");
                return;
            }
            self.into.rejected(&e, data.len(), &self.rejected).await;
        }
        crate::failpoint::hit("amqp-before-ack").await;
        if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
            // The record exists; RabbitMQ will deliver the message again and parking dedupes it.
            tracing::warn!(namespace = %ns, queue = %queue, job = %job, error = %e, "acking a parked message failed");
        }
    }

    async fn copy_to_rejected(&self, data: &[u8], delivery: &Delivery) -> Result<(), BrokerError> {
        let publisher = AmqpConn::new(&self.url)?;
        let (conn, _) = publisher.get().await?;
        let ch = conn.create_channel().await.map_err(|e| classify(&e))?;
        let declared = ch
            .queue_declare(
                ShortString::try_new(self.rejected.clone())
                    .map_err(|_| BrokerError::Config("rejected queue name too long".into()))?,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        let _ = ch.close(200, ShortString::from("declared")).await;
        declared.map_err(|e| classify(&e))?;
        let result = publisher
            .publish("", &self.rejected, data, delivery.properties.clone())
            .await;
        publisher.reset().await;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v.as_bytes()))
    }

    fn dead(reason: &str, count: i64, extra: Vec<(&str, AMQPValue)>) -> BasicProperties {
        dead_at(reason, count, 1_700_000_000, extra)
    }

    fn dead_at(
        reason: &str,
        count: i64,
        time: u64,
        extra: Vec<(&str, AMQPValue)>,
    ) -> BasicProperties {
        let mut entry = FieldTable::default();
        entry.insert("queue".into(), s("orders"));
        entry.insert("reason".into(), s(reason));
        entry.insert("exchange".into(), s("shop"));
        entry.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![s("orders.created")])),
        );
        entry.insert("count".into(), AMQPValue::LongLongInt(count));
        entry.insert("time".into(), AMQPValue::Timestamp(time));
        let mut t = FieldTable::default();
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry)])),
        );
        t.insert("x-trace".into(), s("abc"));
        for (k, v) in extra {
            t.insert(k.into(), v);
        }
        BasicProperties::default()
            .with_message_id("order-1".into())
            .with_headers(t)
    }

    #[test]
    fn a_death_forwarded_again_later_is_the_same_message_and_a_redriven_death_is_not() {
        let first = request_for(
            "orders",
            b"{}",
            &dead_at("rejected", 1, 1_700_000_000, vec![]),
            false,
        );
        // At-least-once dead-lettering re-forwarding after a restart stamps a new time.
        let again = request_for(
            "orders",
            b"{}",
            &dead_at("rejected", 1, 1_700_000_180, vec![]),
            false,
        );
        assert_eq!(first.message, again.message);
        // A quorum dead-letter queue handing it out again after the bridge crashed unacked.
        let reread = request_for(
            "orders",
            b"{}",
            &dead_at(
                "rejected",
                1,
                1_700_000_000,
                vec![("x-delivery-count", AMQPValue::LongLongInt(1))],
            ),
            true,
        );
        assert_eq!(first.message, reread.message);
        assert_eq!(reread.deliveries, first.deliveries);
        // The same job dying again after a redrive carries the redrive's idempotency key.
        let key = vec![("Idempotency-Key", s("0b6c-1"))];
        let later = request_for(
            "orders",
            b"{}",
            &dead_at("rejected", 1, 1_700_000_500, key),
            false,
        );
        assert_ne!(first.message, later.message);
        assert_eq!(first.job.id, later.job.id, "one job, two deaths");
    }

    #[test]
    fn x_death_gives_deliveries_reason_and_origin() {
        let r = request_for("orders", b"{\"o\":1}", &dead("rejected", 2, vec![]), false);
        assert_eq!(r.job.id, "order-1");
        assert_eq!(r.failure_kind, FailureKind::Transient);
        assert_eq!(r.deliveries, 2);
        assert!(
            r.reason
                .starts_with("rejected by a consumer of queue orders"),
            "{}",
            r.reason
        );
        assert!(
            r.reason
                .contains("exchange shop with routing key orders.created")
        );
        let o = r.job.origin.clone().unwrap();
        assert_eq!(o.exchange.as_deref(), Some("shop"));
        assert_eq!(o.routing_key.as_deref(), Some("orders.created"));
        assert_eq!(o.queue.as_deref(), Some("orders"));
        assert_eq!(r.job.headers["x-trace"], "abc");
        assert_eq!(r.job.headers["message-id"], "order-1");
        assert!(!r.job.headers.contains_key("x-death"));
        assert_eq!(r.failed_at.unwrap().as_second(), 1_700_000_000);

        let q = request_for(
            "orders",
            b"x",
            &dead(
                "delivery_limit",
                1,
                vec![("x-delivery-count", AMQPValue::LongLongInt(4))],
            ),
            false,
        );
        assert_eq!(q.deliveries, 5);
        // The same copy handed out again by a quorum dead-letter queue: its x-delivery-count is
        // that queue's, not the work queue's.
        let again = request_for(
            "orders",
            b"x",
            &dead(
                "delivery_limit",
                1,
                vec![("x-delivery-count", AMQPValue::LongLongInt(1))],
            ),
            true,
        );
        assert_eq!(again.deliveries, 1);
        assert_eq!(r.error_class.as_deref(), Some("rejected"));
        assert_eq!(q.error_class.as_deref(), Some("delivery_limit"));
        assert!(q.reason.contains("delivered 5 times"), "{}", q.reason);
    }

    #[test]
    fn a_message_that_is_no_dead_letter_is_invalid_with_its_exact_bytes() {
        let raw = b"\xff\x00raw";
        let r = request_for("orders", raw, &BasicProperties::default(), false);
        assert_eq!(r.failure_kind, FailureKind::Invalid);
        assert_eq!(r.job.payload_bytes().unwrap(), raw);
        assert!(r.job.id.starts_with("amqp-"));
        assert!(r.reason.contains("no headers"), "{}", r.reason);
        assert_eq!(
            request_for("orders", raw, &BasicProperties::default(), false)
                .job
                .id,
            r.job.id,
            "the same message gets the same id, so a redelivery dedupes"
        );
        assert!(r.job.origin.is_none());
    }
}
