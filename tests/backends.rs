//! The scenarios every backend must pass, written once and run against each (a test per
//! scenario and backend: `<scenario>::<backend>`), against the real control plane and real
//! brokers (`dlq_testenv::backends`):
//!
//! - a dead message is parked once from the source and a redrive brings it back untouched;
//! - a record is redriven byte for byte, payload and headers, and only once decided; the
//!   resolution is written, announced and counted, and the queue's counters follow;
//! - the broker down: decided records stay Parked with `Requeued=False` and a `RequeueFailed`
//!   Event, and every job arrives exactly once when it is back;
//! - a crash between a park and its acknowledgement (the backend's failpoint), with the
//!   records resolved meanwhile: the re-read messages find their records, none is parked twice;
//! - a redrive's status write failing after the broker's confirmation (the apiserver away,
//!   then etcd), on a control plane of the test's own: one enqueue each;
//! - 100 records redriven at once, each exactly once, their Events folded per queue (the rate
//!   is reported);
//! - a dead message whose record the apiserver refuses for good (a CEL admission policy), then
//!   one refused even as its exact bytes, then a good one: an Invalid record, a visible
//!   rejection, a record, within seconds; the source never stalls;
//! - a storm past `maxParked` drained by one standing redrive, the operator killed while
//!   passed-through messages wait between their enqueue and their acknowledgement: every job
//!   arrives, a repeat only with the same key (`backends/standing.rs`).
//!
//! What only one backend does (AMQP `x-death`, Kafka origin topics and binary keys, SQS FIFO
//! groups and typed attributes, NATS multi-value headers and the duplicate window, the Redis
//! envelope and stream target, HTTP over TLS) stays in that backend's own test file.

use std::time::Duration;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Phase};
use dlq_testenv::backends::{
    Backend, Broker, Delivered, HttpBackend, KafkaBackend, NatsBackend, PubsubBackend,
    RabbitBackend, RedisBackend, SidekiqBackend, Source, SqsBackend,
};
use dlq_testenv::brokers::s3::S3Server;
use dlq_testenv::{
    Operator, condition, decide, events_for, eventually, record, redrive_many, setup, wait_phase,
    wait_ready,
};
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// A namespace with queue `relayer` on a backend, and an operator watching it.
struct Rig<B> {
    client: kube::Client,
    ns: String,
    api: Api<DeadLetter>,
    backend: B,
    op: Operator,
    /// The operator's environment: the scenario's and the backend's (read again only by the
    /// crash scenario, which needs the `failpoints` feature).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    env: Vec<(String, String)>,
}

impl<B> Rig<B> {
    /// Starts the next operator as this rig's was started, without its failpoint.
    #[cfg(feature = "failpoints")]
    fn operator_without_failpoint(&self) -> Operator {
        let env: Vec<(String, String)> = self
            .env
            .iter()
            .filter(|(k, _)| k != "DLQ_FAILPOINT")
            .cloned()
            .collect();
        Operator::start_with(&self.ns, &[], &pairs(&env))
    }
}

/// Sets the queue `relayer`'s `maxParked` to `n`.
async fn set_max_parked(queues: &Api<DeadLetterQueue>, n: usize) {
    queues
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "maxParked": n } })),
        )
        .await
        .unwrap_or_else(|e| panic!("maxParked {n}: {e}"));
}

/// `env` as `Operator::start_with` takes it.
fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

async fn rig<B: Backend>(
    scenario: &str,
    broker: Broker,
    with_source: bool,
    env: &[(&str, &str)],
) -> Rig<B> {
    rig_with_bodies(scenario, broker, with_source, env, None).await
}

/// The bucket of the body-store scenario.
const BODIES_BUCKET: &str = "dlq-bodies";

/// A [`rig`] whose queue keeps bodies over 64 KiB in `s3`'s bucket [`BODIES_BUCKET`] (with a
/// Secret `s3` of its keys) from before the operator starts.
async fn rig_with_bodies<B: Backend>(
    scenario: &str,
    broker: Broker,
    with_source: bool,
    env: &[(&str, &str)],
    s3: Option<&S3Server>,
) -> Rig<B> {
    let (client, ns) = setup(&format!("{}-{scenario}", B::NAME)).await;
    let backend = B::start(&ns, broker).await;
    backend.create_queue(&client, &ns, with_source).await;
    if let Some(s3) = s3 {
        s3.credentials_secret(&client, &ns, "s3").await;
        let bodies = json!({"spec": {"bodies": {
            "thresholdBytes": 65536,
            "s3": {"bucket": BODIES_BUCKET, "endpoint": s3.endpoint(), "region": "us-east-1",
                   "credentialsSecretRef": {"name": "s3"}},
        }}});
        Api::<DeadLetterQueue>::namespaced(client.clone(), &ns)
            .patch("relayer", &PatchParams::default(), &Patch::Merge(&bodies))
            .await
            .unwrap_or_else(|e| panic!("spec.bodies of queue relayer: {e}"));
    }
    let mut env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.extend(backend.operator_env());
    let op = Operator::start_with(&ns, &[], &pairs(&env));
    Rig {
        env,
        api: Api::namespaced(client.clone(), &ns),
        client,
        ns,
        backend,
        op,
    }
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn sorted(mut v: Vec<Delivered>) -> Vec<Delivered> {
    v.sort();
    v
}

/// Waits until every dead message is parked and acknowledged, and nothing more comes: the
/// records, by job id.
async fn parked_and_acknowledged<B: Source>(r: &Rig<B>, n: usize) -> Vec<DeadLetter> {
    eventually(
        150,
        &format!("{n} records and every dead message acknowledged"),
        || async {
            (records(&r.api).await.len() >= n && r.backend.pending_dead().await == 0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut items = records(&r.api).await;
    items.sort_by(|a, b| a.spec.job.id.cmp(&b.spec.job.id));
    items
}

/// Decides each of `items` for redrive once Parked, and waits until it is Redriven.
async fn redrive_each<B>(r: &Rig<B>, items: &[DeadLetter]) {
    for rec in items {
        let name = rec.name_any();
        wait_phase(&r.api, &name, Phase::Parked, 20).await;
        decide(&r.api, &name, Action::Redrive, "ops").await;
        wait_phase(&r.api, &name, Phase::Redriven, 60).await;
    }
}

/// Each dead message becomes one record with its exact bytes and headers, is acknowledged, and
/// once redriven arrives where it was published, exactly as it was.
async fn a_dead_message_is_parked_once_and_redriven_back_untouched<B: Source>() {
    let r = rig::<B>("park", Broker::Shared, true, &[]).await;
    r.backend.wait_listening().await;
    let sent = r.backend.put_dead(2).await;
    let items = parked_and_acknowledged(&r, sent.len()).await;
    assert_eq!(items.len(), sent.len(), "one record per dead message");
    for s in &sent {
        let found: Vec<&DeadLetter> = items.iter().filter(|i| i.spec.job.id == s.job_id).collect();
        assert_eq!(found.len(), 1, "one record of job {}", s.job_id);
        let rec = found[0];
        assert_eq!(
            rec.spec.job.payload_bytes().ok().as_deref(),
            Some(&s.payload[..]),
            "exact bytes of {}",
            s.job_id
        );
        for (k, v) in &s.headers {
            assert_eq!(
                rec.spec.job.headers.get(k),
                Some(v),
                "header {k} of {}: {:?}",
                s.job_id,
                rec.spec.job.headers
            );
        }
        assert_eq!(rec.spec.cycle, 1);
        assert!(
            rec.annotations().contains_key("dlq.dev/source-message"),
            "the broker's identity of the message is on its record"
        );
    }

    redrive_each(&r, &items).await;
    let want = sorted(sent.iter().map(|s| s.delivered()).collect());
    assert_eq!(sorted(r.backend.jobs().await), want, "back untouched, once");
}

/// Issue 48: a dead message over the queue's body threshold (320 KiB, more than a record holds,
/// where the test broker takes it; not UTF-8 where the broker carries binary, with headers
/// where it carries them) is kept in the queue's bucket
/// before its record is made; the record holds the reference (size, digest) and its headers,
/// no payload; a redrive sends the exact bytes and headers, once.
async fn a_large_dead_message_is_parked_through_the_body_store<B: Source>() {
    let len = B::LARGE_BYTES;
    let s3 = S3Server::start();
    s3.create_bucket(BODIES_BUCKET).await;
    let r = rig_with_bodies::<B>("bodies", Broker::Shared, true, &[], Some(&s3)).await;
    r.backend.wait_listening().await;
    let started = std::time::Instant::now();
    let sent = r
        .backend
        .put_dead_payloads(vec![r.backend.large_payload(len)])
        .await;
    let s = &sent[0];
    assert!(s.payload.len() >= len);
    let items = parked_and_acknowledged(&r, 1).await;
    assert_eq!(items.len(), 1, "one record");
    let job = &items[0].spec.job;
    assert_eq!(job.id, s.job_id);
    let body = job
        .body
        .as_deref()
        .unwrap_or_else(|| panic!("{} has no body reference", job.id));
    let digest = dlq_core::body::sha256_hex(&s.payload);
    assert_eq!(body.size, s.payload.len() as i64, "the body's size");
    assert_eq!(body.sha256, digest, "the body's digest");
    assert!(!body.external);
    assert!(
        job.payload.is_none() && job.payload_base64.is_none() && !job.payload_null,
        "no payload beside the reference"
    );
    for (k, v) in &s.headers {
        assert_eq!(job.headers.get(k), Some(v), "header {k}: {:?}", job.headers);
    }
    let key = body
        .reference
        .strip_prefix(&format!("s3://{BODIES_BUCKET}/"))
        .unwrap_or_else(|| panic!("a reference into the bucket: {}", body.reference));
    assert_eq!(
        s3.get_object(BODIES_BUCKET, key).await.as_deref(),
        Some(&s.payload[..]),
        "the object holds the exact bytes"
    );
    let stored = serde_json::to_vec(&items[0]).unwrap().len();
    assert!(stored < 4096, "a record of {stored} bytes");

    redrive_each(&r, &items).await;
    assert_eq!(
        sorted(r.backend.jobs().await),
        vec![s.delivered()],
        "back untouched, once"
    );
    dlq_testenv::report(&format!(
        "{}: a {} KiB dead message parked through the store and redriven in {:.1}s",
        B::NAME,
        s.payload.len() >> 10,
        started.elapsed().as_secs_f64()
    ));
}

/// Into a sealed queue (issue 32), each dead message becomes a record holding only the
/// ciphertext (payload and headers sealed to the queue's recipient by the source, before the
/// create), and a redrive opens it and brings it back exactly as it was.
async fn a_sealed_dead_message_is_redriven_back_untouched<B: Source>() {
    let r = rig::<B>("sealed", Broker::Shared, true, &[]).await;
    let (identity, recipient) = dlq_core::seal::generate_identity();
    dlq_testenv::create_secret(&r.client, &r.ns, "relayer-seal", "identity", &identity).await;
    let queues: Api<DeadLetterQueue> = Api::namespaced(r.client.clone(), &r.ns);
    let seal =
        json!({"spec": {"protection": {"seal": {"identitySecretRef": {"name": "relayer-seal"}}}}});
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&seal))
        .await
        .unwrap_or_else(|e| panic!("sealing queue relayer: {e}"));
    eventually(30, "the queue's recipient published", || async {
        let q = queues.get("relayer").await.ok()?;
        (q.seal_recipient() == Some(recipient.as_str())).then_some(())
    })
    .await;
    r.backend.wait_listening().await;
    let sent = r.backend.put_dead(2).await;
    let items = parked_and_acknowledged(&r, sent.len()).await;
    assert_eq!(items.len(), sent.len(), "one record per dead message");
    for rec in &items {
        let job = &rec.spec.job;
        let sealed = job
            .sealed
            .as_ref()
            .unwrap_or_else(|| panic!("{} is not sealed", job.id));
        assert_eq!(sealed.recipient, recipient);
        assert!(
            job.payload.is_none() && job.payload_base64.is_none() && job.headers.is_empty(),
            "{}: plaintext beside the ciphertext",
            job.id
        );
    }
    redrive_each(&r, &items).await;
    let want = sorted(sent.iter().map(|s| s.delivered()).collect());
    assert_eq!(
        sorted(r.backend.jobs().await),
        want,
        "opened and back untouched, once"
    );
}

/// A record made by a parker (not from the source) is redriven only once decided, and arrives
/// byte for byte with its headers; the resolution is written, announced and counted, and the
/// queue's counters and target follow.
async fn a_record_is_redriven_byte_for_byte_once_decided<B: Backend>() {
    let r = rig::<B>("redrive", Broker::Shared, false, &[]).await;
    let payload = r.backend.payload(0);
    let headers = r.backend.headers();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    r.api
        .create(
            &PostParams::default(),
            &record("bytes-1", "pi_0003/settle", &payload, &pairs),
        )
        .await
        .unwrap_or_else(|e| panic!("creating record bytes-1: {e}"));
    wait_phase(&r.api, "bytes-1", Phase::Parked, 20).await;
    wait_ready(&r.client, &r.ns, "relayer", true, 30).await;
    assert!(
        r.backend.jobs().await.is_empty(),
        "nothing is redriven without a decision"
    );
    decide(&r.api, "bytes-1", Action::Redrive, "ops").await;
    let done = wait_phase(&r.api, "bytes-1", Phase::Redriven, 30).await;
    let want = Delivered {
        payload,
        headers: headers.into_iter().collect(),
    };
    let key = B::CARRIES_KEY.then(|| dlq_core::decide::redrive_key(&done));
    assert_eq!(
        r.backend.keyed().await,
        vec![(want, key)],
        "exactly one, untouched, its idempotency key beside it"
    );

    assert_eq!(
        condition(&done, "Requeued").map(|c| c.0).as_deref(),
        Some("True")
    );
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(status.resolved_by.as_deref(), Some("ops"));
    assert!(status.resolved_at.is_some());
    assert_eq!(status.observed_generation, done.metadata.generation);
    let events = eventually(10, "a Redriven Event", || async {
        let e = events_for(&r.client, &r.ns, "bytes-1", "Redriven").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    let note = events[0].note.clone().unwrap_or_default();
    assert!(note.contains("redriven by ops"), "{note}");
    let success = r.op.metric(
        "dlq_redrives_total",
        &[
            ("namespace", &r.ns),
            ("queue", "relayer"),
            ("result", "success"),
        ],
    );
    assert_eq!(success, 1.0, "dlq_redrives_total success moved once");
    assert!(
        r.op.logs().contains("initial_state=Streamed"),
        "this apiserver streams the initial records:\n{}",
        r.op.logs()
    );
    let queues: Api<DeadLetterQueue> = Api::namespaced(r.client.clone(), &r.ns);
    let described = r.backend.described();
    let counted = eventually(20, "the queue's counters", || async {
        let s = queues.get("relayer").await.ok()?.status?;
        (s.redriven == 1 && s.parked == 0).then_some(s)
    })
    .await;
    assert_eq!(counted.target.as_deref(), Some(described.as_str()));
}

/// The payload of record `down-<i>`.
fn down_payload(i: usize) -> Vec<u8> {
    format!("job {i}").into_bytes()
}

/// The target's broker goes away: the queue says so, decided records stay Parked with
/// `Requeued=False` (BrokerUnreachable) and a `RequeueFailed` Event; once it is back every
/// record becomes Redriven and the broker holds each job exactly once.
async fn decided_records_wait_parked_while_the_broker_is_down<B: Backend>() {
    const N: usize = 3;
    let mut r = rig::<B>("down", Broker::Own, false, &[]).await;
    let headers = r.backend.headers();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for i in 0..N {
        let name = format!("down-{i}");
        r.api
            .create(
                &PostParams::default(),
                &record(&name, &format!("down/{i}"), &down_payload(i), &pairs),
            )
            .await
            .unwrap_or_else(|e| panic!("creating record {name}: {e}"));
    }
    wait_phase(&r.api, &format!("down-{}", N - 1), Phase::Parked, 20).await;
    wait_ready(&r.client, &r.ns, "relayer", true, 30).await;

    r.backend.stop();
    // Ready follows the broker: checked before any decision, since failing redrives rewrite
    // their records' status continuously. A change to the queue has it reconciled now rather
    // than at its next resync (every 30 s, which the in-process queue test covers).
    Api::<DeadLetterQueue>::namespaced(r.client.clone(), &r.ns)
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"dlq.dev/test": "broker stopped"}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("annotating queue relayer: {e}"));
    let why = wait_ready(&r.client, &r.ns, "relayer", false, 90).await;
    assert!(why.starts_with("BrokerUnreachable"), "{why}");
    for i in 0..N {
        decide(&r.api, &format!("down-{i}"), Action::Redrive, "ops").await;
    }
    for i in 0..N {
        let name = format!("down-{i}");
        let rec = eventually(40, &format!("{name} Requeued=False"), || async {
            let rec = r.api.get(&name).await.ok()?;
            matches!(condition(&rec, "Requeued"), Some((s, _, _)) if s == "False").then_some(rec)
        })
        .await;
        assert_eq!(
            rec.phase(),
            Phase::Parked,
            "a failed requeue leaves {name} Parked"
        );
        let reason = condition(&rec, "Requeued").map(|c| c.1);
        assert_eq!(reason.as_deref(), Some("BrokerUnreachable"), "{name}");
    }
    assert!(
        !events_for(&r.client, &r.ns, "down-0", "RequeueFailed")
            .await
            .is_empty(),
        "a failed requeue is announced with a RequeueFailed Event"
    );

    r.backend.restart().await;
    for i in 0..N {
        let rec = wait_phase(&r.api, &format!("down-{i}"), Phase::Redriven, 90).await;
        assert_eq!(
            condition(&rec, "Requeued").map(|c| c.0).as_deref(),
            Some("True")
        );
    }
    wait_ready(&r.client, &r.ns, "relayer", true, 60).await;
    let got: Vec<Vec<u8>> = sorted(r.backend.jobs().await)
        .into_iter()
        .map(|d| d.payload)
        .collect();
    let mut want: Vec<Vec<u8>> = (0..N).map(down_payload).collect();
    want.sort();
    assert_eq!(got, want, "nothing lost, nothing doubled");
}

/// The source parks, then hangs at its failpoint before acknowledging; a human resolves what
/// was parked; the operator is killed. Nothing was acknowledged, so a fresh operator reads every
/// message again: each finds its record whatever its phase (chaos once found a re-read becoming
/// cycle 2 of a resolved record), and every message ends as exactly one record, acknowledged.
#[cfg(feature = "failpoints")]
async fn a_crash_between_park_and_ack_parks_each_message_once<B: Source>() {
    use std::collections::BTreeSet;
    const N: usize = 10;
    let env = [("DLQ_FAILPOINT", B::FAILPOINT)];
    let mut r = rig::<B>("crash", Broker::Shared, true, &env).await;
    r.backend.wait_listening().await;
    let sent = r.backend.put_dead(N).await;
    r.op.reached_failpoint(B::FAILPOINT, 90).await;
    let before = records(&r.api).await;
    assert!(!before.is_empty(), "parked before the failpoint");
    for rec in &before {
        decide(&r.api, &rec.name_any(), Action::Drop, "alice").await;
    }
    for rec in &before {
        wait_phase(&r.api, &rec.name_any(), Phase::Dropped, 30).await;
    }
    r.op.kill();
    eventually(30, "every dead message still unacknowledged", || async {
        (r.backend.pending_dead().await == N).then_some(())
    })
    .await;

    // The next operator without the failpoint, with what the backend needs.
    let _op = r.operator_without_failpoint();
    let items = parked_and_acknowledged(&r, N).await;
    let ids: BTreeSet<&str> = items.iter().map(|i| i.spec.job.id.as_str()).collect();
    let want: BTreeSet<&str> = sent.iter().map(|s| s.job_id.as_str()).collect();
    assert_eq!(items.len(), N, "none lost, none doubled: {ids:?}");
    assert_eq!(ids, want);
    assert!(items.iter().all(|i| i.spec.cycle == 1), "no second cycle");
    for rec in &before {
        let now = items
            .iter()
            .find(|i| i.name_any() == rec.name_any())
            .unwrap_or_else(|| panic!("{} is gone", rec.name_any()));
        assert_eq!(
            now.phase(),
            Phase::Dropped,
            "{} stays resolved",
            rec.name_any()
        );
    }
    let identities: BTreeSet<Option<&String>> = items
        .iter()
        .map(|i| i.annotations().get("dlq.dev/source-message"))
        .collect();
    assert_eq!(identities.len(), N, "one message identity per record");
    assert!(!identities.contains(&None));
    dlq_testenv::report(&format!(
        "crash {}: {} of {N} dead messages parked and resolved before the kill, all {N} unacknowledged; after the restart {N} records",
        B::NAME,
        before.len()
    ));
}

/// 100 records decided at once are each delivered exactly once; their Normal Events are folded
/// per queue (a handful, not 100) yet account for every record; the rate goes to the log.
async fn many_records_are_each_redriven_exactly_once<B: Backend>() {
    const N: usize = 100;
    let r = rig::<B>("many", Broker::Shared, false, &[]).await;
    let headers = r.backend.headers();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let payloads: Vec<Vec<u8>> = (0..N).map(|i| r.backend.payload(i)).collect();
    let secs = redrive_many(&r.api, N, |i| {
        record(
            &format!("many-{i}"),
            &format!("many/{i}"),
            &payloads[i],
            &pairs,
        )
    })
    .await;
    let want = sorted(
        payloads
            .iter()
            .map(|p| Delivered {
                payload: p.clone(),
                headers: headers.iter().cloned().collect(),
            })
            .collect(),
    );
    let keyed = r.backend.keyed().await;
    let keys: std::collections::BTreeSet<_> = keyed.iter().filter_map(|(_, k)| k.clone()).collect();
    let carrying = if B::CARRIES_KEY { N } else { 0 };
    assert_eq!(keys.len(), carrying, "one idempotency key per redrive");
    assert_eq!(
        sorted(keyed.into_iter().map(|(d, _)| d).collect()),
        want,
        "each exactly once"
    );
    dlq_testenv::report(&format!(
        "redrive rate {}: {N} records in {secs:.2}s = {:.0} records/s",
        B::NAME,
        N as f64 / secs
    ));

    // Every resolution is accounted for: an Event about the record, or a name in a summary.
    let events: Api<Event> = Api::namespaced(r.client.clone(), &r.ns);
    let redriven = eventually(20, "every redrive in an Event", || async {
        let items: Vec<Event> = events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("Redriven"))
            .collect();
        let counted: usize = items
            .iter()
            .map(|e| {
                let note = e.note.as_deref().unwrap_or_default();
                match note.split_once(" records of queue ") {
                    Some((count, _)) => count.parse().unwrap_or(0),
                    None => 1,
                }
            })
            .sum();
        (counted == N).then_some(items)
    })
    .await;
    assert!(
        redriven.len() <= N / 4,
        "{} Redriven Events for {N} redrives: not aggregated",
        redriven.len()
    );
    assert!(
        redriven
            .iter()
            .all(|e| e.type_.as_deref() == Some("Normal")),
        "only Normal Events are aggregated"
    );
}

/// Issue 35: a redrive's status write fails after the broker confirmed its job, once while
/// the apiserver is away and once while etcd is down (a control plane of this test's own):
/// the operator writes only the status when the plane is back, and each job arrives once,
/// carrying one idempotency key.
#[cfg(feature = "failpoints")]
async fn a_failing_status_write_never_enqueues_twice<B: Backend>() {
    use dlq_testenv::plane::ControlPlane;
    let mut plane = ControlPlane::start().expect("a control plane");
    let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
    dlq_testenv::apply_crds(&client, dlq_testenv::CRDS).await;
    let ns = dlq_testenv::namespace(&client, &format!("{}-outage", B::NAME)).await;
    let backend = B::start(&ns, Broker::Shared).await;
    backend.create_queue(&client, &ns, false).await;
    // Held 3 s after each confirmation: the plane breaks meanwhile, so the write meets it.
    let mut env = vec![(
        "DLQ_FAILPOINT".to_string(),
        "after-requeue@3000".to_string(),
    )];
    env.extend(backend.operator_env());
    let op = Operator::start_on(&plane.kubeconfig, &ns, &[], &pairs(&env));
    let headers = backend.headers();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for (i, fault) in ["apiserver", "etcd"].into_iter().enumerate() {
        let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
        let api: Api<DeadLetter> = Api::namespaced(client, &ns);
        let name = format!("outage-{i}");
        let job = record(&name, &format!("outage/{i}"), &backend.payload(i), &pairs);
        api.create(&PostParams::default(), &job)
            .await
            .unwrap_or_else(|e| panic!("creating record {name}: {e}"));
        wait_phase(&api, &name, Phase::Parked, 20).await;
        decide(&api, &name, Action::Redrive, "ops").await;
        op.reached_failpoint_times("after-requeue", i + 1, 30).await;
        if fault == "apiserver" {
            plane.stop_apiserver();
            let failed = format!("writing the status of DeadLetter {name}");
            eventually(20, "the resolution's write to fail", || async {
                op.logs().contains(&failed).then_some(())
            })
            .await;
            plane.start_apiserver().expect("the apiserver back");
        } else {
            // The apiserver holds the write while etcd is away (no answer), past the hold.
            plane.stop_etcd();
            std::thread::sleep(Duration::from_secs(6));
            plane.start_etcd().expect("etcd back");
        }
        let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
        let api: Api<DeadLetter> = Api::namespaced(client, &ns);
        wait_phase(&api, &name, Phase::Redriven, 60).await;
    }
    let keyed = backend.keyed().await;
    assert_eq!(keyed.len(), 2, "one arrival per job\n{}", op.logs());
    let keys: std::collections::BTreeSet<_> = keyed.iter().filter_map(|(_, k)| k.clone()).collect();
    assert_eq!(keys.len(), if B::CARRIES_KEY { 2 } else { 0 });
    let requeued = op.logs().matches("job requeued").count();
    assert_eq!(requeued, 2, "one enqueue per record\n{}", op.logs());
}

/// `text` as a CEL string literal.
fn cel_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The text a record of job `i`'s bytes carries: the bytes when UTF-8, else their base64 (a
/// record of a Redis envelope carries the envelope, which holds that base64).
fn marker<B: Backend>(b: &B, i: usize) -> String {
    use base64::Engine;
    String::from_utf8(b.payload(i))
        .unwrap_or_else(|e| base64::engine::general_purpose::STANDARD.encode(e.into_bytes()))
}

/// A ValidatingAdmissionPolicy on `ns` alone that refuses (422 Invalid, a CEL rule) creating a
/// record that carries job 0's bytes unless it is the operator's fallback after a refusal (its
/// reason says so), and any record carrying job 1's.
async fn refuse_poison<B: Backend>(client: &kube::Client, ns: &str, b: &B) -> String {
    let carries = |m: &str| {
        let m = cel_string(m);
        format!(
            "((has(object.spec.job.payload) && object.spec.job.payload.contains({m})) || \
             (has(object.spec.job.payloadBase64) && object.spec.job.payloadBase64.contains({m})))"
        )
    };
    let allowed = format!(
        "!(!object.spec.reason.contains('apiserver refused') && {}) && !{}",
        carries(&marker(b, 0)),
        carries(&marker(b, 1))
    );
    let probe = json!({
        "metadata": {"name": "probe"},
        "spec": {"queue": "relayer", "cycle": 1, "deliveries": 0, "reason": "probe",
                 "failureKind": "Invalid", "failedAt": "2026-12-01T00:00:00Z",
                 "job": {"id": "probe", "payload": marker(b, 1)}},
    });
    dlq_testenv::admission::refuse(
        client,
        ns,
        "poison",
        &allowed,
        "poisoned: refused by the test's policy",
        probe,
    )
    .await
}

/// Three dead messages in a row: the apiserver refuses job 0's record (422, a CEL rule) unless
/// it is the Invalid record of its bytes made after a refusal, and job 1's in any form; job 2 is good. Job 0 becomes an Invalid record of
/// its exact bytes with the refusal as reason, job 1 is set aside visibly (counted, a Rejected
/// Event), job 2 is parked: all within seconds, the source never stalls on a refusal.
async fn a_refused_message_is_accounted_for_and_the_next_one_parks<B: Source>() {
    let r = rig::<B>("poison", Broker::Shared, true, &[]).await;
    let policy = refuse_poison(&r.client, &r.ns, &r.backend).await;
    r.backend.wait_listening().await;
    let sent = r.backend.put_dead(3).await;
    // From when the dead-letter place holds them (SQS takes its redrive policy's time).
    let started = std::time::Instant::now();
    let rejected = eventually(
        60,
        "2 records, 1 Rejected Event, the source caught up",
        || async {
            let rejected = events_for(&r.client, &r.ns, "relayer", "Rejected").await;
            let caught_up = r.backend.pending_dead().await == usize::from(B::KEEPS_REJECTED);
            (records(&r.api).await.len() >= 2 && !rejected.is_empty() && caught_up)
                .then_some(rejected)
        },
    )
    .await;
    let secs = started.elapsed().as_secs_f64();
    dlq_testenv::report(&format!(
        "{}: refused, rejected and good message accounted for in {secs:.1}s",
        B::NAME
    ));
    dlq_testenv::admission::unrefuse(&r.client, &policy).await;
    // ElasticMQ does not wake a long poll (20 s) for messages its redrive policy moved.
    assert!(secs < 45.0, "took {secs:.1}s");
    let items = records(&r.api).await;
    assert_eq!(items.len(), 2, "job 1 has no record");
    let of = |s: &dlq_testenv::backends::Sent| items.iter().find(|i| i.spec.job.id == s.job_id);
    let refused = of(&sent[0]).expect("job 0 is a record under its own job id");
    let spec = &refused.spec;
    assert_eq!(spec.failure_kind, dlq_core::api::FailureKind::Invalid);
    assert!(
        spec.reason.contains("apiserver refused") && spec.reason.contains("poisoned"),
        "{}",
        spec.reason
    );
    let text = spec.job.payload.clone().or(spec.job.payload_base64.clone());
    assert!(
        text.is_some_and(|t| t.contains(&marker(&r.backend, 0))),
        "the exact bytes are kept"
    );
    for (k, v) in &sent[0].headers {
        assert_eq!(spec.job.headers.get(k), Some(v), "header {k} kept");
    }
    let good = of(&sent[2]).expect("job 2 parked behind the refused ones");
    assert_eq!(
        good.spec.job.payload_bytes().ok().as_deref(),
        Some(&sent[2].payload[..])
    );
    assert!(
        !good.spec.reason.contains("apiserver refused"),
        "{}",
        good.spec.reason
    );
    let created = |d: &DeadLetter| d.metadata.creation_timestamp.clone().map(|t| t.0);
    let (first, last) = (created(refused).unwrap(), created(good).unwrap());
    assert!(
        (last.as_second() - first.as_second()).abs() <= 5,
        "the refused message and the good one were parked {first} and {last}: no stall between"
    );
    let note = rejected[0].note.clone().unwrap_or_default();
    assert!(
        note.contains("poisoned"),
        "the Rejected Event says why: {note}"
    );
    assert_eq!(
        r.op.metric("dlq_rejected_total", &[("reason", "Refused")]),
        1.0,
        "counted as refused"
    );
}

/// A storm past `maxParked`: the queue says how many dead messages still wait in the broker
/// beyond its records (every one the broker holds, those the source has in hand included), its
/// failure group says its share, and once `maxParked` is raised and they are parked both say
/// 0. A broker that cannot say (Pub/Sub) says `unknown`: `messages` absent, never 0.
async fn a_full_queue_reports_its_backlog<B: Source>() {
    const MAX: usize = 3;
    const N: usize = 12;
    let r = rig::<B>("backlog", Broker::Shared, true, &[]).await;
    let queues: Api<DeadLetterQueue> = Api::namespaced(r.client.clone(), &r.ns);
    let groups: Api<dlq_core::groups::DeadLetterGroup> = Api::namespaced(r.client.clone(), &r.ns);
    let backlog = || async {
        queues
            .get("relayer")
            .await
            .ok()
            .and_then(|q| q.status?.backlog)
    };
    // The groups' estimated shares, summed, and how many groups there are.
    let shares = || async {
        let items = groups
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        let estimates: Vec<Option<i64>> = items
            .iter()
            .map(|g| g.status.as_ref()?.backlog.as_ref()?.messages)
            .collect();
        (estimates.iter().flatten().sum::<i64>(), estimates.len())
    };
    set_max_parked(&queues, MAX).await;
    r.backend.wait_listening().await;
    r.backend.put_dead(N).await;
    if !B::BACKLOG_KNOWN {
        let b = eventually(60, "the backlog said to be unknown", || async {
            let b = backlog().await?;
            (records(&r.api).await.len() == MAX).then_some(b)
        })
        .await;
        assert_eq!(
            b.messages, None,
            "a broker that cannot say is unknown, never 0"
        );
        assert!(b.observed_at.is_some(), "{b:?}");
        return;
    }
    let waiting = (N - MAX) as i64;
    let b = eventually(
        60,
        "the backlog to be what waits beyond the records",
        || async {
            let b = backlog().await?;
            (records(&r.api).await.len() == MAX && b.messages == Some(waiting)).then_some(b)
        },
    )
    .await;
    assert!(b.observed_at.is_some(), "{b:?}");
    // Each group's share is written by the groups' reconcile, woken by the backlog's write.
    eventually(
        30,
        "the failure groups' shares to add up to the backlog",
        || async {
            let (sum, n) = shares().await;
            (n > 0 && (sum - waiting).abs() <= n as i64).then_some(())
        },
    )
    .await;
    set_max_parked(&queues, 100).await;
    eventually(60, "every message parked and the backlog 0", || async {
        let b = backlog().await?;
        (records(&r.api).await.len() == N && b.messages == Some(0)).then_some(())
    })
    .await;
    eventually(30, "the failure groups' shares 0", || async {
        let (sum, n) = shares().await;
        (n > 0 && sum == 0).then_some(())
    })
    .await;
}

/// One test per backend of `$scenario`, named `$scenario::<backend>`.
macro_rules! run_for {
    ($scenario:ident: $($backend:ident = $ty:ty),+ $(,)?) => {
        mod $scenario {
            use super::*;
            $(
                #[tokio::test]
                async fn $backend() {
                    super::$scenario::<$ty>().await
                }
            )+
        }
    };
}

run_for!(a_dead_message_is_parked_once_and_redriven_back_untouched:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);

run_for!(a_large_dead_message_is_parked_through_the_body_store:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);

run_for!(a_sealed_dead_message_is_redriven_back_untouched:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);

run_for!(a_record_is_redriven_byte_for_byte_once_decided:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    http = HttpBackend,
    sidekiq = SidekiqBackend,
);

run_for!(decided_records_wait_parked_while_the_broker_is_down:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    http = HttpBackend,
);

#[cfg(feature = "failpoints")]
run_for!(a_crash_between_park_and_ack_parks_each_message_once:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);

#[cfg(feature = "failpoints")]
run_for!(a_failing_status_write_never_enqueues_twice:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    http = HttpBackend,
);

run_for!(many_records_are_each_redriven_exactly_once:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    http = HttpBackend,
    sidekiq = SidekiqBackend,
);

run_for!(a_refused_message_is_accounted_for_and_the_next_one_parks:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
);

run_for!(a_full_queue_reports_its_backlog:
    redis = RedisBackend,
    rabbitmq = RabbitBackend,
    nats = NatsBackend,
    kafka = KafkaBackend,
    sqs = SqsBackend,
    pubsub = PubsubBackend,
    sidekiq = SidekiqBackend,
);

/// Issue 47 item 4: a standing redrive drains the backlog, and a kill during pass-through loses
/// nothing (its own file: one scenario with its own helpers).
#[cfg(feature = "failpoints")]
#[path = "backends/standing.rs"]
mod standing;
