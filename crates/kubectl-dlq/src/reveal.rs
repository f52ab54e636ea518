//! The reveal API from the client side (`kubectl dlq show --reveal`, the page's Reveal button):
//! `GET .../deadletterpayloads/{record}` (or its `unmasked` subresource) as the kubeconfig's
//! user, through the apiserver, which authenticates, authorizes and audits the read. A record
//! whose body is in its queue's store comes with the body's facts and first KiB; its exact bytes
//! (`kubectl dlq show --body`) are the unmasked view asked for `application/octet-stream`.

use std::collections::BTreeMap;

use dlq_core::api::{BodyRef, Job};
use dlq_core::reveal::{GROUP_VERSION, RAW, RESOURCE, UNMASKED};
use futures::AsyncReadExt;
use serde::Deserialize;

use crate::session::CliError;

/// A revealed payload: what the server answered.
#[derive(Deserialize, Debug, Default, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Revealed {
    #[serde(default)]
    pub payload: Option<String>,
    #[serde(default)]
    pub payload_base64: Option<String>,
    #[serde(default)]
    pub payload_null: bool,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `masked` or `unmasked`.
    #[serde(default)]
    pub view: String,
    /// A body kept in the queue's store: its reference, size and digest.
    #[serde(default)]
    pub body: Option<RevealedBody>,
    /// Its first KiB as text (masked in the masked view).
    #[serde(default)]
    pub body_head: Option<String>,
    /// Its first KiB when that is not text.
    #[serde(default)]
    pub body_head_base64: Option<String>,
    /// Why the masked view does not show its first KiB.
    #[serde(default)]
    pub body_head_withheld: Option<String>,
}

/// A stored body as the reveal API describes it.
#[derive(Deserialize, Debug, Default, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RevealedBody {
    #[serde(rename = "ref", default)]
    pub reference: String,
    #[serde(default)]
    pub size: i64,
    #[serde(default)]
    pub sha256: String,
}

impl Revealed {
    /// `job` with the revealed content in place of its seal.
    pub fn into_job(self, job: &Job) -> Job {
        let mut opened = job.clone();
        opened.sealed = None;
        opened.payload = self.payload;
        opened.payload_base64 = self.payload_base64;
        opened.payload_null = self.payload_null;
        opened.headers = self.headers;
        opened
    }
}

/// The API path of record `name`'s payload in `ns`.
pub fn path(ns: &str, name: &str, unmasked: bool) -> String {
    let base = format!("/apis/{GROUP_VERSION}/namespaces/{ns}/{RESOURCE}/{name}");
    if unmasked {
        format!("{base}/{UNMASKED}")
    } else {
        base
    }
}

/// Record `name`'s payload in `ns`, masked unless `unmasked`.
pub async fn fetch(
    client: &kube::Client,
    ns: &str,
    name: &str,
    unmasked: bool,
) -> Result<Revealed, CliError> {
    let request = axum::http::Request::get(path(ns, name, unmasked))
        .body(Vec::new())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    client
        .request::<Revealed>(request)
        .await
        .map_err(|e| refusal(e, ns, unmasked))
}

/// Record `name`'s exact bytes in `ns` (a stored body's, else its payload's), written to `out`
/// as they arrive, never held whole; `want`: the record's unsealed stored body, whose size and
/// digest the bytes are checked against as they pass (a sealed one is checked by the operator
/// before it opens it). The number of bytes written.
pub async fn download(
    client: &kube::Client,
    ns: &str,
    name: &str,
    want: Option<&BodyRef>,
    out: &mut impl std::io::Write,
) -> Result<u64, CliError> {
    let request = axum::http::Request::get(path(ns, name, true))
        .header(axum::http::header::ACCEPT, RAW)
        .body(Vec::new())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let reader = client
        .request_stream(request)
        .await
        .map_err(|e| refusal(e, ns, true))?;
    let mut reader = std::pin::pin!(reader);
    let mut verifier = want.map(|w| dlq_core::body::Verifier::new(name, w));
    let broke_off = |e: std::io::Error| {
        CliError::Io(
            format!("the download of {name}'s body broke off (what was written is incomplete)"),
            e,
        )
    };
    let mut written = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf).await.map_err(broke_off)?;
        let Some(chunk) = buf.get(..n).filter(|c| !c.is_empty()) else {
            break;
        };
        if let Some(v) = verifier.as_mut() {
            v.update(chunk).map_err(corrupt)?;
        }
        out.write_all(chunk)
            .map_err(|e| CliError::Io("writing the body".into(), e))?;
        written += n as u64;
    }
    out.flush()
        .map_err(|e| CliError::Io("writing the body".into(), e))?;
    if let Some(v) = verifier {
        v.finish().map_err(corrupt)?;
    }
    Ok(written)
}

fn corrupt(e: dlq_core::body::BodyCheck) -> CliError {
    CliError::Refused(format!(
        "BodyCorrupt: {e} (what was written is not the record's body)"
    ))
}

/// What a refused reveal tells the user to do.
fn refusal(e: kube::Error, ns: &str, unmasked: bool) -> CliError {
    let kube::Error::Api(status) = e else {
        return CliError::Api(e.to_string());
    };
    let resource = if unmasked {
        format!("{RESOURCE}/{UNMASKED}")
    } else {
        RESOURCE.to_string()
    };
    match status.code {
        403 => CliError::Refused(format!(
            "revealing payloads needs the dlq-payload-reader role (get {resource}.payloads.dlq.dev) in namespace {ns}: {}",
            status.message
        )),
        404 if !status.message.contains("not found in namespace") => CliError::Refused(
            "the reveal API is not installed in this cluster (no APIService v1alpha1.payloads.dlq.dev): install the chart with revealApi.enabled=true".into(),
        ),
        _ => CliError::Api(status.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            serde_json::from_value(serde_json::json!({
                "status": "Failure", "message": message, "reason": "", "code": code
            }))
            .unwrap(),
        )
    }

    #[test]
    fn refusals_name_the_role_or_the_missing_api() {
        let forbidden = refusal(api_error(403, "alice may not"), "pay", true).to_string();
        assert!(forbidden.contains("dlq-payload-reader"), "{forbidden}");
        assert!(
            forbidden.contains("deadletterpayloads/unmasked"),
            "{forbidden}"
        );
        let missing = refusal(
            api_error(404, "the server could not find the requested resource"),
            "pay",
            false,
        )
        .to_string();
        assert!(missing.contains("revealApi.enabled"), "{missing}");
        let gone = refusal(
            api_error(404, "deadletter r not found in namespace pay"),
            "pay",
            false,
        );
        assert!(gone.to_string().contains("not found in namespace"));
    }

    #[test]
    fn the_unmasked_view_is_a_subresource() {
        assert_eq!(
            path("pay", "r-1", true),
            "/apis/payloads.dlq.dev/v1alpha1/namespaces/pay/deadletterpayloads/r-1/unmasked"
        );
    }
}
