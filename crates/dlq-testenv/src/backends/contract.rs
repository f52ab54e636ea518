//! The contract every backend keeps ([`Backend`], and [`Source`] for those the operator also
//! collects from) and the values it deals in, apart from the facade that lists the backends.

use std::collections::BTreeMap;
use std::future::Future;

use kube::Client;

/// Whether a scenario may stop the broker: then the backend starts one of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broker {
    /// The binary's shared broker where there is one (isolated by names); never stopped.
    Shared,
    /// One for this test alone, which [`Backend::stop`] and [`Backend::restart`] may take down.
    Own,
}

/// What redrive put on the broker: the job's bytes and the headers it carries, as a consumer
/// of that broker reads them (the backend's own bookkeeping left out).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Delivered {
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

/// A dead message a failing worker left in the dead-letter place, as the broker holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sent {
    /// The job id its record must have (the broker's id for it where the message has none).
    pub job_id: String,
    pub payload: Vec<u8>,
    /// Every header the message carried (a redrive of its record must bring back exactly these).
    pub headers: BTreeMap<String, String>,
}

impl Sent {
    /// How the message must come back from a redrive.
    pub fn delivered(&self) -> Delivered {
        Delivered {
            payload: self.payload.clone(),
            headers: self.headers.clone(),
        }
    }
}

/// A redrive target's broker, started for one test in namespace `ns`.
pub trait Backend: Sized {
    /// How test names and failures name it.
    const NAME: &'static str;

    /// Starts the broker (see [`Broker`]) and whatever a worker of it would declare.
    fn start(ns: &str, broker: Broker) -> impl Future<Output = Self>;

    /// Creates DeadLetterQueue `relayer` in `ns` with this backend's target (and its source, when
    /// `with_source` and it has one), and the Secrets they name.
    fn create_queue(
        &self,
        client: &Client,
        ns: &str,
        with_source: bool,
    ) -> impl Future<Output = ()>;

    /// How the queue's status names the target (`status.target`: no credentials).
    fn described(&self) -> String;

    /// What the operator's environment needs to reach the broker (Pub/Sub's
    /// `PUBSUB_EMULATOR_HOST`); nothing for most.
    fn operator_env(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// The headers a job redriven here carries in the scenarios (none for a Redis list, which
    /// refuses them).
    fn headers(&self) -> Vec<(String, String)> {
        vec![
            ("x-trace".into(), "t-42".into()),
            ("x-tenant".into(), "acme".into()),
        ]
    }

    /// The bytes of job `i`: binary, unless the broker only takes text.
    fn payload(&self, i: usize) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0u8..=255).rev().collect();
        bytes.extend_from_slice(format!(" job {i}").as_bytes());
        bytes
    }

    /// The size of the body-store scenario's dead message: over what any record holds (256
    /// KiB), so a source whose message is the body keeps it from the broker's own buffer.
    const LARGE_BYTES: usize = 320 << 10;

    /// A job of `len` bytes for the body-store scenario (over a queue's threshold): bytes that
    /// are not UTF-8, unless the broker only takes text.
    fn large_payload(&self, len: usize) -> Vec<u8> {
        binary(len)
    }

    /// Whether a redrive here carries its idempotency key in a header (not on a Redis list,
    /// which carries no headers, nor on SQS, whose FIFO queues deduplicate by it instead).
    const CARRIES_KEY: bool = true;

    /// Everything redrive delivered to the target so far, in any order, as a consumer reads it
    /// (the idempotency key's header included).
    fn delivered(&self) -> impl Future<Output = Vec<Delivered>>;

    /// What redrive delivered, each as its producer made it (see [`split_key`]), with the
    /// idempotency key the redrive added beside it.
    fn keyed(&self) -> impl Future<Output = Vec<(Delivered, Option<String>)>> {
        async { self.delivered().await.into_iter().map(split_key).collect() }
    }

    /// What redrive delivered, each as its producer made it: the untouched jobs.
    fn jobs(&self) -> impl Future<Output = Vec<Delivered>> {
        async { self.keyed().await.into_iter().map(|(d, _)| d).collect() }
    }

    /// Takes the broker down hard, like a crash (only a [`Broker::Own`] one).
    fn stop(&mut self);

    /// Brings it back, with whatever its workers declare when they reconnect.
    fn restart(&mut self) -> impl Future<Output = ()>;
}

/// A backend the operator also collects dead messages from.
pub trait Source: Backend {
    /// The failpoint between a parked message and its acknowledgement to the broker.
    const FAILPOINT: &'static str;

    /// Waits until the operator's source listens (where messages dead before would be missed).
    fn wait_listening(&self) -> impl Future<Output = ()> {
        async {}
    }

    /// Makes `n` messages dead as a failing worker would (job `i` with [`Backend::payload`] and
    /// [`Backend::headers`]); returns them as the dead-letter place holds them.
    fn put_dead(&self, n: usize) -> impl Future<Output = Vec<Sent>> {
        async move {
            let payloads = (0..n).map(|i| self.payload(i)).collect();
            self.put_dead_payloads(payloads).await
        }
    }

    /// Makes a message dead per payload (job `i` with `payloads[i]` and [`Backend::headers`]),
    /// as [`Source::put_dead`] does.
    fn put_dead_payloads(&self, payloads: Vec<Vec<u8>>) -> impl Future<Output = Vec<Sent>>;

    /// Dead messages the source has not acknowledged yet (parked or not).
    fn pending_dead(&self) -> impl Future<Output = usize>;

    /// Whether a message set aside (one that can never be a record) stays where
    /// [`Source::pending_dead`] counts it: SQS keeps it hidden in its queue; the others move
    /// it to a rejected list, queue or topic, or (NATS) leave it in the stream and acknowledge
    /// its advisory.
    const KEEPS_REJECTED: bool = false;

    /// Whether the broker says how many dead messages it holds (`status.backlog.messages`);
    /// Pub/Sub does not.
    const BACKLOG_KNOWN: bool = true;
}

/// The header a redrive's idempotency key arrives in (a queue's default).
pub const KEY_HEADER: &str = dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER;

/// A delivery split into the job as its producer made it and the idempotency key the redrive
/// added beside it: the [`KEY_HEADER`], and a JetStream `Nats-Msg-Id` that repeats it.
pub fn split_key(mut d: Delivered) -> (Delivered, Option<String>) {
    let key = d.headers.remove(KEY_HEADER);
    if key.is_some() && d.headers.get("Nats-Msg-Id") == key.as_ref() {
        d.headers.remove("Nats-Msg-Id");
    }
    (d, key)
}

/// `len` bytes that are not UTF-8 (every byte has its high bit set, and a run of them is no
/// valid sequence), so every broker and record carries them as binary.
pub fn binary(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // 0xf8..=0xff never occur in UTF-8.
            0xf8 | (x >> 29) as u8
        })
        .collect()
}

/// `headers` as owned pairs, for the builders of [`Sent`] and the record fixtures.
pub fn header_map(headers: &[(String, String)]) -> BTreeMap<String, String> {
    headers.iter().cloned().collect()
}
