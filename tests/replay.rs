//! A DeadLetterReplay survives its operator: killed mid-run, the next operator continues from
//! the records (the `dlq.dev/replay` label) and decides no record twice.

use std::time::Duration;

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{DeadLetter, Job, Phase};
use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{LIST, Operator, create_queue, eventually, list_target, setup};
use futures::StreamExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
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

/// Issue 58 item 4: a standing redrive sends its parked records' jobs ahead of their
/// decisions, at the broker's pace, and signs and resolves the records behind: with `maxParked`
/// 200 and 600 dead messages of one group, every job reaches the target exactly once by its
/// identity, every record (the 200 parked before, any parked during) ends Redriven, signed by
/// the replay, and the replay counts each job once.
#[tokio::test]
async fn a_standing_redrive_sends_its_records_jobs_ahead_once_and_ends_them_redriven() {
    use dlq_core::replay::LABEL_REPLAY;
    const STORM: usize = 600;
    const MAX_PARKED: i64 = 200;
    let (client, ns) = setup("replay-ahead").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, MAX_PARKED).await;
    let group = push_dead(&redis, "a", STORM, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    let _op = Operator::start(&ns);
    full(&client, &ns, &redis, MAX_PARKED, 32).await;
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let name = |r: &DeadLetter| r.metadata.name.clone().unwrap_or_default();
    let parked: Vec<String> = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .iter()
        .map(name)
        .collect();
    assert_eq!(parked.len(), MAX_PARKED as usize, "the queue Full");
    let started = std::time::Instant::now();
    start_standing(&client, &ns, "ahead", &group, json!({})).await;
    let on_target = eventually(120, "every job on the target", || async {
        (arrivals(&redis).await.len() == STORM).then(|| started.elapsed())
    })
    .await;
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let done = eventually(180, "the standing replay to end", || async {
        let r = replays.get("ahead").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let took = started.elapsed();
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = arrivals(&redis).await;
    assert_eq!(got.len(), STORM, "every job on the target");
    assert!(
        got.values().all(|n| *n == 1),
        "a job arrived twice: {got:?}"
    );
    let items = records
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    for r in &items {
        let signed = r.metadata.labels.as_ref().and_then(|l| l.get(LABEL_REPLAY));
        assert_eq!(
            (r.phase(), r.spec.by.as_deref(), signed.map(String::as_str)),
            (Phase::Redriven, Some("ops"), Some("ahead")),
            "{}: resolved behind its job, signed by the replay",
            name(r)
        );
    }
    assert!(
        parked.iter().all(|p| items.iter().any(|r| name(r) == *p)),
        "the records parked before, all of them"
    );
    assert_eq!(
        (
            status.passed_through + status.redriven,
            status.redriven,
            status.decided
        ),
        (STORM as i64, items.len() as i64, items.len() as i64),
        "each job counted once on the replay: {status:?}"
    );
    assert_eq!(
        left_in_broker(&redis, "a").await,
        0,
        "none left in the broker"
    );
    dlq_testenv::report(&format!(
        "standing redrive, records' jobs sent ahead: {STORM} jobs on the target in {:.1} s ({} from {} records, {} passed through), each once; Completed, every record Redriven, at {:.1} s",
        on_target.as_secs_f64(),
        status.redriven,
        items.len(),
        status.passed_through,
        took.as_secs_f64()
    ));
}

/// Dead messages of one failure group onto the Redis dead list `relayer:dead`, as a worker
/// leaves them: `prefix/NNNNN`, each its own payload, its reason made by `reason`. The group's
/// fingerprint, as the source reads it.
async fn push_dead(
    redis: &Redis,
    prefix: &str,
    n: usize,
    reason: impl Fn(usize) -> String,
) -> String {
    use dlq_core::facts::Facts;
    let mut pipe = redis::pipe();
    let mut group = String::new();
    for i in 0..n {
        let envelope = json!({
            "id": format!("{prefix}/{i:05}"),
            "payload": format!("{{\"job\":\"{prefix}-{i:05}\"}}"),
            "reason": reason(i),
            "failureKind": "Transient",
        })
        .to_string();
        let req = dlq_core::envelope::request_for("relayer", envelope.as_bytes());
        group = dlq_core::park::arriving(&req, false).group().into_owned();
        pipe.cmd("RPUSH").arg("relayer:dead").arg(envelope);
    }
    let mut conn = redis.conn().await;
    let _: () = pipe.query_async(&mut conn).await.expect("RPUSH");
    group
}

/// A queue `relayer` draining the Redis dead list `relayer:dead` onto the list target, at most
/// `max_parked` records.
async fn storm_queue(client: &kube::Client, ns: &str, redis: &Redis, max_parked: i64) {
    create_queue(
        client,
        ns,
        &redis.url(),
        list_target(),
        json!({"maxParked": max_parked, "source": {"redis": {"list": "relayer:dead"}}}),
    )
    .await;
}

/// Waits until queue `relayer` holds `parked` records, and `inflight` messages wait in the
/// source's hands for room.
async fn full(client: &kube::Client, ns: &str, redis: &Redis, parked: i64, inflight: usize) {
    use dlq_core::api::DeadLetterQueue;
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    eventually(90, "the queue Full, messages waiting for room", || async {
        let s = queues.get("relayer").await.ok()?.status?;
        let waiting = redis.hash_len("relayer:dead:inflight").await;
        (s.parked == parked && waiting >= inflight).then_some(())
    })
    .await;
}

/// Creates standing replay `name` of `group` (`extra` merged into its spec).
async fn start_standing(
    client: &kube::Client,
    ns: &str,
    name: &str,
    group: &str,
    extra: serde_json::Value,
) {
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), ns);
    let mut spec = json!({
        "queue": "relayer", "by": "ops", "note": "INC-57", "standing": true,
        "selector": {"group": group}, "settleSeconds": 15
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    let spec: DeadLetterReplaySpec = serde_json::from_value(spec).expect("a spec");
    replays
        .create(&PostParams::default(), &DeadLetterReplay::new(name, spec))
        .await
        .expect("the replay");
}

/// Creates standing replay `name` of `group` (`extra` merged into its spec) and waits for its end.
async fn standing_run(
    client: &kube::Client,
    ns: &str,
    name: &str,
    group: &str,
    extra: serde_json::Value,
) -> DeadLetterReplay {
    start_standing(client, ns, name, group, extra).await;
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), ns);
    eventually(180, "the standing replay to end", || async {
        let r = replays.get(name).await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await
}

/// What the list target holds, by job payload: how many times each arrived.
async fn arrivals(redis: &Redis) -> std::collections::BTreeMap<String, usize> {
    let mut seen = std::collections::BTreeMap::new();
    for p in redis.list(LIST).await {
        *seen
            .entry(String::from_utf8_lossy(&p).into_owned())
            .or_insert(0) += 1;
    }
    seen
}

/// The dead messages of `prefix` still in the broker (dead list, processing list, inflight).
async fn left_in_broker(redis: &Redis, prefix: &str) -> usize {
    let mut conn = redis.conn().await;
    let mut left: Vec<Vec<u8>> = redis.list("relayer:dead").await;
    left.extend(redis.list("relayer:dead:processing").await);
    let taken: Vec<Vec<u8>> = redis::cmd("HVALS")
        .arg("relayer:dead:inflight")
        .query_async(&mut conn)
        .await
        .expect("HVALS");
    left.extend(taken);
    let mark = format!("\"id\":\"{prefix}/");
    left.iter()
        .filter(|e| String::from_utf8_lossy(e).contains(&mark))
        .count()
}

/// Issue 57 item 2: the queue Full (`maxParked` 5) with 32 messages of another group waiting
/// for room in the source's hands, then 60 of group G behind them and one of G too large for a
/// record (300 KiB): one standing redrive of G reaches past the waiting ones and passes the 60
/// through, each once. The large one is never passed (it waits for a slot), but seen: the
/// replay runs on while it waits in the broker (before: Completed with it still there), and
/// completes once room lets the source take it (rejected: no record holds it, and this queue
/// has no body store); the other group's messages wait where they were until then.
#[tokio::test]
async fn a_standing_redrive_reaches_its_group_behind_other_groups_waiting_for_room() {
    use dlq_core::api::DeadLetterQueue;
    let (client, ns) = setup("replay-reach").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 5).await;
    push_dead(&redis, "other", 40, |i| {
        format!("card declined for customer {i}")
    })
    .await;
    let _op = Operator::start(&ns);
    full(&client, &ns, &redis, 5, 32).await;
    let group = push_dead(&redis, "g", 60, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    push_large(&redis, "g", "payer timeout after 39999ms").await;
    let started = std::time::Instant::now();
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    // Room made below parks the other group's 35: not a sign that G's fix failed.
    let bounds = json!({"stopWhen": {"newParked": 100}});
    start_standing(&client, &ns, "reach", &group, bounds).await;
    let passed = eventually(120, "G's 60 passed through", || async {
        let s = replays.get("reach").await.ok()?.status?;
        (s.passed_through >= 60).then_some(s)
    })
    .await;
    let took = started.elapsed();
    // Past the settle time (15 s), with the large one of G still waiting in the broker.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let waiting = replays.get("reach").await.expect("the replay");
    assert_eq!(
        (waiting.phase(), left_in_broker(&redis, "g").await),
        (ReplayPhase::Running, 1),
        "the replay's phase while one of G waits in the broker: {:?}",
        waiting.status
    );
    let got = arrivals(&redis).await;
    let g_arrived = got.keys().filter(|p| p.contains("\"g-")).count();
    assert_eq!(
        (g_arrived, passed.passed_through),
        (60, 60),
        "G on the target, passed through: {passed:?}"
    );
    assert!(
        got.values().all(|n| *n == 1),
        "a job arrived twice: {got:?}"
    );
    assert_eq!(
        left_in_broker(&redis, "other").await,
        35,
        "the other group's messages wait where they were"
    );
    // Room: the source takes the rest; the large one is rejected, and the replay completes.
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let room = json!({"spec": {"maxParked": 100}});
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&room))
        .await
        .expect("maxParked 100");
    let done = eventually(120, "the standing replay to end", || async {
        let r = replays.get("reach").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    assert_eq!(done.phase(), ReplayPhase::Completed, "{:?}", done.status);
    let rejected = redis.list("relayer:dead:rejected").await;
    assert_eq!(
        (left_in_broker(&redis, "g").await, rejected.len()),
        (0, 1),
        "G left in the broker, and rejected, once the replay completed"
    );
    dlq_testenv::report(&format!(
        "standing redrive behind 32 waiting messages of another group: 60 of 60 passed through in {:.1} s; Running while a 300 KiB one of G waited, Completed once it was taken",
        took.as_secs_f64()
    ));
}

/// One dead message of `prefix` too large for a record (a 300 KiB payload) onto the dead list.
async fn push_large(redis: &Redis, prefix: &str, reason: &str) {
    let envelope = json!({
        "id": format!("{prefix}/large"),
        "payload": "x".repeat(300 << 10),
        "reason": reason,
        "failureKind": "Transient",
    })
    .to_string();
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("RPUSH")
        .arg("relayer:dead")
        .arg(envelope)
        .query_async(&mut conn)
        .await
        .expect("RPUSH");
}

/// Issue 57 item 4: `max` bounds the records decided and the messages passed together: with
/// `maxParked` 10 and 60 dead messages of one group, a standing redrive with `max: 30` sends
/// exactly 30 jobs to the target (it sent 40: 10 decided, 30 passed).
#[tokio::test]
async fn a_standing_replays_max_counts_decisions_and_passes_together() {
    let (client, ns) = setup("replay-max").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 10).await;
    let group = push_dead(&redis, "g", 60, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    let _op = Operator::start(&ns);
    full(&client, &ns, &redis, 10, 32).await;
    let done = standing_run(&client, &ns, "capped", &group, json!({"max": 30})).await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sent: usize = arrivals(&redis).await.values().sum();
    assert_eq!(
        (sent, status.decided + status.passed_through),
        (30, 30),
        "jobs sent, and decided + passed through, under max 30: {status:?}"
    );
}

/// Issue 57 item 5: the operator SIGKILLed while a standing redrive passes 600 dead messages
/// through, then started again: every job arrives exactly once, and the replay's log says at
/// least as many as arrived (`passedThrough + redriven`); it said 266 of 300. Reports the
/// pass-through rate before the kill.
#[tokio::test]
async fn a_kill_during_pass_through_never_leaves_the_count_below_what_was_sent() {
    const STORM: usize = 600;
    let (client, ns) = setup("replay-count").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 5).await;
    let group = push_dead(&redis, "g", STORM, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    let mut first = Operator::start(&ns);
    full(&client, &ns, &redis, 5, 32).await;
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "by": "ops", "note": "INC-57", "standing": true,
        "selector": {"group": group}, "settleSeconds": 20
    }))
    .expect("a spec");
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("count", spec),
        )
        .await
        .expect("the replay");
    let labels = [("namespace", ns.as_str()), ("queue", "relayer")];
    let passed = || first.metric("dlq_passed_through_total", &labels);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (mut first_at, mut first_n) = (None, 0.0);
    let (at_kill, rate) = loop {
        let n = passed();
        let now = std::time::Instant::now();
        if n > 0.0 && first_at.is_none() {
            (first_at, first_n) = (Some(now), n);
        }
        if n >= (STORM / 3) as f64 {
            let secs = first_at.map_or(0.0, |t| now.duration_since(t).as_secs_f64());
            break (n, (n - first_n) / secs.max(0.001));
        }
        assert!(now < deadline, "{n} passed through in 120 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    first.kill();
    dlq_testenv::report(&format!(
        "pass-through {rate:.0}/s (debug build) until a SIGKILL at {at_kill} passed"
    ));
    let _second = Operator::start(&ns);
    let done = eventually(180, "the standing replay to end", || async {
        let r = replays.get("count").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = arrivals(&redis).await;
    assert_eq!(got.len(), STORM, "every job on the target");
    assert!(got.values().all(|n| *n == 1), "a job arrived twice");
    let logged = status.passed_through + status.redriven;
    assert!(
        logged >= STORM as i64,
        "the replay's log says {logged} (passed through {} + redriven {}) for {STORM} jobs on the target",
        status.passed_through,
        status.redriven
    );
    dlq_testenv::report(&format!(
        "log after the restart: passed through {} + redriven {} for {STORM} jobs sent",
        status.passed_through, status.redriven
    ));
}

/// Sets a replay's `spec.paused`, as `kubectl dlq pause`/`resume` do.
async fn set_paused(replays: &Api<DeadLetterReplay>, name: &str, paused: bool) {
    let patch = json!({"spec": {"paused": paused}});
    replays
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("spec.paused");
}

/// Issue 59 item 3: a standing redrive paused during a storm passes nothing and decides
/// nothing while paused, and loses nothing (the group's dead messages park up to `maxParked`,
/// the rest wait in the broker); resumed, it goes on where it was and puts every job on the
/// target exactly once, with nothing it decided before the pause withdrawn.
#[tokio::test]
async fn a_paused_standing_redrive_passes_nothing_and_resumes_to_each_job_once() {
    let (client, ns) = setup("replay-pause").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 5).await;
    let reason = |i: usize| format!("payer timeout after {}ms", 30_000 + i);
    let group = push_dead(&redis, "a", 20, reason).await;
    let _op = Operator::start(&ns);
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    start_standing(&client, &ns, "pause", &group, json!({})).await;
    let on_target = || async { arrivals(&redis).await.len() };
    eventually(90, "the first 20 jobs on the target", || async {
        (on_target().await == 20).then_some(())
    })
    .await;

    set_paused(&replays, "pause", true).await;
    let paused = eventually(30, "the replay Paused", || async {
        let r = replays.get("pause").await.ok()?;
        (r.phase() == ReplayPhase::Paused).then_some(r.status?)
    })
    .await;
    let again = push_dead(&redis, "b", 20, reason).await;
    assert_eq!(again, group, "one failure group");
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let parked_b = || async {
        records
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .iter()
            .filter(|r| r.spec.job.id.starts_with("b/") && r.phase() == Phase::Parked)
            .count()
    };
    eventually(
        60,
        "the queue Full with the paused group's records",
        || async { (parked_b().await == 5).then_some(()) },
    )
    .await;
    // Several of its steps and its sources' looks while paused.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let still = replays.get("pause").await.expect("the replay");
    let status = still.status.clone().unwrap_or_default();
    assert_eq!(
        (
            still.phase(),
            status.passed_through,
            status.decided,
            on_target().await
        ),
        (
            ReplayPhase::Paused,
            paused.passed_through,
            paused.decided,
            20
        ),
        "while paused: phase, passed through, decided, jobs on the target"
    );
    assert_eq!(
        parked_b().await + left_in_broker(&redis, "b").await,
        20,
        "while paused, the group's messages are records or still in the broker"
    );
    assert_eq!(status.withdrawn, 0, "a pause withdraws nothing");

    set_paused(&replays, "pause", false).await;
    let done = eventually(120, "the resumed replay to end", || async {
        let r = replays.get("pause").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    let got = arrivals(&redis).await;
    assert_eq!(got.len(), 40, "every job on the target: {got:?}");
    assert!(
        got.values().all(|n| *n == 1),
        "a job arrived twice: {got:?}"
    );
    assert_eq!(
        left_in_broker(&redis, "b").await,
        0,
        "none left in the broker"
    );
    for reason in ["ReplayPaused", "ReplayResumed"] {
        assert_eq!(
            dlq_testenv::events_for(&client, &ns, "pause", reason)
                .await
                .len(),
            1,
            "one {reason} Event"
        );
    }
    dlq_testenv::report(&format!(
        "paused standing redrive: 0 passed and 0 decided while paused ({} passed, {} decided before), then {} passed and {} decided, 40 of 40 jobs once",
        paused.passed_through, paused.decided, status.passed_through, status.decided
    ));
}

/// A consumer whose jobs all die again: every job the list target receives is pushed back onto
/// the dead list as the same job (`c-00012` → id `c/00012`), so the source parks its next cycle.
fn dying_consumer(redis: &Redis) -> tokio::task::JoinHandle<()> {
    let url = redis.url();
    tokio::spawn(async move {
        let client = redis::Client::open(url).expect("a Redis URL");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("a connection");
        loop {
            // RPOP, not BRPOP: a blocking pop outliving the client's response timeout would
            // take a job the client no longer waits for.
            let popped: Option<String> = redis::cmd("RPOP")
                .arg(LIST)
                .query_async(&mut conn)
                .await
                .expect("RPOP");
            let Some(payload) = popped else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let job: serde_json::Value = serde_json::from_str(&payload).expect("a job payload");
            let name = job["job"].as_str().unwrap_or_default();
            let envelope = json!({
                "id": name.replacen('-', "/", 1),
                "payload": payload,
                "reason": "payer timeout after 31000ms",
                "failureKind": "Transient",
            });
            let _: () = redis::cmd("RPUSH")
                .arg("relayer:dead")
                .arg(envelope.to_string())
                .query_async(&mut conn)
                .await
                .expect("RPUSH");
        }
    })
}

/// `n` records of one failure group parked from the dead list (`prefix/NNNNN`); their group.
async fn parked_group(
    client: &kube::Client,
    ns: &str,
    redis: &Redis,
    prefix: &str,
    n: usize,
) -> String {
    let group = push_dead(redis, prefix, n, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    // Counted on the queue: the operator's own view holds them all (a replay selects from it).
    use dlq_core::api::DeadLetterQueue;
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    eventually(120, "every dead message parked", || async {
        let parked = queues.get("relayer").await.ok()?.status?.parked;
        (parked == i64::try_from(n).ok()?).then_some(())
    })
    .await;
    group
}

/// A replay of `group` with a canary of 5 watched for `observe` seconds, at 100/s; its end.
async fn canary_run(
    client: &kube::Client,
    ns: &str,
    group: &str,
    observe: i64,
) -> DeadLetterReplay {
    let canary = json!({"canary": {"count": 5, "observeSeconds": observe}, "rate": "100/s"});
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), ns);
    let mut spec = json!({
        "queue": "relayer", "by": "ops", "note": "INC-59", "selector": {"group": group},
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), canary.as_object()) {
        spec.extend(extra.clone());
    }
    let spec: DeadLetterReplaySpec = serde_json::from_value(spec).expect("a spec");
    replays
        .create(
            &PostParams::default(),
            &DeadLetterReplay::new("canary", spec),
        )
        .await
        .expect("the replay");
    eventually(180, "the replay to end", || async {
        let r = replays.get("canary").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await
}

/// Issue 59 item 2: a replay of 200 records with a canary of 5, against a consumer whose
/// jobs all die again: the 5 (spread across the selection) are redriven, come back as their
/// next cycle, and the replay stops naming each of them, with nothing else decided.
#[tokio::test]
async fn a_canary_whose_jobs_die_again_stops_the_replay_naming_them() {
    let (client, ns) = setup("replay-canary-dies").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 1000).await;
    let _op = Operator::start(&ns);
    let group = parked_group(&client, &ns, &redis, "c", 200).await;
    let consumer = dying_consumer(&redis);
    let done = canary_run(&client, &ns, &group, 30).await;
    consumer.abort();
    let status = done.status.clone().unwrap_or_default();
    let why = status.stop_reason.clone().unwrap_or_default();
    assert_eq!(
        (done.phase(), status.decided, status.redriven),
        (ReplayPhase::Stopped, 5, 5),
        "{status:?}"
    );
    let names = status.canary.map(|c| c.names).unwrap_or_default();
    assert_eq!(names.len(), 5);
    assert!(why.starts_with("canary failed: 5 of 5: "), "{why}");
    for name in &names {
        assert!(why.contains(&format!("{name} (")), "{name} named in {why}");
    }
    let ids: Vec<usize> = names
        .iter()
        .filter_map(|n| n.split('-').nth(1)?.parse().ok())
        .collect();
    assert!(
        ids.iter().any(|i| *i >= 100) && ids.iter().any(|i| *i < 100),
        "spread across the selection, not the oldest five: {ids:?}"
    );
    dlq_testenv::report(&format!("canary of 5 in 200, jobs dying again: {why}"));
}

/// Issue 59 item 2, the healthy case: the canary's 5 jobs stay done for the watch (5 s), the
/// replay says so (`CanaryPassed`) and redrives the other 195, each job once on the target.
#[tokio::test]
async fn a_healthy_canary_lets_the_whole_replay_through() {
    let (client, ns) = setup("replay-canary-ok").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 1000).await;
    let _op = Operator::start(&ns);
    let group = parked_group(&client, &ns, &redis, "h", 200).await;
    let started = std::time::Instant::now();
    let done = canary_run(&client, &ns, &group, 5).await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(
        (done.phase(), status.decided, status.redriven),
        (ReplayPhase::Completed, 200, 200),
        "{status:?}"
    );
    let got = arrivals(&redis).await;
    assert_eq!(got.len(), 200);
    assert!(got.values().all(|n| *n == 1), "a job arrived twice");
    let passed = dlq_testenv::events_for(&client, &ns, "canary", "CanaryPassed").await;
    assert_eq!(passed.len(), 1, "one CanaryPassed Event");
    dlq_testenv::report(&format!(
        "healthy canary of 5 watched 5 s, then 195 more: 200 of 200 redriven once in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}

/// Issue 59 item 2 for a standing replay during a storm: with a canary of 3 (watched 5 s), the
/// queue Full (`maxParked` 5) and the rest of the group waiting in the broker, nothing passes
/// through until the canary passed (only the canary's 3 jobs on the target meanwhile); then
/// the rest pass, every job once, and the replay completes.
#[tokio::test]
async fn a_standing_canary_holds_pass_through_until_it_passed() {
    let (client, ns) = setup("replay-canary-standing").await;
    let redis = Redis::start();
    storm_queue(&client, &ns, &redis, 5).await;
    let group = push_dead(&redis, "s", 30, |i| {
        format!("payer timeout after {}ms", 30_000 + i)
    })
    .await;
    let _op = Operator::start(&ns);
    full(&client, &ns, &redis, 5, 20).await;
    let canary = json!({"canary": {"count": 3, "observeSeconds": 5}});
    start_standing(&client, &ns, "watched", &group, canary).await;
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let mut looks = 0;
    eventually(60, "the canary to pass", || {
        looks += 1;
        async {
            let status = replays.get("watched").await.ok()?.status?;
            let on_target = arrivals(&redis).await.len();
            if status.canary.as_ref().is_some_and(|c| c.passed()) {
                return Some(());
            }
            assert_eq!(
                (status.passed_through, on_target <= 3),
                (0, true),
                "before the canary passed: passed through, only canary jobs on the target"
            );
            None
        }
    })
    .await;
    assert!(
        looks > 10,
        "watched a while before it passed ({looks} looks)"
    );
    let done = eventually(120, "the standing replay to end", || async {
        let r = replays.get("watched").await.ok()?;
        r.phase().is_final().then_some(r)
    })
    .await;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), ReplayPhase::Completed, "{status:?}");
    let got = arrivals(&redis).await;
    assert_eq!(got.len(), 30, "every job on the target: {got:?}");
    assert!(
        got.values().all(|n| *n == 1),
        "a job arrived twice: {got:?}"
    );
    assert_eq!(
        left_in_broker(&redis, "s").await,
        0,
        "none left in the broker"
    );
    dlq_testenv::report(&format!(
        "standing canary of 3 during a storm: 0 passed through before it passed ({looks} looks), then {} passed and {} decided, 30 of 30 once",
        status.passed_through, status.decided
    ));
}
