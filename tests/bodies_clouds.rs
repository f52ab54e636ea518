//! The body store's GCS and Azure backends (issue 48) against real emulators, started by the
//! test like every other server: fake-gcs-server (built from its Go module by tools/build.sh)
//! and Azurite's blob service (from the npm registry, `npm ci` by tools/build.sh). The operator
//! reaches them the way a user would configure it: the GCS queue's Secret `serviceAccountKey` is
//! a key JSON with `gcs_base_url` and `disable_oauth` (no CRD field for an endpoint); the Azure
//! queue's Secret `accessKey` is the emulator account's key, and the operator's environment has
//! object_store's emulator settings (`AZURE_STORAGE_USE_EMULATOR`, `AZURITE_BLOB_STORAGE_URL`).
//!
//! For each: a 1 MiB dead message from Redis is parked with `spec.job.body` and its object is in
//! the emulator under `<prefix>sha256/<hex>` (read back through the emulator's own API, not the
//! operator's client); it is redriven byte-exact to the Redis list target; a second record whose
//! object is deleted by hand is refused with `BodyMissing` and stays Parked; and the sweep
//! (list + delete through the operator's client) takes an orphan and keeps what records name.
//! On Azurite also a sealing queue's 9 MiB body, over one part: sealed in blocks, staged and
//! copied to its key, redriven byte-exact (fake-gcs-server has no multipart upload).

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_core::park::record_name;
use dlq_testenv::brokers::Redis;
use dlq_testenv::brokers::azurite::{self, AzuriteServer};
use dlq_testenv::brokers::gcs::GcsServer;
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, eventually, report, setup, wait_phase,
};
use kube::Client;
use kube::api::Api;
use redis::AsyncCommands;
use serde_json::{Value, json};

const BUCKET: &str = "dlq-bodies";
const PREFIX: &str = "payments/";
const DEAD: &str = "relayer:dead";
const JOBS: &str = "relayer:jobs";

/// The emulator under test, with the same helpers for either.
enum Emulator {
    Gcs(GcsServer),
    Azure(AzuriteServer),
}

impl Emulator {
    async fn get(&self, key: &str) -> Option<Vec<u8>> {
        match self {
            Emulator::Gcs(s) => s.get_object(BUCKET, key).await,
            Emulator::Azure(s) => s.get_object(BUCKET, key).await,
        }
    }

    async fn put(&self, key: &str, bytes: Vec<u8>) {
        match self {
            Emulator::Gcs(s) => s.put_object(BUCKET, key, bytes).await,
            Emulator::Azure(s) => s.put_object(BUCKET, key, bytes).await,
        }
    }

    async fn delete(&self, key: &str) {
        match self {
            Emulator::Gcs(s) => s.delete_object(BUCKET, key).await,
            Emulator::Azure(s) => s.delete_object(BUCKET, key).await,
        }
    }

    /// The keys under [`PREFIX`].
    async fn keys(&self) -> Vec<String> {
        match self {
            Emulator::Gcs(s) => s.list_keys(BUCKET, PREFIX).await,
            Emulator::Azure(s) => s.list_keys(BUCKET, PREFIX).await,
        }
    }

    /// The reference a record holds for `key`.
    fn reference(&self, key: &str) -> String {
        match self {
            Emulator::Gcs(_) => format!("gs://{BUCKET}/{key}"),
            Emulator::Azure(_) => format!("azure://{}/{BUCKET}/{key}", azurite::ACCOUNT),
        }
    }

    /// `spec.bodies.<store>` and the Secret's data it names.
    fn store_spec(&self) -> (Value, Value) {
        let secret = json!({"name": "store"});
        match self {
            Emulator::Gcs(s) => (
                json!({"gcs": {"bucket": BUCKET, "prefix": PREFIX, "credentialsSecretRef": secret}}),
                json!({"serviceAccountKey": s.service_account_key()}),
            ),
            Emulator::Azure(_) => (
                json!({"azure": {"account": azurite::ACCOUNT, "container": BUCKET,
                                 "prefix": PREFIX, "credentialsSecretRef": secret}}),
                json!({"accessKey": azurite::ACCOUNT_KEY}),
            ),
        }
    }

    /// What the operator's environment needs to reach it.
    fn operator_env(&self) -> Vec<(&'static str, String)> {
        match self {
            Emulator::Gcs(_) => Vec::new(),
            Emulator::Azure(s) => s.operator_env(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Emulator::Gcs(_) => "fake-gcs-server",
            Emulator::Azure(_) => "Azurite",
        }
    }
}

/// Bytes that are not UTF-8 (so the envelope carries them as base64) and differ per `seed`.
fn body(seed: u8, len: usize) -> Vec<u8> {
    dlq_testenv::fixtures::noise(seed, len)
}

fn sha256(bytes: &[u8]) -> String {
    dlq_core::body::sha256_hex(bytes)
}

fn key_of(bytes: &[u8]) -> String {
    format!("{PREFIX}sha256/{}", sha256(bytes))
}

async fn push(redis: &Redis, id: &str, payload: &[u8]) {
    push_onto(redis, DEAD, id, payload).await;
}

async fn push_onto(redis: &Redis, list: &str, id: &str, payload: &[u8]) {
    use base64::Engine;
    let envelope = json!({
        "id": id,
        "payloadBase64": base64::engine::general_purpose::STANDARD.encode(payload),
        "reason": "consumer gave up",
    });
    let mut conn = redis.conn().await;
    let _: () = conn.lpush(list, envelope.to_string()).await.unwrap();
}

async fn parked(api: &Api<DeadLetter>, id: &str) -> DeadLetter {
    parked_in(api, "relayer", id).await
}

async fn parked_in(api: &Api<DeadLetter>, queue: &str, id: &str) -> DeadLetter {
    let name = record_name(queue, id, 1);
    eventually(30, &format!("record of {id}"), || async {
        api.get_opt(&name).await.ok().flatten()
    })
    .await
}

/// Queue `relayer`: Redis dead-list source and list target, bodies above 64 KiB in `store`.
async fn queue(client: &Client, ns: &str, redis: &Redis, store: &Emulator) {
    create_secret(client, ns, "redis", "url", &redis.url()).await;
    let (bodies, data) = store.store_spec();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), ns);
    let creds =
        serde_json::from_value(json!({"metadata": {"name": "store"}, "stringData": data})).unwrap();
    secrets
        .create(&Default::default(), &creds)
        .await
        .expect("the store's credentials Secret");
    let mut spec_bodies = json!({"thresholdBytes": 65536, "orphansAfter": "10s"});
    spec_bodies
        .as_object_mut()
        .unwrap()
        .extend(bodies.as_object().unwrap().clone());
    let spec = json!({
        "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "list": JOBS}},
        "source": {"redis": {"list": DEAD}},
        "bodies": spec_bodies,
    });
    create_dlq(client, ns, "relayer", spec).await;
}

/// Park, redrive byte-exact, `BodyMissing` for an object deleted by hand, and the sweep, against
/// `store` (its bucket or container made already).
async fn park_and_redrive(store: Emulator, ns_prefix: &str, sealed_over_a_part: bool) {
    let started = std::time::Instant::now();
    let redis = Redis::start();
    // An object under the prefix that no record names, there before the operator starts: the
    // sweep (its list and delete through the operator's client) takes it once 10 s old.
    let orphan = body(9, 70_000);
    store.put(&key_of(&orphan), orphan.clone()).await;
    let (client, ns) = setup(ns_prefix).await;
    queue(&client, &ns, &redis, &store).await;
    let env = store.operator_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let op = Operator::start_with(&ns, &["--body-sweep-seconds=2"], &env);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let big = body(1, 1 << 20);
    let other = body(2, 200_000);
    push(&redis, "big", &big).await;
    push(&redis, "other", &other).await;
    let record = parked(&api, "big").await;
    let reference = record.spec.job.body.as_deref().expect("a body reference");
    let key = key_of(&big);
    assert_eq!(reference.size, big.len() as i64);
    assert_eq!(reference.sha256, sha256(&big));
    assert_eq!(reference.reference, store.reference(&key));
    assert!(record.spec.job.payload.is_none() && record.spec.job.payload_base64.is_none());
    assert_eq!(
        store.get(&key).await.as_deref(),
        Some(&big[..]),
        "the 1 MiB body in {}, byte-exact",
        store.name()
    );

    // Redriven: the exact bytes on the target.
    let big_name = record_name("relayer", "big", 1);
    decide(&api, &big_name, Action::Redrive, "ada").await;
    wait_phase(&api, &big_name, Phase::Redriven, 30).await;
    eventually(30, "the 1 MiB job on the target, byte-exact", || async {
        redis.list(JOBS).await.contains(&big).then_some(())
    })
    .await;

    // Deleted by hand: refused, nothing sent, the record stays Parked.
    parked(&api, "other").await;
    let other_key = key_of(&other);
    assert!(store.get(&other_key).await.is_some());
    store.delete(&other_key).await;
    assert_eq!(store.get(&other_key).await, None);
    let other_name = record_name("relayer", "other", 1);
    decide(&api, &other_name, Action::Redrive, "ada").await;
    eventually(30, "Requeued=False BodyMissing", || async {
        let r = api.get(&other_name).await.ok()?;
        let (status, why, _) = condition(&r, "Requeued")?;
        (status == "False" && why == "BodyMissing" && r.phase() == Phase::Parked).then_some(())
    })
    .await;
    assert!(
        !redis.list(JOBS).await.contains(&other),
        "nothing of a missing body is sent"
    );

    // The sweep: the orphan goes, the redriven record's body stays (its record lives).
    let orphan_key = key_of(&orphan);
    eventually(30, "the orphan swept", || async {
        let keys = store.keys().await;
        (!keys.contains(&orphan_key)).then_some(keys)
    })
    .await;
    assert_eq!(store.keys().await, vec![key.clone()]);
    if sealed_over_a_part {
        sealed_body_over_a_part(&client, &ns, &redis, &store, &api).await;
    }
    assert!(
        !op.logs().contains(azurite::ACCOUNT_KEY),
        "no credentials in the log"
    );
    report(&format!(
        "bodies_clouds: {} park, redrive, BodyMissing and sweep in {:.1}s",
        store.name(),
        started.elapsed().as_secs_f64()
    ));
}

/// A sealing queue's body over one part (8 MiB) on the same store: sealed on its way up in
/// parts, staged and copied to the key of its ciphertext's digest (the emulator's block upload
/// and copy), nothing left staged; the object is ciphertext, and a redrive opens it as it
/// streams back and sends the exact bytes. It shares the place of `relayer`'s bodies, whose
/// sweep leaves it be.
async fn sealed_body_over_a_part(
    client: &Client,
    ns: &str,
    redis: &Redis,
    store: &Emulator,
    api: &Api<DeadLetter>,
) {
    let (identity, recipient) = dlq_core::seal::generate_identity();
    create_secret(client, ns, "seal", "identity", &identity).await;
    let (bodies, _) = store.store_spec();
    let mut spec_bodies =
        json!({"thresholdBytes": 65536, "maxBytes": 16 << 20, "orphansAfter": "10s"});
    spec_bodies
        .as_object_mut()
        .unwrap()
        .extend(bodies.as_object().unwrap().clone());
    let spec = json!({
        "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "list": "sealed:jobs"}},
        "source": {"redis": {"list": "sealed:dead"}},
        "bodies": spec_bodies,
        "protection": {"seal": {"identitySecretRef": {"name": "seal"}}},
    });
    create_dlq(client, ns, "sealed", spec).await;
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    eventually(30, "the sealing queue's recipient published", || async {
        let q = queues.get("sealed").await.ok()?;
        (q.seal_recipient() == Some(recipient.as_str())).then_some(())
    })
    .await;

    let large = body(5, (9 << 20) + 7);
    push_onto(redis, "sealed:dead", "large", &large).await;
    let record = parked_in(api, "sealed", "large").await;
    let reference = record.spec.job.body.as_deref().expect("a body reference");
    assert_eq!(reference.recipient.as_deref(), Some(recipient.as_str()));
    let key = format!("{PREFIX}sha256/{}", reference.sha256);
    let sealed = store.get(&key).await.expect("the sealed object");
    assert_eq!(sealed.len() as i64, reference.size);
    assert_eq!(sha256(&sealed), reference.sha256);
    assert!(
        !sealed.windows(64).any(|w| w == &large[..64]),
        "ciphertext only"
    );
    let keys = store.keys().await;
    assert!(
        keys.iter()
            .all(|k| k.starts_with(&format!("{PREFIX}sha256/"))),
        "nothing left staged: {keys:?}"
    );

    let name = record_name("sealed", "large", 1);
    decide(api, &name, Action::Redrive, "ada").await;
    wait_phase(api, &name, Phase::Redriven, 60).await;
    eventually(
        30,
        "the 9 MiB job on the target, opened, byte-exact",
        || async {
            redis
                .list("sealed:jobs")
                .await
                .contains(&large)
                .then_some(())
        },
    )
    .await;

    // Two queues keep bodies in one place: one sweep serves both, with both queues' records.
    // An orphan put now is swept once 10 s old; by then the sealed object is older still, and
    // stays (a sweep of `relayer`'s records alone would take it).
    let orphan = body(6, 70_000);
    let orphan_key = key_of(&orphan);
    store.put(&orphan_key, orphan).await;
    let put = std::time::Instant::now();
    eventually(40, "the shared place's orphan swept", || async {
        (!store.keys().await.contains(&orphan_key)).then_some(())
    })
    .await;
    // Ages are whole seconds of the store's Last-Modified: 10 of them can be 9 s and a bit.
    assert!(put.elapsed().as_secs() >= 9, "swept once 10 s old");
    assert!(
        store.get(&key).await.is_some(),
        "the sealing queue's body stays in the shared place"
    );
}

#[tokio::test]
async fn gcs_bodies_park_and_redrive_byte_exact_against_fake_gcs_server() {
    let gcs = GcsServer::start();
    gcs.create_bucket(BUCKET).await;
    // fake-gcs-server serves no XML multipart upload: bodies there stay below a part.
    park_and_redrive(Emulator::Gcs(gcs), "bodies-gcs", false).await;
}

#[tokio::test]
async fn azure_bodies_park_and_redrive_byte_exact_against_azurite() {
    let azure = AzuriteServer::start();
    azure.create_container(BUCKET).await;
    park_and_redrive(Emulator::Azure(azure), "bodies-azure", true).await;
}
