//! One Alertmanager: `POST /api/v2/alerts` of a batch, with an optional bearer token and CA.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use dlq_core::alert::Alert;

use crate::https::{TlsError, error_chain};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of a refusal's body goes into the log and the Event.
const MAX_ERROR_BODY: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum AlertError {
    #[error("alertmanager url {0:?} must be http(s)://host[:port][/prefix]")]
    Url(String),
    #[error("the alertmanager bearer token is not a valid header value")]
    Token,
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("{0}")]
    Unreachable(String),
    #[error("{url} answered {status}: {body}")]
    Refused {
        url: String,
        status: u16,
        body: String,
    },
    #[error("encoding alerts: {0}")]
    Encode(#[from] serde_json::Error),
}

/// An Alertmanager endpoint (its base URL; `/api/v2/alerts` is appended).
pub struct Alertmanager {
    uri: Uri,
    /// The URL for logs and Events.
    pub shown: String,
    token: Option<HeaderValue>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl std::fmt::Debug for Alertmanager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alertmanager")
            .field("url", &self.shown)
            .finish_non_exhaustive()
    }
}

impl Alertmanager {
    pub fn new(base: &str, token: Option<&str>, ca: Option<&str>) -> Result<Self, AlertError> {
        let base = base.trim().trim_end_matches('/');
        let valid = (base.starts_with("http://") || base.starts_with("https://"))
            && !base.contains('@')
            && !base.contains('?');
        let uri: Uri = format!("{base}/api/v2/alerts")
            .parse()
            .ok()
            .filter(|_| valid)
            .ok_or_else(|| AlertError::Url(base.to_string()))?;
        let token = token
            .map(|t| {
                let mut v = HeaderValue::from_str(&format!("Bearer {}", t.trim()))
                    .map_err(|_| AlertError::Token)?;
                v.set_sensitive(true);
                Ok::<_, AlertError>(v)
            })
            .transpose()?;
        let client = crate::https::client(ca, "--alertmanager-ca-file", CONNECT_TIMEOUT)?;
        Ok(Alertmanager {
            uri,
            shown: base.to_string(),
            token,
            client,
        })
    }

    /// Posts one batch; Ok once Alertmanager answered 2xx.
    pub async fn post(&self, alerts: &[Alert]) -> Result<(), AlertError> {
        let body = serde_json::to_vec(alerts)?;
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.uri.clone())
            .header(CONTENT_TYPE, "application/json");
        if let Some(t) = &self.token {
            req = req.header(AUTHORIZATION, t.clone());
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| AlertError::Unreachable(e.to_string()))?;
        let resp = match tokio::time::timeout(REQUEST_TIMEOUT, self.client.request(req)).await {
            Err(_) => {
                return Err(AlertError::Unreachable(format!(
                    "no answer from {} within {}s",
                    self.shown,
                    REQUEST_TIMEOUT.as_secs()
                )));
            }
            Ok(Err(e)) => {
                return Err(AlertError::Unreachable(format!(
                    "{}: {}",
                    self.shown,
                    error_chain(&e)
                )));
            }
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        if status.is_success() {
            return Ok(());
        }
        let body = body.unwrap_or_default();
        let text = String::from_utf8_lossy(&body[..body.len().min(MAX_ERROR_BODY)]).into_owned();
        Err(AlertError::Refused {
            url: self.shown.clone(),
            status: status.as_u16(),
            body: text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_need_a_scheme_and_no_credentials() {
        for bad in [
            "alertmanager:9093",
            "http://u:p@am:9093",
            "http://am:9093?x=1",
            "",
        ] {
            assert!(
                matches!(Alertmanager::new(bad, None, None), Err(AlertError::Url(_))),
                "{bad}"
            );
        }
        let am = Alertmanager::new("http://am:9093/prefix/", None, None).expect("valid");
        assert_eq!(am.uri.to_string(), "http://am:9093/prefix/api/v2/alerts");
        assert_eq!(am.shown, "http://am:9093/prefix");
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let err = Alertmanager::new("https://am:9093", None, Some("not a pem")).unwrap_err();
        assert!(err.to_string().contains("--alertmanager-ca-file"), "{err}");
    }
}
