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
