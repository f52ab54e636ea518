//! `BENCH_PHASES=standing` (issue 47): one standing redrive of a storm, against the broker's own
//! copy loop in the same run.
//!
//! For each broker (Redis, SQS on ElasticMQ, Kafka; `BENCH_STANDING_REDIS`, `_SQS`, `_KAFKA`
//! messages, default 100,000, 20,000 and 20,000; 0 leaves a broker out) N dead messages of ONE
//! failure group wait in the broker's dead place, a queue with `maxParked`
//! (`BENCH_STANDING_MAX_PARKED`, default 5,000, the CRD's default) and its source fill up to
//! Full, then ONE `kubectl dlq redrive --group G --standing` (the release binary, as a user
//! types it) is timed until every message is back on the target, each exactly once by job
//! identity (the payload names it), read from the target itself. Measured beside it: when the
//! broker's dead place was empty (pass-through done), the records at most while it ran (a one-
//! item list each second), etcd's size before the storm (compacted and defragmented), at Full
//! and at the end, and the operator's CPU seconds per passed message. The baseline is the
//! broker's own copy of the same N messages from a dead place to a target: Redis pipelined
//! LMOVEs (1,000 a round trip), SQS receive/send/delete in batches of 10 by 16 workers (the
//! SQS source's concurrency), Kafka one consumer and one producer with every send in flight.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use deadletter::broker::sqs::{AwsKeys, SqsConn};
use dlq_core::api::DeadLetterQueue;
use dlq_core::conditions;
use dlq_core::replay::{DeadLetterReplay, ReplayPhase};
use dlq_testenv::brokers::{ElasticMq, Kafka};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::*;

type Row = (String, String, String, String);

/// The reason every message of a Kafka or SQS storm carries: one failure group.
const REASON: &str = "payer timeout after 30000ms";

/// The job identity a storm's message `i` carries in its payload (the target reads it back).
fn payload(i: usize) -> String {
    format!("{{\"intent\":\"pi_{i:06}\"}}")
}

/// One broker of the phase: where its dead messages wait and where they go back to.
enum Broker {
    Redis {
        conn: redis::aio::MultiplexedConnection,
        dead: String,
        target: String,
    },
    Sqs {
        mq: ElasticMq,
        sqs: aws_sdk_sqs::Client,
        dead: String,
        target: String,
    },
    Kafka {
        kafka: Kafka,
        dead: String,
        target: String,
        group: String,
    },
}

impl Broker {
    fn name(&self) -> &'static str {
        match self {
            Broker::Redis { .. } => "redis",
            Broker::Sqs { .. } => "sqs",
            Broker::Kafka { .. } => "kafka",
        }
    }

    /// The queue's spec: `maxParked`, its source and its target on this broker.
    fn spec(&self, max_parked: usize) -> serde_json::Value {
        match self {
            Broker::Redis { dead, .. } => {
                json!({"maxParked": max_parked, "source": {"redis": {"list": dead}}})
            }
            Broker::Sqs {
                mq, dead, target, ..
            } => json!({
                "maxParked": max_parked,
                "target": {"redis": null, "sqs": {"region": dlq_testenv::brokers::elasticmq::REGION, "endpoint": mq.endpoint(), "credentialsSecretRef": {"name": "aws"}, "queueUrl": mq.queue_url(target)}},
                "source": {"sqs": {"queueUrl": mq.queue_url(dead)}},
            }),
            Broker::Kafka {
                kafka,
                dead,
                target,
                group,
            } => json!({
                "maxParked": max_parked,
                "target": {"redis": null, "kafka": {"bootstrapServers": kafka.bootstrap(), "topic": target}},
                "source": {"kafka": {"topics": [dead], "groupId": group}},
            }),
        }
    }

    /// Puts the storm's `n` dead messages where the source reads them (`dead`), or where the
    /// baseline copies from.
    async fn fill(&mut self, dead: &str, n: usize) -> anyhow::Result<()> {
        match self {
            Broker::Redis { conn, .. } => {
                for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
                    let mut pipe = redis::pipe();
                    for i in chunk {
                        let env = json!({
                            "id": format!("storm/{i:06}"),
                            "payload": payload(*i),
                            "reason": format!("payer timeout after {}ms", 30_000 + i),
                            "failureKind": "Transient",
                        });
                        pipe.cmd("LPUSH").arg(dead).arg(env.to_string());
                    }
                    let _: () = pipe.query_async(conn).await?;
                }
            }
            Broker::Sqs { mq, sqs, .. } => {
                let url = mq.queue_url(dead);
                let reason = MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(REASON)
                    .build()?;
                let batches: Vec<Vec<usize>> = (0..n)
                    .collect::<Vec<_>>()
                    .chunks(10)
                    .map(<[usize]>::to_vec)
                    .collect();
                let sent: Vec<anyhow::Result<()>> = futures::stream::iter(batches)
                    .map(|batch| {
                        let (sqs, url, reason) = (sqs.clone(), url.clone(), reason.clone());
                        async move {
                            let entries = batch
                                .iter()
                                .map(|i| {
                                    SendMessageBatchRequestEntry::builder()
                                        .id(i.to_string())
                                        .message_body(payload(*i))
                                        .message_attributes(
                                            deadletter::source::sqs::REASON_ATTRIBUTE,
                                            reason.clone(),
                                        )
                                        .build()
                                })
                                .collect::<Result<Vec<_>, _>>()?;
                            let out = sqs
                                .send_message_batch()
                                .queue_url(&url)
                                .set_entries(Some(entries))
                                .send()
                                .await?;
                            if !out.failed().is_empty() {
                                bail!("{} of a batch not sent to {url}", out.failed().len());
                            }
                            Ok(())
                        }
                    })
                    .buffer_unordered(16)
                    .collect()
                    .await;
                sent.into_iter().collect::<anyhow::Result<()>>()?;
            }
            Broker::Kafka { kafka, target, .. } => {
                let producer: FutureProducer = kafka_config(kafka)
                    .set("acks", "all")
                    .set("linger.ms", "20")
                    .create()?;
                for chunk in (0..n).collect::<Vec<_>>().chunks(2000) {
                    let sends = chunk.iter().map(|i| {
                        let mut h = OwnedHeaders::new();
                        for (k, v) in [
                            ("kafka_dlt-original-topic", target.as_bytes().to_vec()),
                            ("kafka_dlt-original-partition", 0i32.to_be_bytes().to_vec()),
                            (
                                "kafka_dlt-original-offset",
                                (*i as i64).to_be_bytes().to_vec(),
                            ),
                            ("kafka_dlt-exception-fqcn", b"payer.Timeout".to_vec()),
                            ("kafka_dlt-exception-message", REASON.as_bytes().to_vec()),
                        ] {
                            h = h.insert(Header {
                                key: k,
                                value: Some(&v),
                            });
                        }
                        let p = payload(*i);
                        let producer = &producer;
                        async move {
                            producer
                                .send(
                                    FutureRecord::<[u8], [u8]>::to(dead)
                                        .payload(p.as_bytes())
                                        .headers(h),
                                    Duration::from_secs(30),
                                )
                                .await
                                .map(|_| ())
                                .map_err(|(e, _)| anyhow::anyhow!("producing to {dead}: {e}"))
                        }
                    });
                    for r in futures::future::join_all(sends).await {
                        r?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Dead messages still in the broker's dead place (taken but unacknowledged included).
    async fn dead_left(&mut self) -> anyhow::Result<usize> {
        Ok(match self {
            Broker::Redis { conn, dead, .. } => {
                let (a, b, c): (usize, usize, usize) = redis::pipe()
                    .atomic()
                    .cmd("LLEN")
                    .arg(&*dead)
                    .cmd("LLEN")
                    .arg(format!("{dead}:processing"))
                    .cmd("HLEN")
                    .arg(format!("{dead}:inflight"))
                    .query_async(conn)
                    .await?;
                a + b + c
            }
            Broker::Sqs { mq, sqs, dead, .. } => sqs_depth(sqs, &mq.queue_url(dead)).await?,
            Broker::Kafka {
                kafka, dead, group, ..
            } => {
                // What the operator's group committed (every second) against the end.
                let c: BaseConsumer = kafka_config(kafka).set("group.id", &*group).create()?;
                let (_, high) = c.fetch_watermarks(dead, 0, Duration::from_secs(10))?;
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(dead, 0);
                let committed = c.committed_offsets(tpl, Duration::from_secs(10))?;
                let at = match committed.elements().first().map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => 0,
                };
                usize::try_from(high - at).unwrap_or(0)
            }
        })
    }

    /// Messages on the target now.
    async fn on_target(&mut self) -> anyhow::Result<usize> {
        Ok(match self {
            Broker::Redis { conn, target, .. } => list_len(conn, target).await,
            Broker::Sqs {
                mq, sqs, target, ..
            } => sqs_depth(sqs, &mq.queue_url(target)).await?,
            Broker::Kafka { kafka, target, .. } => {
                let c: BaseConsumer = kafka_config(kafka).set("group.id", "bench").create()?;
                let (low, high) = c.fetch_watermarks(target, 0, Duration::from_secs(10))?;
                usize::try_from(high - low).unwrap_or(0)
            }
        })
    }

    /// Every payload on the target, read once.
    async fn read_target(&mut self, expected: usize) -> anyhow::Result<Vec<String>> {
        Ok(match self {
            Broker::Redis { conn, target, .. } => {
                let all: Vec<Vec<u8>> = redis::cmd("LRANGE")
                    .arg(&*target)
                    .arg(0)
                    .arg(-1)
                    .query_async(conn)
                    .await?;
                all.into_iter()
                    .map(|p| String::from_utf8_lossy(&p).into_owned())
                    .collect()
            }
            Broker::Sqs {
                mq, sqs, target, ..
            } => {
                let url = mq.queue_url(target);
                let got = Arc::new(std::sync::Mutex::new(Vec::new()));
                let readers = (0..8).map(|_| {
                    let (sqs, url, got) = (sqs.clone(), url.clone(), got.clone());
                    async move {
                        loop {
                            let out = sqs
                                .receive_message()
                                .queue_url(&url)
                                .max_number_of_messages(10)
                                .wait_time_seconds(1)
                                .send()
                                .await?;
                            let batch = out.messages.unwrap_or_default();
                            if batch.is_empty() {
                                return anyhow::Ok(());
                            }
                            delete_batch(&sqs, &url, &batch).await?;
                            let mut got = got.lock().unwrap_or_else(|e| e.into_inner());
                            got.extend(
                                batch
                                    .iter()
                                    .map(|m| m.body().unwrap_or_default().to_string()),
                            );
                        }
                    }
                });
                for r in futures::future::join_all(readers).await {
                    r?;
                }
                got.lock().unwrap_or_else(|e| e.into_inner()).clone()
            }
            Broker::Kafka { kafka, target, .. } => {
                let c: BaseConsumer = kafka_config(kafka).set("group.id", "bench").create()?;
                let (_, high) = c.fetch_watermarks(target, 0, Duration::from_secs(10))?;
                let consumer: StreamConsumer = kafka_config(kafka)
                    .set("group.id", "bench-reader")
                    .set("enable.auto.commit", "false")
                    .create()?;
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(target, 0, Offset::Beginning)?;
                consumer.assign(&tpl)?;
                let mut got = Vec::with_capacity(expected);
                while high > got.len() as i64 {
                    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                        .await
                        .context("the target topic stopped answering")??;
                    got.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
                    if m.offset() + 1 >= high {
                        break;
                    }
                }
                got
            }
        })
    }

    /// The broker's own copy of `n` dead messages from `from` to `to`: seconds.
    async fn copy(&mut self, from: &str, to: &str, n: usize) -> anyhow::Result<f64> {
        let start = Instant::now();
        match self {
            Broker::Redis { conn, .. } => loop {
                let mut pipe = redis::pipe();
                for _ in 0..1000 {
                    pipe.cmd("LMOVE").arg(from).arg(to).arg("RIGHT").arg("LEFT");
                }
                let moved: Vec<Option<Vec<u8>>> = pipe.query_async(conn).await?;
                if moved.iter().any(Option::is_none) {
                    break;
                }
            },
            Broker::Sqs { mq, sqs, .. } => {
                let (from, to) = (mq.queue_url(from), mq.queue_url(to));
                let moved = Arc::new(AtomicUsize::new(0));
                let workers = (0..16).map(|_| {
                    let (sqs, from, to, moved) =
                        (sqs.clone(), from.clone(), to.clone(), moved.clone());
                    async move {
                        while moved.load(Ordering::SeqCst) < n {
                            let out = sqs
                                .receive_message()
                                .queue_url(&from)
                                .max_number_of_messages(10)
                                .wait_time_seconds(1)
                                .send()
                                .await?;
                            let batch = out.messages.unwrap_or_default();
                            if batch.is_empty() {
                                continue;
                            }
                            let entries = batch
                                .iter()
                                .enumerate()
                                .map(|(i, m)| {
                                    SendMessageBatchRequestEntry::builder()
                                        .id(i.to_string())
                                        .message_body(m.body().unwrap_or_default())
                                        .build()
                                })
                                .collect::<Result<Vec<_>, _>>()?;
                            let sent = sqs
                                .send_message_batch()
                                .queue_url(&to)
                                .set_entries(Some(entries))
                                .send()
                                .await?;
                            if !sent.failed().is_empty() {
                                bail!("the copy loop's send failed");
                            }
                            delete_batch(&sqs, &from, &batch).await?;
                            moved.fetch_add(batch.len(), Ordering::SeqCst);
                        }
                        anyhow::Ok(())
                    }
                });
                for r in futures::future::join_all(workers).await {
                    r?;
                }
            }
            Broker::Kafka { kafka, .. } => {
                let consumer: StreamConsumer = kafka_config(kafka)
                    .set("group.id", "bench-copy")
                    .set("enable.auto.commit", "false")
                    .create()?;
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(from, 0, Offset::Beginning)?;
                consumer.assign(&tpl)?;
                let producer: FutureProducer = kafka_config(kafka)
                    .set("acks", "all")
                    .set("enable.idempotence", "true")
                    .create()?;
                let mut sends = Vec::with_capacity(n);
                for _ in 0..n {
                    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                        .await
                        .context("the copy loop's source stopped answering")??;
                    let value = m.payload().unwrap_or_default().to_vec();
                    let producer = producer.clone();
                    let to = to.to_string();
                    sends.push(async move {
                        producer
                            .send(
                                FutureRecord::<[u8], [u8]>::to(&to).payload(&value[..]),
                                Duration::from_secs(30),
                            )
                            .await
                            .map(|_| ())
                            .map_err(|(e, _)| anyhow::anyhow!("the copy loop's produce: {e}"))
                    });
                }
                for r in futures::future::join_all(sends).await {
                    r?;
                }
                let mut done = TopicPartitionList::new();
                done.add_partition_offset(from, 0, Offset::Offset(n as i64))?;
                consumer.commit(&done, rdkafka::consumer::CommitMode::Sync)?;
            }
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

fn kafka_config(kafka: &Kafka) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", kafka.bootstrap());
    c
}

/// Messages of an SQS queue, visible and in flight.
async fn sqs_depth(sqs: &aws_sdk_sqs::Client, url: &str) -> anyhow::Result<usize> {
    let a = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await?;
    let get = |k: QueueAttributeName| -> usize {
        a.attributes()
            .and_then(|m| m.get(&k))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok(get(QueueAttributeName::ApproximateNumberOfMessages)
        + get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
}

async fn delete_batch(
    sqs: &aws_sdk_sqs::Client,
    url: &str,
    batch: &[aws_sdk_sqs::types::Message],
) -> anyhow::Result<()> {
    let entries = batch
        .iter()
        .enumerate()
        .map(|(i, m)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(m.receipt_handle().unwrap_or_default())
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let out = sqs
        .delete_message_batch()
        .queue_url(url)
        .set_entries(Some(entries))
        .send()
        .await?;
    if !out.failed().is_empty() {
        bail!("{} deletes failed on {url}", out.failed().len());
    }
    Ok(())
}

/// What one broker's standing redrive did.
pub struct Outcome {
    pub broker: &'static str,
    pub n: usize,
    pub max_parked: usize,
    /// Operator start → the queue Full.
    pub full_s: f64,
    /// The command → the broker's dead place empty (pass-through done).
    pub drained_s: f64,
    /// The command → every message on the target.
    pub all_s: f64,
    /// The command → the replay Completed (None: not within the wait).
    pub completed_s: Option<f64>,
    pub passed_through: i64,
    pub redriven: i64,
    pub distinct: usize,
    pub duplicates: usize,
    pub missing: usize,
    pub records_max: usize,
    /// etcd's database (total, in use) before the storm, at Full and at the end, in bytes.
    pub etcd: [(f64, f64); 3],
    /// Operator CPU seconds from the command until the dead place was empty.
    pub operator_cpu_s: f64,
    pub baseline_s: f64,
}

impl Outcome {
    /// Messages per second through pass-through: passed over the command → drained.
    pub fn pass_rate(&self) -> f64 {
        self.passed_through as f64 / self.drained_s
    }

    pub fn baseline_rate(&self) -> f64 {
        self.n as f64 / self.baseline_s
    }
}

/// A broker of `kind` for the namespace `ns` (a fresh ElasticMQ or Kafka, the bench's Redis).
async fn broker(b: &Bench, kind: &str, ns: &str) -> anyhow::Result<Broker> {
    Ok(match kind {
        "redis" => Broker::Redis {
            conn: redis::Client::open(b.redis_url.as_str())?
                .get_multiplexed_async_connection()
                .await?,
            dead: format!("{ns}:dead"),
            target: format!("bench:{ns}"),
        },
        "sqs" => {
            // Started on this thread: the broker dies with the thread that spawned it
            // (PR_SET_PDEATHSIG), and a blocking-pool thread ends after 10 s idle.
            let mq = ElasticMq::start();
            let sqs = SqsConn {
                region: Some(dlq_testenv::brokers::elasticmq::REGION.into()),
                endpoint: Some(mq.endpoint()),
                keys: Some(AwsKeys {
                    access_key_id: "bench".into(),
                    secret_access_key: "bench".into(),
                    session_token: None,
                }),
            }
            .client(Duration::from_secs(30))
            .await;
            let (dead, target) = (format!("{ns}-dlq"), format!("{ns}-jobs"));
            for q in [
                &dead,
                &target,
                &format!("{dead}-copy"),
                &format!("{target}-copy"),
            ] {
                sqs.create_queue().queue_name(q).send().await?;
            }
            Broker::Sqs {
                mq,
                sqs,
                dead,
                target,
            }
        }
        _ => {
            let kafka = Kafka::start();
            Broker::Kafka {
                kafka,
                dead: format!("{ns}.DLT"),
                target: format!("{ns}-orders"),
                group: format!("dlq-{ns}"),
            }
        }
    })
}

/// How many records `ns` holds, from a one-item page.
async fn count(api: &Api<DeadLetter>) -> usize {
    api.list_metadata(&ListParams::default().limit(1))
        .await
        .map(|l| {
            l.items.len()
                + usize::try_from(l.metadata.remaining_item_count.unwrap_or(0)).unwrap_or(0)
        })
        .unwrap_or(0)
}

/// One broker's storm of `n`, its standing redrive and its baseline.
pub async fn run_one(
    b: &mut Bench,
    kind: &str,
    n: usize,
    max_parked: usize,
    disable: &[&str],
) -> anyhow::Result<Outcome> {
    let ns = b.namespace(&format!("standing-{kind}")).await?;
    let mut broker = broker(b, kind, &ns).await?;
    let name = broker.name();
    Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns)
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": broker.spec(max_parked) })),
        )
        .await?;
    if kind == "sqs" {
        kubectl_apply(
            &b.plane,
            &format!(
                "apiVersion: v1\nkind: Secret\nmetadata: {{name: aws, namespace: {ns}}}\nstringData: {{AWS_ACCESS_KEY_ID: bench, AWS_SECRET_ACCESS_KEY: bench}}\n"
            ),
        )?;
    }
    let dead = match &broker {
        Broker::Redis { dead, .. } | Broker::Sqs { dead, .. } | Broker::Kafka { dead, .. } => {
            dead.clone()
        }
    };
    let filled = Instant::now();
    broker.fill(&dead, n).await?;
    eprintln!(
        "standing {name}: {n} dead messages in {:.1}s",
        filled.elapsed().as_secs_f64()
    );
    super::scale::settle_etcd(&b.plane)?;
    let etcd_before = super::scale::etcd_sizes(&b.plane)?;
    let queues = Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns);
    let records = Api::<DeadLetter>::namespaced(b.client.clone(), &ns);
    let (operator, pid) = b.operator_without(&ns, disable)?;
    let started = Instant::now();
    // Full, as the queue's status says.
    loop {
        let q = queues.get("relayer").await?;
        let full = q
            .status
            .as_ref()
            .and_then(|s| conditions::find(&s.conditions, conditions::FULL))
            .is_some_and(|c| c.status == "True");
        if full {
            break;
        }
        if started.elapsed() > Duration::from_secs(900) {
            bail!("standing {name}: the queue never became Full");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let full_s = started.elapsed().as_secs_f64();
    let etcd_full = super::scale::etcd_sizes(&b.plane)?;
    let first = records.list(&ListParams::default().limit(1)).await?.items;
    let group = first
        .first()
        .and_then(dlq_core::group::labelled)
        .context("a parked record with its group")?
        .to_string();
    eprintln!(
        "standing {name}: Full after {full_s:.1}s with {} records (group {group})",
        count(&records).await
    );
    // Records at most, each second, until the end.
    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (records, most, stop) = (records.clone(), most.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                most.fetch_max(count(&records).await, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let cpu_before = super::profile::cpu_secs(pid);
    let profiled = super::profile::Sample::take(&b.plane, Some(pid));
    let t0 = Instant::now();
    // The command follows its replay until it ends: run it beside the measure, not before it.
    let mut cli = Command::new(release_bin("kubectl-dlq")?)
        .arg("--kubeconfig")
        .arg(&b.plane.kubeconfig)
        .args([
            "-n",
            &ns,
            "redrive",
            "--group",
            &group,
            "--standing",
            "--by",
            "bench",
        ])
        .args(["--note", "the storm's cause is fixed"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut drained = None;
    let deadline = Duration::from_secs(900 + (max_parked as u64) / 5);
    let mut polls = 0u64;
    let all_s = loop {
        if drained.is_none() && broker.dead_left().await? == 0 {
            drained = Some(t0.elapsed().as_secs_f64());
            eprintln!(
                "standing {name}: the dead place empty {:.1}s after the command",
                drained.unwrap_or_default()
            );
        }
        let on = broker.on_target().await?;
        if on >= n && drained.is_some() {
            break t0.elapsed().as_secs_f64();
        }
        polls += 1;
        if polls.is_multiple_of(20) {
            eprintln!(
                "standing {name}: {on} of {n} on the target after {:.0}s",
                t0.elapsed().as_secs_f64()
            );
        }
        if t0.elapsed() > deadline {
            bail!("standing {name}: {on} of {n} on the target after {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drained_s = drained.unwrap_or(all_s);
    let operator_cpu_s = super::profile::cpu_secs(pid) - cpu_before;
    if let Some(p) = profiled {
        p.report(&format!("standing {name}"), &b.plane, Some(pid), n);
    }
    let replays = Api::<DeadLetterReplay>::namespaced(b.client.clone(), &ns);
    let mut completed_s = None;
    let mut replay = None;
    let wait = Instant::now();
    while wait.elapsed() < Duration::from_secs(120) {
        let r = replays
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .next();
        if let Some(r) = &r
            && r.phase().is_final()
        {
            completed_s = (r.phase() == ReplayPhase::Completed).then(|| t0.elapsed().as_secs_f64());
            replay = Some(r.clone());
            break;
        }
        replay = r;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if cli.try_wait()?.is_none() {
        cli.kill().ok();
    }
    cli.wait().ok();
    stop.store(true, Ordering::SeqCst);
    let _ = watcher.await;
    let etcd_after = super::scale::etcd_sizes(&b.plane)?;
    let status = replay.and_then(|r| r.status).unwrap_or_default();
    if completed_s.is_none() {
        eprintln!(
            "standing {name}: the replay did not complete: {:?} {}",
            status.phase,
            status.summary.as_deref().unwrap_or_default()
        );
    }
    let got = broker.read_target(n).await?;
    let expected: HashSet<String> = (0..n).map(payload).collect();
    let distinct: HashSet<&String> = got.iter().collect();
    let missing = expected.iter().filter(|p| !distinct.contains(p)).count();
    let outcome_distinct = distinct.len();
    drop(operator);
    clear(&b.client, &ns).await?;
    // The baseline: the broker's own copy of the same n messages.
    let (from, to) = match kind {
        "sqs" => (format!("{dead}-copy"), format!("{ns}-jobs-copy")),
        "kafka" => (format!("{ns}.copy.DLT"), format!("{ns}-copy")),
        _ => (format!("{ns}:copy-dead"), format!("{ns}:copy-target")),
    };
    broker.fill(&from, n).await?;
    let baseline_s = broker.copy(&from, &to, n).await?;
    Api::<Namespace>::all(b.client.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .ok();
    Ok(Outcome {
        broker: name,
        n,
        max_parked,
        full_s,
        drained_s,
        all_s,
        completed_s,
        passed_through: status.passed_through,
        redriven: status.redriven,
        distinct: outcome_distinct,
        duplicates: got.len() - outcome_distinct,
        missing,
        records_max: most.load(Ordering::SeqCst),
        etcd: [etcd_before, etcd_full, etcd_after],
        operator_cpu_s,
        baseline_s,
    })
}

/// The phase: each broker's run, its table rows and its JSON.
pub async fn run(b: &mut Bench) -> anyhow::Result<(Vec<Row>, serde_json::Value)> {
    let max_parked = env_usize("BENCH_STANDING_MAX_PARKED", 5000);
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for (kind, var, default) in [
        ("redis", "BENCH_STANDING_REDIS", 100_000),
        ("sqs", "BENCH_STANDING_SQS", 20_000),
        ("kafka", "BENCH_STANDING_KAFKA", 20_000),
    ] {
        let n = env_usize(var, default);
        if n == 0 {
            continue;
        }
        let o = run_one(b, kind, n, max_parked, &[]).await?;
        let mib = |bytes: f64| bytes / (1024.0 * 1024.0);
        let [before, full, after] = o.etcd;
        eprintln!(
            "standing {}: {} messages, maxParked {}: Full in {:.1}s; one command: drained in {:.1}s ({:.0}/s passed through, {} passed + {} records redriven), all on the target in {:.1}s, Completed at {}; {} distinct, {} duplicates, {} missing; records at most {}; etcd total {:.1} -> {:.1} -> {:.1} MiB, in use {:.1} -> {:.1} -> {:.1} MiB; operator CPU {:.1}s ({:.0} us per passed message); the broker's own copy {:.2}s ({:.0}/s)",
            o.broker,
            o.n,
            o.max_parked,
            o.full_s,
            o.drained_s,
            o.pass_rate(),
            o.passed_through,
            o.redriven,
            o.all_s,
            o.completed_s.map_or("-".into(), |s| format!("{s:.1}s")),
            o.distinct,
            o.duplicates,
            o.missing,
            o.records_max,
            mib(before.0),
            mib(full.0),
            mib(after.0),
            mib(before.1),
            mib(full.1),
            mib(after.1),
            o.operator_cpu_s,
            1e6 * o.operator_cpu_s / o.passed_through.max(1) as f64,
            o.baseline_s,
            o.baseline_rate(),
        );
        let label = format!("{} {}", o.broker, o.n);
        rows.push((
            format!("standing {label}: passed (msg/s) vs copy"),
            format!("{:.0}", o.pass_rate()),
            format!("{:.0}", o.baseline_rate()),
            format!("{:.0}%", 100.0 * o.pass_rate() / o.baseline_rate()),
        ));
        rows.push((
            format!("standing {label}: drained / all on target (s)"),
            format!("{:.1} / {:.1}", o.drained_s, o.all_s),
            "-".into(),
            "-".into(),
        ));
        rows.push((
            format!("standing {label}: distinct/dup/missing"),
            format!("{} / {} / {}", o.distinct, o.duplicates, o.missing),
            "-".into(),
            "-".into(),
        ));
        rows.push((
            format!("standing {label}: records max / etcd +MiB"),
            format!("{} / {:.1}", o.records_max, mib(after.1 - before.1)),
            "-".into(),
            "-".into(),
        ));
        out.push(json!({
            "broker": o.broker, "messages": o.n, "max_parked": o.max_parked,
            "full_s": o.full_s, "drained_s": o.drained_s, "all_on_target_s": o.all_s,
            "completed_s": o.completed_s, "passed_through": o.passed_through,
            "redriven": o.redriven, "pass_per_s": o.pass_rate(), "distinct": o.distinct,
            "duplicates": o.duplicates, "missing": o.missing, "records_max": o.records_max,
            "etcd_total_bytes": [before.0, full.0, after.0],
            "etcd_in_use_bytes": [before.1, full.1, after.1],
            "operator_cpu_s": o.operator_cpu_s, "copy_s": o.baseline_s,
            "copy_per_s": o.baseline_rate(), "ratio": o.pass_rate() / o.baseline_rate(),
        }));
        if o.missing > 0 || o.duplicates > 0 {
            bail!(
                "standing {}: {} missing, {} duplicates on the target",
                o.broker,
                o.missing,
                o.duplicates
            );
        }
    }
    let ab = ab(b, &mut rows).await?;
    Ok((rows, json!({"runs": out, "ab": ab})))
}

/// What the sources' mechanisms for pass-through buy: the Kafka source's messages in flight
/// (`--disable=kafka_in_flight`) and the SQS source's several long polls
/// (`--disable=sqs_receivers`), each on a smaller storm (`BENCH_STANDING_AB_N`, default 5,000,
/// into `maxParked` `BENCH_STANDING_AB_MAX_PARKED`, default 100), without then with, in
/// `BENCH_STANDING_AB_ROUNDS` (default 1) rounds; 0 messages (or 0 for the broker's storm)
/// leaves it out.
async fn ab(b: &mut Bench, rows: &mut Vec<Row>) -> anyhow::Result<serde_json::Value> {
    let mut out = serde_json::Map::new();
    out.insert("send_ahead".into(), ab_ahead(b, rows).await?);
    for (broker, mechanism, storm) in [
        ("kafka", "kafka_in_flight", "BENCH_STANDING_KAFKA"),
        ("sqs", "sqs_receivers", "BENCH_STANDING_SQS"),
    ] {
        if env_usize(storm, 1) == 0 {
            continue;
        }
        out.insert(mechanism.into(), ab_one(b, rows, broker, mechanism).await?);
    }
    Ok(serde_json::Value::Object(out))
}

/// What sending a group's records' jobs ahead buys (`--disable=send_ahead`, issue 58 item 4):
/// the storm (`BENCH_STANDING_AHEAD_N`, default 20,000 Redis dead messages of one group,
/// into `maxParked` `BENCH_STANDING_AHEAD_MAX_PARKED`, default 5,000), without then with, in
/// `BENCH_STANDING_AB_ROUNDS` rounds; measured as the command → every job on the target.
/// `BENCH_STANDING_AHEAD_N=0` leaves it out.
async fn ab_ahead(b: &mut Bench, rows: &mut Vec<Row>) -> anyhow::Result<serde_json::Value> {
    let n = env_usize("BENCH_STANDING_AHEAD_N", 20_000);
    let max_parked = env_usize("BENCH_STANDING_AHEAD_MAX_PARKED", 5000);
    let rounds = env_usize("BENCH_STANDING_AB_ROUNDS", 1);
    if n == 0 {
        return Ok(json!(null));
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for off in [round % 2 == 0, round % 2 == 1] {
            let disable: &[&str] = if off { &["send_ahead"] } else { &[] };
            let o = run_one(b, "redis", n, max_parked, disable).await?;
            eprintln!(
                "standing A/B, redis {n} into maxParked {max_parked}, {}: all on the target in {:.1}s (drained in {:.1}s, {:.0} passed/s, {} records redriven), {} duplicates, {} missing",
                if off { "without send_ahead" } else { "with" },
                o.all_s,
                o.drained_s,
                o.pass_rate(),
                o.redriven,
                o.duplicates,
                o.missing
            );
            if off { &mut without } else { &mut with }.push(o.all_s);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (w, wo) = (mean(&with), mean(&without));
    rows.push((
        format!("standing A/B redis {n}: send_ahead, all on target (s)"),
        format!("{w:.1}"),
        format!("{wo:.1} without"),
        format!("{:.1}x sooner", wo / w),
    ));
    Ok(
        json!({"messages": n, "max_parked": max_parked, "with_all_s": with, "without_all_s": without}),
    )
}

async fn ab_one(
    b: &mut Bench,
    rows: &mut Vec<Row>,
    broker: &str,
    mechanism: &str,
) -> anyhow::Result<serde_json::Value> {
    let n = env_usize("BENCH_STANDING_AB_N", 5000);
    let max_parked = env_usize("BENCH_STANDING_AB_MAX_PARKED", 100);
    let rounds = env_usize("BENCH_STANDING_AB_ROUNDS", 1);
    if n == 0 {
        return Ok(json!(null));
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for off in [round % 2 == 0, round % 2 == 1] {
            let disable: &[&str] = if off { &[mechanism] } else { &[] };
            let o = run_one(b, broker, n, max_parked, disable).await?;
            eprintln!(
                "standing A/B, {broker} {n} into maxParked {max_parked}, {}: {:.0} passed/s ({} passed, drained in {:.1}s), {} duplicates, {} missing",
                if off {
                    format!("without {mechanism}")
                } else {
                    "with".to_string()
                },
                o.pass_rate(),
                o.passed_through,
                o.drained_s,
                o.duplicates,
                o.missing
            );
            if off { &mut without } else { &mut with }.push(o.pass_rate());
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (w, wo) = (mean(&with), mean(&without));
    rows.push((
        format!("standing A/B {broker} {n}: {mechanism} (msg/s)"),
        format!("{w:.0}"),
        format!("{wo:.0} without"),
        format!("{:.1}x", w / wo),
    ));
    Ok(
        json!({"messages": n, "max_parked": max_parked, "with_per_s": with, "without_per_s": without}),
    )
}
