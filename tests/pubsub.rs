//! What only Google Cloud Pub/Sub does, against Google's own test server (pstest, run by
//! `tools/pstest-server`): a subscription's dead-letter policy moving a message a worker keeps
//! nacking to the dead-letter topic, the operator parking it from a subscription there and
//! acknowledging it only once its record exists, and a redrive publishing the untouched data,
//! attributes and ordering key back to the origin topic. pstest adds none of the
//! `CloudPubSubDeadLetter*` attributes the real service adds; one test publishes them itself.

use std::collections::BTreeMap;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Phase};
use dlq_testenv::brokers::Pstest;
use dlq_testenv::brokers::pstest::{PROJECT, PsMessage, subscription, topic};
use dlq_testenv::{Operator, create_dlq, decide, eventually, setup, wait_phase};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const KEY_HEADER: &str = dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER;

/// Topic `jobs` with subscription `jobs` (a worker's; dead-letter policy: topic `dead` after 5
/// delivery attempts), topic `dead` with subscription `dead` (the operator's).
fn topology(ps: &Pstest, ordered: bool) {
    ps.create_topic("jobs");
    ps.create_topic("dead");
    ps.create_subscription("jobs", "jobs", Some(("dead", 5)), ordered);
    ps.create_subscription("dead", "dead", None, false);
}

/// DeadLetterQueue `relayer`: source subscription `dead`, target topic `target_topic`.
async fn pubsub_dlq(client: &Client, ns: &str, target_topic: &str) {
    create_dlq(
        client,
        ns,
        "relayer",
        json!({
            "source": {"pubsub": {"project": PROJECT, "subscription": "dead"}},
            "target": {"pubsub": {"project": PROJECT, "topic": target_topic}},
        }),
    )
    .await;
}

fn operator(ns: &str, ps: &Pstest, env: &[(&str, &str)]) -> Operator {
    let host = ps.emulator_host();
    let mut all = vec![("PUBSUB_EMULATOR_HOST", host.as_str())];
    all.extend_from_slice(env);
    Operator::start_with(ns, &[], &all)
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

async fn one_record(api: &Api<DeadLetter>) -> DeadLetter {
    let found = created(api).await;
    wait_phase(api, &found.name_any(), Phase::Parked, 20).await
}

/// The one record, as soon as it exists (marked Parked or not).
async fn created(api: &Api<DeadLetter>) -> DeadLetter {
    eventually(60, "the dead message parked", || async {
        let items = records(api).await;
        (items.len() == 1)
            .then(|| items.into_iter().next())
            .flatten()
    })
    .await
}

fn attrs(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn wait_acked(ps: &Pstest, sub: &str, secs: u64) {
    eventually(secs, "the parked message acknowledged", || async {
        (ps.pending(sub) == 0).then_some(())
    })
    .await;
}

/// The round trip: a worker nacks until pstest dead-letters the message; the operator
/// parks it (binary data, attributes, ordering key) and acknowledges it; a redrive publishes it
/// back and the worker's subscription receives identical data and attributes.
#[tokio::test]
async fn a_dead_lettered_message_parks_and_its_redrive_is_received_again() {
    let (client, ns) = setup("pubsub-trip").await;
    let ps = Pstest::start();
    topology(&ps, true);
    pubsub_dlq(&client, &ns, "jobs").await;
    let _op = operator(&ns, &ps, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let data: Vec<u8> = vec![0xff, 0x00, 0xfe, b'{', b'}', 0x80];
    let sent = PsMessage {
        data: data.clone(),
        attributes: attrs(&[("x-trace", "t-42"), ("x-tenant", "acme")]),
        ordering_key: "payer-7".into(),
    };
    let ids = ps.publish("jobs", std::slice::from_ref(&sent));
    ps.nack_until_dead("jobs", 60);

    let r = one_record(&api).await;
    dlq_testenv::report(&format!(
        "pubsub record:\n{}",
        serde_yaml::to_string(&r.spec).unwrap_or_default()
    ));
    assert_eq!(r.spec.job.id, ids[0], "the job id is the message id");
    assert_eq!(
        r.spec.job.payload, None,
        "binary data is kept as payloadBase64"
    );
    assert_eq!(r.spec.job.payload_bytes().expect("bytes"), data);
    assert_eq!(r.spec.job.headers, sent.attributes);
    assert_eq!(
        r.spec.deliveries, 0,
        "pstest adds no CloudPubSubDeadLetterSourceDeliveryCount"
    );
    let origin = r.spec.job.origin.as_deref().cloned().expect("an origin");
    assert_eq!(origin.ordering_key.as_deref(), Some("payer-7"));
    wait_acked(&ps, "dead", 30).await;

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let back = ps.drain("jobs");
    assert_eq!(back.len(), 1, "exactly one message back");
    let got = &back[0].message;
    dlq_testenv::report(&format!("received after redrive: {got:?}"));
    assert_eq!(got.data, data, "byte-identical data");
    assert_eq!(got.ordering_key, "payer-7");
    let mut want = sent.attributes.clone();
    want.insert(
        KEY_HEADER.into(),
        dlq_core::decide::redrive_key(&api.get(&r.name_any()).await.expect("record")),
    );
    assert_eq!(
        got.attributes, want,
        "the same attributes, and the idempotency key"
    );
}

/// The attributes the real service adds when it dead-letters a message: the delivery count and
/// the source subscription (whose topic the operator looks up) become the record's deliveries
/// and origin; a redrive goes to that topic, not the target's, without them.
#[tokio::test]
async fn pubsubs_dead_letter_attributes_become_the_origin_and_are_not_sent_back() {
    let (client, ns) = setup("pubsub-attrs").await;
    let ps = Pstest::start();
    topology(&ps, false);
    ps.create_topic("elsewhere");
    ps.create_subscription("elsewhere", "elsewhere", None, false);
    pubsub_dlq(&client, &ns, "elsewhere").await;
    let _op = operator(&ns, &ps, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let own = attrs(&[("x-trace", "t-7")]);
    let mut dead = own.clone();
    dead.extend(attrs(&[
        ("CloudPubSubDeadLetterSourceDeliveryCount", "5"),
        ("CloudPubSubDeadLetterSourceSubscription", "jobs"),
        ("CloudPubSubDeadLetterSourceSubscriptionProject", PROJECT),
        (
            "CloudPubSubDeadLetterSourceTopicPublishTime",
            "2026-12-03T07:00:00.000+00:00",
        ),
    ]));
    let body = b"{\"intent\":\"pi_0003\"}".to_vec();
    ps.publish(
        "dead",
        &[PsMessage {
            data: body.clone(),
            attributes: dead.clone(),
            ordering_key: "k-1".into(),
        }],
    );

    let r = one_record(&api).await;
    assert_eq!(r.spec.deliveries, 5);
    assert_eq!(
        r.spec.job.headers, dead,
        "every attribute is kept on the record"
    );
    let origin = r.spec.job.origin.as_deref().cloned().expect("an origin");
    assert_eq!(origin.subscription, Some(subscription("jobs")));
    assert_eq!(
        origin.topic,
        Some(topic("jobs")),
        "the subscription's topic"
    );
    assert!(
        r.spec.reason.contains(&subscription("jobs")),
        "{}",
        r.spec.reason
    );
    wait_acked(&ps, "dead", 30).await;

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    assert!(ps.drain("elsewhere").is_empty(), "the origin topic wins");
    let back = ps.drain("jobs");
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].message.data, body);
    assert_eq!(back[0].message.ordering_key, "k-1");
    let mut sent = back[0].message.attributes.clone();
    assert!(sent.remove(KEY_HEADER).is_some(), "the idempotency key");
    assert_eq!(
        sent, own,
        "Pub/Sub's dead-letter attributes are not sent back"
    );
}

/// Many messages dead-lettered at once: exactly that many records, every message acknowledged.
#[tokio::test]
async fn two_hundred_dead_letters_make_two_hundred_records() {
    const N: usize = 200;
    let (client, ns) = setup("pubsub-many").await;
    let ps = Pstest::start();
    topology(&ps, false);
    pubsub_dlq(&client, &ns, "jobs").await;
    let _op = operator(&ns, &ps, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let msgs: Vec<PsMessage> = (0..N)
        .map(|i| PsMessage {
            data: format!("{{\"job\":{i}}}").into_bytes(),
            attributes: attrs(&[("i", &i.to_string())]),
            ordering_key: String::new(),
        })
        .collect();
    let started = std::time::Instant::now();
    let ids = ps.publish("jobs", &msgs);
    ps.nack_until_dead("jobs", 120);
    eventually(180, "every dead message parked", || async {
        (records(&api).await.len() >= N).then_some(())
    })
    .await;
    wait_acked(&ps, "dead", 60).await;
    dlq_testenv::report(&format!(
        "{N} Pub/Sub dead letters parked and acknowledged in {:?}",
        started.elapsed()
    ));
    let mut jobs: Vec<String> = records(&api)
        .await
        .into_iter()
        .map(|r| r.spec.job.id)
        .collect();
    jobs.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(jobs, want, "one record per message, none twice");
}

/// Killed between the record and the ack: the message is redelivered to the next operator,
/// whose park finds the record by the message's identity; then it is acknowledged.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_park_and_ack_leaves_one_record_and_the_message_acked() {
    let (client, ns) = setup("pubsub-kill").await;
    let ps = Pstest::start();
    topology(&ps, false);
    pubsub_dlq(&client, &ns, "jobs").await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut op = operator(&ns, &ps, &[("DLQ_FAILPOINT", "pubsub-before-ack")]);
    ps.publish(
        "jobs",
        &[PsMessage {
            data: b"settle pi_0011".to_vec(),
            ..PsMessage::default()
        }],
    );
    ps.nack_until_dead("jobs", 60);
    op.reached_failpoint("pubsub-before-ack", 60).await;
    op.kill();
    // Created by the source before the kill; whether the killed replica also marked it Parked
    // is a race, so the next replica is the one that must.
    let r = created(&api).await;
    assert_eq!(ps.pending("dead"), 1, "not acknowledged before the kill");

    let _next = operator(&ns, &ps, &[]);
    wait_phase(&api, &r.name_any(), Phase::Parked, 30).await;
    // Redelivered once its lease (extended up to 60 s at a time) runs out.
    wait_acked(&ps, "dead", 120).await;
    let all = records(&api).await;
    assert_eq!(all.len(), 1, "the redelivery found the record");
    assert_eq!(all[0].name_any(), r.name_any());
}

#[tokio::test]
async fn the_apiserver_accepts_the_documented_pubsub_shape_and_one_backend_only() {
    let (client, ns) = setup("pubsub-rules").await;
    let api: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let queue = |name: &str, spec: serde_json::Value| -> DeadLetterQueue {
        serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": name}, "spec": spec
        }))
        .expect("a DeadLetterQueue")
    };
    let two = queue(
        "bad",
        json!({"target": {"pubsub": {"project": "p", "topic": "t"}, "nats": {"url": "nats://n:4222", "subject": "a"}}}),
    );
    match api.create(&PostParams::default(), &two).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            assert!(s.message.contains("sidekiq or pubsub"), "{}", s.message);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let ok = queue(
        "ok",
        json!({
            "source": {"pubsub": {"project": "shop", "subscription": "relayer-dead",
                                  "credentialsSecretRef": {"name": "gcp", "key": "key.json"},
                                  "jobIdAttribute": "job-id"}},
            "target": {"pubsub": {"project": "shop", "topic": "relayer"}},
        }),
    );
    api.create(&PostParams::default(), &ok)
        .await
        .expect("the documented shape is accepted");
}

/// 100 attributes, Pub/Sub's most: a message's own 96, and with them the 4 Pub/Sub adds when
/// it dead-letters it from subscription `jobs` (which pstest does not add).
fn hundred_attributes() -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let own: BTreeMap<String, String> = (0..96)
        .map(|i| (format!("attr-{i:03}"), format!("v{i}")))
        .collect();
    let mut dead = own.clone();
    dead.extend(attrs(&[
        ("CloudPubSubDeadLetterSourceDeliveryCount", "5"),
        ("CloudPubSubDeadLetterSourceSubscription", "jobs"),
        ("CloudPubSubDeadLetterSourceSubscriptionProject", PROJECT),
        (
            "CloudPubSubDeadLetterSourceTopicPublishTime",
            "2026-12-07T07:00:00.000+00:00",
        ),
    ]));
    assert_eq!(dead.len(), 100);
    (own, dead)
}

/// What a redrive of record `name` must deliver: `own` attributes and the idempotency key.
async fn with_key(
    api: &Api<DeadLetter>,
    name: &str,
    own: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut want = own;
    let record = api.get(name).await.expect("record");
    want.insert(KEY_HEADER.into(), dlq_core::decide::redrive_key(&record));
    want
}

/// Issue #57 (7): a message with 100 attributes (Pub/Sub's limit; a record holds 64 headers)
/// was left in the subscription, redelivered for as long as it kept it, with only a Rejected
/// Event. It is parked within seconds as an Invalid record whose payload is the whole message
/// (data, every attribute, ordering key, as JSON), whose headers and reason a person reads, and
/// the subscription is emptied; its redrive publishes the very same message to its origin topic.
#[tokio::test]
async fn a_message_with_more_attributes_than_a_record_holds_is_parked_whole_and_redriven_as_it_was()
{
    use dlq_core::headers::pubsub::{WHOLE_HEADER, Whole};
    let (client, ns) = setup("pubsub-many-attrs").await;
    let ps = Pstest::start();
    topology(&ps, false);
    pubsub_dlq(&client, &ns, "jobs").await;
    let _op = operator(&ns, &ps, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let (own, dead) = hundred_attributes();
    let data: Vec<u8> = vec![0xff, 0x00, b'{', b'}', 0x80];
    let started = std::time::Instant::now();
    let ids = ps.publish(
        "dead",
        &[PsMessage {
            data: data.clone(),
            attributes: dead.clone(),
            ordering_key: "k-100".into(),
        }],
    );

    let r = one_record(&api).await;
    wait_acked(&ps, "dead", 30).await;
    let parked_in = started.elapsed();
    dlq_testenv::report(&format!(
        "a message of 100 attributes parked whole and acknowledged in {parked_in:.1?}; reason: {}",
        r.spec.reason
    ));
    assert!(parked_in.as_secs() < 30, "{parked_in:?}");
    assert_eq!(r.spec.failure_kind, dlq_core::api::FailureKind::Invalid);
    assert_eq!(r.spec.job.id, ids[0], "the job id is the message id");
    assert_eq!(r.spec.deliveries, 5);
    let origin = r.spec.job.origin.as_deref().cloned().expect("an origin");
    assert_eq!(origin.topic, Some(topic("jobs")));
    let payload = r.spec.job.payload.as_deref().expect("JSON a person reads");
    let whole = Whole::from_payload(payload.as_bytes()).expect("the whole message");
    assert_eq!(whole.attributes, dead, "every attribute");
    assert_eq!(whole.data_bytes().expect("data"), data);
    assert_eq!(whole.ordering_key, "k-100");
    assert_eq!(
        r.spec.job.headers.len(),
        64,
        "as many headers as a record holds"
    );
    assert_eq!(
        r.spec.job.headers.get(WHOLE_HEADER).map(String::as_str),
        Some("json")
    );
    assert_eq!(
        r.spec
            .job
            .headers
            .get("CloudPubSubDeadLetterSourceDeliveryCount"),
        Some(&"5".to_string())
    );
    assert!(
        r.spec.reason.contains("its 100 attributes")
            && r.spec.reason.contains("100 headers; at most 64")
            && r.spec.reason.contains(&subscription("jobs")),
        "{}",
        r.spec.reason
    );
    let rejected = dlq_testenv::events_for(&client, &ns, "relayer", "Rejected").await;
    assert!(rejected.is_empty(), "{rejected:?}");

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let back = ps.drain("jobs");
    assert_eq!(back.len(), 1, "exactly one message back");
    let got = &back[0].message;
    assert_eq!(got.data, data, "byte-identical data");
    assert_eq!(got.ordering_key, "k-100");
    assert_eq!(
        got.attributes,
        with_key(&api, &r.name_any(), own).await,
        "its own 96 attributes and the idempotency key"
    );
}

/// Issue #57 (7): parked whole, a message larger than a record holds (300 KiB of data beside its
/// 100 attributes) goes to the queue's body store like any large message: the record holds the
/// reference, the bucket the whole message as JSON, and its redrive publishes the very message.
#[tokio::test]
async fn a_large_message_with_more_attributes_than_a_record_holds_is_kept_whole_in_the_store() {
    use dlq_core::headers::pubsub::{WHOLE_HEADER, Whole};
    use dlq_testenv::brokers::s3::S3Server;
    const BUCKET: &str = "dlq-bodies";
    let (client, ns) = setup("pubsub-whole-store").await;
    let ps = Pstest::start();
    topology(&ps, false);
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    s3.credentials_secret(&client, &ns, "s3").await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "source": {"pubsub": {"project": PROJECT, "subscription": "dead"}},
            "target": {"pubsub": {"project": PROJECT, "topic": "jobs"}},
            "bodies": {"thresholdBytes": 65536,
                       "s3": {"bucket": BUCKET, "endpoint": s3.endpoint(), "region": "us-east-1",
                              "credentialsSecretRef": {"name": "s3"}}},
        }),
    )
    .await;
    let _op = operator(&ns, &ps, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let (own, dead) = hundred_attributes();
    let data = vec![b'x'; 300 << 10];
    ps.publish(
        "dead",
        &[PsMessage {
            data: data.clone(),
            attributes: dead.clone(),
            ordering_key: String::new(),
        }],
    );

    let r = one_record(&api).await;
    wait_acked(&ps, "dead", 30).await;
    assert_eq!(r.spec.failure_kind, dlq_core::api::FailureKind::Invalid);
    assert!(r.spec.job.payload.is_none() && r.spec.job.payload_base64.is_none());
    assert_eq!(
        r.spec.job.headers.get(WHOLE_HEADER).map(String::as_str),
        Some("json")
    );
    let body = r
        .spec
        .job
        .body
        .as_deref()
        .expect("a reference into the store");
    let key = body
        .reference
        .strip_prefix(&format!("s3://{BUCKET}/"))
        .unwrap_or_else(|| panic!("a reference into the bucket: {}", body.reference));
    let stored = s3.get_object(BUCKET, key).await.expect("the stored body");
    let whole = Whole::from_payload(&stored).expect("the whole message");
    assert_eq!(whole.attributes, dead, "every attribute");
    assert!(whole.data_bytes().expect("data") == data, "the exact data");

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let back = ps.drain("jobs");
    assert_eq!(back.len(), 1, "exactly one message back");
    assert!(back[0].message.data == data, "byte-identical data");
    assert_eq!(
        back[0].message.attributes,
        with_key(&api, &r.name_any(), own).await,
        "its own 96 attributes and the idempotency key"
    );
}
