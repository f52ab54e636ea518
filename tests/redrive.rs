//! Redrive and drop against a real apiserver and a real redis-server: drop and retention, a
//! missing queue, the Redis list and stream targets (one job per redrive key), a crash after
//! the requeue, two operators
//! racing, restarts with decisions waiting, and apiservers without streaming watches or with
//! older CRDs. The scenarios every backend passes (redrive byte for byte with what a resolution
//! writes and announces, broker down, many redrives with their Events folded) are in
//! `tests/backends.rs`.

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_core::testing::RecordBuilder;
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    LIST, Operator, condition, create_queue, decide, events_for, eventually, in_phase, list_target,
    setup, setup_redis_queue, wait_phase,
};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

/// Record `name` of job `job_id` as the relayer's worker parks it.
fn record(name: &str, job_id: &str, payload: &[u8]) -> DeadLetter {
    dlq_testenv::unplaced(
        RecordBuilder::job(job_id)
            .named(name)
            .payload(payload)
            .intent("pi_0003", "created")
            .reason("no luck after 3 deliveries")
            .service_version("relayer@1.4.2")
            .failed_at(jiff::Timestamp::now()),
    )
}

async fn park(api: &Api<DeadLetter>, r: DeadLetter) -> DeadLetter {
    api.create(&PostParams::default(), &r)
        .await
        .expect("creating record")
}

#[tokio::test]
async fn drop_resolves_without_enqueueing_and_retention_spares_parked() {
    let (client, ns, redis) =
        setup_redis_queue("drop", json!({"retention": {"resolvedFor": "2s"}})).await;
    let op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    park(&api, record("keep-1", "keep/1", b"k")).await;
    park(&api, record("drop-1", "drop/1", b"d")).await;
    park(&api, record("redrive-1", "redrive/1", b"r")).await;
    wait_phase(&api, "keep-1", Phase::Parked, 20).await;
    decide(&api, "drop-1", Action::Drop, "ops").await;
    decide(&api, "redrive-1", Action::Redrive, "ops").await;
    let dropped = wait_phase(&api, "drop-1", Phase::Dropped, 20).await;
    assert_eq!(dropped.status.unwrap().resolved_by.as_deref(), Some("ops"));
    eventually(10, "dlq_drops_total to count the drop", || async {
        (op.metric("dlq_drops_total", &[("namespace", &ns)]) == 1.0).then_some(())
    })
    .await;

    // Retention deletes both resolved records, never the parked one.
    eventually(60, "retention to delete resolved records", || async {
        let names: Vec<String> = api
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .iter()
            .map(|r| r.name_any())
            .collect();
        (names == ["keep-1"]).then_some(())
    })
    .await;
    assert_eq!(
        redis.list(LIST).await,
        vec![b"r".to_vec()],
        "the dropped job was never enqueued"
    );
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(
        api.get_opt("keep-1").await.unwrap().is_some(),
        "parked records are never deleted"
    );
}

#[tokio::test]
async fn missing_queue_is_a_condition_not_a_crash() {
    let (client, ns) = setup("noqueue").await;
    let mut op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park(&api, record("orphan-1", "orphan/1", b"x")).await;
    decide(&api, "orphan-1", Action::Redrive, "ops").await;
    let r = eventually(20, "Requeued=False QueueNotFound", || async {
        let r = api.get("orphan-1").await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, reason, _)) if s == "False" && reason == "QueueNotFound").then_some(r)
    })
    .await;
    assert_eq!(r.phase(), Phase::Parked);
    let (_, _, message) = condition(&r, "Requeued").unwrap();
    assert!(
        message.contains("DeadLetterQueue relayer does not exist"),
        "{message}"
    );
    eventually(10, "RequeueFailed warning", || async {
        let e = events_for(&client, &ns, "orphan-1", "RequeueFailed").await;
        e.iter()
            .any(|e| e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;
    // Once the queue exists, the waiting redrive completes.
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    wait_phase(&api, "orphan-1", Phase::Redriven, 30).await;
    assert_eq!(redis.list(LIST).await, vec![b"x".to_vec()]);
    assert!(
        op.terminate().is_some_and(|s| s.success()),
        "operator exits cleanly on SIGTERM"
    );
}

#[tokio::test]
async fn list_target_refuses_headers_instead_of_dropping_them() {
    let (client, ns) = setup("headers").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut r = record("hdr-1", "hdr/1", b"p");
    r.spec.job.headers.insert("x-trace".into(), "abc".into());
    park(&api, r).await;
    decide(&api, "hdr-1", Action::Redrive, "ops").await;
    let r = eventually(20, "Requeued=False HeadersNotCarried", || async {
        let r = api.get("hdr-1").await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, reason, _)) if s == "False" && reason == "HeadersNotCarried").then_some(r)
    })
    .await;
    assert_eq!(r.phase(), Phase::Parked);
    assert!(redis.list(LIST).await.is_empty());
}

#[tokio::test]
async fn stream_target_carries_payload_and_headers() {
    let (client, ns) = setup("stream").await;
    let redis = Redis::start();
    create_queue(
        &client,
        &ns,
        &redis.url(),
        json!({"urlSecretRef": {"name": "redis", "key": "url"}, "stream": "relayer:stream"}),
        json!({}),
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut r = record("st-1", "st/1", b"\xffraw");
    r.spec.job.headers.insert("x-trace".into(), "abc".into());
    park(&api, r).await;
    decide(&api, "st-1", Action::Redrive, "ops").await;
    let done = wait_phase(&api, "st-1", Phase::Redriven, 20).await;
    let mut c = redis.conn().await;
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;
    let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
        .arg("relayer:stream")
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1);
    let fields = &entries[0].1;
    assert!(
        fields.contains(&(b"payload".to_vec(), b"\xffraw".to_vec())),
        "{fields:?}"
    );
    assert!(
        fields.contains(&(b"header:x-trace".to_vec(), b"abc".to_vec())),
        "{fields:?}"
    );
    let key = dlq_core::decide::redrive_key(&done).into_bytes();
    assert!(
        fields.contains(&(b"header:Idempotency-Key".to_vec(), key)),
        "the idempotency key beside the job: {fields:?}"
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn crash_between_requeue_and_status_write_redrives_after_restart() {
    let (client, ns) = setup("crash").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut op = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "after-requeue")]);
    park(&api, record("crash-1", "crash/1", b"once")).await;
    wait_phase(&api, "crash-1", Phase::Parked, 20).await;
    decide(&api, "crash-1", Action::Redrive, "ops").await;
    op.reached_failpoint("after-requeue", 20).await;
    op.kill(); // SIGKILL: no chance to write status
    assert_eq!(
        redis.list(LIST).await,
        vec![b"once".to_vec()],
        "the job was enqueued before the crash"
    );
    assert_eq!(
        api.get("crash-1").await.unwrap().phase(),
        Phase::Parked,
        "status was not written"
    );

    let op = Operator::start(&ns);
    wait_phase(&api, "crash-1", Phase::Redriven, 30).await;
    // The next operator enqueues again (nothing told it the job was sent), with the same
    // idempotency key: Redis finds the redrive's marker and pushes nothing.
    assert!(op.logs().contains("job requeued"), "{}", op.logs());
    assert_eq!(
        redis.list(LIST).await,
        vec![b"once".to_vec()],
        "Redis took the repeated enqueue without a second job"
    );
}

/// The Redis target pushes a redrive once however often it is asked (a lost answer retried, a
/// next leader): the push and the redrive's marker are one script. Lists and streams; another
/// redrive (another key) is pushed; a push Redis refuses leaves no marker behind.
#[tokio::test]
async fn redis_keeps_one_job_per_redrive_key() {
    use deadletter::targets::redis::{MARKER_TTL, RedisKey, RedisTarget, marker};
    use deadletter::targets::{JobMessage, Target};
    let redis = Redis::start();
    let message = |key: &str, headers: &[(&str, &str)]| JobMessage {
        id: "pi_0003/settle".into(),
        payload: b"\x00job\xff".to_vec().into(),
        null_payload: false,
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        origin: None,
        idempotency_key: Some(key.into()),
        key_header: None,
    };
    let list = RedisTarget::new(&redis.url(), RedisKey::List("jobs".into())).expect("target");
    for _ in 0..3 {
        list.requeue(&message("u-1-1", &[])).await.expect("pushed");
    }
    list.requeue(&message("u-2-1", &[])).await.expect("pushed");
    assert_eq!(redis.list("jobs").await.len(), 2, "one job per redrive key");
    let mut c = redis.conn().await;
    let ttl: i64 = redis::cmd("TTL")
        .arg(marker("jobs", "u-1-1"))
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        ttl > 0 && ttl <= MARKER_TTL.as_secs() as i64,
        "the marker expires: {ttl}"
    );

    let stream = RedisTarget::new(&redis.url(), RedisKey::Stream("s".into())).expect("target");
    for _ in 0..2 {
        let m = message("u-1-1", &[("x-trace", "abc")]);
        stream.requeue(&m).await.expect("added");
    }
    let len: usize = redis::cmd("XLEN")
        .arg("s")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(len, 1);

    let _: () = redis::cmd("SET")
        .arg("str")
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    let wrong = RedisTarget::new(&redis.url(), RedisKey::List("str".into())).expect("target");
    wrong
        .requeue(&message("u-3-1", &[]))
        .await
        .expect_err("a string is not a list");
    let exists: bool = redis::cmd("EXISTS")
        .arg(marker("str", "u-3-1"))
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(!exists, "a refused push leaves no marker");
}

/// Issue 35: the broker confirmed a redrive, then the apiserver went away, so the resolution's
/// write fails; the operator is stopped during the outage (as losing its Lease stops it). It
/// writes the resolution once the apiserver is back, before exiting, so neither it nor the
/// next operator enqueues the job again: one element on the Redis list.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn an_apiserver_outage_during_the_status_write_enqueues_once() {
    let mut plane = dlq_testenv::plane::ControlPlane::start().expect("a control plane");
    let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
    dlq_testenv::apply_crds(&client, dlq_testenv::CRDS).await;
    let ns = dlq_testenv::namespace(&client, "outage").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    // Held 3 s after the broker's confirmation: the apiserver is stopped meanwhile.
    let env = [("DLQ_FAILPOINT", "after-requeue@3000")];
    let mut op = Operator::start_on(&plane.kubeconfig, &ns, &[], &env);
    park(&api, record("outage-1", "outage/1", b"once")).await;
    wait_phase(&api, "outage-1", Phase::Parked, 20).await;
    decide(&api, "outage-1", Action::Redrive, "ops").await;
    op.reached_failpoint("after-requeue", 20).await;
    plane.stop_apiserver();
    eventually(20, "the resolution's write to fail", || async {
        op.logs()
            .contains("writing the status of DeadLetter outage-1")
            .then_some(())
    })
    .await;
    op.signal(15); // SIGTERM, as Kubernetes stops a pod
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        op.running(),
        "still writing what it enqueued\n{}",
        op.logs()
    );
    plane.start_apiserver().expect("the apiserver back");
    let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    let status = op.terminate().expect("the operator exits");
    assert!(status.success(), "{status:?}\n{}", op.logs());
    assert_eq!(
        api.get("outage-1").await.expect("record").phase(),
        Phase::Redriven,
        "resolved by the stopping operator\n{}",
        op.logs()
    );

    let next = Operator::start_on(&plane.kubeconfig, &ns, &[], &[]);
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(
        redis.list(LIST).await,
        vec![b"once".to_vec()],
        "one enqueue"
    );
    assert!(!next.logs().contains("job requeued"), "{}", next.logs());
}

#[tokio::test]
async fn two_operators_racing_resolve_each_record_exactly_once() {
    let (client, ns) = setup("race").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    const N: usize = 200;
    let creates = (0..N).map(|i| {
        let api = api.clone();
        async move {
            park(
                &api,
                record(
                    &format!("race-{i}"),
                    &format!("race/{i}"),
                    format!("job-{i}").as_bytes(),
                ),
            )
            .await
        }
    });
    futures::future::join_all(creates).await;
    let a = Operator::start(&ns);
    let b = Operator::start(&ns);
    eventually(60, "all records Parked", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        items
            .iter()
            .all(|r| in_phase(r, Phase::Parked))
            .then_some(())
    })
    .await;
    let decisions = (0..N).map(|i| {
        let api = api.clone();
        async move { decide(&api, &format!("race-{i}"), Action::Redrive, "ops").await }
    });
    futures::future::join_all(decisions).await;
    eventually(120, "all records Redriven", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        items
            .iter()
            .all(|r| r.phase() == Phase::Redriven)
            .then_some(())
    })
    .await;
    let success = |op: &Operator| {
        op.metric(
            "dlq_redrives_total",
            &[("namespace", &ns), ("result", "success")],
        )
    };
    let conflict = |op: &Operator| {
        op.metric(
            "dlq_redrives_total",
            &[("namespace", &ns), ("result", "conflict")],
        )
    };
    // The counters move just after the status writes land.
    eventually(10, "both operators' success counters", || async {
        (success(&a) + success(&b) >= N as f64).then_some(())
    })
    .await;
    assert_eq!(
        success(&a) + success(&b),
        N as f64,
        "each record resolved exactly once across both operators"
    );

    let list = redis.list(LIST).await;
    let distinct: std::collections::BTreeSet<&Vec<u8>> = list.iter().collect();
    assert_eq!(distinct.len(), N, "every job reached Redis at least once");
    let duplicates = list.len() - N;
    let conflicts = conflict(&a) + conflict(&b);
    dlq_testenv::report(&format!(
        "race: {N} records, two operators: {} enqueues, {duplicates} duplicate enqueues, {conflicts} resolve conflicts counted (a: {} ok, b: {} ok)",
        list.len(),
        success(&a),
        success(&b)
    ));
    assert!(
        conflicts >= duplicates as f64,
        "every duplicate enqueue lost a counted CAS"
    );
}

/// An apiserver that refuses streaming watches (WatchList off, as 1.33 ships it): the operator
/// asks, lists its records in pages instead, and resolves decisions as usual.
#[tokio::test]
async fn without_streaming_watches_the_operator_lists_records_in_pages() {
    let plane = dlq_testenv::plane::ControlPlane::start_with_apiserver_args(&[
        "--feature-gates=WatchList=false",
    ])
    .expect("a control plane with WatchList off");
    let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
    // Its own plane: install_crds is once per binary, for the shared one.
    dlq_testenv::apply_crds(&client, dlq_testenv::CRDS).await;
    let ns = dlq_testenv::namespace(&client, "paged").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park(&api, record("paged-1", "pi_0003/settle", b"paged")).await;

    let op = Operator::start_on(&plane.kubeconfig, &ns, &[], &[]);
    wait_phase(&api, "paged-1", Phase::Parked, 20).await;
    decide(&api, "paged-1", Action::Redrive, "ops").await;
    wait_phase(&api, "paged-1", Phase::Redriven, 20).await;
    assert_eq!(redis.list(LIST).await, vec![b"paged".to_vec()]);
    assert!(
        op.logs().contains("initial_state=Paged"),
        "the operator says how its cache starts:\n{}",
        op.logs()
    );
}

/// Decisions made while the operator was down are carried out at its restart without waiting
/// for the full record list (a separate watch of decided records), and exactly once even when
/// both the decisions watch and the full list see them.
#[tokio::test]
async fn decisions_waiting_at_restart_are_carried_out_before_the_full_list_and_once() {
    let (client, ns, redis) = setup_redis_queue("decided", json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let names: Vec<String> = (0..120).map(|i| format!("waiting-{i}")).collect();
    futures::future::join_all(names.iter().map(|n| {
        let payload = n.as_bytes().to_vec();
        park(&api, record(n, n, &payload))
    }))
    .await;
    let op = Operator::start(&ns);
    eventually(60, "every record marked Parked", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        let marked = items.iter().filter(|r| in_phase(r, Phase::Parked)).count();
        (marked == names.len()).then_some(())
    })
    .await;
    drop(op);

    // While it is down: three redrives and a drop.
    for n in &names[..3] {
        decide(&api, n, Action::Redrive, "ops").await;
    }
    decide(&api, &names[3], Action::Drop, "ops").await;
    // The full record list never arrives: only the decisions watch can carry them out.
    let held = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "before-record-list")]);
    for n in &names[..3] {
        wait_phase(&api, n, Phase::Redriven, 30).await;
    }
    wait_phase(&api, &names[3], Phase::Dropped, 30).await;
    assert!(held.logs().contains("failpoint before-record-list reached"));
    drop(held);

    // Three more while it is down; a normal start sees them in both watches.
    for n in &names[4..7] {
        decide(&api, n, Action::Redrive, "ops").await;
    }
    let _op = Operator::start(&ns);
    for n in &names[4..7] {
        wait_phase(&api, n, Phase::Redriven, 30).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let mut sent = redis.list(LIST).await;
    sent.sort();
    let mut want: Vec<Vec<u8>> = [0, 1, 2, 4, 5, 6]
        .iter()
        .map(|i| names[*i].as_bytes().to_vec())
        .collect();
    want.sort();
    assert_eq!(sent, want, "each redriven job enqueued exactly once");
}

/// CRDs older than the operator (installed before `.spec.action` became selectable, and not
/// upgraded: Helm never upgrades CRDs): the decisions watch is refused, the operator says why
/// in its log, still stops cleanly, and carries decisions out from the full record list.
#[tokio::test]
async fn with_crds_older_than_the_operator_decisions_still_run_and_it_says_why() {
    let plane = dlq_testenv::plane::ControlPlane::start().expect("a control plane");
    let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
    let selectable = "    - jsonPath: .status.phase\n    - jsonPath: .spec.action\n";
    assert!(
        dlq_testenv::CRDS.contains(selectable),
        "the CRDs changed shape"
    );
    let old = dlq_testenv::CRDS.replace(selectable, "    - jsonPath: .status.phase\n");
    dlq_testenv::apply_crds(&client, &old).await;
    let ns = dlq_testenv::namespace(&client, "oldcrds").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park(&api, record("old-1", "pi_0003/settle", b"old crds")).await;

    // The full list held back: only the decisions watch runs, and the apiserver refuses it.
    let env = [("DLQ_FAILPOINT", "before-record-list")];
    let mut held = Operator::start_on(&plane.kubeconfig, &ns, &[], &env);
    eventually(
        30,
        "the operator says why its decisions watch fails",
        || async { held.logs().contains("is the CRD up to date").then_some(()) },
    )
    .await;
    let status = held.terminate().expect("the operator exits on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", held.logs());

    let _op = Operator::start_on(&plane.kubeconfig, &ns, &[], &[]);
    wait_phase(&api, "old-1", Phase::Parked, 20).await;
    decide(&api, "old-1", Action::Redrive, "ops").await;
    wait_phase(&api, "old-1", Phase::Redriven, 20).await;
    assert_eq!(redis.list(LIST).await, vec![b"old crds".to_vec()]);
}
