//! `kubectl dlq park --payload @FILE` for a file over a record's limit: the plugin holds no
//! body-store credentials (they never leave the operator), so it streams the file to the
//! queue's HTTP park endpoint (`status.address`, the queue's `spec.http`), which keeps the
//! body in the queue's store (`spec.bodies`) and creates the record, as for any HTTP sender.
//! The file is sent as a plain body (the job id in `x-dlq-job-id`, the reason, deliveries,
//! failure kind and error class in their `x-dlq-*` headers, `--header`s as request headers),
//! read in chunks as it goes, never whole.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dlq_core::api::{DeadLetterQueue, FailureKind, MAX_PAYLOAD_BYTES};
use dlq_core::cloudevent::{
    HEADER_DELIVERIES, HEADER_ERROR_CLASS, HEADER_FAILURE_KIND, HEADER_JOB_ID, HEADER_REASON,
};
use http_body_util::BodyExt;
use kube::ResourceExt;

use crate::session::CliError;

/// Bytes read from the file per chunk sent.
const CHUNK: usize = 256 * 1024;

/// Where and how to send: the endpoint's URL and the CA it is served with.
#[derive(Debug, PartialEq)]
pub struct Endpoint {
    pub url: String,
    pub ca: Option<String>,
}

/// How much is to be sent, over a record's limit.
#[derive(Clone, Copy, Debug)]
pub enum Size {
    /// A file's length, or stdin's once spooled.
    Exactly(u64),
    /// Stdin not read to its end yet: more than a record holds.
    OverARecord,
}

/// The park endpoint of `queue` for a payload of `size` (over a record's limit), or what the
/// queue lacks, worded as what to do.
pub fn endpoint_of(
    queue: &DeadLetterQueue,
    size: Size,
    url: Option<&str>,
) -> Result<Endpoint, CliError> {
    let name = queue.name_any();
    let is = match size {
        Size::Exactly(n) => format!("is {n} bytes, over the {MAX_PAYLOAD_BYTES}"),
        Size::OverARecord => format!("is over the limit of {MAX_PAYLOAD_BYTES} bytes"),
    };
    let over = format!(
        "the payload {is} a record holds: kubectl dlq parks a larger one by streaming it to the queue's HTTP park endpoint, which keeps it in the queue's body store"
    );
    let Some(bodies) = &queue.spec.bodies else {
        return Err(CliError::Refused(format!(
            "{over}, and DeadLetterQueue {name} has no spec.bodies (give it a body store)"
        )));
    };
    if let Size::Exactly(size) = size
        && size > bodies.max()
    {
        return Err(CliError::Refused(format!(
            "the payload is {size} bytes, over DeadLetterQueue {name}'s spec.bodies.maxBytes ({})",
            bodies.max()
        )));
    }
    if queue.spec.http.is_none() {
        return Err(CliError::Refused(format!(
            "{over}, and DeadLetterQueue {name} does not accept HTTP: set spec.http on it (and serve the operator's park endpoint: --park-addr, the chart's parkEndpoint)"
        )));
    }
    let address = queue.status.as_ref().and_then(|s| s.address.as_ref());
    match (url, address) {
        (Some(url), a) => Ok(Endpoint {
            url: url.to_string(),
            ca: a.and_then(|a| a.ca_certs.clone()),
        }),
        (None, Some(a)) => Ok(Endpoint {
            url: a.url.clone(),
            ca: a.ca_certs.clone(),
        }),
        (None, None) => Err(CliError::Refused(format!(
            "{over}, and DeadLetterQueue {name} has no status.address yet: the operator does not serve its park endpoint (--park-addr and --park-url)"
        ))),
    }
}

/// What `kubectl dlq park` says of the job beside its payload, as the endpoint's headers carry
/// it (the park command fills it from its flags).
pub struct Described<'a> {
    pub id: &'a str,
    pub deliveries: i32,
    pub reason: &'a str,
    pub failure_kind: FailureKind,
    pub error_class: Option<&'a str>,
    /// `K=V` pairs, as `--header` takes them.
    pub headers: &'a [String],
    pub token_file: Option<&'a std::path::Path>,
}

/// Streams the file at `path` (`size` bytes) to `endpoint` with the request `args` describe;
/// returns the record's name and whether it is new.
pub async fn park_file(
    args: &Described<'_>,
    endpoint: &Endpoint,
    path: &str,
    size: u64,
) -> Result<(String, bool), CliError> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| CliError::Io(format!("--payload @{path}: reading {path}"), e))?;
    // A local file's reads are short: read between sends, one chunk at a time.
    let chunks = futures::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = vec![0u8; CHUNK];
        match file.read(&mut buf) {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(hyper::body::Frame::data(Bytes::from(buf))), Some(file)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    let body = http_body_util::StreamBody::new(futures::StreamExt::boxed(chunks));
    let mut request = hyper::Request::post(&endpoint.url)
        .header(hyper::header::CONTENT_LENGTH, size)
        .header(HEADER_JOB_ID, args.id)
        .header(HEADER_DELIVERIES, args.deliveries.to_string());
    if !args.reason.is_empty() {
        request = request.header(HEADER_REASON, args.reason);
    }
    if args.failure_kind == FailureKind::Invalid {
        request = request.header(HEADER_FAILURE_KIND, "Invalid");
    }
    if let Some(class) = args.error_class {
        request = request.header(HEADER_ERROR_CLASS, class);
    }
    let mut typed = false;
    for h in args.headers {
        let (k, v) = h
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--header {h:?}: expected K=V")))?;
        typed |= k.eq_ignore_ascii_case("content-type");
        request = request.header(k, v);
    }
    if !typed {
        request = request.header(hyper::header::CONTENT_TYPE, "application/octet-stream");
    }
    if let Some(token) = token(args)? {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(body)
        .map_err(|e| CliError::Usage(format!("the park request: {e}")))?;
    let client = client(endpoint.ca.as_deref())?;
    let answer = client.request(request).await.map_err(|e| {
        CliError::Api(format!(
            "sending the payload to the park endpoint {}: {e}",
            endpoint.url
        ))
    })?;
    let status = answer.status().as_u16();
    let text = answer
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let first = |k: &str| json[k].as_array()?.first()?.as_str().map(str::to_string);
    match (status, first("created"), first("existing")) {
        (201, Some(name), _) => Ok((name, true)),
        (200, _, Some(name)) => Ok((name, false)),
        _ => {
            let why = json["error"].as_str().unwrap_or(&text);
            let hint = match status {
                401 => {
                    " (give a token with the queue's audience: --token-file, e.g. from kubectl create token SERVICEACCOUNT --audience <the queue's status.address.audience>)"
                }
                _ => "",
            };
            Err(CliError::Refused(format!(
                "the park endpoint {} answered {status}: {why}{hint}",
                endpoint.url
            )))
        }
    }
}

/// The bearer token `--token-file` names, if any.
fn token(args: &Described<'_>) -> Result<Option<String>, CliError> {
    let Some(path) = args.token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Io(format!("--token-file {}", path.display()), e))?;
    Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty()))
}

/// An HTTP(S) client trusting `ca` (the endpoint's `CACerts`), else the web roots.
fn client<B>(
    ca: Option<&str>,
) -> Result<
    hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        B,
    >,
    CliError,
>
where
    B: hyper::body::Body + Send,
    B::Data: Send,
{
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|_| {
                    CliError::Refused("the queue's status.address.CACerts is not PEM".into())
                })?;
                roots.add(cert).map_err(|e| {
                    CliError::Refused(format!("the queue's status.address.CACerts: {e}"))
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CliError::Usage(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(spec: serde_json::Value, status: serde_json::Value) -> DeadLetterQueue {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": "ingest", "namespace": "pay"},
            "spec": spec, "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_large_payload_needs_a_store_http_and_an_address_and_says_which_is_missing() {
        let target = serde_json::json!({"redis": {"urlSecretRef": {"name": "r", "key": "url"}, "list": "j"}});
        let bodies = serde_json::json!({"volume": {"path": "/b"}, "maxBytes": 1_000_000});
        let none = queue(serde_json::json!({"target": target}), serde_json::json!({}));
        let e = endpoint_of(&none, Size::Exactly(300_000), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("spec.bodies"), "{e}");
        // Stdin not read to its end: no byte count it does not know.
        let e = endpoint_of(&none, Size::OverARecord, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("over the limit of 262144 bytes") && e.contains("spec.bodies"),
            "{e}"
        );
        let no_http = queue(
            serde_json::json!({"target": target, "bodies": bodies}),
            serde_json::json!({}),
        );
        let e = endpoint_of(&no_http, Size::Exactly(300_000), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("spec.http"), "{e}");
        let e = endpoint_of(&no_http, Size::Exactly(2_000_000), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("maxBytes"), "{e}");
        let no_address = queue(
            serde_json::json!({"target": target, "bodies": bodies, "http": {}}),
            serde_json::json!({}),
        );
        let e = endpoint_of(&no_address, Size::Exactly(300_000), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("status.address"), "{e}");
        let ready = queue(
            serde_json::json!({"target": target, "bodies": bodies, "http": {}}),
            serde_json::json!({"address": {"url": "https://park.pay.svc/v1/namespaces/pay/queues/ingest"}}),
        );
        assert_eq!(
            endpoint_of(&ready, Size::Exactly(300_000), None).unwrap(),
            Endpoint {
                url: "https://park.pay.svc/v1/namespaces/pay/queues/ingest".into(),
                ca: None
            }
        );
        assert_eq!(
            endpoint_of(&ready, Size::Exactly(300_000), Some("http://127.0.0.1:1/x"))
                .unwrap()
                .url,
            "http://127.0.0.1:1/x"
        );
    }
}
