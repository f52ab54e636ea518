//! Payload sealing (issue 32) against a real apiserver, etcd and redis-server: a sealed queue's
//! records parked through `kubectl dlq park`, `dlq-client` and the Redis source hold no card
//! number in etcd's raw value, the operator's log or the records' Events; redrive delivers the
//! exact bytes and headers; rotation (a new key first, old records still redrive, counts per
//! key); a lost key refuses the redrive (`SealKeyMissing`) and the record stays Parked; a queue
//! that seals without a readable key refuses to park plaintext; `age` CLI interop.

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Job, Phase};
use dlq_core::seal::{Keyring, generate_identity};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, eventually, kubectl_dlq, setup,
    wait_phase,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// A Luhn-valid test card number: it must appear nowhere but in what redrive delivers.
const CARD: &str = "4111111111111111";
const STREAM: &str = "relayer:stream";
const DEAD: &str = "relayer:dead";
/// The operator's own modules at debug: whatever it would log about a record, it logs.
const LOG: (&str, &str) = (
    "RUST_LOG",
    "info,deadletter=debug,dlq_client=debug,kube=warn",
);

/// Queue `relayer`: Redis stream target (carries headers), Redis dead-list source, sealed with
/// the identity Secrets `keys` (in order).
async fn sealed_queue(client: &Client, ns: &str, redis: &Redis, keys: &[&str]) {
    create_secret(client, ns, "redis", "url", &redis.url()).await;
    let keys: Vec<_> = keys.iter().map(|k| json!({"secretName": k})).collect();
    create_dlq(
        client,
        ns,
        "relayer",
        json!({
            "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": STREAM}},
            "source": {"redis": {"list": DEAD}},
            "protection": {"seal": {"keys": keys}, "maskPaths": ["$.holder"]},
        }),
    )
    .await;
}

/// A fresh identity in Secret `name` (key `identity`); returns its recipient.
async fn identity_secret(client: &Client, ns: &str, name: &str) -> String {
    let (file, recipient) = generate_identity();
    create_secret(client, ns, name, "identity", &file).await;
    recipient
}

/// The recipient of the identity in Secret `name` (key `identity`).
async fn recipient_in(client: &Client, ns: &str, name: &str) -> String {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets.get(name).await.unwrap();
    let identity = &secret.data.unwrap()["identity"].0;
    let mut keys = Keyring::default();
    keys.add(std::str::from_utf8(identity).unwrap()).unwrap()
}

/// Waits until the queue publishes `recipients` (in order) and returns its status protection.
async fn published(client: &Client, ns: &str, recipients: &[&str]) -> DeadLetterQueue {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    eventually(30, "the queue to publish its recipients", || async {
        let q = queues.get("relayer").await.ok()?;
        let p = q.status.as_ref()?.protection.as_ref()?;
        (p.recipients == recipients).then_some(q)
    })
    .await
}

/// `status.protection.sealedRecords` once it equals `want`.
async fn sealed_counts(client: &Client, ns: &str, want: &[(&str, i64)]) {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let want: std::collections::BTreeMap<String, i64> =
        want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    eventually(30, "sealedRecords per recipient", || async {
        let q = queues.get("relayer").await.ok()?;
        let counts = &q.status.as_ref()?.protection.as_ref()?.sealed_records;
        (*counts == want).then_some(())
    })
    .await;
}

fn card_payload(id: &str) -> String {
    format!(r#"{{"id":"{id}","card":"{CARD}","holder":"Ada"}}"#)
}

/// Parks `id` through `kubectl dlq park` with the card in the payload and a header.
fn park_with_plugin(ns: &str, id: &str) {
    let payload = card_payload(id);
    let header = format!("x-card={CARD}");
    let (ok, out, err) = kubectl_dlq(
        ns,
        &[
            "park",
            "--queue",
            "relayer",
            "--id",
            id,
            "--payload",
            &payload,
            "--header",
            &header,
        ],
    );
    assert!(ok, "kubectl dlq park: {out}{err}");
}

/// Parks `id` through `dlq_client::park`.
async fn park_with_client(client: &Client, ns: &str, id: &str) {
    let mut job = Job::from_bytes(id, card_payload(id).as_bytes());
    job.headers.insert("x-card".into(), CARD.into());
    let req = dlq_client::ParkRequest::new("relayer", job);
    dlq_client::park(client.clone(), ns, req)
        .await
        .expect("dlq_client::park into a sealed queue");
}

/// Pushes a dead-list envelope for `id` for the Redis source to park.
async fn park_with_source(redis: &Redis, id: &str) {
    let envelope = json!({"id": id, "payload": card_payload(id), "headers": {"x-card": CARD}, "reason": "timeout", "deliveries": 3});
    let mut c = redis.conn().await;
    let _: i64 = redis::cmd("LPUSH")
        .arg(DEAD)
        .arg(envelope.to_string())
        .query_async(&mut c)
        .await
        .unwrap();
}

/// The record of job `id`, once it exists.
async fn record_of(api: &Api<DeadLetter>, id: &str) -> DeadLetter {
    eventually(30, &format!("a record of {id}"), || async {
        let list = api.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find(|r| r.spec.job.id == id)
    })
    .await
}

/// Asserts the record is sealed to `recipient` and that etcd's raw value holds no card.
async fn assert_sealed_in_etcd(r: &DeadLetter, recipient: &str) {
    let sealed = r.spec.job.sealed.as_ref().expect("the record is sealed");
    assert_eq!(sealed.recipient, recipient);
    assert!(r.spec.job.payload.is_none() && r.spec.job.headers.is_empty());
    let key = format!(
        "/registry/dlq.dev/deadletters/{}/{}",
        r.namespace().unwrap(),
        r.name_any()
    );
    let raw = dlq_testenv::plane()
        .etcd_value(&key)
        .await
        .unwrap_or_else(|| panic!("etcd has no {key}"));
    let raw = String::from_utf8_lossy(&raw);
    assert!(
        raw.contains(recipient),
        "etcd's value is this record's: {raw:.300}"
    );
    assert!(
        !raw.contains(CARD),
        "the card number is in etcd: {raw:.600}"
    );
    assert!(!raw.contains("Ada"), "the payload is in etcd: {raw:.600}");
}

/// The stream entry redrive wrote for job `id`: its fields.
async fn delivered(redis: &Redis, id: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;
    let needle = format!(r#""id":"{id}""#).into_bytes();
    eventually(30, &format!("{id} on the stream"), || async {
        let mut c = redis.conn().await;
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(STREAM)
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await
            .ok()?;
        entries.into_iter().map(|(_, f)| f).find(|f| {
            f.iter()
                .any(|(k, v)| k == b"payload" && v.windows(needle.len()).any(|w| w == needle))
        })
    })
    .await
}

/// Redrives record `name` and asserts the stream got its exact payload and header.
async fn redrive_exact(api: &Api<DeadLetter>, redis: &Redis, r: &DeadLetter) {
    decide(api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(api, &r.name_any(), Phase::Redriven, 30).await;
    let fields = delivered(redis, &r.spec.job.id).await;
    let payload = card_payload(&r.spec.job.id).into_bytes();
    assert!(
        fields.contains(&(b"payload".to_vec(), payload)),
        "{fields:?}"
    );
    assert!(
        fields.contains(&(b"header:x-card".to_vec(), CARD.as_bytes().to_vec())),
        "{fields:?}"
    );
}

/// Every Event's note in `ns`.
async fn event_notes(client: &Client, ns: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&ListParams::default()).await.unwrap();
    list.items.into_iter().filter_map(|e| e.note).collect()
}

/// The control: into a queue that does not seal, the same job's card is in etcd's raw value,
/// so the reads above would see one.
async fn plaintext_control(client: &Client, ns: &str) {
    create_dlq(
        client,
        ns,
        "plain",
        json!({"target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": "plain"}}}),
    )
    .await;
    let req = dlq_client::ParkRequest::new(
        "plain",
        Job::from_bytes("plain/1", card_payload("plain/1").as_bytes()),
    );
    let outcome = dlq_client::park(client.clone(), ns, req).await.unwrap();
    let key = format!(
        "/registry/dlq.dev/deadletters/{ns}/{}",
        outcome.record().name_any()
    );
    let raw = dlq_testenv::plane().etcd_value(&key).await.unwrap();
    assert!(
        String::from_utf8_lossy(&raw).contains(CARD),
        "a plaintext record's card is readable in etcd"
    );
    // Shown to a human, its card is masked all the same.
    let (ok, out, err) = kubectl_dlq(ns, &["show", "plain/1"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("411111******1111") && !out.contains(CARD),
        "{out}"
    );
}

#[tokio::test]
async fn parked_through_plugin_client_and_source_the_card_is_nowhere_and_redrive_is_exact() {
    let started = std::time::Instant::now();
    let (client, ns) = setup("seal").await;
    let redis = Redis::start();
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    sealed_queue(&client, &ns, &redis, &["relayer-seal"]).await;
    let op = Operator::start_with(&ns, &[], &[LOG]);
    published(&client, &ns, &[&recipient]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    park_with_plugin(&ns, "card/plugin");
    park_with_client(&client, &ns, "card/client").await;
    park_with_source(&redis, "card/source").await;
    let mut records = Vec::new();
    for id in ["card/plugin", "card/client", "card/source"] {
        let r = record_of(&api, id).await;
        assert_sealed_in_etcd(&r, &recipient).await;
        records.push(r);
    }
    sealed_counts(&client, &ns, &[(&recipient, 3)]).await;
    let (ok, out, err) = kubectl_dlq(&ns, &["show", "card/plugin"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("sealed (recipient {recipient})")),
        "{out}"
    );
    assert!(!out.contains("4111"), "{out}");
    plaintext_control(&client, &ns).await;
    for r in &records {
        redrive_exact(&api, &redis, r).await;
    }
    let notes = event_notes(&client, &ns).await;
    assert!(
        notes.iter().any(|n| n.contains("card")),
        "the records' Events are there: {notes:?}"
    );
    assert!(!notes.iter().any(|n| n.contains(CARD)), "{notes:?}");
    let logs = op.logs();
    assert!(
        logs.contains("card/source"),
        "the operator logged the parking"
    );
    assert!(
        !logs.contains(CARD),
        "the card number is in the operator's log"
    );
    dlq_testenv::report(&format!(
        "seal: 3 sealed parkings and redrives in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
}

#[tokio::test]
async fn rotation_seals_new_records_to_the_first_key_and_old_ones_still_redrive() {
    let (client, ns) = setup("rotate").await;
    let redis = Redis::start();
    let old = identity_secret(&client, &ns, "seal-old").await;
    sealed_queue(&client, &ns, &redis, &["seal-old"]).await;
    let _op = Operator::start_with(&ns, &[], &[LOG]);
    published(&client, &ns, &[&old]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park_with_client(&client, &ns, "rot/1").await;
    let first = record_of(&api, "rot/1").await;

    // Rotation with `kubectl dlq seal-key`: a new key first, the old one kept to open older
    // records.
    let (ok, out, err) = kubectl_dlq(&ns, &["seal-key", "relayer", "--secret", "seal-new"]);
    assert!(ok, "kubectl dlq seal-key: {out}{err}");
    let new = recipient_in(&client, &ns, "seal-new").await;
    assert!(out.contains(&new) && out.contains("seal-old"), "{out}");
    assert!(!out.contains("AGE-SECRET-KEY") && !err.contains("AGE-SECRET-KEY"));
    published(&client, &ns, &[&new, &old]).await;
    let (ok, _, err) = kubectl_dlq(&ns, &["seal-key", "relayer", "--secret", "seal-new"]);
    assert!(
        !ok && err.contains("Secret seal-new already exists"),
        "{err}"
    );
    park_with_client(&client, &ns, "rot/2").await;
    let second = record_of(&api, "rot/2").await;
    assert_sealed_in_etcd(&first, &old).await;
    assert_sealed_in_etcd(&second, &new).await;
    sealed_counts(&client, &ns, &[(&new, 1), (&old, 1)]).await;

    redrive_exact(&api, &redis, &first).await;
    redrive_exact(&api, &redis, &second).await;
    // Records count per key whatever their phase: the old key retires once its records go.
    api.delete(&first.name_any(), &Default::default())
        .await
        .unwrap();
    sealed_counts(&client, &ns, &[(&new, 1), (&old, 0)]).await;
}

#[tokio::test]
async fn a_record_whose_key_is_gone_is_refused_and_stays_parked() {
    let (client, ns) = setup("lostkey").await;
    let redis = Redis::start();
    let lost = identity_secret(&client, &ns, "seal-lost").await;
    sealed_queue(&client, &ns, &redis, &["seal-lost"]).await;
    let _op = Operator::start_with(&ns, &[], &[LOG]);
    published(&client, &ns, &[&lost]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park_with_client(&client, &ns, "lost/1").await;
    let r = record_of(&api, "lost/1").await;

    // The key is replaced (its Secret deleted, a new one first): the record cannot be opened.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), &ns);
    secrets
        .delete("seal-lost", &Default::default())
        .await
        .unwrap();
    let fresh = identity_secret(&client, &ns, "seal-fresh").await;
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let keys = json!({"spec": {"protection": {"seal": {"keys": [{"secretName": "seal-fresh"}, {"secretName": "seal-lost"}]}}}});
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&keys))
        .await
        .unwrap();
    published(&client, &ns, &[&fresh]).await;
    sealed_counts(&client, &ns, &[(&fresh, 0), (&lost, 1)]).await;

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    let refused = eventually(30, "Requeued=False SealKeyMissing", || async {
        let r = api.get(&r.name_any()).await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, reason, _)) if s == "False" && reason == "SealKeyMissing").then_some(r)
    })
    .await;
    assert_eq!(refused.phase(), Phase::Parked);
    let (_, _, message) = condition(&refused, "Requeued").unwrap();
    assert!(
        message.contains(&lost) && message.contains("no key of the queue opens it"),
        "{message}"
    );
    let mut c = redis.conn().await;
    let len: i64 = redis::cmd("XLEN")
        .arg(STREAM)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(len, 0, "nothing was sent, not even half-opened");
    let notes = event_notes(&client, &ns).await;
    assert!(
        notes
            .iter()
            .any(|n| n.contains("no key of the queue opens it")),
        "{notes:?}"
    );
}

#[tokio::test]
async fn a_sealed_queue_without_a_readable_key_refuses_to_park_plaintext() {
    let (client, ns) = setup("nokey").await;
    let redis = Redis::start();
    // The Secret named by the queue does not exist: no recipient is ever published.
    sealed_queue(&client, &ns, &redis, &["seal-missing"]).await;
    let _op = Operator::start_with(&ns, &[], &[LOG]);
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(30, "the queue's first status", || async {
        queues.get("relayer").await.ok()?.status?.protection
    })
    .await;
    let payload = card_payload("nokey/1");
    let (ok, out, err) = kubectl_dlq(
        &ns,
        &[
            "park",
            "--queue",
            "relayer",
            "--id",
            "nokey/1",
            "--payload",
            &payload,
        ],
    );
    assert!(!ok, "parked into a queue without a recipient: {out}");
    assert!(
        err.contains("refusing to park the job in plaintext"),
        "{err}"
    );
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    assert!(
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

/// age's own CLI opens what a parker sealed, and an `age-keygen` identity opens a record: the
/// format is age's, not ours. Needs Debian's `age` (scripts/ensure-deps.sh installs it).
#[tokio::test]
async fn the_age_cli_opens_sealed_jobs_and_its_keys_open_records() {
    let found = |bin: &str| {
        std::process::Command::new(bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !found("age") || !found("age-keygen") {
        dlq_testenv::report(
            "SKIPPED the_age_cli_opens_sealed_jobs_and_its_keys_open_records: `age` and `age-keygen` are not on PATH (Debian package `age`; scripts/ensure-deps.sh installs it)",
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("dlq-age-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("key.txt");
    let keygen = std::process::Command::new("age-keygen")
        .arg("-o")
        .arg(&key)
        .output()
        .unwrap();
    assert!(keygen.status.success(), "{keygen:?}");
    let mut keys = Keyring::default();
    let recipient = keys.add(&std::fs::read_to_string(&key).unwrap()).unwrap();

    let mut job = Job::from_bytes("age/1", card_payload("age/1").as_bytes());
    job.headers.insert("x-card".into(), CARD.into());
    let sealed = dlq_core::seal::seal(&job, &recipient).unwrap();
    use base64::Engine;
    let file = base64::engine::general_purpose::STANDARD
        .decode(&sealed.sealed.as_ref().unwrap().ciphertext)
        .unwrap();
    let sealed_file = dir.join("job.age");
    std::fs::write(&sealed_file, file).unwrap();
    let opened = std::process::Command::new("age")
        .arg("-d")
        .arg("-i")
        .arg(&key)
        .arg(&sealed_file)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(opened.status.success(), "{opened:?}");
    let content: serde_json::Value = serde_json::from_slice(&opened.stdout).unwrap();
    assert_eq!(content["payload"], card_payload("age/1"));
    assert_eq!(content["headers"]["x-card"], CARD);
    assert_eq!(dlq_core::seal::open_job(&sealed, &keys).unwrap(), job);
}
