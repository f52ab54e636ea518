//! The `http` phase: parks per second through the HTTP park endpoint (issue 33), binary-mode
//! CloudEvents POSTed over TLS by `BENCH_C` concurrent senders, each with a ServiceAccount
//! token from a real TokenRequest, against plain creates of the same number of records in the
//! same run (in rounds that alternate the order, see `Rounds`).
//!
//! Each sender keeps one TLS connection (a pooled client, as an SDK does), so the figure is the
//! endpoint's cost per event (TokenReview and SubjectAccessReview cached, one create), not a
//! handshake per event.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use kube::api::PostParams;

use dlq_core::api::DeadLetter;

use super::{Bench, Guard, Rounds, clear, kubectl_apply, testenv};

/// The endpoint's certificate (for 127.0.0.1) in a directory, and its CA's PEM.
fn certs(dir: &std::path::Path) -> anyhow::Result<String> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    std::fs::create_dir_all(dir)?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".into()])?.signed_by(&key, &ca)?;
    std::fs::write(dir.join("tls.crt"), cert.pem())?;
    std::fs::write(dir.join("tls.key"), key.serialize_pem())?;
    Ok(ca.pem())
}

/// A ServiceAccount allowed to park in `ns`, and its token for the queue's audience.
async fn sender_token(b: &Bench, ns: &str) -> anyhow::Result<String> {
    kubectl_apply(
        &b.plane,
        &format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: sender, namespace: {ns}}}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: parker, namespace: {ns}}}\nrules: [{{apiGroups: [dlq.dev], resources: [deadletters], verbs: [create]}}]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: parker, namespace: {ns}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: parker}}\nsubjects: [{{kind: ServiceAccount, name: sender, namespace: {ns}}}]\n---\napiVersion: dlq.dev/v1alpha1\nkind: DeadLetterQueue\nmetadata: {{name: relayer, namespace: {ns}}}\nspec:\n  maxParked: 1000000\n  http: {{}}\n  target:\n    redis: {{urlSecretRef: {{name: redis, key: url}}, list: \"bench:{ns}\"}}\n"
        ),
    )?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![dlq_core::api::park_path(ns, "relayer")]),
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let answer = Api::<ServiceAccount>::namespaced(b.client.clone(), ns)
        .create_token_request("sender", &PostParams::default(), &request)
        .await?;
    answer.status.and_then(|s| s.token).context("no token")
}

/// The operator serving the endpoint for `ns` on a free port: its guard and base URL.
fn operator_with_endpoint(
    b: &Bench,
    ns: &str,
    tls: &std::path::Path,
) -> anyhow::Result<(Guard, String)> {
    let (metrics, park) = (testenv::free_port()?, testenv::free_port()?);
    let child = testenv::spawn_guarded(
        std::process::Command::new(&b.operator_bin)
            .args([
                "run",
                "--leader-election=false",
                &format!("--metrics-addr=127.0.0.1:{metrics}"),
                &format!("--watch-namespaces={ns}"),
                &format!("--park-addr=127.0.0.1:{park}"),
                &format!("--park-tls-dir={}", tls.display()),
            ])
            .env("KUBECONFIG", &b.plane.kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_OPERATOR_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(super::operator_env()),
        &b.plane.dir().join(format!("operator-{ns}.log")),
    )?;
    Ok((Guard(child, None), format!("https://127.0.0.1:{park}")))
}

/// The data of every event: 64 bytes.
fn event_data() -> Bytes {
    Bytes::from("x".repeat(64))
}

/// One binary-mode CloudEvent of [`event_data`].
fn event(url: &str, token: &str, i: usize) -> anyhow::Result<hyper::Request<Full<Bytes>>> {
    Ok(hyper::Request::post(url)
        .header("authorization", format!("Bearer {token}"))
        .header("ce-specversion", "1.0")
        .header("ce-id", format!("bench-{i:06}"))
        .header("ce-source", "/bench")
        .header("ce-type", "dev.dlq.bench")
        .header("content-type", "application/json")
        .body(Full::new(event_data()))?)
}

type Sender = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// Event `i` POSTed until it is parked (201 or 200), waiting out 429 and 503.
async fn send(client: &Sender, url: &str, token: &str, i: usize) -> anyhow::Result<()> {
    loop {
        let res = client.request(event(url, token, i)?).await?;
        let status = res.status().as_u16();
        let _ = res.into_body().collect().await;
        match status {
            200 | 201 => return Ok(()),
            429 | 503 => tokio::time::sleep(Duration::from_millis(50)).await,
            other => bail!("event {i}: HTTP {other}"),
        }
    }
}

/// A namespace whose queue takes HTTP, with an operator serving and watching it, ready (a probe
/// event parked) and warm: what the endpoint run starts from.
struct Served {
    ns: String,
    op: Guard,
    client: Sender,
    url: String,
    token: String,
}

/// [`Served`] for `n` timed events of `c` senders (probe and warm-up events use ids past `n`).
async fn served(b: &mut Bench, n: usize, c: usize) -> anyhow::Result<Served> {
    let ns = b.namespace("http").await?;
    let token = sender_token(b, &ns).await?;
    let tls: PathBuf = b.plane.dir().join(format!("park-tls-{ns}"));
    let ca = certs(&tls)?;
    let (op, base) = operator_with_endpoint(b, &ns, &tls)?;
    let url = format!("{base}{}", dlq_core::api::park_path(&ns, "relayer"));
    let client =
        deadletter::https::client::<Full<Bytes>>(Some(&ca), "bench CA", Duration::from_secs(5))?;
    // Ready once a request gets past 503 (the scope registered) and 404 (the queue seen).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let probe = client.request(event(&url, &token, n + 1)?).await;
        if let Ok(r) = probe
            && r.status().is_success()
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("the park endpoint did not come up within a minute");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Warm as the ceiling's client is (its connections to the apiserver are open from earlier
    // runs): C events at once open the senders' connections and the operator's own to the
    // apiserver, so the timed run measures parking, not TLS handshakes. Not counted.
    let warm: Vec<anyhow::Result<()>> = futures::stream::iter(0..c)
        .map(|k| send(&client, &url, &token, n + 2 + k))
        .buffer_unordered(c)
        .collect()
        .await;
    for w in warm {
        w?;
    }
    Ok(Served {
        ns,
        op,
        client,
        url,
        token,
    })
}

/// `n` events parked through the endpoint, `c` senders at once: records/s.
async fn park_over_http(b: &mut Bench, n: usize, c: usize) -> anyhow::Result<f64> {
    let s = served(b, n, c).await?;
    let profiled = super::profile::Profiled::start(&b.plane, "http, endpoint", Some(s.op.0.id()));
    let start = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| send(&s.client, &s.url, &s.token, i))
        .buffer_unordered(c)
        .collect()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    profiled.end(&b.plane, n).await;
    for r in results {
        r?;
    }
    same_as_ceiling(b, &s.ns).await?;
    clear(&b.client, &s.ns).await?;
    Ok(rate)
}

/// The record the endpoint creates for event `i` of queue `relayer`, built by the endpoint's
/// own pure steps (`cloudevent::parse`, `dispose`, `new_record`) with the slot annotation the
/// parker adds: the ceiling creates exactly these objects, so the two differ only in the path.
fn endpoint_record(i: usize) -> anyhow::Result<DeadLetter> {
    let req = event("https://127.0.0.1/", "t", i)?;
    let headers = req
        .headers()
        .iter()
        .filter(|(name, _)| *name != "authorization")
        .map(|(name, value)| {
            (
                name.as_str().to_string(),
                value.to_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let body = event_data();
    let (_, events) = dlq_core::cloudevent::parse(
        "relayer",
        &dlq_core::cloudevent::HttpRequest {
            method: "POST",
            headers,
            body,
        },
    )?;
    let event = events
        .into_iter()
        .next()
        .context("the event parses to no request")?;
    let dlq_core::park::Disposition::Park(park) =
        dlq_core::park::dispose(event.request, &event.raw)
    else {
        bail!("event {i} would not be parked");
    };
    let mut record = dlq_core::park::new_record(&park, 1);
    record.metadata.annotations.get_or_insert_default().insert(
        dlq_core::api::ANNOTATION_SLOT_BLOCK.into(),
        "0123456789ab-0".into(),
    );
    Ok(record)
}

/// Fails unless the endpoint's record of event 0 is the object the ceiling creates for it
/// (same name, spec but its time, and labels): a ceiling of other records would not be this one's ceiling.
async fn same_as_ceiling(b: &Bench, ns: &str) -> anyhow::Result<()> {
    let built = endpoint_record(0)?;
    let name = built.metadata.name.clone().unwrap_or_default();
    let parked = Api::<DeadLetter>::namespaced(b.client.clone(), ns)
        .get(&name)
        .await
        .with_context(|| format!("the endpoint parked no record {name}"))?;
    // All but the moment of failure, which is when each was built.
    let spec = |r: &DeadLetter| {
        let mut spec = serde_json::to_value(&r.spec).unwrap_or_default();
        if let Some(fields) = spec.as_object_mut() {
            fields.remove("failedAt");
        }
        spec
    };
    if spec(&parked) != spec(&built) || parked.metadata.labels != built.metadata.labels {
        bail!(
            "the ceiling's record differs from the endpoint's:\n{}\n{}",
            serde_json::to_string(&parked.spec)?,
            serde_json::to_string(&built.spec)?
        );
    }
    Ok(())
}

/// The apiserver's ceiling: the endpoint's `n` records ([`endpoint_record`]) created straight,
/// `c` at once, by the parker's field manager into a fresh namespace: records/s.
async fn ceiling(b: &mut Bench, n: usize, c: usize) -> anyhow::Result<f64> {
    let ns = b.namespace("http-ceiling").await?;
    let records = (0..n)
        .map(endpoint_record)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let pp = super::as_parker();
    let profiled = super::profile::Profiled::start(&b.plane, "http, ceiling", None);
    let start = Instant::now();
    let results: Vec<Result<DeadLetter, kube::Error>> = futures::stream::iter(&records)
        .map(|r| api.create(&pp, r))
        .buffer_unordered(c)
        .collect()
        .await;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    profiled.end(&b.plane, n).await;
    for r in results {
        r?;
    }
    clear(&b.client, &ns).await?;
    Ok(rate)
}

/// The phase: endpoint and ceiling in `rounds` rounds alternating which goes first;
/// (endpoint, ceiling) records/s under "endpoint" and "ceiling".
pub async fn phase(b: &mut Bench, n: usize, c: usize, rounds: usize) -> anyhow::Result<Rounds> {
    let mut r = Rounds::default();
    for round in 0..rounds {
        for endpoint_first in [round % 2 == 0, round % 2 == 1] {
            if endpoint_first {
                r.add("endpoint", n, park_over_http(b, n, c).await?);
            } else {
                r.add("ceiling", n, ceiling(b, n, c).await?);
            }
        }
    }
    Ok(r)
}
