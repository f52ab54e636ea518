//! `make bench` (failure groups): a storm of `BENCH_GROUP_RECORDS` dead messages (default
//! 10,000) drawn from 12 reason templates with random ids and 2 service versions, parked by 16
//! concurrent parkers into one queue with the operator running; reports the park rate, whether
//! it ends in exactly 24 DeadLetterGroups with exact counts, how long after the storm's last
//! park every group's status was current, and how long `kubectl dlq groups` takes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dlq_client::park::{ParkRequest, Parker};
use dlq_core::api::Job;
use dlq_core::groups::DeadLetterGroup;
use dlq_testenv::{Operator, create_queue, list_target, setup};
use futures::StreamExt;
use kube::api::{Api, ListParams};
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

#[tokio::main]
async fn main() {
    let n = env_usize("BENCH_GROUP_RECORDS", 10_000);
    let (client, ns) = setup("bench-groups").await;
    create_queue(
        &client,
        &ns,
        "redis://127.0.0.1:1/",
        list_target(),
        json!({"maxParked": n}),
    )
    .await;
    let _op = Operator::start(&ns);
    let parker = Parker::new(client.clone());
    let mut want: BTreeMap<String, i64> = BTreeMap::new();
    let start = Instant::now();
    let groups: Vec<String> = futures::stream::iter(0..n)
        .map(|i| {
            let parker = parker.clone();
            let ns = ns.clone();
            async move {
                let outcome = parker.park(&ns, request(i)).await.expect("parked");
                dlq_core::group::labelled(outcome.record())
                    .unwrap_or_default()
                    .to_string()
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let parked_at = Instant::now();
    let rate = n as f64 / start.elapsed().as_secs_f64();
    for g in groups {
        *want.entry(g).or_default() += 1;
    }
    let api: Api<DeadLetterGroup> = Api::namespaced(client.clone(), &ns);
    let deadline = parked_at + Duration::from_secs(120);
    let current = loop {
        let items = api.list(&ListParams::default()).await.map(|l| l.items);
        let got: BTreeMap<String, i64> = items
            .unwrap_or_default()
            .iter()
            .filter_map(|g| {
                let f = g.metadata.labels.as_ref()?.get("dlq.dev/group")?.clone();
                Some((f, g.status.as_ref()?.parked))
            })
            .collect();
        if got == want {
            break Some(parked_at.elapsed());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "groups: {n} records from 12 templates x 2 versions parked at {rate:.0}/s -> {} groups by label (want 24)",
        want.len()
    );
    match current {
        Some(t) => println!(
            "groups: every DeadLetterGroup exact {} ms after the storm's last park",
            t.as_millis()
        ),
        None => println!("groups: DeadLetterGroups NOT exact 120 s after the storm"),
    }
    let plane = dlq_testenv::plane();
    let kubeconfig = plane.kubeconfig.to_string_lossy().to_string();
    let t = Instant::now();
    let out = std::process::Command::new(dlq_testenv::bin("kubectl-dlq"))
        .args(["--kubeconfig", &kubeconfig, "-n", &ns, "groups"])
        .output()
        .expect("kubectl-dlq runs");
    println!(
        "groups: kubectl dlq groups with {n} records: {} ms ({} lines)",
        t.elapsed().as_millis(),
        String::from_utf8_lossy(&out.stdout).lines().count()
    );
}
