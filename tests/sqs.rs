//! Amazon SQS against ElasticMQ (an SQS-compatible server): dead letters produced by a real
//! RedrivePolicy (maxReceiveCount) are parked by the source and redriven by the target, for
//! standard and FIFO queues, with typed message attributes; the server down during redrive;
//! a SIGKILL of the operator mid-drain.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client as Sqs;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use deadletter::target::sqs::{AwsKeys, SqsConn, SqsTarget};
use deadletter::target::{JobMessage, Target};
use dlq_core::api::{Action, DeadLetter, Phase, SqsTargetSpec};
use dlq_core::headers::sqs::{ATTRIBUTES_HEADER, GROUP_HEADER};
use dlq_testenv::brokers::ElasticMq;
use dlq_testenv::brokers::elasticmq::REGION;
use dlq_testenv::{
    Operator, Outage, assert_requeue_failing_then_recovers, create_dlq, decide, eventually, record,
    redrive_many, setup, wait_phase,
};
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

/// A worker that fails everything: receives without deleting (visibility 0) until the
/// RedrivePolicy has moved every message of `url` to its dead-letter queue.
async fn fail_everything(sqs: &Sqs, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while depth(sqs, url).await > 0 {
        assert!(Instant::now() < deadline, "messages never left {url}");
        sqs.receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(0)
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
    let mq = ElasticMq::start();
    let sqs = sqs(&mq).await;
    create_queue(&sqs, &mq, "jobs-dlq", None).await;
    create_queue(&sqs, &mq, "jobs", Some(("jobs-dlq", 2))).await;
    sqs_dlq(&client, &ns, &mq, "jobs", Some("jobs-dlq")).await;
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
        .queue_url(mq.queue_url("jobs"))
        .message_body(body)
        .set_message_attributes(Some(attrs.clone()))
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url("jobs")).await;

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
        Some(mq.queue_arn("jobs").as_str())
    );
    assert_eq!(
        r.spec.deliveries, 2,
        "the consumer's receives (maxReceiveCount)"
    );
    eventually(30, "the dead message deleted from jobs-dlq", || async {
        (depth(&sqs, &mq.queue_url("jobs-dlq")).await == 0).then_some(())
    })
    .await;

    let name = kube::ResourceExt::name_any(&r);
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;
    let back = drain(&sqs, &mq.queue_url("jobs")).await;
    assert_eq!(back.len(), 1, "exactly one message back");
    assert_eq!(back[0].body(), Some(body), "byte-identical body");
    assert_eq!(attributes_of(&back[0]), attrs, "the same typed attributes");
}

#[tokio::test]
async fn fifo_keeps_the_group_and_a_retried_redrive_is_not_doubled() {
    let (client, ns) = setup("sqs-fifo").await;
    let mq = ElasticMq::start();
    let sqs = sqs(&mq).await;
    create_queue(&sqs, &mq, "jobs-dlq.fifo", None).await;
    create_queue(&sqs, &mq, "jobs.fifo", Some(("jobs-dlq.fifo", 1))).await;
    sqs_dlq(&client, &ns, &mq, "jobs.fifo", Some("jobs-dlq.fifo")).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    sqs.send_message()
        .queue_url(mq.queue_url("jobs.fifo"))
        .message_body("settle pi_0007")
        .message_group_id("payer-7")
        .message_deduplication_id("d-1")
        .send()
        .await
        .expect("send");
    fail_everything(&sqs, &mq.queue_url("jobs.fifo")).await;
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
            queue_url: mq.queue_url("jobs.fifo"),
            region: Some(REGION.into()),
            endpoint: Some(mq.endpoint()),
            ..SqsTargetSpec::default()
        },
        Some(keys()),
    );
    let mut job = JobMessage::from_job(&r.spec.job).expect("job");
    job.record_uid = r.metadata.uid.clone();
    target.requeue(&job).await.expect("retried redrive");

    let back = drain(&sqs, &mq.queue_url("jobs.fifo")).await;
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

/// ElasticMQ behind the target: restarting it starts empty, so it re-creates `jobs`, as a
/// consumer's start-up would.
struct SqsJobs<'a> {
    mq: &'a ElasticMq,
}

impl Outage for SqsJobs<'_> {
    fn name(&self) -> &str {
        "ElasticMQ"
    }

    fn stop(&mut self) {
        self.mq.stop();
    }

    async fn restart(&mut self) {
        self.mq.restart();
        create_queue(&sqs(self.mq).await, self.mq, "jobs", None).await;
    }

    async fn delivered(&mut self) -> Vec<Vec<u8>> {
        drain(&sqs(self.mq).await, &self.mq.queue_url("jobs"))
            .await
            .into_iter()
            .map(|m| m.body().unwrap_or_default().as_bytes().to_vec())
            .collect()
    }
}

#[tokio::test]
async fn server_down_keeps_records_parked_until_it_returns() {
    let (client, ns) = setup("sqs-down").await;
    let mq = ElasticMq::start();
    create_queue(&sqs(&mq).await, &mq, "jobs", None).await;
    sqs_dlq(&client, &ns, &mq, "jobs", None).await;
    let _op = Operator::start(&ns);
    let mut broker = SqsJobs { mq: &mq };
    assert_requeue_failing_then_recovers(&client, &ns, &mut broker, &[("x-n", "1")], 3).await;
}

#[tokio::test]
async fn source_survives_sigkill_mid_drain_and_parks_every_message_exactly_once() {
    const N: usize = 300;
    let (client, ns) = setup("sqs-crash").await;
    let mq = ElasticMq::start();
    let sqs = sqs(&mq).await;
    create_queue(&sqs, &mq, "jobs-dlq", None).await;
    create_queue(&sqs, &mq, "jobs", Some(("jobs-dlq", 1))).await;
    sqs_dlq(&client, &ns, &mq, "jobs", Some("jobs-dlq")).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    let mut op = Operator::start(&ns);
    let mut ids = BTreeSet::new();
    for chunk in 0..N / 10 {
        let entries: Vec<SendMessageBatchRequestEntry> = (0..10)
            .map(|j| {
                SendMessageBatchRequestEntry::builder()
                    .id(format!("e{j}"))
                    .message_body(format!("job {}", chunk * 10 + j))
                    .build()
                    .expect("entry")
            })
            .collect();
        let out = sqs
            .send_message_batch()
            .queue_url(mq.queue_url("jobs"))
            .set_entries(Some(entries))
            .send()
            .await
            .expect("send batch");
        ids.extend(out.successful().iter().map(|s| s.message_id().to_string()));
    }
    assert_eq!(ids.len(), N);
    fail_everything(&sqs, &mq.queue_url("jobs")).await;
    eventually(120, "some records", || async {
        (records(&api).await.len() >= 60).then_some(())
    })
    .await;
    op.kill();
    let at_kill = records(&api).await.len();
    assert!(at_kill < N, "the kill came mid-drain");
    let _op = Operator::start(&ns);
    eventually(
        150,
        "every message parked and deleted from jobs-dlq",
        || async {
            (records(&api).await.len() >= N && depth(&sqs, &mq.queue_url("jobs-dlq")).await == 0)
                .then_some(())
        },
    )
    .await;
    let elapsed = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let items = records(&api).await;
    assert_eq!(items.len(), N, "none lost, none doubled");
    let parked: BTreeSet<String> = items.iter().map(|r| r.spec.job.id.clone()).collect();
    assert_eq!(parked, ids, "one record per MessageId");
    dlq_testenv::report(&format!(
        "sqs source: {N} dead messages parked in {:.1}s incl. SIGKILL at {at_kill} records and a restart",
        elapsed.as_secs_f64()
    ));
}

#[tokio::test]
async fn redrive_rate() {
    let (client, ns) = setup("sqs-rate").await;
    let mq = ElasticMq::start();
    let sqs = sqs(&mq).await;
    create_queue(&sqs, &mq, "jobs", None).await;
    sqs_dlq(&client, &ns, &mq, "jobs", None).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let n = 200;
    let secs = redrive_many(&api, n, |i| {
        record(
            &format!("rate-{i}"),
            &format!("rate/{i}"),
            format!("job {i}").as_bytes(),
            &[("x-n", "1")],
        )
    })
    .await;
    assert_eq!(depth(&sqs, &mq.queue_url("jobs")).await as usize, n);
    dlq_testenv::report(&format!(
        "redrive rate sqs (ElasticMQ): {n} records in {secs:.2}s = {:.0} records/s",
        n as f64 / secs
    ));
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
            "exactly one backend (redis, amqp, nats, http, sqs or kafka)",
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
