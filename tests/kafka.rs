//! What only Kafka does, against a real broker (Apache Kafka 4, KRaft, single node): Spring-style
//! dead-letter topic messages are parked by the source and redriven to their original topic
//! with the same key, value and headers (binary keys and values, repeated and null headers,
//! Spring's bookkeeping left out); a message over the payload limit goes to the rejected topic.
//! The scenarios every backend passes are in `tests/backends.rs`.
//!
//! One broker is shared by the tests of this binary (the JVM takes seconds to start); tests
//! isolate themselves by topic names.

use std::time::Duration;

use dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER as KEY_HEADER;
use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_testenv::brokers::shared_kafka;
use dlq_testenv::{Operator, create_dlq, decide, events_for, eventually, setup, wait_phase};
use kube::Client;
use kube::api::{Api, ListParams};
use rdkafka::Message;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

type RawHeaders = Vec<(String, Option<Vec<u8>>)>;

async fn create_topics(bootstrap: &str, names: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let topics: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| NewTopic::new(n, 1, TopicReplication::Fixed(1)))
        .collect();
    let out = admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .expect("create topics");
    for r in out {
        if let Err((name, e)) = r {
            assert!(
                e == rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                "creating topic {name}: {e}"
            );
        }
    }
}

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

async fn send(
    p: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: &[u8],
    headers: &RawHeaders,
) {
    send_value(p, topic, key, Some(value), headers).await
}

/// [`send`] of a value that may be null (a tombstone).
async fn send_value(
    p: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &RawHeaders,
) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: v.as_deref(),
        });
    }
    let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(h);
    if let Some(v) = value {
        rec = rec.payload(v);
    }
    if let Some(k) = key {
        rec = rec.key(k);
    }
    p.send(rec, Duration::from_secs(10))
        .await
        .unwrap_or_else(|(e, _)| panic!("producing to {topic}: {e}"));
}

/// Every message of `topic` (one partition) now there: read from the beginning up to its high
/// watermark, by assignment (no group to join, no waiting for silence).
async fn read_all(bootstrap: &str, topic: &str) -> Vec<OwnedMessage> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("reader-{topic}"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let (low, high) = consumer
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks");
    let mut got = Vec::new();
    if high <= low {
        return got;
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .expect("partition 0");
    consumer.assign(&tpl).expect("assign");
    loop {
        let m = tokio::time::timeout(Duration::from_secs(20), consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{topic} has messages up to offset {high} but none came"))
            .unwrap_or_else(|e| panic!("reading {topic}: {e}"));
        let offset = m.offset();
        got.push(m.detach());
        if offset + 1 >= high {
            return got;
        }
    }
}

fn headers_of(m: &OwnedMessage) -> RawHeaders {
    m.headers()
        .map(|h| {
            h.iter()
                .map(|x| (x.key.to_string(), x.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default()
}

fn h(name: &str, v: &[u8]) -> (String, Option<Vec<u8>>) {
    (name.to_string(), Some(v.to_vec()))
}

/// What Spring Kafka's DeadLetterPublishingRecoverer adds to a record it dead-letters.
fn spring_headers(origin: &str, offset: i64, class: &str, message: &str) -> RawHeaders {
    vec![
        h("kafka_dlt-original-topic", origin.as_bytes()),
        h("kafka_dlt-original-partition", &0i32.to_be_bytes()),
        h("kafka_dlt-original-offset", &offset.to_be_bytes()),
        h(
            "kafka_dlt-original-timestamp",
            &1_700_000_000_000i64.to_be_bytes(),
        ),
        h("kafka_dlt-exception-fqcn", class.as_bytes()),
        h("kafka_dlt-exception-message", message.as_bytes()),
    ]
}

/// A DeadLetterQueue `relayer` producing to `topic`, optionally consuming `dlt`.
async fn kafka_dlq(client: &Client, ns: &str, bootstrap: &str, topic: &str, dlt: Option<&str>) {
    let mut spec = json!({"target": {"kafka": {"bootstrapServers": bootstrap, "topic": topic}}});
    if let Some(dlt) = dlt {
        spec["source"] = json!({"kafka": {"topics": [dlt], "groupId": format!("dlq-{ns}")}});
    }
    create_dlq(client, ns, "relayer", spec).await;
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

async fn parked_by_id(api: &Api<DeadLetter>, n: usize) -> Vec<DeadLetter> {
    let mut items = eventually(90, "the dead-letter messages parked", || async {
        let items = records(api).await;
        (items.len() >= n).then_some(items)
    })
    .await;
    items.sort_by(|a, b| a.spec.job.id.cmp(&b.spec.job.id));
    items
}

#[tokio::test]
async fn spring_dead_letters_round_trip_to_their_origin_topic_byte_for_byte() {
    let (client, ns) = setup("kafka-spring").await;
    let kafka = shared_kafka();
    let (orders, dlt, fallback) = (
        format!("orders-{ns}"),
        format!("orders-{ns}.DLT"),
        format!("fallback-{ns}"),
    );
    create_topics(&kafka.bootstrap(), &[&orders, &dlt, &fallback]).await;
    let p = producer(&kafka.bootstrap());
    let text_headers = [
        spring_headers(&orders, 41, "java.lang.IllegalStateException", "amount < 0"),
        vec![
            h("trace", b"t-1"),
            h("tenant", b"acme"),
            // A record cannot hold CR/LF as a header: it travels as bytes, the message stays
            // what it is (not Invalid, key and headers kept).
            h("crlf", b"a\r\nInjected: 1"),
        ],
    ]
    .concat();
    let text_value = "{\"order\":1,\"note\":\"é ✓\"}".as_bytes();
    send(&p, &dlt, Some(b"order-1"), text_value, &text_headers).await;
    let bin_key: &[u8] = &[0, 255, 1, 128];
    let bin_value: &[u8] = &[0, 159, 146, 150, 255, 0];
    let bin_headers = [
        spring_headers(&orders, 42, "org.example.BadAvro", "magic byte"),
        vec![
            h("bin", &[1, 2, 255]),
            h("dup", b"a"),
            h("dup", b"b"),
            ("nil".into(), None),
        ],
    ]
    .concat();
    send(&p, &dlt, Some(bin_key), bin_value, &bin_headers).await;

    kafka_dlq(&client, &ns, &kafka.bootstrap(), &fallback, Some(&dlt)).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = parked_by_id(&api, 2).await;
    assert_eq!(items.len(), 2);
    let (text, bin) = (&items[0], &items[1]);
    assert_eq!(text.spec.job.id, format!("kafka-{dlt}-0-0"));
    assert_eq!(
        text.spec.job.payload.as_deref().map(str::as_bytes),
        Some(text_value)
    );
    assert_eq!(
        bin.spec.job.payload, None,
        "binary values are kept as payloadBase64"
    );
    let origin = text.spec.job.origin.clone().unwrap_or_default();
    assert_eq!(origin.topic.as_deref(), Some(orders.as_str()));
    assert_eq!((origin.partition, origin.offset), (Some(0), Some(41)));
    assert_eq!(
        text.spec.reason,
        "java.lang.IllegalStateException: amount < 0"
    );
    assert_eq!(bin.spec.reason, "org.example.BadAvro: magic byte");
    assert_eq!(
        text.spec.failure_kind,
        dlq_core::api::FailureKind::Transient
    );
    assert!(text.spec.job.headers.contains_key("kafka-key"));

    for r in &items {
        let name = kube::ResourceExt::name_any(r);
        wait_phase(&api, &name, Phase::Parked, 20).await;
        decide(&api, &name, Action::Redrive, "ops").await;
        wait_phase(&api, &name, Phase::Redriven, 30).await;
    }
    let back = read_all(&kafka.bootstrap(), &orders).await;
    assert_eq!(
        back.len(),
        2,
        "exactly one message each, back on the origin topic"
    );
    let without_bookkeeping = |hs: &RawHeaders| -> Vec<(String, Option<Vec<u8>>)> {
        let mut v: Vec<_> = hs
            .iter()
            .filter(|(n, _)| !n.starts_with("kafka_dlt-"))
            .cloned()
            .collect();
        v.sort();
        v
    };
    let by_key = |k: &[u8]| {
        back.iter()
            .find(|m| m.key() == Some(k))
            .unwrap_or_else(|| panic!("no message with key {k:?}"))
    };
    // The idempotency key each redrive adds beside the job's headers: one per record.
    let mut keys: Vec<String> = items.iter().map(dlq_core::decide::redrive_key).collect();
    let mut keyed = |m: &OwnedMessage| {
        let mut got = headers_of(m);
        let at = got.iter().position(|(n, _)| n == KEY_HEADER);
        let key = at
            .and_then(|i| got.remove(i).1)
            .expect("an idempotency key");
        let key = String::from_utf8(key).expect("a text key");
        let known = keys.iter().position(|k| *k == key).expect("a record's key");
        keys.remove(known);
        got.sort();
        got
    };
    let m = by_key(b"order-1");
    assert_eq!(m.payload(), Some(text_value));
    let got = keyed(m);
    assert_eq!(
        got,
        without_bookkeeping(&text_headers),
        "same headers, no kafka_dlt-*"
    );
    let m = by_key(bin_key);
    assert_eq!(m.payload(), Some(bin_value), "binary value byte for byte");
    let got = keyed(m);
    assert_eq!(
        got,
        without_bookkeeping(&bin_headers),
        "binary, repeated and null headers"
    );
    assert!(
        read_all(&kafka.bootstrap(), &fallback).await.is_empty(),
        "nothing went to the configured topic"
    );
}

/// Spring headers the apiserver refuses to hold as an origin (a partition of -1, a topic over
/// the 1024 characters an origin's topic may have) once stalled the partition; now the message is an Invalid record of
/// its exact bytes with the apiserver's words as reason, and the good one behind it parks.
#[tokio::test]
async fn forged_dead_letter_headers_become_invalid_records_and_the_partition_moves_on() {
    let (client, ns) = setup("kafka-forged").await;
    let kafka = shared_kafka();
    let (jobs, dlt) = (format!("forged-{ns}"), format!("forged-{ns}.DLT"));
    create_topics(&kafka.bootstrap(), &[&jobs, &dlt]).await;
    let p = producer(&kafka.bootstrap());
    let mut minus_one = spring_headers(&jobs, 3, "java.lang.RuntimeException", "boom");
    minus_one[1] = h("kafka_dlt-original-partition", &(-1i32).to_be_bytes());
    minus_one.push(h("trace", b"t-1"));
    let long_topic = spring_headers(&"t".repeat(1100), 4, "java.lang.RuntimeException", "boom");
    let good = spring_headers(&jobs, 5, "java.lang.RuntimeException", "boom");
    send(&p, &dlt, Some(b"k0"), b"forged partition", &minus_one).await;
    send(&p, &dlt, Some(b"k1"), b"forged topic", &long_topic).await;
    send(&p, &dlt, Some(b"k2"), b"good", &good).await;
    kafka_dlq(&client, &ns, &kafka.bootstrap(), &jobs, Some(&dlt)).await;
    let started = std::time::Instant::now();
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = parked_by_id(&api, 3).await;
    dlq_testenv::report(&format!(
        "kafka forged headers: 3 messages accounted for in {:.1}s (operator start included)",
        started.elapsed().as_secs_f64()
    ));
    let ids: Vec<&str> = items.iter().map(|r| r.spec.job.id.as_str()).collect();
    let want: Vec<String> = (0..3).map(|o| format!("kafka-{dlt}-0-{o}")).collect();
    assert_eq!(
        ids, want,
        "each message under its own address, none skipped"
    );
    for (r, (payload, refused)) in items
        .iter()
        .zip([("forged partition", "partition"), ("forged topic", "topic")])
    {
        let spec = &r.spec;
        assert_eq!(spec.failure_kind, dlq_core::api::FailureKind::Invalid);
        assert_eq!(spec.job.payload.as_deref(), Some(payload));
        assert_eq!(spec.job.origin, None, "the refused origin is left out");
        assert!(
            spec.reason.contains("apiserver refused") && spec.reason.contains(refused),
            "{}",
            spec.reason
        );
    }
    assert_eq!(
        items[0].spec.job.headers.get("trace").map(String::as_str),
        Some("t-1"),
        "the headers it could hold are kept"
    );
    assert_eq!(
        items[2].spec.failure_kind,
        dlq_core::api::FailureKind::Transient
    );
    assert_eq!(
        items[2].spec.job.origin.as_ref().and_then(|o| o.offset),
        Some(5)
    );
}

#[tokio::test]
async fn a_tombstone_is_parked_as_null_and_redriven_as_null_not_empty() {
    let (client, ns) = setup("kafka-null").await;
    let kafka = shared_kafka();
    let (jobs, dlt) = (format!("compacted-{ns}"), format!("compacted-{ns}.DLT"));
    create_topics(&kafka.bootstrap(), &[&jobs, &dlt]).await;
    let p = producer(&kafka.bootstrap());
    let headers = spring_headers(&jobs, 7, "java.lang.IllegalStateException", "no row");
    send_value(&p, &dlt, Some(b"deleted"), None, &headers).await;
    send_value(&p, &dlt, Some(b"emptied"), Some(b""), &headers).await;
    kafka_dlq(&client, &ns, &kafka.bootstrap(), &jobs, Some(&dlt)).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = parked_by_id(&api, 2).await;
    let (null, empty) = (&items[0].spec.job, &items[1].spec.job);
    assert_eq!(null.id, format!("kafka-{dlt}-0-0"));
    assert!(null.payload_null, "the tombstone is recorded as null");
    assert_eq!((&null.payload, &null.payload_base64), (&None, &None));
    assert!(!empty.payload_null);
    assert_eq!(
        empty.payload.as_deref(),
        Some(""),
        "an empty value stays empty"
    );

    for r in &items {
        let name = kube::ResourceExt::name_any(r);
        wait_phase(&api, &name, Phase::Parked, 20).await;
        decide(&api, &name, Action::Redrive, "ops").await;
        wait_phase(&api, &name, Phase::Redriven, 30).await;
    }
    let back = read_all(&kafka.bootstrap(), &jobs).await;
    assert_eq!(back.len(), 2);
    let by_key = |k: &[u8]| {
        back.iter()
            .find(|m| m.key() == Some(k))
            .map(|m| m.payload())
    };
    assert_eq!(by_key(b"deleted"), Some(None), "redriven as a tombstone");
    assert_eq!(
        by_key(b"emptied"),
        Some(Some(&b""[..])),
        "redriven as an empty value"
    );
}

#[tokio::test]
async fn a_message_over_the_payload_limit_is_copied_to_the_rejected_topic_with_the_reason() {
    let (client, ns) = setup("kafka-big").await;
    let kafka = shared_kafka();
    let (jobs, dlt) = (format!("big-{ns}"), format!("big-{ns}.DLT"));
    let rejected = format!("{dlt}.rejected");
    create_topics(&kafka.bootstrap(), &[&jobs, &dlt, &rejected]).await;
    let p = producer(&kafka.bootstrap());
    let big = vec![b'x'; 300 * 1024];
    let headers = spring_headers(&jobs, 0, "java.lang.RuntimeException", "too big");
    send(&p, &dlt, Some(b"big"), &big, &headers).await;
    send(&p, &dlt, Some(b"small"), b"small job", &headers).await;
    kafka_dlq(&client, &ns, &kafka.bootstrap(), &jobs, Some(&dlt)).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let items = parked_by_id(&api, 1).await;
    assert_eq!(items.len(), 1, "only the small message is a record");
    assert_eq!(items[0].spec.job.id, format!("kafka-{dlt}-0-1"));
    // The source handles several messages at once: the small one may be parked before the big
    // one's copy is written (its offset is stored only after that copy, in order).
    let copies = eventually(
        30,
        "the big message copied to the rejected topic",
        || async {
            let copies = read_all(&kafka.bootstrap(), &rejected).await;
            (!copies.is_empty()).then_some(copies)
        },
    )
    .await;
    assert_eq!(copies.len(), 1, "the big message copied once to {rejected}");
    assert_eq!(copies[0].payload(), Some(&big[..]), "byte for byte");
    assert_eq!(copies[0].key(), Some(&b"big"[..]));
    let reason = headers_of(&copies[0])
        .into_iter()
        .find(|(n, _)| n == "dlq-rejected-reason")
        .and_then(|(_, v)| v)
        .map(|v| String::from_utf8_lossy(&v).to_string())
        .unwrap_or_default();
    assert!(
        reason.contains("limit") || reason.contains("bytes"),
        "{reason}"
    );
    eventually(30, "a Rejected Event on the queue", || async {
        let e = events_for(&client, &ns, "relayer", "Rejected").await;
        (!e.is_empty()).then_some(())
    })
    .await;
}

/// Issue 48: a 50 MiB dead message (the test broker's `message.max.bytes` raised to 64 MiB) is
/// parked through the queue's body store (`maxBytes` 64 MiB) and redriven byte-exact: the
/// source's consumer and the target's producer are sized by the store's `maxBytes` (librdkafka
/// refuses anything over about 1 MB by default). The times are reported.
#[tokio::test]
async fn a_50_mib_dead_message_is_parked_through_the_body_store_and_redriven_byte_exact() {
    use dlq_testenv::brokers::s3::S3Server;
    const LEN: usize = 50 << 20;
    const MAX: usize = 64 << 20;
    let kafka = dlq_testenv::brokers::Kafka::start_with_max_message(MAX + (1 << 20));
    let s3 = S3Server::start();
    s3.create_bucket("dlq-bodies").await;
    let (client, ns) = setup("kafka-50mib").await;
    let (jobs, dlt) = (format!("large-{ns}"), format!("large-{ns}.DLT"));
    create_topics(&kafka.bootstrap(), &[&jobs, &dlt]).await;
    dlq_testenv::create_secret(&client, &ns, "s3", "accessKeyId", s3.access_key()).await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), &ns);
    secrets
        .patch(
            "s3",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"stringData": {"secretAccessKey": s3.secret_key()}})),
        )
        .await
        .expect("the S3 secret key");
    let spec = json!({
        "target": {"kafka": {"bootstrapServers": kafka.bootstrap(), "topic": jobs}},
        "source": {"kafka": {"topics": [dlt], "groupId": format!("dlq-{ns}")}},
        "bodies": {"maxBytes": MAX, "s3": {"bucket": "dlq-bodies", "endpoint": s3.endpoint(),
                   "region": "us-east-1", "credentialsSecretRef": {"name": "s3"}}},
    });
    create_dlq(&client, &ns, "relayer", spec).await;

    let value = dlq_testenv::backends::binary(LEN);
    let mut headers = spring_headers(&jobs, 7, "java.lang.OutOfMemoryError", "too large");
    headers.push(h("x-trace", b"t-50"));
    let big: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("acks", "all")
        .set("message.max.bytes", (MAX + (1 << 20)).to_string())
        .create()
        .expect("producer");
    send(&big, &dlt, Some(b"order-7"), &value, &headers).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let started = std::time::Instant::now();
    let items = eventually(180, "the 50 MiB dead message parked", || async {
        let items = records(&api).await;
        (!items.is_empty()).then_some(items)
    })
    .await;
    let parked_in = started.elapsed().as_secs_f64();
    let job = &items[0].spec.job;
    let body = job.body.as_deref().expect("a body reference");
    assert_eq!(body.size, LEN as i64);
    assert_eq!(body.sha256, dlq_core::body::sha256_hex(&value));
    assert!(job.payload.is_none() && job.payload_base64.is_none());
    let key = body
        .reference
        .strip_prefix("s3://dlq-bodies/")
        .expect("a reference into the bucket");
    assert_eq!(s3.list_keys("dlq-bodies", "").await, vec![key.to_string()]);

    let name = kube::ResourceExt::name_any(&items[0]);
    let started = std::time::Instant::now();
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 120).await;
    let redriven_in = started.elapsed().as_secs_f64();
    let consumer_max = (MAX + (2 << 20)).to_string();
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", format!("reader-{jobs}"))
        .set("enable.auto.commit", "false")
        .set("fetch.max.bytes", &consumer_max)
        .set("max.partition.fetch.bytes", &consumer_max)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&jobs, 0, Offset::Beginning)
        .expect("partition 0");
    consumer.assign(&tpl).expect("assign");
    let m = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
        .await
        .expect("the redriven message within 60 s")
        .expect("reading the target topic")
        .detach();
    assert!(
        m.payload() == Some(&value[..]),
        "the 50 MiB value byte-exact"
    );
    assert_eq!(m.key(), Some(&b"order-7"[..]));
    let got = headers_of(&m);
    assert!(got.contains(&h("x-trace", b"t-50")), "{got:?}");
    let (_, high) = consumer
        .fetch_watermarks(&jobs, 0, Duration::from_secs(10))
        .expect("watermarks");
    assert_eq!(high, 1, "redriven once");
    dlq_testenv::report(&format!(
        "kafka: a 50 MiB dead message parked through the store in {parked_in:.1}s (operator start included), redriven byte-exact in {redriven_in:.1}s"
    ));
}
