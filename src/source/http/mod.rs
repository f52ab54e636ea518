//! The HTTP park endpoint: `POST /v1/namespaces/{ns}/queues/{queue}` with a CloudEvent (binary,
//! structured or batched mode) or a plain body parks it into that DeadLetterQueue, if the queue
//! has `spec.http` and the caller may (see [`auth`]). It makes any HTTP sender a parker: a
//! Knative `deadLetterSink`, Argo Events' `dlqTrigger`, a webhook relay.
//!
//! It parks through the same plan as every broker source (`dlq_core::source_plan`: what is
//! not what it claims to be becomes an Invalid record of its exact bytes, also after a final
//! refusal), but it never waits: the sender holds the event, so a full queue answers 429 with
//! `Retry-After` and an apiserver that cannot take it 503. An answer of 201 (a new record) or
//! 200 (this event's record already exists) comes only once the record exists.
//!
//! A queue with a body store (`spec.bodies`) takes bodies up to its `maxBytes` (others a
//! record's limit, [`MAX_BODY`]): the limit is enforced while the body is read (413 above it,
//! and never more than the limit read), and an event above the queue's threshold is kept in
//! the store before its record is created, as every source does (`ParkInto::keep_body`); a
//! store that does not take it within [`BODY_STORE_WAIT`] answers 503 and keeps nothing the
//! sweep would not delete.
//!
//! The server runs from the start of the process; a scope of the operator (its queue store,
//! job index and parker) registers here while it runs, so a standby replica, or one whose
//! term on the Lease ran out, answers 503. Senders do not reach a standby through the park
//! Service: the leader points it at itself ([`service`]).

pub mod auth;
pub mod connections;
pub mod service;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http_body_util::BodyExt;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use dlq_client::park::{ParkError, ParkOutcome};
use dlq_core::cloudevent::{self, HttpRequest, Incoming, MAX_BODY};
use dlq_core::park::ParkInvalid;
use dlq_core::park::ParkRequest;
use dlq_core::source_plan::Parking;

use crate::metrics::Metrics;

use super::park_into::{ParkInto, Shared};
use auth::Auth;
use connections::{Connections, Refusal, Refusals, SLOW_BODY};
use hyper_util::service::TowerToHyperService;

/// What a full queue tells the sender to wait: about when the operator looks at it again.
const RETRY_AFTER_FULL: u64 = 2;
/// What an apiserver that cannot take the record tells the sender to wait.
const RETRY_AFTER_UNAVAILABLE: u64 = 1;
/// Longest wait for a request's body (at most [`MAX_BODY`] bytes); a larger one a second more
/// per MiB its queue takes.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Least a request must bring over each [`BODY_WINDOW`], in bytes a second, until its body
/// ends: one trickled slower holds one of its address's slots no longer than a window, its
/// headers and its body together, as one trickling its headers alone holds it no longer than
/// [`HEADER_TIMEOUT`]. 1 KiB/s is far below any sender that means to deliver (the
/// [`BODY_TIMEOUT`] already asks 9 KiB/s of a body of [`MAX_BODY`]) and far above a
/// slowloris' byte a second.
const MIN_BODY_RATE: usize = 1024;
/// The span [`MIN_BODY_RATE`] is measured over, the first from when the connection was ready
/// for the request (its accept, or the previous answer): the header timeout, so that no slow
/// client, whether it trickles its headers, its body or both, keeps a neighbour waiting longer.
const BODY_WINDOW: Duration = HEADER_TIMEOUT;
/// Room beyond a body store's `maxBytes` for a structured event's or a batch's framing.
const FRAMING: usize = 4096;
/// Requests whose bodies are over a record's limit read at once: each is held about three
/// times over while it is parsed and kept (the bytes read, the job's payload, the exact bytes
/// an Invalid record would hold), so this bounds the endpoint's memory to about
/// `3 × LARGE_BODIES × maxBytes`. Others wait for their turn (within their body's timeout).
const LARGE_BODIES: usize = 2;
static LARGE_BODY_TURNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(LARGE_BODIES);
/// Longest wait for the body store to take an event's body before answering 503 (the sender
/// keeps the event and retries).
const BODY_STORE_WAIT: Duration = Duration::from_secs(15);
/// Longest wait for a connection's first request to arrive whole, from its accept (the TLS
/// handshake included), and for each later request's headers: the longest a connection that
/// trickles holds one of its client's slots before it is closed.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// One scope of the operator (a namespace, or all of them) that parks while it runs.
struct Scope {
    namespace: Option<String>,
    shared: Shared,
}

/// The endpoint: the scopes that park, who may, and its metric.
#[derive(Clone)]
pub struct ParkEndpoint {
    scopes: Arc<RwLock<Vec<(u64, Scope)>>>,
    next: Arc<std::sync::atomic::AtomicU64>,
    auth: Arc<Auth>,
    metrics: Metrics,
}

/// Unregisters its scope when dropped (the scope stopped).
pub struct Registration {
    id: u64,
    scopes: Arc<RwLock<Vec<(u64, Scope)>>>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut scopes) = self.scopes.write() {
            scopes.retain(|(id, _)| *id != self.id);
        }
    }
}

impl ParkEndpoint {
    /// An endpoint checking callers with `client`'s apiserver; callers without a token are
    /// taken (by queues that allow it) only from `anonymous_from`.
    pub fn new(client: kube::Client, metrics: Metrics, anonymous_from: Vec<ipnet::IpNet>) -> Self {
        ParkEndpoint {
            scopes: Arc::default(),
            next: Arc::default(),
            auth: Arc::new(Auth::new(client, anonymous_from)),
            metrics,
        }
    }

    /// Parks into `namespace` (all when None) through `shared` until the returned
    /// registration is dropped.
    pub fn register(&self, namespace: Option<String>, shared: Shared) -> Registration {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut scopes) = self.scopes.write() {
            scopes.push((id, Scope { namespace, shared }));
        }
        Registration {
            id,
            scopes: self.scopes.clone(),
        }
    }

    /// The scope parking into `namespace`, if this replica runs one.
    fn scope(&self, namespace: &str) -> Option<Shared> {
        let scopes = self.scopes.read().ok()?;
        scopes
            .iter()
            .find(|(_, s)| s.namespace.as_deref().is_none_or(|n| n == namespace))
            .map(|(_, s)| s.shared.clone())
    }

    /// The endpoint's routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/namespaces/{namespace}/queues/{queue}", any(park))
            .with_state(self)
    }
}

/// The address a request's connection came from.
#[derive(Clone, Copy, Debug)]
struct Peer(SocketAddr);

/// Serves the endpoint on `listener` (TLS when `tls` is given), holding at most
/// `max_connections` connections, until `shutdown` resolves, then lets the requests under way
/// finish.
///
/// Its own accept loop rather than `axum::serve`, whose connections have no header timeout:
/// a connection has [`HEADER_TIMEOUT`] from its accept for its TLS handshake and first
/// request's headers, as long for each later request's headers, and a body must bring
/// [`MIN_BODY_RATE`] over each [`BODY_WINDOW`] and end within [`BODY_TIMEOUT`] (else 408); one
/// over the [`connections`] limits is answered 429 or 503 with `Retry-After` once its request
/// begins (within the same [`HEADER_TIMEOUT`]) and closed.
pub async fn serve(
    endpoint: ParkEndpoint,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    max_connections: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let metrics = endpoint.metrics.clone();
    metrics.touch_http_refused(&[
        Refusal::ClientLimit.reason(),
        Refusal::ConnectionLimit { max: 0 }.reason(),
        SLOW_BODY,
    ]);
    let router = endpoint.router();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let connections = Connections::new(max_connections);
    let mut refusals = Refusals::default();
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut served = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        while served.try_join_next().is_some() {}
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a park endpoint connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let first_by = tokio::time::Instant::now() + HEADER_TIMEOUT;
        let counted = match connections.enter(peer.ip()) {
            Ok(counted) => counted,
            Err(refusal) => {
                tracing::debug!(%peer, reason = refusal.reason(), "park endpoint connection refused");
                refusals.refuse(tcp, acceptor.clone(), first_by, refusal, &metrics);
                continue;
            }
        };
        // The peer's address decides whether a caller without a token is inside the cluster.
        let app = router
            .clone()
            .layer(axum::Extension(ConnectInfo(Peer(peer))));
        let (acceptor, stopping, metrics) = (acceptor.clone(), stopping.clone(), metrics.clone());
        served.spawn(async move {
            let _counted = counted;
            match acceptor {
                None => connection(tcp, app, first_by, stopping, &metrics).await,
                Some(acceptor) => {
                    match tokio::time::timeout_at(first_by, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => connection(tls, app, first_by, stopping, &metrics).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
    // Refusals under way end with the loop (each is a few seconds at most anyway).
    drop(refusals);
    let _ = stop.send(true);
    while served.join_next().await.is_some() {}
    Ok(())
}

/// Serves HTTP/1 on one connection until the client closes it or the endpoint stops (then
/// the request under way finishes first): its first request must arrive by `first_by`,
/// each later one's headers within [`HEADER_TIMEOUT`]. A request cut for its slow body
/// ([`SlowBody`]) closes the connection once answered; it is counted as `slow_body`, answered
/// when the connection ended without an error (its 408 written).
async fn connection<Io>(
    io: Io,
    app: Router,
    first_by: tokio::time::Instant,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    metrics: &Metrics,
) where
    Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let asked = Arc::new(AtomicBool::new(false));
    let slow = Arc::new(AtomicBool::new(false));
    // When the connection was last ready for a request: its accept, then each answer.
    let ready = Arc::new(std::sync::Mutex::new(first_by - HEADER_TIMEOUT));
    let service = {
        let (asked, slow, app) = (asked.clone(), slow.clone(), TowerToHyperService::new(app));
        hyper::service::service_fn(move |mut request: hyper::Request<_>| {
            asked.store(true, Ordering::Relaxed);
            let began = *ready.lock().unwrap_or_else(|e| e.into_inner());
            request.extensions_mut().insert(RequestClock {
                began,
                asked: tokio::time::Instant::now(),
            });
            let answering = hyper::service::Service::call(&app, request);
            let (slow, ready) = (slow.clone(), ready.clone());
            async move {
                let response = answering.await?;
                *ready.lock().unwrap_or_else(|e| e.into_inner()) = tokio::time::Instant::now();
                if response.extensions().get::<SlowBody>().is_some() {
                    slow.store(true, Ordering::Relaxed);
                }
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    // hyper's header timeout starts after the TLS handshake: this one counts it too.
    let first_late = async {
        tokio::time::sleep_until(first_by).await;
        if asked.load(std::sync::atomic::Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
    };
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let ended_well = tokio::select! {
        done = conn.as_mut() => match done {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "park endpoint connection ended");
                false
            }
        },
        () = first_late => {
            tracing::debug!("park endpoint connection closed: no request in time");
            false
        }
        _ = async { stopping.wait_for(|stop| *stop).await.map(|_| ()) } => {
            conn.as_mut().graceful_shutdown();
            conn.await.is_ok()
        }
    };
    if slow.load(Ordering::Relaxed) {
        metrics.http_refused(SLOW_BODY, ended_well);
    }
}

/// Marks the answer to a request whose body came too slowly (see [`read_body`]): the
/// connection closes after it, and it is counted as [`SLOW_BODY`].
#[derive(Clone, Copy, Debug)]
struct SlowBody;

/// A request's times (an extension of it): when its connection was ready for it, which starts
/// its first [`BODY_WINDOW`], and when its headers were whole.
#[derive(Clone, Copy, Debug)]
struct RequestClock {
    began: tokio::time::Instant,
    asked: tokio::time::Instant,
}

/// An answer: its status, and a JSON body saying what happened or what to fix.
struct Answer {
    status: StatusCode,
    body: serde_json::Value,
    retry_after: Option<u64>,
    /// A body cut for coming too slowly ([`SlowBody`]).
    slow: bool,
}

impl Answer {
    fn error(status: u16, message: impl std::fmt::Display) -> Self {
        Answer {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            body: serde_json::json!({ "error": message.to_string() }),
            retry_after: None,
            slow: false,
        }
    }

    fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// 408 for a body that came too slowly, `why`.
    fn slow_body(why: impl std::fmt::Display) -> Self {
        Answer {
            slow: true,
            ..Answer::error(408, why)
        }
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body.to_string(),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.slow {
            // The rest of the body is never read: the connection cannot carry another request.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response.extensions_mut().insert(SlowBody);
        }
        response
    }
}

async fn park(
    State(endpoint): State<ParkEndpoint>,
    Path((namespace, queue)): Path<(String, String)>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    request: Request,
) -> Response {
    let answer = answer(&endpoint, &namespace, &queue, peer.ip(), request).await;
    endpoint.metrics.http_park_request(answer.status.as_u16());
    if answer.status.is_server_error() || answer.status == StatusCode::TOO_MANY_REQUESTS {
        tracing::debug!(%namespace, %queue, status = answer.status.as_u16(), "park request not taken");
    }
    answer.into_response()
}

async fn answer(
    endpoint: &ParkEndpoint,
    namespace: &str,
    queue: &str,
    peer: IpAddr,
    request: Request,
) -> Answer {
    if request.method() != axum::http::Method::POST {
        return Answer::error(405, "only POST parks");
    }
    let Some(shared) = endpoint.scope(namespace) else {
        return Answer::error(
            503,
            "this replica is not parking (a standby, or starting): try again",
        )
        .retry_after(RETRY_AFTER_UNAVAILABLE);
    };
    if !shared.holds_term() {
        return Answer::error(503, "this replica's term on the Lease ran out: try again")
            .retry_after(RETRY_AFTER_UNAVAILABLE);
    }
    let into = ParkInto {
        key: ObjectRef::new(queue).within(namespace),
        shared,
    };
    let Some(q) = into.queue_now() else {
        return Answer::error(
            404,
            format!("no DeadLetterQueue {queue} in namespace {namespace}"),
        );
    };
    let (Some(http), Some(audience)) = (q.spec.http.as_ref(), q.http_audience()) else {
        return Answer::error(
            404,
            format!("DeadLetterQueue {namespace}/{queue} does not accept HTTP (no spec.http)"),
        );
    };
    let token = bearer(request.headers());
    let caller = match endpoint
        .auth
        .check(token, &audience, namespace, http.allow_anonymous, peer)
        .await
    {
        Ok(caller) => caller,
        Err(e) => {
            let answer = Answer::error(e.status(), &e);
            return if e.status() == 503 {
                answer.retry_after(RETRY_AFTER_UNAVAILABLE)
            } else {
                answer
            };
        }
    };
    let (parts, body) = request.into_parts();
    let now = tokio::time::Instant::now();
    let clock = parts
        .extensions
        .get::<RequestClock>()
        .copied()
        .unwrap_or(RequestClock {
            began: now,
            asked: now,
        });
    let pace = Pace::first(clock, head_size(&parts), now);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let limit = body_limit(&q);
    if declared.is_some_and(|n| n > limit) {
        return too_large(limit);
    }
    let (body, _turn) = match read_body(body, limit, declared, pace).await {
        Ok(read) => read,
        Err(answer) => return answer,
    };
    let (headers, unreadable) = lower_case_headers(&parts.headers);
    if let Err(e) = cloudevent::refuse_unreadable(&headers, &unreadable) {
        return Answer::error(e.status(), e);
    }
    let http_request = HttpRequest {
        method: parts.method.as_str(),
        headers,
        // Moved, not copied: the events share it, and a large one's data goes to the body
        // store from it.
        body: bytes::Bytes::from(body),
    };
    let events = match cloudevent::parse_within(queue, &http_request, limit) {
        Ok((_, events)) => events,
        Err(e) => return Answer::error(e.status(), e),
    };
    drop(http_request);
    let mut created = Vec::new();
    let mut existing = Vec::new();
    for event in events {
        match park_one(&into, event).await {
            Ok((name, true)) => created.push(name),
            Ok((name, false)) => existing.push(name),
            Err(answer) => return answer,
        }
    }
    tracing::debug!(%namespace, %queue, %caller, created = created.len(), existing = existing.len(), "parked over HTTP");
    let status = if created.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Answer {
        status,
        body: serde_json::json!({
            "namespace": namespace,
            "created": created,
            "existing": existing,
        }),
        retry_after: None,
        slow: false,
    }
}

/// The largest body `queue` takes: its body store's `maxBytes` (plus framing), else what a
/// record holds.
fn body_limit(queue: &dlq_core::api::DeadLetterQueue) -> usize {
    queue.spec.bodies.as_ref().map_or(MAX_BODY, |b| {
        usize::try_from(b.max())
            .unwrap_or(usize::MAX)
            .saturating_add(FRAMING)
            .max(MAX_BODY)
    })
}

fn too_large(limit: usize) -> Answer {
    let why = if limit > MAX_BODY {
        "more than the queue's body store takes (spec.bodies.maxBytes)"
    } else {
        "more than a record holds (a queue with spec.bodies takes more)"
    };
    Answer::error(413, format!("the body is over {limit} bytes, {why}"))
}

/// The body, at most `limit` bytes (counted as it arrives: what is over is never read), at
/// least [`MIN_BODY_RATE`] over each [`BODY_WINDOW`] until it ends (`pace`, its request's
/// first window) and within [`BODY_TIMEOUT`] (a second more per MiB of `limit` over
/// [`MAX_BODY`]), else 408; one over a record's limit holds one of the [`LARGE_BODIES`] turns,
/// returned with it, from the moment it is known to be that large until the request is
/// answered (the pace waits with it: the wait is not the client's).
async fn read_body(
    body: Body,
    limit: usize,
    declared: Option<usize>,
    mut pace: Pace,
) -> Result<(Vec<u8>, Option<tokio::sync::SemaphorePermit<'static>>), Answer> {
    let timeout = BODY_TIMEOUT + Duration::from_secs((limit.saturating_sub(MAX_BODY) >> 20) as u64);
    let mut body = std::pin::pin!(body);
    let mut turn = None;
    let read = async {
        if declared.is_some_and(|n| n > MAX_BODY) {
            let waiting = tokio::time::Instant::now();
            turn = LARGE_BODY_TURNS.acquire().await.ok();
            pace.waited(waiting.elapsed());
        }
        let mut out = Vec::with_capacity(declared.unwrap_or(0).min(limit));
        loop {
            let frame = match tokio::time::timeout_at(pace.ends, body.frame()).await {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(_) => {
                    pace.window_over(out.len())?;
                    continue;
                }
            };
            let frame = frame.map_err(|e| Answer::error(400, format!("reading the body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                let len = out.len().saturating_add(data.len());
                if len > limit {
                    return Err(too_large(limit));
                }
                if len > MAX_BODY && turn.is_none() {
                    let waiting = tokio::time::Instant::now();
                    turn = LARGE_BODY_TURNS.acquire().await.ok();
                    pace.waited(waiting.elapsed());
                }
                pace.brought(data.len());
                out.extend_from_slice(&data);
            }
            if tokio::time::Instant::now() >= pace.ends {
                pace.window_over(out.len())?;
            }
        }
        Ok(out)
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(out)) => Ok((out, turn)),
        Ok(Err(answer)) => Err(answer),
        Err(_) => Err(Answer::slow_body(format!(
            "the body did not arrive within {} s",
            timeout.as_secs()
        ))),
    }
}

/// A request's pace: what it brought in the current [`BODY_WINDOW`], which ends at `ends`.
struct Pace {
    ends: tokio::time::Instant,
    brought: usize,
}

impl Pace {
    /// The first window of a request (`clock`) whose headers took `head` bytes, its body read
    /// from `now` on: from when its connection was ready for it, lengthened by the time since
    /// its headers were whole (the endpoint's own, authenticating it).
    fn first(clock: RequestClock, head: usize, now: tokio::time::Instant) -> Self {
        Pace {
            ends: clock.began + BODY_WINDOW + now.saturating_duration_since(clock.asked),
            brought: head,
        }
    }

    /// The endpoint kept the body waiting `wait` (for a large body's turn): not the client's.
    fn waited(&mut self, wait: Duration) {
        self.ends += wait;
    }

    fn brought(&mut self, n: usize) {
        self.brought = self.brought.saturating_add(n);
    }

    /// At the end of a window: the next one, or 408 when this one brought less than
    /// [`MIN_BODY_RATE`] (`read` bytes of the body so far).
    fn window_over(&mut self, read: usize) -> Result<(), Answer> {
        let least = MIN_BODY_RATE.saturating_mul(BODY_WINDOW.as_secs() as usize);
        if self.brought < least {
            tracing::debug!(
                brought = self.brought,
                least,
                read,
                "park request's body too slow"
            );
            return Err(Answer::slow_body(format!(
                "the body came too slowly: {} bytes in the last {} s, at least {least} wanted ({MIN_BODY_RATE} bytes a second); {read} read",
                self.brought,
                BODY_WINDOW.as_secs()
            )));
        }
        self.ends += BODY_WINDOW;
        self.brought = 0;
        Ok(())
    }
}

/// About how many bytes a request's line and headers took.
fn head_size(parts: &axum::http::request::Parts) -> usize {
    let line = parts.method.as_str().len() + parts.uri.to_string().len() + 12;
    parts.headers.iter().fold(line, |n, (name, value)| {
        n + name.as_str().len() + value.len() + 4
    })
}

/// The bearer token of `Authorization`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Header names in lower case (HTTP's are case-insensitive), repeated ones joined by ", ";
/// and the names of those whose values are not text (a record could not hold them as they are).
fn lower_case_headers(
    headers: &HeaderMap,
) -> (std::collections::BTreeMap<String, String>, Vec<String>) {
    let mut out: std::collections::BTreeMap<String, String> = Default::default();
    let mut unreadable = Vec::new();
    for (name, value) in headers {
        let name = name.as_str().to_ascii_lowercase();
        let Ok(value) = value.to_str() else {
            unreadable.push(name);
            continue;
        };
        out.entry(name)
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(value);
            })
            .or_insert_with(|| value.to_string());
    }
    (out, unreadable)
}

/// Parks one event once: its record's name and whether it is new, or the answer to give.
async fn park_one(into: &ParkInto, event: Incoming) -> Result<(String, bool), Answer> {
    let Incoming { request, raw } = event;
    // Over the queue's threshold: kept in its body store first, as every source does. The
    // event's bytes are kept too (a share of the body, not a copy): a request that then fails
    // validation is parked as an Invalid record of them (by reference when they are the
    // stored body itself), never of nothing.
    let (mut parking, kept) = keep_body(into, request, &raw).await?;
    loop {
        let mut attempt = parking.request().clone();
        // Two copies of one event posted at once (a sender's retry racing its first try): the
        // second waits and then finds the first's record.
        let _turn = into.in_flight().turn(&mut attempt).await;
        let refused = match into.park(attempt).await {
            Ok(ParkOutcome::Parked(r)) => return Ok((r.name_any(), true)),
            Ok(outcome) => return Ok((outcome.record().name_any(), false)),
            Err(e) if e.is_backpressure() => {
                // Counted into the queue's `status.http.refusedLastMinute`.
                super::backlog::BACKLOGS.refused(into.namespace(), into.queue());
                into.metrics().park_refused(
                    into.namespace(),
                    into.queue(),
                    e.bound().unwrap_or_default(),
                );
                return Err(Answer::error(429, e).retry_after(RETRY_AFTER_FULL));
            }
            Err(e) if e.final_refusal().is_some() => e,
            Err(e @ ParkError::Invalid(_)) => return Err(Answer::error(400, e)),
            Err(e @ ParkError::UnknownQueue { .. }) => return Err(Answer::error(404, e)),
            // Sealed, the job outgrew a record: too large, as an oversize payload is.
            Err(e @ ParkError::Seal(dlq_core::seal::SealError::TooLarge { .. })) => {
                return Err(Answer::error(413, e));
            }
            Err(e) => {
                tracing::warn!(namespace = %into.namespace(), queue = %into.queue(), job = %parking.request().job.id, error = %e, "parking over HTTP failed; the sender keeps the event");
                return Err(Answer::error(503, e).retry_after(RETRY_AFTER_UNAVAILABLE));
            }
        };
        let refusal = refused.final_refusal().unwrap_or_default();
        let job = parking.request().job.id.clone();
        // A body kept in the store is parked by reference or not at all.
        let next = match kept {
            Some(_) => None,
            None => parking.after_refusal(refusal),
        };
        let Some(next) = next else {
            return Err(Answer::error(400, refused));
        };
        tracing::warn!(namespace = %into.namespace(), queue = %into.queue(), %job, error = %refused, fallback = next.fallbacks(), "the apiserver refused the record for good; parking the event as Invalid with its exact bytes");
        parking = next;
    }
}

/// The core's plan of `request` carried out up to its park (`ParkInto::keep_body`, the path
/// of every source): its payload kept in the queue's body store when it is over the queue's
/// threshold, and the guard keeping the object from the sweep until the record exists. Over
/// `maxBytes`: 413; invalid even as an Invalid record of its bytes: 400; the store not taking
/// it within [`BODY_STORE_WAIT`]: 503 (the sender retries; an object already written and never
/// referenced is swept after `orphansAfter`).
async fn keep_body(
    into: &ParkInto,
    request: ParkRequest,
    raw: &bytes::Bytes,
) -> Result<(Parking, Option<crate::body::Kept>), Answer> {
    let keeping = into.keep_body(request, Some(raw), "with the sender", &|| async {});
    match tokio::time::timeout(BODY_STORE_WAIT, keeping).await {
        Ok(Ok(kept)) => Ok(kept),
        Ok(Err(e @ ParkError::Invalid(ParkInvalid::PayloadTooLarge { .. }))) => {
            Err(Answer::error(413, e))
        }
        Ok(Err(e)) => Err(Answer::error(400, e)),
        Err(_) => Err(Answer::error(
            503,
            "the queue's body store did not take the body in time: try again",
        )
        .retry_after(RETRY_AFTER_UNAVAILABLE)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window that brought less than its minimum ends the body (a 408 marked slow); one that
    /// brought enough starts the next, which starts from nothing.
    #[test]
    fn a_body_must_bring_its_minimum_in_every_window() {
        let least = MIN_BODY_RATE * BODY_WINDOW.as_secs() as usize;
        let start = tokio::time::Instant::now();
        let clock = RequestClock {
            began: start,
            asked: start + Duration::from_secs(2),
        };
        // Headers of 100 bytes in 2 s, then 3 s authenticating: the first window ends 13 s in.
        let mut pace = Pace::first(clock, 100, start + Duration::from_secs(5));
        assert_eq!(pace.ends, start + BODY_WINDOW + Duration::from_secs(3));
        pace.waited(Duration::from_secs(1));
        let start = pace.ends;
        pace.brought(least - 100);
        assert!(pace.window_over(least).is_ok());
        assert_eq!(pace.ends, start + BODY_WINDOW);
        pace.brought(least - 1);
        let cut = pace.window_over(2 * least - 1).expect_err("too slow");
        assert_eq!(cut.status, StatusCode::REQUEST_TIMEOUT);
        assert!(cut.slow);
        let response = cut.into_response();
        assert!(response.extensions().get::<SlowBody>().is_some());
        assert_eq!(
            response
                .headers()
                .get(header::CONNECTION)
                .map(|v| v.as_bytes()),
            Some(&b"close"[..])
        );
    }

    #[test]
    fn only_a_bearer_token_is_a_token() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  t0k "),
        );
        assert_eq!(bearer(&h), Some("t0k"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer(&h), None);
    }

    #[test]
    fn repeated_headers_are_joined_and_names_lowered() {
        let mut h = HeaderMap::new();
        h.append("Ce-Id", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.append(
            "Ce-Subject",
            HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"),
        );
        let (out, unreadable) = lower_case_headers(&h);
        assert_eq!(out.get("ce-id").map(String::as_str), Some("1"));
        assert_eq!(out.get("x-a").map(String::as_str), Some("1, 2"));
        assert_eq!(unreadable, ["ce-subject"]);
    }

    /// A structured event is read for its attributes only: its `data`, here 4 MiB of a JSON
    /// array of small numbers (which as JSON values would take about 32 bytes an element, some
    /// 70 MiB), is never read into values, so a post of the queue's `maxBytes` cannot take the
    /// operator's memory many times over.
    #[test]
    fn a_structured_events_data_is_not_read_into_values() {
        let mut text =
            String::from(r#"{"specversion":"1.0","id":"e-1","source":"/s","type":"t","data":[0"#);
        while text.len() < 4 << 20 {
            text.push_str(",0");
        }
        text.push_str("]}");
        let post = HttpRequest {
            method: "POST",
            headers: [(
                "content-type".to_string(),
                "application/cloudevents+json".to_string(),
            )]
            .into(),
            body: bytes::Bytes::from(text),
        };
        let before = dlq_testenv::alloc::thread::start_peak();
        let (_, events) = cloudevent::parse_within("relayer", &post, 8 << 20).expect("parsed");
        let peak = dlq_testenv::alloc::thread::peak_above(before);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].request.job.id, "e-1@/s");
        assert!(
            peak < (post.body.len() / 8) as isize,
            "read with {peak} bytes beside a body of {}",
            post.body.len()
        );
    }
}
