//! Who may hold one of the park endpoint's connections, and the answer to those that may not.
//!
//! A client address holds at most [`MAX_CONNECTIONS_PER_CLIENT`] connections, the endpoint
//! [`MAX_CONNECTIONS`] (`--park-max-connections`): a client that opens many and trickles its
//! headers or its body (slowloris) cannot take every file descriptor. A connection over either limit is still answered, `429` or
//! `503` with `Retry-After` and `Connection: close`, so a sender behind a shared address (a
//! Knative dispatcher, a node's SNAT, an ingress) can tell a refusal from a network fault.
//! The answer waits for the request to begin, as long as a served connection's first request
//! may take (a client reading an answer before it has written, as Go's `net/http` or hyper's
//! client, takes it for an unsolicited one and drops it); a connection that sends nothing by
//! then is closed unanswered. Refusals are bounded as well: at most [`MAX_REFUSING`] at once,
//! each in a fixed buffer and over within twice [`REFUSAL_LINGER`] of that deadline; beyond
//! them a connection is closed at once, unanswered (counted as such).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;

/// Connections one client address may hold open at once.
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 32;
/// Connections the endpoint holds open at once, unless `--park-max-connections` says otherwise.
pub const MAX_CONNECTIONS: usize = 4096;
/// Connections being refused at once; more are closed without an answer.
pub const MAX_REFUSING: usize = 1024;
/// Longest time to write a refusal, and then to read what the client still sends until it
/// closes (closing with its request unread would reset the connection under the answer).
const REFUSAL_LINGER: Duration = Duration::from_secs(2);
/// What a refused sender waits before it tries again: a slot frees when a request ends, and
/// a trickling connection holds one at most the header timeout.
const RETRY_AFTER_BUSY: u64 = 1;

/// The label of `dlq_http_refused_total{reason}` for a request whose body came too slowly
/// (answered 408 by the request's handler, not here): counted beside the refused connections
/// because it is the same defence, a slot freed from a client that holds it.
pub const SLOW_BODY: &str = "slow_body";

/// Why a connection is not served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its client address holds [`MAX_CONNECTIONS_PER_CLIENT`]: 429.
    ClientLimit,
    /// The endpoint holds `max` connections (its limit): 503.
    ConnectionLimit { max: usize },
}

impl Refusal {
    /// The label of `dlq_http_refused_total{reason}`.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::ClientLimit => "client_limit",
            Refusal::ConnectionLimit { .. } => "connection_limit",
        }
    }

    /// The whole HTTP/1.1 answer, written before the request is read.
    fn answer(self) -> String {
        let (status, error) = match self {
            Refusal::ClientLimit => (
                "429 Too Many Requests",
                format!(
                    "this client address holds {MAX_CONNECTIONS_PER_CLIENT} connections to the park endpoint, as many as it may: try again"
                ),
            ),
            Refusal::ConnectionLimit { max } => (
                "503 Service Unavailable",
                format!("the park endpoint holds {max} connections, as many as it may: try again"),
            ),
        };
        let body = serde_json::json!({ "error": error }).to_string();
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nretry-after: {RETRY_AFTER_BUSY}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }
}

/// Connections open per client address, and in all (at most `max`).
#[derive(Clone)]
pub struct Connections {
    open: Arc<Mutex<Open>>,
    max: usize,
}

#[derive(Default)]
struct Open {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// One open connection, counted until dropped.
pub struct Counted {
    connections: Connections,
    client: IpAddr,
}

impl Connections {
    /// No connection open yet; the endpoint holds `max` at most.
    pub fn new(max: usize) -> Self {
        Connections {
            open: Arc::default(),
            max,
        }
    }

    /// A place for one more connection from `client`, or why there is none.
    pub fn enter(&self, client: IpAddr) -> Result<Counted, Refusal> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mine = open.per_client.get(&client).copied().unwrap_or(0);
        if mine >= MAX_CONNECTIONS_PER_CLIENT {
            return Err(Refusal::ClientLimit);
        }
        // Checked before the client gets an entry: a full endpoint keeps no entry of a
        // client it refused, however many addresses knock.
        if open.total >= self.max {
            return Err(Refusal::ConnectionLimit { max: self.max });
        }
        open.per_client.insert(client, mine + 1);
        open.total += 1;
        Ok(Counted {
            connections: self.clone(),
            client,
        })
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut open = self
            .connections
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        open.total = open.total.saturating_sub(1);
        if let Some(mine) = open.per_client.get_mut(&self.client) {
            *mine = mine.saturating_sub(1);
            if *mine == 0 {
                open.per_client.remove(&self.client);
            }
        }
    }
}

/// The connections being refused, at most [`MAX_REFUSING`].
#[derive(Default)]
pub struct Refusals {
    under_way: tokio::task::JoinSet<()>,
}

impl Refusals {
    /// Answers `tcp` with `refusal` beside the accept loop once its request begins (by
    /// `asked_by`), or closes it at once when [`MAX_REFUSING`] are under way; counts it
    /// either way.
    pub fn refuse(
        &mut self,
        tcp: TcpStream,
        tls: Option<TlsAcceptor>,
        asked_by: Instant,
        refusal: Refusal,
        metrics: &Metrics,
    ) {
        while self.under_way.try_join_next().is_some() {}
        if self.under_way.len() >= MAX_REFUSING {
            metrics.http_refused(refusal.reason(), false);
            return;
        }
        let metrics = metrics.clone();
        self.under_way.spawn(async move {
            let answered = answer(tcp, tls, asked_by, refusal).await;
            metrics.http_refused(refusal.reason(), answered);
        });
    }
}

/// Writes `refusal`'s answer on `tcp` (after its TLS handshake, if any) once its request
/// begins by `asked_by`; whether it was written.
async fn answer(
    tcp: TcpStream,
    tls: Option<TlsAcceptor>,
    asked_by: Instant,
    refusal: Refusal,
) -> bool {
    let Some(acceptor) = tls else {
        return answer_on(tcp, asked_by, refusal).await;
    };
    match tokio::time::timeout_at(asked_by, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => answer_on(tls, asked_by, refusal).await,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "TLS handshake of a refused connection failed");
            false
        }
        Err(_) => false,
    }
}

/// Waits for the request to begin (by `asked_by`), writes the answer and closes the sending
/// side, then reads until the client closes (at most [`REFUSAL_LINGER`]).
async fn answer_on<Io: AsyncRead + AsyncWrite + Unpin>(
    mut io: Io,
    asked_by: Instant,
    refusal: Refusal,
) -> bool {
    let mut scratch = [0u8; 4096];
    match tokio::time::timeout_at(asked_by, io.read(&mut scratch)).await {
        Ok(Ok(1..)) => {}
        // Nothing asked, nothing to answer: the client went away, or said nothing in time.
        Ok(Ok(0) | Err(_)) | Err(_) => return false,
    }
    let answer = refusal.answer();
    let written = tokio::time::timeout(REFUSAL_LINGER, async {
        io.write_all(answer.as_bytes()).await?;
        io.shutdown().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return false;
    }
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        while let Ok(1..) = io.read(&mut scratch).await {}
    })
    .await;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_over_its_share_is_refused_and_its_slot_returns_when_one_closes() {
        let connections = Connections::new(MAX_CONNECTIONS);
        let client: IpAddr = [10, 0, 0, 1].into();
        let mut held: Vec<Counted> = (0..MAX_CONNECTIONS_PER_CLIENT)
            .map(|_| connections.enter(client).expect("a slot"))
            .collect();
        assert_eq!(connections.enter(client).err(), Some(Refusal::ClientLimit));
        assert!(connections.enter([10, 0, 0, 2].into()).is_ok());
        held.pop();
        assert!(connections.enter(client).is_ok());
    }

    #[test]
    fn a_full_endpoint_keeps_no_entry_for_the_clients_it_refuses() {
        let connections = Connections::new(MAX_CONNECTIONS);
        let _held: Vec<Counted> = (0..MAX_CONNECTIONS)
            .map(|n| {
                let client = IpAddr::from((n as u32).to_be_bytes());
                connections.enter(client).expect("a slot")
            })
            .collect();
        let stranger: IpAddr = [192, 0, 2, 1].into();
        assert_eq!(
            connections.enter(stranger).err(),
            Some(Refusal::ConnectionLimit {
                max: MAX_CONNECTIONS
            })
        );
        let open = connections.open.lock().expect("lock");
        assert_eq!(open.per_client.len(), MAX_CONNECTIONS);
    }

    #[test]
    fn a_refusal_is_a_whole_http_answer_with_retry_after() {
        let full = Refusal::ConnectionLimit {
            max: MAX_CONNECTIONS,
        };
        for (refusal, status) in [(Refusal::ClientLimit, 429), (full, 503)] {
            let answer = refusal.answer();
            let (head, body) = answer.split_once("\r\n\r\n").expect("head and body");
            assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
            assert!(head.contains("\r\nretry-after: 1"), "{head}");
            assert!(head.contains("\r\nconnection: close"), "{head}");
            assert!(
                head.contains(&format!("\r\ncontent-length: {}", body.len())),
                "{head}"
            );
            let body: serde_json::Value = serde_json::from_str(body).expect("JSON");
            assert!(
                body["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("try again"))
            );
        }
    }
}
