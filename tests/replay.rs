//! A DeadLetterReplay survives its operator: killed mid-run, the next operator continues from
//! the records (the `dlq.dev/replay` label) and decides no record twice.

use std::time::Duration;

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{DeadLetter, Job, Phase};
use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{LIST, Operator, create_queue, eventually, list_target, setup};
use futures::StreamExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

const RECORDS: usize = 120;

#[tokio::test]
async fn a_replay_continues_after_its_operator_is_killed_without_deciding_twice() {
    let (client, ns) = setup("replay-failover").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    futures::stream::iter(0..RECORDS)
        .map(|i| {
            let (client, ns) = (client.clone(), ns.clone());
            async move {
                let job = Job {
                    id: format!("fo/{i:03}"),
                    payload: Some(format!("job {i}")),
                    ..Job::default()
                };
                park(client, &ns, ParkRequest::new("relayer", job))
                    .await
                    .expect("parked");
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let mut first = Operator::start(&ns);
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "rate": "20/s", "by": "ops", "note": "failover"
    }))
    .expect("a spec");
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("failover", spec),
        )
        .await
        .expect("the replay");
    eventually(60, "a third decided", || async {
        let r = replays.get("failover").await.ok()?;
        (r.status?.decided >= (RECORDS / 3) as i64).then_some(())
    })
    .await;
    first.kill();
    // Only a job whose record was decided and not yet resolved when the operator died can have
    // been requeued without its status write: those, and no others, may arrive twice.
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let in_flight = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .iter()
        .filter(|r| r.spec.action.is_some() && r.phase() == Phase::Parked)
        .count();
    let _second = Operator::start(&ns);
    let done = eventually(90, "the replay to complete", || async {
        replays
            .get("failover")
            .await
            .ok()
            .filter(|r| r.phase() == ReplayPhase::Completed)
    })
    .await;
    let status = done.status.unwrap_or_default();
    assert_eq!(
        (status.selected, status.decided, status.redriven),
        (RECORDS as i64, RECORDS as i64, RECORDS as i64),
        "{status:?}"
    );
    let items = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    assert!(
        items
            .iter()
            .all(|r| r.phase() == Phase::Redriven && r.spec.by.as_deref() == Some("ops"))
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delivered = redis.list(LIST).await.len();
    assert!(
        (RECORDS..=RECORDS + in_flight).contains(&delivered),
        "{delivered} deliveries for {RECORDS} records, {in_flight} of them in flight at the kill"
    );
    dlq_testenv::report(&format!(
        "replay failover: operator killed at a third with {in_flight} decided and unresolved; {}; {delivered} deliveries",
        status.summary.unwrap_or_default()
    ));
}

/// Issue 45 item 13: a replay of a group (5 selected, seen Running) also redrove 2 records of
/// the group parked right after it started. The reviewer approved the 5: exactly those are
/// decided, and the 2 are new parkings, left Parked.
#[tokio::test]
async fn a_replay_decides_exactly_the_records_selected_at_its_start() {
    use dlq_core::group::labelled;
    let (client, ns) = setup("replay-frozen").await;
    dlq_testenv::create_offline_queue(&client, &ns).await;
    let _op = Operator::start(&ns);
    let parker = dlq_client::park::Parker::new(client.clone());
    let park = |i: usize| {
        let mut req = ParkRequest::new(
            "relayer",
            Job {
                id: format!("frozen/{i}"),
                payload: Some("{}".into()),
                ..Job::default()
            },
        );
        req.reason = format!("order {i} has no customer");
        req
    };
    let mut group = String::new();
    for i in 0..5 {
        let outcome = parker.park(&ns, park(i)).await.expect("parked");
        group = labelled(outcome.record()).expect("labelled").to_string();
    }
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    // 2/s: the run lasts about two seconds, so the late parkings land while it decides.
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "action": "drop", "rate": "2/s", "by": "ops",
        "selector": {"group": group}, "settleSeconds": 5
    }))
    .expect("a spec");
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("group", spec),
        )
        .await
        .expect("the replay");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = replays.get("group").await.expect("the replay");
        if r.phase() == ReplayPhase::Running {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never Running: {:?}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut late = Vec::new();
    for i in 5..7 {
        let outcome = parker.park(&ns, park(i)).await.expect("parked");
        assert_eq!(
            labelled(outcome.record()),
            Some(group.as_str()),
            "the same group"
        );
        late.push(outcome.record().metadata.name.clone().unwrap_or_default());
    }
    let done = eventually(60, "the replay to complete", || async {
        let r = replays.get("group").await.ok()?;
        (r.phase() == ReplayPhase::Completed).then_some(r)
    })
    .await;
    let status = done.status.unwrap_or_default();
    assert_eq!(
        (
            status.selected,
            status.decided,
            status.dropped,
            status.new_parked
        ),
        (5, 5, 5, 2),
        "{status:?}"
    );
    let records: Api<DeadLetter> = Api::namespaced(client, &ns);
    for name in &late {
        let r = records.get(name).await.expect("a late record");
        assert_eq!(r.phase(), Phase::Parked, "{name}: parked after the start");
        assert_eq!(r.spec.action, None, "{name}: undecided");
    }
}

/// Issue 47: a storm past `maxParked` (1,500 dead messages of one failure group on a Redis dead
/// list, `maxParked` 50) is redriven by ONE standing replay: the records it parked are decided,
/// the rest go straight from the dead list to the target without a record each, and every job
/// arrives exactly once; etcd never holds more than `maxParked` records of the storm, and the
/// queue's backlog said how big the storm was before anyone acted.
#[tokio::test]
async fn one_standing_redrive_drains_a_storm_past_max_parked_each_job_once() {
    use dlq_core::api::DeadLetterQueue;
    use dlq_core::group::labelled;
    const STORM: usize = 1500;
    const MAX_PARKED: i64 = 50;
    let (client, ns) = setup("replay-storm").await;
    let redis = Redis::start();
    create_queue(
        &client,
        &ns,
        &redis.url(),
        list_target(),
        json!({"maxParked": MAX_PARKED, "source": {"redis": {"list": "relayer:dead"}}}),
    )
    .await;
    let mut conn = redis.conn().await;
    let mut pipe = redis::pipe();
    for i in 0..STORM {
        let envelope = json!({
            "id": format!("storm/{i:05}"),
            "payload": format!("{{\"intent\":\"pi_{i:05}\"}}"),
            "reason": format!("payer timeout after {}ms", 30_000 + i),
            "failureKind": "Transient",
        });
        pipe.cmd("RPUSH")
            .arg("relayer:dead")
            .arg(envelope.to_string());
    }
    let _: () = pipe.query_async(&mut conn).await.expect("RPUSH the storm");
    let _op = Operator::start(&ns);
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    // The queue fills, and says how much more waits in the broker.
    let waiting = eventually(60, "the backlog beyond maxParked", || async {
        let s = queues.get("relayer").await.ok()?.status?;
        let waiting = s.backlog?.messages?;
        (s.parked == MAX_PARKED && waiting > 1000).then_some(waiting)
    })
    .await;
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let parked = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    let group = labelled(&parked[0]).expect("a group label").to_string();
    assert!(
        parked.iter().all(|r| labelled(r) == Some(group.as_str())),
        "one failure group"
    );
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "by": "ops", "note": "INC-47 payer fixed", "standing": true,
        "selector": {"group": group}, "rate": "100/s", "settleSeconds": 10
    }))
    .expect("a spec");
    let started = std::time::Instant::now();
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("storm", spec),
        )
        .await
        .expect("the replay");
    let done = eventually(180, "the standing replay to complete", || async {
        let r = replays.get("storm").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let took = started.elapsed();
    let phase = done.phase();
    let status = done.status.unwrap_or_default();
    assert_eq!(phase, ReplayPhase::Completed, "{status:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delivered = redis.list(LIST).await;
    let mut jobs: Vec<String> = delivered
        .iter()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    jobs.sort();
    let before = jobs.len();
    jobs.dedup();
    assert_eq!(before, jobs.len(), "a job delivered twice");
    assert_eq!(jobs.len(), STORM, "every job back, each once");
    assert_eq!(
        status.passed_through + status.redriven,
        STORM as i64,
        "each job counted once on the replay: {status:?}"
    );
    assert!(status.passed_through > 1000, "{status:?}");
    assert_eq!(status.sample.len(), dlq_core::replay::SAMPLE);
    for key in [
        "relayer:dead",
        "relayer:dead:processing",
        "relayer:dead:inflight",
    ] {
        let left: i64 = redis::cmd(if key.ends_with("inflight") {
            "HLEN"
        } else {
            "LLEN"
        })
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("length");
        assert_eq!(left, 0, "{key} still holds dead messages");
    }
    let made = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    assert!(
        made.len() as i64 <= MAX_PARKED + 32,
        "{} records for a storm of {STORM}: pass-through makes none",
        made.len()
    );
    let summary = status.summary.unwrap_or_default();
    assert!(
        summary.contains(&format!("passed through {}", status.passed_through)),
        "{summary}"
    );
    dlq_testenv::report(&format!(
        "standing redrive: {STORM} dead messages ({waiting} waiting in the broker when it started), maxParked {MAX_PARKED}: {} passed through and {} records redriven in {:.1} s (one command); {} records made",
        status.passed_through,
        status.redriven,
        took.as_secs_f64(),
        made.len()
    ));
}
