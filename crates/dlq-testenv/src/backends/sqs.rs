//! Amazon SQS against ElasticMQ: queue `<ns>-jobs` (the target, and the origin a dead message
//! names) whose RedrivePolicy moves a message to `<ns>-jobs-dlq` (the source) after one receive.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client as Sqs;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::elasticmq::REGION;
use crate::brokers::{ElasticMq, shared_elasticmq};
use crate::fixtures::create_dlq;

/// The access key pair the tests sign with (ElasticMQ checks none).
pub const ACCESS_KEY_ID: &str = "test-key";
pub const SECRET_ACCESS_KEY: &str = "test-secret";

/// An ElasticMQ server: the binary's shared one, or this test's own.
enum Node {
    Shared(&'static ElasticMq),
    Own(ElasticMq),
}

pub struct SqsBackend {
    node: Node,
    jobs: String,
    dead: String,
    /// What was received from `jobs` so far (a read deletes it).
    taken: Mutex<Vec<Delivered>>,
}

/// A client of `mq`, as the operator's (`broker::sqs::SqsConn::client`) but with the test keys.
pub async fn client(mq: &ElasticMq) -> Sqs {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .operation_timeout(Duration::from_secs(30))
        .build();
    let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
        .timeout_config(timeouts)
        .region(aws_config::Region::new(REGION))
        .credentials_provider(aws_credential_types::Credentials::new(
            ACCESS_KEY_ID,
            SECRET_ACCESS_KEY,
            None,
            None,
            "dlq-testenv",
        ))
        .load()
        .await;
    let conf = aws_sdk_sqs::config::Builder::from(&shared).endpoint_url(mq.endpoint());
    Sqs::from_conf(conf.build())
}

/// Messages of `url` visible plus in flight.
pub async fn depth(sqs: &Sqs, url: &str) -> usize {
    let a = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap_or_else(|e| panic!("attributes of {url}: {e:?}"));
    let get = |k: QueueAttributeName| -> usize {
        a.attributes()
            .and_then(|m| m.get(&k))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    get(QueueAttributeName::ApproximateNumberOfMessages)
        + get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
}

fn text(s: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(s)
        .build()
        .unwrap_or_else(|e| panic!("a message attribute: {e}"))
}

impl SqsBackend {
    fn mq(&self) -> &ElasticMq {
        match &self.node {
            Node::Shared(m) => m,
            Node::Own(m) => m,
        }
    }

    /// Creates both queues (again: ElasticMQ keeps them in memory).
    async fn create_queues(&self) {
        let sqs = client(self.mq()).await;
        sqs.create_queue()
            .queue_name(&self.dead)
            .send()
            .await
            .unwrap_or_else(|e| panic!("creating queue {}: {e:?}", self.dead));
        let policy =
            json!({"deadLetterTargetArn": self.mq().queue_arn(&self.dead), "maxReceiveCount": 1});
        sqs.create_queue()
            .queue_name(&self.jobs)
            .attributes(QueueAttributeName::RedrivePolicy, policy.to_string())
            .send()
            .await
            .unwrap_or_else(|e| panic!("creating queue {}: {e:?}", self.jobs));
    }
}

impl Backend for SqsBackend {
    const NAME: &'static str = "sqs";
    const CARRIES_KEY: bool = false;
    /// ElasticMQ takes at most 256 KiB a message.
    const LARGE_BYTES: usize = 200 << 10;

    async fn start(ns: &str, broker: Broker) -> Self {
        let node = match broker {
            Broker::Shared => Node::Shared(shared_elasticmq()),
            Broker::Own => Node::Own(ElasticMq::start()),
        };
        let b = SqsBackend {
            node,
            jobs: format!("{ns}-jobs"),
            dead: format!("{ns}-jobs-dlq"),
            taken: Mutex::default(),
        };
        b.create_queues().await;
        b
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "aws"},
            "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY}
        }))
        .unwrap_or_else(|e| panic!("a Secret: {e}"));
        Api::<Secret>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &secret)
            .await
            .unwrap_or_else(|e| panic!("creating Secret aws: {e}"));
        let mq = self.mq();
        let mut spec = json!({"target": {"sqs": {
            "region": REGION,
            "endpoint": mq.endpoint(),
            "credentialsSecretRef": {"name": "aws"},
            "queueUrl": mq.queue_url(&self.jobs),
        }}});
        if with_source {
            spec["source"] = json!({"sqs": {"queueUrl": mq.queue_url(&self.dead)}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!(
            "sqs queue {} (or the record's origin)",
            self.mq().queue_url(&self.jobs)
        )
    }

    /// SQS bodies are text (XML characters only).
    fn payload(&self, i: usize) -> Vec<u8> {
        format!("{{\"job\":{i},\"note\":\"é ✓\"}}").into_bytes()
    }

    /// Text (SQS bodies are XML characters), two bytes of UTF-8 in every few.
    fn large_payload(&self, len: usize) -> Vec<u8> {
        let mut text = String::with_capacity(len + 8);
        let mut i = 0usize;
        while text.len() < len {
            text.push(if i.is_multiple_of(7) {
                'é'
            } else {
                char::from(b'a' + (i % 26) as u8)
            });
            i += 1;
        }
        text.into_bytes()
    }

    async fn delivered(&self) -> Vec<Delivered> {
        let sqs = client(self.mq()).await;
        let url = self.mq().queue_url(&self.jobs);
        let mut fresh = Vec::new();
        loop {
            let out = sqs
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .send()
                .await
                .unwrap_or_else(|e| panic!("receiving from {url}: {e:?}"));
            let batch = out.messages.unwrap_or_default();
            if batch.is_empty() {
                break;
            }
            for m in batch {
                if let Some(h) = m.receipt_handle() {
                    sqs.delete_message()
                        .queue_url(&url)
                        .receipt_handle(h)
                        .send()
                        .await
                        .unwrap_or_else(|e| panic!("deleting from {url}: {e:?}"));
                }
                let headers: BTreeMap<String, String> = m
                    .message_attributes()
                    .map(|a| {
                        a.iter()
                            .map(|(k, v)| (k.clone(), v.string_value().unwrap_or_default().into()))
                            .collect()
                    })
                    .unwrap_or_default();
                fresh.push(Delivered {
                    payload: m.body().unwrap_or_default().as_bytes().to_vec(),
                    headers,
                });
            }
        }
        let mut taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        taken.extend(fresh);
        taken.clone()
    }

    fn stop(&mut self) {
        match &self.node {
            Node::Own(m) => m.stop(),
            Node::Shared(_) => panic!("the shared ElasticMQ is never stopped"),
        }
    }

    /// ElasticMQ comes back empty: the queues are created again, as a consumer's start-up would.
    async fn restart(&mut self) {
        self.mq().restart();
        self.create_queues().await;
    }
}

impl Source for SqsBackend {
    const KEEPS_REJECTED: bool = true;

    const FAILPOINT: &'static str = "sqs-before-delete";

    /// Sends each job with its headers as String attributes, then receives everything without
    /// deleting it until the RedrivePolicy has moved it to the dead-letter queue.
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let sqs = client(self.mq()).await;
        let url = self.mq().queue_url(&self.jobs);
        let mut sent = Vec::new();
        for payload in payloads {
            let headers = super::contract::header_map(&self.headers());
            let mut req = sqs
                .send_message()
                .queue_url(&url)
                .message_body(String::from_utf8_lossy(&payload));
            for (k, v) in &headers {
                req = req.message_attributes(k, text(v));
            }
            let out = req
                .send()
                .await
                .unwrap_or_else(|e| panic!("sending to {url}: {e:?}"));
            sent.push(Sent {
                job_id: out.message_id().unwrap_or_default().to_string(),
                payload,
                headers,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while depth(&sqs, &url).await > 0 {
            assert!(Instant::now() < deadline, "messages never left {url}");
            sqs.receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                // Not 0 in a tight loop: ElasticMQ then sometimes never moves a message.
                .visibility_timeout(1)
                .wait_time_seconds(1)
                .send()
                .await
                .unwrap_or_else(|e| panic!("receiving from {url}: {e:?}"));
        }
        sent
    }

    async fn pending_dead(&self) -> usize {
        let sqs = client(self.mq()).await;
        depth(&sqs, &self.mq().queue_url(&self.dead)).await
    }
}
