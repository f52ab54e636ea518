//! RabbitMQ: a worker queue `<ns>.orders` dead-lettering through exchange `<ns>.dlx` into
//! `<ns>.orders.dlq` (the source, a quorum queue); the target publishes to `<ns>.orders`
//! through the default exchange, which is also the origin `x-death` names.

use std::collections::BTreeMap;
use std::sync::Mutex;

use kube::Client;
use lapin::options::{BasicPublishOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::{
    Rabbit, declare_exchange, declare_queue, drain, queue_depth, quorum_args, shared_rabbit,
    worker_rejects,
};
use crate::fixtures::{create_dlq, create_secret};

/// A RabbitMQ node: the binary's shared one, or this test's own.
enum Node {
    Shared(&'static Rabbit),
    Own(Rabbit),
}

pub struct RabbitBackend {
    node: Node,
    /// `<ns>.orders`: the worker's queue, the target's address and the dead messages' origin.
    orders: String,
    dlx: String,
    /// `<ns>.orders.dlq`: where RabbitMQ dead-letters `orders`; the source's queue.
    dlq: String,
    /// What was taken off `orders` so far (a read drains it).
    taken: Mutex<Vec<Delivered>>,
}

fn text(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v.as_bytes()))
}

/// An AMQP header value as text: strings as they are, anything else as the client prints it.
fn value_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        other => format!("{other:?}"),
    }
}

impl RabbitBackend {
    fn rabbit(&self) -> &Rabbit {
        match &self.node {
            Node::Shared(r) => r,
            Node::Own(r) => r,
        }
    }

    /// Declares the worker's topology (again, as a worker does when it reconnects).
    async fn declare(&self) {
        let (_conn, ch) = self.rabbit().channel().await;
        declare_exchange(&ch, &self.dlx, ExchangeKind::Fanout).await;
        let mut args = FieldTable::default();
        args.insert(ShortString::from("x-dead-letter-exchange"), text(&self.dlx));
        declare_queue(&ch, &self.orders, args).await;
        // A quorum queue, as docs/backends.md advises: it stamps `x-delivery-count` on a
        // message it hands out again, which the source must not take for a new death.
        declare_queue(&ch, &self.dlq, quorum_args()).await;
        ch.queue_bind(
            self.dlq.as_str().into(),
            self.dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("binding {} to {}: {e}", self.dlq, self.dlx));
    }
}

impl Backend for RabbitBackend {
    const NAME: &'static str = "rabbitmq";

    async fn start(ns: &str, broker: Broker) -> Self {
        let node = match broker {
            Broker::Shared => Node::Shared(shared_rabbit()),
            Broker::Own => Node::Own(Rabbit::start()),
        };
        let b = RabbitBackend {
            node,
            orders: format!("{ns}.orders"),
            dlx: format!("{ns}.dlx"),
            dlq: format!("{ns}.orders.dlq"),
            taken: Mutex::default(),
        };
        b.declare().await;
        b
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        create_secret(client, ns, "amqp", "url", &self.rabbit().url()).await;
        let mut spec = json!({"target": {"amqp": {
            "urlSecretRef": {"name": "amqp", "key": "url"},
            "exchange": "",
            "routingKey": self.orders,
        }}});
        if with_source {
            spec["source"] = json!({"amqp": {"queue": self.dlq}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!(
            "amqp exchange (default) key {} (or the record's origin)",
            self.orders
        )
    }

    async fn delivered(&self) -> Vec<Delivered> {
        let (_conn, ch) = self.rabbit().channel().await;
        let fresh = drain(&ch, &self.orders).await.into_iter().map(|m| {
            let headers = m
                .delivery
                .properties
                .headers()
                .as_ref()
                .map(headers_of)
                .unwrap_or_default();
            Delivered {
                payload: m.delivery.data.clone(),
                headers,
            }
        });
        let mut taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        taken.extend(fresh);
        taken.clone()
    }

    fn stop(&mut self) {
        match &self.node {
            Node::Own(r) => r.stop(),
            Node::Shared(_) => panic!("the shared RabbitMQ is never stopped"),
        }
    }

    async fn restart(&mut self) {
        self.rabbit().restart();
        // A node killed hard may come back without queues declared moments before the kill;
        // workers declare theirs when they reconnect, and so does this one.
        self.declare().await;
    }
}

impl Source for RabbitBackend {
    const FAILPOINT: &'static str = "amqp-before-ack";

    /// Publishes each job to the worker's queue (message-id = the job id) and rejects it as a
    /// failing worker does: RabbitMQ dead-letters it into the source's queue.
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let n = payloads.len();
        let (_conn, ch) = self.rabbit().channel().await;
        ch.confirm_select(Default::default())
            .await
            .unwrap_or_else(|e| panic!("confirm.select: {e}"));
        let mut sent = Vec::new();
        for (i, payload) in payloads.into_iter().enumerate() {
            let s = Sent {
                job_id: format!("dead/{i}"),
                payload,
                headers: super::contract::header_map(&self.headers()),
            };
            let mut table = FieldTable::default();
            for (k, v) in &s.headers {
                table.insert(ShortString::from(k.as_str()), text(v));
            }
            let props = BasicProperties::default()
                .with_message_id(s.job_id.as_str().into())
                .with_headers(table);
            ch.basic_publish(
                "".into(),
                self.orders.as_str().into(),
                BasicPublishOptions::default(),
                &s.payload,
                props,
            )
            .await
            .unwrap_or_else(|e| panic!("publishing to {}: {e}", self.orders))
            .await
            .unwrap_or_else(|e| panic!("confirm of a publish to {}: {e}", self.orders));
            sent.push(s);
        }
        for _ in 0..n {
            worker_rejects(&ch, &self.orders).await;
        }
        sent
    }

    /// Ready messages of the source's queue: RabbitMQ counts a delivery the source holds
    /// unacked only once the source's connection is gone (then it is ready again).
    async fn pending_dead(&self) -> usize {
        let (_conn, ch) = self.rabbit().channel().await;
        queue_depth(&ch, &self.dlq).await as usize
    }
}

/// A message's header table as text.
fn headers_of(table: &FieldTable) -> BTreeMap<String, String> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), value_text(v)))
        .collect()
}
