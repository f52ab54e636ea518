//! The queue reconciler's failure groups: labels on records parked before groups, one
//! DeadLetterGroup per group, acknowledgements and the overflow group.

use super::*;

/// Records parked before failure groups existed carry no `dlq.dev/group`: the queue reconciler
/// labels them with the group the core computes, and leaves labelled ones alone.
#[tokio::test]
async fn records_parked_before_groups_get_their_group_label() {
    use dlq_core::group::{LABEL_GROUP, labelled};
    use dlq_core::record::Facts;
    let now = jiff::Timestamp::now().as_second();
    let mut records = queue_records(now);
    for r in records.iter_mut().skip(1) {
        if let Some(labels) = r.metadata.labels.as_mut() {
            labels.remove(LABEL_GROUP);
        }
    }
    let apiserver = FakeApiserver::holding(records.clone());
    let target: Arc<FakeTarget> = Arc::default();
    let mut q = limited_queue(100);
    q.spec.retention = None;
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    let action = crate::reconcile::queue::reconcile(Arc::new(q), ctx)
        .await
        .expect("reconcile");
    assert_eq!(
        action,
        ReconcileAction::requeue(std::time::Duration::from_secs(30))
    );
    let mut want: Vec<String> = records
        .iter()
        .skip(1)
        .map(|r| r.name().to_string())
        .collect();
    let mut got = apiserver.group_labelled();
    want.sort();
    got.sort();
    assert_eq!(got, want, "every unlabelled record, and only those");
    for r in apiserver.all() {
        assert_eq!(labelled(&r), Some(r.group().as_ref()), "{}", r.name());
        assert_eq!(
            labelled(&r).map(str::to_string),
            Some(dlq_core::group::Key::of(&r).fingerprint())
        );
    }
}

/// The queue reconciler keeps one DeadLetterGroup per failure group, owned by the queue;
/// an unchanged group is not written again, and a changed one at most once per
/// `groups::MIN_INTERVAL` (the reconcile comes back for it).
#[tokio::test]
async fn a_queues_failure_groups_are_kept_and_their_writes_coalesced() {
    use dlq_core::record::Facts;
    let now = jiff::Timestamp::now().as_second();
    let records = queue_records(now);
    let apiserver = FakeApiserver::holding(records.clone());
    let target: Arc<FakeTarget> = Arc::default();
    let mut q = limited_queue(100);
    q.metadata.uid = Some("q-uid".into());
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    let live = apiserver.all();
    let fingerprints: std::collections::BTreeSet<String> =
        live.iter().map(|r| r.group().into_owned()).collect();
    let groups = apiserver.groups();
    assert_eq!(groups.len(), fingerprints.len(), "{groups:?}");
    let parked: i64 = groups
        .values()
        .filter_map(|g| g.status.as_ref())
        .map(|s| s.parked)
        .sum();
    let counted = live.iter().filter(|r| r.phase() == Phase::Parked).count();
    assert_eq!(parked as usize, counted, "every Parked record in one group");
    for g in groups.values() {
        let owner = &g.metadata.owner_references.clone().unwrap_or_default()[0];
        assert_eq!(owner.uid, "q-uid");
    }
    let writes = apiserver.group_writes().len();
    assert!(apiserver.group_writes().iter().all(|(_, create)| *create));

    crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    assert_eq!(
        apiserver.group_writes().len(),
        writes,
        "nothing changed, nothing written"
    );

    // A new record of an existing group, right after its write: held back, not lost.
    let more = queued("later", dlq_core::api::FailureKind::Transient, now, 1).build();
    let group = more.group().into_owned();
    ctx.records
        .observe(&kube::runtime::watcher::Event::Apply(more.clone()));
    let action = crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    assert_eq!(apiserver.group_writes().len(), writes, "held back");
    assert_ne!(
        action,
        ReconcileAction::requeue(std::time::Duration::from_secs(30)),
        "comes back for it within the interval"
    );
    tokio::time::sleep(crate::reconcile::groups::MIN_INTERVAL).await;
    crate::reconcile::queue::reconcile(Arc::new(q), ctx)
        .await
        .expect("reconcile");
    let name = dlq_core::groups::group_name("relayer", &group);
    assert!(
        apiserver.group_writes()[writes..].contains(&(name.clone(), false)),
        "written once the interval passed"
    );
    let status = apiserver.groups()[&name].status.clone().unwrap_or_default();
    assert!(
        status.samples.contains(&more.name().to_string()),
        "{status:?}"
    );
}

/// A changed group whose status has held still for `groups::SETTLED` (its records stopped
/// changing: a storm is over) is written without waiting out `groups::MIN_INTERVAL`: a storm's
/// last counts are exact within a second of its last park, not up to 2 s after it (#57).
#[tokio::test]
async fn a_changed_group_that_holds_still_is_written_before_the_interval_passes() {
    use crate::reconcile::groups::{MIN_INTERVAL, SETTLED};
    use dlq_core::record::Facts;
    let now = jiff::Timestamp::now().as_second();
    let apiserver = FakeApiserver::holding(queue_records(now));
    let target: Arc<FakeTarget> = Arc::default();
    // No retention: every group's records stay as they are, only the new one changes.
    let mut q = limited_queue(100);
    q.spec.retention = None;
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    let written = std::time::Instant::now();
    let writes = apiserver.group_writes().len();
    // The storm's last record, right after the group's write: held back while it may change.
    let last = queued("last", dlq_core::api::FailureKind::Transient, now, 1).build();
    let name = dlq_core::groups::group_name("relayer", &last.group());
    ctx.records
        .observe(&kube::runtime::watcher::Event::Apply(last));
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
        .await
        .expect("reconcile");
    assert_eq!(apiserver.group_writes().len(), writes, "held back");
    // Nothing changed for SETTLED: written, long before MIN_INTERVAL.
    tokio::time::sleep(SETTLED).await;
    crate::reconcile::queue::reconcile(Arc::new(q), ctx)
        .await
        .expect("reconcile");
    assert!(
        written.elapsed() < MIN_INTERVAL,
        "a slow machine: {:?}",
        written.elapsed()
    );
    assert_eq!(
        apiserver.group_writes()[writes..],
        [(name, false)],
        "the changed group, once it held still"
    );
}

/// An acknowledgement on a group (its spec, from the watch) is kept in its status with what the
/// group looked like then, and silences it; taken back, the group is no longer silenced.
#[tokio::test]
async fn an_acknowledged_group_records_its_baseline_and_is_silenced() {
    use dlq_core::groups::{Acknowledgement, DeadLetterGroup};
    let now = jiff::Timestamp::now().as_second();
    let apiserver = FakeApiserver::holding(queue_records(now));
    let target: Arc<FakeTarget> = Arc::default();
    let q = limited_queue(100);
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx)
        .await
        .expect("reconcile");
    let mut stored: Vec<DeadLetterGroup> = apiserver.groups().into_values().collect();
    let acked = stored
        .iter()
        .position(|g| g.status.as_ref().is_some_and(|s| s.parked > 0))
        .expect("a group with parked records");
    stored[acked].spec.acknowledged = Some(Acknowledgement {
        by: "carol".into(),
        note: Some("INC-1234".into()),
    });
    let name = stored[acked].metadata.name.clone().unwrap_or_default();
    let parked = stored[acked].status.as_ref().map_or(0, |s| s.parked);
    let with_ack = |groups: &[DeadLetterGroup]| {
        let ctx = context(
            &apiserver,
            &target,
            std::slice::from_ref(&q),
            Settings::default(),
        );
        Arc::new(
            Arc::into_inner(ctx)
                .expect("one owner")
                .with_group_store(store_of(groups)),
        )
    };
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), with_ack(&stored))
        .await
        .expect("reconcile");
    let status = apiserver.groups()[&name].status.clone().unwrap_or_default();
    let at = status
        .acknowledgement
        .clone()
        .expect("the acknowledgement kept");
    assert_eq!((at.by.as_str(), at.parked), ("carol", parked));
    assert!(status.silenced);
    let others_silenced = apiserver
        .groups()
        .values()
        .filter(|g| g.metadata.name.as_deref() != Some(name.as_str()))
        .any(|g| g.status.as_ref().is_some_and(|s| s.silenced));
    assert!(!others_silenced, "only the acknowledged group");

    stored[acked].spec.acknowledged = None;
    stored[acked].status = Some(status);
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), with_ack(&stored))
        .await
        .expect("reconcile");
    let status = apiserver.groups()[&name].status.clone().unwrap_or_default();
    assert_eq!(status.acknowledgement, None);
    assert!(!status.silenced);
}

/// Beyond `spec.groups.max` groups, the rest are counted in the queue's overflow group and a
/// Warning `GroupsOverflow` says so, once while the number does not grow.
#[tokio::test]
async fn groups_beyond_the_bound_overflow_with_one_warning() {
    let now = jiff::Timestamp::now().as_second();
    let records = queue_records(now);
    let apiserver = FakeApiserver::holding(records.clone());
    let target: Arc<FakeTarget> = Arc::default();
    let mut q = limited_queue(100);
    q.spec.retention = None;
    q.spec.groups = Some(dlq_core::groups::GroupSettings {
        max: Some(1),
        ..Default::default()
    });
    let ctx = context(
        &apiserver,
        &target,
        std::slice::from_ref(&q),
        Settings::default(),
    );
    for _ in 0..2 {
        crate::reconcile::queue::reconcile(Arc::new(q.clone()), ctx.clone())
            .await
            .expect("reconcile");
    }
    let groups = apiserver.groups();
    assert_eq!(
        groups.len(),
        2,
        "one group and the overflow: {:?}",
        groups.keys()
    );
    let overflow = groups["relayer-overflow"]
        .status
        .clone()
        .unwrap_or_default();
    let total: i64 = groups
        .values()
        .filter_map(|g| g.status.as_ref())
        .map(|s| s.parked + s.redriven + s.dropped)
        .sum();
    assert_eq!(total as usize, records.len(), "every record counted once");
    assert!(overflow.parked + overflow.redriven + overflow.dropped > 0);
    let warnings = apiserver
        .reasons()
        .iter()
        .filter(|r| **r == dlq_core::events::reason::GROUPS_OVERFLOW)
        .count();
    assert_eq!(warnings, 1, "announced once");
}

/// Issue 47: a failure group counts what the standing replays of its queue passed through
/// without a record (from their status, summed over the replays of that group only).
#[tokio::test]
async fn a_group_counts_what_its_standing_replays_passed_through() {
    use dlq_core::record::Facts;
    use dlq_core::replay::{DeadLetterReplay, DeadLetterReplayStatus};
    let now = jiff::Timestamp::now().as_second();
    let records = queue_records(now);
    let group = records[0].group().into_owned();
    let apiserver = FakeApiserver::holding(records.clone());
    let target: Arc<FakeTarget> = Arc::default();
    let q = limited_queue(100);
    let replay = |name: &str, queue: &str, group: &str, passed: i64| {
        let mut r: DeadLetterReplay = serde_json::from_value(serde_json::json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterReplay",
            "metadata": {"name": name, "namespace": q.metadata.namespace},
            "spec": {"queue": queue, "by": "ops", "standing": true, "selector": {"group": group}},
        }))
        .expect("replay");
        r.status = Some(DeadLetterReplayStatus {
            passed_through: passed,
            ..Default::default()
        });
        r
    };
    let replays = [
        replay("storm-1", "relayer", &group, 1200),
        replay("storm-2", "relayer", &group, 34),
        replay("elsewhere", "mailer", &group, 99),
    ];
    let ctx = Context::new(
        apiserver.clone(),
        Arc::new(target.clone()),
        crate::state::records::RecordIndex::listed_with(&apiserver.all()),
        store_of(std::slice::from_ref(&q)),
        Metrics::default(),
        Settings::default(),
    )
    .with_replay_store(store_of(&replays));
    crate::reconcile::queue::reconcile(Arc::new(q), Arc::new(ctx))
        .await
        .expect("reconcile");
    let groups = apiserver.groups();
    let passed: Vec<i64> = groups
        .values()
        .map(|g| g.status.as_ref().map_or(0, |s| s.passed_through))
        .collect();
    assert!(passed.contains(&1234), "{passed:?}");
    assert_eq!(
        passed.iter().sum::<i64>(),
        1234,
        "only that group, only this queue"
    );
}

/// Each group's status carries its history, parked per hour from its records' creation times,
/// written with the group's status (no write of its own); a second process (a restart, a new
/// leader) folds on from the stored history and counts nothing twice, only what is new.
#[tokio::test]
async fn a_groups_history_is_written_and_a_new_leader_counts_nothing_twice() {
    use dlq_core::record::Facts;
    use std::collections::BTreeMap;
    const H: i64 = 3600;
    let now = jiff::Timestamp::now().as_second();
    let records = queue_records(now);
    let apiserver = FakeApiserver::holding(records.clone());
    let target: Arc<FakeTarget> = Arc::default();
    let mut q = limited_queue(100);
    q.spec.retention = None;
    let queues = std::slice::from_ref(&q);
    let first = context(&apiserver, &target, queues, Settings::default());
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), first)
        .await
        .expect("reconcile");
    // What each group's last 24 hours should read, from the records themselves.
    let mut want: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for r in &records {
        let hours = want
            .entry(dlq_core::groups::group_name("relayer", &r.group()))
            .or_insert_with(|| vec![0; 24]);
        let created = r.created().map_or(now, |t| t.as_second());
        let back = now.div_euclid(H) - created.div_euclid(H);
        hours[23 - back as usize] += 1;
    }
    let histories =
        |apiserver: &FakeApiserver| -> BTreeMap<String, dlq_core::history::GroupHistory> {
            apiserver
                .groups()
                .into_iter()
                .filter_map(|(name, g)| Some((name, g.status?.history?)))
                .collect()
        };
    let written = histories(&apiserver);
    assert_eq!(written.len(), want.len(), "{written:?}");
    let hourly = |h: &BTreeMap<String, dlq_core::history::GroupHistory>| {
        h.iter()
            .map(|(name, h)| (name.clone(), h.hourly(dlq_core::testing::at(now), 24)))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(hourly(&written), want, "every record in its hour, once");
    let writes = apiserver.group_writes().len();
    assert_eq!(
        writes,
        want.len(),
        "one write a group: the status write it always had"
    );

    // A second process: loads the stored groups and folds the same records on from them.
    let second = context(&apiserver, &target, queues, Settings::default());
    crate::reconcile::queue::reconcile(Arc::new(q.clone()), second.clone())
        .await
        .expect("reconcile");
    assert_eq!(
        apiserver.group_writes().len(),
        2 * writes,
        "it wrote its own, re-derived"
    );
    assert_eq!(histories(&apiserver), written, "nothing counted twice");

    // A new parking counts once, in its hour, on top of what was there.
    let more = queued("later", dlq_core::api::FailureKind::Transient, now, 0).build();
    let group = dlq_core::groups::group_name("relayer", &more.group());
    second
        .records
        .observe(&kube::runtime::watcher::Event::Apply(more));
    tokio::time::sleep(crate::reconcile::groups::MIN_INTERVAL).await;
    crate::reconcile::queue::reconcile(Arc::new(q), second)
        .await
        .expect("reconcile");
    let after = histories(&apiserver);
    let mut expected = want[&group].clone();
    expected[23] += 1;
    assert_eq!(
        after[&group].hourly(dlq_core::testing::at(now), 24),
        expected
    );
    assert!(
        after[&group].trend.last_hour >= 1,
        "{:?}",
        after[&group].trend
    );
}
