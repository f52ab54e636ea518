//! Google Cloud Pub/Sub against pstest (Google's test server), one per test: topic `jobs`
//! with the worker's subscription `jobs` (the target's topic, read by [`Backend::delivered`])
//! whose dead-letter policy moves a message to topic `dead` after 5 delivery attempts, and the
//! operator's subscription `dead` (the source). The operator reaches the server through
//! `PUBSUB_EMULATOR_HOST` ([`Backend::operator_env`]).

use std::sync::Mutex;

use kube::Client;
use serde_json::json;

use super::contract::{Backend, Broker, Delivered, Sent, Source};
use crate::brokers::Pstest;
use crate::brokers::pstest::{PROJECT, PsMessage, topic};
use crate::fixtures::create_dlq;

/// Delivery attempts before pstest dead-letters a message.
pub const MAX_DELIVERY_ATTEMPTS: i32 = 5;

pub struct PubsubBackend {
    ps: Pstest,
    /// What was pulled from `jobs` so far (a read acknowledges it).
    taken: Mutex<Vec<Delivered>>,
}

impl PubsubBackend {
    /// The topics and subscriptions (again after a restart: pstest keeps them in memory).
    fn declare(ps: &Pstest) {
        ps.create_topic("dead");
        ps.create_subscription("dead", "dead", None, false);
        ps.create_topic("jobs");
        ps.create_subscription("jobs", "jobs", Some(("dead", MAX_DELIVERY_ATTEMPTS)), false);
    }

    pub fn pstest(&self) -> &Pstest {
        &self.ps
    }
}

impl Backend for PubsubBackend {
    const NAME: &'static str = "pubsub";

    /// Always a server of its own: pstest starts in well under a second.
    async fn start(_ns: &str, _broker: Broker) -> Self {
        let b = PubsubBackend {
            ps: Pstest::start(),
            taken: Mutex::default(),
        };
        Self::declare(&b.ps);
        b
    }

    async fn create_queue(&self, client: &Client, ns: &str, with_source: bool) {
        let mut spec = json!({"target": {"pubsub": {"project": PROJECT, "topic": "jobs"}}});
        if with_source {
            spec["source"] = json!({"pubsub": {"project": PROJECT, "subscription": "dead"}});
        }
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!("pubsub topic {} (or the record's origin)", topic("jobs"))
    }

    fn operator_env(&self) -> Vec<(String, String)> {
        vec![("PUBSUB_EMULATOR_HOST".into(), self.ps.emulator_host())]
    }

    async fn delivered(&self) -> Vec<Delivered> {
        let fresh = self.ps.drain("jobs").into_iter().map(|p| Delivered {
            payload: p.message.data,
            headers: p.message.attributes,
        });
        let mut taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        taken.extend(fresh);
        taken.clone()
    }

    fn stop(&mut self) {
        self.ps.stop();
    }

    /// pstest comes back empty: the topics and subscriptions are declared again, before the
    /// operator can reach it (a job published to `jobs` before its subscription exists would
    /// reach no one: once in a CI run).
    async fn restart(&mut self) {
        self.ps.restart_declared(Self::declare);
    }
}

impl Source for PubsubBackend {
    /// A message that can never be a record stays unacknowledged in the subscription.
    const KEEPS_REJECTED: bool = true;

    /// Pub/Sub's backlog is in Cloud Monitoring, not its API (nor the emulator's).
    const BACKLOG_KNOWN: bool = false;

    const FAILPOINT: &'static str = "pubsub-before-ack";

    /// Publishes each job with its headers as attributes, then nacks every delivery on `jobs`
    /// until the dead-letter policy has moved everything to `dead`.
    async fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> Vec<Sent> {
        let msgs: Vec<PsMessage> = payloads
            .into_iter()
            .map(|data| PsMessage {
                data,
                attributes: super::contract::header_map(&self.headers()),
                ordering_key: String::new(),
            })
            .collect();
        let ids = self.ps.publish("jobs", &msgs);
        self.ps.nack_until_dead("jobs", 60);
        ids.into_iter()
            .zip(msgs)
            .map(|(id, m)| Sent {
                job_id: id,
                payload: m.data,
                headers: m.attributes,
            })
            .collect()
    }

    async fn pending_dead(&self) -> usize {
        self.ps.pending("dead")
    }
}
