//! `make bench` (failure groups): a storm of `BENCH_GROUP_RECORDS` dead messages (default
//! 10,000) drawn from 12 reason templates with random ids and 2 service versions, parked by 16
//! concurrent parkers into one queue with the operator running; reports the park rate against
//! plain creates of the same records into a queue of their own with the operator running there
//! too, measured just before (the apiserver's ceiling in this run with the operator's own writes
//! per record beside it, so that the ratio is what parking and grouping cost, not what the
//! operator's status writes cost), and how long after the storm's last park every group's
//! status was current; it fails unless the storm ends in exactly the 24 DeadLetterGroups the
//! generator made (fingerprints of its templates, counts of its requests, not the parker's
//! labels). Then, once the queue holds
//! `BENCH_GROUP_LIST_RECORDS` records (default 100,000), how long `kubectl dlq groups` takes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dlq_client::park::{ParkRequest, Parker};
use dlq_core::api::{DeadLetter, Job};
use dlq_core::groups::DeadLetterGroup;
use dlq_testenv::{Operator, create_queue, list_target, setup};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `i`-th dead message: template `i % 12`, version `i / 12 % 2`, ids from a cheap hash.
fn request(i: usize) -> ParkRequest {
    let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let id = format!("{:012x}", h >> 16);
    let reason = match i % 12 {
        0 => format!("timeout after {} ms talking to payer {id}", h % 5000),
        1 => format!("connection refused by 10.0.{}.{}:5432", h % 250, h % 7),
        2 => format!("field \"amount{}\" is not a number", h % 97),
        3 => format!("order {} has no customer", h % 100_000),
        4 => format!("payer {id} refused the signature"),
        5 => format!("rate limited by api.example.com for {}s", h % 60),
        6 => format!("deadlock detected on row {}", h % 1_000_000),
        7 => format!("unknown schema version {} in message {id}", h % 9),
        8 => format!("card {} expired", h % 10_000),
        9 => format!("mail to ops+{}@example.com bounced", h % 1000),
        10 => format!("retry budget of {} exhausted after {}ms", h % 10, h % 9000),
        _ => format!("trace 123e4567-e89b-12d3-a456-{id} lost"),
    };
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: format!("storm/{i}"),
            payload: Some("{}".into()),
            ..Job::default()
        },
    );
    r.reason = reason;
    r.service_version = Some(format!("relayer@1.4.{}", i / 12 % 2));
    r
}

/// Parkers at once, as a storm's consumers would.
const PARKERS: usize = 16;

/// Plain creates of the records `request(from..to)` would park (the parker's field manager), in
/// a namespace of their own deleted after, with a queue there and the operator running when
/// `operator` (as in the storm): the apiserver's ceiling, records/s.
async fn ceiling(client: &Client, range: std::ops::Range<usize>, operator: bool) -> f64 {
    let (_, ns) = setup("bench-groups-ceiling").await;
    let _op = if operator {
        create_queue(
            client,
            &ns,
            "redis://127.0.0.1:1/",
            list_target(),
            json!({"maxParked": range.len()}),
        )
        .await;
        Some(Operator::start(&ns))
    } else {
        None
    };
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let pp = PostParams {
        field_manager: Some(dlq_client::park::PARKER.into()),
        ..PostParams::default()
    };
    let n = range.len();
    let start = Instant::now();
    futures::stream::iter(range)
        .map(|i| {
            let (api, pp) = (&api, &pp);
            async move {
                let record = dlq_core::park::new_record(&request(i), 1);
                api.create(pp, &record).await.expect("created");
            }
        })
        .buffer_unordered(PARKERS)
        .collect::<Vec<()>>()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    rate
}

/// Parks `request(range)` through the client library, 16 at a time.
async fn park_storm(parker: &Parker, ns: &str, range: std::ops::Range<usize>) {
    futures::stream::iter(range)
        .map(|i| {
            let parker = parker.clone();
            async move {
                parker.park(ns, request(i)).await.expect("parked");
            }
        })
        .buffer_unordered(PARKERS)
        .collect::<Vec<()>>()
        .await;
}

/// Templates x versions of [`request`]: the groups a storm must end in.
const GROUPS: usize = 24;

/// The groups `request(0..n)` must end in, from the generator alone (not from what the
/// parker labelled): template `i % 12` and version `i / 12 % 2` make the group, named by the
/// fingerprint of its first request; each counts the requests it generated. Exits when two
/// templates share a fingerprint (fewer than 24 groups could never be right).
fn expected(n: usize) -> BTreeMap<String, i64> {
    let mut counts = [0i64; GROUPS];
    for i in 0..n {
        counts[i % 12 + 12 * (i / 12 % 2)] += 1;
    }
    let mut want = BTreeMap::new();
    for (g, count) in counts.into_iter().enumerate().filter(|(_, c)| *c > 0) {
        // Request `g` is the group's first: template g % 12, version g / 12.
        let record = dlq_core::park::new_record(&request(g), 1);
        let fingerprint = dlq_core::group::Key::of(&record).fingerprint();
        want.insert(fingerprint, count);
    }
    if n >= GROUPS && want.len() != GROUPS {
        fail(&format!(
            "{} fingerprints for the generator's {GROUPS} templates x versions",
            want.len()
        ));
    }
    want
}

/// A wrong result ends the bench with a failure, not a line to overlook.
fn fail(why: &str) -> ! {
    eprintln!("groups: FAILED: {why}");
    std::process::exit(1)
}

/// The groups as the operator counts them: fingerprint -> parked.
async fn counted(api: &Api<DeadLetterGroup>) -> BTreeMap<String, i64> {
    let items = api.list(&ListParams::default()).await.map(|l| l.items);
    items
        .unwrap_or_default()
        .iter()
        .filter_map(|g| {
            let f = g.metadata.labels.as_ref()?.get("dlq.dev/group")?.clone();
            Some((f, g.status.as_ref()?.parked))
        })
        .collect()
}

/// How long after `since` every group's status counted exactly `want` parked records (None
/// after `wait`).
async fn groups_exact(
    api: &Api<DeadLetterGroup>,
    want: &BTreeMap<String, i64>,
    since: Instant,
    wait: Duration,
) -> Option<Duration> {
    loop {
        if &counted(api).await == want {
            return Some(since.elapsed());
        }
        if since.elapsed() > wait {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Fails the bench unless the groups are exactly `want` within `wait` of `since`: how long
/// they took.
async fn require_exact(
    api: &Api<DeadLetterGroup>,
    want: &BTreeMap<String, i64>,
    since: Instant,
    wait: Duration,
) -> Duration {
    match groups_exact(api, want, since, wait).await {
        Some(t) => t,
        None => {
            let got = counted(api).await;
            fail(&format!(
                "{} DeadLetterGroups, not exactly the {} groups with their counts {} s after the storm; counted {got:?}, want {want:?}",
                got.len(),
                want.len(),
                wait.as_secs()
            ))
        }
    }
}

/// `kubectl dlq groups` run `times` times: (median, slowest, lines of the last output).
fn time_groups_cli(ns: &str, times: usize) -> (Duration, Duration, usize) {
    let plane = dlq_testenv::plane();
    let kubeconfig = plane.kubeconfig.to_string_lossy().to_string();
    let mut took = Vec::new();
    let mut lines = 0;
    for _ in 0..times {
        let t = Instant::now();
        let out = std::process::Command::new(dlq_testenv::bin("kubectl-dlq"))
            .args(["--kubeconfig", &kubeconfig, "-n", ns, "groups"])
            .output()
            .expect("kubectl-dlq runs");
        took.push(t.elapsed());
        assert!(out.status.success(), "kubectl dlq groups failed");
        lines = String::from_utf8_lossy(&out.stdout).lines().count();
    }
    took.sort();
    (took[took.len() / 2], took[took.len() - 1], lines)
}

#[tokio::main]
async fn main() {
    let n = env_usize("BENCH_GROUP_RECORDS", 10_000);
    let total = env_usize("BENCH_GROUP_LIST_RECORDS", 100_000).max(n);
    let (client, ns) = setup("bench-groups").await;
    // Warm-up, not counted: a fresh apiserver's first creates are cheaper than later ones.
    let warm = ceiling(&client, 0..n / 4, false).await;
    let bare = ceiling(&client, 0..n, false).await;
    let plain = ceiling(&client, 0..n, true).await;
    eprintln!(
        "groups: warm-up (not counted) {warm:.0}/s; plain creates {bare:.0}/s without the operator, {plain:.0}/s with it"
    );
    create_queue(
        &client,
        &ns,
        "redis://127.0.0.1:1/",
        list_target(),
        json!({"maxParked": total}),
    )
    .await;
    let _op = Operator::start(&ns);
    let parker = Parker::new(client.clone());
    let want = expected(n);
    let start = Instant::now();
    park_storm(&parker, &ns, 0..n).await;
    let parked_at = Instant::now();
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let api: Api<DeadLetterGroup> = Api::namespaced(client.clone(), &ns);
    let current = require_exact(&api, &want, parked_at, Duration::from_secs(120)).await;
    println!(
        "groups: {n} records from 12 templates x 2 versions parked at {rate:.0}/s with grouping and the operator on: {:.0}% of plain creates with the operator on ({plain:.0}/s, this run; {:.0}% of {bare:.0}/s without it)",
        100.0 * rate / plain,
        100.0 * rate / bare
    );
    println!(
        "groups: exactly {} DeadLetterGroups (12 templates x 2 versions, from the generator) with exact counts {} ms after the storm's last park",
        want.len(),
        current.as_millis()
    );
    let (median, slowest, lines) = time_groups_cli(&ns, 5);
    println!(
        "groups: kubectl dlq groups with {n} records: median {} ms, slowest {} ms ({lines} lines)",
        median.as_millis(),
        slowest.as_millis()
    );
    if total > n {
        park_storm(&parker, &ns, n..total).await;
        let want = expected(total);
        require_exact(&api, &want, Instant::now(), Duration::from_secs(900)).await;
        let (median, slowest, lines) = time_groups_cli(&ns, 5);
        println!(
            "groups: kubectl dlq groups with {total} records: median {} ms, slowest {} ms ({lines} lines; groups exact)",
            median.as_millis(),
            slowest.as_millis(),
        );
    }
}
