//! What only Amazon SQS does, against ElasticMQ (an SQS-compatible server): typed message
//! attributes (numbers, binary) through park and redrive, FIFO queues keeping the message group
//! and deduplicating a retried redrive, and the apiserver's rules for SQS URLs. The scenarios
//! every backend passes are in `tests/backends.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client as Sqs;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};
use deadletter::broker::sqs::{AwsKeys, SqsConn};
use deadletter::targets::sqs::SqsTarget;
use deadletter::targets::{JobMessage, Target};
use dlq_core::api::{Action, DeadLetter, Phase, SqsTargetSpec};
use dlq_core::headers::sqs::{ATTRIBUTES_HEADER, GROUP_HEADER};
use dlq_testenv::brokers::elasticmq::REGION;
use dlq_testenv::brokers::{ElasticMq, shared_elasticmq};
use dlq_testenv::{Operator, create_dlq, decide, eventually, setup, wait_phase};
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

fn keys() -> AwsKeys {
    AwsKeys {
        access_key_id: "test-key".into(),
        secret_access_key: "test-secret".into(),
        session_token: None,
    }
}

async fn sqs(mq: &ElasticMq) -> Sqs {
    SqsConn {
        region: Some(REGION.into()),
        endpoint: Some(mq.endpoint()),
        keys: Some(keys()),
    }
    .client(Duration::from_secs(25))
    .await
}

/// Creates `name` (and, with `dlq`, a RedrivePolicy moving a message there after
/// `max_receives` receives).
async fn create_queue(sqs: &Sqs, mq: &ElasticMq, name: &str, dlq: Option<(&str, u32)>) {
    let mut req = sqs.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        req = req.attributes(QueueAttributeName::FifoQueue, "true");
    }
    if let Some((dead, max)) = dlq {
        let policy =
            json!({"deadLetterTargetArn": mq.queue_arn(dead), "maxReceiveCount": max}).to_string();
        req = req.attributes(QueueAttributeName::RedrivePolicy, policy);
    }
    req.send()
        .await
        .unwrap_or_else(|e| panic!("creating queue {name}: {e:?}"));
}

/// Messages visible plus in flight.
async fn depth(sqs: &Sqs, url: &str) -> u64 {
    let a = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .expect("queue attributes");
    let get = |k: QueueAttributeName| -> u64 {
        a.attributes()
            .and_then(|m| m.get(&k))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    get(QueueAttributeName::ApproximateNumberOfMessages)
        + get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
}

/// A worker that fails everything: receives without deleting, each message back after a
/// second, until the RedrivePolicy has moved every message of `url` to its dead-letter queue.
///
/// Not visibility 0 in a tight loop: ElasticMQ then sometimes never moves a message (twice in
/// CI, for 60 and 180 s; its issue #738), and no real worker gives a message back that fast.
async fn fail_everything(sqs: &Sqs, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while depth(sqs, url).await > 0 {
        assert!(Instant::now() < deadline, "messages never left {url}");
        sqs.receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(1)
            .wait_time_seconds(1)
            .send()
            .await
            .expect("receive");
    }
}

/// Every message of `url`, deleted as read.
async fn drain(sqs: &Sqs, url: &str) -> Vec<aws_sdk_sqs::types::Message> {
    let mut got = Vec::new();
    loop {
        let out = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .expect("receive");
        let batch = out.messages.unwrap_or_default();
        if batch.is_empty() {
            return got;
        }
        for m in &batch {
            if let Some(h) = m.receipt_handle() {
                sqs.delete_message()
                    .queue_url(url)
                    .receipt_handle(h)
                    .send()
                    .await
                    .expect("delete");
            }
        }
        got.extend(batch);
    }
}

async fn aws_secret(client: &Client, ns: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "aws"},
        "stringData": {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret"}
    }))
    .expect("a Secret");
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("creating the aws Secret");
}

/// A DeadLetterQueue `relayer` redriving to `jobs`, optionally collecting from `dead`.
async fn sqs_dlq(client: &Client, ns: &str, mq: &ElasticMq, jobs: &str, dead: Option<&str>) {
    aws_secret(client, ns).await;
    let conn = json!({"region": REGION, "endpoint": mq.endpoint(), "credentialsSecretRef": {"name": "aws"}});
    let mut target = conn.clone();
    target["queueUrl"] = json!(mq.queue_url(jobs));
    let mut spec = json!({"target": {"sqs": target}});
    if let Some(dead) = dead {
        spec["source"] = json!({"sqs": {"queueUrl": mq.queue_url(dead)}});
    }
    create_dlq(client, ns, "relayer", spec).await;
}

async fn records(api: &Api<DeadLetter>) -> Vec<DeadLetter> {
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

async fn one_record(api: &Api<DeadLetter>) -> DeadLetter {
    let found = eventually(60, "the dead message parked", || async {
        let items = records(api).await;
        (items.len() == 1)
            .then(|| items.into_iter().next())
            .flatten()
    })
    .await;
    wait_phase(api, &kube::ResourceExt::name_any(&found), Phase::Parked, 20).await
}

fn typed(data_type: &str, s: Option<&str>, b: Option<&[u8]>) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type(data_type)
        .set_string_value(s.map(str::to_string))
        .set_binary_value(b.map(Blob::new))
        .build()
        .expect("attribute")
}

fn attributes_of(m: &aws_sdk_sqs::types::Message) -> HashMap<String, MessageAttributeValue> {
    m.message_attributes().cloned().unwrap_or_default()
}

#[tokio::test]
async fn standard_queue_dead_letters_round_trip_with_typed_attributes() {
    let (client, ns) = setup("sqs-std").await;
    let mq = shared_elasticmq();
    let sqs = sqs(mq).await;
    let (jobs, dead) = (format!("{ns}-jobs"), format!("{ns}-jobs-dlq"));
    create_queue(&sqs, mq, &dead, None).await;
    create_queue(&sqs, mq, &jobs, Some((&dead, 2))).await;
    sqs_dlq(&client, &ns, mq, &jobs, Some(&dead)).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let body = "{\"intent\":\"pi_0003\",\"ref\":\"settle\"} é ✓";
    let attrs = HashMap::from([
        ("x-trace".to_string(), typed("String", Some("abc"), None)),
        ("n".to_string(), typed("Number.int", Some("42"), None)),
        (
            "blob".to_string(),
            typed("Binary", None, Some(&[0, 255, 7])),
        ),
    ]);
    sqs.send_message()
        .queue_url(mq.queue_url(&jobs))
        .message_body(body)
        .set_message_attributes(Some(attrs.clone()))
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url(&jobs)).await;

    let r = one_record(&api).await;
    assert_eq!(r.spec.job.payload.as_deref(), Some(body));
    assert_eq!(
        r.spec.job.headers.get("x-trace").map(String::as_str),
        Some("abc")
    );
    assert!(r.spec.job.headers.contains_key(ATTRIBUTES_HEADER));
    assert_eq!(
        r.spec
            .job
            .origin
            .as_ref()
            .and_then(|o| o.queue_arn.as_deref()),
        Some(mq.queue_arn(&jobs).as_str())
    );
    assert_eq!(
        r.spec.deliveries, 2,
        "the consumer's receives (maxReceiveCount)"
    );
    eventually(
        30,
        "the dead message deleted from the dead-letter queue",
        || async { (depth(&sqs, &mq.queue_url(&dead)).await == 0).then_some(()) },
    )
    .await;

    let name = kube::ResourceExt::name_any(&r);
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;
    let back = drain(&sqs, &mq.queue_url(&jobs)).await;
    assert_eq!(back.len(), 1, "exactly one message back");
    assert_eq!(back[0].body(), Some(body), "byte-identical body");
    assert_eq!(attributes_of(&back[0]), attrs, "the same typed attributes");
}

#[tokio::test]
async fn fifo_keeps_the_group_and_a_retried_redrive_is_not_doubled() {
    let (client, ns) = setup("sqs-fifo").await;
    let mq = shared_elasticmq();
    let sqs = sqs(mq).await;
    let (jobs, dead) = (format!("{ns}-jobs.fifo"), format!("{ns}-jobs-dlq.fifo"));
    create_queue(&sqs, mq, &dead, None).await;
    create_queue(&sqs, mq, &jobs, Some((&dead, 1))).await;
    sqs_dlq(&client, &ns, mq, &jobs, Some(&dead)).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    sqs.send_message()
        .queue_url(mq.queue_url(&jobs))
        .message_body("settle pi_0007")
        .message_group_id("payer-7")
        .message_deduplication_id("d-1")
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url(&jobs)).await;
    let r = one_record(&api).await;
    assert_eq!(
        r.spec.job.headers.get(GROUP_HEADER).map(String::as_str),
        Some("payer-7")
    );
    let name = kube::ResourceExt::name_any(&r);
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;

    // The same redrive again (as after a lost answer): same record, same deduplication id.
    let target = SqsTarget::new(
        &SqsTargetSpec {
            queue_url: mq.queue_url(&jobs),
            region: Some(REGION.into()),
            endpoint: Some(mq.endpoint()),
            ..SqsTargetSpec::default()
        },
        Some(keys()),
    );
    let mut job = JobMessage::from_job(&r.spec.job).expect("job");
    job.idempotency_key = Some(dlq_core::decide::redrive_key(&r));
    target.requeue(&job).await.expect("retried redrive");

    let back = drain(&sqs, &mq.queue_url(&jobs)).await;
    assert_eq!(back.len(), 1, "the retried redrive was deduplicated");
    assert_eq!(back[0].body(), Some("settle pi_0007"));
    let group = back[0]
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
        .cloned();
    assert_eq!(group.as_deref(), Some("payer-7"));
    assert!(
        attributes_of(&back[0]).is_empty(),
        "the group id is not sent as an attribute"
    );
}

#[tokio::test]
async fn the_apiserver_refuses_sqs_urls_with_credentials_and_accepts_the_documented_shape() {
    use dlq_core::api::DeadLetterQueue;
    let (client, ns) = setup("sqs-rules").await;
    let api: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let create = |name: &str, spec: serde_json::Value| {
        let q: DeadLetterQueue = serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": name}, "spec": spec
        }))
        .expect("a DeadLetterQueue");
        let api = api.clone();
        async move { api.create(&PostParams::default(), &q).await }
    };
    let url = "https://sqs.eu-west-1.amazonaws.com/123456789012/relayer";
    for (spec, want) in [
        (
            json!({"target": {"sqs": {"queueUrl": "https://key:secret@sqs.eu-west-1.amazonaws.com/1/q"}}}),
            "without credentials",
        ),
        (
            json!({"target": {"sqs": {"queueUrl": url, "endpoint": "http://k:s@127.0.0.1:9324"}}}),
            "sqs endpoint must be",
        ),
        (
            json!({"target": {"sqs": {"queueUrl": url}, "nats": {"url": "nats://n:4222", "subject": "a"}}}),
            "exactly one backend (redis, amqp, nats, http, sqs, kafka, sidekiq or pubsub)",
        ),
    ] {
        match create("bad", spec).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 422, "{s:?}");
                assert!(s.message.contains(want), "{} should say {want}", s.message);
            }
            other => panic!("expected a refusal saying {want}, got {other:?}"),
        }
    }
    create(
        "ok",
        json!({"target": {"sqs": {"queueUrl": url, "credentialsSecretRef": {"name": "aws"}}},
               "source": {"sqs": {"queueUrl": format!("{url}-dlq")}}}),
    )
    .await
    .expect("the README's shape is accepted");
}

/// Issue 35: the operator is killed between SQS's answer and the status write; the next
/// operator sends the job again with the same `MessageDeduplicationId` (from the idempotency
/// key), and the FIFO queue delivers one message.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_the_send_and_the_status_write_leaves_one_message_in_a_fifo_queue() {
    let (client, ns) = setup("sqs-kill").await;
    let mq = shared_elasticmq();
    let sqs = sqs(mq).await;
    let jobs = format!("{ns}-jobs.fifo");
    create_queue(&sqs, mq, &jobs, None).await;
    sqs_dlq(&client, &ns, mq, &jobs, None).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut op = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "after-requeue")]);
    api.create(
        &PostParams::default(),
        &dlq_testenv::record("kill-1", "pi_0011/settle", b"settle pi_0011", &[]),
    )
    .await
    .expect("creating the record");
    wait_phase(&api, "kill-1", Phase::Parked, 20).await;
    decide(&api, "kill-1", Action::Redrive, "ops").await;
    op.reached_failpoint("after-requeue", 20).await;
    op.kill();

    let next = Operator::start(&ns);
    wait_phase(&api, "kill-1", Phase::Redriven, 30).await;
    assert!(
        next.logs().contains("job requeued"),
        "the next operator sent the job again:\n{}",
        next.logs()
    );
    let back = drain(&sqs, &mq.queue_url(&jobs)).await;
    assert_eq!(back.len(), 1, "SQS dropped the second send");
    assert_eq!(back[0].body(), Some("settle pi_0011"));
}

/// A pointer message as the SQS Extended Client sends it for an object `key` of `bucket`.
fn extended_pointer(bucket: &str, key: &str) -> String {
    json!([
        "software.amazon.payloadoffloading.PayloadS3Pointer",
        {"s3BucketName": bucket, "s3Key": key}
    ])
    .to_string()
}

/// Issue 48: an SQS Extended Client message (its 5 MiB body offloaded by the producer to its
/// own bucket, which the queue declares in `externalBuckets`, the message a pointer with
/// `ExtendedPayloadSize`) is parked with the pointer inline and `spec.job.body` naming the
/// producer's object (size and digest read through the queue's S3 store credentials); a redrive checks the object and sends the pointer message
/// untouched, attributes and all, once; the sweep leaves the object alone. An object deleted
/// before the redrive refuses it (`BodyMissing`): nothing sent, the record stays Parked.
#[tokio::test]
async fn an_extended_client_pointer_references_its_object_and_is_redriven_untouched() {
    use dlq_testenv::brokers::s3::S3Server;
    const PRODUCER: &str = "producer-payloads";
    const STORE: &str = "dlq-bodies";
    let s3 = S3Server::start();
    s3.create_bucket(PRODUCER).await;
    s3.create_bucket(STORE).await;
    let object = dlq_testenv::backends::binary(5 << 20);
    let key = "payloads/6f1c1e0a-5e2b-4c1a-9d6e-2f7b9a1c0d33";
    s3.put_object(PRODUCER, key, object.clone()).await;

    let (client, ns) = setup("sqs-extended").await;
    let mq = shared_elasticmq();
    let sqs = sqs(mq).await;
    let (jobs, dead) = (format!("{ns}-jobs"), format!("{ns}-jobs-dlq"));
    create_queue(&sqs, mq, &dead, None).await;
    create_queue(&sqs, mq, &jobs, Some((&dead, 1))).await;
    aws_secret(&client, &ns).await;
    s3.credentials_secret(&client, &ns, "s3").await;
    let conn = json!({"region": REGION, "endpoint": mq.endpoint(), "credentialsSecretRef": {"name": "aws"}});
    let mut target = conn.clone();
    target["queueUrl"] = json!(mq.queue_url(&jobs));
    let spec = json!({
        "target": {"sqs": target},
        "source": {"sqs": {"queueUrl": mq.queue_url(&dead)}},
        "bodies": {"orphansAfter": "10s", "s3": {"bucket": STORE, "endpoint": s3.endpoint(),
                   "region": "us-east-1", "credentialsSecretRef": {"name": "s3"},
                   "externalBuckets": [{"bucket": PRODUCER, "prefix": "payloads/"}]}},
    });
    create_dlq(&client, &ns, "relayer", spec).await;
    let _op = Operator::start_with(&ns, &["--body-sweep-seconds=2"], &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let pointer = extended_pointer(PRODUCER, key);
    let attrs = HashMap::from([
        (
            "ExtendedPayloadSize".to_string(),
            typed("Number", Some(&object.len().to_string()), None),
        ),
        ("x-trace".to_string(), typed("String", Some("t-5"), None)),
    ]);
    sqs.send_message()
        .queue_url(mq.queue_url(&jobs))
        .message_body(&pointer)
        .set_message_attributes(Some(attrs.clone()))
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url(&jobs)).await;

    let r = one_record(&api).await;
    let job = &r.spec.job;
    assert_eq!(
        job.payload.as_deref(),
        Some(pointer.as_str()),
        "the pointer inline"
    );
    let body = job
        .body
        .as_deref()
        .expect("the producer's object referenced");
    assert!(body.external, "{body:?}");
    assert_eq!(body.reference, format!("s3://{PRODUCER}/{key}"));
    assert_eq!(body.size, object.len() as i64);
    assert_eq!(body.sha256, dlq_core::body::sha256_hex(&object));
    assert!(s3.list_keys(STORE, "").await.is_empty(), "nothing copied");

    // The sweep runs (it takes an orphan of the store's own) and leaves the producer's object.
    let orphan = dlq_core::body::object_key("", &dlq_core::body::sha256_hex(b"orphan"));
    s3.put_object(STORE, &orphan, b"orphan".to_vec()).await;
    eventually(60, "the store's orphan swept", || async {
        s3.list_keys(STORE, "").await.is_empty().then_some(())
    })
    .await;
    let name = kube::ResourceExt::name_any(&r);
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;
    let back = drain(&sqs, &mq.queue_url(&jobs)).await;
    assert_eq!(back.len(), 1, "exactly one message back");
    assert_eq!(
        back[0].body(),
        Some(pointer.as_str()),
        "the pointer untouched"
    );
    assert_eq!(attributes_of(&back[0]), attrs, "the same typed attributes");
    assert_eq!(
        s3.get_object(PRODUCER, key).await.as_deref(),
        Some(&object[..]),
        "the producer's object unchanged after the sweep and the redrive"
    );

    // Its object gone (a lifecycle rule, a consumer that deleted it): the redrive is refused.
    let second = "payloads/second";
    s3.put_object(PRODUCER, second, vec![7u8; 300_000]).await;
    let pointer = extended_pointer(PRODUCER, second);
    let attrs = HashMap::from([(
        "ExtendedPayloadSize".to_string(),
        typed("Number", Some("300000"), None),
    )]);
    sqs.send_message()
        .queue_url(mq.queue_url(&jobs))
        .message_body(&pointer)
        .set_message_attributes(Some(attrs))
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url(&jobs)).await;
    let parked = eventually(60, "the second pointer parked", || async {
        records(&api)
            .await
            .into_iter()
            .find(|d| d.spec.job.payload.as_deref() == Some(pointer.as_str()))
    })
    .await;
    assert!(parked.spec.job.body.as_deref().is_some_and(|b| b.external));
    s3.delete_object(PRODUCER, second).await;
    let name = kube::ResourceExt::name_any(&parked);
    decide(&api, &name, Action::Redrive, "ops").await;
    eventually(60, "Requeued=False BodyMissing", || async {
        let r = api.get(&name).await.ok()?;
        let (status, why, _) = dlq_testenv::condition(&r, "Requeued")?;
        (status == "False" && why == "BodyMissing" && r.phase() == Phase::Parked).then_some(())
    })
    .await;
    assert!(
        drain(&sqs, &mq.queue_url(&jobs)).await.is_empty(),
        "nothing sent"
    );
}
