//! The queue reconciler: counters, readiness, `Full` and retention, from the record index.

use super::*;

#[tokio::test]
async fn a_queue_reconcile_counts_deletes_expired_resolved_records_and_says_full_once() {
    let now = jiff::Timestamp::now().as_second();
    let apiserver = FakeApiserver::holding(queue_records(now));
    let target: Arc<FakeTarget> = Arc::default();
    let q = limited_queue(4);
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );

    let action = crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    assert_eq!(action, ReconcileAction::requeue(Duration::from_secs(30)));

    let mut deleted = apiserver.deleted();
    deleted.sort();
    assert_eq!(deleted, ["dropped-old", "redriven-old"]);
    assert!(apiserver.get("parked-old").is_some(), "never a Parked one");
    assert!(
        apiserver.get("again-1").is_some(),
        "a job's cycle 1 goes last"
    );

    let writes = apiserver.queue_writes();
    assert_eq!(writes.len(), 1);
    let (name, status) = &writes[0];
    assert_eq!(name, "relayer");
    assert_eq!(
        (status.parked, status.redriven, status.dropped),
        (4, 2, 0),
        "the deleted records are not counted"
    );
    let at = |ago: i64| {
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            dlq_core::testing::at(now - ago),
        ))
    };
    assert_eq!(status.oldest_parked_at, at(3 * 3600));
    let transient = &status.failure_kinds["Transient"];
    assert_eq!(
        (transient.parked, transient.redriven, transient.dropped),
        (3, 2, 0)
    );
    assert_eq!(transient.oldest_parked_at, at(3 * 3600));
    let invalid = &status.failure_kinds["Invalid"];
    assert_eq!(
        (invalid.parked, invalid.redriven, invalid.dropped),
        (1, 0, 0)
    );
    assert_eq!(invalid.oldest_parked_at, at(3600));
    assert_eq!(status.target, "fake");
    assert_eq!(status.observed_generation, Some(4));
    let ready = conditions::find(&status.conditions, conditions::READY).expect("Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "TargetReachable")
    );
    let full = conditions::find(&status.conditions, conditions::FULL).expect("Full");
    assert_eq!(
        (full.status.as_str(), full.reason.as_str()),
        ("True", "MaxParkedReached")
    );
    assert!(full.message.starts_with("4 parked"), "{}", full.message);
    let published = apiserver.published();
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(
        published[0].0.as_deref(),
        Some("relayer"),
        "about the queue"
    );
    assert_eq!(published[0].1.reason, "QueueFull");
    assert_eq!(
        metric(
            &ctx,
            r#"dlq_records{namespace="payments",queue="relayer",phase="Parked"}"#
        ),
        4.0
    );

    // The queue as the watch now sees it, full already; its broker goes away.
    let mut seen = q.clone();
    seen.status = Some(dlq_core::api::DeadLetterQueueStatus {
        conditions: status.conditions.clone(),
        ..Default::default()
    });
    target.down.store(true, Ordering::SeqCst);
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&seen),
        Settings::default(),
    );
    crate::reconcile::queue::reconcile(Arc::new(seen), ctx)
        .await
        .expect("reconcile");
    assert_eq!(apiserver.reasons(), ["QueueFull"], "once per transition");
    assert_eq!(apiserver.deleted().len(), 2, "nothing more expired");
    let (_, status) = apiserver.queue_writes().pop().expect("a second write");
    assert_eq!((status.parked, status.redriven, status.dropped), (4, 2, 0));
    let ready = conditions::find(&status.conditions, conditions::READY).expect("Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "BrokerUnreachable")
    );
    assert!(
        ready.message.contains("connection refused"),
        "{}",
        ready.message
    );
}

#[tokio::test]
async fn a_queue_below_max_parked_is_not_full_and_without_retention_deletes_nothing() {
    let now = jiff::Timestamp::now().as_second();
    let apiserver = FakeApiserver::holding(queue_records(now));
    let target: Arc<FakeTarget> = Arc::default();
    let mut q = limited_queue(5);
    q.spec.retention = None;
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    crate::reconcile::queue::reconcile(Arc::new(q), ctx)
        .await
        .expect("reconcile");
    assert!(apiserver.deleted().is_empty());
    let (_, status) = apiserver.queue_writes().pop().expect("a write");
    assert_eq!((status.parked, status.redriven, status.dropped), (4, 3, 1));
    let full = conditions::find(&status.conditions, conditions::FULL).expect("Full");
    assert_eq!(
        (full.status.as_str(), full.reason.as_str()),
        ("False", "BelowMaxParked")
    );
    assert!(apiserver.reasons().is_empty(), "no QueueFull");
}
