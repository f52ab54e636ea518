//! `make bench`: the operator measured side by side with the apiserver's own ceiling, in one run
//! on one machine (these machines are noisy, so only ratios from the same run are quoted).
//!
//! Prints one table and writes the same figures to `target/bench/results.json`.
//! `BENCH_N` (records per throughput run, default 2000; park phases create `BENCH_PARK_N`,
//! default 3 N) and `BENCH_C` (concurrency, default 16) override the sizes, `BENCH_ROUNDS`
//! (default 4) the rounds of the park and redrive comparisons; `BENCH_SCALE` (default
//! "500,2000,8000") and `BENCH_MEMORY` (default "0,1000,10000") the scaling and memory points;
//! `BENCH_STORM` (default "10000,5000": messages, maxParked), `BENCH_CAPACITY` (default
//! "1024,65536": payload bytes, over `BENCH_CAPACITY_N` = 1000 records each) and
//! `BENCH_RECORDS` (default off; e.g. 100000, with `BENCH_RECORDS_REDRIVE` = 10000) the points
//! of `scale`. `BENCH_PROFILE=1` adds, per phase, the CPU each process spent and the apiserver
//! requests made per record, and `BENCH_PPROF=DIR` an apiserver CPU profile of each park phase
//! (see `profile`). `BENCH_PHASES` runs only the phases it names, `BENCH_OPERATOR_ENV` gives
//! the operator extra environment. The `ab` phase measures what each throughput mechanism buys
//! (`BENCH_AB_N`, `BENCH_AB_ROUNDS`, `BENCH_AB_MEMORY`: see `ab`). The `seal` phase measures
//! payload sealing on against off (`BENCH_SEAL_N`, `BENCH_SEAL_ROUNDS`: see `seal`). The
//! `bodies` phase, last, measures the body store against versitygw (`BENCH_BODIES_N`,
//! `BENCH_BODIES_ROUNDS`, `BENCH_BODIES_ETCD_N`, `BENCH_BODIES_RSS_N`: see `bodies`).

#[path = "operator/ab.rs"]
mod ab;
#[path = "operator/bodies.rs"]
mod bodies;
#[path = "operator/http.rs"]
mod http;
#[path = "operator/profile.rs"]
mod profile;
#[path = "operator/scale.rs"]
mod scale;
#[path = "operator/seal.rs"]
mod seal;
#[path = "operator/standing.rs"]
mod standing;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use dlq_client::park::{ParkOptions, ParkRequest, Parker};
use dlq_core::api::{DeadLetter, Job, Phase};
use dlq_core::park::{job_key, record_name};
use dlq_testenv::plane::{self as testenv, ControlPlane};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::json;

/// A table row: a rate, the ceiling it is compared with, and the ratio.
fn ratio_row(label: &str, rate: f64, ceiling: f64) -> (String, String, String, String) {
    (
        label.to_string(),
        format!("{rate:.0}"),
        format!("{ceiling:.0}"),
        format!("{:.0}%", 100.0 * rate / ceiling),
    )
}

/// Default rounds: as many as the park comparison has kinds, so that each kind runs once in
/// every position of a round (and redrive's two kinds each go first in half of them).
const ROUNDS: usize = 4;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `BENCH_OPERATOR_ENV` ("K=V,K=V"): extra environment for the operator only, e.g. to try a
/// runtime setting without changing the bench's own.
fn operator_env() -> Vec<(String, String)> {
    std::env::var("BENCH_OPERATOR_ENV")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// Whether `BENCH_PHASES` (a comma list; default: every phase) names `phase`: park, redrive,
/// latency, http, storm, standing, seal, ab, memory, capacity, records, scale, bodies. For
/// investigating one phase at a time.
fn wanted(phase: &str) -> bool {
    std::env::var("BENCH_PHASES").map_or(true, |list| list.split(',').any(|p| p.trim() == phase))
}

/// `env_list(name, default)` for a phase `BENCH_PHASES` leaves out: empty.
fn phase_list(phase: &str, name: &str, default: &str) -> Vec<usize> {
    if wanted(phase) {
        env_list(name, default)
    } else {
        Vec::new()
    }
}

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// A child process stopped when dropped; an operator's carries its metrics port.
struct Guard(Child, Option<u16>);

impl Guard {
    /// The records this operator has marked (`dlq_parked_total`, every series): asked of its
    /// `/metrics`, not of the apiserver being measured. The mark writes no status, so a
    /// record's phase (Parked by the CRD's default) no longer tells a marked one.
    fn marks(&self) -> f64 {
        self.1
            .and_then(|port| dlq_testenv::operator::http_get(("127.0.0.1", port), "/metrics"))
            .map_or(0.0, |body| {
                dlq_testenv::operator::metric(&body, "dlq_parked_total", &[])
            })
    }

    /// Waits until this operator has marked `n` records, at most `limit`.
    async fn until_marked(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        while self.marks() < n as f64 {
            if start.elapsed() > limit {
                bail!(
                    "{n} records were not all marked within {} s",
                    limit.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

/// Whether any record of `api` still waits for its mark (a create's managed fields, which the
/// mark clears; see `dlq_core::decide::needs_mark`): metadata pages of 500, stopping at the
/// first one found.
async fn any_unmarked(api: &Api<DeadLetter>) -> anyhow::Result<bool> {
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list_metadata(&params).await?;
        if page.items.iter().any(|m| {
            m.metadata
                .managed_fields
                .as_ref()
                .is_some_and(|f| !f.is_empty())
        }) {
            return Ok(true);
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(false),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        testenv::terminate(&mut self.0, Duration::from_secs(5));
    }
}

fn release_bin(name: &str) -> anyhow::Result<PathBuf> {
    dlq_testenv::paths::try_bin(name)
        .map_err(anyhow::Error::msg)
        .context("the bench runs the release build: `cargo build --release --workspace --bins` (make bench does)")
}

/// Peak and current RSS of a process, in MiB.
fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmHWM:"), field("VmRSS:"))
}

struct Bench {
    client: Client,
    plane: ControlPlane,
    redis_url: String,
    /// redis-server's process id (the bodies phase reads its CPU time).
    redis_pid: u32,
    operator_bin: PathBuf,
    c: usize,
    seq: u32,
}

impl Bench {
    async fn namespace(&mut self, prefix: &str) -> anyhow::Result<String> {
        self.seq += 1;
        let name = format!("{prefix}-{}", self.seq);
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        let list = format!("bench:{name}");
        let apply = format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: redis, namespace: {name}}}\nstringData: {{url: \"{}\"}}\n---\napiVersion: dlq.dev/v1alpha1\nkind: DeadLetterQueue\nmetadata: {{name: relayer, namespace: {name}}}\nspec:\n  maxParked: 1000000\n  target:\n    redis: {{urlSecretRef: {{name: redis, key: url}}, list: \"{list}\"}}\n",
            self.redis_url
        );
        kubectl_apply(&self.plane, &apply)?;
        Ok(name)
    }

    fn operator(&self, ns: &str) -> anyhow::Result<(Guard, u32)> {
        self.operator_without(ns, &[])
    }

    /// The operator with the throughput mechanisms `disable` names switched off (its hidden
    /// `--disable`; see `ab`).
    fn operator_without(&self, ns: &str, disable: &[&str]) -> anyhow::Result<(Guard, u32)> {
        let port = testenv::free_port()?;
        let child = testenv::spawn_guarded(
            Command::new(&self.operator_bin)
                .args([
                    "run",
                    "--leader-election=false",
                    &format!("--metrics-addr=127.0.0.1:{port}"),
                    &format!("--watch-namespaces={ns}"),
                    &format!("--disable={}", disable.join(",")),
                ])
                .env("KUBECONFIG", &self.plane.kubeconfig)
                .env(
                    "RUST_LOG",
                    std::env::var("BENCH_OPERATOR_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .envs(operator_env()),
            &self.plane.dir().join(format!("operator-{ns}.log")),
        )?;
        let pid = child.id();
        // Ready once /readyz answers.
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok((Guard(child, Some(port)), pid))
    }
}

fn kubectl_apply(plane: &ControlPlane, yaml: &str) -> anyhow::Result<()> {
    let mut child = plane
        .kubectl()?
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, yaml.as_bytes())?;
    drop(child.stdin.take());
    if !child.wait()?.success() {
        bail!("kubectl apply failed");
    }
    Ok(())
}

fn request(i: usize, payload_bytes: usize) -> ParkRequest {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: format!("bench/{i:06}"),
            payload: Some("x".repeat(payload_bytes)),
            ..Job::default()
        },
    );
    r.deliveries = 3;
    r.reason = "bench".into();
    r
}

/// Create parameters of the parker (its field manager), for plain creates of its records.
fn as_parker() -> PostParams {
    PostParams {
        field_manager: Some(dlq_client::park::PARKER.into()),
        ..PostParams::default()
    }
}

/// The object a plain client creates for a ceiling: the record park() writes, its slot-block
/// annotation included, and for a source's storm (`from_source`) the source message it came
/// from. The ceiling then creates the same bytes as the operator, and a ratio measures the
/// operator's work (its watch, admissions, marks), not the shape of the record.
fn plain_record(i: usize, payload_bytes: usize, from_source: bool) -> DeadLetter {
    let mut req = request(i, payload_bytes);
    if from_source {
        req = req.with_message(format!("dead#{}", i + 1));
    }
    let mut r = dlq_core::park::new_record(&req, 1);
    r.metadata.annotations.get_or_insert_default().insert(
        dlq_core::api::ANNOTATION_SLOT_BLOCK.into(),
        "0123456789ab-0".into(),
    );
    r
}

async fn park_all(
    client: &Client,
    ns: &str,
    n: usize,
    c: usize,
    payload: usize,
) -> anyhow::Result<f64> {
    let parker = Parker::new(client.clone());
    let start = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let parker = parker.clone();
            async move {
                parker.park(ns, request(i, payload)).await?;
                Ok(())
            }
        })
        .buffer_unordered(c)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// The operator's own parking path (its sources): the job index fed by a watch of the
/// namespace, as in the operator, and `Parker::park_known` (a create; a list only on a 409).
/// With `plain`, the same watch and index but plain creates of the same records: the ceiling
/// of creates under the watch the sources need, which tells the watch's cost from the parker's.
async fn park_sourced(
    client: &Client,
    ns: &str,
    n: usize,
    c: usize,
    payload: usize,
    plain: bool,
    options: ParkOptions,
) -> anyhow::Result<f64> {
    use deadletter::state::jobs::JobIndex;
    use kube::runtime::{WatchStreamExt, watcher};
    let jobs = JobIndex::default();
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let feed = jobs.clone();
    let watch = tokio::spawn(
        watcher(records, watcher::Config::default().any_semantic())
            .default_backoff()
            .for_each(move |event| {
                if let Ok(event) = &event {
                    feed.observe(event);
                }
                futures::future::ready(())
            }),
    );
    while jobs.cycles(ns, "-").is_none() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let queue = Api::<dlq_core::api::DeadLetterQueue>::namespaced(client.clone(), ns)
        .get("relayer")
        .await?;
    let parker = Parker::with_options(client.clone(), options);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let pp = as_parker();
    let start = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let (parker, jobs, queue, api, pp) = (parker.clone(), jobs.clone(), &queue, &api, &pp);
            async move {
                if plain {
                    api.create(pp, &plain_record(i, payload, false)).await?;
                } else {
                    let req = request(i, payload);
                    let known = jobs.cycles(ns, &job_key(&req.queue, &req.job.id));
                    parker.park_known(queue, req, known.as_deref()).await?;
                }
                Ok(())
            }
        })
        .buffer_unordered(c)
        .collect()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    watch.abort();
    for r in results {
        r?;
    }
    Ok(rate)
}

async fn create_plain(
    client: &Client,
    ns: &str,
    n: usize,
    c: usize,
    payload: usize,
) -> anyhow::Result<f64> {
    create_records(client, ns, n, c, payload, false).await
}

/// `n` records of [`plain_record`] created `c` at a time, as the parker creates them (same
/// field manager): records/s.
async fn create_records(
    client: &Client,
    ns: &str,
    n: usize,
    c: usize,
    payload: usize,
    from_source: bool,
) -> anyhow::Result<f64> {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let pp = as_parker();
    let start = Instant::now();
    let results: Vec<Result<DeadLetter, kube::Error>> = futures::stream::iter(0..n)
        .map(|i| {
            let (api, pp) = (&api, &pp);
            async move { api.create(pp, &plain_record(i, payload, from_source)).await }
        })
        .buffer_unordered(c)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Deletes a phase's records once it is measured, and waits until they are gone: every
/// throughput phase then meets an apiserver holding the same objects. (Left in place, each
/// phase's records grew the apiserver's watch cache and heap for the phases after it: a
/// profile showed its garbage collector's share of CPU rising from 12% to 17% over the run,
/// and a plain create costing 13% more CPU by the storm than in the first phase, where the
/// park ceiling was measured.)
async fn clear(client: &Client, ns: &str) -> anyhow::Result<()> {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !api
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .items
        .is_empty()
    {
        if Instant::now() > deadline {
            bail!("the records of {ns} were not deleted within 2 minutes");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Throughput measured in rounds: the apiserver's cost per request drifts over a run (a
/// profile showed a plain create costing up to a quarter more apiserver CPU later in the run
/// than in its first phase, and two ceilings measured a minute apart differing by a tenth), so
/// a ceiling measured once at the start is not what a later operator run is up against. Each
/// comparison runs its kinds `BENCH_ROUNDS` times in rotating order, and each kind's rate is
/// its records over its seconds across the rounds.
#[derive(Default)]
struct Rounds {
    /// kind → (records, seconds, each round's rate)
    kinds: std::collections::BTreeMap<&'static str, (f64, f64, Vec<f64>)>,
}

impl Rounds {
    fn add(&mut self, kind: &'static str, n: usize, rate: f64) {
        let e = self.kinds.entry(kind).or_default();
        e.0 += n as f64;
        e.1 += n as f64 / rate;
        e.2.push(rate);
    }

    fn rate(&self, kind: &str) -> f64 {
        self.kinds.get(kind).map_or(0.0, |(n, secs, _)| n / secs)
    }

    fn each(&self) -> String {
        self.kinds
            .iter()
            .map(|(kind, (_, _, rates))| {
                let rates: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
                format!("{kind} {}", rates.join("/"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn json(&self) -> serde_json::Value {
        self.kinds
            .iter()
            .map(|(kind, (_, _, rates))| (kind.to_string(), json!(rates)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// The three ways records are created in the park comparison.
#[derive(Clone, Copy)]
enum ParkKind {
    Ceiling,
    /// Plain creates while the sources' watch runs (a diagnostic row).
    CeilingWatched,
    Sources,
    External,
}

impl ParkKind {
    const ALL: [ParkKind; 4] = [
        ParkKind::Ceiling,
        ParkKind::Sources,
        ParkKind::External,
        ParkKind::CeilingWatched,
    ];

    fn name(self) -> &'static str {
        match self {
            ParkKind::Ceiling => "ceiling",
            ParkKind::CeilingWatched => "ceiling-watched",
            ParkKind::Sources => "sources",
            ParkKind::External => "external",
        }
    }
}

const _: () = assert!(ROUNDS == ParkKind::ALL.len());

/// One park measurement in a namespace of its own, cleared after: records/s.
async fn park_phase(b: &mut Bench, kind: ParkKind, n: usize, c: usize) -> anyhow::Result<f64> {
    let ns = b.namespace(&format!("park-{}", kind.name())).await?;
    let profiled = profile::Profiled::start(&b.plane, &format!("park, {}", kind.name()), None);
    let rate = match kind {
        ParkKind::Ceiling => create_plain(&b.client, &ns, n, c, 64).await?,
        ParkKind::CeilingWatched => {
            park_sourced(&b.client, &ns, n, c, 64, true, ParkOptions::default()).await?
        }
        ParkKind::Sources => {
            park_sourced(&b.client, &ns, n, c, 64, false, ParkOptions::default()).await?
        }
        ParkKind::External => park_all(&b.client, &ns, n, c, 64).await?,
    };
    profiled.end(&b.plane, n).await;
    clear(&b.client, &ns).await?;
    Ok(rate)
}

/// Plain creates at each concurrency of `concs`, each in a namespace of its own, cleared after.
async fn storm_ceilings(b: &mut Bench, n: usize, concs: [usize; 2]) -> anyhow::Result<[f64; 2]> {
    let mut rates = [0.0; 2];
    for (rate, conc) in rates.iter_mut().zip(concs) {
        let ns = b.namespace("ceiling-storm").await?;
        let before = profile::Sample::take(&b.plane, None);
        *rate = create_records(&b.client, &ns, n, conc, 64, true).await?;
        if let Some(s) = &before {
            s.report(&format!("storm ceiling, C={conc}"), &b.plane, None, n);
        }
        clear(&b.client, &ns).await?;
    }
    Ok(rates)
}

/// Runs `write` on each of `names`, `c` at a time; the first error, if any.
async fn each_name<F, Fut>(names: &[String], c: usize, write: F) -> anyhow::Result<()>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<DeadLetter, kube::Error>>,
{
    let results: Vec<Result<DeadLetter, kube::Error>> =
        futures::stream::iter(names.iter().cloned())
            .map(write)
            .buffer_unordered(c)
            .collect()
            .await;
    for r in results {
        r?;
    }
    Ok(())
}

/// The decision patch a human's bulk redrive makes.
fn redrive_decision() -> Patch<serde_json::Value> {
    Patch::Merge(json!({"spec": {"action": "redrive", "by": "bench"}}))
}

async fn decide_all(api: &Api<DeadLetter>, names: &[String], c: usize) -> anyhow::Result<()> {
    each_name(names, c, |name| {
        let api = api.clone();
        async move {
            api.patch(&name, &PatchParams::default(), &redrive_decision())
                .await
        }
    })
    .await
}

async fn list_len(redis: &mut redis::aio::MultiplexedConnection, key: &str) -> usize {
    redis::cmd("LLEN")
        .arg(key)
        .query_async(redis)
        .await
        .unwrap_or(0)
}

/// Operator redrive throughput: all records decided at once; records/s until all are Redriven
/// and on the list.
async fn redrive_run(b: &mut Bench, n: usize) -> anyhow::Result<f64> {
    redrive_without(b, n, &[]).await
}

/// [`redrive_run`] with an operator whose mechanisms `disable` names are off.
async fn redrive_without(b: &mut Bench, n: usize, disable: &[&str]) -> anyhow::Result<f64> {
    let ns = b.namespace("redrive").await?;
    create_plain(&b.client, &ns, n, b.c, 64).await?;
    redrive_in(b, &ns, n, disable, "redrive").await
}

/// The redrive of the `n` records already created in `ns` (named as [`plain_record`] names
/// them) by an operator with `disable`d mechanisms: records/s; the namespace is removed after.
async fn redrive_in(
    b: &mut Bench,
    ns: &str,
    n: usize,
    disable: &[&str],
    label: &str,
) -> anyhow::Result<f64> {
    let ns = ns.to_string();
    let (op, pid) = b.operator_without(&ns, disable)?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    // Wait for the operator to have marked them: the run measures redrive only.
    op.until_marked(n, Duration::from_secs(600)).await?;
    let names: Vec<String> = (0..n)
        .map(|i| record_name("relayer", &format!("bench/{i:06}"), 1))
        .collect();
    let mut redis = redis::Client::open(b.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let key = format!("bench:{ns}");
    let before = profile::Sample::take(&b.plane, Some(pid));
    let start = Instant::now();
    decide_all(&api, &names, b.c).await?;
    loop {
        if list_len(&mut redis, &key).await >= n {
            let items = api.list(&ListParams::default()).await?.items;
            if items.iter().all(|r| r.phase() == Phase::Redriven) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        if start.elapsed() > Duration::from_secs(600) {
            bail!("redrive of {n} did not finish in 10 minutes");
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    if let Some(before) = before {
        before.report(label, &b.plane, Some(pid), n);
    }
    clear(&b.client, &ns).await?;
    Api::<Namespace>::all(b.client.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .ok();
    Ok(rate)
}

/// The ceiling for a redrive: the same apiserver writes (decision patch + status patch per
/// record) from a plain client with the same concurrency.
async fn redrive_ceiling(b: &mut Bench, n: usize) -> anyhow::Result<f64> {
    let ns = b.namespace("ceiling").await?;
    create_plain(&b.client, &ns, n, b.c, 64).await?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let names: Vec<String> = (0..n)
        .map(|i| record_name("relayer", &format!("bench/{i:06}"), 1))
        .collect();
    let before = profile::Sample::take(&b.plane, None);
    let rate = redrive_writes(&api, &names, b.c).await?;
    if let Some(before) = before {
        before.report("redrive ceiling", &b.plane, None, n);
    }
    clear(&b.client, &ns).await?;
    Ok(rate)
}

/// A redrive's apiserver writes from a plain client (decision patch, then status patch) for
/// each of `names`, `c` at a time: records/s.
async fn redrive_writes(api: &Api<DeadLetter>, names: &[String], c: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    each_name(names, c, |name| {
        let api = api.clone();
        async move {
            api.patch(&name, &PatchParams::default(), &redrive_decision())
                .await?;
            let status = json!({"status": {"phase": "Redriven", "resolvedBy": "bench"}});
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                .await
        }
    })
    .await?;
    Ok(names.len() as f64 / start.elapsed().as_secs_f64())
}

/// The N of the headline redrive, for labels.
fn n_headline(json: &serde_json::Map<String, serde_json::Value>) -> u64 {
    json.get("redrive")
        .and_then(|r| r["n"].as_u64())
        .unwrap_or(0)
}

async fn latency(b: &mut Bench, samples: usize) -> anyhow::Result<(f64, f64, f64)> {
    let ns = b.namespace("latency").await?;
    create_plain(&b.client, &ns, samples, b.c, 64).await?;
    let (op, _) = b.operator(&ns)?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(30)));
    let mut redis = redis::Client::open(b.redis_url.as_str())?
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let key = format!("bench:{ns}");
    op.until_marked(samples, Duration::from_secs(600)).await?;
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let name = record_name("relayer", &format!("bench/{i:06}"), 1);
        let start = Instant::now();
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"action": "redrive", "by": "bench"}})),
        )
        .await?;
        let _: Option<(String, Vec<u8>)> = redis::cmd("BRPOP")
            .arg(&key)
            .arg(20)
            .query_async(&mut redis)
            .await?;
        ms.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        ms[((ms.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(ms.len() - 1)]
    };
    Ok((pct(0.50), pct(0.99), *ms.last().unwrap_or(&0.0)))
}

async fn memory(b: &mut Bench, n: usize) -> anyhow::Result<(f64, f64, f64)> {
    let ns = b.namespace("memory").await?;
    create_plain(&b.client, &ns, n, b.c.min(8), 64 * 1024).await?;
    let (op, pid) = b.operator(&ns)?;
    // Until the operator has seen (and marked) every record.
    op.until_marked(n, Duration::from_secs(900)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (peak, now) = rss_mib(pid);
    let apiserver = rss_mib(b.plane.apiserver_pid()).1;
    clear(&b.client, &ns).await?;
    Ok((peak, now, apiserver))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // BENCH_LOG (a tracing filter, e.g. `dlq_client=debug`): what the in-process parkers do.
    if let Ok(filter) = std::env::var("BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let n = env_usize("BENCH_N", 2000);
    let c = env_usize("BENCH_C", 16);
    let operator_bin = release_bin("deadletter-operator")?;
    eprintln!("bench: N={n} C={c}; starting a control plane and redis-server");
    let plane = ControlPlane::start()?;
    kubectl_apply(&plane, include_str!("../crds/dlq.dev.yaml"))?;
    let st = plane
        .kubectl()?
        .args([
            "wait",
            "--for=condition=established",
            "crd/deadletters.dlq.dev",
            "crd/deadletterqueues.dlq.dev",
        ])
        .status()?;
    if !st.success() {
        bail!("CRDs not established");
    }
    let redis_port = testenv::free_port()?;
    let redis_bin = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("redis-server"))
                .find(|p| p.is_file())
        })
        .context("redis-server not found: run scripts/ensure-deps.sh")?;
    let _redis = Guard(
        testenv::spawn_guarded(
            Command::new(redis_bin).args([
                "--port",
                &redis_port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ]),
            &plane.dir().join("redis.log"),
        )?,
        None,
    );
    profile::also("redis", _redis.0.id());
    std::thread::sleep(Duration::from_millis(300));
    let mut config = Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&plane.kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    config.read_timeout = Some(Duration::from_secs(120));
    let client = Client::try_from(config)?;
    let mut b = Bench {
        client: client.clone(),
        plane,
        redis_url: format!("redis://127.0.0.1:{redis_port}/"),
        redis_pid: _redis.0.id(),
        operator_bin,
        c,
        seq: 0,
    };

    let mut rows: Vec<(String, String, String, String)> = Vec::new();
    let mut json = serde_json::Map::new();

    let rounds = env_usize("BENCH_ROUNDS", ROUNDS).max(1);
    if wanted("park") {
        // Park phases take 3 s at N = 2,000 and their rates wander by a tenth from round to round
        // (the machine's load, the apiserver's garbage collector): 3 N records each average more.
        let park_n = env_usize("BENCH_PARK_N", 3 * n);
        // 0. Warm-up, not counted: the first phase of a run meets a fresh apiserver (an empty
        // watch cache, a small heap), where a create cost it 1.91 ms of CPU against 2.3-2.4 ms
        // in the phases after; only the kind that happened to go first gained from it.
        let warm_up = park_phase(&mut b, ParkKind::Ceiling, park_n, c).await?;
        eprintln!("warm-up (not counted): plain creates {warm_up:.0}/s");
        json.insert(
            "warm_up".into(),
            json!({"n": park_n, "c": c, "ceiling_per_s": warm_up}),
        );

        // 1. Park vs plain create: the operator's sources (job index) and an external parker,
        // in rounds that rotate the order (see `Rounds`).
        let mut park = Rounds::default();
        for round in 0..rounds {
            for i in 0..ParkKind::ALL.len() {
                let kind = ParkKind::ALL[(round + i) % ParkKind::ALL.len()];
                let rate = park_phase(&mut b, kind, park_n, c).await?;
                park.add(kind.name(), park_n, rate);
            }
        }
        let (ceiling, parked, external, watched) = (
            park.rate("ceiling"),
            park.rate("sources"),
            park.rate("external"),
            park.rate("ceiling-watched"),
        );
        eprintln!(
            "park: {parked:.0}/s (external {external:.0}/s) vs create {ceiling:.0}/s over {rounds} rounds: {}",
            park.each()
        );
        rows.push(ratio_row(
            "park, operator's sources (records/s)",
            parked,
            ceiling,
        ));
        rows.push(ratio_row(
            "park, external park() / CLI (records/s)",
            external,
            ceiling,
        ));
        // Diagnostic: what the sources' watch alone costs the ceiling, and the sources against
        // that (the parker's own cost: admissions, the job index).
        rows.push(ratio_row(
            "park ceiling with the watch (records/s)",
            watched,
            ceiling,
        ));
        rows.push(ratio_row(
            "park, sources vs ceiling with watch",
            parked,
            watched,
        ));
        json.insert("park".into(), json!({"n": park_n, "c": c, "rounds": rounds, "records_per_s": parked, "ceiling_per_s": ceiling, "ratio": parked / ceiling, "ceiling_under_watch_per_s": watched, "ratio_to_ceiling_under_watch": parked / watched, "each": park.json()}));
        json.insert("park_external".into(), json!({"n": park_n, "c": c, "rounds": rounds, "records_per_s": external, "ceiling_per_s": ceiling, "ratio": external / ceiling}));
    }

    if wanted("redrive") {
        // 2. Redrive vs the same writes from a plain client, in rounds that alternate the order.
        let mut redrive = Rounds::default();
        for round in 0..rounds {
            for operator_first in [round % 2 == 1, round % 2 == 0] {
                if operator_first {
                    redrive.add("operator", n, redrive_run(&mut b, n).await?);
                } else {
                    redrive.add("ceiling", n, redrive_ceiling(&mut b, n).await?);
                }
            }
        }
        let (ceiling, redriven) = (redrive.rate("ceiling"), redrive.rate("operator"));
        eprintln!(
            "redrive: {redriven:.0}/s vs writes {ceiling:.0}/s over {rounds} rounds: {}",
            redrive.each()
        );
        rows.push(ratio_row("redrive (records/s)", redriven, ceiling));
        json.insert("redrive".into(), json!({"n": n, "c": c, "rounds": rounds, "records_per_s": redriven, "ceiling_per_s": ceiling, "ratio": redriven / ceiling, "each": redrive.json()}));
    }

    if wanted("latency") {
        // 3. Latency: decision -> job on the list, idle system.
        let (p50, p99, max) = latency(&mut b, 200).await?;
        eprintln!("latency: p50 {p50:.1} ms p99 {p99:.1} ms max {max:.1} ms");
        rows.push((
            "latency decision->list p50/p99/max (ms)".into(),
            format!("{p50:.1}/{p99:.1}/{max:.1}"),
            "-".into(),
            "-".into(),
        ));
        json.insert(
            "latency_ms".into(),
            json!({"samples": 200, "p50": p50, "p99": p99, "max": max}),
        );
    }

    if wanted("http") {
        // 3b. Parks through the HTTP park endpoint (CloudEvents over TLS, tokens reviewed)
        // against plain creates of the same records, in alternating rounds.
        let r = http::phase(&mut b, n, c, rounds).await?;
        let (ceiling, endpoint) = (r.rate("ceiling"), r.rate("endpoint"));
        eprintln!(
            "http: {endpoint:.0}/s vs create {ceiling:.0}/s over {rounds} rounds: {}",
            r.each()
        );
        rows.push(ratio_row(
            "park, HTTP endpoint, CloudEvents (records/s)",
            endpoint,
            ceiling,
        ));
        json.insert("http".into(), json!({"n": n, "c": c, "rounds": rounds, "records_per_s": endpoint, "ceiling_per_s": ceiling, "ratio": endpoint / ceiling, "each": r.json()}));
    }

    // 4. Parking storm into a queue with a hard maxParked. Before the memory points: those leave
    // the apiserver holding 10,000 x 64 KiB deleted objects in its watch cache (8.5 GB RSS),
    // and a storm right after them made 76-77% of its ceiling in two full runs, against 83-88%
    // in every run without them.
    let storm_sizes = phase_list("storm", "BENCH_STORM", "10000,5000");
    if let [messages, max] = storm_sizes[..] {
        // The ceiling right before and right after the storm (its mean, against drift), at
        // the bench's concurrency and at the Redis source's own, and the better of the two: a
        // source with more parks in flight than BENCH_C must not be compared with less.
        let c_source = deadletter::source::redis::CONCURRENCY;
        // As many records as the storm makes: the apiserver's cost per create grows with the
        // objects it holds (its garbage collector walks them all).
        let before = storm_ceilings(&mut b, max, [c, c_source]).await?;
        let s = scale::storm(&mut b, messages, max).await?;
        let after = storm_ceilings(&mut b, max, [c, c_source]).await?;
        let at_bench_c = (before[0] + after[0]) / 2.0;
        let at_source_c = (before[1] + after[1]) / 2.0;
        let ceiling = at_bench_c.max(at_source_c);
        let first_park_ceiling = json
            .get("park")
            .and_then(|p| p["ceiling_per_s"].as_f64())
            .unwrap_or(0.0);
        eprintln!(
            "storm ceiling: create {at_bench_c:.0}/s at C={c} ({:.0} before, {:.0} after), {at_source_c:.0}/s at C={c_source} ({:.0}, {:.0}); the park row's: {first_park_ceiling:.0}/s",
            before[0], after[0], before[1], after[1]
        );
        eprintln!(
            "storm: {messages} messages, maxParked {max}: {:.0}/s, {} records, {} left in the broker, {} rejected, Full={}, {} QueueFull Events",
            s.rate, s.records, s.in_broker, s.rejected, s.full, s.events
        );
        rows.push(ratio_row(
            &format!("storm {messages} -> maxParked {max} (records/s)"),
            s.rate,
            ceiling,
        ));
        rows.push((
            "storm: first record -> all marked Parked (s)".into(),
            format!("{:.1}", s.all_marked_s),
            "-".into(),
            "-".into(),
        ));
        rows.push((
            "storm: records / in broker / rejected".into(),
            format!("{} / {} / {}", s.records, s.in_broker, s.rejected),
            "-".into(),
            "-".into(),
        ));
        json.insert("storm".into(), json!({"messages": messages, "max_parked": max, "records_per_s": s.rate, "ceiling_per_s": ceiling, "ratio": s.rate / ceiling, "ceiling_at_bench_c": at_bench_c, "ceiling_at_source_c": at_source_c, "ceilings_before": before, "ceilings_after": after, "park_row_ceiling_per_s": first_park_ceiling, "ratio_to_park_row_ceiling": s.rate / first_park_ceiling, "source_c": c_source, "all_marked_s": s.all_marked_s, "operator_peak_mib": s.peak_mib, "records": s.records, "in_broker": s.in_broker, "rejected": s.rejected, "full_condition": s.full, "queue_full_events": s.events}));
    }

    // 4b. Issue 47: one standing redrive of a storm per broker, against the broker's own copy
    // loop (see `standing`). Before the memory points, as the storm.
    if wanted("standing") {
        let (standing_rows, standing_json) = standing::run(&mut b).await?;
        rows.extend(standing_rows);
        json.insert("standing".into(), standing_json);
    }

    // 5. What each throughput mechanism buys: the same build with and without it (see `ab`).
    // Before the memory points, as the storm.
    let mut ab_rows = Vec::new();
    if wanted("seal") {
        let (seal_rows, seal_json) = seal::run(&mut b, n, rounds).await?;
        rows.extend(seal_rows);
        json.insert("seal".into(), seal_json);
    }

    if wanted("ab") {
        let (rows, ab_json) = ab::run(&mut b).await?;
        ab_rows = rows;
        json.insert("ab".into(), ab_json);
    }

    // 6. Memory with 64 KiB payloads, after every throughput phase (see the storm's).
    let mut mem = Vec::new();
    for m in phase_list("memory", "BENCH_MEMORY", "0,1000,10000") {
        let (peak, now, apiserver) = memory(&mut b, m).await?;
        eprintln!(
            "memory: {m} x 64 KiB parked: operator peak {peak:.1} MiB (now {now:.1}), apiserver {apiserver:.0} MiB"
        );
        rows.push((
            format!("operator RSS, {m} x 64 KiB parked (MiB)"),
            format!("{peak:.1} peak"),
            format!("apiserver {apiserver:.0}"),
            "-".into(),
        ));
        mem.push(json!({"records": m, "operator_peak_mib": peak, "operator_rss_mib": now, "apiserver_rss_mib": apiserver}));
    }
    json.insert("memory".into(), json!(mem));

    // 7. etcd bytes per record.
    let mut cap = Vec::new();
    let cap_n = env_usize("BENCH_CAPACITY_N", 1000);
    for payload in phase_list("capacity", "BENCH_CAPACITY", "1024,65536") {
        let per = scale::etcd_per_record(&mut b, cap_n, payload).await?;
        eprintln!("capacity: {payload} B payload: {per:.0} B of etcd per record");
        rows.push((
            format!("etcd bytes per record, {payload} B payload"),
            format!("{per:.0}"),
            "-".into(),
            "-".into(),
        ));
        cap.push(json!({"payload_bytes": payload, "records": cap_n, "etcd_bytes_per_record": per}));
    }
    json.insert("capacity".into(), json!(cap));

    // 8. The 100,000-record point (opt-in).
    for n in phase_list("records", "BENCH_RECORDS_ONLY_CLI", "") {
        for (what, ms, lines) in scale::cli_at_scale(&mut b, n).await? {
            eprintln!("records {n}: {what}: {ms:.0} ms, {lines} lines");
            rows.push((
                format!("{n}: {what} (ms)"),
                format!("{ms:.0}"),
                format!("{lines} lines"),
                "-".into(),
            ));
        }
    }
    for n in phase_list("records", "BENCH_RECORDS", "") {
        let redrive = env_usize("BENCH_RECORDS_REDRIVE", 10_000);
        let s = scale::hundred_thousand(&mut b, n, redrive).await?;
        eprintln!(
            "records {n}: marked in {:.0}s, RSS peak {:.1} MiB, restart->first reconcile {:.1}s, ls {:.0} ms ({} lines), stats {:.0} ms, redrive {redrive} at {:.0}/s",
            s.marked_secs,
            s.peak_mib,
            s.restart_secs,
            s.ls_ms,
            s.ls_rows,
            s.stats_ms,
            s.redrive_rate
        );
        let cells = [
            (
                format!("{n} x 1 KiB: operator RSS (MiB)"),
                format!("{:.1} peak", s.peak_mib),
            ),
            (
                format!("{n} x 1 KiB: all marked Parked (s)"),
                format!("{:.0}", s.marked_secs),
            ),
            (
                format!("{n}: restart -> first reconcile (s)"),
                format!("{:.1}", s.restart_secs),
            ),
            (
                format!("{n}: kubectl dlq ls --queue, page (ms)"),
                format!("{:.0}", s.ls_ms),
            ),
            (
                format!("{n}: kubectl dlq stats (ms)"),
                format!("{:.0}", s.stats_ms),
            ),
        ];
        for (a, v) in cells {
            rows.push((a, v, "-".into(), "-".into()));
        }
        for found in &s.searches {
            eprintln!("records {n}: {}: {:.0} ms", found.what, found.ms);
            rows.push((
                format!("{n}: {} (ms)", found.what),
                format!("{:.0}", found.ms),
                "-".into(),
                "-".into(),
            ));
        }
        // Linear cost: the same ratio to the ceiling as the headline redrive (N = BENCH_N),
        // the ceiling measured at this scale (the apiserver itself is slower with n records).
        let ratio = s.redrive_rate / s.redrive_ceiling;
        rows.push(ratio_row(
            &format!("{n}: redrive {redrive} (records/s)"),
            s.redrive_rate,
            s.redrive_ceiling,
        ));
        let headline = json
            .get("redrive")
            .and_then(|r| r["ratio"].as_f64())
            .unwrap_or(f64::NAN);
        rows.push((
            format!("{n}: redrive ratio / ratio at N={}", n_headline(&json)),
            format!("{:.2}", ratio / headline),
            "-".into(),
            "-".into(),
        ));
        json.insert("records".into(), json!({"n": n, "marked_s": s.marked_secs, "operator_peak_mib": s.peak_mib, "operator_rss_mib": s.rss_mib, "restart_first_reconcile_s": s.restart_secs, "ls_ms": s.ls_ms, "ls_lines": s.ls_rows, "stats_ms": s.stats_ms, "redrive": redrive, "redrive_per_s": s.redrive_rate, "redrive_ceiling_per_s": s.redrive_ceiling, "redrive_ratio": ratio, "redrive_ratio_vs_headline": ratio / headline, "searches_ms": s.searches.iter().map(|f| (f.what.clone(), json!(f.ms))).collect::<serde_json::Map<_, _>>()}));
    }

    // 9. Scaling of redrive throughput.
    let mut scale = Vec::new();
    for s in phase_list("scale", "BENCH_SCALE", "500,2000,8000") {
        let rate = redrive_run(&mut b, s).await?;
        eprintln!("scaling: redrive N={s}: {rate:.0}/s");
        rows.push((
            format!("redrive N={s} (records/s)"),
            format!("{rate:.0}"),
            "-".into(),
            "-".into(),
        ));
        scale.push(json!({"n": s, "records_per_s": rate, "seconds": s as f64 / rate}));
    }
    json.insert("scaling".into(), json!(scale));

    // 10. The body store (issue 48), last: its RSS points leave the apiserver holding tens of
    // thousands of 64 KiB records (and restart it), which no phase after should meet.
    if wanted("bodies") {
        let (bodies_rows, bodies_json) = bodies::run(&mut b).await?;
        rows.extend(bodies_rows);
        json.insert("bodies".into(), bodies_json);
    }

    println!();
    println!(
        "{:<44}{:>16}{:>16}{:>8}",
        "measure", "operator", "ceiling", "ratio"
    );
    for (a, b, c, d) in &rows {
        println!("{a:<44}{b:>16}{c:>16}{d:>8}");
    }
    if !ab_rows.is_empty() {
        let load = json["ab"]["loadavg_before"].as_str().unwrap_or_default();
        println!("\nA/B, the same build with and without each mechanism (load average {load}):");
        println!(
            "{:<44}{:>16}{:>16}{:>10}",
            "mechanism", "with", "without", "points"
        );
        for (a, b, c, d) in &ab_rows {
            println!("{a:<44}{b:>16}{c:>16}{d:>10}");
        }
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("\nwritten to {}", dir.join("results.json").display());
    Ok(())
}
