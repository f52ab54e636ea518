//! `make bench` (per-record alerts): park → Alertmanager and park → webhook latency over
//! `BENCH_ALERT_SAMPLES` records (default 100), against a real Alertmanager (group_wait and
//! group_interval 1 s, so the webhook figure includes up to ~1 s of Alertmanager's grouping);
//! then the POSTs per minute the operator makes while `BENCH_ALERT_PARKED` records (default
//! 10,000) stay parked, counted at an HTTP sink standing in for Alertmanager.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dlq_client::park::{ParkRequest, Parker};
use dlq_core::api::Job;
use dlq_testenv::brokers::{Alertmanager, HttpSink};
use dlq_testenv::{
    Operator, alerts_per_record, create_offline_queue, create_queue, list_target, setup,
};
use futures::StreamExt;
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn request(id: &str) -> ParkRequest {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: id.into(),
            payload: Some("{}".into()),
            ..Job::default()
        },
    );
    r.reason = "bench".into();
    r
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Jobs Alertmanager holds as active, and jobs the webhook was told of.
fn seen(am: &Alertmanager) -> (Vec<String>, Vec<String>) {
    let job = |a: &serde_json::Value| a["labels"]["job"].as_str().map(String::from);
    let active = am.active_alerts().iter().filter_map(job).collect();
    let hooked = am
        .notifications()
        .iter()
        .flat_map(|n| n["alerts"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| job(&a))
        .collect();
    (active, hooked)
}

/// Parks `n` records 100 ms apart and returns the p50/p99 (ms) of park → Alertmanager and
/// park → webhook.
async fn latency(n: usize) -> ((f64, f64), (f64, f64)) {
    let (client, ns) = setup("bench-alert-latency").await;
    let am = Alertmanager::start();
    create_offline_queue(&client, &ns).await;
    alerts_per_record(&client, &ns, "relayer").await;
    let _op = Operator::start_with(&ns, &[&format!("--alertmanager-url={}", am.url())], &[]);
    let parker = Parker::new(client.clone());
    let mut parked: HashMap<String, Instant> = HashMap::new();
    let (mut to_am, mut to_hook) = (HashMap::new(), HashMap::new());
    let deadline = Instant::now() + Duration::from_secs(60 + n as u64 / 5);
    let mut next = 0;
    while (to_hook.len() < n || to_am.len() < n) && Instant::now() < deadline {
        if next < n {
            let id = format!("lat/{next:04}");
            parker.park(&ns, request(&id)).await.expect("park");
            parked.insert(id, Instant::now());
            next += 1;
        }
        let (active, hooked) = seen(&am);
        let now = Instant::now();
        for (jobs, into) in [(active, &mut to_am), (hooked, &mut to_hook)] {
            for j in jobs {
                if let Some(t) = parked.get(&j) {
                    into.entry(j).or_insert_with(|| now.duration_since(*t));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = |m: HashMap<String, Duration>| {
        let mut v: Vec<f64> = m.values().map(|d| d.as_secs_f64() * 1000.0).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        (percentile(&v, 0.5), percentile(&v, 0.99))
    };
    (stats(to_am), stats(to_hook))
}

/// POSTs per minute (and alerts per POST) while `n` records stay parked, over `window`.
async fn steady_posts(n: usize, window: Duration) -> (f64, f64, f64) {
    let (client, ns) = setup("bench-alert-posts").await;
    let sink = HttpSink::start(None);
    create_queue(
        &client,
        &ns,
        "redis://127.0.0.1:1/",
        list_target(),
        json!({"maxParked": n, "alerts": {"per": "record"}}),
    )
    .await;
    let _op = Operator::start_with(&ns, &[&format!("--alertmanager-url={}", sink.url(""))], &[]);
    let parker = Parker::new(client.clone());
    let start = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(16, |i| {
            let parker = parker.clone();
            let ns = ns.clone();
            async move {
                parker
                    .park(&ns, request(&format!("steady/{i:06}")))
                    .await
                    .expect("park");
            }
        })
        .await;
    let park_rate = n as f64 / start.elapsed().as_secs_f64();
    // Let the parking burst drain, then count a quiet window.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = sink.posts();
    tokio::time::sleep(window).await;
    let during: Vec<_> = sink.posts().into_iter().skip(before.len()).collect();
    let alerts: usize = during
        .iter()
        .filter_map(|p| serde_json::from_slice::<Vec<serde_json::Value>>(&p.body).ok())
        .map(|v| v.len())
        .sum();
    let minutes = window.as_secs_f64() / 60.0;
    let posts = during.len() as f64;
    (park_rate, posts / minutes, alerts as f64 / posts.max(1.0))
}

#[tokio::main]
async fn main() {
    let samples = env_usize("BENCH_ALERT_SAMPLES", 100);
    let parked = env_usize("BENCH_ALERT_PARKED", 10_000);
    let window = Duration::from_secs(env_usize("BENCH_ALERT_WINDOW_SECS", 120) as u64);
    let ((am50, am99), (hook50, hook99)) = latency(samples).await;
    println!(
        "alerts: park -> Alertmanager over {samples} records: p50 {am50:.0} ms, p99 {am99:.0} ms"
    );
    println!(
        "alerts: park -> webhook over {samples} records:      p50 {hook50:.0} ms, p99 {hook99:.0} ms (group_wait/interval 1s)"
    );
    let (rate, per_min, per_post) = steady_posts(parked, window).await;
    println!(
        "alerts: {parked} parked ({rate:.0}/s): {per_min:.1} POSTs/min over {}s, {per_post:.0} alerts per POST (lease 4m, resent every 1m)",
        window.as_secs()
    );
}
