//! Redis: a list target ([`LIST`]) and the dead list `relayer:dead` of envelopes as source.

use base64::Engine;
use kube::Client;
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::Redis;
use crate::fixtures::{LIST, create_queue, list_target};

/// The dead list the source drains (its `:processing` list and `:inflight` hash beside it).
pub const DEAD: &str = "relayer:dead";

/// A redis-server of this test's own (they start in milliseconds).
pub struct RedisBackend {
    pub redis: Redis,
}

impl Backend for RedisBackend {
    const NAME: &'static str = "redis";
    const CARRIES_KEY: bool = false;

    async fn start(_ns: &str, _broker: Broker) -> Self {
        RedisBackend {
            redis: Redis::start(),
        }
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        let extra = if with_source {
            json!({"source": {"redis": {"list": DEAD}}})
        } else {
            json!({})
        };
        create_queue(client, ns, &self.redis.url(), list_target(), extra).await;
    }

    fn described(&self) -> String {
        format!("redis list {LIST}")
    }

    /// A list element is the payload alone: a list target refuses jobs with headers.
    fn headers(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    async fn delivered(&self) -> Vec<Delivered> {
        list_delivered(&self.redis, LIST).await
    }

    fn stop(&mut self) {
        self.redis.stop();
    }

    async fn restart(&mut self) {
        self.redis.restart();
    }
}

/// What Redis list `list` holds, as deliveries: payloads alone (an element carries no
/// headers). Also the Sidekiq backend's, whose queues are Redis lists.
pub(super) async fn list_delivered(redis: &Redis, list: &str) -> Vec<Delivered> {
    redis
        .list(list)
        .await
        .into_iter()
        .map(|payload| Delivered {
            payload,
            headers: Default::default(),
        })
        .collect()
}

impl Source for RedisBackend {
    const FAILPOINT: &'static str = "redis-before-ack";

    /// Envelopes as a worker pushes them when it gives up (`payloadBase64`: any bytes).
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let sent: Vec<Sent> = payloads
            .into_iter()
            .enumerate()
            .map(|(i, payload)| Sent {
                job_id: format!("dead/{i}"),
                payload,
                headers: super::contract::header_map(&self.headers()),
            })
            .collect();
        let mut c = self.redis.conn().await;
        let mut pipe = redis::pipe();
        for s in &sent {
            let envelope = json!({
                "id": s.job_id,
                "payloadBase64": base64::engine::general_purpose::STANDARD.encode(&s.payload),
                "headers": s.headers,
                "reason": "retries exhausted",
                "deliveries": 5,
                "failureKind": "Transient",
            });
            pipe.cmd("RPUSH").arg(DEAD).arg(envelope.to_string());
        }
        let _: () = pipe
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("RPUSH onto {DEAD}: {e}"));
        sent
    }

    async fn pending_dead(&self) -> usize {
        self.redis.list(DEAD).await.len()
            + self.redis.list(&format!("{DEAD}:processing")).await.len()
            + self.redis.hash_len(&format!("{DEAD}:inflight")).await
    }
}
