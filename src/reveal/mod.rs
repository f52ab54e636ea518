//! The reveal API: `GET /apis/payloads.dlq.dev/v1alpha1/namespaces/{ns}/deadletterpayloads/{record}`
//! (and its `/unmasked` subresource) returns the record's job opened, for a caller the
//! apiserver authenticated and proxied here (an `APIService`, see [`front_proxy`]). Each reveal
//! is authorized again with a SubjectAccessReview for exactly that record and view, and
//! announced by a `PayloadRevealed` Event naming the user; the apiserver's audit log has the
//! request with the user and the record. Get only: there is no list, so payloads are read one
//! record at a time.
//!
//! A record whose body is in its queue's store (`spec.job.body`, issue 48) is read through
//! this process's [`Bodies`] (the store's credentials never leave the operator), checked
//! (size and SHA-256) and opened when sealed: the JSON views describe the body (`body`: ref,
//! size, sha256) and show its first KiB (`bodyHead`, masked in the masked view); the unmasked
//! view asked with `Accept: application/octet-stream` answers the job's exact bytes (a stored
//! body's or an inline payload's), so downloading a body needs exactly the role that shows a
//! payload unmasked. An unsealed body is checked whole first and then streamed (one chunk in
//! memory); a sealed one is opened in memory, bounded by the queue's `maxBytes`, two at a
//! time. A body that is gone or changed is answered 409 naming `BodyMissing`/`BodyCorrupt`,
//! with a `RevealFailed` Event; a store that does not answer, 503.
//!
//! Every replica serves it (reading records and keys needs no leadership). The pure parts (the
//! objects, the discovery documents, masking) are `dlq_core::reveal`.

pub mod front_proxy;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::serve::IncomingStream;
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::ResourceAttributes;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource};
use serde_json::Value;

use futures::StreamExt;

use dlq_core::api::{BodyRef, DeadLetter, DeadLetterQueue};
use dlq_core::reveal::{self, View};
use dlq_core::seal::{Keyring, OpenError};

use crate::body::payload::{self, Payloads};
use crate::body::{Bodies, BodyError};
use crate::serving_tls::{self as tls, TlsListener};
use front_proxy::FrontProxy;

/// Longest wait between attempts to read the front-proxy settings at start.
const SETTINGS_RETRY_CAP: Duration = Duration::from_secs(30);

/// The verified client certificate of a request's connection (DER), if it had one.
#[derive(Clone, Debug, Default)]
struct ClientCertificate(Option<Arc<Vec<u8>>>);

impl Connected<IncomingStream<'_, TlsListener>> for ClientCertificate {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        let (_, connection) = stream.io().get_ref();
        ClientCertificate(
            connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|c| Arc::new(c.to_vec())),
        )
    }
}

/// What the API needs to answer.
#[derive(Clone)]
pub struct RevealApi {
    client: Client,
    front_proxy: Arc<FrontProxy>,
    recorder: Recorder,
    reporter: Reporter,
    /// The queues' body stores, read with the operator's own credentials.
    bodies: Arc<dyn Bodies>,
}

/// Why the API could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("serving the reveal API: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves the API on `listener` with the certificate in `tls_dir` until `shutdown` resolves;
/// first waits for the apiserver's front-proxy settings (retrying, logged, while it cannot
/// read them).
pub async fn serve(
    client: Client,
    reporter: Reporter,
    listener: tokio::net::TcpListener,
    tls_dir: &std::path::Path,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let front_proxy = front_proxy_settings(&client).await;
    let config = tls::server_config_verifying(tls_dir, &front_proxy.client_ca)?;
    let api = RevealApi {
        recorder: Recorder::new(client.clone(), reporter.clone()),
        bodies: Arc::new(crate::body::cache::BodyCache::new(client.clone())),
        client,
        front_proxy: Arc::new(front_proxy),
        reporter,
    };
    let app = Router::new()
        .fallback(answer)
        .with_state(api)
        .into_make_service_with_connect_info::<ClientCertificate>();
    let listener = TlsListener::new(listener, config)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// The front-proxy settings, read again with capped backoff until they can be.
async fn front_proxy_settings(client: &Client) -> FrontProxy {
    let mut wait = Duration::from_secs(1);
    loop {
        match FrontProxy::load(client).await {
            Ok(settings) => return settings,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "the reveal API cannot start yet");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(SETTINGS_RETRY_CAP);
            }
        }
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Groups,
    Group,
    Resources,
    Payload {
        namespace: String,
        name: String,
        view: View,
    },
    Unknown,
}

/// The route of `path`.
fn route(path: &str) -> Route {
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    match parts.as_slice() {
        ["apis"] => Route::Groups,
        ["apis", g] if *g == reveal::GROUP => Route::Group,
        ["apis", g, v] if *g == reveal::GROUP && *v == reveal::VERSION => Route::Resources,
        ["apis", g, v, "namespaces", ns, r, name, rest @ ..]
            if *g == reveal::GROUP && *v == reveal::VERSION && *r == reveal::RESOURCE =>
        {
            let view = match rest {
                [] => View::Masked,
                [sub] if *sub == reveal::UNMASKED => View::Unmasked,
                _ => return Route::Unknown,
            };
            Route::Payload {
                namespace: ns.to_string(),
                name: name.to_string(),
                view,
            }
        }
        _ => Route::Unknown,
    }
}

/// An answer: a status and a JSON body (a `metav1.Status` when refused).
struct Answer(StatusCode, Value);

impl Answer {
    fn refused(code: u16, reason: &str, message: impl std::fmt::Display) -> Self {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Answer(status, reveal::status(code, reason, &message.to_string()))
    }
}

/// What a reveal gives: the `DeadLetterPayload` object, or the job's exact bytes.
enum Revealed {
    Object(Value),
    Bytes { body: axum::body::Body, len: u64 },
}

impl IntoResponse for Revealed {
    fn into_response(self) -> Response {
        match self {
            Revealed::Object(object) => Answer(StatusCode::OK, object).into_response(),
            Revealed::Bytes { body, len } => (
                StatusCode::OK,
                [
                    (header::CONTENT_TYPE, reveal::RAW.to_string()),
                    (header::CONTENT_LENGTH, len.to_string()),
                ],
                body,
            )
                .into_response(),
        }
    }
}

/// Whether a request asks for the exact bytes (`Accept: application/octet-stream`).
fn wants_raw(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| v.split(';').next().unwrap_or_default().trim() == reveal::RAW)
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        (
            self.0,
            [(header::CONTENT_TYPE, "application/json")],
            self.1.to_string(),
        )
            .into_response()
    }
}

async fn answer(
    State(api): State<RevealApi>,
    ConnectInfo(certificate): ConnectInfo<ClientCertificate>,
    request: Request,
) -> Response {
    let caller = match api.front_proxy.caller(
        certificate.0.as_deref().map(Vec::as_slice),
        request.headers(),
    ) {
        Ok(caller) => caller,
        Err(e) => return Answer::refused(401, "Unauthorized", e).into_response(),
    };
    if request.method() != Method::GET {
        return Answer::refused(405, "MethodNotAllowed", "this API is read-only: get only")
            .into_response();
    }
    let raw = wants_raw(request.headers());
    match route(request.uri().path()) {
        Route::Groups => Answer(StatusCode::OK, reveal::api_group_list()).into_response(),
        Route::Group => Answer(StatusCode::OK, reveal::api_group()).into_response(),
        Route::Resources => Answer(StatusCode::OK, reveal::api_resource_list()).into_response(),
        Route::Payload { view, .. } if raw && view == View::Masked => Answer::refused(
            406,
            "NotAcceptable",
            format!(
                "the exact bytes ({}) are the unmasked view: ask {}/{}",
                reveal::RAW,
                reveal::RESOURCE,
                reveal::UNMASKED
            ),
        )
        .into_response(),
        Route::Payload {
            namespace,
            name,
            view,
        } => match api.reveal(&caller, &namespace, &name, view, raw).await {
            Ok(revealed) => revealed.into_response(),
            Err(e) => e.answer().into_response(),
        },
        Route::Unknown => Answer::refused(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .into_response(),
    }
}

/// Why a payload was not revealed. Never carries the payload.
#[derive(Debug, thiserror::Error)]
enum RevealError {
    #[error("{user} may not get {resource} {name} in namespace {namespace}")]
    Forbidden {
        user: String,
        resource: String,
        namespace: String,
        name: String,
    },
    #[error("deadletter {name} not found in namespace {namespace}")]
    NotFound { namespace: String, name: String },
    /// The record exists but cannot be opened: its key is gone or its ciphertext is damaged.
    /// Asking again does not help until the record or its key is fixed.
    #[error("deadletter {name} in namespace {namespace} cannot be opened: {why}")]
    Open {
        namespace: String,
        name: String,
        why: OpenError,
    },
    /// The record's body is in its queue's store but cannot be read, checked or opened.
    #[error("deadletter {name} in namespace {namespace}: its body cannot be revealed ({}): {why}", why.reason())]
    Body {
        namespace: String,
        name: String,
        why: BodyError,
    },
    #[error("asking the apiserver: {0}")]
    Apiserver(#[source] kube::Error),
}

impl RevealError {
    fn answer(&self) -> Answer {
        let (code, reason) = match self {
            RevealError::Forbidden { .. } => (403, "Forbidden"),
            RevealError::NotFound { .. } => (404, "NotFound"),
            // The key is gone, or the ciphertext damaged: a state of the record, not a fault of
            // the server; asking again does not help until the key or the record is fixed.
            RevealError::Open { .. } => (409, "Conflict"),
            // Missing or changed: a state of the record's object; the store not answering: a
            // fault that may pass.
            RevealError::Body {
                why: BodyError::Unreachable(_),
                ..
            } => (503, "ServiceUnavailable"),
            RevealError::Body { .. } => (409, "Conflict"),
            RevealError::Apiserver(_) => (503, "ServiceUnavailable"),
        };
        Answer::refused(code, reason, self)
    }
}

impl RevealApi {
    /// The record's payload in `view`, for `caller`: authorize, read, open, show, announce;
    /// `raw`: its exact bytes (the unmasked view only).
    async fn reveal(
        &self,
        caller: &UserInfo,
        namespace: &str,
        name: &str,
        view: View,
        raw: bool,
    ) -> Result<Revealed, RevealError> {
        self.authorize(caller, namespace, name, view).await?;
        let record = self.record(namespace, name).await?;
        let queue = self.queue(namespace, &record.spec.queue).await?;
        let mask_paths = queue
            .as_ref()
            .map(|q| q.mask_paths().to_vec())
            .unwrap_or_default();
        let body = record.spec.job.stored_body().cloned();
        let keyring = match &queue {
            Some(q) if payload::needs_keys(&record.spec.job) => {
                crate::keys::load(&self.client, q).await.keyring
            }
            _ => Default::default(),
        };
        let opened = match payload::opened(&record.spec.job, &keyring) {
            Ok(opened) => opened,
            Err(why) => {
                self.refuse_unopenable(caller, &record, view, &why).await;
                return Err(RevealError::Open {
                    namespace: namespace.into(),
                    name: name.into(),
                    why,
                });
            }
        };
        let revealed = match (&body, raw) {
            (None, false) => {
                Revealed::Object(reveal::payload_object(&record, &opened, view, &mask_paths))
            }
            (None, true) => {
                let bytes = opened.payload_bytes().unwrap_or_default();
                Revealed::Bytes {
                    len: bytes.len() as u64,
                    body: axum::body::Body::from(bytes),
                }
            }
            (Some(body), _) => {
                let read = self
                    .read_body(queue.as_ref(), &record, body, &keyring, raw)
                    .await;
                let read = match read {
                    Ok(read) => read,
                    Err(why) => {
                        self.refuse_unreadable(caller, &record, view, &why).await;
                        return Err(RevealError::Body {
                            namespace: namespace.into(),
                            name: name.into(),
                            why,
                        });
                    }
                };
                match read {
                    BodyRead::Head { head, whole } => Revealed::Object(reveal::with_body(
                        reveal::payload_object(&record, &opened, view, &mask_paths),
                        body,
                        &head,
                        whole,
                        view,
                        &mask_paths,
                    )),
                    BodyRead::Bytes { body, len } => Revealed::Bytes { body, len },
                }
            }
        };
        match (&body, raw) {
            (Some(b), true) => {
                let user = caller.username.clone().unwrap_or_default();
                tracing::info!(namespace = ?record.metadata.namespace, record = ?record.metadata.name, %user, size = b.size, "body revealed");
                self.publish_on(&record, &reveal::body_revealed_event(&user, b.size))
                    .await;
            }
            _ => self.announce(caller, &record, view).await,
        }
        Ok(revealed)
    }

    /// The record's stored `body`, checked against its size and digest and opened when
    /// sealed: its head (the JSON views), or all of it (`raw`). Never held whole, sealed or
    /// not: the head is kept while the rest is checked (and opened), and the bytes are checked
    /// in a first pass and streamed in a second (checked again: an error then ends the
    /// response short).
    async fn read_body(
        &self,
        queue: Option<&DeadLetterQueue>,
        record: &DeadLetter,
        body: &BodyRef,
        keyring: &Keyring,
        raw: bool,
    ) -> Result<BodyRead, BodyError> {
        let job = record.spec.job.id.as_str();
        let queue = queue.ok_or_else(|| {
            BodyError::Config(format!(
                "the record's DeadLetterQueue {} is gone, and with it where its body is kept",
                record.spec.queue
            ))
        })?;
        let payloads = Payloads::of(self.bodies.as_ref(), queue);
        let want_head = reveal::BODY_HEAD + reveal::BODY_HEAD_MARGIN;
        let (head, len) = payloads.head(job, body, keyring, want_head).await?;
        if !raw {
            let whole = len <= want_head as u64;
            return Ok(BodyRead::Head { head, whole });
        }
        let stream = payloads.plaintext(job, body, keyring).await?.map(|chunk| {
            chunk.map_err(|e| std::io::Error::other(format!("{} ({})", e, e.reason())))
        });
        Ok(BodyRead::Bytes {
            body: axum::body::Body::from_stream(stream),
            len,
        })
    }

    /// The `RevealFailed` Warning on a record whose body could not be read, and a log line.
    async fn refuse_unreadable(
        &self,
        caller: &UserInfo,
        record: &DeadLetter,
        view: View,
        why: &BodyError,
    ) {
        let user = caller.username.clone().unwrap_or_default();
        let plan = reveal::body_unreadable_event(&user, view, why.reason(), &why.to_string());
        tracing::warn!(namespace = ?record.metadata.namespace, record = ?record.metadata.name, %user, ?view, reason = why.reason(), error = %why, "body could not be revealed");
        self.publish_on(record, &plan).await;
    }

    /// A SubjectAccessReview for `get deadletterpayloads[/unmasked]` of exactly this record.
    async fn authorize(
        &self,
        caller: &UserInfo,
        namespace: &str,
        name: &str,
        view: View,
    ) -> Result<(), RevealError> {
        let attributes = ResourceAttributes {
            namespace: Some(namespace.into()),
            verb: Some("get".into()),
            group: Some(reveal::GROUP.into()),
            resource: Some(reveal::RESOURCE.into()),
            subresource: view.subresource().map(Into::into),
            name: Some(name.into()),
            ..ResourceAttributes::default()
        };
        let allowed = crate::access::allowed(&self.client, caller, attributes)
            .await
            .map_err(RevealError::Apiserver)?;
        if allowed {
            return Ok(());
        }
        let resource = match view.subresource() {
            Some(sub) => format!("{}/{sub}", reveal::RESOURCE),
            None => reveal::RESOURCE.to_string(),
        };
        Err(RevealError::Forbidden {
            user: caller.username.clone().unwrap_or_default(),
            resource,
            namespace: namespace.into(),
            name: name.into(),
        })
    }

    async fn record(&self, namespace: &str, name: &str) -> Result<DeadLetter, RevealError> {
        let api: Api<DeadLetter> = Api::namespaced(self.client.clone(), namespace);
        api.get_opt(name)
            .await
            .map_err(RevealError::Apiserver)?
            .ok_or_else(|| RevealError::NotFound {
                namespace: namespace.into(),
                name: name.into(),
            })
    }

    /// The record's queue, if it still exists (its mask paths and keys).
    async fn queue(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<DeadLetterQueue>, RevealError> {
        let api: Api<DeadLetterQueue> = Api::namespaced(self.client.clone(), namespace);
        api.get_opt(name).await.map_err(RevealError::Apiserver)
    }

    /// The `RevealFailed` Warning on a record that could not be opened, and a log line.
    async fn refuse_unopenable(
        &self,
        caller: &UserInfo,
        record: &DeadLetter,
        view: View,
        why: &OpenError,
    ) {
        let user = caller.username.clone().unwrap_or_default();
        let plan = reveal::unopenable_event(&user, view, why);
        tracing::warn!(namespace = ?record.metadata.namespace, record = ?record.metadata.name, %user, ?view, error = %why, "payload could not be revealed");
        self.publish_on(record, &plan).await;
    }

    /// The `PayloadRevealed` Event on the record, and a log line (user and record, no payload).
    async fn announce(&self, caller: &UserInfo, record: &DeadLetter, view: View) {
        let user = caller.username.clone().unwrap_or_default();
        let plan = reveal::revealed_event(&user, view);
        tracing::info!(namespace = ?record.metadata.namespace, record = ?record.metadata.name, %user, ?view, "payload revealed");
        self.publish_on(record, &plan).await;
    }

    /// Publishes `plan` as an Event on `record`.
    async fn publish_on(&self, record: &DeadLetter, plan: &dlq_core::events::EventPlan) {
        dlq_client::events::publish(
            &self.client,
            &self.recorder,
            &self.reporter,
            &record.object_ref(&()),
            plan,
        )
        .await;
    }
}

/// A stored body as read for a reveal.
enum BodyRead {
    /// Its first bytes (at most `BODY_HEAD + BODY_HEAD_MARGIN`); `whole`: that is all of it.
    Head { head: Vec<u8>, whole: bool },
    /// All of it, checked, as the response's body.
    Bytes { body: axum::body::Body, len: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_octet_stream_accept_asks_for_the_bytes() {
        let mut h = axum::http::HeaderMap::new();
        assert!(!wants_raw(&h));
        h.insert(header::ACCEPT, "application/json".parse().unwrap());
        assert!(!wants_raw(&h));
        h.insert(
            header::ACCEPT,
            "application/json;q=0.5, application/octet-stream"
                .parse()
                .unwrap(),
        );
        assert!(wants_raw(&h));
    }

    #[test]
    fn a_body_gone_or_changed_is_a_conflict_naming_why_and_a_store_down_unavailable() {
        let missing = RevealError::Body {
            namespace: "pay".into(),
            name: "r-1".into(),
            why: BodyError::Missing {
                job: "j".into(),
                reference: "s3://b/k".into(),
            },
        };
        let Answer(code, body) = missing.answer();
        assert_eq!(code, StatusCode::CONFLICT);
        assert!(
            body["message"]
                .as_str()
                .unwrap_or_default()
                .contains(dlq_core::conditions::reason::BODY_MISSING),
            "{body}"
        );
        let down = RevealError::Body {
            namespace: "pay".into(),
            name: "r-1".into(),
            why: BodyError::Unreachable("connection refused".into()),
        };
        assert_eq!(down.answer().0, StatusCode::SERVICE_UNAVAILABLE);
    }

    /// A record the operator cannot open (damaged ciphertext, or its key gone) is a state of
    /// that record: 409 naming it, never a 500.
    #[test]
    fn an_unopenable_record_is_a_conflict_naming_it() {
        for why in [
            OpenError::Corrupt {
                job: "j".into(),
                recipient: "age1x".into(),
                why: "header is invalid".into(),
            },
            OpenError::KeyMissing {
                job: "j".into(),
                recipient: "age1x".into(),
            },
        ] {
            let Answer(code, body) = RevealError::Open {
                namespace: "pay".into(),
                name: "j-1a2b3c4d-1".into(),
                why,
            }
            .answer();
            assert_eq!(code, StatusCode::CONFLICT);
            assert_eq!(body["reason"], "Conflict");
            let message = body["message"].as_str().unwrap_or_default();
            assert!(
                message.starts_with("deadletter j-1a2b3c4d-1 in namespace pay cannot be opened"),
                "{message}"
            );
        }
    }

    #[test]
    fn paths_route_to_discovery_the_payload_or_nowhere() {
        assert_eq!(route("/apis"), Route::Groups);
        assert_eq!(route("/apis/payloads.dlq.dev/"), Route::Group);
        assert_eq!(route("/apis/payloads.dlq.dev/v1alpha1"), Route::Resources);
        let base = "/apis/payloads.dlq.dev/v1alpha1/namespaces/pay/deadletterpayloads/r-1";
        assert_eq!(
            route(base),
            Route::Payload {
                namespace: "pay".into(),
                name: "r-1".into(),
                view: View::Masked
            }
        );
        assert_eq!(
            route(&format!("{base}/unmasked")),
            Route::Payload {
                namespace: "pay".into(),
                name: "r-1".into(),
                view: View::Unmasked
            }
        );
        assert_eq!(route(&format!("{base}/status")), Route::Unknown);
        assert_eq!(
            route("/apis/payloads.dlq.dev/v1alpha1/namespaces/pay/deadletterpayloads"),
            Route::Unknown,
            "no list"
        );
        assert_eq!(route("/apis/dlq.dev/v1alpha1"), Route::Unknown);
    }
}
