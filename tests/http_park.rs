//! The HTTP park endpoint (issue 33) against the real apiserver and operator: CloudEvents sent
//! by a sender built on the CloudEvents Go SDK (`tools/cesender`), with ServiceAccount tokens
//! from a real TokenRequest; the answers a sender acts on (201/200, 400, 401, 403, 404, 408,
//! 413, 429 and 503 with Retry-After), slow clients among them; and the redrive of a parked
//! event as the same event.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, FailureKind, Phase};
use dlq_testenv::brokers::HttpSink;
use dlq_testenv::{Operator, create_dlq, decide, eventually, setup, wait_phase};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The endpoint's certificate and the CA senders trust, in a directory of their own.
struct Certs {
    dir: PathBuf,
    ca: PathBuf,
    ca_pem: String,
}

/// The directory holds a private key: it goes with the test.
impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn certs() -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let dir = std::env::temp_dir().join(format!(
        "dlq-park-tls-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).expect("cert dir");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key")).expect("CA");
    let params = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("serving parameters");
    let key = KeyPair::generate().expect("serving key");
    let cert = params.signed_by(&key, &ca).expect("serving certificate");
    std::fs::write(dir.join("tls.crt"), cert.pem()).expect("tls.crt");
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).expect("tls.key");
    let ca_pem = ca.pem();
    let ca_path = dir.join("ca.crt");
    std::fs::write(&ca_path, &ca_pem).expect("ca.crt");
    Certs {
        dir,
        ca: ca_path,
        ca_pem,
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

/// An operator serving the park endpoint over TLS, and its base URL.
/// The operator serving its park endpoint on loopback, taking callers without a token (for
/// queues that allow them) from `anonymous_from`.
fn operator_with_endpoint(ns: &str, certs: &Certs, anonymous_from: &str) -> (Operator, String) {
    operator_with_endpoint_and(ns, certs, anonymous_from, &[])
}

/// As [`operator_with_endpoint`], with `more` flags.
fn operator_with_endpoint_and(
    ns: &str,
    certs: &Certs,
    anonymous_from: &str,
    more: &[&str],
) -> (Operator, String) {
    let port = dlq_testenv::plane::free_port().expect("a free port");
    let base = format!("https://127.0.0.1:{port}");
    let mut args = vec![
        format!("--park-addr=127.0.0.1:{port}"),
        format!("--park-tls-dir={}", certs.dir.display()),
        format!("--park-url={base}"),
        format!("--park-anonymous-from={anonymous_from}"),
    ];
    args.extend(more.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start_with(ns, &args, &[]);
    (op, base)
}

fn queue_url(base: &str, ns: &str, queue: &str) -> String {
    format!("{base}{}", dlq_core::api::park_path(ns, queue))
}

/// A ServiceAccount `name`, allowed to create deadletters in `ns` when `may_park`.
async fn service_account(client: &Client, ns: &str, name: &str, may_park: bool) {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("sa");
    sas.create(&PostParams::default(), &sa)
        .await
        .expect("create sa");
    if may_park {
        let role: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-parker")},
            "rules": [{"apiGroups": ["dlq.dev"], "resources": ["deadletters"], "verbs": ["create"]}]
        }))
        .expect("role");
        Api::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &role)
            .await
            .expect("create role");
        let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-parker")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": format!("{name}-parker")},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]
        }))
        .expect("binding");
        Api::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &binding)
            .await
            .expect("create binding");
    }
}

/// A token of ServiceAccount `name` for `audience` (a real TokenRequest), written to a file.
async fn token(client: &Client, ns: &str, name: &str, audience: &str, dir: &Path) -> PathBuf {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.to_string()]),
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let answer = sas
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .expect("TokenRequest");
    let token = answer.status.and_then(|s| s.token).expect("a token");
    let path = dir.join(format!("{name}-{}.token", rand_suffix()));
    std::fs::write(&path, token).expect("token file");
    path
}

/// What one POST got back.
struct Reply {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

/// A client trusting `ca`, as the operator's own targets build it.
type Sender = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

fn sender(ca: &str) -> Sender {
    deadletter::https::client::<Full<Bytes>>(Some(ca), "test CA", Duration::from_secs(5))
        .expect("client")
}

/// POSTs `body` with `headers` to `url`, trusting `ca`.
async fn post(url: &str, ca: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
    send(&sender(ca), url, headers, body)
        .await
        .expect("an answer")
}

/// POSTs `body` with `headers` to `url` through `client`: its answer, or how the connection
/// failed without one.
async fn send(
    client: &Sender,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Reply, String> {
    let mut req = hyper::Request::post(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).expect("request");
    let res = client
        .request(req)
        .await
        .map_err(|e| deadletter::https::error_chain(&e))?;
    let status = res.status().as_u16();
    let headers = res
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect();
    let body = res
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Waits until the endpoint parks for the queue at `url` (a standby or starting scope says 503,
/// an unknown queue 404): then a request without a token gets `want`.
async fn endpoint_ready(url: &str, ca: &str, want: u16) {
    eventually(20, "the park endpoint to serve the queue", || async move {
        let r = post(
            url,
            ca,
            &[("content-type", "text/plain")],
            b"probe".to_vec(),
        )
        .await;
        (r.status == want).then_some(())
    })
    .await;
}

/// Runs cesender with `args`; returns its stdout (one `copy=N status=S` line per copy, then a
/// `codes` summary).
fn cesender(args: &[&str]) -> String {
    let dirs = dlq_testenv::plane::tool_dirs(&["cesender"]).expect("building cesender");
    let bin = dirs
        .iter()
        .map(|d| d.join("cesender"))
        .find(|p| p.is_file())
        .expect("cesender built");
    let out = std::process::Command::new(bin)
        .args(args)
        .output()
        .expect("running cesender");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "cesender failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The status codes of cesender's copies, sorted.
fn codes(out: &str) -> Vec<u16> {
    let mut codes: Vec<u16> = out
        .lines()
        .filter_map(|l| l.split("status=").nth(1))
        .filter_map(|s| s.split_whitespace().next())
        .filter_map(|s| s.parse().ok())
        .collect();
    codes.sort();
    codes
}

async fn records(client: &Client, ns: &str) -> Vec<DeadLetter> {
    Api::<DeadLetter>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .expect("list records")
        .items
}

#[tokio::test]
async fn go_sdk_events_park_once_with_a_real_token_and_redrive_as_the_same_event() {
    let (client, ns) = setup("http-park").await;
    let certs = certs();
    let sink = HttpSink::start(None);
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"http": {"url": sink.url("/events")}}, "http": {}}),
    )
    .await;
    service_account(&client, &ns, "sender", true).await;
    let (op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "relayer");
    endpoint_ready(&url, &certs.ca_pem, 401).await;
    let audience = dlq_core::api::park_path(&ns, "relayer");
    let token = token(&client, &ns, "sender", &audience, &certs.dir).await;
    let ca = certs.ca.display().to_string();
    let tok = token.display().to_string();
    let base_args = ["-url", &url, "-ca", &ca, "-token-file", &tok];

    // Binary mode, three copies of one event at once: one record, answered 201 once.
    let data = base64_of("payer said no");
    let mut args = base_args.to_vec();
    let ext_code = "knativeerrorcode=503".to_string();
    let ext_data = format!("knativeerrordata={data}");
    args.extend([
        "-mode",
        "binary",
        "-id",
        "e-1",
        "-source",
        "/payments/relayer",
        "-type",
        "dev.payments.settle",
        "-data",
        r#"{"intent":"pi_1"}"#,
        "-copies",
        "3",
        "-ext",
        &ext_code,
        "-ext",
        &ext_data,
    ]);
    let started = Instant::now();
    let out = cesender(&args);
    assert_eq!(codes(&out), [200, 200, 201], "{out}");
    dlq_testenv::report(&format!(
        "http_park: 3 concurrent copies answered in {:?}",
        started.elapsed()
    ));
    // A retry later: the same record again.
    let again = cesender(&[&args[..args.len() - 6], &["-copies", "1"]].concat());
    assert_eq!(codes(&again), [200], "{again}");
    let all = records(&client, &ns).await;
    assert_eq!(all.len(), 1, "one record for one event");
    let rec = &all[0];
    assert_eq!(rec.spec.job.id, "e-1@/payments/relayer");
    assert_eq!(
        rec.spec.job.payload.as_deref(),
        Some(r#"{"intent":"pi_1"}"#)
    );
    assert_eq!(
        rec.spec.job.headers.get("ce-type").map(String::as_str),
        Some("dev.payments.settle")
    );
    assert!(
        rec.spec
            .reason
            .contains("failed with HTTP 503: payer said no"),
        "{}",
        rec.spec.reason
    );
    assert_eq!(rec.spec.error_class.as_deref(), Some("HTTP 503"));

    // Structured mode: the document is the job.
    let mut args = base_args.to_vec();
    args.extend([
        "-mode",
        "structured",
        "-id",
        "e-2",
        "-source",
        "/payments/relayer",
    ]);
    assert_eq!(codes(&cesender(&args)), [201]);
    let e2 = records(&client, &ns)
        .await
        .into_iter()
        .find(|r| r.spec.job.id == "e-2@/payments/relayer")
        .expect("e-2 parked");
    let doc: serde_json::Value =
        serde_json::from_str(e2.spec.job.payload.as_deref().unwrap_or_default()).expect("JSON");
    assert_eq!(doc["id"], "e-2");
    assert_eq!(
        e2.spec.job.headers.get("content-type").map(String::as_str),
        Some("application/cloudevents+json")
    );

    // The queue is Addressable.
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let (queues, want_url, want_audience) = (&queues, url.as_str(), audience.as_str());
    eventually(20, "status.address", || async move {
        let q = queues.get("relayer").await.ok()?;
        let a = q.status?.address?;
        (a.url == want_url && a.audience.as_deref() == Some(want_audience)).then_some(())
    })
    .await;

    // Redrive: the same event arrives (binary mode: ce-* headers and the data).
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let name = rec.name_any();
    wait_phase(&api, &name, Phase::Parked, 20).await;
    decide(&api, &name, Action::Redrive, "ops").await;
    wait_phase(&api, &name, Phase::Redriven, 30).await;
    let posts = sink.posts();
    assert_eq!(posts.len(), 1);
    let p = &posts[0];
    assert_eq!(p.body, br#"{"intent":"pi_1"}"#);
    for (h, v) in [
        ("ce-id", "e-1"),
        ("ce-source", "/payments/relayer"),
        ("ce-type", "dev.payments.settle"),
        ("ce-specversion", "1.0"),
        ("ce-time", "2025-12-03T12:00:00Z"),
        ("content-type", "application/json"),
    ] {
        assert_eq!(p.header(h), Some(v), "{h}");
    }
    assert!(
        p.header("authorization").is_none(),
        "the sender's token is not kept"
    );
    assert!(op.metric("dlq_http_park_requests_total", &[("code", "201")]) >= 2.0);
}

fn base64_of(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[tokio::test]
async fn callers_without_the_right_and_bodies_that_cannot_be_records_are_refused() {
    let (client, ns) = setup("http-park-auth").await;
    let certs = certs();
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "http": {}}),
    )
    .await;
    create_dlq(
        &client,
        &ns,
        "closed",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}}),
    )
    .await;
    create_dlq(
        &client,
        &ns,
        "open",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "http": {"allowAnonymous": true}}),
    )
    .await;
    service_account(&client, &ns, "sender", true).await;
    service_account(&client, &ns, "stranger", false).await;
    // Anonymous callers are taken only from the pod network, which loopback is not.
    let (op, base) = operator_with_endpoint(&ns, &certs, "198.18.0.0/15");
    let url = queue_url(&base, &ns, "relayer");
    let ca = certs.ca_pem.as_str();
    endpoint_ready(&url, ca, 401).await;
    let audience = dlq_core::api::park_path(&ns, "relayer");
    let read = |p: PathBuf| std::fs::read_to_string(p).expect("token");
    let good = read(token(&client, &ns, "sender", &audience, &certs.dir).await);
    let wrong_audience = read(token(&client, &ns, "sender", "https://elsewhere", &certs.dir).await);
    let stranger = read(token(&client, &ns, "stranger", &audience, &certs.dir).await);
    let bearer = |t: &str| format!("Bearer {t}");
    fn event(id: &str) -> Vec<(&'static str, &str)> {
        vec![
            ("ce-specversion", "1.0"),
            ("ce-id", id),
            ("ce-source", "/t"),
            ("ce-type", "t"),
            ("content-type", "application/json"),
        ]
    }

    let none = post(&url, ca, &event("a"), b"{}".to_vec()).await;
    assert_eq!(none.status, 401, "{}", none.body);
    assert_eq!(
        none.headers.get("www-authenticate").map(String::as_str),
        Some("Bearer")
    );
    // A queue that allows anonymous parking still refuses a caller from outside the cluster.
    let outside = post(
        &queue_url(&base, &ns, "open"),
        ca,
        &event("a"),
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(outside.status, 401, "{}", outside.body);
    assert!(
        outside.body.contains("--park-anonymous-from") && outside.body.contains("127.0.0.1"),
        "{}",
        outside.body
    );
    let auth = bearer(&wrong_audience);
    let mut h = event("a");
    h.push(("authorization", &auth));
    assert_eq!(post(&url, ca, &h, b"{}".to_vec()).await.status, 401);
    let auth = bearer(&stranger);
    let mut h = event("a");
    h.push(("authorization", &auth));
    let r = post(&url, ca, &h, b"{}".to_vec()).await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("may not create deadletters"), "{}", r.body);
    let auth = bearer(&good);
    let mut h = event("a");
    h.push(("authorization", &auth));
    let closed = post(&queue_url(&base, &ns, "closed"), ca, &h, b"{}".to_vec()).await;
    assert_eq!(closed.status, 404, "no spec.http: {}", closed.body);

    // Over the size limit: 413, nothing parked.
    let big = vec![b'x'; dlq_core::cloudevent::MAX_BODY + 1];
    let r = post(&url, ca, &h, big).await;
    assert_eq!(r.status, 413, "{}", r.body);
    // A batch too long to park: 400 with the reason.
    let batch = format!("[{}]", vec!["{}"; 101].join(","));
    let r = post(
        &url,
        ca,
        &[
            ("authorization", &auth),
            ("content-type", "application/cloudevents-batch+json"),
        ],
        batch.into_bytes(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("at most 100"), "{}", r.body);
    // Hostile bytes claiming to be a structured event: an Invalid record of exactly them.
    let garbage: Vec<u8> = b"{\"specversion\":\"1.0\",\x00\xff\xfe<script>".to_vec();
    let r = post(
        &url,
        ca,
        &[
            ("authorization", &auth),
            ("content-type", "application/cloudevents+json"),
        ],
        garbage.clone(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let all = records(&client, &ns).await;
    assert_eq!(all.len(), 1, "only the garbage is a record");
    assert_eq!(all[0].spec.failure_kind, FailureKind::Invalid);
    assert_eq!(all[0].spec.job.payload_bytes().expect("bytes"), garbage);
    assert!(
        all[0].spec.reason.starts_with("not a CloudEvent 1.0"),
        "{}",
        all[0].spec.reason
    );
    // The same garbage again: the same record.
    let r = post(
        &url,
        ca,
        &[
            ("authorization", &auth),
            ("content-type", "application/cloudevents+json"),
        ],
        garbage,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(records(&client, &ns).await.len(), 1);
    let logs = op.logs();
    assert!(
        !logs.contains(&good) && !logs.contains(&stranger),
        "a token in the log"
    );
    assert!(op.metric("dlq_http_park_requests_total", &[("code", "401")]) >= 2.0);
}

#[tokio::test]
async fn a_full_queue_answers_429_and_the_senders_retry_parks_it_later() {
    let (client, ns) = setup("http-park-full").await;
    let certs = certs();
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "maxParked": 1,
               "http": {"allowAnonymous": true}}),
    )
    .await;
    // Loopback stands for the pod network here: anonymous parking is allowed from it.
    let (_op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "relayer");
    let ca = certs.ca_pem.as_str();
    // Anonymous parking is allowed here: a plain body with its headers, no token.
    let plain = |id: &'static str| {
        vec![
            ("content-type", "text/plain"),
            ("x-trace", "t-1"),
            ("x-dlq-job-id", id),
            ("x-dlq-reason", "gave up after 5 tries"),
        ]
    };
    let url_ref = url.as_str();
    let first = eventually(20, "the endpoint to park", || async move {
        let r = post(url_ref, ca, &plain("job-1"), b"first".to_vec()).await;
        (r.status != 503 && r.status != 404).then_some(r)
    })
    .await;
    assert_eq!(first.status, 201, "{}", first.body);
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let rec = records(&client, &ns).await.remove(0);
    assert_eq!(
        rec.spec.job.headers.get("x-trace").map(String::as_str),
        Some("t-1")
    );
    assert!(!rec.spec.job.headers.contains_key("x-dlq-job-id"));
    assert_eq!(rec.spec.reason, "gave up after 5 tries");
    wait_phase(&api, &rec.name_any(), Phase::Parked, 20).await;

    // Full: 429 at once, with Retry-After; nothing parked.
    let started = Instant::now();
    let full = post(&url, ca, &plain("job-2"), b"second".to_vec()).await;
    assert_eq!(full.status, 429, "{}", full.body);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered without waiting"
    );
    assert!(
        full.headers.contains_key("retry-after"),
        "{:?}",
        full.headers
    );
    // The endpoint has no backlog: the queue's status says how many it refused instead.
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(10, "status.http.refusedLastMinute 1", || async {
        let q = queues.get("relayer").await.ok()?;
        let refused = q.status?.http?.refused_last_minute;
        (refused == 1).then_some(())
    })
    .await;

    // The Go sender keeps its event and retries; a human drops the first record meanwhile.
    let ca_path = certs.ca.display().to_string();
    let sender = {
        let url = url.clone();
        std::thread::spawn(move || {
            cesender(&[
                "-url",
                &url,
                "-ca",
                &ca_path,
                "-mode",
                "batch",
                "-id",
                "e-late",
                "-source",
                "/t",
                "-retry-for",
                "60s",
            ])
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    decide(&api, &rec.name_any(), Action::Drop, "ops").await;
    let out = tokio::task::spawn_blocking(move || sender.join().expect("sender"))
        .await
        .expect("join");
    assert_eq!(codes(&out), [201], "{out}");
    let attempts: u32 = out
        .lines()
        .filter_map(|l| l.split("attempts=").nth(1))
        .filter_map(|s| s.trim().parse().ok())
        .next()
        .unwrap_or(0);
    assert!(attempts > 1, "the first tries met a full queue: {out}");
    let all = records(&client, &ns).await;
    assert!(
        all.iter().any(|r| r.spec.job.id == "e-late@/t"),
        "the retried event is parked: nothing lost"
    );
}

/// The park Service reaches only the replica that parks: the leader points the Service's
/// EndpointSlice at itself, a standby leaves it alone, and after a failover the new leader
/// takes it. (The replicas run on loopback; the addresses they announce stand for pod IPs.)
#[tokio::test]
async fn the_park_service_points_at_the_leader_and_follows_a_failover() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let (client, ns) = setup("http-park-leader").await;
    let certs = certs();
    let replica = |ns: &str, ip: &str| {
        let port = dlq_testenv::plane::free_port().expect("a free port");
        Operator::start_with(
            ns,
            &[
                "--leader-election=true",
                &format!("--park-addr=127.0.0.1:{port}"),
                &format!("--park-tls-dir={}", certs.dir.display()),
                "--park-service=dlq-park",
            ],
            &[("POD_NAMESPACE", ns), ("POD_IP", ip)],
        )
    };
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let address = || {
        let slices = slices.clone();
        async move {
            let slice = slices.get_opt("dlq-park").await.ok().flatten()?;
            slice.endpoints?.first()?.addresses.first().cloned()
        }
    };
    let mut first = replica(&ns, "198.18.0.1");
    eventually(30, "the slice at the first replica", || async {
        (address().await.as_deref() == Some("198.18.0.1")).then_some(())
    })
    .await;
    let _second = replica(&ns, "198.18.0.2");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        address().await.as_deref(),
        Some("198.18.0.1"),
        "a standby leaves the slice alone"
    );
    first.terminate();
    eventually(60, "the slice at the new leader", || async {
        (address().await.as_deref() == Some("198.18.0.2")).then_some(())
    })
    .await;
    let slice = slices.get("dlq-park").await.expect("the slice");
    assert_eq!(
        slice
            .metadata
            .labels
            .unwrap_or_default()
            .get("kubernetes.io/service-name")
            .map(String::as_str),
        Some("dlq-park")
    );
    let ports = slice.ports.unwrap_or_default();
    assert_eq!(ports[0].name.as_deref(), Some("park"));
}

/// POSTs with header values given as bytes (a sender writing Latin-1, say).
async fn post_raw(url: &str, ca: &str, headers: &[(&str, &[u8])], body: Vec<u8>) -> Reply {
    let client =
        deadletter::https::client::<Full<Bytes>>(Some(ca), "test CA", Duration::from_secs(5))
            .expect("client");
    let mut req = hyper::Request::post(url);
    for (n, v) in headers {
        req = req.header(
            *n,
            hyper::header::HeaderValue::from_bytes(v).expect("a value"),
        );
    }
    let res = client
        .request(req.body(Full::new(Bytes::from(body))).expect("request"))
        .await
        .expect("an answer");
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.map(|b| b.to_bytes());
    Reply {
        status,
        headers: BTreeMap::new(),
        body: String::from_utf8_lossy(&body.unwrap_or_default()).into_owned(),
    }
}

/// Hostile events from issue 45: two events whose 300-character ids differ only in the last
/// character are two records; a batch keeps each event's exact text (numbers no float can
/// hold); an extension attribute in bytes that are not text is refused, never accepted and
/// dropped.
#[tokio::test]
async fn hostile_events_are_parked_apart_and_exactly_or_refused() {
    let (client, ns) = setup("http-park-hostile").await;
    let certs = certs();
    create_dlq(
        &client,
        &ns,
        "open",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "http": {"allowAnonymous": true}}),
    )
    .await;
    let (_op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "open");
    let ca = certs.ca_pem.as_str();
    endpoint_ready(&url, ca, 201).await;
    let all = |client: Client, ns: String| async move {
        let mut r = records(&client, &ns).await;
        r.retain(|r| r.spec.failure_kind != FailureKind::Invalid || r.spec.job.id != "probe");
        r
    };

    // 1. Long ids differing only at the end: two records, each with its own data.
    let stem = "x".repeat(299);
    let mut names = Vec::new();
    for (last, data) in [("a", "{\"n\":1}"), ("b", "{\"n\":2}")] {
        let id = format!("{stem}{last}");
        let h = [
            ("ce-specversion", "1.0"),
            ("ce-id", id.as_str()),
            ("ce-source", "/hostile"),
            ("ce-type", "t"),
            ("content-type", "application/json"),
        ];
        let r = post(&url, ca, &h, data.as_bytes().to_vec()).await;
        assert_eq!(r.status, 201, "{}", r.body);
        names.push(r.body);
    }
    assert_ne!(names[0], names[1]);
    let parked = all(client.clone(), ns.clone()).await;
    let long: Vec<_> = parked
        .iter()
        .filter(|r| r.spec.job.id.starts_with("xxxx"))
        .collect();
    assert_eq!(long.len(), 2, "two events, two records");
    let mut data: Vec<_> = long
        .iter()
        .filter_map(|r| r.spec.job.payload.clone())
        .collect();
    data.sort();
    assert_eq!(data, ["{\"n\":1}", "{\"n\":2}"]);

    // 2. A batch: each event's exact text, numbers included.
    let one = r#"{"specversion":"1.0","id":"big-1","source":"/hostile","type":"t","data":{"d":12345678901234567890.12345678901234567890}}"#;
    let two = r#"{"specversion":"1.0","id":"big-2","source":"/hostile","type":"t","data":123456789012345678901234567890}"#;
    let batch = format!("[{one}, {two}]");
    let r = post(
        &url,
        ca,
        &[("content-type", "application/cloudevents-batch+json")],
        batch.into_bytes(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let parked = all(client.clone(), ns.clone()).await;
    for (id, text) in [("big-1@/hostile", one), ("big-2@/hostile", two)] {
        let rec = parked
            .iter()
            .find(|r| r.spec.job.id == id)
            .unwrap_or_else(|| panic!("{id} parked"));
        assert_eq!(rec.spec.job.payload.as_deref(), Some(text));
    }

    // 3. ce-subject in Latin-1: refused, nothing parked.
    let before = all(client.clone(), ns.clone()).await.len();
    let r = post_raw(
        &url,
        ca,
        &[
            ("ce-specversion", b"1.0"),
            ("ce-id", b"latin-1"),
            ("ce-source", b"/hostile"),
            ("ce-type", b"t"),
            ("ce-subject", b"caf\xe9"),
        ],
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("ce-subject"), "{}", r.body);
    assert_eq!(all(client.clone(), ns.clone()).await.len(), before);
    // Percent-encoded, as the HTTP binding asks, it parks and keeps the header.
    let r = post(
        &url,
        ca,
        &[
            ("ce-specversion", "1.0"),
            ("ce-id", "latin-1"),
            ("ce-source", "/hostile"),
            ("ce-type", "t"),
            ("ce-subject", "caf%C3%A9"),
        ],
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let rec = all(client.clone(), ns.clone())
        .await
        .into_iter()
        .find(|r| r.spec.job.id == "latin-1@/hostile")
        .expect("parked");
    assert_eq!(
        rec.spec.job.headers.get("ce-subject").map(String::as_str),
        Some("caf%C3%A9")
    );
}

/// A TLS connector trusting `ca_pem`, for connections the test writes byte by byte.
fn tls_connector(ca_pem: &str) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA pem")).expect("a root");
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// How one trickling connection ended: the status line it was answered with, if any, and
/// when (from `started`) the endpoint ended it.
struct Trickled {
    answer: Option<String>,
    ended: Duration,
}

/// A slowloris client over TLS: the pieces of `head` a second apart (a POST's request line, and
/// maybe its headers), then a byte a second (of a header, or of the body), until the endpoint
/// answers or closes the connection (at most `for_at_most` from `started`). It adds one to
/// `begun` once it has written its first bytes (or failed to).
async fn trickle(
    addr: String,
    connector: tokio_rustls::TlsConnector,
    head: Vec<String>,
    started: Instant,
    for_at_most: Duration,
    begun: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Trickled {
    let began = || begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ended = |answer: Option<String>| Trickled {
        answer,
        ended: started.elapsed(),
    };
    let Ok(tcp) = tokio::net::TcpStream::connect(&addr).await else {
        began();
        return ended(None);
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let Ok(tls) = connector.connect(name, tcp).await else {
        began();
        return ended(None);
    };
    let (mut rd, mut wr) = tokio::io::split(tls);
    let reading = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        while let Ok(Ok(n @ 1..)) = tokio::time::timeout(for_at_most, rd.read(&mut buf)).await {
            got.extend_from_slice(&buf[..n]);
        }
        got
    });
    let mut pieces = head.into_iter();
    let mut first = true;
    while !reading.is_finished() && started.elapsed() < for_at_most {
        let next = pieces.next().unwrap_or_else(|| "x".to_string());
        let written = wr.write_all(next.as_bytes()).await.is_ok() && wr.flush().await.is_ok();
        if std::mem::take(&mut first) {
            began();
        }
        if !written {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let at = started.elapsed();
    let got = reading.await.unwrap_or_default();
    let answer = String::from_utf8_lossy(&got)
        .lines()
        .next()
        .filter(|l| !l.is_empty())
        .map(str::to_string);
    Trickled { answer, ended: at }
}

/// Slowloris (issue 45 item 14): one client opening many connections gets at most 32 at once
/// (the rest are refused, and one that never asks is never answered), and a connection that
/// never finishes its TLS handshake, or trickles its headers, is closed within about 10 s, so
/// file descriptors cannot be exhausted.
#[tokio::test]
async fn trickling_clients_are_cut_off_and_cannot_hold_every_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_client, ns) = setup("http-park-slow").await;
    let certs = certs();
    let (op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "none");
    endpoint_ready(&url, &certs.ca_pem, 404).await;
    let addr = base.trim_start_matches("https://").to_string();

    // 60 connections that say nothing: 32 held, 28 refused; all closed once their handshake
    // is overdue (10 s).
    let started = Instant::now();
    let mut held = Vec::new();
    for _ in 0..60 {
        held.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect"),
        );
    }
    let mut ends = Vec::new();
    for mut c in held {
        ends.push(tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let _ = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf)).await;
            Instant::now()
        }));
    }
    let mut last = started;
    for end in ends {
        last = last.max(end.await.expect("joined"));
    }
    let all_closed = last.duration_since(started);
    dlq_testenv::report(&format!(
        "http_park slowloris: 60 silent connections, all closed after {all_closed:?}"
    ));
    // Those over the limit never asked: refused, and counted so, but not answered.
    let op = &op;
    eventually(5, "28 refusals counted unanswered", || async move {
        let unanswered = op.metric(
            "dlq_http_refused_total",
            &[("reason", "client_limit"), ("answered", "false")],
        );
        (unanswered >= 28.0).then_some(())
    })
    .await;
    assert!(all_closed < Duration::from_secs(15), "{all_closed:?}");

    // Headers trickled one line a second over TLS: closed within the header timeout.
    let connector = tls_connector(&certs.ca_pem);
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let mut tls = connector.connect(name, tcp).await.expect("handshake");
    let path = dlq_core::api::park_path(&ns, "none");
    tls.write_all(format!("POST {path} HTTP/1.1\r\nHost: x\r\n").as_bytes())
        .await
        .expect("request line");
    let started = Instant::now();
    let cut = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let line = format!("x-trickle-{}: 1\r\n", started.elapsed().as_secs());
        if tls.write_all(line.as_bytes()).await.is_err() || tls.flush().await.is_err() {
            break started.elapsed();
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(10), tls.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break started.elapsed(),
            Ok(Ok(_)) => break started.elapsed(), // an answer (408) ends it too
            Err(_) => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "still open after 30 s"
        );
    };
    dlq_testenv::report(&format!(
        "http_park slowloris: trickled headers cut after {cut:?}"
    ));
    assert!(cut < Duration::from_secs(15), "{cut:?}");
}

/// Issue 57 item 6: a connection over its client's limit is answered, never just closed. 60
/// connections from loopback trickle their headers over TLS, a byte a second: 32 hold their
/// client's slots, the other 28 are answered 429 with `Retry-After`. A real event from the
/// same address is answered at once (429 with `Retry-After` while the trickles hold the slots)
/// and parked by the Go SDK sender retrying as told once the trickles are cut at the header
/// timeout. Then 1,000 POSTs at once from that address, from a Rust client and again from the
/// Go sender: every one is answered, 2xx or 429/503 with `Retry-After`, none closed bare, and
/// each 201 is a record.
#[tokio::test]
async fn connections_over_a_clients_limit_are_answered_429_with_retry_after() {
    let (client, ns) = setup("http-park-refused").await;
    let certs = certs();
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "http": {"allowAnonymous": true}}),
    )
    .await;
    let (op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "relayer");
    let ca = certs.ca_pem.as_str();
    let addr = base.trim_start_matches("https://").to_string();
    let plain = |id: &str| {
        vec![
            ("content-type".to_string(), "text/plain".to_string()),
            ("x-dlq-job-id".to_string(), id.to_string()),
        ]
    };
    let url_ref = url.as_str();
    eventually(30, "the endpoint to park", || async move {
        let headers = [("content-type", "text/plain"), ("x-dlq-job-id", "probe")];
        let r = post(url_ref, ca, &headers, b"probe".to_vec()).await;
        (r.status == 201).then_some(())
    })
    .await;
    // The probe's client is gone; its connection closes and frees its slot.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // 60 trickling connections from 127.0.0.1.
    let connector = tls_connector(ca);
    let path = dlq_core::api::park_path(&ns, "relayer");
    let started = Instant::now();
    let begun = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let head = vec![format!("POST {path} HTTP/1.1\r\nHost: x\r\nx-trickle: ")];
    let trickles: Vec<_> = (0..60)
        .map(|_| {
            let (addr, connector, head, begun) =
                (addr.clone(), connector.clone(), head.clone(), begun.clone());
            let for_at_most = Duration::from_secs(30);
            tokio::spawn(trickle(addr, connector, head, started, for_at_most, begun))
        })
        .collect();
    let begun_ref = &begun;
    eventually(9, "the 60 trickles to begin", || async move {
        (begun_ref.load(std::sync::atomic::Ordering::SeqCst) == 60).then_some(())
    })
    .await;
    dlq_testenv::report(&format!(
        "http_park refusals: 60 trickles begun after {:?}",
        started.elapsed()
    ));

    // A real event from the same address: answered at once.
    let sender = sender(ca);
    let asked = Instant::now();
    let headers = plain("during-trickles");
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let first = send(&sender, &url, &headers, b"real".to_vec()).await;
    let answered_in = asked.elapsed();
    let first = first.unwrap_or_else(|e| panic!("the event got no HTTP answer: {e}"));
    dlq_testenv::report(&format!(
        "http_park refusals: an event beside 60 trickles answered {} in {answered_in:?}",
        first.status
    ));
    assert!(answered_in < Duration::from_secs(3), "{answered_in:?}");
    match first.status {
        201 => assert!(
            started.elapsed() > Duration::from_secs(9),
            "served beside 32 trickles"
        ),
        429 | 503 => assert!(
            first.headers.contains_key("retry-after"),
            "{:?}",
            first.headers
        ),
        other => panic!("answered {other}: {}", first.body),
    }

    // The Go SDK sender, retrying as Retry-After says, parks its event once the trickles are cut.
    let ca_path = certs.ca.display().to_string();
    let go = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            cesender(&[
                "-url",
                &url,
                "-ca",
                &ca_path,
                "-mode",
                "batch",
                "-id",
                "e-after-trickles",
                "-source",
                "/t",
                "-retry-for",
                "30s",
            ])
        })
    };
    let out = go.await.expect("cesender");
    let parked_after = started.elapsed();
    dlq_testenv::report(&format!(
        "http_park refusals: the Go sender's event parked {parked_after:?} after the trickles began: {}",
        out.trim()
    ));
    assert_eq!(codes(&out), [201], "{out}");
    assert!(parked_after < Duration::from_secs(16), "{parked_after:?}");

    let mut trickled = Vec::new();
    for t in trickles {
        trickled.push(t.await.expect("trickle"));
    }
    let answered_429 = trickled
        .iter()
        .filter(|t| {
            t.answer
                .as_deref()
                .is_some_and(|a| a.starts_with("HTTP/1.1 429"))
        })
        .count();
    let last_cut = trickled.iter().map(|t| t.ended).max().unwrap_or_default();
    dlq_testenv::report(&format!(
        "http_park refusals: 60 trickles, {answered_429} answered 429, the last cut after {last_cut:?}"
    ));
    assert!(
        answered_429 >= 28,
        "{answered_429} of the trickles answered 429"
    );
    assert!(last_cut < Duration::from_secs(15), "{last_cut:?}");

    // 1,000 sends at once from the Go SDK sender: copies of one event (its connections close
    // when it exits, so the next burst has the address's slots).
    let ca_path = certs.ca.display().to_string();
    let go_url = url.clone();
    let out = tokio::task::spawn_blocking(move || {
        cesender(&[
            "-url", &go_url, "-ca", &ca_path, "-mode", "binary", "-id", "e-burst", "-source", "/t",
            "-copies", "1000",
        ])
    })
    .await
    .expect("cesender");
    let summary = out.lines().last().unwrap_or_default().to_string();
    dlq_testenv::report(&format!(
        "http_park refusals: 1,000 Go sends at once: {summary}"
    ));
    let go_codes = codes(&out);
    let go_429 = go_codes.iter().filter(|c| **c == 429).count();
    assert_eq!(go_codes.len(), 1000, "{summary}");
    assert!(
        go_codes.iter().all(|c| matches!(c, 200 | 201 | 429 | 503)),
        "a copy without an HTTP answer (0) or another status: {summary}"
    );

    // 1,000 POSTs at once from the same address, from a Rust client.
    let burst = Instant::now();
    let posts: Vec<_> = (0..1000)
        .map(|n| {
            let (sender, url) = (sender.clone(), url.clone());
            tokio::spawn(async move {
                let id = format!("burst-{n}");
                let headers = [
                    ("content-type", "text/plain"),
                    ("x-dlq-job-id", id.as_str()),
                ];
                let sent = send(&sender, &url, &headers, b"burst".to_vec());
                match tokio::time::timeout(Duration::from_secs(60), sent).await {
                    Ok(answer) => answer,
                    Err(_) => Err("no answer in 60 s".to_string()),
                }
            })
        })
        .collect();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut bare = Vec::new();
    for p in posts {
        match p.await.expect("post") {
            Ok(r) => {
                *statuses.entry(r.status).or_default() += 1;
                assert!(
                    matches!(r.status, 200 | 201 | 429 | 503),
                    "answered {}: {}",
                    r.status,
                    r.body
                );
                if r.status >= 429 {
                    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
                }
            }
            Err(e) => bare.push(e),
        }
    }
    dlq_testenv::report(&format!(
        "http_park refusals: 1,000 POSTs at once from one address in {:?}: {statuses:?}, {} without an answer",
        burst.elapsed(),
        bare.len()
    ));
    assert!(
        bare.is_empty(),
        "{} closed without an answer, e.g. {:?}",
        bare.len(),
        bare.first()
    );
    let created = statuses.get(&201).copied().unwrap_or(0);
    let burst_records = records(&client, &ns)
        .await
        .iter()
        .filter(|r| r.spec.job.id.starts_with("burst-"))
        .count();
    assert_eq!(
        burst_records, created,
        "one record for each 201, none for a refusal"
    );

    let refused = op.metric(
        "dlq_http_refused_total",
        &[("reason", "client_limit"), ("answered", "true")],
    );
    let counted = answered_429 + go_429 + statuses.get(&429).copied().unwrap_or(0);
    assert!(
        refused >= counted as f64,
        "{refused} counted, {counted} seen"
    );
}

/// Issue 57 item 6, the rest: a client trickling its *body* starves no one sharing its
/// address for longer than the header timeout. 40 connections from loopback send a POST over
/// TLS, its headers a line a second for 5 s (a body of 4,096 bytes announced), then its body a
/// byte a second: 32 hold their address's slots, the other 8 are answered 429. A request that
/// has not brought its minimum (1 KiB a second over each 10 s, the first from its connection's
/// accept) is answered 408 and its slot freed, so the Go SDK sender, from the same address and
/// retrying as told, parks its event within about 10 s of the trickles' start (before: 35 s,
/// the body timeout after the headers), and every trickle gets an answer;
/// `dlq_http_refused_total{reason="slow_body"}` counts them.
#[tokio::test]
async fn clients_trickling_bodies_are_answered_408_and_free_their_slots_within_10_s() {
    let (client, ns) = setup("http-park-slow-body").await;
    let certs = certs();
    create_dlq(
        &client,
        &ns,
        "relayer",
        json!({"target": {"http": {"url": "http://127.0.0.1:9/x"}}, "http": {"allowAnonymous": true}}),
    )
    .await;
    let (op, base) = operator_with_endpoint(&ns, &certs, "127.0.0.0/8");
    let url = queue_url(&base, &ns, "relayer");
    let ca = certs.ca_pem.as_str();
    let addr = base.trim_start_matches("https://").to_string();
    let url_ref = url.as_str();
    eventually(30, "the endpoint to park", || async move {
        let headers = [("content-type", "text/plain"), ("x-dlq-job-id", "probe")];
        let r = post(url_ref, ca, &headers, b"probe".to_vec()).await;
        (r.status == 201).then_some(())
    })
    .await;
    // The probe's client is gone; its connection closes and frees its slot.
    tokio::time::sleep(Duration::from_secs(1)).await;

    const TRICKLES: usize = 40;
    let connector = tls_connector(ca);
    let path = dlq_core::api::park_path(&ns, "relayer");
    let started = Instant::now();
    let begun = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let trickles: Vec<_> = (0..TRICKLES)
        .map(|n| {
            let mut head = vec![format!("POST {path} HTTP/1.1\r\nHost: x\r\n")];
            head.extend((0..4).map(|i| format!("x-slow-{i}: {n}\r\n")));
            head.push(format!(
                "content-type: text/plain\r\nx-dlq-job-id: slow-{n}\r\ncontent-length: 4096\r\n\r\n"
            ));
            let (addr, connector, begun) = (addr.clone(), connector.clone(), begun.clone());
            let for_at_most = Duration::from_secs(40);
            tokio::spawn(trickle(addr, connector, head, started, for_at_most, begun))
        })
        .collect();
    let begun_ref = &begun;
    eventually(9, "the trickles to begin", || async move {
        (begun_ref.load(std::sync::atomic::Ordering::SeqCst) == TRICKLES).then_some(())
    })
    .await;
    let all_begun = started.elapsed();

    // The Go SDK sender, from the same address, retrying as Retry-After says.
    let ca_path = certs.ca.display().to_string();
    let go = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            cesender(&[
                "-url",
                &url,
                "-ca",
                &ca_path,
                "-mode",
                "batch",
                "-id",
                "e-beside-slow-bodies",
                "-source",
                "/t",
                "-retry-for",
                "45s",
            ])
        })
    };
    let out = go.await.expect("cesender");
    let parked_after = started.elapsed();

    let mut trickled = Vec::new();
    for t in trickles {
        trickled.push(t.await.expect("trickle"));
    }
    let answered = |status: &str| {
        trickled
            .iter()
            .filter(|t| {
                t.answer
                    .as_deref()
                    .is_some_and(|a| a.starts_with(&format!("HTTP/1.1 {status}")))
            })
            .count()
    };
    let (answered_408, answered_429) = (answered("408"), answered("429"));
    let last_cut = trickled.iter().map(|t| t.ended).max().unwrap_or_default();
    let slow_body = op.metric(
        "dlq_http_refused_total",
        &[("reason", "slow_body"), ("answered", "true")],
    );
    dlq_testenv::report(&format!(
        "http_park slow bodies: {TRICKLES} trickled bodies (begun in {all_begun:?}); the Go sender's event from the same address parked {parked_after:?} after they began ({}); {answered_408} answered 408, {answered_429} answered 429, the last cut after {last_cut:?}; slow_body refusals counted answered: {slow_body}",
        out.trim()
    ));
    assert_eq!(codes(&out), [201], "{out}");
    assert!(
        parked_after < Duration::from_secs(14),
        "the neighbour waited {parked_after:?}: slow bodies held its address's slots"
    );
    assert_eq!(
        answered_408 + answered_429,
        TRICKLES,
        "every trickle answered: {answered_408} 408, {answered_429} 429"
    );
    assert!(answered_408 >= 32, "{answered_408} answered 408");
    assert!(last_cut < Duration::from_secs(15), "{last_cut:?}");
    assert!(slow_body >= 32.0, "{slow_body} counted");
    assert!(
        records(&client, &ns)
            .await
            .iter()
            .all(|r| !r.spec.job.id.starts_with("slow-")),
        "a slow body is never parked"
    );
}

/// `n` silent TCP connections to `addr`, from 127.0.0.2 on, [`MAX_CONNECTIONS_PER_CLIENT`]
/// from each address.
async fn hold_silent(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    use deadletter::source::http::connections::MAX_CONNECTIONS_PER_CLIENT;
    use futures::StreamExt;
    futures::stream::iter(0..n)
        .map(|n| async move {
            let from =
                std::net::Ipv4Addr::new(127, 0, 0, 2 + (n / MAX_CONNECTIONS_PER_CLIENT) as u8);
            let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
            socket
                .bind((from, 0).into())
                .unwrap_or_else(|e| panic!("binding {from}: {e}"));
            socket.connect(addr).await.expect("connect")
        })
        .buffer_unordered(16)
        .collect()
        .await
}

/// The endpoint's own limit (4,096 connections; `--park-max-connections` 64 here, so the
/// test needs no more descriptors than any other): 127.0.0.2 and 127.0.0.3 hold 32 silent
/// connections each, and a request from 127.0.0.1 is answered 503 with `Retry-After: 1` and
/// `Connection: close` (not closed bare) and counted (`connection_limit`, answered); once the
/// silent ones are cut at the header timeout, the same request is served.
#[tokio::test]
async fn a_full_endpoint_answers_503_with_retry_after() {
    use deadletter::source::http::connections::MAX_CONNECTIONS_PER_CLIENT;
    const MAX: usize = 64;
    let (_client, ns) = setup("http-park-full").await;
    let certs = certs();
    let max = format!("--park-max-connections={MAX}");
    let (op, base) = operator_with_endpoint_and(&ns, &certs, "127.0.0.0/8", &[&max]);
    let url = queue_url(&base, &ns, "none");
    let ca = certs.ca_pem.as_str();
    endpoint_ready(&url, ca, 404).await;
    let addr: std::net::SocketAddr = base
        .trim_start_matches("https://")
        .parse()
        .expect("an address");
    let addresses = MAX / MAX_CONNECTIONS_PER_CLIENT;
    // Sent until refused (the endpoint counts a connection once it accepts it), each time on
    // a connection of its own: a kept-alive one would hold its slot and be served.
    let url_ref = url.as_str();
    let ask = || async move {
        let headers = [("content-type", "text/plain")];
        send(&sender(ca), url_ref, &headers, b"x".to_vec())
            .await
            .ok()
    };
    // The endpoint cuts the silent connections 10 s after it accepted them (its header
    // timeout): on a loaded machine the connects and the first TLS asks can take that long,
    // and the asks are then served. Such a round is not the behaviour under test, so the
    // connections are dropped and held again, up to three rounds; a full endpoint that never
    // answers 503 fails all three.
    let mut round = 0;
    let (held, refused, connected, started) = loop {
        round += 1;
        let started = Instant::now();
        let held = hold_silent(addr, MAX).await;
        let connected = started.elapsed();
        let deadline = Instant::now() + Duration::from_secs(8);
        let mut refused = None;
        while refused.is_none() && Instant::now() < deadline {
            refused = ask().await.filter(|r| r.status == 503);
            if refused.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        match refused {
            Some(r) => break (held, r, connected, started),
            None if round < 3 => {
                dlq_testenv::report(&format!(
                    "http_park full endpoint: round {round} saw no 503 (connected in {connected:?}); holding again"
                ));
                drop(held);
            }
            None => panic!("no 503 from the full endpoint in {round} rounds"),
        }
    };
    let refused_after = started.elapsed();
    dlq_testenv::report(&format!(
        "http_park full endpoint: {} connections from {addresses} addresses in {connected:?}; a request from another answered 503 after {refused_after:?}: {:?} {}",
        held.len(),
        refused.headers.get("retry-after"),
        refused.body
    ));
    assert_eq!(
        refused.headers.get("retry-after").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        refused.headers.get("connection").map(String::as_str),
        Some("close")
    );
    assert!(refused.body.contains("try again"), "{}", refused.body);
    let op = &op;
    eventually(5, "the refusal counted answered", || async move {
        let answered = op.metric(
            "dlq_http_refused_total",
            &[("reason", "connection_limit"), ("answered", "true")],
        );
        (answered >= 1.0).then_some(())
    })
    .await;
    // The silent connections are cut at the header timeout: the endpoint serves again.
    eventually(20, "the endpoint to serve again", || async move {
        ask().await.filter(|r| r.status == 404)
    })
    .await;
    drop(held);
}
