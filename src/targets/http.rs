//! HTTP target: POST the payload to the consumer's own endpoint; any 2xx is the confirmation.
//!
//! Each job header is sent as an HTTP header of the same name and value (so `content-type`
//! becomes the request's Content-Type); nothing else is added but `Authorization: Bearer`
//! when a token Secret is configured. Headers HTTP itself owns (Host, Content-Length,
//! Transfer-Encoding, Connection, ...) cannot be sent untouched, so a job carrying one is
//! refused (`HeadersNotCarried`) rather than altered. A non-2xx answer is a failure whose
//! message holds the status and the first bytes of the body.
//!
//! TLS is rustls: the public web roots, or only the PEM CA certificates of `caSecretRef`.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty, Full};
use hyper::header::{AUTHORIZATION, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use dlq_core::cloudevent::HTTP_MANAGED;

use dlq_core::api::HttpTargetSpec;

use crate::broker::backend::ConnectError;
use crate::https::error_chain;
use crate::secret::SecretReads;

use super::{JobMessage, Target, TargetError};
use crate::broker::redact_url;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How much of an error body goes into the condition.
pub const MAX_ERROR_BODY: usize = 256;

type Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

pub struct HttpTarget {
    uri: Uri,
    shown: String,
    token: Option<HeaderValue>,
    client: Client<HttpsConnector<HttpConnector>, Body>,
}

impl HttpTarget {
    /// The bearer token and CA bundle the spec names, read from their Secrets: an HTTP
    /// endpoint has no broker module, so its connection is read here.
    pub async fn secrets(
        reads: &mut SecretReads<'_>,
        spec: &HttpTargetSpec,
    ) -> Result<(Option<String>, Option<String>), ConnectError> {
        let token = match &spec.bearer_token_secret_ref {
            Some(r) => Some(reads.value(r).await?),
            None => None,
        };
        let ca = match &spec.ca_secret_ref {
            Some(r) => Some(reads.value(r).await?),
            None => None,
        };
        Ok((token, ca))
    }

    pub fn new(url: &str, token: Option<&str>, ca: Option<&str>) -> Result<Self, TargetError> {
        let uri: Uri = url
            .parse()
            .map_err(|_| TargetError::Config("http target url is not a valid URL".into()))?;
        match uri.scheme_str() {
            Some("http") | Some("https") => {}
            _ => {
                return Err(TargetError::Config(
                    "http target url must start with http:// or https://".into(),
                ));
            }
        }
        let token = token
            .map(|t| {
                let mut v = HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| {
                    TargetError::Config("the bearer token is not a valid header value".into())
                })?;
                v.set_sensitive(true);
                Ok::<_, TargetError>(v)
            })
            .transpose()?;
        let client = crate::https::client(ca, "caSecretRef", CONNECT_TIMEOUT)
            .map_err(|e| TargetError::Config(e.to_string()))?;
        Ok(HttpTarget {
            shown: redact_url(url),
            uri,
            token,
            client,
        })
    }

    async fn send(
        &self,
        req: Request<Body>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, TargetError> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.client.request(req)).await {
            Err(_) => Err(TargetError::Unreachable(format!(
                "no answer from {} within {}s",
                self.shown,
                REQUEST_TIMEOUT.as_secs()
            ))),
            Ok(Err(e)) => Err(TargetError::Unreachable(format!(
                "{}: {}",
                self.shown,
                error_chain(&e)
            ))),
            Ok(Ok(resp)) => Ok(resp),
        }
    }
}

/// The request headers for `headers`, or why they cannot be sent untouched.
pub fn request_headers(
    headers: &BTreeMap<String, String>,
    with_token: bool,
) -> Result<Vec<(HeaderName, HeaderValue)>, TargetError> {
    let mut out = Vec::with_capacity(headers.len());
    let mut refused = Vec::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if HTTP_MANAGED.contains(&lower.as_str()) || (with_token && lower == "authorization") {
            refused.push(name.clone());
            continue;
        }
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| TargetError::Invalid(format!("header name {name:?} is not valid HTTP")))?;
        let v = HeaderValue::from_str(value).map_err(|_| {
            TargetError::Invalid(format!("header {name:?} value is not a valid HTTP value"))
        })?;
        out.push((n, v));
    }
    if !refused.is_empty() {
        return Err(TargetError::Unsupported(format!(
            "the http target cannot send these headers untouched: {} (HTTP sets them itself)",
            refused.join(", ")
        )));
    }
    Ok(out)
}

/// Up to `max` bytes of a body, as text for a condition.
async fn body_prefix(body: hyper::body::Incoming, max: usize) -> String {
    let mut body = body;
    let mut buf = Vec::new();
    let read = async {
        while buf.len() < max {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        buf.extend_from_slice(data);
                    }
                }
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), read).await;
    let cut = buf.len() > max;
    buf.truncate(max);
    let mut text = String::from_utf8_lossy(&buf).trim().to_string();
    if cut {
        text.push_str("...");
    }
    if text.is_empty() {
        text = "(empty body)".into();
    }
    text
}

impl Target for HttpTarget {
    fn describe(&self) -> String {
        format!("http POST {}", self.shown)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let mut req = Request::builder()
                .method(Method::POST)
                .uri(self.uri.clone());
            for (n, v) in request_headers(&job.headers_with_key(), self.token.is_some())? {
                req = req.header(n, v);
            }
            if let Some(t) = &self.token {
                req = req.header(AUTHORIZATION, t.clone());
            }
            let body: Body = Full::new(job.payload.clone()).boxed();
            let req = req
                .body(body)
                .map_err(|e| TargetError::Invalid(format!("building the request: {e}")))?;
            let resp = self.send(req).await?;
            let status = resp.status();
            if status.is_success() {
                return Ok(());
            }
            let body = body_prefix(resp.into_body(), MAX_ERROR_BODY).await;
            Err(TargetError::HttpStatus {
                status: status.as_u16(),
                body,
            })
        })
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        Box::pin(async move {
            // HEAD has no side effects by HTTP's rules; any answer but a 5xx means reachable.
            let mut req = Request::builder()
                .method(Method::HEAD)
                .uri(self.uri.clone());
            if let Some(t) = &self.token {
                req = req.header(AUTHORIZATION, t.clone());
            }
            let body: Body = Empty::new().boxed();
            let req = req
                .body(body)
                .map_err(|e| TargetError::Config(format!("building the probe: {e}")))?;
            let resp = self.send(req).await?;
            if resp.status().is_server_error() {
                return Err(TargetError::HttpStatus {
                    status: resp.status().as_u16(),
                    body: "(probe)".into(),
                });
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_owned_headers_are_refused_not_dropped() {
        let h = BTreeMap::from([
            ("content-type".to_string(), "application/json".to_string()),
            ("Content-Length".to_string(), "3".to_string()),
        ]);
        let err = request_headers(&h, false).unwrap_err();
        assert_eq!(err.reason(), "HeadersNotCarried");
        assert!(err.to_string().contains("Content-Length"), "{err}");
        let ok = BTreeMap::from([("authorization".to_string(), "Basic x".to_string())]);
        assert!(request_headers(&ok, false).is_ok());
        assert!(
            request_headers(&ok, true).is_err(),
            "would clash with the token"
        );
    }

    #[test]
    fn describe_hides_credentials_and_queries() {
        let t = HttpTarget::new(
            "https://hooks.example:8443/jobs?key=secret",
            Some("tok"),
            None,
        )
        .unwrap();
        assert_eq!(t.describe(), "http POST https://hooks.example:8443/jobs");
        assert!(HttpTarget::new("ftp://x/", None, None).is_err());
        assert!(matches!(
            HttpTarget::new("https://x/", None, Some("not pem")),
            Err(TargetError::Config(_))
        ));
    }
}
