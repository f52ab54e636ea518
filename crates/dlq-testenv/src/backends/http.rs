//! An HTTP endpoint (target only): a job is the body of a POST, its headers the request's.

use kube::Client;
use serde_json::json;

use super::contract::{Backend, Broker, Delivered};
use crate::brokers::HttpSink;
use crate::fixtures::create_dlq;

/// A plain-HTTP sink of this test's own.
pub struct HttpBackend {
    pub sink: HttpSink,
}

impl Backend for HttpBackend {
    const NAME: &'static str = "http";

    async fn start(_ns: &str, _broker: Broker) -> Self {
        HttpBackend {
            sink: HttpSink::start(None),
        }
    }

    async fn create_queue(&self, client: &Client, ns: &str, _with_source: bool) {
        let spec = json!({"target": {"http": {"url": self.sink.url("/jobs")}}});
        create_dlq(client, ns, "relayer", spec).await;
    }

    fn described(&self) -> String {
        format!("http POST {}", self.sink.url("/jobs"))
    }

    /// The job's headers are the request's `x-` headers (the rest is HTTP's own).
    async fn delivered(&self) -> Vec<Delivered> {
        self.sink
            .posts()
            .into_iter()
            .map(|p| Delivered {
                // The job's headers (x-*) and the idempotency key (HTTP names are any case).
                headers: p
                    .headers
                    .iter()
                    .filter_map(|(k, v)| match k {
                        k if k.eq_ignore_ascii_case(super::contract::KEY_HEADER) => {
                            Some((super::contract::KEY_HEADER.to_string(), v.clone()))
                        }
                        k if k.starts_with("x-") => Some((k.clone(), v.clone())),
                        _ => None,
                    })
                    .collect(),
                payload: p.body,
            })
            .collect()
    }

    fn stop(&mut self) {
        self.sink.stop();
    }

    async fn restart(&mut self) {
        self.sink.restart();
    }
}
