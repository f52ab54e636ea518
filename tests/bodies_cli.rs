//! Stored bodies (issue 48 item 4) from the user's side, against a real apiserver (audited),
//! etcd, redis-server and an S3-compatible server (versitygw): the reveal API reads a record's
//! body from the bucket through the operator (the store's credentials never leave it), so
//! `kubectl dlq show` prints its size, digest, reference and first KiB (masked), `show --body`
//! downloads the exact bytes as the caller (the unmasked view: audited, announced by a
//! `PayloadRevealed` Event), a caller without the reveal role is refused, and an object deleted
//! or changed in the bucket is answered `BodyMissing`/`BodyCorrupt`; the page shows size and
//! digest instead of the payload (screenshot `body.png` in target/ui-screenshots). The HTTP park
//! endpoint takes bodies up to the queue's `maxBytes` into the store (a 3 MiB POST parked and
//! redriven byte-exact), answers 413 above it whether the length is declared or streamed
//! (nothing kept), and `kubectl dlq park --payload @file` (or `@-`, stdin) sends a payload over
//! a record's limit to the queue's park endpoint.

use std::process::{Command, Stdio};
use std::time::Instant;

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_core::park::record_name;
use dlq_testenv::brokers::Redis;
use dlq_testenv::brokers::s3::S3Server;
use dlq_testenv::reveal::{register_reveal_api, reveal_certificate};
use dlq_testenv::{
    Operator, audited_plane, create_dlq, create_secret, decide, eventually, kubectl_dlq_on, report,
    setup_on, wait_phase,
};
use kube::Client;
use kube::api::Api;
use redis::AsyncCommands;
use serde_json::json;

const BUCKET: &str = "dlq-bodies";
const PREFIX: &str = "cli/";
const DEAD: &str = "relayer:dead";
/// The sealed queue's dead list.
const SEALED_DEAD: &str = "sealed:dead";
const JOBS: &str = "relayer:jobs";
/// The HTTP queue's target: a stream, which carries the event's headers.
const STREAM: &str = "ingest:jobs";
/// `spec.bodies.maxBytes` of the test queues.
const MAX_BYTES: usize = 8 << 20;

/// MiB of the body `show` and `show --body` read (`DLQ_BODIES_CLI_MIB`, default 2; its queue's
/// `maxBytes` grows to fit, for measuring larger downloads).
fn show_mib() -> usize {
    std::env::var("DLQ_BODIES_CLI_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}
/// The card number in the bodies' first KiB: shown masked, downloaded exactly.
const CARD: &str = "4111111111111111";

/// `len` bytes of text: a JSON-ish head holding [`CARD`], then printable bytes that differ
/// per `seed`.
fn body(seed: u8, len: usize) -> Vec<u8> {
    let mut out = format!("{{\"card\":\"{CARD}\",\"seed\":{seed},\"data\":\"").into_bytes();
    let mut x = u32::from(seed).wrapping_mul(2_654_435_761) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.push(b'a' + (x >> 24) as u8 % 26);
    }
    out.truncate(len);
    out
}

fn sha256(bytes: &[u8]) -> String {
    dlq_core::body::sha256_hex(bytes)
}

/// The S3 credentials Secret `s3`.
async fn s3_secret(client: &Client, ns: &str, s3: &S3Server) {
    s3.credentials_secret(client, ns, "s3").await;
}

/// Queue `name`: Redis list target, bodies in the bucket above 64 KiB up to `max_bytes`;
/// `extra` merged into its spec (a source, `http`).
async fn queue(
    client: &Client,
    ns: &str,
    name: &str,
    s3: &S3Server,
    max_bytes: usize,
    extra: serde_json::Value,
) {
    let mut spec = json!({
        "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "list": JOBS}},
        "bodies": {
            "thresholdBytes": 65536,
            "maxBytes": max_bytes,
            "s3": {"bucket": BUCKET, "prefix": PREFIX, "endpoint": s3.endpoint(),
                   "region": "us-east-1", "credentialsSecretRef": {"name": "s3"}},
        },
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    create_dlq(client, ns, name, spec).await;
}

fn envelope(id: &str, payload: &[u8]) -> String {
    json!({
        "id": id,
        "payload": String::from_utf8_lossy(payload),
        "reason": "consumer gave up",
    })
    .to_string()
}

async fn parked(api: &Api<DeadLetter>, queue: &str, id: &str) -> DeadLetter {
    let name = record_name(queue, id, 1);
    eventually(60, &format!("record of {id}"), || async {
        api.get_opt(&name).await.ok().flatten()
    })
    .await
}

/// Waits until the target stream holds an entry whose payload is `want`; returns its fields.
async fn delivered_to_stream(redis: &Redis, want: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;
    eventually(60, "the job on the stream, byte-exact", || async {
        let mut c = redis.conn().await;
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(STREAM)
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await
            .ok()?;
        entries
            .into_iter()
            .map(|(_, f)| f)
            .find(|f| f.iter().any(|(k, v)| k == b"payload" && v == want))
    })
    .await
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

/// `kubectl dlq [--as user] show job --body > file`: (success, the file's bytes, stderr).
fn download(
    ns: &str,
    user: Option<&str>,
    job: &str,
    file: &std::path::Path,
) -> (bool, Vec<u8>, String) {
    let out = std::fs::File::create(file).expect("the download's file");
    let mut cmd = Command::new(dlq_testenv::bin("kubectl-dlq"));
    cmd.arg("--kubeconfig")
        .arg(&audited_plane().kubeconfig)
        .args(["-n", ns]);
    if let Some(user) = user {
        cmd.args(["--as", user]);
    }
    let done = cmd
        .args(["show", job, "--body"])
        .stdin(Stdio::null())
        .stdout(out)
        .output()
        .expect("kubectl-dlq runs");
    (
        done.status.success(),
        std::fs::read(file).unwrap_or_default(),
        String::from_utf8_lossy(&done.stderr).into_owned(),
    )
}

/// Notes of the Events on record `name` with `reason`.
async fn notes(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<String> {
    dlq_testenv::events_for(client, ns, name, reason)
        .await
        .into_iter()
        .filter_map(|e| e.note)
        .collect()
}

/// The page of record `name` as the admin: the body's size and digest instead of a payload;
/// Reveal shows its first KiB masked (screenshot `body.png`).
async fn page_shows_the_body(ns: &str, name: &str) -> (String, String, String) {
    let ui = dlq_testenv::ui_page::UiPage::start(audited_plane(), ns, None);
    let b = dlq_testenv::browser::Browser::start("bodies-cli").await;
    b.client.goto(&ui.url).await.expect("the page's URL");
    b.client
        .goto(&format!("{}/r/{ns}/{name}", ui.base()))
        .await
        .expect("the record's page");
    let size = b.text("#body-size").await;
    let digest = b.text("#body-sha256").await;
    b.click("#reveal").await;
    let head = b.text("#revealed-payload").await;
    b.screenshot("body").await;
    b.stop().await;
    drop(ui);
    (size, digest, head)
}

#[tokio::test]
async fn show_prints_a_stored_bodys_facts_and_head_and_body_downloads_its_exact_bytes() {
    let started = Instant::now();
    let (client, ns) = setup_on(audited_plane(), "bodies-cli").await;
    let redis = Redis::start();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    s3_secret(&client, &ns, &s3).await;
    queue(
        &client,
        &ns,
        "relayer",
        &s3,
        MAX_BYTES.max((show_mib() + 1) << 20),
        json!({"source": {"redis": {"list": DEAD}}}),
    )
    .await;
    let (tls_dir, ca_pem) = reveal_certificate(&ns);
    let port = dlq_testenv::plane::free_port().expect("a free port");
    let op = Operator::start_on(
        &audited_plane().kubeconfig,
        &ns,
        &[
            &format!("--reveal-addr=127.0.0.1:{port}"),
            &format!("--reveal-tls-dir={}", tls_dir.display()),
        ],
        &[],
    );
    register_reveal_api(&client, &ns, port, &ca_pem).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    // A 2 MiB body, parked from Redis into the bucket.
    let big = body(1, show_mib() << 20);
    let (size_shown, bytes_shown) = (format!("{}.0 MiB", show_mib()), big.len().to_string());
    let mut conn = redis.conn().await;
    let _: () = conn
        .lpush(DEAD, envelope("big", &big))
        .await
        .expect("LPUSH");
    let record = parked(&api, "relayer", "big").await;
    let name = record.metadata.name.clone().unwrap_or_default();
    let reference = record.spec.job.body.as_deref().expect("a stored body");
    assert_eq!(reference.sha256, sha256(&big));

    // show: size, digest, reference and the first KiB, masked, through the reveal API.
    let (ok, out, err) = eventually(20, "show with the body's head", || async {
        let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "big"]);
        (ok && out.contains("Body head:") && !out.contains("(not shown")).then_some((ok, out, err))
    })
    .await;
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("{size_shown} ({bytes_shown} bytes)")),
        "{out}"
    );
    assert!(out.contains(&sha256(&big)), "{out}");
    assert!(out.contains(&reference.reference), "{out}");
    assert!(
        out.contains("411111******1111") && !out.contains(CARD),
        "the head masked: {out}"
    );
    let head_line = out
        .lines()
        .skip_while(|l| !l.starts_with("Body head:"))
        .nth(1)
        .unwrap_or_default()
        .to_string();
    assert_eq!(head_line.len(), 1024, "the first KiB: {head_line}");
    assert_eq!(
        head_line.replace("411111******1111", CARD).as_bytes(),
        &big[..1024]
    );

    // show --body: the exact bytes, streamed, as the caller.
    let file = std::env::temp_dir().join(format!("dlq-body-{}-{ns}", std::process::id()));
    let timer = Instant::now();
    let (ok, got, err) = download(&ns, None, "big", &file);
    let took = timer.elapsed();
    assert!(ok, "{err}");
    assert!(got == big, "the download differs ({} bytes)", got.len());
    report(&format!(
        "bodies_cli: show --body of {} MiB through the apiserver and the reveal API in {took:?}",
        show_mib()
    ));

    // Who may read records but not reveal them: refused, naming the role; show says why the
    // head is not shown and still prints the rest.
    grant_viewing(&ns, "bob");
    let (ok, got, err) = eventually(10, "bob's refusal", || async {
        let r = download(&ns, Some("bob"), "big", &file);
        (!r.0 && r.2.contains("dlq-payload-reader")).then_some(r)
    })
    .await;
    assert!(!ok && got.is_empty(), "{err}");
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["--as", "bob", "show", "big"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&sha256(&big))
            && out.contains("(not shown:")
            && out.contains("dlq-payload-reader"),
        "{out}"
    );
    assert!(
        !out.contains(CARD) && !out.contains("411111******"),
        "{out}"
    );

    // The page: size and digest instead of the payload; Reveal shows the first KiB masked.
    let (size, digest, head) = page_shows_the_body(&ns, &name).await;
    assert!(
        size.contains(&size_shown) && size.contains(&bytes_shown),
        "{size}"
    );
    assert_eq!(digest.trim(), sha256(&big));
    assert!(
        head.contains("411111******1111") && !head.contains(CARD),
        "{head}"
    );

    // Announced and audited: the download as the unmasked view.
    let revealed = eventually(10, "PayloadRevealed Events", || async {
        let n = notes(&client, &ns, &name, "PayloadRevealed").await;
        n.iter()
            .any(|n| n.contains(&format!("the body's {bytes_shown} bytes")))
            .then_some(n)
    })
    .await;
    assert!(!revealed.iter().any(|n| n.contains(CARD)), "{revealed:?}");
    let audit = std::fs::read_to_string(audited_plane().audit_log.as_ref().expect("audited"))
        .unwrap_or_default();
    let downloads = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            e["objectRef"]["resource"] == "deadletterpayloads"
                && e["objectRef"]["subresource"] == "unmasked"
                && e["objectRef"]["name"] == name.as_str()
        })
        .map(|e| e["responseStatus"]["code"].as_i64().unwrap_or_default())
        .collect::<Vec<_>>();
    assert!(
        downloads.contains(&200) && downloads.contains(&403),
        "audit of the downloads: {downloads:?}"
    );

    // Deleted from the bucket: BodyMissing, nothing written; changed: BodyCorrupt.
    let key = format!("{PREFIX}sha256/{}", sha256(&big));
    s3.delete_object(BUCKET, &key).await;
    let (ok, got, err) = download(&ns, None, "big", &file);
    assert!(!ok && err.contains("BodyMissing"), "{err}");
    assert!(got.is_empty(), "nothing of a missing body written");
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "big"]);
    assert!(ok && out.contains("BodyMissing"), "{out}{err}");
    let mut changed = big.clone();
    changed[5000] ^= 1;
    s3.put_object(BUCKET, &key, changed).await;
    let (ok, got, err) = download(&ns, None, "big", &file);
    assert!(!ok && err.contains("BodyCorrupt"), "{err}");
    assert!(got.is_empty(), "nothing of a changed body written");
    let failed = eventually(10, "RevealFailed Events", || async {
        let n = notes(&client, &ns, &name, "RevealFailed").await;
        (n.iter().any(|n| n.contains("BodyMissing")) && n.iter().any(|n| n.contains("BodyCorrupt")))
            .then_some(n)
    })
    .await;
    assert!(!failed.iter().any(|n| n.contains(CARD)), "{failed:?}");

    // A sealed queue: the bucket holds ciphertext; show opens the head (masked) and --body
    // downloads the exact plaintext.
    let (identity, recipient) = dlq_core::seal::generate_identity();
    create_secret(&client, &ns, "seal", "identity", &identity).await;
    queue(
        &client,
        &ns,
        "sealed",
        &s3,
        MAX_BYTES,
        json!({
            "source": {"redis": {"list": SEALED_DEAD}},
            "protection": {"seal": {"identitySecretRef": {"name": "seal"}}},
        }),
    )
    .await;
    let secret = body(5, 300_000);
    let _: () = conn
        .lpush(SEALED_DEAD, envelope("sealed-1", &secret))
        .await
        .expect("LPUSH");
    let record = parked(&api, "sealed", "sealed-1").await;
    let sealed = record.spec.job.body.as_deref().expect("a stored body");
    assert_eq!(sealed.recipient.as_deref(), Some(recipient.as_str()));
    let object = s3
        .get_object(
            BUCKET,
            sealed
                .reference
                .trim_start_matches(&format!("s3://{BUCKET}/")),
        )
        .await
        .expect("the sealed object");
    assert!(
        !object.windows(CARD.len()).any(|w| w == CARD.as_bytes()),
        "the bucket holds ciphertext only"
    );
    let (ok, out, err) = kubectl_dlq_on(audited_plane(), &ns, &["show", "sealed-1"]);
    assert!(ok, "{err}");
    // A sealed body's size and digest are the stored ciphertext's.
    assert!(
        out.contains(&format!("({} bytes, sealed", sealed.size)) && out.contains(&sealed.sha256),
        "{out}"
    );
    assert!(out.contains(&format!("to {recipient}")), "{out}");
    assert!(
        out.contains("411111******1111") && !out.contains(CARD),
        "the opened head, masked: {out}"
    );
    let (ok, got, err) = download(&ns, None, "sealed-1", &file);
    assert!(ok, "{err}");
    assert!(
        got == secret,
        "the sealed body's download differs ({} bytes)",
        got.len()
    );
    assert!(
        !op.logs().contains(CARD),
        "the card is in the operator's log"
    );
    assert!(
        !op.logs().contains(s3.secret_key()),
        "no credentials in the log"
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_dir_all(tls_dir);
    report(&format!(
        "bodies_cli: show/--body/page/refusals in {:?}",
        started.elapsed()
    ));
}

/// POSTs the file `path` to `url` with curl (`chunked`: without a declared length), as a
/// plain body with job id `id`: (status, answer).
/// `kubectl dlq park --queue ingest --id ID --payload @-` with `payload` on its stdin:
/// (success, stdout, stderr).
fn park_from_stdin(ns: &str, id: &str, payload: &[u8]) -> (bool, String, String) {
    use std::io::Write;
    let kubeconfig = audited_plane().kubeconfig.clone();
    let mut child = std::process::Command::new(dlq_testenv::bin("kubectl-dlq"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "-n",
            ns,
            "park",
            "--queue",
            "ingest",
            "--id",
            id,
            "--payload",
            "@-",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl-dlq runs");
    let mut stdin = child.stdin.take().expect("its stdin");
    let bytes = payload.to_vec();
    // A refusal may close stdin early: the writer's broken pipe is expected then.
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&bytes);
    });
    let out = child.wait_with_output().expect("kubectl-dlq ends");
    let _ = writer.join();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn post_file(url: &str, path: &std::path::Path, id: &str, chunked: bool) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-w", "\n%{http_code}", "-H"])
        .arg(format!("x-dlq-job-id: {id}"))
        .args(["-H", "content-type: application/octet-stream"]);
    if chunked {
        cmd.args(["-H", "Transfer-Encoding: chunked"]);
    }
    let out = cmd
        .arg("--data-binary")
        .arg(format!("@{}", path.display()))
        .arg(url)
        .output()
        .expect("curl runs");
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[tokio::test]
async fn the_http_endpoint_parks_large_bodies_into_the_store_and_refuses_above_max_bytes() {
    let started = Instant::now();
    let (client, ns) = setup_on(audited_plane(), "bodies-http").await;
    let redis = Redis::start();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    create_secret(&client, &ns, "redis", "url", &redis.url()).await;
    s3_secret(&client, &ns, &s3).await;
    queue(
        &client,
        &ns,
        "ingest",
        &s3,
        MAX_BYTES,
        json!({
            "http": {"allowAnonymous": true},
            "target": {"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "stream": STREAM}},
        }),
    )
    .await;
    let port = dlq_testenv::plane::free_port().expect("a free port");
    let base = format!("http://127.0.0.1:{port}");
    let _op = Operator::start_on(
        &audited_plane().kubeconfig,
        &ns,
        &[
            &format!("--park-addr=127.0.0.1:{port}"),
            "--park-plaintext",
            &format!("--park-url={base}"),
            "--park-anonymous-from=127.0.0.1/32",
        ],
        &[],
    );
    let url = format!("{base}{}", dlq_core::api::park_path(&ns, "ingest"));
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let dir = std::env::temp_dir().join(format!("dlq-bodies-http-{}-{ns}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a dir");

    // 3 MiB: parked into the store, its record a reference.
    let big = body(2, 3 << 20);
    let big_file = dir.join("big");
    std::fs::write(&big_file, &big).expect("the file");
    let timer = Instant::now();
    let (code, answer) = eventually(30, "the endpoint to park", || async {
        let r = post_file(&url, &big_file, "big-1", false);
        (r.0 != 503 && r.0 != 404).then_some(r)
    })
    .await;
    assert_eq!(code, 201, "{answer}");
    report(&format!(
        "bodies_cli: a 3 MiB POST parked into the store in {:?}",
        timer.elapsed()
    ));
    let record = parked(&api, "ingest", "big-1").await;
    let reference = record.spec.job.body.as_deref().expect("a stored body");
    assert_eq!(reference.size, big.len() as i64);
    assert_eq!(reference.sha256, sha256(&big));
    assert!(record.spec.job.payload.is_none() && record.spec.job.payload_base64.is_none());
    let key = format!("{PREFIX}sha256/{}", sha256(&big));
    assert_eq!(s3.get_object(BUCKET, &key).await.as_deref(), Some(&big[..]));
    // The same POST again: the same record.
    let (code, answer) = post_file(&url, &big_file, "big-1", false);
    assert_eq!(code, 200, "{answer}");
    // Streamed without a declared length: counted as it arrives, parked all the same.
    let streamed = body(6, (2 << 20) + 12345);
    let streamed_file = dir.join("streamed");
    std::fs::write(&streamed_file, &streamed).expect("the file");
    let (code, answer) = post_file(&url, &streamed_file, "streamed-1", true);
    assert_eq!(code, 201, "{answer}");
    let streamed_record = parked(&api, "ingest", "streamed-1").await;
    assert_eq!(
        streamed_record
            .spec
            .job
            .body
            .as_deref()
            .map(|b| b.sha256.clone()),
        Some(sha256(&streamed))
    );

    // Over maxBytes, declared or streamed: 413, nothing kept.
    let huge_file = dir.join("huge");
    std::fs::write(&huge_file, body(3, MAX_BYTES + (1 << 20))).expect("the file");
    for (id, chunked) in [("huge-declared", false), ("huge-streamed", true)] {
        let (code, answer) = post_file(&url, &huge_file, id, chunked);
        assert_eq!(code, 413, "{id}: {answer}");
        assert!(answer.contains("maxBytes"), "{answer}");
    }
    let records = api.list(&Default::default()).await.expect("records").items;
    assert_eq!(records.len(), 2, "only the 3 MiB and the streamed records");
    let mut keys = s3.list_keys(BUCKET, PREFIX).await;
    keys.sort();
    let mut want = vec![key.clone(), format!("{PREFIX}sha256/{}", sha256(&streamed))];
    want.sort();
    assert_eq!(keys, want, "nothing else in the bucket");

    // Hostile: a job id longer than a record takes, on a body over the threshold. The body goes
    // to the store first; the request then fails validation and is parked as an Invalid record
    // of the body's exact bytes (100 KiB fits a record), not of nothing.
    let odd = body(7, 100 << 10);
    let odd_file = dir.join("odd");
    std::fs::write(&odd_file, &odd).expect("the file");
    let long_id = "j".repeat(dlq_core::api::MAX_JOB_ID_LEN + 1);
    let (code, answer) = post_file(&url, &odd_file, &long_id, false);
    assert_eq!(code, 201, "{answer}");
    let invalid = eventually(30, "the Invalid record", || async {
        let records = api.list(&Default::default()).await.ok()?.items;
        records
            .into_iter()
            .find(|r| r.spec.failure_kind == dlq_core::api::FailureKind::Invalid)
    })
    .await;
    assert!(
        invalid.spec.job.payload_bytes().ok() == Some(odd),
        "an Invalid record of the exact bytes: {:?}",
        invalid.spec.reason
    );
    // The same over what a record holds inline: an Invalid record of the stored body, by
    // reference (refused as too large before).
    let odd_large = body(8, 1 << 20);
    std::fs::write(&odd_file, &odd_large).expect("the file");
    let long_id = "k".repeat(dlq_core::api::MAX_JOB_ID_LEN + 1);
    let (code, answer) = post_file(&url, &odd_file, &long_id, false);
    assert_eq!(code, 201, "{answer}");
    let by_reference = eventually(30, "the Invalid record by reference", || async {
        let records = api.list(&Default::default()).await.ok()?.items;
        records.into_iter().find(|r| {
            r.spec.failure_kind == dlq_core::api::FailureKind::Invalid && r.spec.job.body.is_some()
        })
    })
    .await;
    let reference = by_reference.spec.job.body.as_deref().expect("a body");
    assert_eq!(
        reference.sha256,
        sha256(&odd_large),
        "the exact bytes, referenced"
    );
    assert!(by_reference.spec.job.payload.is_none());

    // Redriven byte-exact from the store.
    let name = record.metadata.name.clone().unwrap_or_default();
    decide(&api, &name, Action::Redrive, "ada").await;
    wait_phase(&api, &name, Phase::Redriven, 60).await;
    let fields = delivered_to_stream(&redis, &big).await;
    assert!(
        fields
            .iter()
            .any(|(k, v)| k == b"header:content-type" && v == b"application/octet-stream"),
        "the event's header kept"
    );

    // kubectl dlq park --payload @file over a record's limit goes to the park endpoint its
    // queue publishes.
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    eventually(30, "the queue's status.address", || async {
        let q = queues.get("ingest").await.ok()?;
        q.status?.address
    })
    .await;
    let parked_file = dir.join("via-cli");
    let via_cli = body(4, 1 << 20);
    std::fs::write(&parked_file, &via_cli).expect("the file");
    let (ok, out, err) = kubectl_dlq_on(
        audited_plane(),
        &ns,
        &[
            "park",
            "--queue",
            "ingest",
            "--id",
            "cli-1",
            "--reason",
            "too big for a record",
            "--payload",
            &format!("@{}", parked_file.display()),
        ],
    );
    assert!(ok, "{out}{err}");
    assert!(out.contains("park endpoint"), "{out}");
    let record = parked(&api, "ingest", "cli-1").await;
    assert_eq!(
        record.spec.job.body.as_deref().map(|b| b.sha256.clone()),
        Some(sha256(&via_cli))
    );
    assert_eq!(record.spec.reason, "too big for a record");

    // The same from stdin (spooled to a private temp file, then sent), and one byte over the
    // queue's maxBytes refused before anything is sent.
    let via_stdin = body(5, 600 << 10);
    let (ok, out, err) = park_from_stdin(&ns, "cli-2", &via_stdin);
    assert!(ok && out.contains("park endpoint"), "{out}{err}");
    let record = parked(&api, "ingest", "cli-2").await;
    assert_eq!(
        record.spec.job.body.as_deref().map(|b| b.sha256.clone()),
        Some(sha256(&via_stdin))
    );
    let (ok, out, err) = park_from_stdin(&ns, "cli-3", &body(6, MAX_BYTES + 1));
    assert!(!ok && err.contains("limit of 8388608 bytes"), "{out}{err}");
    assert!(
        api.get_opt(&record_name("ingest", "cli-3", 1))
            .await
            .ok()
            .flatten()
            .is_none(),
        "nothing parked"
    );
    let _ = std::fs::remove_dir_all(&dir);
    report(&format!(
        "bodies_cli: the HTTP endpoint's large bodies in {:?}",
        started.elapsed()
    ));
}
