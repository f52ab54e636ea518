//! The body store (issue 48) against a real apiserver, etcd, redis-server and an S3-compatible
//! server (versitygw, built from its Go module by tools/build.sh): a dead message above the
//! queue's threshold is kept in the bucket and its record holds `spec.job.body {ref, size,
//! sha256}` (a record of a few hundred bytes in etcd); redrive delivers the exact bytes; an
//! object deleted by hand or changed refuses the redrive (`BodyMissing`, `BodyCorrupt`) and the
//! record stays Parked until the object is right again; a message over `maxBytes` stays in the
//! broker (`Rejected`); with the bucket down a large dead message stays in Redis with a
//! `BodyStoreUnavailable` Event and is parked once it is back; the operator killed between the
//! upload and the record's create parks the message once, and the sweep deletes objects no
//! record references (an orphan, a deleted record's) and keeps every referenced one; a queue
//! whose store moved to another bucket (its objects copied) still redrives what it parked
//! before. A sealed
//! queue's objects are ciphertext, and its redrive is still byte-exact. Issue 57: queues spelling
//! one endpoint two ways (`localhost`, `127.0.0.1`) keep each other's bodies through their sweeps;
//! a hand-made record naming another bucket's object is refused unread, telling nothing of it.

use std::time::Duration;

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_core::park::record_name;
use dlq_core::seal::generate_identity;
use dlq_testenv::brokers::Redis;
use dlq_testenv::brokers::s3::S3Server;
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, events_for, eventually, report, setup,
    wait_phase,
};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use redis::AsyncCommands;
use serde_json::json;

const BUCKET: &str = "dlq-bodies";
const PREFIX: &str = "payments/";
/// Where the queue's store moves to.
const MOVED: &str = "dlq-bodies-moved";
const DEAD: &str = "relayer:dead";
const JOBS: &str = "relayer:jobs";
/// `spec.bodies.maxBytes` of the test queue.
const MAX_BYTES: usize = 12 << 20;

/// Bytes that are not UTF-8 (so the envelope carries them as base64) and differ per `seed`.
fn body(seed: u8, len: usize) -> Vec<u8> {
    dlq_testenv::fixtures::noise(seed, len)
}

fn envelope(id: &str, payload: &[u8]) -> String {
    use base64::Engine;
    json!({
        "id": id,
        "payloadBase64": base64::engine::general_purpose::STANDARD.encode(payload),
        "reason": "consumer gave up",
    })
    .to_string()
}

fn sha256(bytes: &[u8]) -> String {
    dlq_core::body::sha256_hex(bytes)
}

/// Queue `relayer`: Redis list target and dead-list source, bodies in the bucket above 64 KiB.
async fn queue(client: &Client, ns: &str, redis: &Redis, s3: &S3Server, seal: Option<&str>) {
    secrets(client, ns, redis, s3).await;
    let mut spec = queue_spec(DEAD, &s3.endpoint());
    if let Some(identity) = seal {
        spec["protection"] = json!({"seal": {"identitySecretRef": {"name": identity}}});
    }
    create_dlq(client, ns, "relayer", spec).await;
}

/// The Secrets `redis` (its URL) and `s3` (the store's keys).
async fn secrets(client: &Client, ns: &str, redis: &Redis, s3: &S3Server) {
    create_secret(client, ns, "redis", "url", &redis.url()).await;
    s3.credentials_secret(client, ns, "s3").await;
}

/// A queue parking from Redis list `dead` to [`JOBS`], its bodies under [`PREFIX`] of
/// [`BUCKET`] on the S3 endpoint spelled `endpoint`.
fn queue_spec(dead: &str, endpoint: &str) -> serde_json::Value {
    json!({
        "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "list": JOBS}},
        "source": {"redis": {"list": dead}},
        "bodies": {
            "thresholdBytes": 65536,
            "maxBytes": MAX_BYTES,
            "orphansAfter": "10s",
            "s3": {"bucket": BUCKET, "prefix": PREFIX, "endpoint": endpoint,
                   "region": "us-east-1", "credentialsSecretRef": {"name": "s3"}},
        },
    })
}

async fn push(redis: &Redis, id: &str, payload: &[u8]) {
    push_to(redis, DEAD, id, payload).await;
}

async fn push_to(redis: &Redis, dead: &str, id: &str, payload: &[u8]) {
    let mut conn = redis.conn().await;
    let _: () = conn.lpush(dead, envelope(id, payload)).await.unwrap();
}

async fn parked(api: &Api<DeadLetter>, id: &str) -> DeadLetter {
    parked_in(api, "relayer", id, 60).await
}

async fn parked_in(api: &Api<DeadLetter>, queue: &str, id: &str, secs: u64) -> DeadLetter {
    let name = record_name(queue, id, 1);
    eventually(secs, &format!("record of {id}"), || async {
        api.get_opt(&name).await.ok().flatten()
    })
    .await
}

/// Waits until the target list holds an element equal to `want`.
async fn delivered(redis: &Redis, want: &[u8], what: &str) {
    eventually(60, what, || async {
        redis
            .list(JOBS)
            .await
            .iter()
            .any(|e| e == want)
            .then_some(())
    })
    .await;
}

fn start_operator(ns: &str, env: &[(&str, &str)]) -> Operator {
    Operator::start_with(ns, &["--body-sweep-seconds=2"], env)
}

#[tokio::test]
async fn large_bodies_live_in_the_bucket_and_redrive_byte_exact() {
    let redis = Redis::start();
    let mut s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    let (client, ns) = setup("bodies").await;
    queue(&client, &ns, &redis, &s3, None).await;
    let op = start_operator(&ns, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    // 3 MiB goes to the bucket; 1 KiB stays inline; 13 MiB is over maxBytes.
    let big = body(1, 3 << 20);
    let small = body(2, 1024);
    let huge = body(3, MAX_BYTES + (1 << 20));
    push(&redis, "big", &big).await;
    push(&redis, "small", &small).await;
    push(&redis, "huge", &huge).await;
    let record = parked(&api, "big").await;
    let reference = record.spec.job.body.as_deref().expect("a body reference");
    assert_eq!(reference.size, big.len() as i64);
    assert_eq!(reference.sha256, sha256(&big));
    let key = format!("{PREFIX}sha256/{}", sha256(&big));
    assert_eq!(reference.reference, format!("s3://{BUCKET}/{key}"));
    assert!(record.spec.job.payload.is_none() && record.spec.job.payload_base64.is_none());
    assert_eq!(s3.get_object(BUCKET, &key).await.as_deref(), Some(&big[..]));
    let stored = serde_json::to_vec(&record).unwrap().len();
    report(&format!(
        "bodies: a record of a 3 MiB body is {stored} bytes of JSON"
    ));
    assert!(stored < 2048, "record of {stored} bytes");
    let inline = parked(&api, "small").await;
    assert!(inline.spec.job.body.is_none() && inline.spec.job.payload_base64.is_some());
    eventually(
        30,
        "the 9 MiB message rejected and kept in Redis",
        || async {
            let kept = redis.list(&format!("{DEAD}:rejected")).await;
            let event = events_for(&client, &ns, "relayer", "Rejected").await;
            (kept.len() == 1 && !event.is_empty()).then_some(())
        },
    )
    .await;

    decide(
        &api,
        &record_name("relayer", "big", 1),
        Action::Redrive,
        "ada",
    )
    .await;
    wait_phase(&api, &record_name("relayer", "big", 1), Phase::Redriven, 60).await;
    delivered(&redis, &big, "the 3 MiB job on the target, byte-exact").await;

    // Deleted by hand: nothing is sent, the record stays Parked and says why.
    let other = body(4, 200_000);
    push(&redis, "other", &other).await;
    parked(&api, "other").await;
    let other_key = format!("{PREFIX}sha256/{}", sha256(&other));
    s3.delete_object(BUCKET, &other_key).await;
    let other_name = record_name("relayer", "other", 1);
    decide(&api, &other_name, Action::Redrive, "ada").await;
    requeue_refused(&api, &other_name, "BodyMissing").await;
    // Changed in the bucket: refused as corrupt, never sent.
    let mut changed = other.clone();
    changed[100] ^= 1;
    s3.put_object(BUCKET, &other_key, changed.clone()).await;
    requeue_refused(&api, &other_name, "BodyCorrupt").await;
    assert!(
        !redis
            .list(JOBS)
            .await
            .iter()
            .any(|e| *e == changed || *e == other),
        "nothing of a wrong body is sent"
    );
    // Put right again: the retry goes through.
    s3.put_object(BUCKET, &other_key, other.clone()).await;
    wait_phase(&api, &other_name, Phase::Redriven, 60).await;
    delivered(&redis, &other, "the restored body redriven").await;

    // The bucket down: the dead message stays in Redis and an Event says why.
    s3.stop();
    let late = body(5, 500_000);
    push(&redis, "late", &late).await;
    eventually(60, "a BodyStoreUnavailable Event", || async {
        let e = events_for(&client, &ns, "relayer", "BodyStoreUnavailable").await;
        (!e.is_empty()).then_some(())
    })
    .await;
    assert!(
        api.get_opt(&record_name("relayer", "late", 1))
            .await
            .unwrap()
            .is_none()
    );
    let held = redis.list(DEAD).await.len()
        + redis.list(&format!("{DEAD}:processing")).await.len()
        + redis.hash_len(&format!("{DEAD}:inflight")).await;
    assert_eq!(held, 1, "the dead message waits in Redis");
    s3.restart();
    let late_record = parked(&api, "late").await;
    assert_eq!(
        late_record.spec.job.body.as_deref().unwrap().sha256,
        sha256(&late)
    );

    // The sweep: an orphan (an upload whose record was never made) and the body of a deleted
    // record go; every referenced body stays.
    let orphan = body(6, 70_000);
    let orphan_key = format!("{PREFIX}sha256/{}", sha256(&orphan));
    s3.put_object(BUCKET, &orphan_key, orphan).await;
    api.delete(&record_name("relayer", "big", 1), &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        60,
        "the orphan and the deleted record's body swept",
        || async {
            let keys = s3.list_keys(BUCKET, PREFIX).await;
            (!keys.contains(&orphan_key) && !keys.contains(&key)).then_some(keys)
        },
    )
    .await;
    let keys = s3.list_keys(BUCKET, PREFIX).await;
    let late_key = format!("{PREFIX}sha256/{}", sha256(&late));
    assert!(
        keys.contains(&other_key) && keys.contains(&late_key),
        "{keys:?}"
    );
    assert!(
        !op.logs().contains(&s3.secret_key().to_string()),
        "no credentials in the log"
    );

    // The queue's store moved to another bucket, its objects copied there: a record parked
    // before still redrives, its body found by its digest in the new place.
    s3.create_bucket(MOVED).await;
    let late_bytes = s3
        .get_object(BUCKET, &late_key)
        .await
        .expect("the late body");
    s3.put_object(MOVED, &late_key, late_bytes).await;
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let moved = json!({"spec": {"bodies": {"s3": {"bucket": MOVED}}}});
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&moved))
        .await
        .expect("the queue's store moved");
    let late_name = record_name("relayer", "late", 1);
    decide(&api, &late_name, Action::Redrive, "ada").await;
    wait_phase(&api, &late_name, Phase::Redriven, 60).await;
    delivered(&redis, &late, "the moved body redriven byte-exact").await;

    // The apiserver refuses a record of a kept body for good (an admission policy): the
    // message, small enough for a record, is parked as an Invalid record of its exact bytes.
    let policy = refuse_stored_bodies(&client, &ns).await;
    let refused = body(7, 100_000);
    push(&redis, "refused", &refused).await;
    let record = parked(&api, "refused").await;
    assert_eq!(
        record.spec.failure_kind,
        dlq_core::api::FailureKind::Invalid
    );
    assert!(record.spec.job.body.is_none(), "inline, not by reference");
    assert_eq!(
        record.spec.job.payload_bytes().expect("bytes"),
        envelope("refused", &refused).into_bytes(),
        "the element's exact bytes"
    );
    dlq_testenv::admission::unrefuse(&client, &policy).await;
}

/// Refuses (422, an admission policy's CEL rule) any record in `ns` that references a stored
/// body, but the operator's fallback after a refusal.
async fn refuse_stored_bodies(client: &Client, ns: &str) -> String {
    let probe = json!({
        "metadata": {"name": "probe"},
        "spec": {"queue": "relayer", "cycle": 1, "deliveries": 0, "reason": "probe",
                 "failureKind": "Transient", "failedAt": "2026-12-01T00:00:00Z",
                 "job": {"id": "probe", "body": {"ref": "s3://b/k", "size": 1,
                         "sha256": "0".repeat(64)}}},
    });
    let allowed = "!has(object.spec.job.body) || object.spec.reason.contains('apiserver refused')";
    dlq_testenv::admission::refuse(client, ns, "no-bodies", allowed, "no stored bodies", probe)
        .await
}

async fn requeue_refused(api: &Api<DeadLetter>, name: &str, reason: &str) {
    eventually(60, &format!("Requeued=False {reason}"), || async {
        let r = api.get(name).await.ok()?;
        let (status, why, _) = condition(&r, "Requeued")?;
        (status == "False" && why == reason && r.phase() == Phase::Parked).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_kill_between_upload_and_create_parks_once_and_sealed_bodies_are_ciphertext() {
    let redis = Redis::start();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    let (client, ns) = setup("bodies-seal").await;
    let (identity, _) = generate_identity();
    create_secret(&client, &ns, "seal", "identity", &identity).await;
    queue(&client, &ns, &redis, &s3, Some("seal")).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let mut op = start_operator(&ns, &[("DLQ_FAILPOINT", "body-after-upload")]);
    let marker = b"CARD-4111111111111111-";
    // Over one part (8 MiB): sealed on its way up, staged and moved to its key in the bucket.
    let mut secret = marker.repeat(400_000);
    secret.extend_from_slice(&body(7, 1000));
    push(&redis, "sealed", &secret).await;
    op.reached_failpoint("body-after-upload", 60).await;
    op.kill();
    let objects = s3.list_keys(BUCKET, PREFIX).await;
    assert_eq!(objects.len(), 1, "uploaded before the kill: {objects:?}");
    assert!(
        api.get_opt(&record_name("relayer", "sealed", 1))
            .await
            .unwrap()
            .is_none()
    );

    let _op = start_operator(&ns, &[]);
    let record = parked(&api, "sealed").await;
    let reference = record.spec.job.body.as_deref().expect("a body");
    assert!(reference.recipient.is_some(), "sealed to the queue's key");
    let stored = s3
        .get_object(
            BUCKET,
            reference
                .reference
                .trim_start_matches(&format!("s3://{BUCKET}/")),
        )
        .await
        .expect("the object");
    assert!(
        !stored.windows(marker.len()).any(|w| w == marker),
        "the bucket holds ciphertext only"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let records = api.list(&Default::default()).await.unwrap().items;
    assert_eq!(records.len(), 1, "parked once");
    decide(
        &api,
        &record_name("relayer", "sealed", 1),
        Action::Redrive,
        "ada",
    )
    .await;
    wait_phase(
        &api,
        &record_name("relayer", "sealed", 1),
        Phase::Redriven,
        60,
    )
    .await;
    delivered(&redis, &secret, "the sealed body redriven byte-exact").await;
    // The first upload's object (ciphertext of another file key) no record names: swept.
    eventually(60, "only the record's object left", || async {
        let keys = s3.list_keys(BUCKET, PREFIX).await;
        (keys.len() == 1).then_some(())
    })
    .await;
}

/// Two queues on one bucket and prefix, one naming the endpoint `127.0.0.1`, the other
/// `localhost` (issue 57): each spelling is swept on its own, yet neither sweep deletes a body
/// the other queue's record names, nor one a park into the other queue is still waiting with
/// (every park held 25 s after its upload, past `orphansAfter`); both redrive byte-exact.
#[tokio::test]
async fn queues_spelling_one_place_two_ways_keep_each_others_bodies() {
    const MIRROR_DEAD: &str = "mirror:dead";
    let redis = Redis::start();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    let (client, ns) = setup("bodies-spelled").await;
    secrets(&client, &ns, &redis, &s3).await;
    let localhost = format!("http://localhost:{}", s3.port());
    create_dlq(&client, &ns, "relayer", queue_spec(DEAD, &s3.endpoint())).await;
    create_dlq(&client, &ns, "mirror", queue_spec(MIRROR_DEAD, &localhost)).await;
    let _op = start_operator(&ns, &[("DLQ_FAILPOINT", "body-after-upload@25000")]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let (a, b) = (body(11, 300_000), body(12, 300_000));
    push(&redis, "a", &a).await;
    push_to(&redis, MIRROR_DEAD, "b", &b).await;
    let keys = [&a, &b].map(|bytes| format!("{PREFIX}sha256/{}", sha256(bytes)));
    parked_in(&api, "relayer", "a", 120).await;
    parked_in(&api, "mirror", "b", 120).await;
    let stored = s3.list_keys(BUCKET, PREFIX).await;
    assert!(
        keys.iter().all(|k| stored.contains(k)),
        "kept while their parks waited: {stored:?}"
    );
    // Sweeps of both spellings, every 2 s, past orphansAfter with both records Parked.
    tokio::time::sleep(Duration::from_secs(16)).await;
    let stored = s3.list_keys(BUCKET, PREFIX).await;
    assert!(
        keys.iter().all(|k| stored.contains(k)),
        "kept while their records name them: {stored:?}"
    );
    for (queue, id) in [("relayer", "a"), ("mirror", "b")] {
        decide(&api, &record_name(queue, id, 1), Action::Redrive, "ada").await;
    }
    for (queue, id) in [("relayer", "a"), ("mirror", "b")] {
        wait_phase(&api, &record_name(queue, id, 1), Phase::Redriven, 60).await;
    }
    delivered(&redis, &a, "a redriven byte-exact").await;
    delivered(&redis, &b, "b redriven byte-exact").await;
}

/// Records made by hand whose external body names another bucket's object (issue 57): their
/// redrives are refused (`BodyOutsideStore`, still Parked) without the object ever being asked
/// for, and no condition, Event or `kubectl dlq show` says its size or digest, even for the
/// record naming its true size. An object under a bucket and prefix the queue declares
/// (`externalBuckets`) is checked and its pointer message redriven.
#[tokio::test]
async fn a_hand_made_record_reads_no_object_the_queue_does_not_declare() {
    const VAULT: &str = "vault";
    const SECRET_KEY: &str = "vault/creds.json";
    let redis = Redis::start();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    s3.create_bucket(VAULT).await;
    let secret = body(13, 73_421);
    s3.put_object(VAULT, SECRET_KEY, secret.clone()).await;
    let (client, ns) = setup("bodies-forged").await;
    queue(&client, &ns, &redis, &s3, None).await;
    let _op = start_operator(&ns, &[]);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    let forged = [("forged-1", 1), ("forged-2", secret.len() as i64)];
    for (id, size) in forged {
        let reference = format!("s3://{VAULT}/{SECRET_KEY}");
        by_hand(&api, id, &reference, size, &"0".repeat(64)).await;
    }
    for (id, _) in forged {
        let name = record_name("relayer", id, 1);
        wait_phase(&api, &name, Phase::Parked, 60).await;
        decide(&api, &name, Action::Redrive, "mallory").await;
        let (why, message) = eventually(60, &format!("{id}'s redrive refused"), || async {
            let r = api.get(&name).await.ok()?;
            let (status, why, message) = condition(&r, "Requeued")?;
            (status == "False" && r.phase() == Phase::Parked).then_some((why, message))
        })
        .await;
        assert_eq!(why, "BodyOutsideStore", "{message}");
    }
    let (size, digest) = (secret.len().to_string(), sha256(&secret));
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    let mut said: Vec<String> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.note)
        .collect();
    for (id, _) in forged {
        let name = record_name("relayer", id, 1);
        let record = api.get(&name).await.unwrap();
        said.push(condition(&record, "Requeued").expect("Requeued").2);
        let (ok, out, err) = dlq_testenv::kubectl_dlq(&ns, &["show", &name]);
        assert!(ok && out.contains("BodyOutsideStore"), "{out}{err}");
        said.push(out);
    }
    for text in &said {
        assert!(
            !text.contains(&size) && !text.contains(&digest),
            "the object's size or digest told: {text}"
        );
    }
    assert_eq!(
        s3.requests_for(VAULT, SECRET_KEY).len(),
        1,
        "only the test's own PUT"
    );

    // Declared by the queue: read, checked, and the pointer message sent as it is.
    let declared = json!({"spec": {"bodies": {"s3": {"externalBuckets": [
        {"bucket": VAULT, "prefix": "offloaded/"}]}}}});
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&declared))
        .await
        .expect("externalBuckets declared");
    let offloaded = body(14, 90_000);
    s3.put_object(VAULT, "offloaded/o-1", offloaded.clone())
        .await;
    let reference = format!("s3://{VAULT}/offloaded/o-1");
    let size = offloaded.len() as i64;
    by_hand(&api, "declared", &reference, size, &sha256(&offloaded)).await;
    let name = record_name("relayer", "declared", 1);
    wait_phase(&api, &name, Phase::Parked, 60).await;
    decide(&api, &name, Action::Redrive, "ada").await;
    wait_phase(&api, &name, Phase::Redriven, 60).await;
    delivered(
        &redis,
        b"[pointer declared]",
        "the pointer message, untouched",
    )
    .await;
    assert_eq!(
        s3.requests_for(VAULT, SECRET_KEY).len(),
        1,
        "the undeclared object still unread"
    );
}

/// Creates the record of job `id` of queue `relayer` by hand, its payload a pointer message and
/// its body the external object `reference` with the `size` and `sha256` given.
async fn by_hand(api: &Api<DeadLetter>, id: &str, reference: &str, size: i64, sha256: &str) {
    let record: DeadLetter = serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetter",
        "metadata": {"name": record_name("relayer", id, 1)},
        "spec": {"queue": "relayer", "cycle": 1, "deliveries": 0, "reason": "by hand",
                 "failureKind": "Transient", "failedAt": "2026-12-01T00:00:00Z",
                 "job": {"id": id, "payload": format!("[pointer {id}]"),
                         "body": {"ref": reference, "size": size, "sha256": sha256,
                                  "external": true}}},
    }))
    .expect("a record");
    api.create(&Default::default(), &record)
        .await
        .unwrap_or_else(|e| panic!("the record of {id} by hand: {e}"));
}
