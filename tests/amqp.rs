//! What only RabbitMQ does, against a real rabbitmq-server: AMQP properties and typed headers
//! on redrive, unroutable jobs and missing exchanges as failures, the dead-letter queue source
//! reading `x-death` (deliveries, reason, origin), quorum delivery limits, odd headers and
//! oversize dead letters. The scenarios every backend passes (park, redrive byte for byte,
//! broker down, a crash between park and ack, many redrives) are in `tests/backends.rs`.

use std::time::{Duration, Instant};

use dlq_core::api::DEFAULT_IDEMPOTENCY_KEY_HEADER as KEY_HEADER;
use dlq_core::api::{Action, DeadLetter, FailureKind, Origin, Phase};
use dlq_testenv::brokers::{
    declare_exchange, declare_queue, drain, queue_depth, quorum_args, shared_rabbit, worker_rejects,
};
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, events_for, eventually, record, setup,
    wait_phase,
};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use lapin::options::{BasicGetOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use serde_json::json;

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v.as_bytes()))
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(k), v);
    }
    t
}

/// A Secret `amqp` with the URL and a DeadLetterQueue `relayer`.
async fn amqp_queue(
    client: &Client,
    ns: &str,
    url: &str,
    target: serde_json::Value,
    source: Option<serde_json::Value>,
) {
    create_secret(client, ns, "amqp", "url", url).await;
    let mut target = target;
    target["urlSecretRef"] = json!({"name": "amqp", "key": "url"});
    let mut spec = json!({"target": {"amqp": target}});
    if let Some(src) = source {
        spec["source"] = json!({"amqp": src});
    }
    create_dlq(client, ns, "relayer", spec).await;
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

#[tokio::test]
async fn redrive_publishes_identical_payload_and_properties_with_confirms() {
    let (client, ns) = setup("amqp-target").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    let jobs = format!("{ns}.jobs");
    declare_queue(&ch, &jobs, FieldTable::default()).await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": "", "routingKey": jobs}),
        None,
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let payload: Vec<u8> = (0u8..=255).collect();
    let typed = r#"{"x-retries":{"LongInt":3},"x-flag":{"Boolean":true}}"#;
    let headers = [
        ("content-type", "application/octet-stream"),
        ("message-id", "pi_0003/settle"),
        ("correlation-id", "corr-1"),
        ("priority", "5"),
        ("timestamp", "1700000000"),
        ("x-trace", "abc"),
        ("amqp-table", typed),
    ];
    api.create(
        &PostParams::default(),
        &record("bytes-1", "pi_0003/settle", &payload, &headers),
    )
    .await
    .unwrap();
    wait_phase(&api, "bytes-1", Phase::Parked, 20).await;
    assert_eq!(
        queue_depth(&ch, &jobs).await,
        0,
        "nothing without a decision"
    );
    decide(&api, "bytes-1", Action::Redrive, "ops").await;
    let done = wait_phase(&api, "bytes-1", Phase::Redriven, 30).await;
    assert_eq!(condition(&done, "Requeued").unwrap().0, "True");

    let got = drain(&ch, &jobs).await;
    assert_eq!(got.len(), 1, "exactly one message");
    let m = &got[0].delivery;
    assert_eq!(m.data, payload, "byte-identical payload");
    let p = &m.properties;
    assert_eq!(p.delivery_mode(), &Some(2), "persistent");
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/octet-stream"
    );
    assert_eq!(p.message_id().as_ref().unwrap().as_str(), "pi_0003/settle");
    assert_eq!(p.correlation_id().as_ref().unwrap().as_str(), "corr-1");
    assert_eq!(p.priority(), &Some(5));
    assert_eq!(p.timestamp(), &Some(1_700_000_000));
    let t = p.headers().as_ref().unwrap().inner();
    assert_eq!(t["x-trace"], s("abc"));
    assert_eq!(
        t["x-retries"],
        AMQPValue::LongInt(3),
        "typed headers keep their type"
    );
    assert_eq!(t["x-flag"], AMQPValue::Boolean(true));
    assert_eq!(
        t[KEY_HEADER],
        s(&dlq_core::decide::redrive_key(&done)),
        "the idempotency key beside them"
    );
    assert_eq!(t.len(), 4, "no other headers: {t:?}");

    // The queue's Ready condition is the broker's reachability.
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(30, "queue Ready=True", || async {
        let q = queues.get("relayer").await.ok()?;
        let s = q.status?;
        let ready = s
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready
            && s.target
                .as_deref()
                .is_some_and(|t| t.starts_with("amqp exchange (default) key")))
        .then_some(())
    })
    .await;
    let status = serde_json::to_string(&queues.get("relayer").await.unwrap().status).unwrap();
    assert!(
        !status.contains("guest:guest"),
        "no credentials in status: {status}"
    );
}

#[tokio::test]
async fn unroutable_and_missing_exchange_are_failures_not_successes() {
    let (client, ns) = setup("amqp-unroutable").await;
    let rabbit = shared_rabbit();
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": "", "routingKey": format!("{ns}.nobody-listens")}),
        None,
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &record("lost-1", "lost/1", b"x", &[]),
    )
    .await
    .unwrap();
    decide(&api, "lost-1", Action::Redrive, "ops").await;
    let r = eventually(30, "Requeued=False for an unroutable job", || async {
        let r = api.get("lost-1").await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, _, _)) if s == "False").then_some(r)
    })
    .await;
    assert_eq!(r.phase(), Phase::Parked);
    let (_, reason, message) = condition(&r, "Requeued").unwrap();
    assert_eq!(reason, "BrokerRefused");
    assert!(message.contains("unroutable"), "{message}");
    eventually(10, "RequeueFailed warning", || async {
        let e = events_for(&client, &ns, "lost-1", "RequeueFailed").await;
        e.iter()
            .any(|e| e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;

    // A record whose origin names an exchange that does not exist: the channel error is a
    // failure too, and the target keeps working for the next record.
    let mut r = record("gone-1", "gone/1", b"y", &[]);
    r.spec.job.origin = Some(Box::new(Origin {
        exchange: Some(format!("{ns}.no-such-exchange")),
        routing_key: Some("k".into()),
        ..Origin::default()
    }));
    api.create(&PostParams::default(), &r).await.unwrap();
    decide(&api, "gone-1", Action::Redrive, "ops").await;
    let r = eventually(30, "Requeued=False for a missing exchange", || async {
        let r = api.get("gone-1").await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, _, _)) if s == "False").then_some(r)
    })
    .await;
    let (_, reason, message) = condition(&r, "Requeued").unwrap();
    assert_eq!(reason, "BrokerRefused");
    assert!(message.contains("NOT_FOUND"), "{message}");
}

/// Topology of a worker queue `<ns>.orders` (bound to `<ns>.shop` with `orders.created`) whose
/// dead letters go through `<ns>.dlx` into `<ns>.orders.dlq`.
async fn dlx_topology(
    ch: &lapin::Channel,
    ns: &str,
    queue_args: Vec<(&str, AMQPValue)>,
) -> (String, String, String) {
    dlx_topology_into(ch, ns, queue_args, FieldTable::default()).await
}

/// [`dlx_topology`] with the dead-letter queue declared with `dlq_args`.
async fn dlx_topology_into(
    ch: &lapin::Channel,
    ns: &str,
    queue_args: Vec<(&str, AMQPValue)>,
    dlq_args: FieldTable,
) -> (String, String, String) {
    let (shop, dlx) = (format!("{ns}.shop"), format!("{ns}.dlx"));
    let (orders, dlq) = (format!("{ns}.orders"), format!("{ns}.orders.dlq"));
    declare_exchange(ch, &shop, ExchangeKind::Direct).await;
    declare_exchange(ch, &dlx, ExchangeKind::Fanout).await;
    let mut args = vec![("x-dead-letter-exchange", s(&dlx))];
    args.extend(queue_args);
    declare_queue(ch, &orders, table(args)).await;
    declare_queue(ch, &dlq, dlq_args).await;
    ch.queue_bind(
        orders.as_str().into(),
        shop.as_str().into(),
        "orders.created".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        dlq.as_str().into(),
        dlx.as_str().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (shop, orders, dlq)
}

async fn publish(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

#[tokio::test]
async fn a_rejected_message_becomes_a_record_from_x_death_and_redrives_to_its_origin() {
    let (client, ns) = setup("amqp-dlx").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let (shop, orders, dlq) = dlx_topology(&ch, &ns, vec![]).await;
    // The target's own address is a decoy: the record's origin must win.
    let decoy = format!("{ns}.decoy");
    declare_queue(&ch, &decoy, FieldTable::default()).await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": "", "routingKey": decoy}),
        Some(json!({"queue": dlq})),
    )
    .await;

    let body = br#"{"intent":"pi_0042","ref":"settle"}"#;
    let props = BasicProperties::default()
        .with_message_id("pi_0042/settle".into())
        .with_content_type("application/json".into())
        .with_headers(table(vec![
            ("x-trace", s("t-42")),
            ("x-attempt", AMQPValue::LongInt(7)),
        ]));
    publish(&ch, &shop, "orders.created", body, props).await;
    worker_rejects(&ch, &orders).await;
    // And a message that RabbitMQ never dead-lettered, pushed straight into the DLQ.
    let stray = b"\xff\xfenot a dead letter";
    publish(&ch, "", &dlq, stray, BasicProperties::default()).await;

    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = eventually(60, "two records", || async {
        let items = records(&api).await;
        (items.len() == 2).then_some(items)
    })
    .await;
    let r = items
        .iter()
        .find(|r| r.spec.job.id == "pi_0042/settle")
        .expect("record by message-id");
    assert_eq!(r.spec.failure_kind, FailureKind::Transient);
    assert_eq!(r.spec.deliveries, 1, "x-death count");
    assert!(
        r.spec
            .reason
            .contains(&format!("rejected by a consumer of queue {orders}")),
        "{}",
        r.spec.reason
    );
    assert!(
        r.spec.reason.contains(&format!(
            "published to exchange {shop} with routing key orders.created"
        )),
        "{}",
        r.spec.reason
    );
    let origin = r.spec.job.origin.clone().expect("origin from x-death");
    assert_eq!(origin.exchange.as_deref(), Some(shop.as_str()));
    assert_eq!(origin.routing_key.as_deref(), Some("orders.created"));
    assert_eq!(origin.queue.as_deref(), Some(orders.as_str()));
    assert_eq!(
        r.spec.job.payload.as_deref().map(str::as_bytes),
        Some(&body[..])
    );
    assert_eq!(r.spec.job.headers["x-trace"], "t-42");
    assert!(!r.spec.job.headers.contains_key("x-death"));
    let invalid = items
        .iter()
        .find(|r| r.spec.failure_kind == FailureKind::Invalid)
        .expect("invalid record");
    assert_eq!(
        invalid.spec.job.payload_bytes().unwrap(),
        stray,
        "exact bytes"
    );
    assert!(
        invalid.spec.reason.contains("not a RabbitMQ dead letter"),
        "{}",
        invalid.spec.reason
    );
    assert_eq!(invalid.labels()["dlq.dev/failure-kind"], "invalid");
    eventually(20, "the DLQ to be acked empty", || async {
        (queue_depth(&ch, &dlq).await == 0).then_some(())
    })
    .await;

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let back = drain(&ch, &orders).await;
    assert_eq!(back.len(), 1, "landed on the original queue");
    assert!(
        drain(&ch, &decoy).await.is_empty(),
        "origin wins over the target's address"
    );
    let d = &back[0].delivery;
    assert_eq!(d.data, body);
    assert_eq!(d.exchange.as_str(), shop, "through the original exchange");
    assert_eq!(d.routing_key.as_str(), "orders.created");
    assert_eq!(
        d.properties.message_id().as_ref().unwrap().as_str(),
        "pi_0042/settle"
    );
    assert_eq!(
        d.properties.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    let t = d.properties.headers().as_ref().unwrap().inner();
    assert_eq!(t["x-trace"], s("t-42"));
    assert_eq!(t["x-attempt"], AMQPValue::LongInt(7));
    assert!(
        !t.contains_key("x-death"),
        "the old death is not carried back: {t:?}"
    );
}

/// The bridge is killed after RabbitMQ handed it a dead message but before its record exists.
/// A quorum dead-letter queue hands the message out again stamped with its own
/// `x-delivery-count`: the record still says the job was delivered once (x-death's count), and
/// there is one record.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_dead_message_handed_out_again_by_a_quorum_dlq_counts_the_jobs_deliveries() {
    let (client, ns) = setup("amqp-again").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let (shop, orders, dlq) = dlx_topology_into(&ch, &ns, vec![], quorum_args()).await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": shop, "routingKey": "orders.created"}),
        Some(json!({"queue": dlq})),
    )
    .await;
    let props = BasicProperties::default().with_message_id("again-1".into());
    publish(&ch, &shop, "orders.created", b"once", props).await;
    worker_rejects(&ch, &orders).await;

    let mut op = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "amqp-before-park")]);
    op.reached_failpoint("amqp-before-park", 60).await;
    op.kill();
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    assert!(records(&api).await.is_empty(), "killed before parking");
    let _op = Operator::start(&ns);
    let r = eventually(60, "the record", || async {
        records(&api).await.into_iter().next()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(records(&api).await.len(), 1, "one record");
    assert_eq!(r.spec.job.id, "again-1");
    assert_eq!(r.spec.deliveries, 1, "x-death's count: {}", r.spec.reason);
}

#[tokio::test]
async fn a_quorum_queue_delivery_limit_dead_letter_becomes_a_record_and_redrives_back() {
    let (client, ns) = setup("amqp-quorum").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let (shop, orders, dlq) = dlx_topology(
        &ch,
        &ns,
        vec![
            ("x-queue-type", s("quorum")),
            ("x-delivery-limit", AMQPValue::LongInt(2)),
        ],
    )
    .await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": shop, "routingKey": "orders.created"}),
        Some(json!({"queue": dlq})),
    )
    .await;
    let props = BasicProperties::default()
        .with_message_id("q-1".into())
        .with_headers(table(vec![("x-trace", s("q"))]));
    publish(&ch, &shop, "orders.created", b"quorum job", props).await;
    // A worker that keeps failing: nack with requeue until the delivery limit dead-letters it.
    let mut deliveries = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while queue_depth(&ch, &dlq).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the delivery limit never dead-lettered the job"
        );
        if let Ok(Some(m)) = ch
            .basic_get(orders.as_str().into(), BasicGetOptions { no_ack: false })
            .await
        {
            deliveries += 1;
            m.delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let r = eventually(60, "the record", || async {
        records(&api).await.into_iter().next()
    })
    .await;
    dlq_testenv::report(&format!(
        "amqp quorum: worker saw {deliveries} deliveries; record says deliveries={} reason={:?}",
        r.spec.deliveries, r.spec.reason
    ));
    assert_eq!(r.spec.job.id, "q-1");
    assert_eq!(r.spec.failure_kind, FailureKind::Transient);
    assert!(
        r.spec.reason.contains("delivery limit") || r.spec.reason.contains("delivered"),
        "{}",
        r.spec.reason
    );
    // RabbitMQ 3.10 strips x-delivery-count when it dead-letters, so the count the record can
    // know is x-death's (newer brokers that keep the header give the real number).
    assert!(
        r.spec.deliveries == 1 || r.spec.deliveries == deliveries,
        "deliveries {} from x-death (worker saw {deliveries})",
        r.spec.deliveries
    );
    assert_eq!(
        r.spec.job.origin.as_ref().unwrap().queue.as_deref(),
        Some(orders.as_str())
    );
    assert!(!r.spec.job.headers.contains_key("x-delivery-count"));

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let back = eventually(10, "the job back on the quorum queue", || async {
        ch.basic_get(orders.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .ok()
            .flatten()
    })
    .await;
    assert_eq!(back.delivery.data, b"quorum job");
    assert_eq!(
        back.delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .as_str(),
        "q-1"
    );
    assert!(
        !back.delivery.redelivered,
        "a fresh delivery, not one counted against the old limit"
    );
}

/// Issue 19 through the RabbitMQ source: a header name no record header may have is carried
/// in the AMQP headers codec (a Transient record, redriven with it); a dead letter over the
/// payload limit is copied to `<dlq>.rejected`, counted and announced.
#[tokio::test]
async fn odd_headers_are_carried_and_oversize_dead_letters_are_reported() {
    let (client, ns) = setup("amqp-unusable").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let (shop, orders, dlq) = dlx_topology(&ch, &ns, vec![]).await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": "", "routingKey": orders}),
        Some(json!({"queue": dlq})),
    )
    .await;
    let body = br#"{"intent":"pi_0077"}"#;
    let bad_header = BasicProperties::default()
        .with_message_id("pi_0077/settle".into())
        .with_headers(table(vec![("bad name", s("v"))]));
    publish(&ch, &shop, "orders.created", body, bad_header).await;
    let too_big = vec![b'z'; dlq_core::api::MAX_PAYLOAD_BYTES + 10];
    publish(
        &ch,
        &shop,
        "orders.created",
        &too_big,
        BasicProperties::default(),
    )
    .await;
    for _ in 0..2 {
        worker_rejects(&ch, &orders).await;
    }

    let op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let items = eventually(60, "one record", || async {
        let items = records(&api).await;
        (!items.is_empty()).then_some(items)
    })
    .await;
    assert_eq!(items.len(), 1, "the oversize message is no record");
    let r = &items[0];
    assert_eq!(
        r.spec.failure_kind,
        FailureKind::Transient,
        "{}",
        r.spec.reason
    );
    assert_eq!(r.spec.job.payload_bytes().unwrap(), body, "exact bytes");
    assert!(
        r.spec.job.headers.values().any(|v| v.contains("bad name")),
        "the odd header travels in the codec: {:?}",
        r.spec.job.headers
    );
    eventually(30, "dlq_rejected_total counts it", || async {
        let n = op.metric("dlq_rejected_total", &[("reason", "PayloadTooLarge")]);
        (n == 1.0).then_some(())
    })
    .await;
    let rejected = format!("{dlq}.rejected");
    // Counted only after the copy is in the rejected queue.
    eventually(10, "the oversize message in the rejected queue", || async {
        (queue_depth(&ch, &rejected).await == 1).then_some(())
    })
    .await;
    let events = eventually(30, "a Rejected event on the queue", || async {
        let e = events_for(&client, &ns, "relayer", "Rejected").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    let note = events[0].note.clone().unwrap_or_default();
    assert!(note.contains(&rejected), "{note}");
    eventually(20, "the DLQ to be acked empty", || async {
        (queue_depth(&ch, &dlq).await == 0).then_some(())
    })
    .await;
}

/// A dead letter as RabbitMQ forwards it: `x-death` naming queue `orders` at `time`, plus
/// `extra` headers.
fn forwarded(time: u64, extra: Vec<(&str, AMQPValue)>) -> BasicProperties {
    let death = table(vec![
        ("queue", s("orders")),
        ("reason", s("rejected")),
        ("exchange", s("shop")),
        ("count", AMQPValue::LongLongInt(1)),
        ("time", AMQPValue::Timestamp(time)),
    ]);
    let mut headers = vec![(
        "x-death",
        AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
    )];
    headers.extend(extra);
    BasicProperties::default()
        .with_message_id("pi_0091/settle".into())
        .with_delivery_mode(2)
        .with_headers(table(headers))
}

/// At-least-once dead-lettering forwards a death again (after a restart or a lost confirm),
/// unflagged and with a new `x-death` time: once the first record is resolved, that copy is
/// still that record's message, while the same job dying after a redrive (it carries the
/// redrive's idempotency key) is its next cycle.
#[tokio::test]
async fn a_death_forwarded_twice_is_one_record_and_a_death_after_a_redrive_the_next_cycle() {
    let (client, ns) = setup("amqp-forwarded-twice").await;
    let rabbit = shared_rabbit();
    let (_conn, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let dlq = format!("{ns}.dlq");
    declare_queue(&ch, &dlq, FieldTable::default()).await;
    amqp_queue(
        &client,
        &ns,
        &rabbit.url(),
        json!({"exchange": "", "routingKey": format!("{ns}.orders")}),
        Some(json!({"queue": dlq})),
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let body = br#"{"intent":"pi_0091"}"#;
    publish(&ch, "", &dlq, body, forwarded(1_700_000_000, vec![])).await;
    let first = eventually(60, "the first death's record", || async {
        records(&api).await.into_iter().next()
    })
    .await;
    let name = first.name_any();
    decide(&api, &name, Action::Drop, "ops@example.com").await;
    wait_phase(&api, &name, Phase::Dropped, 60).await;

    publish(&ch, "", &dlq, body, forwarded(1_700_000_180, vec![])).await;
    acked_then_settled(&ch, &dlq).await;
    let after_copy = records(&api).await;
    assert_eq!(
        after_copy.len(),
        1,
        "the copy forwarded again is no record of its own: {:?}",
        after_copy.iter().map(|r| r.name_any()).collect::<Vec<_>>()
    );

    let key = vec![(KEY_HEADER, s(&format!("{}-1", first.uid().unwrap())))];
    publish(&ch, "", &dlq, body, forwarded(1_700_000_500, key)).await;
    acked_then_settled(&ch, &dlq).await;
    let mut all = records(&api).await;
    all.sort_by_key(|r| r.spec.cycle);
    let cycles: Vec<(i32, Phase)> = all.iter().map(|r| (r.spec.cycle, r.phase())).collect();
    assert_eq!(
        cycles,
        vec![(1, Phase::Dropped), (2, Phase::Parked)],
        "the death after a redrive is cycle 2"
    );
    assert!(all[1].spec.job.headers.contains_key(KEY_HEADER));
}

/// Waits until `queue` is empty (every message acked), then a moment for a stray create.
async fn acked_then_settled(ch: &lapin::Channel, queue: &str) {
    eventually(60, "the DLQ to be acked empty", || async {
        (queue_depth(ch, queue).await == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
}
