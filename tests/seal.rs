//! Payload sealing (issue 32) against a real apiserver, etcd and redis-server: a sealed queue's
//! records parked through `kubectl dlq park`, `dlq-client`, the Redis source, the HTTP park
//! endpoint and the Sidekiq source (a real Sidekiq) hold no card number in etcd's raw value, the
//! operator's log or the records' Events; redrive delivers the exact bytes and headers; an
//! element that is no envelope (a card as a JSON number) is an Invalid record whose reason does
//! not quote it; rotation (a new key first, old records still redrive, counts per key); a lost
//! key refuses the redrive (`SealKeyMissing`) and the record stays Parked; a queue that seals
//! without a readable key refuses to park plaintext; the reveal API (masked, unmasked, a damaged
//! record a 409); `age` CLI interop.

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, Job, Phase};
use dlq_core::seal::{Keyring, generate_identity};
use dlq_testenv::brokers::Redis;
use dlq_testenv::reveal::{register_reveal_api, reveal_certificate};
use dlq_testenv::{
    Operator, audited_plane, condition, create_dlq, create_secret, decide, eventually,
    kubectl_dlq_on, setup_on, wait_phase,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// One entry of a Redis stream as XRANGE answers it: its id and its (field, value) pairs.
type StreamEntry = (String, Vec<(Vec<u8>, Vec<u8>)>);

/// A Luhn-valid test card number: it must appear nowhere but in what redrive delivers.
/// The card holder of the test payloads: with a space, which no base64 ciphertext holds (a bare
/// `Ada` turned up inside one by chance).
const HOLDER: &str = "Ada Lovelace";
const CARD: &str = "4111111111111111";
/// The plaintext control's card: in etcd and the audit log, as a payload that is not sealed is.
const CONTROL_CARD: &str = "5555555555554444";
/// The reveal test's card: an unmasked reveal shows it, so it is not [`CARD`].
const REVEAL_CARD: &str = "4012888888881881";
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
    // One key is the queue's identity; several are a rotation's list, the first sealing.
    let seal = match keys {
        [one] => json!({"identitySecretRef": {"name": one}}),
        _ => json!({"keys": keys.iter().map(|k| json!({"name": k})).collect::<Vec<_>>()}),
    };
    create_dlq(
        client,
        ns,
        "relayer",
        json!({
            "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": STREAM}},
            "source": {"redis": {"list": DEAD}},
            "protection": {"seal": seal, "mask": ["$.holder"]},
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

/// Waits until the queue publishes the first of `recipients` as the one to seal to and counts
/// records for all of them; returns the queue.
async fn published(client: &Client, ns: &str, recipients: &[&str]) -> DeadLetterQueue {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    eventually(30, "the queue to publish its recipients", || async {
        let q = queues.get("relayer").await.ok()?;
        let p = q.status.as_ref()?.protection.as_ref()?;
        let counted = recipients.iter().all(|r| p.records.contains_key(*r));
        (p.recipient.as_deref() == recipients.first().copied() && counted).then_some(q)
    })
    .await
}

/// `status.protection.records` once it equals `want`.
async fn sealed_counts(client: &Client, ns: &str, want: &[(&str, i64)]) {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let want: std::collections::BTreeMap<String, i64> =
        want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    eventually(30, "records per recipient", || async {
        let q = queues.get("relayer").await.ok()?;
        let counts = &q.status.as_ref()?.protection.as_ref()?.records;
        (*counts == want).then_some(())
    })
    .await;
}

fn card_payload(id: &str) -> String {
    format!(r#"{{"id":"{id}","card":"{CARD}","holder":"{HOLDER}"}}"#)
}

/// Parks `id` through `kubectl dlq park` with the card in the payload and a header.
fn park_with_plugin(ns: &str, id: &str) {
    let payload = card_payload(id);
    let header = format!("x-card={CARD}");
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
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

/// Record `r` as etcd stores it, read past the apiserver.
async fn etcd_raw(r: &DeadLetter) -> String {
    let key = format!(
        "/registry/dlq.dev/deadletters/{}/{}",
        r.namespace().unwrap(),
        r.name_any()
    );
    let raw = audited_plane()
        .etcd_value(&key)
        .await
        .unwrap_or_else(|| panic!("etcd has no {key}"));
    String::from_utf8_lossy(&raw).into_owned()
}

/// Asserts the record is sealed to `recipient` and that etcd's raw value holds no card.
async fn assert_sealed_in_etcd(r: &DeadLetter, recipient: &str) {
    let sealed = r.spec.job.sealed.as_ref().expect("the record is sealed");
    assert_eq!(sealed.recipient, recipient);
    assert!(r.spec.job.payload.is_none() && r.spec.job.headers.is_empty());
    let raw = etcd_raw(r).await;
    assert!(
        raw.contains(recipient),
        "etcd's value is this record's: {raw:.300}"
    );
    assert!(
        !raw.contains(CARD),
        "the card number is in etcd: {raw:.600}"
    );
    assert!(!raw.contains(HOLDER), "the payload is in etcd: {raw:.600}");
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
    let payload = card_payload("plain/1").replace(CARD, CONTROL_CARD);
    let req = dlq_client::ParkRequest::new("plain", Job::from_bytes("plain/1", payload.as_bytes()));
    let outcome = dlq_client::park(client.clone(), ns, req).await.unwrap();
    let key = format!(
        "/registry/dlq.dev/deadletters/{ns}/{}",
        outcome.record().name_any()
    );
    let raw = audited_plane().etcd_value(&key).await.unwrap();
    assert!(
        String::from_utf8_lossy(&raw).contains(CONTROL_CARD),
        "a plaintext record's card is readable in etcd"
    );
    eventually(10, "the plaintext card in the audit log", || async {
        audit_log().contains(CONTROL_CARD).then_some(())
    })
    .await;
    // Shown to a human, its card is masked all the same.
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), ns, &["show", "plain/1"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("555555******4444") && !out.contains(CONTROL_CARD),
        "{out}"
    );
}

/// The audited plane's audit log as it is now.
fn audit_log() -> String {
    let path = audited_plane()
        .audit_log
        .as_ref()
        .expect("an audited plane");
    std::fs::read_to_string(path).unwrap_or_default()
}

#[tokio::test]
async fn parked_through_plugin_client_and_source_the_card_is_nowhere_and_redrive_is_exact() {
    let started = std::time::Instant::now();
    let (client, ns) = setup_on(audited_plane(), "seal").await;
    let redis = Redis::start();
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    sealed_queue(&client, &ns, &redis, &["relayer-seal"]).await;
    let op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
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
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "card/plugin"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("sealed (recipient {recipient})")),
        "{out}"
    );
    assert!(!out.contains("4111"), "{out}");
    let audit = audit_log();
    assert!(
        records.iter().all(|r| audit.contains(&r.name_any())),
        "the audit log has the parkings"
    );
    assert!(!audit.contains(CARD), "the card number is in the audit log");
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
    let (client, ns) = setup_on(audited_plane(), "rotate").await;
    let redis = Redis::start();
    let old = identity_secret(&client, &ns, "seal-old").await;
    sealed_queue(&client, &ns, &redis, &["seal-old"]).await;
    let _op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
    published(&client, &ns, &[&old]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park_with_client(&client, &ns, "rot/1").await;
    let first = record_of(&api, "rot/1").await;

    // Rotation with `kubectl dlq seal-key`: a new key first, the old one kept to open older
    // records.
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &["seal-key", "relayer", "--secret", "seal-new"],
    );
    assert!(ok, "kubectl dlq seal-key: {out}{err}");
    let new = recipient_in(&client, &ns, "seal-new").await;
    assert!(out.contains(&new) && out.contains("seal-old"), "{out}");
    assert!(!out.contains("AGE-SECRET-KEY") && !err.contains("AGE-SECRET-KEY"));
    published(&client, &ns, &[&new, &old]).await;
    // Run again, it finds the key first already and changes nothing; an older key, or a Secret
    // it did not make, is not taken.
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &["seal-key", "relayer", "--secret", "seal-new"],
    );
    assert!(ok && out.contains("already seals"), "{out}{err}");
    let (ok, _, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &["seal-key", "relayer", "--secret", "seal-old"],
    );
    assert!(!ok && err.contains("already an older key"), "{err}");
    let (ok, _, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &["seal-key", "relayer", "--secret", "redis"],
    );
    assert!(
        !ok && err.contains("Secret redis already exists and is not a key"),
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

/// A queue `relayer` with no key yet (Redis target), the operator watching it.
async fn unsealed_queue(client: &Client, ns: &str, redis: &Redis) -> Operator {
    create_secret(client, ns, "redis", "url", &redis.url()).await;
    create_dlq(
        client,
        ns,
        "relayer",
        json!({"target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": STREAM}}}),
    )
    .await;
    Operator::start_on(&audited_plane().kubeconfig, ns, &[], &[LOG])
}

/// Writes the queue's status again and again (what the operator does to a new queue, without
/// pause) until `stop`; returns how many writes the apiserver took.
fn status_writes(
    client: &Client,
    ns: &str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut written = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let status = json!({"status": {"http": {"refusedLastMinute": written + 1}}});
            let pp = PatchParams::default();
            if queues
                .patch_status("relayer", &pp, &Patch::Merge(&status))
                .await
                .is_ok()
            {
                written += 1;
            }
        }
        written
    })
}

/// `kubectl dlq seal-key` against the admin kubeconfig, off the test's runtime threads.
async fn seal_key(ns: &str, args: &[&str]) -> (bool, String, String) {
    let ns = ns.to_string();
    let args: Vec<String> = std::iter::once("seal-key")
        .chain(args.iter().copied())
        .map(String::from)
        .collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kubectl_dlq_on(audited_plane(), &ns, &args)
    })
    .await
    .unwrap()
}

/// The names of the queue's keys, in order.
async fn key_names(client: &Client, ns: &str) -> Vec<String> {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let q = queues.get("relayer").await.unwrap();
    let seal = q.spec.protection.and_then(|p| p.seal).unwrap_or_default();
    seal.key_refs().iter().map(|k| k.name.clone()).collect()
}

/// Issue #57 (9): `seal-key`'s change of the queue was guarded by the resourceVersion it read,
/// which the operator's own status writes move: on a new queue about 1 run in 4 failed with a
/// raw 409 and left its Secret behind. Here the queue's status is written without pause while
/// it runs three times (a first key, then two rotations): each run makes its key the queue's.
#[tokio::test]
async fn seal_key_makes_its_key_the_queues_while_the_queues_status_is_written() {
    let (client, ns) = setup_on(audited_plane(), "sealkey-race").await;
    let redis = Redis::start();
    let _op = unsealed_queue(&client, &ns, &redis).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = status_writes(&client, &ns, stop.clone());
    let started = std::time::Instant::now();
    let mut runs = Vec::new();
    for name in ["key-1", "key-2", "key-3"] {
        runs.push((name, seal_key(&ns, &["relayer", "--secret", name]).await));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let written = writer.await.unwrap();
    dlq_testenv::report(&format!(
        "seal-key: 3 runs against {written} status writes in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
    assert!(written >= 3, "the status was written meanwhile: {written}");
    for (name, (ok, out, err)) in &runs {
        assert!(*ok, "seal-key --secret {name}: {out}{err}");
    }
    assert_eq!(key_names(&client, &ns).await, ["key-3", "key-2", "key-1"]);
    let mut recipients = Vec::new();
    for name in ["key-3", "key-2", "key-1"] {
        recipients.push(recipient_in(&client, &ns, name).await);
    }
    let recipients: Vec<&str> = recipients.iter().map(String::as_str).collect();
    published(&client, &ns, &recipients).await;
}

/// Lets `user` read queues and create and read Secrets in `ns`, but not change a queue: a
/// `seal-key` as `user` makes its Secret and then fails.
fn grant_secrets_only(ns: &str, user: &str) {
    let role = format!("secrets-{user}");
    dlq_testenv::chart::apply(
        audited_plane(),
        &[
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": role, "namespace": ns},
             "rules": [
                {"apiGroups": ["dlq.dev"], "resources": ["deadletterqueues"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": role, "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}),
        ],
    );
}

/// Issue #57 (9): a run that failed after making its Secret says so and names it; the command
/// it prints finishes the job with that very Secret (its key, not a new one), where a second
/// run used to be refused because the Secret exists. Run once more, it changes nothing.
#[tokio::test]
async fn seal_key_run_again_after_a_failure_uses_the_secret_it_left() {
    let (client, ns) = setup_on(audited_plane(), "sealkey-again").await;
    let redis = Redis::start();
    let _op = unsealed_queue(&client, &ns, &redis).await;
    grant_secrets_only(&ns, "half");
    // Until the authorizer has the Role, the queue's read or the Secret's create is refused.
    let (ok, out, err) = eventually(
        30,
        "seal-key as half to reach the queue's change",
        || async {
            let run = seal_key(&ns, &["--as", "half", "relayer"]).await;
            run.2.contains("cannot patch resource").then_some(run)
        },
    )
    .await;
    assert!(!ok, "half may not change the queue: {out}{err}");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), &ns);
    let left: Vec<String> = secrets
        .list(&ListParams::default().labels(&format!("{}=relayer", dlq_core::api::LABEL_QUEUE)))
        .await
        .unwrap()
        .items
        .iter()
        .map(|s| s.name_any())
        .collect();
    assert_eq!(left.len(), 1, "one key Secret made: {left:?}");
    let name = &left[0];
    let finish = format!("kubectl dlq seal-key relayer --secret {name}");
    assert!(
        err.contains(&format!("Secret {name} holds the new key")) && err.contains(&finish),
        "the failure names what it left and how to finish: {err}"
    );
    assert!(key_names(&client, &ns).await.is_empty());

    let recipient = recipient_in(&client, &ns, name).await;
    let (ok, out, err) = seal_key(&ns, &["relayer", "--secret", name]).await;
    assert!(ok, "the run again finishes: {out}{err}");
    assert!(
        out.contains(&recipient),
        "its own key, not a new one: {out}"
    );
    assert_eq!(key_names(&client, &ns).await, [name.as_str()]);
    published(&client, &ns, &[&recipient]).await;
    let (ok, out, err) = seal_key(&ns, &["relayer", "--secret", name]).await;
    assert!(ok && out.contains("already seals"), "{out}{err}");
    assert_eq!(key_names(&client, &ns).await, [name.as_str()]);
}

#[tokio::test]
async fn a_record_whose_key_is_gone_is_refused_and_stays_parked() {
    let (client, ns) = setup_on(audited_plane(), "lostkey").await;
    let redis = Redis::start();
    let lost = identity_secret(&client, &ns, "seal-lost").await;
    sealed_queue(&client, &ns, &redis, &["seal-lost"]).await;
    let _op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
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
    let keys = json!({"spec": {"protection": {"seal": {"identitySecretRef": null, "keys": [{"name": "seal-fresh"}, {"name": "seal-lost"}]}}}});
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
    let (client, ns) = setup_on(audited_plane(), "nokey").await;
    let redis = Redis::start();
    // The Secret named by the queue does not exist: no recipient is ever published.
    sealed_queue(&client, &ns, &redis, &["seal-missing"]).await;
    let _op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(30, "the queue's first status", || async {
        queues.get("relayer").await.ok()?.status?.protection
    })
    .await;
    let payload = card_payload("nokey/1");
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
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

/// The record's payload through the apiserver as `user`: the object, or the refusal's code.
async fn reveal_as(
    user: &str,
    ns: &str,
    name: &str,
    unmasked: bool,
) -> Result<serde_json::Value, u16> {
    let client = audited_plane()
        .client_as(user, &["system:authenticated"])
        .await;
    let mut path =
        format!("/apis/payloads.dlq.dev/v1alpha1/namespaces/{ns}/deadletterpayloads/{name}");
    if unmasked {
        path.push_str("/unmasked");
    }
    let request = axum::http::Request::get(path).body(Vec::new()).unwrap();
    match client.request::<serde_json::Value>(request).await {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(status)) => Err(status.code),
        Err(e) => panic!("reveal as {user}: {e}"),
    }
}

/// A request straight to the operator's reveal port with curl (no apiserver in between),
/// with the front proxy's certificate or none: (HTTP status, body).
fn straight_to_operator(port: u16, path: &str, front_proxy: bool, user: &str) -> (u16, String) {
    let pki = audited_plane().dir.join("pki");
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sk", "-w", "\n%{http_code}", "-H"])
        .arg(format!("X-Remote-User: {user}"))
        .arg("-H")
        .arg("X-Remote-Group: system:authenticated");
    if front_proxy {
        cmd.arg("--cert")
            .arg(pki.join("front-proxy-client.crt"))
            .arg("--key")
            .arg(pki.join("front-proxy-client.key"));
    }
    let out = cmd
        .arg(format!("https://127.0.0.1:{port}{path}"))
        .output()
        .expect("curl runs");
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Grants `user` the reveal of payloads in `ns`, with the unmasked view or without.
fn grant_reveal(ns: &str, user: &str, unmasked: bool) {
    let mut resources = vec!["deadletterpayloads"];
    if unmasked {
        resources.push("deadletterpayloads/unmasked");
    }
    let role = format!("reveal-{user}");
    dlq_testenv::chart::apply(
        audited_plane(),
        &[
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": role, "namespace": ns},
             "rules": [{"apiGroups": ["payloads.dlq.dev"], "resources": resources, "verbs": ["get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": role, "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}),
        ],
    );
}

/// Lets `user` read records, queues and Events in `ns` (what dlq-viewer grants), nothing more.
fn grant_viewing(ns: &str, user: &str) {
    let role = format!("view-{user}");
    dlq_testenv::chart::apply(
        audited_plane(),
        &[
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": role, "namespace": ns},
             "rules": [
                {"apiGroups": ["dlq.dev"], "resources": ["deadletters", "deadletterqueues"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["get", "list"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": role, "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}),
        ],
    );
}

/// `kubectl dlq ui` as the admin, in headless Chromium: a sealed record's page shows the
/// payload sealed and a Reveal button; clicking it shows the payload through the reveal API,
/// masked (a screenshot `reveal.png` in target/ui-screenshots); bob's page (who may read records
/// but not reveal them) shows the refusal naming the role.
async fn page_reveals(ns: &str, name: &str) {
    let ui = dlq_testenv::ui_page::UiPage::start(audited_plane(), ns, None);
    let b = dlq_testenv::browser::Browser::start("seal-reveal").await;
    b.client.goto(&ui.url).await.expect("the page's URL");
    b.client
        .goto(&format!("{}/r/{ns}/{name}", ui.base()))
        .await
        .expect("the record's page");
    let sealed = b.text("#payload").await;
    assert!(sealed.contains("sealed (recipient"), "{sealed}");
    b.click("#reveal").await;
    let shown = b.text("#revealed-payload").await;
    let headers = b.text("#revealed-headers").await;
    b.screenshot("reveal").await;
    drop(ui);
    // bob may read records but not reveal them: his page says which role he lacks.
    let bobs = dlq_testenv::ui_page::UiPage::start(audited_plane(), ns, Some("bob"));
    b.client.goto(&bobs.url).await.expect("bob's page's URL");
    b.client
        .goto(&format!("{}/r/{ns}/{name}", bobs.base()))
        .await
        .expect("the record's page, as bob");
    b.click("#reveal").await;
    let refused = b.text("#reveal-refused").await;
    let bobs_payload = b.text("#payload").await;
    b.stop().await;
    drop(bobs);
    assert!(refused.contains("dlq-payload-reader"), "{refused}");
    assert!(
        !refused.contains("4012") && !bobs_payload.contains("4012"),
        "{refused} {bobs_payload}"
    );
    assert!(
        shown.contains("401288******1881") && !shown.contains(REVEAL_CARD),
        "what Reveal shows: {shown}"
    );
    assert!(headers.contains("401288******1881"), "{headers}");
}

#[tokio::test]
async fn a_reveal_needs_the_role_is_masked_unless_asked_and_is_audited_and_announced() {
    let (client, ns) = setup_on(audited_plane(), "reveal").await;
    let redis = Redis::start();
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    sealed_queue(&client, &ns, &redis, &["relayer-seal"]).await;
    let (tls_dir, ca_pem) = reveal_certificate(&ns);
    let port = dlq_testenv::plane::free_port().unwrap();
    let op = Operator::start_on(
        &audited_plane().kubeconfig,
        &ns,
        &[
            &format!("--reveal-addr=127.0.0.1:{port}"),
            &format!("--reveal-tls-dir={}", tls_dir.display()),
        ],
        &[LOG],
    );
    register_reveal_api(&client, &ns, port, &ca_pem).await;
    published(&client, &ns, &[&recipient]).await;
    let mut job = Job::from_bytes(
        "reveal/1",
        card_payload("reveal/1")
            .replace(CARD, REVEAL_CARD)
            .as_bytes(),
    );
    job.headers.insert("x-card".into(), REVEAL_CARD.into());
    let parked = dlq_client::park(
        client.clone(),
        &ns,
        dlq_client::ParkRequest::new("relayer", job),
    )
    .await
    .unwrap();
    let name = parked.record().name_any();

    // Without the role the apiserver refuses; the operator refuses too when asked directly.
    assert_eq!(reveal_as("bob", &ns, &name, false).await, Err(403));
    let path = format!("/apis/payloads.dlq.dev/v1alpha1/namespaces/{ns}/deadletterpayloads/{name}");
    let (code, body) = straight_to_operator(port, &path, false, "admin");
    assert_eq!(code, 401, "no front-proxy certificate: {body}");
    let (code, body) = straight_to_operator(port, &path, true, "bob");
    assert_eq!(code, 403, "the operator's own SubjectAccessReview: {body}");
    assert!(!body.contains(REVEAL_CARD));

    // With it: masked, and unmasked only with the subresource.
    grant_reveal(&ns, "alice", false);
    let masked = eventually(10, "alice's reveal", || async {
        reveal_as("alice", &ns, &name, false).await.ok()
    })
    .await;
    assert_eq!(masked["kind"], "DeadLetterPayload");
    assert_eq!(masked["sealedTo"], recipient.as_str());
    let shown = masked.to_string();
    assert!(
        shown.contains("401288******1881") && !shown.contains(REVEAL_CARD),
        "{shown}"
    );
    assert!(shown.contains("****"), "the queue's mask paths: {shown}");
    assert_eq!(reveal_as("alice", &ns, &name, true).await, Err(403));
    grant_reveal(&ns, "carol", true);
    let exact = eventually(10, "carol's unmasked reveal", || async {
        reveal_as("carol", &ns, &name, true).await.ok()
    })
    .await;
    assert_eq!(
        exact["payload"],
        card_payload("reveal/1").replace(CARD, REVEAL_CARD)
    );
    assert_eq!(exact["headers"]["x-card"], REVEAL_CARD);

    // kubectl reads it like any resource.
    let out = audited_plane()
        .kubectl()
        .args(["get", "deadletterpayload", "-n", &ns, &name, "-o", "yaml"])
        .output()
        .unwrap();
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(
        yaml.contains("401288******1881"),
        "{yaml}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `kubectl dlq show --reveal` goes through the same API, as its user (admin here).
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "reveal/1", "--reveal"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("401288******1881") && !out.contains(REVEAL_CARD),
        "{out}"
    );
    assert!(!out.contains("sealed (recipient"), "{out}");
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &["show", "reveal/1", "--reveal", "--unmasked"],
    );
    assert!(ok, "{err}");
    assert!(out.contains(&format!("x-card={REVEAL_CARD}")), "{out}");
    let (ok, _, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "reveal/1", "--unmasked"]);
    assert!(!ok && err.contains("--reveal"), "--unmasked alone: {err}");

    // Who may read records but not reveal them hears which role is missing.
    grant_viewing(&ns, "bob");
    let refused = eventually(10, "bob's refusal", || async {
        let (ok, out, err) = kubectl_dlq_on(
            audited_plane(),
            &ns,
            &["--as", "bob", "show", "reveal/1", "--reveal"],
        );
        (!ok && err.contains("dlq-payload-reader")).then_some(format!("{out}{err}"))
    })
    .await;
    assert!(!refused.contains("4012"), "{refused}");
    page_reveals(&ns, &name).await;

    // Every reveal: an Event naming the user, a line in the apiserver's audit log.
    let notes = eventually(10, "PayloadRevealed Events", || async {
        let notes = event_notes(&client, &ns).await;
        (notes
            .iter()
            .any(|n| n.contains("revealed to alice (masked)"))
            && notes
                .iter()
                .any(|n| n.contains("revealed to carol (unmasked)")))
        .then_some(notes)
    })
    .await;
    assert!(!notes.iter().any(|n| n.contains(REVEAL_CARD)), "{notes:?}");
    let audit = audit_log();
    let reveals: Vec<serde_json::Value> = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            e["objectRef"]["resource"] == "deadletterpayloads"
                && e["objectRef"]["name"] == name.as_str()
        })
        .collect();
    let by = |user: &str, code: i64| {
        reveals.iter().any(|e| {
            e["user"]["username"] == "admin"
                && e["impersonatedUser"]["username"] == user
                && e["responseStatus"]["code"] == code
        })
    };
    assert!(
        by("alice", 200) && by("bob", 403) && by("carol", 200),
        "audit: {reveals:#?}"
    );
    assert!(
        !op.logs().contains(REVEAL_CARD),
        "the card is in the operator's log"
    );
    revealing_a_damaged_record_is_a_conflict_naming_it(&client, &ns, &name, port).await;
    if std::env::var_os("DLQ_REVEAL_SHOW").is_some() {
        let record = audited_plane()
            .kubectl()
            .args(["get", "dl", "-n", &ns, &name, "-o", "yaml"])
            .output()
            .unwrap();
        eprintln!("{}\n---\n{yaml}", String::from_utf8_lossy(&record.stdout));
    }
    let _ = std::fs::remove_dir_all(tls_dir);
}

/// Issue 45 item 15: a record whose ciphertext was damaged (a copy of record `name` with one
/// byte of its age file flipped) cannot be opened: the reveal answers 409 naming the record,
/// not 500, and a Warning Event `RevealFailed` on it says who asked and why.
async fn revealing_a_damaged_record_is_a_conflict_naming_it(
    client: &Client,
    ns: &str,
    name: &str,
    port: u16,
) {
    use base64::Engine;
    let engine = base64::engine::general_purpose::STANDARD;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let original = api.get(name).await.unwrap();
    let mut spec = original.spec.clone();
    spec.job.id = "damaged/1".into();
    let sealed = spec.job.sealed.as_mut().expect("a sealed record");
    let mut bytes = engine.decode(&sealed.ciphertext).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    sealed.ciphertext = engine.encode(bytes);
    let damaged = DeadLetter::new("damaged-1", spec);
    api.create(&Default::default(), &damaged).await.unwrap();

    assert_eq!(reveal_as("carol", ns, "damaged-1", false).await, Err(409));
    let path =
        format!("/apis/payloads.dlq.dev/v1alpha1/namespaces/{ns}/deadletterpayloads/damaged-1");
    let (code, body) = straight_to_operator(port, &path, true, "carol");
    assert_eq!(code, 409, "{body}");
    assert!(
        body.contains(&format!(
            "deadletter damaged-1 in namespace {ns} cannot be opened"
        )),
        "{body}"
    );
    let notes = eventually(10, "the RevealFailed Event", || async {
        let events: Api<Event> = Api::namespaced(client.clone(), ns);
        let lp = ListParams::default().fields("regarding.name=damaged-1");
        let list = events.list(&lp).await.ok()?;
        let failed: Vec<String> = list
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("RevealFailed"))
            .filter_map(|e| e.note)
            .collect();
        (!failed.is_empty()).then_some(failed)
    })
    .await;
    assert!(
        notes
            .iter()
            .any(|n| n.contains("could not be revealed to carol") && n.contains("does not open")),
        "{notes:?}"
    );
}

/// Every Event's note about record `name`.
async fn notes_about(client: &Client, ns: &str, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().fields(&format!("regarding.name={name}"));
    let list = events.list(&lp).await.unwrap();
    list.items.into_iter().filter_map(|e| e.note).collect()
}

/// Asserts etcd's raw value of record `r` holds no card number.
async fn no_card_in_etcd(r: &DeadLetter) {
    let raw = etcd_raw(r).await;
    assert!(raw.contains(&r.name_any()), "etcd's value is this record's");
    assert!(
        !raw.contains(CARD),
        "the card number is in etcd: {raw:.900}"
    );
}

/// Issue 45 item 6: a dead-list element whose header value is a JSON number (a card number)
/// is no envelope. On a sealed queue its Invalid record says what was wrong without quoting the
/// number, in etcd and in the `Parked` Event; its exact bytes are sealed and redrive them.
#[tokio::test]
async fn an_envelope_that_is_not_one_is_parked_sealed_and_its_reason_quotes_no_card() {
    let (client, ns) = setup_on(audited_plane(), "seal-invalid").await;
    let redis = Redis::start();
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    sealed_queue(&client, &ns, &redis, &["relayer-seal"]).await;
    let op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
    published(&client, &ns, &[&recipient]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let raw = format!(r#"{{"id":"inv/1","payload":"p","headers":{{"x-card":{CARD}}}}}"#);
    let mut c = redis.conn().await;
    let _: i64 = redis::cmd("LPUSH")
        .arg(DEAD)
        .arg(&raw)
        .query_async(&mut c)
        .await
        .unwrap();
    let r = eventually(30, "the Invalid record", || async {
        let list = api.list(&ListParams::default()).await.ok()?;
        list.items
            .into_iter()
            .find(|r| r.spec.failure_kind == dlq_core::api::FailureKind::Invalid)
    })
    .await;
    assert_eq!(
        r.spec.reason,
        "not a dead-letter envelope: a value of the wrong type (expected a string)"
    );
    assert_sealed_in_etcd(&r, &recipient).await;
    wait_phase(&api, &r.name_any(), Phase::Parked, 30).await;
    let notes = eventually(30, "the Parked Event", || async {
        let notes = notes_about(&client, &ns, &r.name_any()).await;
        (!notes.is_empty()).then_some(notes)
    })
    .await;
    assert!(!notes.iter().any(|n| n.contains(CARD)), "{notes:?}");
    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let mut c = redis.conn().await;
    let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
        .arg(STREAM)
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        entries
            .iter()
            .any(|(_, f)| f.contains(&(b"payload".to_vec(), raw.clone().into_bytes()))),
        "the exact bytes redriven: {entries:?}"
    );
    assert!(
        !op.logs().contains(CARD),
        "the card is in the operator's log"
    );
}

/// Issue 44: the HTTP park endpoint seals like every parker. A plain body and its headers (a
/// card in both, and in the sender's reason), and a structured CloudEvent that is not one (a
/// card where its id's string belongs): no card number in etcd or the records' Events; the
/// redrive posts the exact body and header.
#[tokio::test]
async fn parked_through_the_http_endpoint_the_card_is_nowhere_and_redrive_is_exact() {
    use rcgen::{CertificateParams, KeyPair};
    let (client, ns) = setup_on(audited_plane(), "seal-http").await;
    let sink = dlq_testenv::brokers::HttpSink::start(None);
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "target": {"http": {"url": sink.url("/settle")}},
            "http": {"allowAnonymous": true},
            "protection": {"seal": {"identitySecretRef": {"name": "relayer-seal"}}},
        }),
    )
    .await;
    let dir = std::env::temp_dir().join(format!("dlq-seal-http-{}-{ns}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    let port = dlq_testenv::plane::free_port().unwrap();
    let base = format!("https://127.0.0.1:{port}");
    let op = Operator::start_on(
        &audited_plane().kubeconfig,
        &ns,
        &[
            &format!("--park-addr=127.0.0.1:{port}"),
            &format!("--park-tls-dir={}", dir.display()),
            &format!("--park-url={base}"),
            "--park-anonymous-from=127.0.0.0/8",
        ],
        &[LOG],
    );
    published(&client, &ns, &[&recipient]).await;
    let url = format!("{base}{}", dlq_core::api::park_path(&ns, "relayer"));
    let payload = card_payload("http/1");
    let reason = format!("card {CARD} declined");
    let x_card = format!("x-card: {CARD}");
    let post = |headers: Vec<String>, body: String| {
        let mut cmd = std::process::Command::new("curl");
        cmd.args([
            "-sk",
            "-w",
            "\n%{http_code}",
            "-X",
            "POST",
            "--data-binary",
            "@-",
        ]);
        for h in &headers {
            cmd.arg("-H").arg(h);
        }
        let mut child = cmd
            .arg(&url)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("curl runs");
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(body.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse::<u16>().unwrap_or(0), body.to_string())
    };
    let plain = vec![
        "content-type: application/json".to_string(),
        x_card.clone(),
        "x-dlq-job-id: http/1".to_string(),
        format!("x-dlq-reason: {reason}"),
    ];
    let (code, body) = eventually(30, "the endpoint to park", || async {
        let (code, body) = post(plain.clone(), payload.clone());
        (code != 503 && code != 404 && code != 0).then_some((code, body))
    })
    .await;
    assert_eq!(code, 201, "{body}");
    assert!(!body.contains(CARD), "the answer quotes the card: {body}");
    let not_an_event = format!(r#"{{"specversion":"1.0","id":{CARD},"source":"/t","type":"t"}}"#);
    let (code, body) = post(
        vec!["content-type: application/cloudevents+json".to_string()],
        not_an_event.clone(),
    );
    assert_eq!(code, 201, "an Invalid record of it: {body}");
    assert!(!body.contains(CARD), "the answer quotes the card: {body}");

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let r = record_of(&api, "http/1").await;
    assert_sealed_in_etcd(&r, &recipient).await;
    assert_eq!(r.spec.reason, "card 411111******1111 declined");
    let invalid = eventually(30, "the Invalid record", || async {
        let list = api.list(&ListParams::default()).await.ok()?;
        list.items
            .into_iter()
            .find(|r| r.spec.failure_kind == dlq_core::api::FailureKind::Invalid)
    })
    .await;
    assert!(
        invalid.spec.job.sealed.is_some(),
        "the Invalid record is sealed"
    );
    no_card_in_etcd(&invalid).await;
    for name in [r.name_any(), invalid.name_any()] {
        wait_phase(&api, &name, Phase::Parked, 30).await;
        let notes = eventually(30, "the Parked Event", || async {
            let notes = notes_about(&client, &ns, &name).await;
            (!notes.is_empty()).then_some(notes)
        })
        .await;
        assert!(!notes.iter().any(|n| n.contains(CARD)), "{notes:?}");
    }

    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 30).await;
    let posted = eventually(30, "the redrive's POST", || async {
        sink.posts().into_iter().next()
    })
    .await;
    assert_eq!(posted.body, payload.as_bytes(), "the exact body");
    assert_eq!(posted.header("x-card"), Some(CARD), "{:?}", posted.headers);
    assert!(
        !op.logs().contains(CARD),
        "the card is in the operator's log"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 44: the Sidekiq source seals like every parker. A real Sidekiq kills a job whose
/// argument holds a card (its error message quotes it): no card number in etcd or the record's
/// Events, and after the redrive the same Sidekiq fetches the dead job's JSON byte for byte.
#[tokio::test]
async fn parked_from_sidekiqs_dead_set_the_card_is_nowhere_and_redrive_is_exact() {
    use dlq_testenv::brokers::Sidekiq;
    let (client, ns) = setup_on(audited_plane(), "seal-sidekiq").await;
    let redis = Redis::start();
    let recipient = identity_secret(&client, &ns, "relayer-seal").await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({
            "target": {"sidekiq": {"urlSecretRef": {"name": "redis", "key": "url"}}},
            "source": {"sidekiq": {}},
            "protection": {"seal": {"identitySecretRef": {"name": "relayer-seal"}}},
        }),
    )
    .await;
    let _sidekiq = Sidekiq::start(&redis.url(), 1).await;
    let jids = Sidekiq::enqueue(&redis.url(), 1, &format!("card-{CARD}"));
    let mut c = redis.conn().await;
    let dead: Vec<u8> = eventually(30, "the job in the dead set", || {
        let mut c = c.clone();
        async move {
            let members: Vec<Vec<u8>> = redis::cmd("ZRANGE")
                .arg("dead")
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .ok()?;
            members.into_iter().next()
        }
    })
    .await;
    assert!(
        String::from_utf8_lossy(&dead).contains(CARD),
        "the control: the dead job holds the card"
    );

    let op = Operator::start_on(&audited_plane().kubeconfig, &ns, &[], &[LOG]);
    published(&client, &ns, &[&recipient]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let r = record_of(&api, &jids[0]).await;
    assert_sealed_in_etcd(&r, &recipient).await;
    assert!(
        r.spec
            .reason
            .starts_with("GatewayError: gateway said no to card-411111******1111"),
        "{}",
        r.spec.reason
    );
    wait_phase(&api, &r.name_any(), Phase::Parked, 30).await;
    let notes = eventually(30, "the Parked Event", || async {
        let notes = notes_about(&client, &ns, &r.name_any()).await;
        (!notes.is_empty()).then_some(notes)
    })
    .await;
    assert!(!notes.iter().any(|n| n.contains(CARD)), "{notes:?}");

    let _: () = redis::cmd("SET")
        .arg("test:flag")
        .arg("1")
        .query_async(&mut c)
        .await
        .unwrap();
    decide(&api, &r.name_any(), Action::Redrive, "ops").await;
    wait_phase(&api, &r.name_any(), Phase::Redriven, 60).await;
    let received: Vec<Vec<u8>> = eventually(30, "Sidekiq fetches the redriven job", || {
        let mut c = c.clone();
        async move {
            let got: Vec<Vec<u8>> = redis::cmd("LRANGE")
                .arg("test:received")
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .ok()?;
            (got.len() >= 2).then_some(got)
        }
    })
    .await;
    assert_eq!(received[1], dead, "the dead job's JSON, byte for byte");
    assert!(
        !op.logs().contains(CARD),
        "the card is in the operator's log"
    );
}
