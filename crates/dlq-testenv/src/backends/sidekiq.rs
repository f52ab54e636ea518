//! Sidekiq: the target pushes a job's JSON onto `queue:default`, and the source drains the
//! `dead` sorted set, both on a redis-server of the test's own.
//!
//! The dead jobs are made by a real Sidekiq running `tests/fixtures/sidekiq/worker.rb`, on a
//! redis-server of their own: the test must know each job's exact bytes as Sidekiq wrote them,
//! which the operator's source would take from a shared dead set before the test could read
//! them. They are then moved, bytes and scores unchanged, into the backend's dead set.

use kube::Client;
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::{Redis, Sidekiq};
use crate::fixtures::{create_dlq, create_secret};

/// Sidekiq's dead set, which the source drains.
pub const DEAD: &str = "dead";

/// The queue every job of the scenarios belongs to, and so where a redrive pushes it.
pub const QUEUE: &str = "queue:default";

/// A redis-server of this test's own (they start in milliseconds), for the target and source.
pub struct SidekiqBackend {
    pub redis: Redis,
    /// The namespace, which names the source's inflight hash.
    ns: String,
}

impl SidekiqBackend {
    /// The source's inflight hash: jobs taken from the dead set and not acknowledged yet.
    fn inflight(&self) -> String {
        format!("dlq:{}/relayer:inflight", self.ns)
    }

    /// `n` dead jobs as a real Sidekiq leaves them in its dead set (member, score), made on a
    /// redis-server of their own and read once all `n` died.
    async fn die_elsewhere(n: usize) -> Vec<(Vec<u8>, f64)> {
        let redis = Redis::start();
        let sidekiq = Sidekiq::start(&redis.url(), 4).await;
        let jids = Sidekiq::enqueue(&redis.url(), n, "pi");
        assert_eq!(jids.len(), n, "enqueue.rb returned {} jids", jids.len());
        let mut c = redis.conn().await;
        crate::harness::eventually(60, &format!("{n} jobs in Sidekiq's dead set"), || {
            let mut c = c.clone();
            async move {
                let dead: usize = redis::cmd("ZCARD")
                    .arg(DEAD)
                    .query_async(&mut c)
                    .await
                    .ok()?;
                (dead >= n).then_some(())
            }
        })
        .await;
        drop(sidekiq);
        let members: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(DEAD)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("ZRANGE {DEAD}: {e}"));
        members
    }
}

impl Backend for SidekiqBackend {
    const NAME: &'static str = "sidekiq";
    /// The key is a marker beside the queue; a Sidekiq job carries nothing but its JSON.
    const CARRIES_KEY: bool = false;

    async fn start(ns: &str, _broker: Broker) -> Self {
        SidekiqBackend {
            redis: Redis::start(),
            ns: ns.to_string(),
        }
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        create_secret(client, ns, "redis", "url", &self.redis.url()).await;
        let mut spec =
            json!({"target": {"sidekiq": {"urlSecretRef": {"name": "redis", "key": "url"}}}});
        if with_source {
            spec["source"] = json!({"sidekiq": {}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        "sidekiq queue:<the job's queue>".into()
    }

    /// A Sidekiq job is its JSON alone: the target refuses jobs with headers.
    fn headers(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// A job of queue `default` as Sidekiq writes it into its dead set (the target reads the
    /// queue from it), with a jid of its own.
    fn payload(&self, i: usize) -> Vec<u8> {
        json!({
            "retry": 0, "queue": "default", "class": "SettleJob", "args": [format!("pi-{i}")],
            "jid": format!("{i:024x}"), "error_class": "GatewayError",
            "error_message": format!("gateway said no to pi-{i}"), "failed_at": 1.5,
            "retry_count": 0,
        })
        .to_string()
        .into_bytes()
    }

    /// A job as [`Backend::payload`] makes them, whose argument is `len` bytes of text (a
    /// Sidekiq job is JSON).
    fn large_payload(&self, len: usize) -> Vec<u8> {
        let arg: String = (0..len)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        json!({
            "retry": 0, "queue": "default", "class": "SettleJob", "args": [arg],
            "jid": "large0000000000000000000", "error_class": "GatewayError",
            "error_message": "gateway said no", "failed_at": 1.5, "retry_count": 0,
        })
        .to_string()
        .into_bytes()
    }

    async fn delivered(&self) -> Vec<Delivered> {
        super::redis::list_delivered(&self.redis, QUEUE).await
    }

    fn stop(&mut self) {
        self.redis.stop();
    }

    async fn restart(&mut self) {
        self.redis.restart();
    }
}

impl Source for SidekiqBackend {
    const FAILPOINT: &'static str = "sidekiq-before-ack";

    /// Jobs a real Sidekiq let die (`SettleJob` fails while `test:flag` is unset), their
    /// members and scores moved as they are into this backend's dead set.
    async fn put_dead(&self, n: usize) -> Vec<Sent> {
        let members = Self::die_elsewhere(n).await;
        let sent: Vec<Sent> = members
            .iter()
            .map(|(member, _)| {
                let job: serde_json::Value = serde_json::from_slice(member)
                    .unwrap_or_else(|e| panic!("a dead job that is not JSON: {e}"));
                Sent {
                    job_id: job["jid"].as_str().unwrap_or_default().to_string(),
                    payload: member.clone(),
                    headers: Default::default(),
                }
            })
            .collect();
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(DEAD);
        for (member, score) in &members {
            zadd.arg(*score).arg(&member[..]);
        }
        let mut c = self.redis.conn().await;
        let _: () = zadd
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("ZADD onto {DEAD}: {e}"));
        sent
    }

    /// Each payload (a job's JSON, see [`Backend::payload`]) added to the dead set as Sidekiq
    /// adds a job it gives up on (`ZADD dead <now> <json>`).
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut c = self.redis.conn().await;
        let mut sent = Vec::new();
        for payload in payloads {
            let job: serde_json::Value = serde_json::from_slice(&payload)
                .unwrap_or_else(|e| panic!("a Sidekiq job that is not JSON: {e}"));
            let _: () = redis::cmd("ZADD")
                .arg(DEAD)
                .arg(now)
                .arg(&payload[..])
                .query_async(&mut c)
                .await
                .unwrap_or_else(|e| panic!("ZADD onto {DEAD}: {e}"));
            sent.push(Sent {
                job_id: job["jid"].as_str().unwrap_or_default().to_string(),
                payload,
                headers: Default::default(),
            });
        }
        sent
    }

    async fn pending_dead(&self) -> usize {
        let mut c = self.redis.conn().await;
        let dead: usize = redis::cmd("ZCARD")
            .arg(DEAD)
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("ZCARD {DEAD}: {e}"));
        dead + self.redis.hash_len(&self.inflight()).await
    }
}
