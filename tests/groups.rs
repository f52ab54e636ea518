//! Failure groups against a real apiserver: records parked before groups existed (or by an
//! older parker) get their `dlq.dev/group` label from the operator, so the apiserver selects a
//! group's records by label.

use std::collections::BTreeSet;

use dlq_core::api::DeadLetter;
use dlq_core::group::{Key, LABEL_GROUP, labelled};
use dlq_core::testing::RecordBuilder;
use dlq_testenv::{Operator, create_offline_queue, eventually, setup, unplaced};
use kube::api::{Api, ListParams, PostParams};

/// A record as an older parker made it: every label but the group.
fn old_record(id: &str, reason: &str) -> DeadLetter {
    let mut r = unplaced(
        RecordBuilder::job(id)
            .reason(reason)
            .service_version("relayer@1.4.2")
            .failed_at(jiff::Timestamp::now()),
    );
    if let Some(labels) = r.metadata.labels.as_mut() {
        labels.remove(LABEL_GROUP);
    }
    r
}

#[tokio::test]
async fn records_parked_before_groups_are_labelled_by_the_operator() {
    let (client, ns) = setup("group-migrate").await;
    create_offline_queue(&client, &ns).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let old = [
        old_record("a", "timeout after 3021 ms talking to payer 7f3a9c21"),
        old_record("b", "timeout after 15 ms talking to payer 0b11e0aa"),
        old_record("c", "field \"amount\" is not a number"),
    ];
    for r in &old {
        let created = api.create(&PostParams::default(), r).await.expect("create");
        assert_eq!(labelled(&created), None, "parked without a group label");
    }
    let group = Key::of(&old[0]).fingerprint();
    let _op = Operator::start(&ns);
    let records = eventually(60, "every record labelled with its group", || async {
        let items = api.list(&ListParams::default()).await.ok()?.items;
        items.iter().all(|r| labelled(r).is_some()).then_some(items)
    })
    .await;
    for r in &records {
        assert_eq!(
            labelled(r).map(str::to_string),
            Some(Key::of(r).fingerprint()),
            "{}",
            r.spec.job.id
        );
    }
    let selected = api
        .list(&ListParams::default().labels(&format!("{LABEL_GROUP}={group}")))
        .await
        .expect("list");
    let jobs: BTreeSet<String> = selected
        .items
        .iter()
        .map(|r| r.spec.job.id.clone())
        .collect();
    assert_eq!(jobs, BTreeSet::from(["a".to_string(), "b".to_string()]));
}
