//! The broker-down scenario every redrive backend must pass: the target goes away, decided
//! records stay Parked with Requeued=False, and once it is back every job arrives exactly once.

use std::future::Future;

use dlq_core::api::{Action, DeadLetter, Phase};
use kube::Client;
use kube::api::{Api, PostParams};

use crate::brokers::{HttpSink, Redis};
use crate::{LIST, condition, decide, events_for, eventually, record, wait_phase, wait_ready};

/// A redrive target's broker that a test can take down and bring back.
pub trait Outage {
    /// How messages name it ("redis", "RabbitMQ", …).
    fn name(&self) -> &str;
    /// Takes it down hard, like a crash.
    fn stop(&mut self);
    /// Brings it back (and re-creates whatever a consumer would declare on reconnecting).
    fn restart(&mut self) -> impl Future<Output = ()>;
    /// The payload of every job it holds at the target's address, in any order.
    fn delivered(&mut self) -> impl Future<Output = Vec<Vec<u8>>>;
}

/// redis-server, read at [`LIST`] (the list of [`list_target`](crate::list_target)).
impl Outage for Redis {
    fn name(&self) -> &str {
        "redis"
    }

    fn stop(&mut self) {
        Redis::stop(self);
    }

    async fn restart(&mut self) {
        Redis::restart(self);
    }

    async fn delivered(&mut self) -> Vec<Vec<u8>> {
        self.list(LIST).await
    }
}

/// The HTTP sink: a job is the body of a POST.
impl Outage for HttpSink {
    fn name(&self) -> &str {
        "the endpoint"
    }

    fn stop(&mut self) {
        HttpSink::stop(self);
    }

    async fn restart(&mut self) {
        HttpSink::restart(self);
    }

    async fn delivered(&mut self) -> Vec<Vec<u8>> {
        self.posts().into_iter().map(|p| p.body).collect()
    }
}

/// The payload of record `down-<i>`.
fn payload(i: usize) -> Vec<u8> {
    format!("job {i}").into_bytes()
}

/// With DeadLetterQueue `relayer` in `ns` redriving to `broker` and an operator watching `ns`:
/// parks `n` records `down-<i>` (payload `job <i>`, with `headers`), takes the broker down,
/// decides them all, and asserts that
///
/// - the queue's Ready condition follows the broker (False, BrokerUnreachable);
/// - every record stays Parked with Requeued=False (BrokerUnreachable), with a RequeueFailed
///   Event;
/// - once the broker is back every record becomes Redriven (Requeued=True), the queue Ready
///   again, and the broker holds each job exactly once.
pub async fn assert_requeue_failing_then_recovers(
    client: &Client,
    ns: &str,
    broker: &mut impl Outage,
    headers: &[(&str, &str)],
    n: usize,
) {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    park_records(&api, headers, n).await;
    wait_ready(client, ns, "relayer", true, 30).await;

    broker.stop();
    // Ready follows the broker (the queue resyncs every 30s); checked before any decision,
    // since failing redrives rewrite their records' status continuously.
    let why = wait_ready(client, ns, "relayer", false, 90).await;
    assert!(why.starts_with("BrokerUnreachable"), "{why}");
    for i in 0..n {
        decide(&api, &format!("down-{i}"), Action::Redrive, "ops").await;
    }
    assert_requeue_failing(&api, broker.name(), n).await;
    assert!(
        !events_for(client, ns, "down-0", "RequeueFailed")
            .await
            .is_empty(),
        "a failed requeue is announced with a RequeueFailed Event"
    );

    broker.restart().await;
    for i in 0..n {
        let r = wait_phase(&api, &format!("down-{i}"), Phase::Redriven, 90).await;
        assert_eq!(
            condition(&r, "Requeued").map(|c| c.0).as_deref(),
            Some("True")
        );
    }
    wait_ready(client, ns, "relayer", true, 60).await;
    let mut got = broker.delivered().await;
    got.sort();
    let want: Vec<Vec<u8>> = (0..n).map(payload).collect();
    assert_eq!(got, want, "nothing lost, nothing doubled");
}

/// Creates records `down-0..n` and waits until the last is Parked.
async fn park_records(api: &Api<DeadLetter>, headers: &[(&str, &str)], n: usize) {
    for i in 0..n {
        let name = format!("down-{i}");
        api.create(
            &PostParams::default(),
            &record(&name, &format!("down/{i}"), &payload(i), headers),
        )
        .await
        .unwrap_or_else(|e| panic!("creating record {name}: {e}"));
    }
    wait_phase(api, &format!("down-{}", n - 1), Phase::Parked, 20).await;
}

/// Every decided record says Requeued=False, BrokerUnreachable, and is still Parked.
async fn assert_requeue_failing(api: &Api<DeadLetter>, broker: &str, n: usize) {
    for i in 0..n {
        let name = format!("down-{i}");
        let r = eventually(
            40,
            &format!("Requeued=False while {broker} is down"),
            || async {
                let r = api.get(&name).await.ok()?;
                matches!(condition(&r, "Requeued"), Some((s, _, _)) if s == "False").then_some(r)
            },
        )
        .await;
        assert_eq!(
            r.phase(),
            Phase::Parked,
            "a failed requeue leaves the record Parked"
        );
        let reason = condition(&r, "Requeued").map(|c| c.1);
        assert_eq!(reason.as_deref(), Some("BrokerUnreachable"), "{name}");
    }
}
