//! dlq.dev objects as the tests create, decide and wait on them.

use std::time::Instant;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Phase};
use dlq_core::testing::RecordBuilder;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::harness::eventually;

/// The list the `relayer` queue of [`create_queue`] + [`list_target`] redrives onto.
pub const LIST: &str = "relayer:jobs";

/// A Secret `redis` with the Redis URL and a DeadLetterQueue `relayer` whose Redis target is
/// `target` (e.g. [`list_target`]); `extra` is merged into the queue's spec.
pub async fn create_queue(
    client: &Client,
    ns: &str,
    url: &str,
    target: serde_json::Value,
    extra: serde_json::Value,
) {
    create_secret(client, ns, "redis", "url", url).await;
    let mut spec = json!({"target": {"redis": target}});
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    create_dlq(client, ns, "relayer", spec).await;
}

/// A fresh namespace ([`setup`](crate::cluster::setup) `name`), a fresh redis-server and queue
/// `relayer` redriving onto its [`LIST`], with `extra` merged into the queue's spec.
pub async fn setup_redis_queue(
    name: &str,
    extra: serde_json::Value,
) -> (Client, String, crate::brokers::Redis) {
    let (client, ns) = crate::cluster::setup(name).await;
    let redis = crate::brokers::Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), extra).await;
    (client, ns, redis)
}

/// Queue `relayer` as [`create_queue`] makes it, with a Redis nothing listens on: for tests of
/// parking, the CLI and the apiserver's rules, where no job ever reaches a broker.
pub async fn create_offline_queue(client: &Client, ns: &str) {
    create_queue(client, ns, "redis://127.0.0.1:1/", list_target(), json!({})).await;
}

/// Makes queue `queue` alert per parked record (`spec.alerts.per: record`) instead of per
/// failure group, for tests and benches of the per-record alerts.
pub async fn alerts_per_record(client: &Client, ns: &str, queue: &str) {
    use kube::api::{Patch, PatchParams};
    let api: kube::Api<dlq_core::api::DeadLetterQueue> = kube::Api::namespaced(client.clone(), ns);
    api.patch(
        queue,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"alerts": {"per": "record"}}})),
    )
    .await
    .unwrap_or_else(|e| panic!("alerts per record on {queue}: {e}"));
}

/// The Redis target onto [`LIST`], with the URL from the Secret of [`create_queue`].
pub fn list_target() -> serde_json::Value {
    json!({"urlSecretRef": {"name": "redis", "key": "url"}, "list": LIST})
}

/// A Secret with one key.
pub async fn create_secret(client: &Client, ns: &str, name: &str, key: &str, value: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name}, "stringData": {key: value}
    }))
    .expect("a Secret object");
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("creating secret {name}: {e}"));
}

/// A DeadLetterQueue `name` with `spec` as given.
pub async fn create_dlq(client: &Client, ns: &str, name: &str, spec: serde_json::Value) {
    let q: DeadLetterQueue = serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap_or_else(|e| panic!("DeadLetterQueue {name}: spec does not fit the type: {e}"));
    Api::<DeadLetterQueue>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &q)
        .await
        .unwrap_or_else(|e| panic!("creating DeadLetterQueue {name}: {e}"));
}

/// A record `name` of job `id` on queue `relayer` as a parker would create it (see
/// `dlq_core::testing::RecordBuilder`), failed now: `payload` as UTF-8 text when it is, else
/// base64.
pub fn record(name: &str, id: &str, payload: &[u8], headers: &[(&str, &str)]) -> DeadLetter {
    unplaced(
        RecordBuilder::job(id)
            .named(name)
            .payload(payload)
            .headers(headers)
            .failed_at(jiff::Timestamp::now()),
    )
}

/// `builder`'s record as a test creates it: in the namespace of the `Api` it is created
/// through, its generation the apiserver's to set.
pub fn unplaced(builder: RecordBuilder) -> DeadLetter {
    let mut r = builder.build();
    r.metadata.namespace = None;
    r.metadata.generation = None;
    r
}

/// Signs a decision on record `name` as `by`.
pub async fn decide(api: &Api<DeadLetter>, name: &str, action: Action, by: &str) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"action": action, "by": by}})),
    )
    .await
    .unwrap_or_else(|e| panic!("setting the decision on {name}: {e}"));
}

/// Waits until record `name` is in `phase`; returns it. Parked means as the operator left it:
/// the apiserver serves every record Parked from its create (the CRD's default), so this
/// also waits for its mark unless it has a decision (`dlq_core::decide::needs_mark`).
pub async fn wait_phase(api: &Api<DeadLetter>, name: &str, phase: Phase, secs: u64) -> DeadLetter {
    eventually(secs, &format!("{name} to be {phase:?}"), || async {
        api.get(name).await.ok().filter(|r| in_phase(r, phase))
    })
    .await
}

/// Whether `r` is in `phase`, Parked only once marked or decided (see [`wait_phase`]).
pub fn in_phase(r: &DeadLetter, phase: Phase) -> bool {
    r.phase() == phase && !(phase == Phase::Parked && dlq_core::decide::needs_mark(r))
}

/// Waits until DeadLetterQueue `name` says Ready=`want`; returns `<reason>: <message>`.
pub async fn wait_ready(client: &Client, ns: &str, name: &str, want: bool, secs: u64) -> String {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let status = if want { "True" } else { "False" };
    eventually(secs, &format!("queue {name} Ready={status}"), || async {
        let q = queues.get(name).await.ok()?;
        q.status?
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready" && c.status == status)
            .map(|c| format!("{}: {}", c.reason, c.message))
    })
    .await
}

/// The Events about object `name` with `reason`.
pub async fn events_for(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap_or_else(|e| panic!("listing events in {ns}: {e}"))
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

/// (status, reason, message) of the record's condition `type_`.
pub fn condition(r: &DeadLetter, type_: &str) -> Option<(String, String, String)> {
    r.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Creates `n` records, waits until each is Parked, decides them all at once, and returns the
/// seconds from the decisions until every record is Redriven.
pub async fn redrive_many(
    api: &Api<DeadLetter>,
    n: usize,
    make: impl Fn(usize) -> DeadLetter,
) -> f64 {
    let creates = (0..n).map(|i| {
        let api = api.clone();
        let r = make(i);
        async move {
            api.create(&PostParams::default(), &r)
                .await
                .unwrap_or_else(|e| panic!("creating record {}: {e}", r.name_any()))
        }
    });
    let names: Vec<String> = futures::future::join_all(creates)
        .await
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let all_in = |phase: Phase| {
        let api = api.clone();
        async move {
            let items = api.list(&ListParams::default()).await.ok()?.items;
            (items.len() >= n && items.iter().all(|r| in_phase(r, phase))).then_some(())
        }
    };
    eventually(120, "all records Parked", || all_in(Phase::Parked)).await;
    let started = Instant::now();
    futures::future::join_all(
        names
            .iter()
            .map(|name| decide(api, name, Action::Redrive, "ops")),
    )
    .await;
    eventually(300, "all records Redriven", || all_in(Phase::Redriven)).await;
    started.elapsed().as_secs_f64()
}

/// `len` bytes that are not UTF-8 (a source carries them as base64) and differ per `seed`: a
/// large dead message whose every byte matters.
pub fn noise(seed: u8, len: usize) -> Vec<u8> {
    let mut x = u32::from(seed).wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8 | 0x80
        })
        .collect()
}
