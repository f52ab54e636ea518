//! NATS JetStream: stream `JOBS` (`jobs.>`) with a durable consumer `worker` that gives up
//! after [`MAX_DELIVER`] deliveries (the source reads its MAX_DELIVERIES advisories); the target
//! publishes to `jobs.orders`, the subject the workers' jobs are published to.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use kube::Client;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::Nats;
use crate::fixtures::create_dlq;
use crate::harness::eventually;

const STREAM: &str = "JOBS";
const SUBJECT: &str = "jobs.orders";
const WORKER: &str = "worker";
/// Deliveries before JetStream gives a message up.
pub const MAX_DELIVER: i64 = 2;

/// A nats-server of this test's own (it starts in well under a second).
pub struct NatsBackend {
    pub nats: Nats,
}

/// The operator's advisory capture stream of `JOBS`/`worker` (`source::nats::advisory_stream`).
fn capture_stream() -> String {
    let hash = hex::encode(&Sha256::digest(format!("{STREAM}/{WORKER}").as_bytes())[..4]);
    format!("DLQ_ADV_{STREAM}_{WORKER}_{hash}")
}

/// Every header as text (the last value of a repeated one).
fn headers_of(h: &HeaderMap) -> BTreeMap<String, String> {
    h.iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.last()?.as_str().to_string())))
        .collect()
}

impl NatsBackend {
    async fn stream(&self) -> jetstream::stream::Stream {
        self.nats
            .js()
            .await
            .get_stream(STREAM)
            .await
            .unwrap_or_else(|e| panic!("stream {STREAM}: {e}"))
    }

    /// Messages in stream `name` (0 while it does not exist).
    async fn messages_in(&self, name: &str) -> usize {
        match self.nats.js().await.get_stream(name).await {
            Ok(s) => s.get_info().await.map_or(0, |i| i.state.messages as usize),
            Err(_) => 0,
        }
    }

    /// Fails every delivery (a nak) until each of `seqs` was delivered [`MAX_DELIVER`] times
    /// and JetStream holds none of them for the worker any more: each gave rise to its advisory.
    async fn fail_until_given_up(&self, seqs: &[u64]) {
        let stream = self.stream().await;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer(WORKER)
            .await
            .unwrap_or_else(|e| panic!("consumer {WORKER}: {e}"));
        let mut deliveries: HashMap<u64, i64> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let info = consumer
                .get_info()
                .await
                .unwrap_or_else(|e| panic!("consumer {WORKER} info: {e}"));
            let all_given_up = seqs
                .iter()
                .all(|s| deliveries.get(s).is_some_and(|d| *d >= MAX_DELIVER));
            if all_given_up && info.num_pending == 0 && info.num_ack_pending == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "JetStream did not give up on every message within 60s: {deliveries:?}, {info:?}"
            );
            let Ok(mut batch) = consumer
                .fetch()
                .max_messages(100)
                .expires(Duration::from_millis(300))
                .messages()
                .await
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            while let Some(Ok(m)) = batch.next().await {
                if let Ok(i) = m.info() {
                    let seen = deliveries.entry(i.stream_sequence).or_default();
                    *seen = (*seen).max(i.delivered);
                }
                let _ = m.ack_with(AckKind::Nak(None)).await;
            }
        }
    }
}

impl Backend for NatsBackend {
    const NAME: &'static str = "nats";

    async fn start(_ns: &str, _broker: Broker) -> Self {
        let b = NatsBackend {
            nats: Nats::start(),
        };
        let js = b.nats.js().await;
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: STREAM.into(),
                subjects: vec!["jobs.>".into()],
                // Short: a parked job redriven with its Nats-Msg-Id is not a duplicate for long.
                duplicate_window: Duration::from_secs(1),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("creating stream {STREAM}: {e}"));
        stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(WORKER.into()),
                max_deliver: MAX_DELIVER,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("creating consumer {WORKER}: {e}"));
        b
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        let mut spec = json!({"target": {"nats": {"url": self.nats.url(), "subject": SUBJECT}}});
        if with_source {
            spec["source"] = json!({"nats": {"stream": STREAM, "consumer": WORKER}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!("nats jetstream subject {SUBJECT} (or the record's origin)")
    }

    async fn delivered(&self) -> Vec<Delivered> {
        let stream = self.stream().await;
        let state = stream
            .get_info()
            .await
            .unwrap_or_else(|e| panic!("stream {STREAM} info: {e}"))
            .state;
        let mut got = Vec::new();
        if state.messages == 0 {
            return got;
        }
        // Parked messages the source deleted leave gaps.
        for seq in state.first_sequence..=state.last_sequence {
            if let Ok(m) = stream.get_raw_message(seq).await {
                got.push(Delivered {
                    payload: m.payload.to_vec(),
                    headers: headers_of(&m.headers),
                });
            }
        }
        got
    }

    fn stop(&mut self) {
        self.nats.stop();
    }

    async fn restart(&mut self) {
        self.nats.restart();
    }
}

impl Source for NatsBackend {
    const FAILPOINT: &'static str = "nats-before-advisory-ack";

    /// Advisories before the operator's capture stream exists are lost.
    async fn wait_listening(&self) {
        let js = self.nats.js().await;
        let name = capture_stream();
        eventually(30, "the operator's advisory capture stream", || async {
            js.get_stream(&name).await.ok().map(|_| ())
        })
        .await;
    }

    /// Publishes each job with `Nats-Msg-Id` = its id, then fails it until JetStream gives up.
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let js = self.nats.js().await;
        let mut sent = Vec::new();
        let mut seqs = Vec::new();
        for (i, payload) in payloads.into_iter().enumerate() {
            let job_id = format!("dead-{i}");
            let mut headers = super::contract::header_map(&self.headers());
            headers.insert("Nats-Msg-Id".into(), job_id.clone());
            let mut h = HeaderMap::new();
            for (k, v) in &headers {
                h.insert(k.as_str(), v.as_str());
            }
            let ack = js
                .publish_with_headers(SUBJECT, h, payload.clone().into())
                .await
                .unwrap_or_else(|e| panic!("publishing to {SUBJECT}: {e}"))
                .await
                .unwrap_or_else(|e| panic!("PubAck from {SUBJECT}: {e}"));
            seqs.push(ack.sequence);
            sent.push(Sent {
                job_id,
                payload,
                headers,
            });
        }
        self.fail_until_given_up(&seqs).await;
        sent
    }

    /// Advisories captured and not yet acknowledged by the source.
    async fn pending_dead(&self) -> usize {
        self.messages_in(&capture_stream()).await
    }
}
