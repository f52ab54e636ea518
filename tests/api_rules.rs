//! The apiserver itself enforces the record's rules (CEL in the CRD): each refusal is checked
//! with its message, on a real kube-apiserver.

use dlq_testenv::replays::{replay, replays};
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

fn records(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("dlq.dev", "v1alpha1", "DeadLetter"),
        "deadletters",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn record(name: &str, job: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetter",
        "metadata": {"name": name},
        "spec": {
            "queue": "relayer", "cycle": 1, "job": job,
            "intent": {"id": "pi_0003", "state": "created"},
            "deliveries": 3, "reason": "no luck after 3 deliveries",
            "failureKind": "Transient", "failedAt": "2026-11-29T10:00:00Z"
        }
    }))
    .unwrap()
}

fn job() -> Value {
    json!({"id": "pi_0003/settle", "payload": "{\"intent\":\"pi_0003\"}"})
}

async fn setup() -> (Client, Api<DynamicObject>) {
    let (client, ns) = dlq_testenv::setup("rules").await;
    let api = records(&client, &ns);
    (client, api)
}

fn refusal(r: Result<DynamicObject, kube::Error>) -> (u16, String) {
    match r {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        Err(e) => panic!("expected an API refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, the apiserver accepted it"),
    }
}

async fn merge(
    api: &Api<DynamicObject>,
    name: &str,
    patch: Value,
) -> Result<DynamicObject, kube::Error> {
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
}

#[tokio::test]
async fn unsigned_decision_is_refused() {
    let (_c, api) = setup().await;
    api.create(&PostParams::default(), &record("r1", job()))
        .await
        .unwrap();
    let (code, msg) = refusal(merge(&api, "r1", json!({"spec": {"action": "redrive"}})).await);
    assert_eq!(code, 422);
    assert!(msg.contains("every decision must be signed"), "{msg}");
    let (_, msg) =
        refusal(merge(&api, "r1", json!({"spec": {"action": "drop", "by": "  "}})).await);
    assert!(msg.contains("every decision must be signed"), "{msg}");
    merge(
        &api,
        "r1",
        json!({"spec": {"action": "redrive", "by": "ops", "note": "INC-1"}}),
    )
    .await
    .expect("a signed decision is accepted");
}

#[tokio::test]
async fn parked_facts_are_immutable() {
    let (_c, api) = setup().await;
    api.create(&PostParams::default(), &record("r2", job()))
        .await
        .unwrap();
    for (patch, expected) in [
        (
            json!({"spec": {"job": {"payload": "edited"}}}),
            "spec.job is immutable",
        ),
        (
            json!({"spec": {"job": {"headers": {"x": "y"}}}}),
            "spec.job is immutable",
        ),
        (
            json!({"spec": {"intent": {"state": "authorized"}}}),
            "spec.intent is immutable",
        ),
        (
            json!({"spec": {"queue": "other"}}),
            "spec.queue is immutable",
        ),
        (json!({"spec": {"cycle": 2}}), "spec.cycle is immutable"),
        (
            json!({"spec": {"deliveries": 1}}),
            "spec.deliveries is immutable",
        ),
        (json!({"spec": {"reason": "x"}}), "spec.reason is immutable"),
        (
            json!({"spec": {"failureKind": "Invalid"}}),
            "spec.failureKind is immutable",
        ),
        (
            json!({"spec": {"serviceVersion": "v2"}}),
            "spec.serviceVersion is immutable",
        ),
        (
            json!({"spec": {"failedAt": "2026-01-01T00:00:00Z"}}),
            "spec.failedAt is immutable",
        ),
        (
            json!({"spec": {"errorClass": "PayerTimeout"}}),
            "spec.errorClass is immutable",
        ),
    ] {
        let (code, msg) = refusal(merge(&api, "r2", patch.clone()).await);
        assert_eq!(code, 422, "{patch}");
        assert!(msg.contains(expected), "{patch}: {msg}");
    }
}

#[tokio::test]
async fn the_error_class_is_bounded_and_immutable_once_set() {
    let (_c, api) = setup().await;
    let mut long = record("r-class-long", job());
    long.data["spec"]["errorClass"] = json!("E".repeat(257));
    let (code, msg) = refusal(api.create(&PostParams::default(), &long).await);
    assert_eq!(code, 422);
    assert!(msg.contains("spec.errorClass"), "{msg}");
    let mut classed = record("r-class", job());
    classed.data["spec"]["errorClass"] = json!("E".repeat(256));
    api.create(&PostParams::default(), &classed)
        .await
        .expect("256 characters fit");
    let (code, msg) = refusal(merge(&api, "r-class", json!({"spec": {"errorClass": "F"}})).await);
    assert_eq!(code, 422);
    assert!(msg.contains("spec.errorClass is immutable"), "{msg}");
    let (_, msg) = refusal(merge(&api, "r-class", json!({"spec": {"errorClass": null}})).await);
    assert!(msg.contains("spec.errorClass is immutable"), "{msg}");
}

/// The CRD's one-payload-form rule, in its words.
const ONE_FORM: &str = "exactly one of spec.job.payload, spec.job.payloadBase64, spec.job.payloadNull and spec.job.body";

#[tokio::test]
async fn payload_forms_and_sizes_are_bounded() {
    let (_c, api) = setup().await;
    let both = json!({"id": "j", "payload": "a", "payloadBase64": "YQ=="});
    let (code, msg) = refusal(
        api.create(&PostParams::default(), &record("both", both))
            .await,
    );
    assert_eq!(code, 422);
    assert!(msg.contains(ONE_FORM), "{msg}");

    // A null value (a Kafka tombstone) is a form of its own, never beside a payload.
    for (name, job) in [
        (
            "null-and-text",
            json!({"id": "j", "payload": "", "payloadNull": true}),
        ),
        (
            "null-and-b64",
            json!({"id": "j", "payloadBase64": "YQ==", "payloadNull": true}),
        ),
    ] {
        let (code, msg) = refusal(api.create(&PostParams::default(), &record(name, job)).await);
        assert_eq!(code, 422, "{name}");
        assert!(msg.contains(ONE_FORM), "{name}: {msg}");
    }
    let null = json!({"id": "j", "payloadNull": true});
    api.create(&PostParams::default(), &record("null", null))
        .await
        .expect("a null value alone is a payload");
    let not_null = json!({"id": "j", "payloadNull": false});
    let (_, msg) = refusal(
        api.create(&PostParams::default(), &record("not-null", not_null))
            .await,
    );
    assert!(
        msg.contains(ONE_FORM),
        "payloadNull false is no payload: {msg}"
    );

    // A body in the store (issue 48) is a form of its own: never beside a payload, unless it
    // is a producer's object the inline payload points at (`external`).
    let body = json!({"ref": "s3://dlq-bodies/sha256/ab", "size": 3, "sha256": "a".repeat(64)});
    api.create(
        &PostParams::default(),
        &record("stored", json!({"id": "j", "body": body})),
    )
    .await
    .expect("a stored body alone is a payload");
    let (code, msg) = refusal(
        api.create(
            &PostParams::default(),
            &record(
                "stored-and-text",
                json!({"id": "j", "payload": "a", "body": body}),
            ),
        )
        .await,
    );
    assert_eq!(code, 422);
    assert!(msg.contains("holds no payload"), "{msg}");
    let mut external = body.clone();
    external["external"] = json!(true);
    api.create(
        &PostParams::default(),
        &record(
            "pointer",
            json!({"id": "j", "payload": "[pointer]", "body": external}),
        ),
    )
    .await
    .expect("an external body beside its pointer message");

    let neither = json!({"id": "j"});
    let (_, msg) = refusal(
        api.create(&PostParams::default(), &record("neither", neither))
            .await,
    );
    assert!(msg.contains(ONE_FORM), "{msg}");

    let big = json!({"id": "j", "payload": "x".repeat(256 * 1024 + 1)});
    let (code, msg) = refusal(
        api.create(&PostParams::default(), &record("big", big))
            .await,
    );
    assert_eq!(code, 422);
    assert!(
        msg.contains("spec.job.payload") && msg.contains("262144"),
        "{msg}"
    );

    let at_limit = json!({"id": "j", "payload": "x".repeat(256 * 1024)});
    api.create(&PostParams::default(), &record("at-limit", at_limit))
        .await
        .expect("256 KiB is allowed");

    let not_b64 = json!({"id": "j", "payloadBase64": "not base64!"});
    let (code, _) = refusal(
        api.create(&PostParams::default(), &record("badb64", not_b64))
            .await,
    );
    assert_eq!(code, 422);
}

/// A sealed job (issue 32) holds its payload and headers only in `sealed`: the CRD refuses a
/// plaintext form beside it and a recipient that is not an age one.
#[tokio::test]
async fn a_sealed_job_holds_nothing_in_plaintext_beside_it() {
    let (_c, api) = setup().await;
    let (_, recipient) = dlq_core::seal::generate_identity();
    let sealed = json!({"recipient": recipient, "ciphertext": "YWdl"});
    let exclusive = "a sealed job holds its payload and headers only in spec.job.sealed";
    for (name, job) in [
        (
            "sealed-payload",
            json!({"id": "j", "sealed": sealed, "payload": "4111111111111111"}),
        ),
        (
            "sealed-b64",
            json!({"id": "j", "sealed": sealed, "payloadBase64": "YQ=="}),
        ),
        (
            "sealed-null",
            json!({"id": "j", "sealed": sealed, "payloadNull": true}),
        ),
        (
            "sealed-headers",
            json!({"id": "j", "sealed": sealed, "headers": {"x-card": "4111"}}),
        ),
    ] {
        let (code, msg) = refusal(api.create(&PostParams::default(), &record(name, job)).await);
        assert_eq!(code, 422, "{name}");
        assert!(msg.contains(exclusive), "{name}: {msg}");
    }
    let bad = json!({"id": "j", "sealed": {"recipient": "ssh-ed25519 AAAA", "ciphertext": "YWdl"}});
    let (code, msg) = refusal(
        api.create(&PostParams::default(), &record("bad", bad))
            .await,
    );
    assert_eq!(code, 422);
    assert!(msg.contains("spec.job.sealed.recipient"), "{msg}");
    api.create(
        &PostParams::default(),
        &record("sealed", json!({"id": "j", "sealed": sealed})),
    )
    .await
    .expect("a sealed job alone is a payload");
    let (_, msg) = refusal(
        merge(
            &api,
            "sealed",
            json!({"spec": {"job": {"sealed": null, "payload": "x"}}}),
        )
        .await,
    );
    assert!(msg.contains("spec.job is immutable"), "{msg}");
}

#[tokio::test]
async fn decision_is_frozen_once_resolved() {
    let (_c, api) = setup().await;
    api.create(&PostParams::default(), &record("r3", job()))
        .await
        .unwrap();
    merge(
        &api,
        "r3",
        json!({"spec": {"action": "redrive", "by": "ops"}}),
    )
    .await
    .unwrap();
    api.patch_status(
        "r3",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Redriven", "resolvedBy": "ops"}})),
    )
    .await
    .unwrap();
    for patch in [
        json!({"spec": {"action": "drop"}}),
        json!({"spec": {"by": "mallory"}}),
        json!({"spec": {"note": "rewriting history"}}),
        json!({"spec": {"action": null, "by": null}}),
    ] {
        let (code, msg) = refusal(merge(&api, "r3", patch.clone()).await);
        assert_eq!(code, 422, "{patch}");
        assert!(
            msg.contains("record is not parked: pi_0003/settle is redriven"),
            "{patch}: {msg}"
        );
    }
    // Labels and annotations stay editable: only the decision is frozen.
    merge(
        &api,
        "r3",
        json!({"metadata": {"labels": {"team": "payments"}}}),
    )
    .await
    .expect("metadata edits are fine");
}

/// A replay is signed, its name fits a label, and once it runs only `spec.stop` changes.
#[tokio::test]
async fn replay_spec_is_signed_and_frozen_once_running() {
    let (client, ns) = dlq_testenv::setup("rules-replay").await;
    let api = replays(&client, &ns);
    let (code, msg) = refusal(api.create(&PostParams::default(), &replay("r0", " ")).await);
    assert_eq!(code, 422);
    assert!(msg.contains("every decision must be signed"), "{msg}");
    let long = "r".repeat(64);
    let (_, msg) = refusal(
        api.create(&PostParams::default(), &replay(&long, "carol"))
            .await,
    );
    assert!(msg.contains("at most 63 characters"), "{msg}");
    let (_, msg) = refusal(
        api.create(&PostParams::default(), &{
            let mut r = replay("r1", "carol");
            r.data["spec"]["rate"] = json!("fast");
            r
        })
        .await,
    );
    assert!(msg.contains("spec.rate"), "{msg}");

    api.create(&PostParams::default(), &replay("r2", "carol"))
        .await
        .unwrap();
    merge(
        &api,
        "r2",
        json!({"spec": {"dryRun": false, "note": "reviewed"}}),
    )
    .await
    .expect("a dry run may still change");
    api.patch_status(
        "r2",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running"}})),
    )
    .await
    .unwrap();
    let (code, msg) = refusal(merge(&api, "r2", json!({"spec": {"rate": "100/s"}})).await);
    assert_eq!(code, 422);
    assert!(
        msg.contains(
            "replay r2 is running: only spec.stop and spec.paused can change once it started"
        ),
        "{msg}"
    );
    merge(&api, "r2", json!({"spec": {"stop": true}}))
        .await
        .expect("a running replay can be stopped");
}

/// A queue's `spec.target.idempotencyKeyHeader` is a header name, or empty (no key carried).
#[tokio::test]
async fn the_idempotency_key_header_is_a_header_name_or_empty() {
    let (client, ns) = dlq_testenv::setup("keyheader").await;
    let api: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client, &ns);
    let cases = [
        ("Idempotency-Key", true),
        ("", true),
        ("x_dedupe.key-2", true),
        ("two words", false),
        ("x:key", false),
    ];
    for (i, (header, accepted)) in cases.into_iter().enumerate() {
        let q: dlq_core::api::DeadLetterQueue = serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": format!("q{i}")},
            "spec": {"target": {
                "idempotencyKeyHeader": header,
                "http": {"url": "https://h/x"}
            }}
        }))
        .unwrap();
        let result = api.create(&PostParams::default(), &q).await;
        if accepted {
            let stored = result.unwrap_or_else(|e| panic!("{header:?} refused: {e}"));
            assert_eq!(
                stored.spec.target.idempotency_key_header.as_deref(),
                Some(header)
            );
        } else {
            let (code, message) = match result {
                Err(kube::Error::Api(s)) => (s.code, s.message),
                other => panic!("{header:?}: expected a refusal, got {other:?}"),
            };
            assert_eq!(code, 422);
            assert!(
                message.contains("idempotencyKeyHeader must be a header name"),
                "{message}"
            );
        }
    }
}

/// A Sidekiq source and target share one URL: either names it, and one of them must.
#[tokio::test]
async fn a_sidekiq_queue_names_its_redis_url_on_one_side_at_least() {
    let (client, ns) = dlq_testenv::setup("sidekiq-url").await;
    let api: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client, &ns);
    let url = json!({"name": "redis", "key": "url"});
    let redis = json!({"redis": {"urlSecretRef": url, "list": "jobs"}});
    let cases = [
        (
            json!({"sidekiq": {"urlSecretRef": url}}),
            json!({"sidekiq": {}}),
            None,
        ),
        (
            json!({"sidekiq": {}}),
            json!({"sidekiq": {"urlSecretRef": url}}),
            None,
        ),
        (
            json!({"sidekiq": {}}),
            json!({"sidekiq": {}}),
            Some("spec.target.sidekiq needs urlSecretRef"),
        ),
        (
            redis.clone(),
            json!({"sidekiq": {}}),
            Some("spec.source.sidekiq needs urlSecretRef"),
        ),
        (
            json!({"sidekiq": {}}),
            Value::Null,
            Some("spec.target.sidekiq needs urlSecretRef"),
        ),
    ];
    for (i, (target, source, refused)) in cases.into_iter().enumerate() {
        let mut spec = json!({"target": target});
        if !source.is_null() {
            spec["source"] = source;
        }
        let q: dlq_core::api::DeadLetterQueue = serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": format!("q{i}")}, "spec": spec
        }))
        .unwrap();
        let result = api.create(&PostParams::default(), &q).await;
        match (refused, result) {
            (None, Ok(_)) => {}
            (Some(why), Err(kube::Error::Api(s))) => {
                assert_eq!(s.code, 422, "case {i}");
                assert!(s.message.contains(why), "case {i}: {}", s.message);
            }
            (want, got) => panic!("case {i}: wanted {want:?}, got {got:?}"),
        }
    }
}

/// A queue seals with one identity (`identitySecretRef`) or, while rotating, a list (`keys`):
/// exactly one of the two (issue 32).
#[tokio::test]
async fn a_queue_names_one_identity_or_a_list_of_keys_not_both() {
    let (client, _) = setup().await;
    let ns = dlq_testenv::namespace(&client, "rules-seal").await;
    let queues: Api<DynamicObject> = Api::namespaced_with(
        client,
        &ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "dlq.dev",
            "v1alpha1",
            "DeadLetterQueue",
        )),
    );
    let queue = |name: &str, seal: Value| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": name},
            "spec": {"target": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}, "list": "l"}},
                     "protection": {"seal": seal, "mask": ["$.holder"]}},
        }))
        .unwrap()
    };
    let one = json!({"name": "seal-1"});
    for (name, seal) in [
        ("one", json!({"identitySecretRef": one})),
        ("rotating", json!({"keys": [{"name": "seal-2"}, one]})),
    ] {
        queues
            .create(&PostParams::default(), &queue(name, seal))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for (name, seal) in [
        ("both", json!({"identitySecretRef": one, "keys": [one]})),
        ("neither", json!({})),
        ("empty", json!({"keys": []})),
    ] {
        let (code, msg) = refusal(
            queues
                .create(&PostParams::default(), &queue(name, seal))
                .await,
        );
        assert_eq!(code, 422, "{name}: {msg}");
    }
}
