//! What only the HTTP redrive target does, against a small HTTP(S) server started by the test:
//! untouched payload and headers over TLS with a CA and a bearer token from Secrets, non-2xx
//! answers as failures with the status and a cut body, the apiserver's rules for targets. The
//! scenarios every backend passes (redrive byte for byte, endpoint down, many redrives) are in
//! `tests/backends.rs`.

use std::sync::atomic::Ordering;

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_testenv::brokers::{HttpSink, TestCa};
use dlq_testenv::{
    Operator, condition, create_dlq, create_secret, decide, events_for, eventually, record, setup,
    wait_phase, wait_ready,
};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;

/// A DeadLetterQueue `relayer` posting to `url`, with the token and CA Secrets when given.
async fn http_queue(client: &Client, ns: &str, url: &str, token: Option<&str>, ca: Option<&str>) {
    let mut target = json!({"url": url});
    if let Some(t) = token {
        create_secret(client, ns, "hook-token", "token", t).await;
        target["bearerTokenSecretRef"] = json!({"name": "hook-token", "key": "token"});
    }
    if let Some(pem) = ca {
        create_secret(client, ns, "hook-ca", "ca.crt", pem).await;
        target["caSecretRef"] = json!({"name": "hook-ca", "key": "ca.crt"});
    }
    create_dlq(client, ns, "relayer", json!({"target": {"http": target}})).await;
}

#[tokio::test]
async fn redrive_posts_identical_payload_and_headers_over_tls_with_a_bearer_token() {
    let (client, ns) = setup("http-target").await;
    let ca = TestCa::new();
    let sink = HttpSink::start(Some(&ca));
    http_queue(
        &client,
        &ns,
        &sink.url("/jobs?via=dlq"),
        Some("s3cr3t-token"),
        Some(&ca.ca_pem),
    )
    .await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let payload: Vec<u8> = (0u8..=255).collect();
    api.create(
        &PostParams::default(),
        &record(
            "bytes-1",
            "pi_0003/settle",
            &payload,
            &[
                ("content-type", "application/octet-stream"),
                ("x-trace", "abc"),
                ("message-id", "pi_0003/settle"),
            ],
        ),
    )
    .await
    .unwrap();
    wait_phase(&api, "bytes-1", Phase::Parked, 20).await;
    assert!(sink.posts().is_empty(), "nothing without a decision");
    decide(&api, "bytes-1", Action::Redrive, "ops").await;
    let done = wait_phase(&api, "bytes-1", Phase::Redriven, 30).await;
    assert_eq!(condition(&done, "Requeued").unwrap().0, "True");

    let posts = sink.posts();
    assert_eq!(posts.len(), 1, "exactly one POST");
    let p = &posts[0];
    assert_eq!(p.path, "/jobs?via=dlq");
    assert_eq!(p.body, payload, "byte-identical body");
    assert_eq!(p.header("content-type"), Some("application/octet-stream"));
    assert_eq!(p.header("x-trace"), Some("abc"));
    assert_eq!(p.header("message-id"), Some("pi_0003/settle"));
    assert_eq!(p.header("authorization"), Some("Bearer s3cr3t-token"));

    let why = wait_ready(&client, &ns, "relayer", true, 30).await;
    assert!(why.starts_with("TargetReachable"), "{why}");
    let q = Api::<dlq_core::api::DeadLetterQueue>::namespaced(client.clone(), &ns)
        .get("relayer")
        .await
        .unwrap();
    let status = serde_json::to_string(&q.status).unwrap();
    assert!(
        status.contains(&format!("http POST https://127.0.0.1:{}/jobs", sink.port)),
        "{status}"
    );
    assert!(
        !status.contains("s3cr3t") && !status.contains("via=dlq"),
        "no secrets or query strings in status: {status}"
    );
}

#[tokio::test]
async fn a_non_2xx_answer_is_a_failure_with_the_status_and_a_cut_body() {
    let (client, ns) = setup("http-503").await;
    let sink = HttpSink::start(None);
    sink.status.store(503, Ordering::SeqCst);
    *sink.body.lock().unwrap() = format!("overloaded: {}", "x".repeat(1000));
    http_queue(&client, &ns, &sink.url("/jobs"), None, None).await;
    let _op = Operator::start(&ns);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &record("busy-1", "busy/1", b"{}", &[]),
    )
    .await
    .unwrap();
    decide(&api, "busy-1", Action::Redrive, "ops").await;
    let r = eventually(30, "Requeued=False EndpointRefused", || async {
        let r = api.get("busy-1").await.ok()?;
        matches!(condition(&r, "Requeued"), Some((s, reason, _)) if s == "False" && reason == "EndpointRefused").then_some(r)
    })
    .await;
    assert_eq!(r.phase(), Phase::Parked);
    let (_, _, message) = condition(&r, "Requeued").unwrap();
    assert!(
        message.starts_with("endpoint answered HTTP 503: overloaded: xxx"),
        "{message}"
    );
    assert!(message.contains("xxx..."), "body cut: {message}");
    assert!(
        message.len() < 400,
        "cut to a few hundred bytes: {}",
        message.len()
    );
    eventually(10, "RequeueFailed warning", || async {
        let e = events_for(&client, &ns, "busy-1", "RequeueFailed").await;
        e.iter()
            .any(|e| e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;
    sink.status.store(204, Ordering::SeqCst);
    wait_phase(&api, "busy-1", Phase::Redriven, 30).await;
}

#[tokio::test]
async fn the_apiserver_refuses_ambiguous_targets_and_credentials_in_urls() {
    let (client, ns) = setup("backend-rules").await;
    let api: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let refused = |spec: serde_json::Value, want: &'static str| {
        let api = api.clone();
        async move {
            let q: dlq_core::api::DeadLetterQueue = serde_json::from_value(json!({
                "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
                "metadata": {"name": "q"}, "spec": spec
            }))
            .unwrap();
            match api.create(&PostParams::default(), &q).await {
                Err(kube::Error::Api(s)) => {
                    assert_eq!(s.code, 422, "{s:?}");
                    assert!(s.message.contains(want), "{} should say {want}", s.message);
                }
                other => panic!("expected a refusal saying {want}, got {other:?}"),
            }
        }
    };
    let secret = json!({"name": "s", "key": "url"});
    refused(
        json!({"target": {"http": {"url": "https://h/x"}, "nats": {"url": "nats://n:4222", "subject": "a"}}}),
        "exactly one backend (redis, amqp, nats, http, sqs, kafka, sidekiq or pubsub)",
    )
    .await;
    refused(json!({"target": {}}), "exactly one backend").await;
    refused(
        json!({"target": {"nats": {"url": "nats://user:pw@n:4222", "subject": "a"}}}),
        "credentials belong in a Secret",
    )
    .await;
    refused(
        json!({"target": {"nats": {"url": "nats://n:4222", "urlSecretRef": secret, "subject": "a"}}}),
        "exactly one of url or urlSecretRef",
    )
    .await;
    refused(
        json!({"target": {"http": {"url": "https://user:pw@h/x"}}}),
        "without credentials",
    )
    .await;
    refused(
        json!({"target": {"http": {"url": "http://h/x", "caSecretRef": secret}}}),
        "caSecretRef needs an https:// url",
    )
    .await;
    refused(
        json!({"target": {"amqp": {"urlSecretRef": secret, "routingKey": "k"}},
               "source": {"amqp": {"queue": "q.dlq"}, "nats": {"stream": "S", "consumer": "c"}}}),
        "exactly one broker (redis, amqp, nats, sqs, kafka, sidekiq or pubsub)",
    )
    .await;
    // The shapes from the spec are accepted.
    for (i, spec) in [
        json!({"target": {"amqp": {"urlSecretRef": secret, "exchange": "", "routingKey": "relayer"}},
               "source": {"amqp": {"queue": "relayer.dlq"}}}),
        json!({"target": {"nats": {"url": "nats://nats:4222", "subject": "relayer.jobs", "jetStream": true}},
               "source": {"nats": {"stream": "RELAYER", "consumer": "worker", "onParked": "keep"}}}),
        json!({"target": {"http": {"url": "https://relayer.payments.svc:8443/jobs",
               "bearerTokenSecretRef": secret, "caSecretRef": secret}}}),
    ]
    .into_iter()
    .enumerate()
    {
        let q: dlq_core::api::DeadLetterQueue = serde_json::from_value(json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": format!("ok-{i}")}, "spec": spec
        }))
        .unwrap();
        api.create(&PostParams::default(), &q)
            .await
            .unwrap_or_else(|e| panic!("spec {i} refused: {e}"));
    }
}

#[tokio::test]
async fn origin_is_part_of_the_immutable_job() {
    let (client, ns) = setup("origin-rules").await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut r = record("o-1", "o/1", b"x", &[]);
    r.spec.job.origin = Some(Box::new(dlq_core::api::Origin {
        exchange: Some("shop".into()),
        routing_key: Some("orders.created".into()),
        queue: Some("orders".into()),
        ..Default::default()
    }));
    api.create(&PostParams::default(), &r).await.unwrap();
    let patch = json!({"spec": {"job": {"origin": {"exchange": "elsewhere"}}}});
    match api
        .patch(
            "o-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert!(s.message.contains("spec.job is immutable"), "{s:?}"),
        other => panic!("origin must not be editable: {other:?}"),
    }
}
