//! Leader election on a Lease: one of two replicas acts; when it dies, the other takes over.

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{Action, DeadLetter, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    LIST, Operator, create_queue, decide, events_for, eventually, list_target, setup, wait_phase,
};
use kube::ResourceExt;
use kube::api::Api;
use serde_json::json;

fn leads(op: &Operator) -> bool {
    op.logs().contains("became leader")
}

struct Replicas {
    client: kube::Client,
    ns: String,
    redis: Redis,
    /// The leader.
    a: Operator,
    /// The standby.
    b: Operator,
}

/// A queue on a fresh Redis and two replicas with leader election, the first one leading.
async fn two_replicas(name: &str) -> Replicas {
    let (client, ns) = setup(name).await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let args = ["--leader-election=true", "--lease-namespace", &ns];
    let a = Operator::start_with(&ns, &args, &[]);
    eventually(30, "the first replica to lead", || async {
        leads(&a).then_some(())
    })
    .await;
    let b = Operator::start_with(&ns, &args, &[]);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(!leads(&b), "only one replica leads");
    Replicas {
        client,
        ns,
        redis,
        a,
        b,
    }
}

#[tokio::test]
async fn a_standby_takes_over_when_the_leader_dies() {
    let Replicas {
        client,
        ns,
        redis,
        mut a,
        b,
    } = two_replicas("leader").await;

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let first = park(
        client.clone(),
        &ns,
        ParkRequest::new(
            "relayer",
            Job {
                id: "l/1".into(),
                payload: Some("one".into()),
                ..Job::default()
            },
        ),
    )
    .await
    .unwrap();
    decide(&api, &first.record().name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &first.record().name_any(), Phase::Redriven, 20).await;

    a.kill(); // the leader dies without releasing the Lease
    eventually(60, "the standby to take over", || async {
        leads(&b).then_some(())
    })
    .await;
    let second = park(
        client.clone(),
        &ns,
        ParkRequest::new(
            "relayer",
            Job {
                id: "l/2".into(),
                payload: Some("two".into()),
                ..Job::default()
            },
        ),
    )
    .await
    .unwrap();
    decide(&api, &second.record().name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &second.record().name_any(), Phase::Redriven, 30).await;
    let mut jobs = redis.list(LIST).await;
    jobs.sort();
    assert_eq!(jobs, vec![b"one".to_vec(), b"two".to_vec()]);
}

/// A leader stopped cleanly (SIGTERM, as in a rolling update) gives the Lease up, so the
/// standby takes over at once instead of after the Lease's 15 s.
#[tokio::test]
async fn a_leader_stopped_cleanly_hands_the_lease_over_at_once() {
    let Replicas { mut a, b, .. } = two_replicas("leader-term").await;

    let stopped = std::time::Instant::now();
    let status = a.terminate().expect("the leader exits on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", a.logs());
    assert!(a.logs().contains("released the Lease"), "{}", a.logs());
    eventually(30, "the standby to take over", || async {
        leads(&b).then_some(())
    })
    .await;
    let took = stopped.elapsed();
    dlq_testenv::report(&format!(
        "leader: SIGTERM to the standby leading took {:.1}s (Lease 15 s)",
        took.as_secs_f64()
    ));
    assert!(
        took.as_secs() < 8,
        "took {took:?}: the Lease was not handed over"
    );
}

/// A leader whose reconcile of a decision hangs (failpoint `before-requeue`, held for ever)
/// makes no progress on it, and never would: past the stall bound it says so (a log line, a
/// Warning Event `LeaderStalled` on the queue, `/readyz` false), gives up the Lease and exits.
/// The standby takes over and carries the decision out; the job arrives once.
#[tokio::test]
async fn a_leader_stalled_on_a_decision_steps_down_and_the_standby_carries_it_out() {
    let (client, ns) = setup("leader-stall").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    // Bound: max(4 s, 2 x 2 s cap (the harness's) + 1 s re-list) = 5 s.
    let args = [
        "--leader-election=true",
        "--lease-namespace",
        &ns,
        "--decided-resync-seconds",
        "1",
        "--stall-after-seconds",
        "4",
    ];
    let mut a = Operator::start_with(&ns, &args, &[("DLQ_FAILPOINT", "before-requeue")]);
    eventually(30, "the first replica to lead", || async {
        leads(&a).then_some(())
    })
    .await;
    let b = Operator::start_with(&ns, &args, &[]);

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let parked = park(
        client.clone(),
        &ns,
        ParkRequest::new(
            "relayer",
            Job {
                id: "l/stall".into(),
                payload: Some("stalled".into()),
                ..Job::default()
            },
        ),
    )
    .await
    .unwrap();
    let name = parked.record().name_any();
    decide(&api, &name, Action::Redrive, "ops").await;
    a.reached_failpoint("before-requeue", 20).await;
    assert!(
        !leads(&b),
        "the standby waits while the leader holds the Lease"
    );

    // It stops being ready before it exits (running reconciles get a grace of 10 s).
    eventually(30, "the stalled leader to turn /readyz false", || async {
        a.http_get("/readyz")
            .is_some_and(|body| !body.starts_with("ok"))
            .then_some(())
    })
    .await;
    let logs = a.logs();
    assert!(
        logs.contains("no progress on decided records; giving up the Lease"),
        "{logs}"
    );
    // Exits after the grace given to the hung reconcile (10 s) and the Lease's release.
    let exited_by = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while a.running() {
        assert!(
            std::time::Instant::now() < exited_by,
            "the stalled leader did not exit"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let status = a.terminate().expect("its exit status");
    assert!(
        !status.success(),
        "a replica that gave up leading exits with an error: {status:?}"
    );
    let events = events_for(&client, &ns, "relayer", "LeaderStalled").await;
    assert_eq!(
        events.len(),
        1,
        "one Warning Event on the queue: {events:?}"
    );

    eventually(30, "the standby to take over", || async {
        leads(&b).then_some(())
    })
    .await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;
    assert_eq!(redis.list(LIST).await, vec![b"stalled".to_vec()]);
}
