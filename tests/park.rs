//! Parking against a real apiserver and redis-server: the park API, `kubectl dlq park`, what
//! only the Redis source does (sweeping up what other processes left behind, unusable elements
//! parked as Invalid or rejected), and a GitOps decision next to the parker's fields. The
//! scenarios every source passes (park, a crash between park and ack) are in
//! `tests/backends.rs`.

use std::collections::BTreeSet;
use std::process::Stdio;

use dlq_client::park::{ParkError, ParkOutcome, ParkRequest, Parker, park};
use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, FailureKind, IntentSnapshot, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    LIST, Operator, create_offline_queue, create_queue, decide, events_for, eventually,
    kubectl_dlq, list_target, setup, setup_redis_queue, wait_phase,
};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

fn request(id: &str, payload: &str) -> ParkRequest {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: id.into(),
            payload: Some(payload.into()),
            ..Job::default()
        },
    );
    r.deliveries = 3;
    r.reason = "no luck after 3 deliveries".into();
    r.intent = Some(IntentSnapshot {
        id: "pi_0003".into(),
        state: "created".into(),
    });
    r.service_version = Some("relayer@1.4.2".into());
    r
}

#[tokio::test]
async fn park_dedupes_while_parked_and_starts_a_new_cycle_after_resolution() {
    let (client, ns) = setup("park").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let first = park(
        client.clone(),
        &ns,
        request("pi_0003/settle", "{\"intent\":\"pi_0003\"}"),
    )
    .await
    .unwrap();
    assert!(first.is_new());
    let r = first.record();
    let key = dlq_core::park::job_key("relayer", "pi_0003/settle");
    assert_eq!(r.name_any(), format!("pi-0003-settle-{}-1", &key[..8]));
    let labels = r.labels();
    assert_eq!(labels["dlq.dev/queue"], "relayer");
    assert_eq!(labels["dlq.dev/failure-kind"], "transient");
    assert_eq!(labels["dlq.dev/job-key"], key);
    let managers: Vec<String> = r
        .managed_fields()
        .iter()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert_eq!(
        managers,
        ["dlq-parker"],
        "the parker owns the record's facts"
    );

    let again = park(
        client.clone(),
        &ns,
        request("pi_0003/settle", "a different body"),
    )
    .await
    .unwrap();
    let ParkOutcome::AlreadyParked(same) = again else {
        panic!("expected AlreadyParked")
    };
    assert_eq!(same.name_any(), r.name_any());
    assert_eq!(
        same.resource_version(),
        api.get(&r.name_any()).await.unwrap().resource_version(),
        "nothing changed"
    );
    assert_eq!(
        same.spec.job.payload.as_deref(),
        Some("{\"intent\":\"pi_0003\"}")
    );

    // Before the operator writes anything, the apiserver serves the record Parked (the CRD's
    // default for an unwritten status) to every reader: the create's answer, a get, a list, a
    // watch and kubectl's PHASE column.
    reads_parked_before_any_status_write(&client, &ns, r).await;

    // The operator announces a new record (once, whoever parked it).
    let _op = Operator::start(&ns);
    let ev = eventually(10, "Parked warning", || async {
        let e = events_for(&client, &ns, &r.name_any(), "Parked").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert_eq!(ev[0].type_.as_deref(), Some("Warning"));
    // The mark is one write: it cleared the managed fields (0.7 KB of etcd and about 10 KB of
    // the apiserver's watch cache a record; the CRD's rules keep the facts immutable) and wrote
    // no status: no condition, Parked by the default.
    let marked = wait_phase(&api, &r.name_any(), Phase::Parked, 20).await;
    assert!(
        marked.managed_fields().is_empty(),
        "{:?}",
        marked.managed_fields()
    );
    assert_eq!(
        marked.status.as_ref().map(|s| s.conditions.len()),
        Some(0),
        "{:?}",
        marked.status
    );
    assert_eq!(
        marked.status.as_ref().and_then(|s| s.phase),
        Some(Phase::Parked)
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let events = events_for(&client, &ns, &r.name_any(), "Parked").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].series.as_ref().map(|s| s.count),
        None,
        "announced once"
    );
    assert_eq!(
        api.get(&r.name_any()).await.unwrap().resource_version(),
        marked.resource_version(),
        "no write after the mark"
    );

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 20).await;

    let second = park(
        client.clone(),
        &ns,
        request("pi_0003/settle", "{\"intent\":\"pi_0003\"}"),
    )
    .await
    .unwrap();
    assert!(
        second.is_new(),
        "a job that dies again after a redrive is a new cycle"
    );
    assert_eq!(second.record().spec.cycle, 2);
    assert_eq!(
        second.record().name_any(),
        format!("pi-0003-settle-{}-2", &key[..8])
    );
    let cycles = api
        .list(&ListParams::default().labels(&format!("dlq.dev/job-key={key}")))
        .await
        .unwrap();
    assert_eq!(cycles.items.len(), 2, "earlier cycles stay as history");
}

/// Issue 14 (found by chaos): a source's create was stored but its reply lost in an apiserver
/// restart, a human dropped the record, then the source's retry came. The retry must answer
/// with that record, not park the same dead message as cycle 2.
#[tokio::test]
async fn a_retried_park_whose_first_reply_was_lost_finds_its_resolved_record() {
    let (client, ns) = setup("park-retry").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    // Like an AMQP first delivery: an identity that is a hash, so not matched by itself.
    let mut delivery = request("order-7", "{}").with_message("amqp:sha256:0f1e");
    delivery.redelivered = false;

    let stored = park(client.clone(), &ns, delivery.clone()).await.unwrap();
    assert!(stored.is_new());
    let name = stored.record().name_any();
    let _op = Operator::start(&ns);
    decide(&api, &name, Action::Drop, "alice").await;
    wait_phase(&api, &name, Phase::Dropped, 20).await;

    let mut retry = delivery.clone();
    retry.retrying();
    let outcome = park(client.clone(), &ns, retry).await.unwrap();
    let ParkOutcome::SameMessage(same) = outcome else {
        panic!("expected SameMessage, got {outcome:?}")
    };
    assert_eq!(same.name_any(), name);
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );

    // The same bytes delivered afresh (not a retry) are the job dying again.
    let again = park(client.clone(), &ns, delivery).await.unwrap();
    assert!(again.is_new());
    assert_eq!(again.record().spec.cycle, 2);
}

#[tokio::test]
async fn fifty_concurrent_parkers_make_one_record() {
    let (client, ns) = setup("race-park").await;
    create_offline_queue(&client, &ns).await;
    let parker = Parker::new(client.clone());
    let outcomes = futures::future::join_all((0..50).map(|_| {
        let parker = parker.clone();
        let ns = ns.clone();
        async move { parker.park(&ns, request("same/job", "p")).await }
    }))
    .await;
    let outcomes: Vec<ParkOutcome> = outcomes
        .into_iter()
        .map(|o| o.expect("every parker gets an answer"))
        .collect();
    let names: BTreeSet<String> = outcomes.iter().map(|o| o.record().name_any()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert_eq!(
        outcomes.iter().filter(|o| o.is_new()).count(),
        1,
        "exactly one parker created it"
    );
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

/// Reasons that differ only in ids fall in one failure group, another service version or
/// error class in another; the group is a label, so the apiserver selects a group's records.
#[tokio::test]
async fn records_failing_alike_share_a_group_label_the_apiserver_selects_by() {
    let (client, ns) = setup("group-park").await;
    create_offline_queue(&client, &ns).await;
    let parker = Parker::new(client.clone());
    let timeout = |id: &str, ms: u32, payer: &str, version: &str, class: Option<&str>| {
        let mut r = request(id, "{}");
        r.reason = format!("timeout after {ms} ms talking to payer {payer}");
        r.service_version = Some(version.into());
        r.error_class = class.map(str::to_string);
        r
    };
    let requests = [
        timeout("a", 3021, "7f3a9c21", "relayer@1.4.2", None),
        timeout("b", 15, "0b11e0aa", "relayer@1.4.2", None),
        timeout("c", 99, "1234abcd", "relayer@1.4.2", None),
        timeout("d", 15, "0b11e0aa", "relayer@1.4.3", None),
        timeout("e", 15, "0b11e0aa", "relayer@1.4.2", Some("PayerTimeout")),
    ];
    let mut groups = Vec::new();
    for req in requests {
        let outcome = parker.park(&ns, req).await.expect("parked");
        let record = outcome.record();
        let group = dlq_core::group::labelled(record).expect("labelled at park");
        groups.push(group.to_string());
    }
    assert_eq!(groups[0], groups[1]);
    assert_eq!(groups[0], groups[2]);
    assert_ne!(
        groups[0], groups[3],
        "another service version, another group"
    );
    assert_ne!(groups[0], groups[4], "another error class, another group");
    assert_ne!(groups[3], groups[4]);
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    let selected = api
        .list(&ListParams::default().labels(&format!("dlq.dev/group={}", groups[0])))
        .await
        .unwrap();
    let jobs: BTreeSet<String> = selected
        .items
        .iter()
        .map(|r| r.spec.job.id.clone())
        .collect();
    assert_eq!(jobs, BTreeSet::from(["a".into(), "b".into(), "c".into()]));
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_message() {
    let (client, ns) = setup("bad-park").await;
    create_queue(
        &client,
        &ns,
        "redis://127.0.0.1:1/",
        list_target(),
        json!({"maxParked": 1}),
    )
    .await;
    let parker = Parker::new(client.clone());
    let refuse = |mut f: Box<dyn FnMut(&mut ParkRequest)>, want: &'static str| {
        let parker = parker.clone();
        let ns = ns.clone();
        async move {
            let mut r = request("bad/1", "p");
            f(&mut r);
            let err = parker.park(&ns, r).await.expect_err(want).to_string();
            assert!(err.contains(want), "{err:?} should say {want:?}");
        }
    };
    refuse(Box::new(|r| r.job.id.clear()), "missing job id").await;
    refuse(Box::new(|r| r.queue.clear()), "missing queue").await;
    refuse(
        Box::new(|r| r.queue = "nope".into()),
        "unknown queue: no DeadLetterQueue nope in namespace",
    )
    .await;
    refuse(
        Box::new(|r| r.job.payload = Some("x".repeat(256 * 1024 + 1))),
        "payload is 262145 bytes; the limit is 262144 bytes",
    )
    .await;
    refuse(
        Box::new(|r| {
            r.job.headers.insert("bad header".into(), "v".into());
        }),
        "invalid header name \"bad header\"",
    )
    .await;
    refuse(
        Box::new(|r| r.job.payload_base64 = Some("cA==".into())),
        "both payload and payloadBase64",
    )
    .await;

    // maxParked: the queue's status says it is full.
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    queues
        .patch_status(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"parked": 1}})),
        )
        .await
        .unwrap();
    let err = parker
        .park(&ns, request("full/1", "p"))
        .await
        .expect_err("queue is full");
    assert!(
        matches!(
            err,
            ParkError::MaxParked {
                parked: 1,
                limit: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("at its maxParked of 1"), "{err}");
}

#[tokio::test]
async fn kubectl_dlq_park_prints_the_record_and_fails_on_bad_input() {
    let (client, ns) = setup("cli-park").await;
    create_offline_queue(&client, &ns).await;
    let dir = std::env::temp_dir().join(format!("dlq-cli-{ns}"));
    std::fs::create_dir_all(&dir).unwrap();
    let body = dir.join("job.bin");
    std::fs::write(&body, b"\x00\x01binary").unwrap();
    let run = |args: &[&str]| kubectl_dlq(&ns, args);
    let payload = format!("@{}", body.display());
    let args = [
        "park",
        "--queue",
        "relayer",
        "--id",
        "cli/1",
        "--payload",
        &payload,
        "--header",
        "x-trace=abc",
        "--reason",
        "gave up",
        "--deliveries",
        "2",
        "--failure-kind",
        "Invalid",
        "--intent-id",
        "pi_1",
        "--intent-state",
        "created",
        "--service-version",
        "relayer@1.4.2",
        "--error-class",
        "PayerTimeout",
    ];
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("parked cli-1-") && out.contains("(new, cycle 1)"),
        "{out}"
    );
    let (ok, out, _) = run(&args);
    assert!(ok);
    assert!(out.starts_with("already parked cli-1-"), "{out}");

    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    let r = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .remove(0);
    assert_eq!(
        r.spec.job.payload_bytes().unwrap(),
        b"\x00\x01binary",
        "binary file kept exactly"
    );
    assert_eq!(r.spec.job.headers["x-trace"], "abc");
    assert_eq!(r.spec.failure_kind, FailureKind::Invalid);
    assert_eq!(r.spec.deliveries, 2);
    assert_eq!(r.spec.error_class.as_deref(), Some("PayerTimeout"));
    assert_eq!(
        dlq_core::group::labelled(&r),
        Some(dlq_core::group::Key::of(&r).fingerprint().as_str()),
        "the group label is set at park"
    );

    let (ok, _, err) = run(&["park", "--queue", "relayer", "--id", "", "--payload", "x"]);
    assert!(!ok);
    assert!(err.contains("error: missing job id"), "{err}");
    let (ok, _, err) = run(&["park", "--queue", "ghost", "--id", "a", "--payload", "x"]);
    assert!(!ok);
    assert!(err.contains("unknown queue"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A producer retrying `kubectl dlq park` after a lost reply, while a human already resolved
/// the record: with `--message` (the death's own id) the retry answers with that record; the
/// same job parked without it is a new death, cycle 2.
#[tokio::test]
async fn kubectl_dlq_park_with_a_message_id_is_idempotent_across_a_resolution() {
    let (client, ns, _redis) = setup_redis_queue("cli-message", json!({})).await;
    let _op = Operator::start(&ns);
    let run = |extra: &[&str]| {
        let mut args = vec![
            "park",
            "--queue",
            "relayer",
            "--id",
            "cli/retry",
            "--payload",
            "{}",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = kubectl_dlq(&ns, &args);
        assert!(ok, "{err}");
        out
    };
    let first = run(&["--message", "producer-7f3a"]);
    assert!(first.contains("(new, cycle 1)"), "{first}");
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    let name = api.list(&ListParams::default()).await.unwrap().items[0].name_any();
    decide(&api, &name, Action::Drop, "alice").await;
    wait_phase(&api, &name, Phase::Dropped, 30).await;

    let retry = run(&["--message", "producer-7f3a"]);
    assert!(
        retry.starts_with(&format!("this message already has a record: {name}")),
        "{retry}"
    );
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    let again = run(&[]);
    assert!(
        again.contains("(new, cycle 2)"),
        "a new death without an id: {again}"
    );
}

#[tokio::test]
async fn gitops_server_side_apply_of_a_decision_does_not_conflict_with_the_parker() {
    let (client, ns) = setup("gitops").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let _op = Operator::start(&ns);
    let parked = park(client.clone(), &ns, request("gitops/1", "g"))
        .await
        .unwrap();
    let name = parked.record().name_any();
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    wait_phase(&api, &name, Phase::Parked, 20).await;

    let manifest = format!(
        "apiVersion: dlq.dev/v1alpha1\nkind: DeadLetter\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  action: redrive\n  by: carol\n"
    );
    // A fact applied with another value conflicts with the manager the apiserver gives the
    // record's fields at its first apply (its managed fields were cleared with the mark).
    let fact = format!("{manifest}  reason: edited\n");
    let out = server_side_apply("gitops", &fact);
    let refused = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && refused.contains("before-first-apply")
            && refused.contains(".spec.reason"),
        "{refused}"
    );
    let out = server_side_apply("gitops", &manifest);
    assert!(
        out.status.success(),
        "server-side apply failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let done = wait_phase(&api, &name, Phase::Redriven, 20).await;
    assert_eq!(
        done.status.as_ref().unwrap().resolved_by.as_deref(),
        Some("carol")
    );
    let gitops = done
        .managed_fields()
        .iter()
        .find(|m| m.manager.as_deref() == Some("gitops"))
        .expect("gitops manages its fields");
    let owned = serde_json::to_string(&gitops.fields_v1).unwrap();
    assert!(
        owned.contains("f:action") && owned.contains("f:by") && !owned.contains("f:job"),
        "{owned}"
    );
    assert_eq!(redis.list(LIST).await, vec![b"g".to_vec()]);
}

/// Record `r`, just created and never written since, reads `status.phase: Parked` with no
/// condition in the create's answer, a get, a list, a watch and `kubectl get dl`.
async fn reads_parked_before_any_status_write(client: &kube::Client, ns: &str, r: &DeadLetter) {
    use futures::{StreamExt, TryStreamExt};
    use kube::runtime::{WatchStreamExt, watcher};
    let parked = |from: &str, d: &DeadLetter| {
        let status = d
            .status
            .as_ref()
            .unwrap_or_else(|| panic!("{from}: no status"));
        assert_eq!(status.phase, Some(Phase::Parked), "{from}");
        assert!(
            status.conditions.is_empty(),
            "{from}: {:?}",
            status.conditions
        );
        assert!(
            !d.managed_fields().is_empty(),
            "{from}: a create's managed fields"
        );
    };
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let name = r.name_any();
    parked("the create's answer", r);
    parked("a get", &api.get(&name).await.unwrap());
    let listed = api.list(&ListParams::default()).await.unwrap().items;
    let listed = listed
        .iter()
        .find(|d| d.name_any() == name)
        .expect("listed");
    parked("a list", listed);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let watched = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        watcher(api.clone(), config)
            .applied_objects()
            .boxed()
            .try_next(),
    )
    .await
    .expect("the watch answers")
    .unwrap()
    .expect("the record watched");
    parked("a watch", &watched);
    let selected = api
        .list(&ListParams::default().fields("status.phase=Parked"))
        .await
        .unwrap()
        .items;
    assert!(
        selected.iter().any(|d| d.name_any() == name),
        "the field selector status.phase=Parked selects it"
    );
    let out = dlq_testenv::plane()
        .kubectl()
        .args(["get", "dl", &name, "-n", ns, "--no-headers"])
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.contains(" Parked "), "kubectl's PHASE column: {line}");
    let yaml = dlq_testenv::plane()
        .kubectl()
        .args([
            "get",
            "dl",
            &name,
            "-n",
            ns,
            "-o",
            "jsonpath={.status.phase}",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&yaml.stdout), "Parked");
}

/// Issue 58: a record parked through a source costs the apiserver its create and one write by
/// the operator, the mark (a metadata patch clearing its managed fields), and no status write;
/// what etcd then stores holds no managed fields and no condition. Counted by the apiserver
/// itself (`apiserver_request_total` by verb, resource and subresource) on a plane no other
/// test of this binary writes to (the audited one), as a ratio to the records. etcd then holds
/// `status: {phase: Parked}` (the update copies the status it read, defaulted) and nothing more.
#[tokio::test]
async fn a_record_parked_through_a_source_costs_its_create_and_one_mark() {
    const N: usize = 24;
    let plane = dlq_testenv::audited_plane();
    let client = plane.client().await;
    // Its own plane: `setup` installs the CRDs once per binary, on the shared one.
    dlq_testenv::apply_crds(&client, dlq_testenv::CRDS).await;
    let ns = dlq_testenv::namespace(&client, "park-writes").await;
    let redis = Redis::start();
    create_queue(
        &client,
        &ns,
        &redis.url(),
        list_target(),
        json!({"source": {"redis": {"list": "relayer:dead"}}}),
    )
    .await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let op = Operator::start_on(&plane.kubeconfig, &ns, &[], &[]);
    // The source's first park waits for the operator's watches; the writes counted are the
    // records' alone (resource deadletters), so what the operator writes of its queue, its
    // groups, its Events and its ledger does not count.
    let before = deadletter_writes(plane);
    let mut c = redis.conn().await;
    let mut pipe = redis::pipe();
    for i in 0..N {
        let env =
            json!({"id": format!("writes/{i}"), "payload": "{}", "reason": "retries exhausted"});
        pipe.cmd("LPUSH").arg("relayer:dead").arg(env.to_string());
    }
    let _: () = pipe.query_async(&mut c).await.unwrap();
    eventually(60, "every record parked and marked", || async {
        (op.metric("dlq_parked_total", &[]) == N as f64).then_some(())
    })
    .await;
    // Anything late would show here.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let after = deadletter_writes(plane);
    let records = api.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(records.len(), N);
    let delta = |key: &str| {
        after.get(key).copied().unwrap_or(0.0) - before.get(key).copied().unwrap_or(0.0)
    };
    let writes: std::collections::BTreeMap<&String, f64> = after
        .keys()
        .map(|k| (k, delta(k.as_str())))
        .filter(|(_, n)| *n != 0.0)
        .collect();
    dlq_testenv::report(&format!(
        "park: {N} records through the Redis source cost the apiserver {writes:?}"
    ));
    assert_eq!(delta("POST deadletters"), N as f64, "{writes:?}");
    assert_eq!(
        delta("PATCH deadletters"),
        N as f64,
        "one mark each: {writes:?}"
    );
    let status_writes: f64 = after
        .keys()
        .filter(|k| k.contains("deadletters/status"))
        .map(|k| delta(k.as_str()))
        .sum();
    assert_eq!(status_writes, 0.0, "no status write: {writes:?}");
    assert_eq!(
        writes.len(),
        2,
        "no other write of a record (PUT, APPLY, DELETE): {writes:?}"
    );

    for r in &records {
        assert!(r.managed_fields().is_empty(), "{:?}", r.managed_fields());
        let status = r.status.clone().unwrap_or_default();
        assert_eq!(
            (status.phase, status.conditions.len()),
            (Some(Phase::Parked), 0)
        );
    }
    // Each record is announced once: by its own Parked Event, or counted in its failure group's
    // Event series once a burst folds them (its last count is patched within 5 s).
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &ns);
    eventually(20, "one Parked announcement a record", || {
        let events = events.clone();
        async move {
            let announced: i32 = events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("Parked"))
                .map(|e| e.series.as_ref().map_or(1, |s| s.count))
                .sum();
            (announced == N as i32).then_some(())
        }
    })
    .await;

    // What etcd stores of a marked record: no managed fields, no condition.
    let r = &records[0];
    let key = format!("/registry/dlq.dev/deadletters/{ns}/{}", r.name_any());
    let stored = plane.etcd_value(&key).await.expect("the record in etcd");
    let stored: serde_json::Value = serde_json::from_slice(&stored).unwrap();
    assert_eq!(stored["metadata"].get("managedFields"), None, "{stored}");
    assert_eq!(stored["status"].get("conditions"), None, "{stored}");
    assert!(
        stored
            .get("status")
            .is_none_or(|s| *s == json!({"phase": "Parked"})),
        "{stored}"
    );
    dlq_testenv::report(&format!(
        "park: a marked record's status in etcd: {} ({} bytes stored)",
        stored
            .get("status")
            .map_or("none".to_string(), |s| s.to_string()),
        stored.to_string().len()
    ));
}

/// The apiserver's `apiserver_request_total` of deadletters writes (POST, PUT, PATCH, APPLY,
/// DELETE), every code, keyed "VERB deadletters[/subresource]".
fn deadletter_writes(plane: &dlq_testenv::Plane) -> std::collections::BTreeMap<String, f64> {
    let out = plane
        .kubectl()
        .args(["get", "--raw", "/metrics"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let label = |labels: &str, key: &str| {
        labels
            .split_once(&format!("{key}=\""))
            .and_then(|(_, rest)| rest.split_once('"'))
            .map_or(String::new(), |(v, _)| v.to_string())
    };
    let mut by = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let verb = label(labels, "verb");
        if label(labels, "resource") != "deadletters"
            || !["POST", "PUT", "PATCH", "APPLY", "DELETE"].contains(&verb.as_str())
        {
            continue;
        }
        let mut key = format!("{verb} deadletters");
        let sub = label(labels, "subresource");
        if !sub.is_empty() {
            key = format!("{key}/{sub}");
        }
        *by.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    by
}

/// `kubectl apply --server-side --field-manager=MANAGER -f -` of `manifest`.
fn server_side_apply(manager: &str, manifest: &str) -> std::process::Output {
    let mut cmd = dlq_testenv::plane().kubectl();
    cmd.args([
        "apply",
        "--server-side",
        "--field-manager",
        manager,
        "-f",
        "-",
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), manifest.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// A namespace with queue `relayer` whose source is the dead list `relayer:dead` of a fresh
/// redis-server (also its target).
async fn redis_source_queue(name: &str) -> (kube::Client, String, Redis) {
    let (client, ns, redis) =
        setup_redis_queue(name, json!({"source": {"redis": {"list": "relayer:dead"}}})).await;
    (client, ns, redis)
}

/// Pushes `n` envelopes (plus one garbage element) onto the dead list.
async fn push_dead(redis: &Redis, list: &str, n: usize) -> Vec<u8> {
    let mut c = redis.conn().await;
    let mut pipe = redis::pipe();
    for i in 0..n {
        let env = json!({"id": format!("dead/{i}"), "payload": format!("{{\"n\":{i}}}"), "reason": "retries exhausted",
            "deliveries": 5, "failureKind": "Transient", "intent": {"id": format!("pi_{i}"), "state": "created"}});
        pipe.cmd("LPUSH").arg(list).arg(env.to_string());
    }
    let garbage = b"\xff\xfe not an envelope {".to_vec();
    pipe.cmd("LPUSH").arg(list).arg(&garbage[..]);
    let _: () = pipe.query_async(&mut c).await.unwrap();
    garbage
}

/// What another process left behind after this one started (a leader that lost its Lease
/// while parking, a puller of a failed run): an element moved to the processing list and one
/// claimed into the inflight hash, both orphaned while the bridge runs. Its sweep parks each
/// once, with the id it has (the claimed one keeps its record identity), and drains both.
#[tokio::test]
async fn redis_bridge_sweeps_up_elements_another_process_left_behind() {
    let (client, ns, redis) = redis_source_queue("sweep").await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    // The bridge is running: its startup recovery has already looked at both places.
    push_dead(&redis, "relayer:dead", 1).await;
    eventually(30, "the bridge parks a fresh element", || async {
        let n = api.list(&ListParams::default()).await.ok()?.items.len();
        (n == 2).then_some(())
    })
    .await;
    let envelope =
        |id: &str| json!({"id": id, "payload": "{}", "reason": "left behind"}).to_string();
    let mut c = redis.conn().await;
    let _: () = redis::pipe()
        .cmd("LPUSH")
        .arg("relayer:dead:processing")
        .arg(envelope("moved/1"))
        .cmd("HSET")
        .arg("relayer:dead:inflight")
        .arg("1.2-99")
        .arg(envelope("claimed/1"))
        .query_async(&mut c)
        .await
        .unwrap();
    let records = eventually(60, "both orphans parked", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        (items.len() == 4).then_some(items)
    })
    .await;
    eventually(30, "both places drained", || async {
        let processing = redis.list("relayer:dead:processing").await.len();
        let inflight = redis.hash_len("relayer:dead:inflight").await;
        (processing + inflight == 0).then_some(())
    })
    .await;
    let claimed = records
        .iter()
        .find(|r| r.spec.job.id == "claimed/1")
        .expect("the claimed orphan's record");
    assert_eq!(
        claimed
            .annotations()
            .get("dlq.dev/source-message")
            .map(String::as_str),
        Some("relayer:dead#1.2-99"),
        "parked with the id it was claimed under"
    );
    assert!(records.iter().any(|r| r.spec.job.id == "moved/1"));
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        4
    );
}

/// Issue 19: what is not an envelope, and envelopes that fail validation, become Invalid
/// records of their exact bytes; only what can never be a record goes to `:rejected`, counted
/// and announced.
#[tokio::test]
async fn redis_bridge_parks_unusable_elements_as_invalid_and_reports_what_it_rejects() {
    let (client, ns, redis) = redis_source_queue("unusable").await;
    let unusable: Vec<Vec<u8>> = vec![
        br#"["an","array"]"#.to_vec(),
        br#"{"id":"e4","paylod":"typo"}"#.to_vec(),
        br#"{"id":"e5","payload":"x","headers":{"bad name":"v"}}"#.to_vec(),
        br#"{"id":"e6","payload":"x","headers":{"x":"a\r\nb"}}"#.to_vec(),
        br#"{"id":"e7","payload":"x","deliveries":-5}"#.to_vec(),
        format!(r#"{{"id":"{}","payload":"x"}}"#, "i".repeat(300)).into_bytes(),
        br#"{"id":"e9","payloadBase64":"!!!"}"#.to_vec(),
    ];
    let too_big = vec![b'z'; dlq_core::api::MAX_PAYLOAD_BYTES + 10];
    let mut c = redis.conn().await;
    let mut pipe = redis::pipe();
    for raw in unusable.iter().chain([&too_big]) {
        pipe.cmd("RPUSH").arg("relayer:dead").arg(&raw[..]);
    }
    let _: () = pipe.query_async(&mut c).await.expect("RPUSH");

    let op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let records = eventually(60, "an Invalid record per unusable element", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        (items.len() == unusable.len()).then_some(items)
    })
    .await;
    for raw in &unusable {
        let r = records
            .iter()
            .find(|r| r.spec.job.payload_bytes().ok().as_deref() == Some(&raw[..]))
            .unwrap_or_else(|| panic!("no record holds {:?}", String::from_utf8_lossy(raw)));
        assert_eq!(r.spec.failure_kind, FailureKind::Invalid);
        assert!(r.spec.job.id.starts_with("invalid-"), "{}", r.spec.job.id);
    }
    let rejected = eventually(
        30,
        "the oversize element in relayer:dead:rejected",
        || async {
            let l = redis.list("relayer:dead:rejected").await;
            (!l.is_empty()).then_some(l)
        },
    )
    .await;
    assert_eq!(rejected, vec![too_big.clone()], "kept byte for byte");
    eventually(30, "dlq_rejected_total counts it", || async {
        let n = op.metric(
            "dlq_rejected_total",
            &[("queue", "relayer"), ("reason", "PayloadTooLarge")],
        );
        (n == 1.0).then_some(())
    })
    .await;
    let events = eventually(30, "a Rejected event on the queue", || async {
        let e = events_for(&client, &ns, "relayer", "Rejected").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    let note = events[0].note.clone().unwrap_or_default();
    assert!(note.contains("relayer:dead:rejected"), "{note}");
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));
    assert_eq!(redis.list("relayer:dead").await.len(), 0);
    assert_eq!(redis.list("relayer:dead:processing").await.len(), 0);
    assert_eq!(redis.hash_len("relayer:dead:inflight").await, 0);
}

/// Issue 58: a storm of dead messages through the Redis source costs a handful of `Parked`
/// Event writes, not one a record: past `STORM_ABOVE` a second the group's records are counted
/// by one Event series (`series.count`) instead, and every record is counted exactly once (its
/// own Event or a series' count). Once the storm is over, a trickle gets its own Events again.
/// Event writes are counted from a watch of the namespace's Events (each create and patch is one
/// watch event), not from the operator's word.
#[tokio::test]
async fn a_parking_storm_is_one_event_series_and_a_trickle_after_it_one_event_each() {
    use futures::{StreamExt, TryStreamExt};
    use k8s_openapi::api::events::v1::Event;
    use kube::api::WatchParams;
    use kube::core::WatchEvent;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const STORM: usize = 2_000;

    let (client, ns, redis) = redis_source_queue("series").await;
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let from = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap_or_default();
    let writes = Arc::new(AtomicUsize::new(0));
    let watch = events
        .watch(&WatchParams::default().timeout(290), &from)
        .await
        .unwrap();
    let counting = writes.clone();
    tokio::spawn(async move {
        let mut watch = watch.boxed();
        while let Ok(Some(e)) = watch.try_next().await {
            if let WatchEvent::Added(e) | WatchEvent::Modified(e) = e
                && e.reason.as_deref() == Some("Parked")
            {
                counting.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let started = std::time::Instant::now();
    // The storm's dead messages and the helper's one garbage element (an Invalid record).
    push_dead(&redis, "relayer:dead", STORM).await;
    let parked = || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        let n = items
            .iter()
            .filter(|r| r.status.as_ref().and_then(|s| s.phase) == Some(Phase::Parked))
            .count();
        if n < STORM + 1 {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            return None;
        }
        Some(n)
    };
    let records = eventually(300, "every dead message parked and marked", parked).await;
    let took = started.elapsed();
    // Parked Events on the records, and the series' counts (an Event without one counts 1).
    let counted = || async {
        let items = events.list(&ListParams::default()).await.ok()?.items;
        let parked: Vec<&Event> = items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Parked"))
            .collect();
        let own = parked
            .iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("DeadLetter"))
            .count();
        let series: Vec<(String, i32)> = parked
            .iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.kind.as_deref()) != Some("DeadLetter"))
            .map(|e| (e.name_any(), e.series.as_ref().map_or(1, |s| s.count)))
            .collect();
        let total = own + series.iter().map(|(_, c)| *c as usize).sum::<usize>();
        (total == records).then_some((own, series))
    };
    let (own, series) = eventually(60, "the Events counting every record once", counted).await;
    let storm_writes = writes.load(Ordering::SeqCst);
    dlq_testenv::report(&format!(
        "parking storm: {records} records parked in {took:?}, {storm_writes} Parked Event writes \
         ({own} Events on records, series {series:?})"
    ));
    // What an operator sees: the storm as a few lines, the series' count climbing.
    for view in [
        vec![
            "get",
            "events",
            "-o",
            "wide",
            "--field-selector",
            "reason=Parked",
        ],
        vec!["events", "--types", "Warning"],
    ] {
        let shown = dlq_testenv::plane()
            .kubectl()
            .args(["-n", &ns])
            .args(&view)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&shown.stdout);
        let lines: Vec<&str> = text.lines().collect();
        dlq_testenv::report(&format!(
            "kubectl {}: {} lines; the last:\n{}",
            view.join(" "),
            lines.len(),
            lines[lines.len().saturating_sub(4)..].join("\n")
        ));
    }
    assert!(!series.is_empty(), "a storm makes a series");
    assert!(
        storm_writes * 20 < records,
        "{storm_writes} Event writes for {records} records"
    );

    // The storm is over once it has been calm for a few seconds; then a trickle of three, a
    // second or more apart, gets an Event each on its record.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let before = writes.load(Ordering::SeqCst);
    let mut c = redis.conn().await;
    for i in 0..3 {
        let env = json!({"id": format!("trickle/{i}"), "payload": "{}", "reason": "retries exhausted",
            "deliveries": 5, "failureKind": "Transient"});
        let _: () = redis::cmd("LPUSH")
            .arg("relayer:dead")
            .arg(env.to_string())
            .query_async(&mut c)
            .await
            .unwrap();
        let record = eventually(30, "the trickle's record", || async {
            let items = api.list(&ListParams::default()).await.ok()?.items;
            items
                .into_iter()
                .find(|r| r.spec.job.id == format!("trickle/{i}"))
        })
        .await;
        eventually(20, "its own Parked Event", || async {
            let e = events_for(&client, &ns, &record.name_any(), "Parked").await;
            (!e.is_empty()).then_some(())
        })
        .await;
        tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        writes.load(Ordering::SeqCst) - before,
        3,
        "one write each, no series"
    );
    let (own_after, series_after) =
        eventually(30, "the Events counting every record once", || async {
            let total = records + 3;
            let items = events.list(&ListParams::default()).await.ok()?.items;
            let own = items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("Parked"))
                .filter(|e| {
                    e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("DeadLetter")
                })
                .count();
            let series: usize = items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("Parked"))
                .filter(|e| {
                    e.regarding.as_ref().and_then(|r| r.kind.as_deref()) != Some("DeadLetter")
                })
                .map(|e| e.series.as_ref().map_or(1, |s| s.count) as usize)
                .sum();
            (own + series == total).then_some((own, series))
        })
        .await;
    assert_eq!(own_after, own + 3);
    assert_eq!(
        series_after,
        series.iter().map(|(_, c)| *c as usize).sum::<usize>()
    );
}
