//! `maxParked` as a hard limit against a real apiserver: concurrent parkers in this process and
//! in others (`kubectl dlq park`), with the operator counting and reckoning their blocks of
//! slots meanwhile; and a Redis source that leaves what does not fit in the broker (not in
//! `:rejected`) and parks it once records are resolved.

use std::process::Stdio;

use dlq_client::park::{ParkError, ParkRequest, Parker};
use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Job, Phase};
use dlq_core::conditions;
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    Operator, create_offline_queue, create_queue, decide, events_for, eventually, list_target,
    setup, setup_redis_queue,
};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

fn request(id: &str) -> ParkRequest {
    ParkRequest::new(
        "relayer",
        Job {
            id: id.into(),
            payload: Some(format!("{{\"id\":\"{id}\"}}")),
            ..Job::default()
        },
    )
}

/// Records that are Parked (or not yet marked), from etcd.
async fn parked(api: &Api<DeadLetter>) -> usize {
    api.list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter(|r| r.phase() == Phase::Parked)
                .count()
        })
        .unwrap_or(0)
}

/// The queue's `Full` condition (status, reason), once the operator wrote it.
async fn full(queues: &Api<DeadLetterQueue>) -> Option<(String, String)> {
    let q = queues.get("relayer").await.ok()?;
    let c = conditions::find(&q.status?.conditions, conditions::FULL)?.clone();
    Some((c.status, c.reason))
}

/// `kubectl dlq park` of `id` in a process of its own: (succeeded, stderr).
fn cli_park(ns: &str, id: &str) -> tokio::task::JoinHandle<(bool, String)> {
    let kubeconfig = dlq_testenv::plane().kubeconfig.clone();
    let (ns, id) = (ns.to_string(), id.to_string());
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(dlq_testenv::bin("kubectl-dlq"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["-n", &ns, "park", "--queue", "relayer", "--id", &id])
            .args(["--payload", "{}"])
            .stdin(Stdio::null())
            .output()
            .expect("kubectl-dlq runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    })
}

#[tokio::test]
async fn max_parked_holds_under_concurrent_parkers_and_the_cli() {
    let (client, ns) = setup("cap-race").await;
    create_queue(
        &client,
        &ns,
        "redis://127.0.0.1:1/",
        list_target(),
        json!({"maxParked": 40}),
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);

    // Three parkers in this process (they share one batching point), 30 jobs each, all at
    // once; and 30 `kubectl dlq park` processes at the same time, each its own contender.
    let mut tasks = Vec::new();
    for p in 0..3 {
        let parker = Parker::new(client.clone());
        let ns = ns.clone();
        tasks.push(tokio::spawn(async move {
            futures::future::join_all((0..30).map(|i| {
                let (parker, ns) = (parker.clone(), ns.clone());
                async move { parker.park(&ns, request(&format!("p{p}/{i}"))).await }
            }))
            .await
        }));
    }
    let clis: Vec<_> = (0..30)
        .map(|i| cli_park(&ns, &format!("cli/{i}")))
        .collect();

    let (mut new, mut full_refusals) = (0, 0);
    for t in tasks {
        for r in t.await.expect("parker task") {
            match r {
                Ok(o) if o.is_new() => new += 1,
                Ok(_) => panic!("no job was parked twice"),
                Err(ParkError::MaxParked { limit: 40, .. }) => full_refusals += 1,
                Err(e) => panic!("unexpected refusal: {e}"),
            }
        }
    }
    for c in clis {
        let (ok, stderr) = c.await.expect("cli task");
        if ok {
            new += 1;
        } else {
            assert!(stderr.contains("at its maxParked of 40"), "{stderr}");
            full_refusals += 1;
        }
    }
    assert_eq!((new, full_refusals), (40, 80), "exactly maxParked admitted");
    let all = api.list(&ListParams::default()).await.expect("list").items;
    assert_eq!(all.len(), 40, "exactly 40 records exist");

    // The operator says so: condition, Event, and the blocks of slots are reckoned into its count.
    eventually(
        30,
        "the queue to be Full with its blocks counted",
        || async {
            let q = queues.get("relayer").await.ok()?;
            let s = q.status.as_ref()?;
            (s.parked == 40 && s.blocks.is_empty()).then_some(())
        },
    )
    .await;
    assert_eq!(
        full(&queues).await,
        Some(("True".into(), "MaxParkedReached".into()))
    );
    let events = eventually(30, "a QueueFull Event", || async {
        let e = events_for(&client, &ns, "relayer", "QueueFull").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));

    // One resolved: exactly one more fits, from the CLI too.
    decide(&api, &all[0].name_any(), Action::Drop, "ops").await;
    eventually(30, "the drop counted", || async {
        let q = queues.get("relayer").await.ok()?;
        (q.status?.parked == 39).then_some(())
    })
    .await;
    let (ok, stderr) = cli_park(&ns, "after/1").await.expect("cli");
    assert!(ok, "{stderr}");
    let (ok, stderr) = cli_park(&ns, "after/2").await.expect("cli");
    assert!(!ok && stderr.contains("maxParked"), "{stderr}");
    assert_eq!(parked(&api).await, 40);
}

/// Dead messages still in Redis: waiting, moved for parking, or in flight (`<list>:inflight`).
async fn in_broker(redis: &Redis) -> usize {
    redis.list("relayer:dead").await.len()
        + redis.list("relayer:dead:processing").await.len()
        + redis.hash_len("relayer:dead:inflight").await
}

/// Pushes `n` envelopes onto the dead list.
async fn push_dead(redis: &Redis, list: &str, n: usize) {
    let mut c = redis.conn().await;
    let mut pipe = redis::pipe();
    for i in 0..n {
        let env = json!({"id": format!("dead/{i}"), "payload": format!("{{\"n\":{i}}}")});
        pipe.cmd("LPUSH").arg(list).arg(env.to_string());
    }
    let _: () = pipe.query_async(&mut c).await.expect("LPUSH");
}

#[tokio::test]
async fn a_full_queue_leaves_dead_messages_in_redis_and_parks_them_as_records_resolve() {
    let (client, ns, redis) = setup_redis_queue(
        "cap-storm",
        json!({"maxParked": 20, "source": {"redis": {"list": "relayer:dead"}}}),
    )
    .await;
    push_dead(&redis, "relayer:dead", 50).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);

    eventually(60, "the queue to fill and say so", || async {
        (full(&queues).await? == ("True".into(), "MaxParkedReached".into())).then_some(())
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let records = api.list(&ListParams::default()).await.expect("list").items;
    assert_eq!(records.len(), 20, "exactly maxParked records");
    assert_eq!(in_broker(&redis).await, 30, "the rest stays in the broker");
    assert!(redis.list("relayer:dead:rejected").await.is_empty());
    assert!(
        !events_for(&client, &ns, "relayer", "QueueFull")
            .await
            .is_empty()
    );

    // Resolve in rounds: each frees room, the source parks more, never beyond 20 Parked.
    let mut max_seen = 0;
    for _ in 0..10 {
        let items = api.list(&ListParams::default()).await.expect("list").items;
        if items.len() == 50 {
            break;
        }
        for r in items.iter().filter(|r| r.phase() == Phase::Parked) {
            decide(&api, &r.name_any(), Action::Drop, "ops").await;
        }
        let before = items.len();
        eventually(60, "more records parked after resolutions", || async {
            let n = api.list(&ListParams::default()).await.ok()?.items.len();
            (n > before).then_some(())
        })
        .await;
        max_seen = max_seen.max(parked(&api).await);
    }
    eventually(60, "all 50 dead messages to be records", || async {
        let n = api.list(&ListParams::default()).await.ok()?.items.len();
        (n == 50).then_some(())
    })
    .await;
    assert!(
        max_seen <= 20,
        "never more than maxParked parked: {max_seen}"
    );
    eventually(30, "the dead list drained", || async {
        (in_broker(&redis).await == 0).then_some(())
    })
    .await;
    assert!(redis.list("relayer:dead:rejected").await.is_empty());
}

/// A storm from one process takes its slots in growing blocks: a few queue writes for hundreds
/// of records, not one each. No operator runs, so nothing is reckoned and the blocks stay in
/// the status to be looked at.
#[tokio::test]
async fn a_parking_storm_takes_slots_in_a_few_growing_blocks() {
    let (client, ns) = setup("cap-blocks").await;
    create_offline_queue(&client, &ns).await;
    let parker = Parker::new(client.clone());
    let results = futures::future::join_all((0..300).map(|i| {
        let (parker, ns) = (parker.clone(), ns.clone());
        async move { parker.park(&ns, request(&format!("storm/{i}"))).await }
    }))
    .await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(results.iter().all(|r| r.as_ref().is_ok_and(|o| o.is_new())));
    let q = Api::<DeadLetterQueue>::namespaced(client.clone(), &ns)
        .get("relayer")
        .await
        .expect("queue");
    let blocks = q.status.expect("status").blocks;
    let slots: i64 = blocks.values().map(|b| b.size).sum();
    assert!(
        // At most the block being spent and the one asked for ahead beyond the 300.
        blocks.len() <= 20 && (300..300 + 2 * dlq_core::capacity::MAX_BLOCK).contains(&slots),
        "{} blocks, {slots} slots: {blocks:?}",
        blocks.len()
    );
    // Every record names its block, and no block holds more records than slots.
    let records = Api::<DeadLetter>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    let mut per_block = std::collections::BTreeMap::<String, i64>::new();
    for r in &records {
        let block = r
            .annotations()
            .get("dlq.dev/slot-block")
            .expect("block")
            .clone();
        *per_block.entry(block).or_default() += 1;
    }
    for (id, n) in &per_block {
        assert!(*n <= blocks[id].size, "block {id}: {n} records");
    }
    // The blocks grew: one of them carried a large part of the storm. (Which sizes remain in
    // the status depends on whether a block's unused slots were already given back, so the
    // records per block are what is checked.)
    let largest = per_block.values().copied().max().unwrap_or(0);
    assert!(
        largest >= 64,
        "largest block holds {largest} records: {per_block:?} / {blocks:?}"
    );
    dlq_testenv::report(&format!(
        "capacity: 300 parkings took {} blocks ({slots} slots)",
        blocks.len()
    ));
    // Slots not taken within the block's use window go back: exactly 300 stay counted.
    let queues = Api::<DeadLetterQueue>::namespaced(client.clone(), &ns);
    eventually(30, "unused slots given back", || async {
        let blocks = queues.get("relayer").await.ok()?.status?.blocks;
        (blocks.values().map(|b| b.size).sum::<i64>() == 300).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_queue_without_max_parked_gets_the_safe_default() {
    let (client, ns) = setup("cap-default").await;
    create_offline_queue(&client, &ns).await;
    let q = Api::<DeadLetterQueue>::namespaced(client, &ns)
        .get("relayer")
        .await
        .expect("queue");
    assert_eq!(
        q.spec.max_parked,
        Some(dlq_core::api::DEFAULT_MAX_PARKED),
        "the apiserver fills in the default, so kubectl shows it"
    );
    assert_eq!(dlq_core::api::DEFAULT_MAX_PARKED, 5000);
}
