//! Google's Pub/Sub test server (`cloud.google.com/go/pubsub/v2/pstest`, the gRPC API with
//! dead-letter policies), run by `tools/pstest-server` (`tools/build.sh pstest-server`) on two
//! free loopback ports: gRPC for the operator (`PUBSUB_EMULATOR_HOST`) and a JSON admin shim for
//! the tests (topics, subscriptions, publish, pull, ack, nack, pending). Everything is in
//! memory: a restart starts empty. Killed on drop.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

/// The project the tests' topics and subscriptions live in.
pub const PROJECT: &str = "dlq-test";

/// A pstest server of one test.
pub struct Pstest {
    pub grpc_port: u16,
    pub admin_port: u16,
    dir: PathBuf,
    bin: PathBuf,
    child: Mutex<Option<Child>>,
}

/// A message as the admin shim publishes and pulls it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PsMessage {
    pub data: Vec<u8>,
    pub attributes: BTreeMap<String, String>,
    pub ordering_key: String,
}

/// A pulled message: the message, its id, ack id and delivery attempt (0: no dead-letter
/// policy on the subscription).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pulled {
    pub message: PsMessage,
    pub message_id: String,
    pub ack_id: String,
    pub delivery_attempt: i64,
}

/// `projects/<PROJECT>/topics/<name>`.
pub fn topic(name: &str) -> String {
    format!("projects/{PROJECT}/topics/{name}")
}

/// `projects/<PROJECT>/subscriptions/<name>`.
pub fn subscription(name: &str) -> String {
    format!("projects/{PROJECT}/subscriptions/{name}")
}

impl Pstest {
    /// Builds (once, cached) and starts the server.
    pub fn start() -> Pstest {
        let dirs = crate::plane::tool_dirs(&["pstest-server"])
            .unwrap_or_else(|e| panic!("building pstest-server: {e}"));
        let bin = crate::plane::find_binary(&dirs, "pstest-server")
            .unwrap_or_else(|e| panic!("{e} (tools/build.sh pstest-server)"));
        let grpc_port = super::child::port();
        let mut admin_port = super::child::port();
        while admin_port == grpc_port {
            admin_port = super::child::port();
        }
        let p = Pstest {
            grpc_port,
            admin_port,
            dir: super::child::temp_dir("pstest", grpc_port),
            bin,
            child: Mutex::new(None),
        };
        p.restart();
        p
    }

    /// Starts (again) on the same ports, with no topics.
    pub fn restart(&self) {
        self.restart_declared(|_| {});
    }

    /// Starts (again) on the same ports and runs `declare` (topics, subscriptions) before the
    /// gRPC port opens: the operator cannot publish to a topic whose subscription is not there
    /// yet (such a message reaches no one).
    pub fn restart_declared(&self, declare: impl FnOnce(&Pstest)) {
        let mut slot = self.child.lock().unwrap_or_else(|p| p.into_inner());
        assert!(slot.is_none(), "pstest already running");
        let log = self.dir.join("pstest.log");
        let mut cmd = Command::new(&self.bin);
        cmd.arg("-grpc-port")
            .arg(self.grpc_port.to_string())
            .arg("-admin-port")
            .arg(self.admin_port.to_string())
            .arg("-closed");
        let child = crate::plane::spawn_guarded(&mut cmd, &log)
            .unwrap_or_else(|e| panic!("starting pstest-server: {e}"));
        *slot = Some(child);
        drop(slot);
        super::child::wait_listening(self.admin_port, 30, "pstest (admin)", &log);
        declare(self);
        self.call("POST", "/open", None);
        super::child::wait_listening(self.grpc_port, 30, "pstest (gRPC)", &log);
    }

    /// Kills it hard, like a crashed server.
    pub fn stop(&self) {
        super::child::stop_child(&mut self.child.lock().unwrap_or_else(|p| p.into_inner()));
        super::child::wait_closed(self.grpc_port, 10);
    }

    /// `127.0.0.1:<grpc port>`: the operator's `PUBSUB_EMULATOR_HOST`.
    pub fn emulator_host(&self) -> String {
        format!("127.0.0.1:{}", self.grpc_port)
    }

    /// `http://127.0.0.1:<admin port>`.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// One call to the admin shim; panics on anything but 200.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = TcpStream::connect(("127.0.0.1", self.admin_port))
            .unwrap_or_else(|e| panic!("connecting to the pstest admin shim: {e}"));
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        write!(
            s,
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap_or_else(|e| panic!("writing to the pstest admin shim: {e}"));
        let mut out = String::new();
        s.read_to_string(&mut out)
            .unwrap_or_else(|e| panic!("reading from the pstest admin shim: {e}"));
        let (head, answer) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        assert!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "pstest {method} {path}: {head}\n{answer}"
        );
        serde_json::from_str(answer).unwrap_or(Value::Null)
    }

    pub fn create_topic(&self, name: &str) {
        self.call("POST", "/topics", Some(json!({"name": topic(name)})));
    }

    /// A subscription of `topic_name`; with `dead_letter`, a dead-letter policy sending a
    /// message to that topic after `max_attempts` deliveries.
    pub fn create_subscription(
        &self,
        name: &str,
        topic_name: &str,
        dead_letter: Option<(&str, i32)>,
        ordered: bool,
    ) {
        let mut body = json!({
            "name": subscription(name), "topic": topic(topic_name),
            "ackDeadlineSeconds": 10, "enableMessageOrdering": ordered,
        });
        if let Some((dl, max)) = dead_letter {
            body["deadLetterTopic"] = json!(topic(dl));
            body["maxDeliveryAttempts"] = json!(max);
        }
        self.call("POST", "/subscriptions", Some(body));
    }

    /// Publishes `messages` to `topic_name`; returns their message ids.
    pub fn publish(&self, topic_name: &str, messages: &[PsMessage]) -> Vec<String> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                json!({"data": b64.encode(&m.data), "attributes": m.attributes,
                       "orderingKey": m.ordering_key})
            })
            .collect();
        let out = self.call(
            "POST",
            "/publish",
            Some(json!({"topic": topic(topic_name), "messages": msgs})),
        );
        serde_json::from_value(out["messageIds"].clone()).unwrap_or_default()
    }

    /// Pulls up to `max` messages of subscription `name` (nothing waits: an empty answer is
    /// possible while messages are outstanding elsewhere).
    pub fn pull(&self, name: &str, max: usize) -> Vec<Pulled> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let out = self.call(
            "POST",
            "/pull",
            Some(json!({"subscription": subscription(name), "max": max})),
        );
        let msgs = out["messages"].as_array().cloned().unwrap_or_default();
        msgs.into_iter()
            .map(|m| Pulled {
                message: PsMessage {
                    data: b64
                        .decode(m["data"].as_str().unwrap_or_default())
                        .unwrap_or_else(|e| panic!("pstest data is not base64: {e}")),
                    attributes: serde_json::from_value(m["attributes"].clone()).unwrap_or_default(),
                    ordering_key: m["orderingKey"].as_str().unwrap_or_default().into(),
                },
                message_id: m["messageId"].as_str().unwrap_or_default().into(),
                ack_id: m["ackId"].as_str().unwrap_or_default().into(),
                delivery_attempt: m["deliveryAttempt"].as_i64().unwrap_or(0),
            })
            .collect()
    }

    pub fn ack(&self, name: &str, ack_ids: &[String]) {
        if !ack_ids.is_empty() {
            let body = json!({"subscription": subscription(name), "ackIds": ack_ids});
            self.call("POST", "/ack", Some(body));
        }
    }

    /// Nacks (ack deadline 0): redelivered at once, one more delivery attempt.
    pub fn nack(&self, name: &str, ack_ids: &[String]) {
        if !ack_ids.is_empty() {
            let body = json!({"subscription": subscription(name), "ackIds": ack_ids});
            self.call("POST", "/nack", Some(body));
        }
    }

    /// Unacknowledged messages of subscription `name`, outstanding or not.
    pub fn pending(&self, name: &str) -> usize {
        let out = self.call(
            "GET",
            &format!("/pstest/pending?subscription={}", subscription(name)),
            None,
        );
        out["pending"].as_u64().unwrap_or(0) as usize
    }

    /// A worker that fails everything: pulls and nacks subscription `name` until it holds
    /// nothing (the dead-letter policy moved every message away) or `secs` pass.
    pub fn nack_until_dead(&self, name: &str, secs: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        while self.pending(name) > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "messages never left subscription {name}"
            );
            let ids: Vec<String> = self
                .pull(name, 1000)
                .into_iter()
                .map(|p| p.ack_id)
                .collect();
            if ids.is_empty() {
                std::thread::sleep(Duration::from_millis(20));
            }
            self.nack(name, &ids);
        }
    }

    /// Pulls and acks everything subscription `name` holds now (a consumer reading it).
    pub fn drain(&self, name: &str) -> Vec<Pulled> {
        let mut all = Vec::new();
        loop {
            let batch = self.pull(name, 1000);
            if batch.is_empty() {
                return all;
            }
            let ids: Vec<String> = batch.iter().map(|p| p.ack_id.clone()).collect();
            self.ack(name, &ids);
            all.extend(batch);
        }
    }
}

impl Drop for Pstest {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
