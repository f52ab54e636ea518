//! What only NATS JetStream does, against a real nats-server: multi-valued headers and
//! `Nats-Msg-Id` on redrive, the MAX_DELIVERIES source (job ids from `Nats-Msg-Id` or the stream
//! sequence, the origin subject) and the stream's duplicate window refusing an early redrive.
//! The scenarios every backend passes are in `tests/backends.rs`.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER as KEY_HEADER;
use dlq_core::api::{Action, DeadLetter, FailureKind, Phase};
use dlq_testenv::brokers::Nats;
use dlq_testenv::{
    Operator, condition, create_dlq, decide, events_for, eventually, record, setup, wait_phase,
};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

async fn create_stream(nats: &Nats, dup_window: Duration) -> jetstream::stream::Stream {
    nats.js()
        .await
        .create_stream(jetstream::stream::Config {
            name: "JOBS".into(),
            subjects: vec!["jobs.>".into()],
            duplicate_window: dup_window,
            ..Default::default()
        })
        .await
        .expect("creating stream JOBS")
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

async fn stream_messages(stream: &jetstream::stream::Stream) -> u64 {
    stream
        .get_info()
        .await
        .map(|i| i.state.messages)
        .unwrap_or(0)
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.as_str())
}

/// The message at `seq` as a consumer receives it (every value of repeated headers; the
/// client's STREAM.MSG.GET decoding keeps only the last one).
async fn read_seq(
    stream: &jetstream::stream::Stream,
    seq: u64,
) -> (async_nats::Message, HeaderMap) {
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: seq,
            },
            ..Default::default()
        })
        .await
        .expect("reader consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("fetch");
    let m = batch.next().await.expect("a message").expect("message");
    let headers = m.message.headers.clone().unwrap_or_default();
    (m.message, headers)
}

#[tokio::test]
async fn redrive_publishes_identical_payload_and_headers_and_waits_for_the_puback() {
    let (client, ns) = setup("nats-target").await;
    let nats = Nats::start();
    let stream = create_stream(&nats, Duration::from_secs(120)).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"nats": {"url": nats.url(), "subject": "jobs.relayer"}}}),
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let payload: Vec<u8> = (0u8..=255).rev().collect();
    api.create(
        &PostParams::default(),
        &record(
            "bytes-1",
            "pi_0003/settle",
            &payload,
            &[
                ("x-trace", "abc"),
                ("Content-Type", "application/octet-stream"),
                ("nats-multi", r#"{"x-tag":["a","b"]}"#),
            ],
        ),
    )
    .await
    .unwrap();
    wait_phase(&api, "bytes-1", Phase::Parked, 20).await;
    assert_eq!(stream_messages(&stream).await, 0);
    decide(&api, "bytes-1", Action::Redrive, "ops").await;
    let done = wait_phase(&api, "bytes-1", Phase::Redriven, 30).await;

    assert_eq!(stream_messages(&stream).await, 1, "exactly one message");
    let (m, headers) = read_seq(&stream, 1).await;
    assert_eq!(m.subject.as_str(), "jobs.relayer");
    assert_eq!(m.payload.as_ref(), &payload[..], "byte-identical payload");
    assert_eq!(header(&headers, "x-trace"), Some("abc"));
    assert_eq!(
        header(&headers, "Content-Type"),
        Some("application/octet-stream")
    );
    let tags: Vec<&str> = headers.get_all("x-tag").map(|v| v.as_str()).collect();
    assert_eq!(
        tags,
        ["a", "b"],
        "multi-valued headers come back as they were"
    );
    assert!(headers.get("nats-multi").is_none());
    let key = dlq_core::decide::redrive_key(&done);
    assert_eq!(header(&headers, KEY_HEADER), Some(key.as_str()));
    assert_eq!(
        header(&headers, "Nats-Msg-Id"),
        Some(key.as_str()),
        "JetStream deduplicates by the idempotency key"
    );
    assert_eq!(headers.iter().count(), 5, "no other headers");

    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(30, "queue Ready=True", || async {
        let s = queues.get("relayer").await.ok()?.status?;
        (s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            && s.target.as_deref()
                == Some("nats jetstream subject jobs.relayer (or the record's origin)"))
        .then_some(())
    })
    .await;
}

/// A worker that fails every message it gets: naks until JetStream gives up (MaxDeliver).
fn failing_worker(
    consumer: jetstream::consumer::Consumer<jetstream::consumer::pull::Config>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
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
                let _ = m.ack_with(AckKind::Nak(None)).await;
            }
        }
    })
}

async fn worker_consumer(
    stream: &jetstream::stream::Stream,
    max_deliver: i64,
) -> jetstream::consumer::Consumer<jetstream::consumer::pull::Config> {
    stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("worker".into()),
            max_deliver,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .expect("worker consumer")
}

/// Waits until the bridge has its advisory capture stream (advisories before it are lost).
async fn wait_for_bridge(nats: &Nats) {
    let js = nats.js().await;
    let name = deadletter::source::nats::advisory_stream("JOBS", "worker");
    eventually(30, "the bridge's advisory stream", || async {
        js.get_stream(&name).await.ok().map(|_| ())
    })
    .await;
}

#[tokio::test]
async fn a_message_over_max_deliver_becomes_a_record_and_redrive_respects_the_duplicate_window() {
    let (client, ns) = setup("nats-source").await;
    let nats = Nats::start();
    const WINDOW: Duration = Duration::from_secs(20);
    let stream = create_stream(&nats, WINDOW).await;
    let consumer = worker_consumer(&stream, 3).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "target": {"nats": {"url": nats.url(), "subject": "jobs.relayer"}},
            "source": {"nats": {"stream": "JOBS", "consumer": "worker"}}
        }),
    )
    .await;
    let _op = Operator::start(&ns);
    wait_for_bridge(&nats).await;

    let js = nats.js().await;
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "pi_0007/settle");
    h.insert("x-trace", "t7");
    h.append("x-tag", "a");
    h.append("x-tag", "b");
    let published = Instant::now();
    js.publish_with_headers("jobs.orders", h, "with id".into())
        .await
        .unwrap()
        .await
        .unwrap();
    js.publish("jobs.orders", "without id".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let worker = failing_worker(consumer);

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = eventually(60, "two records", || async {
        let items = records(&api).await;
        (items.len() == 2).then_some(items)
    })
    .await;
    let with_id = items
        .iter()
        .find(|r| r.spec.job.id == "pi_0007/settle")
        .expect("job id from Nats-Msg-Id");
    let without = items
        .iter()
        .find(|r| r.spec.job.id == "nats-JOBS-2")
        .expect("job id from the stream sequence");
    assert_eq!(with_id.spec.deliveries, 3, "MaxDeliver deliveries");
    assert_eq!(with_id.spec.failure_kind, FailureKind::Transient);
    assert!(
        with_id
            .spec
            .reason
            .contains("JetStream consumer worker gave up after 3 deliveries"),
        "{}",
        with_id.spec.reason
    );
    assert_eq!(with_id.spec.job.payload.as_deref(), Some("with id"));
    assert_eq!(with_id.spec.job.headers["x-trace"], "t7");
    assert_eq!(
        with_id.spec.job.headers["nats-multi"],
        r#"{"x-tag":["a","b"]}"#
    );
    assert_eq!(with_id.spec.job.headers["Nats-Msg-Id"], "pi_0007/settle");
    let origin = with_id.spec.job.origin.clone().unwrap();
    assert_eq!(origin.subject.as_deref(), Some("jobs.orders"));
    assert_eq!(origin.stream.as_deref(), Some("JOBS"));
    assert_eq!(origin.sequence, Some(1));
    // The failing worker would kill redriven jobs again; stop it.
    worker.abort();
    eventually(20, "parked messages deleted from the stream", || async {
        (stream_messages(&stream).await == 0).then_some(())
    })
    .await;

    // Without Nats-Msg-Id nothing deduplicates: the redrive lands on the original subject.
    decide(&api, &without.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &without.name_any(), Phase::Redriven, 30).await;
    let (m, _) = read_seq(&stream, 3).await;
    assert_eq!(m.subject.as_str(), "jobs.orders", "origin subject wins");
    assert_eq!(m.payload.as_ref(), b"without id");

    // With it, inside the duplicate window: refused with its own reason, retried, and through
    // once the window has passed.
    decide(&api, &with_id.name_any(), Action::Redrive, "ops").await;
    let r = eventually(30, "Requeued=False DuplicateWindow", || async {
        let r = api.get(&with_id.name_any()).await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, reason, _)) if s == "False" && reason == "DuplicateWindow").then_some(r)
    })
    .await;
    assert_eq!(r.phase(), Phase::Parked);
    let (_, _, message) = condition(&r, "Requeued").unwrap();
    assert!(message.contains("duplicate window"), "{message}");
    let refused_after = published.elapsed();
    eventually(10, "RequeueFailed warning", || async {
        let e = events_for(&client, &ns, &with_id.name_any(), "RequeueFailed").await;
        e.iter()
            .any(|e| e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;
    let done = wait_phase(&api, &with_id.name_any(), Phase::Redriven, 60).await;
    let through_after = published.elapsed();
    assert!(through_after >= WINDOW, "not before the window passed");
    assert_eq!(condition(&done, "Requeued").unwrap().0, "True");
    let info = stream.get_info().await.unwrap();
    let (m, headers) = read_seq(&stream, info.state.last_sequence).await;
    assert_eq!(m.subject.as_str(), "jobs.orders");
    assert_eq!(m.payload.as_ref(), b"with id");
    assert_eq!(header(&headers, "Nats-Msg-Id"), Some("pi_0007/settle"));
    assert_eq!(header(&headers, "x-trace"), Some("t7"));
    let tags: Vec<&str> = headers.get_all("x-tag").map(|v| v.as_str()).collect();
    assert_eq!(tags, ["a", "b"], "the original headers, untouched");
    dlq_testenv::report(&format!(
        "nats duplicate window {}s: redrive refused as DuplicateWindow at {:.1}s, redriven at {:.1}s after the original publish",
        WINDOW.as_secs(),
        refused_after.as_secs_f64(),
        through_after.as_secs_f64()
    ));
}

/// Issue 35: the operator is killed between the JetStream PubAck and the status write; the
/// next operator enqueues the job again with the same idempotency key as `Nats-Msg-Id`, and
/// the stream, inside its duplicate window, keeps one message (the duplicate PubAck is a
/// success).
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_the_puback_and_the_status_write_leaves_one_message_in_the_stream() {
    let (client, ns) = setup("nats-kill").await;
    let nats = Nats::start();
    let stream = create_stream(&nats, Duration::from_secs(120)).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"nats": {"url": nats.url(), "subject": "jobs.relayer"}}}),
    )
    .await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut op = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "after-requeue")]);
    api.create(
        &PostParams::default(),
        &record("kill-1", "pi_0009/settle", b"once", &[("x-trace", "k")]),
    )
    .await
    .unwrap();
    wait_phase(&api, "kill-1", Phase::Parked, 20).await;
    decide(&api, "kill-1", Action::Redrive, "ops").await;
    op.reached_failpoint("after-requeue", 20).await;
    op.kill();
    assert_eq!(
        stream_messages(&stream).await,
        1,
        "enqueued before the kill"
    );

    let next = Operator::start(&ns);
    let done = wait_phase(&api, "kill-1", Phase::Redriven, 30).await;
    assert!(
        next.logs().contains("redrive was a JetStream duplicate"),
        "the next operator enqueued again and JetStream dropped it:\n{}",
        next.logs()
    );
    assert_eq!(
        stream_messages(&stream).await,
        1,
        "one message in the stream"
    );
    let (m, headers) = read_seq(&stream, 1).await;
    assert_eq!(m.payload.as_ref(), b"once");
    let key = dlq_core::decide::redrive_key(&done);
    assert_eq!(header(&headers, "Nats-Msg-Id"), Some(key.as_str()));
}
