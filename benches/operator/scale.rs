//! Issue 15's storm, capacity and scale points: a parking storm into a queue with a hard
//! `maxParked` (`BENCH_STORM`, "messages,maxParked"), etcd bytes per record
//! (`BENCH_CAPACITY`, payload sizes), and the 100,000-record point (`BENCH_RECORDS`, opt-in:
//! operator RSS, restart → first reconcile, `ls`/`stats` latency, the searches of `ls --grep`,
//! `--where` and the page, redrive of 10,000).

use std::io::{Read, Write};

use dlq_core::api::DeadLetterQueue;
use dlq_core::conditions;

use super::*;

/// A namespace whose queue `relayer` has `patch` merged into its spec (on top of the Redis
/// target `bench:<ns>`).
pub async fn namespace_with(
    b: &mut Bench,
    prefix: &str,
    patch: serde_json::Value,
) -> anyhow::Result<String> {
    let ns = b.namespace(prefix).await?;
    Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns)
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": patch })),
        )
        .await?;
    Ok(ns)
}

/// What a storm left behind.
pub struct Storm {
    pub rate: f64,
    /// Seconds from the first record to the last one marked Parked by the operator (marks
    /// yield to parking while the source drains, so they finish after it).
    pub all_marked_s: f64,
    pub records: usize,
    pub in_broker: usize,
    pub rejected: usize,
    pub full: bool,
    pub events: usize,
    /// The operator's peak RSS over the storm, in MiB.
    pub peak_mib: f64,
}

/// `messages` envelopes on a Redis dead list, a queue with `max_parked`: the operator's source
/// parks until the queue is full. Rate from the first to the last record.
pub async fn storm(b: &mut Bench, messages: usize, max_parked: usize) -> anyhow::Result<Storm> {
    storm_without(b, messages, max_parked, &[]).await
}

/// [`storm`] with an operator whose mechanisms `disable` names are off.
pub async fn storm_without(
    b: &mut Bench,
    messages: usize,
    max_parked: usize,
    disable: &[&str],
) -> anyhow::Result<Storm> {
    let ns = namespace_with(
        b,
        "storm",
        json!({"maxParked": max_parked, "source": {"redis": {"list": "dead"}}}),
    )
    .await?;
    let mut redis = redis::Client::open(b.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    // What an earlier storm left in the broker (`ab` runs several) would count as not drained.
    let _: () = redis::cmd("DEL")
        .arg(&["dead", "dead:processing", "dead:inflight", "dead:rejected"])
        .query_async(&mut redis)
        .await?;
    for chunk in (0..messages).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let env = json!({"id": format!("storm/{i:06}"), "payload": "x".repeat(64)});
            pipe.cmd("LPUSH").arg("dead").arg(env.to_string());
        }
        let _: () = pipe.query_async(&mut redis).await?;
    }
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let before = super::profile::Sample::take(&b.plane, None);
    let (operator, pid) = b.operator_without(&ns, disable)?;
    // How many records exist, from a one-item page (its remainingItemCount).
    let count = || async {
        api.list_metadata(&ListParams::default().limit(1))
            .await
            .map(|l| {
                let rest = l.metadata.remaining_item_count.unwrap_or(0);
                l.items.len() + usize::try_from(rest).unwrap_or(0)
            })
            .unwrap_or(0)
    };
    // The drain as Redis sees it: a message leaves the broker (its HDEL) only once its record
    // exists. Counted there, not by asking the apiserver the storm is measured on (polling
    // it, even for one-item pages, or watching it cost the storm up to a tenth of its rate).
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut first = None;
    loop {
        let n = messages.saturating_sub(in_redis(&mut redis).await);
        if n > 0 && first.is_none() {
            first = Some((Instant::now(), n));
        }
        if n >= max_parked || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (t0, n0) = first.context("no record parked")?;
    let rate = (max_parked - n0) as f64 / t0.elapsed().as_secs_f64();
    if let Some(before) = before {
        before.report("storm", &b.plane, Some(pid), max_parked);
    }
    // Marked: the operator's own count (the mark writes no status to select by).
    while operator.marks() < max_parked as f64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_marked_s = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let peak_mib = rss_mib(pid).0;
    let records = count().await;
    let in_broker = in_redis(&mut redis).await;
    let rejected = list_len(&mut redis, "dead:rejected").await;
    let queue = Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns)
        .get("relayer")
        .await?;
    let full = queue
        .status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, conditions::FULL))
        .is_some_and(|c| c.status == "True");
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(b.client.clone(), &ns)
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("QueueFull"))
        .count();
    // Stopped first: its source would park what is left in the broker as records go.
    drop(operator);
    clear(&b.client, &ns).await?;
    Ok(Storm {
        rate,
        all_marked_s,
        records,
        in_broker,
        rejected,
        full,
        events,
        peak_mib,
    })
}

/// Messages still in Redis: on the dead list, moved to processing, or claimed and not yet
/// acknowledged (read in one transaction, so a message moving between them counts once).
async fn in_redis(redis: &mut redis::aio::MultiplexedConnection) -> usize {
    let (dead, processing, inflight): (usize, usize, usize) = redis::pipe()
        .atomic()
        .cmd("LLEN")
        .arg("dead")
        .cmd("LLEN")
        .arg("dead:processing")
        .cmd("HLEN")
        .arg("dead:inflight")
        .query_async(redis)
        .await
        .unwrap_or((usize::MAX, 0, 0));
    dead.saturating_add(processing).saturating_add(inflight)
}

/// etcd's `etcd_mvcc_db_total_size_in_use_in_bytes`.
pub fn etcd_bytes(plane: &ControlPlane) -> anyhow::Result<f64> {
    etcd_http(plane, "GET", "/metrics", "")?
        .lines()
        .find(|l| l.starts_with("etcd_mvcc_db_total_size_in_use_in_bytes "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .context("etcd_mvcc_db_total_size_in_use_in_bytes not in etcd's /metrics")
}

/// etcd's database size (`etcd_mvcc_db_total_size_in_bytes`) and the part in use, in bytes.
pub fn etcd_sizes(plane: &ControlPlane) -> anyhow::Result<(f64, f64)> {
    let metrics = etcd_http(plane, "GET", "/metrics", "")?;
    let metric = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("{name} not in etcd's /metrics"))
    };
    Ok((
        metric("etcd_mvcc_db_total_size_in_bytes")?,
        metric("etcd_mvcc_db_total_size_in_use_in_bytes")?,
    ))
}

/// One HTTP/1.0 request to etcd's client URL (its metrics, or its JSON gateway): the body of
/// the answer.
fn etcd_http(plane: &ControlPlane, method: &str, path: &str, body: &str) -> anyhow::Result<String> {
    let addr = plane.etcd_url().trim_start_matches("http://").to_string();
    let mut s = std::net::TcpStream::connect(&addr)?;
    s.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    Ok(answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string()))
}

/// A request to etcd's JSON gateway.
pub fn etcd_post(
    plane: &ControlPlane,
    path: &str,
    body: &serde_json::Value,
) -> anyhow::Result<String> {
    etcd_http(plane, "POST", path, &body.to_string())
}

/// Compacts etcd to its current revision and defragments it, so its in-use size holds live
/// data only: the earlier phases delete their records, and reusing their freed pages (or the
/// apiserver's own compaction, every five minutes, running mid-measure) would move the in-use
/// size while 1,000 records are written.
pub fn settle_etcd(plane: &ControlPlane) -> anyhow::Result<()> {
    let status: serde_json::Value =
        serde_json::from_str(&etcd_post(plane, "/v3/maintenance/status", &json!({}))?)?;
    let revision = status["header"]["revision"]
        .as_str()
        .context("etcd's status has no revision")?
        .to_string();
    etcd_post(
        plane,
        "/v3/kv/compaction",
        &json!({"revision": revision, "physical": true}),
    )?;
    etcd_post(plane, "/v3/maintenance/defragment", &json!({}))?;
    Ok(())
}

/// Bytes of etcd per record of `payload` bytes: `n` plain records created (each one revision,
/// as parked before the operator marks it), the in-use database size before and after, on an
/// etcd compacted and defragmented first.
pub async fn etcd_per_record(b: &mut Bench, n: usize, payload: usize) -> anyhow::Result<f64> {
    let ns = b.namespace("capacity").await?;
    settle_etcd(&b.plane)?;
    let before = etcd_bytes(&b.plane)?;
    create_plain(&b.client, &ns, n, b.c, payload).await?;
    let after = etcd_bytes(&b.plane)?;
    clear(&b.client, &ns).await?;
    Ok((after - before) / n as f64)
}

/// Wall time of one `kubectl dlq` command against the bench's control plane.
pub fn time_cli(b: &Bench, ns: &str, args: &[&str]) -> anyhow::Result<(f64, usize)> {
    time_bin(&release_bin("kubectl-dlq")?, b, ns, args)
}

/// Wall time of `bin` (a `kubectl-dlq`) with `args`, and the lines it printed.
fn time_bin(bin: &Path, b: &Bench, ns: &str, args: &[&str]) -> anyhow::Result<(f64, usize)> {
    let start = Instant::now();
    let out = Command::new(bin)
        .arg("--kubeconfig")
        .arg(&b.plane.kubeconfig)
        .args(["-n", ns])
        .args(args)
        .output()?;
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    if !out.status.success() {
        bail!(
            "kubectl dlq {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((ms, out.stdout.iter().filter(|c| **c == b'\n').count()))
}

/// `ls --queue` and `stats` over `n` records without an operator (`BENCH_RECORDS_ONLY_CLI`):
/// the queue's counters written as the operator would. With `BENCH_KUBECTL_DLQ_BEFORE` (a
/// `kubectl-dlq` built from an earlier commit) the same commands of that binary too.
pub async fn cli_at_scale(b: &mut Bench, n: usize) -> anyhow::Result<Vec<(String, f64, usize)>> {
    let ns = namespace_with(b, "cli-scale", json!({"maxParked": n * 2})).await?;
    create_plain(&b.client, &ns, n, b.c, 1024).await?;
    Api::<DeadLetterQueue>::namespaced(b.client.clone(), &ns)
        .patch_status(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"parked": n, "failureKinds": {"Transient": {"parked": n}}}}),
            ),
        )
        .await?;
    let mut out = Vec::new();
    let mut bins = vec![("after".to_string(), release_bin("kubectl-dlq")?)];
    if let Some(before) = std::env::var_os("BENCH_KUBECTL_DLQ_BEFORE") {
        bins.push(("before".to_string(), PathBuf::from(before)));
    }
    for (which, bin) in bins {
        for args in [&["ls", "--queue", "relayer"][..], &["stats"][..]] {
            let (ms, lines) = time_bin(&bin, b, &ns, args)?;
            out.push((
                format!("{which}: kubectl dlq {}", args.join(" ")),
                ms,
                lines,
            ));
        }
    }
    for s in search_at_scale(b, &ns, n)? {
        out.push((s.what, s.ms, s.lines));
    }
    Ok(out)
}

/// One search's figure at scale.
pub struct Searched {
    pub what: String,
    pub ms: f64,
    pub lines: usize,
}

/// The searches of issue 60 over the `n` records of [`create_plain`] (1 KiB payloads of `x`):
/// `ls --grep` for the last record's job id and `--where` on a payload path nothing has (every
/// record read: the whole scan), `--grep` whose first 50 matches are on the first page (what
/// on-call sees first), and the page's search box with its watch synced, then from its start.
pub fn search_at_scale(b: &Bench, ns: &str, n: usize) -> anyhow::Result<Vec<Searched>> {
    let last = format!("bench/{:06}", n.saturating_sub(1));
    let mut out = Vec::new();
    let runs: [(&str, Vec<&str>); 3] = [
        (
            "ls --grep, one match (whole scan)",
            vec!["--grep", last.as_str()],
        ),
        (
            "ls --where payload path, no match (whole scan)",
            vec!["--where", "payload.customer=cus_42"],
        ),
        (
            "ls --grep, first 50 matches",
            vec!["--grep", "bench", "--limit", "50"],
        ),
    ];
    for (what, extra) in runs {
        let mut args = vec!["ls", "--queue", "relayer"];
        args.extend(extra);
        let (ms, lines) = time_cli(b, ns, &args)?;
        out.push(Searched {
            what: format!("kubectl dlq {what}"),
            ms,
            lines,
        });
    }
    let query = format!("queue=relayer&phase=&grep={}", last.replace('/', "%2F"));
    let page = page_search(b, ns, &query, "1 records match")?;
    out.push(Searched {
        what: "the page's search, watch synced (one match)".into(),
        ms: page.search_ms,
        lines: 1,
    });
    out.push(Searched {
        what: "the page's first complete answer from its start".into(),
        ms: page.first_ms,
        lines: 1,
    });
    Ok(out)
}

/// The page's figures: its first complete answer from the start (the watch lists every
/// record first), then the same search asked again once synced.
pub struct PageSearch {
    pub first_ms: f64,
    pub search_ms: f64,
}

/// `kubectl dlq ui` (the release binary) searching `query` on its records page until the
/// answer says `want`; then the median of five more asks.
pub fn page_search(b: &Bench, ns: &str, query: &str, want: &str) -> anyhow::Result<PageSearch> {
    let start = Instant::now();
    let mut child = Command::new(release_bin("kubectl-dlq")?)
        .arg("--kubeconfig")
        .arg(&b.plane.kubeconfig)
        .args(["-n", ns, "ui"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let page = Page::read(&mut child);
    let result = page.and_then(|page| {
        let path = format!("/records/live?{query}");
        loop {
            if page.get(&path)?.contains(want) {
                break;
            }
            if start.elapsed() > Duration::from_secs(300) {
                bail!("the page did not answer {want:?} in 5 minutes");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let first_ms = start.elapsed().as_secs_f64() * 1000.0;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let body = page.get(&path)?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
            if !body.contains(want) {
                bail!("the page's search changed its answer: {body:.200}");
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(PageSearch {
            first_ms,
            search_ms: times[times.len() / 2],
        })
    });
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// The page's address and the cookie its token buys.
struct Page {
    authority: String,
    cookie: String,
}

impl Page {
    /// From the first line `kubectl dlq ui` prints (`... http://127.0.0.1:PORT/?token=T`).
    fn read(child: &mut std::process::Child) -> anyhow::Result<Page> {
        use std::io::BufRead;
        let stdout = child.stdout.take().context("the page's stdout")?;
        let mut lines = std::io::BufReader::new(stdout);
        let mut line = String::new();
        lines.read_line(&mut line)?;
        // Keep reading so the page's later lines never meet a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut lines, &mut std::io::sink()));
        let url = line.split_whitespace().last().unwrap_or_default();
        let (base, token) = url
            .trim_start_matches("http://")
            .split_once("/?token=")
            .with_context(|| format!("no page URL in {line:?}"))?;
        let port = base.rsplit(':').next().unwrap_or_default();
        Ok(Page {
            authority: base.to_string(),
            cookie: format!("dlq_ui_{port}={token}"),
        })
    }

    /// One GET with the cookie: the body (the status line must say 200).
    fn get(&self, path: &str) -> anyhow::Result<String> {
        let mut s = std::net::TcpStream::connect(&self.authority)?;
        s.write_all(
            format!(
                "GET {path} HTTP/1.1\r\nHost: {}\r\nCookie: {}\r\nConnection: close\r\n\r\n",
                self.authority, self.cookie
            )
            .as_bytes(),
        )?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        if !answer.starts_with("HTTP/1.1 200") {
            bail!("GET {path}: {:.200}", answer);
        }
        Ok(answer)
    }
}

/// The 100,000-record point.
pub struct Scale {
    pub marked_secs: f64,
    pub peak_mib: f64,
    pub rss_mib: f64,
    pub restart_secs: f64,
    pub ls_ms: f64,
    pub ls_rows: usize,
    pub stats_ms: f64,
    pub redrive_rate: f64,
    /// The plain client's redrive writes on as many other records of the same namespace, the
    /// operator stopped: the ceiling at this scale.
    pub redrive_ceiling: f64,
    /// The searches' figures ([`search_at_scale`]).
    pub searches: Vec<Searched>,
}

/// `n` records of 1 KiB in one queue: the operator marks them, is restarted, `ls` and `stats`
/// are timed, and 10,000 are redriven.
pub async fn hundred_thousand(b: &mut Bench, n: usize, redrive: usize) -> anyhow::Result<Scale> {
    let ns = namespace_with(b, "scale", json!({"maxParked": n * 2})).await?;
    create_plain(&b.client, &ns, n, b.c, 1024).await?;
    eprintln!("scale: {n} records created");
    let queues: Api<DeadLetterQueue> = Api::namespaced(b.client.clone(), &ns);
    let parked = || async {
        queues
            .get("relayer")
            .await
            .ok()
            .and_then(|q| q.status)
            .map_or(0, |s| s.parked)
    };
    let start = Instant::now();
    let (op, pid) = b.operator(&ns)?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    // Every record marked (the operator's own count) and counted.
    loop {
        if op.marks() >= n as f64 && parked().await == n as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let marked_secs = start.elapsed().as_secs_f64();
    let (peak_mib, rss_mib) = rss_mib(pid);
    drop(op);

    // Restart → first reconcile: a decision made as the operator starts, until it is resolved.
    let first = record_name("relayer", &format!("bench/{:06}", 0), 1);
    let start = Instant::now();
    let (_op, _) = b.operator(&ns)?;
    api.patch(
        &first,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"action": "drop", "by": "bench"}})),
    )
    .await?;
    while api.get(&first).await?.phase() != Phase::Dropped {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let restart_secs = start.elapsed().as_secs_f64();

    let (ls_ms, ls_rows) = time_cli(b, &ns, &["ls", "--queue", "relayer"])?;
    let (stats_ms, _) = time_cli(b, &ns, &["stats"])?;
    let searches = search_at_scale(b, &ns, n)?;

    let names: Vec<String> = (1..=redrive)
        .map(|i| record_name("relayer", &format!("bench/{i:06}"), 1))
        .collect();
    let mut redis = redis::Client::open(b.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let key = format!("bench:{ns}");
    let start = Instant::now();
    decide_all(&api, &names, b.c).await?;
    while list_len(&mut redis, &key).await < redrive {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if start.elapsed() > Duration::from_secs(1800) {
            bail!("redrive of {redrive} did not finish in 30 minutes");
        }
    }
    let redrive_rate = redrive as f64 / start.elapsed().as_secs_f64();
    drop(_op);
    let others: Vec<String> = (redrive + 1..=2 * redrive)
        .map(|i| record_name("relayer", &format!("bench/{i:06}"), 1))
        .collect();
    let redrive_ceiling = redrive_writes(&api, &others, b.c).await?;
    Ok(Scale {
        marked_secs,
        peak_mib,
        rss_mib,
        restart_secs,
        ls_ms,
        ls_rows,
        stats_ms,
        redrive_rate,
        redrive_ceiling,
        searches,
    })
}
