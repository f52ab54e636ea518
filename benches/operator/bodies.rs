//! `BENCH_PHASES=bodies` (issue 48): the body store against a real S3-compatible server
//! (versitygw, `dlq_testenv::brokers::S3Server`), each figure beside a baseline measured in the
//! same run.
//!
//! - **park and redrive** through the Redis source and target, bodies of 1 KiB, 256 KiB and
//!   10 MiB (`BENCH_BODIES_N`, default "2000,500,20" records each; 0 leaves a size out), in
//!   `BENCH_BODIES_ROUNDS` (default 2) rounds whose order rotates. Park: the dead messages wait
//!   on a staging list while the operator idles on an empty dead list (one warm-up message has
//!   gone through the whole path); a RENAME hands them all over at once, and the rate runs until
//!   the last one has left Redis (a message leaves only once its record exists). Redrive: a
//!   bulk decision on all of them, until all are Redriven and on the target list. 1 KiB is
//!   below the threshold, so it is compared with the same queue without a store (ratio ~1) and
//!   with plain creates of its record; 256 KiB and 10 MiB with the plain client doing the same
//!   writes (the object PUT as the operator puts it, one PUT up to 8 MiB and 8 MiB parts above,
//!   then the record's create; for redrive the decision patch, a GET, an LPUSH and the status
//!   patch), and with each half alone: the store's own PUT / GET of the same bytes through
//!   object_store in this process, and the apiserver's creates / redrive writes of the record.
//!   Park ceilings run at the Redis source's concurrency (32), redrive ceilings at `BENCH_C`.
//!   The CPU each process spent per record is printed with each.
//! - **etcd bytes per record** of 64 KiB bodies with a store and without (`BENCH_BODIES_ETCD_N`,
//!   default 1,000): parked by the operator through the Redis source and marked, etcd
//!   compacted and defragmented before and after, the in-use size's growth per record, then
//!   again once their Parked Events are deleted (the Events' share); and the stored value of a
//!   record read from etcd itself (the mean of 50).
//! - **apiserver RSS** with `BENCH_BODIES_RSS_N` (default 20,000) records of 64 KiB bodies
//!   parked with a store, then `BENCH_BODIES_RSS_NONE_N` without a store (default the same): the apiserver
//!   restarted first (its RSS then), right after the operator parked and marked them, and once
//!   more restarted over them (what holding them costs, without what writing them left
//!   behind).
//!
//! The bench's queues have `thresholdBytes` 32 KiB: a body goes to the store when it is over the
//! threshold, and 64 KiB is not over the default (65,536).

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use dlq_core::api::{BodyRef, DeadLetterQueue};
use dlq_testenv::brokers::S3Server;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use redis::aio::MultiplexedConnection;

use super::scale::{etcd_bytes, etcd_post, settle_etcd};
use super::*;

type Row = (String, String, String, String);

/// The bucket of the operator's bodies (a prefix per namespace).
const BUCKET: &str = "bench-bodies";
/// The bucket of the store ceilings' objects.
const CEILING_BUCKET: &str = "bench-ceiling";
/// The bench queues' `thresholdBytes` (see the module's doc).
const THRESHOLD: usize = 32 * 1024;
/// Payload of the etcd and RSS points.
const POINT_BYTES: usize = 64 * 1024;
/// The body sizes of the throughput runs, paired with `BENCH_BODIES_N`.
const SIZES: [usize; 3] = [1024, 256 * 1024, 10 * 1024 * 1024];

/// What the phase runs against besides the bench's control plane and Redis.
struct Env {
    s3: S3Server,
    /// The ceilings' client (object_store, as the operator's).
    store: Arc<dyn ObjectStore>,
    redis: MultiplexedConnection,
}

fn size_label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// A rate with the precision its size deserves (10 MiB runs make a few records a second).
fn fmt_rate(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

fn row(label: &str, a: f64, b: f64) -> Row {
    (
        label.to_string(),
        fmt_rate(a),
        fmt_rate(b),
        format!("{:.0}%", 100.0 * a / b),
    )
}

/// `size` bytes that differ per `seed` (objects are content-addressed: equal bodies would share
/// one).
fn body(seed: &str, size: usize) -> String {
    let mut s = format!("{seed}/");
    s.push_str(&"x".repeat(size.saturating_sub(s.len())));
    s.truncate(size);
    s
}

fn job_id(i: usize) -> String {
    format!("bench/{i:06}")
}

fn envelope(id: &str, payload: &str) -> String {
    json!({"id": id, "payload": payload, "reason": "bench"}).to_string()
}

async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    // Replies of tens of MiB on a busy machine: far from redis-rs's default timeout.
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(300)));
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await?)
}

// --- CPU per record -------------------------------------------------------------------------

/// Processes whose CPU time a measure reads.
fn pids(b: &Bench, env: &Env, operator: Option<u32>) -> Vec<(&'static str, u32)> {
    let mut p = Vec::new();
    if let Some(pid) = operator {
        p.push(("operator", pid));
    }
    p.push(("apiserver", b.plane.apiserver_pid()));
    p.push(("etcd", b.plane.etcd_pid()));
    if let Some(pid) = env.s3.pid() {
        p.push(("s3", pid));
    }
    p.push(("redis", b.redis_pid));
    p.push(("bench", std::process::id()));
    p
}

struct CpuStart(Vec<(&'static str, u32, f64)>);

impl CpuStart {
    fn take(pids: &[(&'static str, u32)]) -> CpuStart {
        CpuStart(
            pids.iter()
                .map(|&(who, pid)| (who, pid, profile::cpu_secs(pid)))
                .collect(),
        )
    }

    /// CPU seconds each process spent since.
    fn spent(&self) -> Vec<(&'static str, f64)> {
        self.0
            .iter()
            .map(|&(who, pid, secs)| (who, (profile::cpu_secs(pid) - secs).max(0.0)))
            .collect()
    }
}

/// CPU seconds per kind of measure, summed over its rounds.
#[derive(Default)]
struct CpuLog(BTreeMap<&'static str, (usize, BTreeMap<&'static str, f64>)>);

impl CpuLog {
    fn add(&mut self, kind: &'static str, n: usize, spent: Vec<(&'static str, f64)>) {
        let e = self.0.entry(kind).or_default();
        e.0 += n;
        for (who, secs) in spent {
            *e.1.entry(who).or_default() += secs;
        }
    }

    /// Milliseconds of CPU per record, per process.
    fn per_record(&self, kind: &str) -> Vec<(&'static str, f64)> {
        self.0.get(kind).map_or_else(Vec::new, |(n, cpu)| {
            cpu.iter()
                .map(|(who, secs)| (*who, 1000.0 * secs / (*n).max(1) as f64))
                .collect()
        })
    }

    fn line(&self, kind: &str) -> String {
        self.per_record(kind)
            .iter()
            .map(|(who, ms)| format!("{who} {ms:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn json(&self) -> serde_json::Value {
        self.0
            .keys()
            .map(|kind| {
                let per: serde_json::Map<String, serde_json::Value> = self
                    .per_record(kind)
                    .into_iter()
                    .map(|(who, ms)| (who.to_string(), json!(ms)))
                    .collect();
                (kind.to_string(), serde_json::Value::Object(per))
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

// --- Redis ------------------------------------------------------------------------------------

/// The queue's dead list (its source's).
fn dead_list(ns: &str) -> String {
    format!("{ns}:dead")
}

/// Messages still in Redis: on the dead list, moved to processing, or taken and not yet
/// acknowledged (read in one transaction, so a message moving between them counts once).
async fn left(redis: &mut MultiplexedConnection, dead: &str) -> anyhow::Result<usize> {
    let (d, p, i): (usize, usize, usize) = redis::pipe()
        .atomic()
        .cmd("LLEN")
        .arg(dead)
        .cmd("LLEN")
        .arg(format!("{dead}:processing"))
        .cmd("HLEN")
        .arg(format!("{dead}:inflight"))
        .query_async(redis)
        .await?;
    Ok(d + p + i)
}

/// Until no message of `dead` is left in Redis: the seconds it took.
async fn drained(
    redis: &mut MultiplexedConnection,
    dead: &str,
    start: Instant,
    limit: Duration,
) -> anyhow::Result<f64> {
    loop {
        if left(redis, dead).await? == 0 {
            return Ok(start.elapsed().as_secs_f64());
        }
        if start.elapsed() > limit {
            bail!("{dead} was not drained in {} s", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// LPUSHes envelopes of jobs `ids` with `size`-byte bodies (seeded `seed`) onto `list`, about
/// 32 MiB a round trip. With `backlog`, first waits while `list` holds more than that many (so
/// Redis does not hold a whole 20,000 x 64 KiB point at once).
async fn push(
    redis: &mut MultiplexedConnection,
    list: &str,
    ids: std::ops::Range<usize>,
    seed: &str,
    size: usize,
    backlog: Option<usize>,
) -> anyhow::Result<()> {
    let per = ((32 << 20) / size.max(1)).clamp(1, 1000);
    let ids: Vec<usize> = ids.collect();
    for chunk in ids.chunks(per) {
        if let Some(max) = backlog {
            while list_len(redis, list).await > max {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let mut pipe = redis::pipe();
        for &i in chunk {
            let id = job_id(i);
            let payload = body(&format!("{seed}/{id}"), size);
            pipe.cmd("LPUSH").arg(list).arg(envelope(&id, &payload));
        }
        let _: () = pipe.query_async(redis).await?;
    }
    Ok(())
}

// --- Queues and records -----------------------------------------------------------------------

/// A namespace whose queue `relayer` has the Redis source on [`dead_list`] (and the Redis target
/// `bench:<ns>`) and, with `store`, its bodies over [`THRESHOLD`] in [`BUCKET`] under `<ns>/`.
async fn queue_ns(b: &mut Bench, env: &Env, prefix: &str, store: bool) -> anyhow::Result<String> {
    let ns = b.namespace(prefix).await?;
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"},
        "stringData": {"accessKeyId": env.s3.access_key(), "secretAccessKey": env.s3.secret_key()},
    });
    Api::<Secret>::namespaced(b.client.clone(), &ns)
        .create(&PostParams::default(), &serde_json::from_value(secret)?)
        .await?;
    let mut spec = json!({"source": {"redis": {"list": dead_list(&ns)}}});
    if store {
        spec["bodies"] = json!({
            "thresholdBytes": THRESHOLD,
            "s3": {"bucket": BUCKET, "prefix": format!("{ns}/"), "endpoint": env.s3.endpoint(),
                   "region": dlq_testenv::brokers::s3::REGION, "credentialsSecretRef": {"name": "s3"}},
        });
    }
    Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns)
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await?;
    Ok(ns)
}

/// The record the source writes for job `i` of a `size`-byte body: the payload inline, or
/// (`stored`: the body's bytes) the reference to its object.
fn record_of(i: usize, size: usize, stored: Option<&[u8]>, ns: &str) -> DeadLetter {
    let Some(bytes) = stored else {
        return plain_record(i, size, true);
    };
    let mut r = plain_record(i, 0, true);
    r.spec.job.payload = None;
    let sha256 = dlq_core::body::sha256_hex(bytes);
    r.spec.job.body = Some(Box::new(BodyRef {
        reference: format!("s3://{BUCKET}/{ns}/sha256/{sha256}"),
        size: i64::try_from(bytes.len()).unwrap_or(i64::MAX),
        sha256,
        recipient: None,
        external: false,
    }));
    r
}

/// Records in `ns` (from a one-item page and its remainingItemCount).
async fn count(api: &Api<DeadLetter>) -> anyhow::Result<usize> {
    let l = api.list_metadata(&ListParams::default().limit(1)).await?;
    let rest = l.metadata.remaining_item_count.unwrap_or(0);
    Ok(l.items.len() + usize::try_from(rest).unwrap_or(0))
}

/// Until the operator has marked every record of `api` (none left with a create's managed
/// fields).
async fn all_marked(api: &Api<DeadLetter>, limit: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    while super::any_unmarked(api).await? {
        if start.elapsed() > limit {
            bail!("records not all marked in {} s", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// [`clear`] with a deadline that grows with the records (20,000 take longer than 2 minutes).
async fn clear_many(client: &Client, ns: &str, n: usize) -> anyhow::Result<()> {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    // The apiserver keeps deleting after a client gives up on a long delete-collection (100,000
    // records outlast the client's 2-minute read timeout): the count below decides.
    if let Err(e) = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
    {
        eprintln!("bodies: deleting the records of {ns}: {e}; waiting for them to go");
    }
    let limit = Duration::from_secs(120 + (n / 50) as u64);
    let start = Instant::now();
    while count(&api).await.unwrap_or(1) > 0 {
        if start.elapsed() > limit {
            bail!(
                "the records of {ns} were not deleted in {} s",
                limit.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

async fn drop_namespace(b: &Bench, ns: &str) {
    Api::<Namespace>::all(b.client.clone())
        .delete(ns, &DeleteParams::default())
        .await
        .ok();
}

// --- The throughput runs ----------------------------------------------------------------------

/// What is measured in one turn of a round: a park-side and a redrive-side rate.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// The operator, a queue with a store.
    Store,
    /// The operator, the same queue without one.
    NoStore,
    /// Plain creates of the records the operator writes, then the redrive's apiserver writes.
    Records,
    /// The store alone: object_store PUTs of the same bodies, then GETs.
    Objects,
    /// Both halves from a plain client: PUT then create; decision, GET, LPUSH, status.
    Both,
}

impl Kind {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Kind::Store => ("park-store", "redrive-store"),
            Kind::NoStore => ("park-none", "redrive-none"),
            Kind::Records => ("create", "writes"),
            Kind::Objects => ("put", "get"),
            Kind::Both => ("put+create", "get+writes"),
        }
    }
}

/// The operator's park through the Redis source of `n` bodies of `size` bytes, then its
/// redrive of them; the CPU of each half is logged.
async fn operator_run(
    b: &mut Bench,
    env: &mut Env,
    size: usize,
    n: usize,
    store: bool,
    cpu: &mut CpuLog,
) -> anyhow::Result<(f64, f64)> {
    let kind = if store { Kind::Store } else { Kind::NoStore };
    let ns = queue_ns(
        b,
        env,
        if store { "bodies-store" } else { "bodies-none" },
        store,
    )
    .await?;
    let (op, pid) = b.operator(&ns)?;
    let dead = dead_list(&ns);
    let staging = format!("{ns}:staging");
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    // Warm-up: one message through the whole path (the source's blocking take, the store's
    // client and connection).
    let warm = envelope("warm", &body(&format!("{ns}/warm"), size));
    let _: () = redis::cmd("LPUSH")
        .arg(&dead)
        .arg(warm)
        .query_async(&mut env.redis)
        .await?;
    drained(
        &mut env.redis,
        &dead,
        Instant::now(),
        Duration::from_secs(120),
    )
    .await?;
    push(&mut env.redis, &staging, 0..n, &ns, size, None).await?;

    let who = pids(b, env, Some(pid));
    let before = CpuStart::take(&who);
    let start = Instant::now();
    let _: () = redis::cmd("RENAME")
        .arg(&staging)
        .arg(&dead)
        .query_async(&mut env.redis)
        .await?;
    let secs = drained(&mut env.redis, &dead, start, Duration::from_secs(1800)).await?;
    let park = n as f64 / secs;
    cpu.add(kind.names().0, n, before.spent());
    eprintln!(
        "bodies: {} {size} B x {n}: operator peak RSS {:.1} MiB after parking",
        kind.names().0,
        rss_mib(pid).0
    );

    let rejected = list_len(&mut env.redis, &format!("{dead}:rejected")).await;
    let records = count(&api).await?;
    if rejected != 0 || records != n + 1 {
        bail!("{ns}: {records} records for {n} messages and a warm-up, {rejected} rejected");
    }
    let first = api.get(&record_name("relayer", &job_id(0), 1)).await?;
    if first.spec.job.body.is_some() != (store && size > THRESHOLD) {
        bail!(
            "{ns}: a {size}-byte body {} in the store",
            if first.spec.job.body.is_some() {
                "is"
            } else {
                "is not"
            }
        );
    }

    // Redrive: every record marked Parked first, so that only the redrive is timed.
    let start = Instant::now();
    loop {
        let items = api.list(&ListParams::default()).await?.items;
        if items.iter().all(|r| r.phase() == Phase::Parked) {
            break;
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!("{ns}: records not all Parked in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let names: Vec<String> = (0..n)
        .map(|i| record_name("relayer", &job_id(i), 1))
        .collect();
    let target = format!("bench:{ns}");
    let before = CpuStart::take(&who);
    let start = Instant::now();
    decide_all(&api, &names, b.c).await?;
    loop {
        if list_len(&mut env.redis, &target).await >= n {
            let items = api.list(&ListParams::default()).await?.items;
            if items
                .iter()
                .filter(|r| r.phase() == Phase::Redriven)
                .count()
                >= n
            {
                break;
            }
        }
        if start.elapsed() > Duration::from_secs(1800) {
            bail!("{ns}: redrive of {n} did not finish in 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let redrive = n as f64 / start.elapsed().as_secs_f64();
    cpu.add(kind.names().1, n, before.spent());
    let got: Option<Vec<u8>> = redis::cmd("LINDEX")
        .arg(&target)
        .arg(0)
        .query_async(&mut env.redis)
        .await?;
    if got.as_ref().is_none_or(|g| g.len() < size) {
        bail!("{ns}: a redriven job of a {size}-byte body is shorter than its body");
    }
    drop(op);
    let _: () = redis::cmd("DEL")
        .arg(&target)
        .query_async(&mut env.redis)
        .await?;
    clear(&b.client, &ns).await?;
    drop_namespace(b, &ns).await;
    Ok((park, redrive))
}

/// `n` bodies of `size` bytes seeded `seed`, and their object paths under `seed/`.
fn bodies_of(seed: &str, size: usize, n: usize) -> Vec<(ObjectPath, Bytes)> {
    (0..n)
        .map(|i| {
            let id = job_id(i);
            (
                ObjectPath::from(format!("{seed}/{i:06}")),
                Bytes::from(body(&format!("{seed}/{id}"), size)),
            )
        })
        .collect()
}

/// Runs `each` on `0..n`, `c` at a time: records/s, or the first error.
async fn rate_of<F, Fut>(n: usize, c: usize, each: F) -> anyhow::Result<f64>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let start = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(each)
        .buffer_unordered(c)
        .collect()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    results.into_iter().collect::<anyhow::Result<()>>()?;
    Ok(rate)
}

/// The decision patch, then the status patch of a redrive, as the plain client writes them.
async fn redrive_patches(
    api: &Api<DeadLetter>,
    name: &str,
    between: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    api.patch(name, &PatchParams::default(), &redrive_decision())
        .await?;
    between.await?;
    let status = json!({"status": {"phase": "Redriven", "resolvedBy": "bench"}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await?;
    Ok(())
}

/// A ceiling of `kind` for `n` bodies of `size` bytes: (park-side, redrive-side) records/s.
async fn ceiling_run(
    b: &mut Bench,
    env: &mut Env,
    kind: Kind,
    size: usize,
    n: usize,
    cpu: &mut CpuLog,
) -> anyhow::Result<(f64, f64)> {
    let c_park = deadletter::source::redis::CONCURRENCY;
    let c = b.c;
    let store = env.store.clone();
    let ns = b.namespace("bodies-ceiling").await?;
    let bodies = bodies_of(&ns, size, n);
    let in_store = size > THRESHOLD;
    let records: Vec<DeadLetter> = bodies
        .iter()
        .enumerate()
        .map(|(i, (_, bytes))| record_of(i, size, in_store.then_some(&bytes[..]), &ns))
        .collect();
    let names: Vec<String> = (0..n)
        .map(|i| record_name("relayer", &job_id(i), 1))
        .collect();
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let list = format!("bench:{ns}");
    let who = pids(b, env, None);
    let pp = as_parker();
    let (parks, redrives) = kind.names();

    let before = CpuStart::take(&who);
    let park = match kind {
        Kind::Records => {
            rate_of(n, c_park, |i| {
                let (api, pp, r) = (&api, &pp, &records[i]);
                async move {
                    api.create(pp, r).await?;
                    Ok(())
                }
            })
            .await?
        }
        Kind::Objects => {
            rate_of(n, c_park, |i| {
                let (store, (path, bytes)) = (&store, &bodies[i]);
                async move {
                    Ok(deadletter::body::put_object(store.as_ref(), path, bytes.clone()).await?)
                }
            })
            .await?
        }
        Kind::Both => {
            rate_of(n, c_park, |i| {
                let (store, (path, bytes)) = (&store, &bodies[i]);
                let (api, pp, r) = (&api, &pp, &records[i]);
                async move {
                    deadletter::body::put_object(store.as_ref(), path, bytes.clone()).await?;
                    api.create(pp, r).await?;
                    Ok(())
                }
            })
            .await?
        }
        Kind::Store | Kind::NoStore => bail!("not a ceiling"),
    };
    cpu.add(parks, n, before.spent());

    let before = CpuStart::take(&who);
    let redrive = match kind {
        Kind::Records => {
            rate_of(n, c, |i| {
                let (api, name) = (&api, &names[i]);
                async move { redrive_patches(api, name, async { Ok(()) }).await }
            })
            .await?
        }
        Kind::Objects => {
            rate_of(n, c, |i| {
                let (store, (path, _)) = (&store, &bodies[i]);
                async move {
                    store.get(path).await?.bytes().await?;
                    Ok(())
                }
            })
            .await?
        }
        _ => {
            let redis = env.redis.clone();
            rate_of(n, c, |i| {
                let (api, name, store, (path, _)) = (&api, &names[i], &store, &bodies[i]);
                let (mut redis, list) = (redis.clone(), &list);
                async move {
                    let fetch_and_push = async move {
                        let bytes = store.get(path).await?.bytes().await?;
                        let _: () = redis::cmd("LPUSH")
                            .arg(list)
                            .arg(&bytes[..])
                            .query_async(&mut redis)
                            .await?;
                        Ok(())
                    };
                    redrive_patches(api, name, fetch_and_push).await
                }
            })
            .await?
        }
    };
    cpu.add(redrives, n, before.spent());

    let _: () = redis::cmd("DEL")
        .arg(&list)
        .query_async(&mut env.redis)
        .await?;
    if kind != Kind::Objects {
        clear(&b.client, &ns).await?;
    }
    drop_namespace(b, &ns).await;
    Ok((park, redrive))
}

/// Rows of one body size: its kinds in `rounds` rotating rounds.
async fn size_rows(
    b: &mut Bench,
    env: &mut Env,
    size: usize,
    n: usize,
    rounds: usize,
) -> anyhow::Result<(Vec<Row>, serde_json::Value)> {
    let kinds: &[Kind] = if size > THRESHOLD {
        &[Kind::Store, Kind::Records, Kind::Objects, Kind::Both]
    } else {
        &[Kind::Store, Kind::NoStore, Kind::Records]
    };
    let label = size_label(size);
    let mut runs = Rounds::default();
    let mut cpu = CpuLog::default();
    for round in 0..rounds {
        for j in 0..kinds.len() {
            let kind = kinds[(round + j) % kinds.len()];
            let (park, redrive) = match kind {
                Kind::Store => operator_run(b, env, size, n, true, &mut cpu).await?,
                Kind::NoStore => operator_run(b, env, size, n, false, &mut cpu).await?,
                _ => ceiling_run(b, env, kind, size, n, &mut cpu).await?,
            };
            let (parks, redrives) = kind.names();
            eprintln!(
                "bodies {label}, round {round}: {parks} {park:.2}/s, {redrives} {redrive:.2}/s"
            );
            runs.add(parks, n, park);
            runs.add(redrives, n, redrive);
        }
    }
    eprintln!("bodies {label}: {}", runs.each());
    let (park, redrive) = (runs.rate("park-store"), runs.rate("redrive-store"));
    let mut rows = Vec::new();
    let pairs: Vec<(&str, &str, &str)> = if size > THRESHOLD {
        vec![
            ("park", "put+create", "PUT+create"),
            ("park", "put", "PUT alone"),
            ("park", "create", "create alone"),
            ("redrive", "get+writes", "GET+writes"),
            ("redrive", "get", "GET alone"),
            ("redrive", "writes", "writes alone"),
        ]
    } else {
        vec![
            ("park", "park-none", "no store"),
            ("park", "create", "create"),
            ("redrive", "redrive-none", "no store"),
            ("redrive", "writes", "writes"),
        ]
    };
    for (what, base, name) in pairs {
        let rate = if what == "park" { park } else { redrive };
        rows.push(row(
            &format!("bodies {what} {label} / {name} (rec/s)"),
            rate,
            runs.rate(base),
        ));
    }
    for kind in ["park-store", "redrive-store"] {
        let ms = cpu.per_record(kind);
        let cell = |who: &str| {
            ms.iter()
                .find(|(w, _)| *w == who)
                .map_or_else(|| "-".to_string(), |(_, v)| format!("{v:.1}"))
        };
        eprintln!(
            "bodies {label}: CPU ms per record, {kind}: {}",
            cpu.line(kind)
        );
        rows.push((
            format!(
                "bodies {label} {} ms: op/api/s3/redis",
                kind.trim_end_matches("-store")
            ),
            format!(
                "{}/{}/{}/{}",
                cell("operator"),
                cell("apiserver"),
                cell("s3"),
                cell("redis")
            ),
            "-".into(),
            "-".into(),
        ));
    }
    for kind in ["put+create", "get+writes", "create", "writes", "park-none"] {
        if !cpu.per_record(kind).is_empty() {
            eprintln!(
                "bodies {label}: CPU ms per record, {kind}: {}",
                cpu.line(kind)
            );
        }
    }
    let mb = size as f64 / (1 << 20) as f64;
    let json = json!({
        "size": size, "n": n, "rounds": rounds,
        "park_per_s": park, "redrive_per_s": redrive,
        "park_mib_per_s": park * mb, "redrive_mib_per_s": redrive * mb,
        "rates": kinds.iter().flat_map(|k| { let (p, r) = k.names(); [(p, runs.rate(p)), (r, runs.rate(r))] })
            .map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "each": runs.json(),
        "cpu_ms_per_record": cpu.json(),
    });
    Ok((rows, json))
}

// --- etcd and the apiserver's memory ----------------------------------------------------------

/// Parks `n` messages of [`POINT_BYTES`] through the source of `ns`'s queue (the operator
/// running), until every one has left Redis and its record is marked.
async fn park_point(b: &Bench, env: &mut Env, ns: &str, n: usize) -> anyhow::Result<()> {
    let dead = dead_list(ns);
    push(&mut env.redis, &dead, 0..n, ns, POINT_BYTES, Some(2000)).await?;
    let limit = Duration::from_secs(600 + n as u64 / 10);
    drained(&mut env.redis, &dead, Instant::now(), limit).await?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), ns);
    all_marked(&api, limit).await?;
    let records = count(&api).await?;
    let rejected = list_len(&mut env.redis, &format!("{dead}:rejected")).await;
    if records != n || rejected != 0 {
        bail!("{ns}: {records} records of {n} messages, {rejected} rejected");
    }
    Ok(())
}

/// The mean size of the stored values of (up to) 50 records of `ns`, read from etcd itself.
fn stored_value_bytes(plane: &ControlPlane, ns: &str) -> anyhow::Result<f64> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let prefix = format!("/registry/dlq.dev/deadletters/{ns}/");
    // The end of the prefix's range: its last byte plus one ('/' + 1 = '0').
    let end = format!("/registry/dlq.dev/deadletters/{ns}0");
    let answer: serde_json::Value = serde_json::from_str(&etcd_post(
        plane,
        "/v3/kv/range",
        &json!({"key": b64.encode(&prefix), "range_end": b64.encode(&end), "limit": 50}),
    )?)?;
    let sizes: Vec<usize> = answer["kvs"]
        .as_array()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|kv| kv["value"].as_str())
                .filter_map(|v| b64.decode(v).ok())
                .map(|v| v.len())
                .collect()
        })
        .unwrap_or_default();
    if sizes.is_empty() {
        bail!("no record of {ns} read from etcd under {prefix}");
    }
    Ok(sizes.iter().sum::<usize>() as f64 / sizes.len() as f64)
}

/// etcd bytes per record of `n` parked 64 KiB bodies (with or without a store), and the mean
/// stored value of one.
async fn etcd_point(
    b: &mut Bench,
    env: &mut Env,
    n: usize,
    store: bool,
    disable: &[&str],
) -> anyhow::Result<EtcdPoint> {
    let ns = queue_ns(b, env, "bodies-etcd", store).await?;
    let (op, _) = b.operator_without(&ns, disable)?;
    // The operator's start-up writes (the queue's status) before the first measure.
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle_etcd(&b.plane)?;
    let before = etcd_bytes(&b.plane)?;
    park_point(b, env, &ns, n).await?;
    drop(op);
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle_etcd(&b.plane)?;
    let after = etcd_bytes(&b.plane)?;
    let value = stored_value_bytes(&b.plane, &ns)?;
    // The records' Parked Events (one each, gone after the apiserver's --event-ttl): their share.
    let events: Api<Event> = Api::namespaced(b.client.clone(), &ns);
    events
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    settle_etcd(&b.plane)?;
    let records_only = etcd_bytes(&b.plane)?;
    clear(&b.client, &ns).await?;
    drop_namespace(b, &ns).await;
    Ok(EtcdPoint {
        per_record: (after - before) / n as f64,
        events_per_record: (after - records_only) / n as f64,
        value,
    })
}

/// etcd's growth per parked record, the share of it its Parked Event takes, and the mean
/// stored value of a record.
struct EtcdPoint {
    per_record: f64,
    events_per_record: f64,
    value: f64,
}

/// The apiserver's RSS (MiB) with `n` records of 64 KiB bodies parked with (or without) a
/// store: restarted before, right after parking, restarted over them. The namespace, to clear.
async fn rss_point(
    b: &mut Bench,
    env: &mut Env,
    n: usize,
    store: bool,
    disable: &[&str],
) -> anyhow::Result<([f64; 3], String)> {
    b.plane.restart_apiserver()?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let fresh = rss_mib(b.plane.apiserver_pid()).1;
    let ns = queue_ns(b, env, "bodies-rss", store).await?;
    let (op, _) = b.operator_without(&ns, disable)?;
    let start = Instant::now();
    park_point(b, env, &ns, n).await?;
    eprintln!(
        "bodies: {n} x 64 KiB {} parked and marked in {:.0} s",
        if store {
            "with a store"
        } else {
            "without a store"
        },
        start.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let parked = rss_mib(b.plane.apiserver_pid()).1;
    drop(op);
    b.plane.restart_apiserver()?;
    // The records' watch cache is filled on the first request for them; a list at any
    // resourceVersion is served from it once it is.
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    api.list_metadata(&ListParams::default().limit(1)).await?;
    let cached = api
        .list_metadata(&ListParams::default().match_any())
        .await?
        .items
        .len();
    if cached != n {
        bail!("{ns}: the apiserver's cache lists {cached} records of {n}");
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let restarted = rss_mib(b.plane.apiserver_pid()).1;
    Ok(([fresh, parked, restarted], ns))
}

/// The RSS points' rows: with a store against keeping managed fields and against no store,
/// right after parking, restarted over them, and fresh before; a point alone on its own row.
fn rss_rows(points: &[(&str, usize, [f64; 3])], rows: &mut Vec<Row>) {
    let find = |which: &str| points.iter().find(|p| p.0 == which);
    let Some(store) = find("store") else {
        for (which, n, mib) in points {
            rows.push((
                format!("bodies apiserver MiB {n}, {which}"),
                format!("{:.0} parked", mib[1]),
                format!("{:.0} restarted", mib[2]),
                "-".into(),
            ));
        }
        return;
    };
    let pairs = [("none", "store/none")];
    let mut compared = false;
    for (other, vs) in pairs {
        let Some(o) = find(other) else { continue };
        compared = true;
        let n = if store.1 == o.1 {
            format!("{}", store.1)
        } else {
            format!("{}/{}", store.1, o.1)
        };
        rows.push(row(
            &format!("bodies apiserver MiB {n}, {vs}"),
            store.2[1],
            o.2[1],
        ));
        rows.push(row(
            &format!("bodies apiserver MiB restarted, {vs}"),
            store.2[2],
            o.2[2],
        ));
        rows.push(row(
            &format!("bodies apiserver MiB fresh, {vs}"),
            store.2[0],
            o.2[0],
        ));
    }
    if !compared {
        rows.push((
            format!("bodies apiserver MiB {}, store", store.1),
            format!("{:.0} parked", store.2[1]),
            format!("{:.0} restarted", store.2[2]),
            format!("{:.0} fresh", store.2[0]),
        ));
    }
}

// --- The phase --------------------------------------------------------------------------------

/// Rows and JSON of the bodies phase.
pub async fn run(
    b: &mut Bench,
) -> anyhow::Result<(Vec<(String, String, String, String)>, serde_json::Value)> {
    let counts = env_list("BENCH_BODIES_N", "2000,500,20");
    let rounds = env_usize("BENCH_BODIES_ROUNDS", 2).max(1);
    let etcd_n = env_usize("BENCH_BODIES_ETCD_N", 1000);
    let rss_n = env_usize("BENCH_BODIES_RSS_N", 20_000);
    let rss_none_n = env_usize("BENCH_BODIES_RSS_NONE_N", rss_n);

    let s3 = S3Server::try_start()?;
    for bucket in [BUCKET, CEILING_BUCKET] {
        s3.create_bucket(bucket).await;
    }
    let store: Arc<dyn ObjectStore> = Arc::new(s3.store_builder(CEILING_BUCKET).build()?);
    // The ceilings' client connected before its first measure, as the operator's is by the
    // warm-up message.
    store
        .put(
            &ObjectPath::from("warm"),
            PutPayload::from(Bytes::from_static(b"warm")),
        )
        .await?;
    let redis = connect(&b.redis_url).await?;
    let mut env = Env { s3, store, redis };
    eprintln!(
        "bodies: versitygw at {}; sizes {SIZES:?} x {counts:?}, {rounds} rounds",
        env.s3.endpoint()
    );

    let mut rows = Vec::new();
    let mut json = serde_json::Map::new();
    let mut sizes = Vec::new();
    for (&size, &n) in SIZES.iter().zip(&counts) {
        if n == 0 {
            continue;
        }
        let (r, j) = size_rows(b, &mut env, size, n, rounds).await?;
        rows.extend(r);
        sizes.push(j);
    }
    json.insert("throughput".into(), json!(sizes));

    if etcd_n > 0 {
        let store = etcd_point(b, &mut env, etcd_n, true, &[]).await?;
        let none = etcd_point(b, &mut env, etcd_n, false, &[]).await?;
        eprintln!(
            "bodies: etcd per record of 64 KiB, {etcd_n} records: {:.0} B with a store ({:.0} B its Event, {:.0} B stored value), {:.0} B without a store ({:.0} B)",
            store.per_record, store.events_per_record, store.value, none.per_record, none.value
        );
        let records = |p: &EtcdPoint| p.per_record - p.events_per_record;
        rows.push(row(
            "bodies etcd B/record 64 KiB, store / none",
            store.per_record,
            none.per_record,
        ));
        rows.push(row(
            "bodies etcd B/rec w/o Event, store / none",
            records(&store),
            records(&none),
        ));
        rows.push(row(
            "bodies etcd value of a record, store / none",
            store.value,
            none.value,
        ));
        let point = |p: &EtcdPoint| json!({"bytes_per_record": p.per_record, "event_bytes_per_record": p.events_per_record, "value_bytes": p.value});
        json.insert("etcd".into(), json!({"records": etcd_n, "payload": POINT_BYTES, "store": point(&store), "none": point(&none)}));
    }

    let mut rss = serde_json::Map::new();
    let mut points = Vec::new();
    let variants = [
        (rss_n, true, "store", &[][..]),
        (rss_none_n, false, "none", &[][..]),
    ];
    let last = variants.iter().rposition(|v| v.0 > 0);
    for (i, (n, store, which, disable)) in variants.into_iter().enumerate() {
        if n == 0 {
            continue;
        }
        let (mib, ns) = rss_point(b, &mut env, n, store, disable).await?;
        eprintln!(
            "bodies: apiserver RSS, {n} x 64 KiB, {which}: {:.0} MiB fresh, {:.0} parked, {:.0} restarted over them",
            mib[0], mib[1], mib[2]
        );
        rss.insert(
            which.into(),
            json!({"records": n, "fresh_mib": mib[0], "parked_mib": mib[1], "restarted_mib": mib[2]}),
        );
        points.push((which, n, mib));
        if Some(i) == last {
            break;
        }
        // Gone before the next point, which then meets the same etcd.
        clear_many(&b.client, &ns, n).await?;
        drop_namespace(b, &ns).await;
        settle_etcd(&b.plane)?;
    }
    rss_rows(&points, &mut rows);
    json.insert("apiserver_rss".into(), rss.into());
    Ok((rows, json.into()))
}
