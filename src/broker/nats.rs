//! NATS, for its source (JetStream advisories and the stream's messages) and its target: a
//! client connected on first use (async-nats reconnects it afterwards), the header codec (a
//! header's several values kept in one job header, `nats-multi`) and how a JetStream publish
//! error is classified.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::{HeaderMap, ServerAddr};
use tokio::sync::Mutex;

use dlq_core::api::{NatsSourceSpec, NatsTargetSpec};

use super::BrokerError;
use super::backend::{ConnectError, Sides};
use crate::secret::SecretReads;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub use dlq_core::headers::nats::{MULTI_HEADER, carried_headers, parse_header_block};

/// The NATS headers that carry `headers` untouched.
pub fn nats_headers(headers: &BTreeMap<String, String>) -> Result<HeaderMap, BrokerError> {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        if name == MULTI_HEADER {
            let multi: BTreeMap<String, Vec<String>> = serde_json::from_str(value)
                .map_err(|e| BrokerError::Invalid(format!("header {MULTI_HEADER}: {e}")))?;
            for (k, vs) in multi {
                for v in vs {
                    map.append(k.as_str(), v);
                }
            }
        } else {
            map.insert(name.as_str(), value.as_str());
        }
    }
    Ok(map)
}

/// A NATS client, connected on first use; async-nats reconnects it by itself afterwards.
pub struct NatsConn {
    servers: Vec<ServerAddr>,
    client: Mutex<Option<async_nats::Client>>,
}

impl NatsConn {
    pub fn new(url: &str) -> Result<Self, BrokerError> {
        let servers = url
            .split(',')
            .map(|s| s.trim().parse::<ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| {
                BrokerError::Config("the NATS URL is not a valid nats:// server list".into())
            })?;
        if servers.is_empty() {
            return Err(BrokerError::Config("the NATS URL names no server".into()));
        }
        Ok(NatsConn {
            servers,
            client: Mutex::new(None),
        })
    }

    /// The client, if it is connected right now.
    pub async fn get(&self) -> Result<async_nats::Client, BrokerError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return match c.connection_state() {
                State::Connected => Ok(c.clone()),
                _ => Err(BrokerError::Unreachable(
                    "not connected to NATS (reconnecting)".into(),
                )),
            };
        }
        let client = async_nats::ConnectOptions::new()
            .name("deadletter-operator")
            .connection_timeout(CONNECT_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            .connect(self.servers.clone())
            .await
            // The error kind only: the address may carry credentials.
            .map_err(|e| BrokerError::Unreachable(format!("connecting to NATS: {}", e.kind())))?;
        *slot = Some(client.clone());
        Ok(client)
    }
}

/// How many messages `stream` holds (a work-queue stream: those not yet acknowledged).
pub async fn stream_depth(client: async_nats::Client, stream: &str) -> Result<i64, BrokerError> {
    let js = async_nats::jetstream::new(client);
    let mut stream = js
        .get_stream(stream)
        .await
        .map_err(|e| BrokerError::Unreachable(format!("stream {stream}: {}", e.kind())))?;
    let info = stream
        .info()
        .await
        .map_err(|e| BrokerError::Unreachable(format!("stream info: {e}")))?;
    Ok(i64::try_from(info.state.messages).unwrap_or(i64::MAX))
}

/// Sorts a JetStream publish error into refused (no stream, the server said no) or unreachable.
pub fn publish_error(
    e: async_nats::jetstream::context::PublishError,
    subject: &str,
) -> BrokerError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => {
            BrokerError::Refused(format!("no JetStream stream captures subject {subject}"))
        }
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            BrokerError::Unreachable(format!("JetStream publish: {e}"))
        }
        _ => BrokerError::Refused(format!("JetStream publish: {e}")),
    }
}

/// A NATS source's server URL: its own Secret or URL; without either, its queue's NATS
/// target's Secret or URL.
pub async fn source_url(
    secrets: &mut SecretReads<'_>,
    sides: Sides<'_, NatsSourceSpec>,
) -> Result<String, ConnectError> {
    // The source's own plain URL wins over the target's Secret.
    let own_url = sides.own.url.as_ref();
    let secret_ref = sides.either(
        |s| s.url_secret_ref.as_ref(),
        |t| t.url_secret_ref.as_ref().filter(|_| own_url.is_none()),
    );
    if let Some(r) = secret_ref {
        return Ok(secrets.value(r).await?);
    }
    let why = "source.nats needs url or urlSecretRef (the target is not nats)";
    let url = sides.either(|s| s.url.as_ref(), |t| t.url.as_ref());
    url.cloned()
        .ok_or_else(|| ConnectError::Unnamed(why.into()))
}

/// A NATS target's server URL: its Secret, else its plain `url`.
pub async fn target_url(
    secrets: &mut SecretReads<'_>,
    target: &NatsTargetSpec,
) -> Result<String, ConnectError> {
    match (&target.url, &target.url_secret_ref) {
        (_, Some(r)) => Ok(secrets.value(r).await?),
        (Some(plain), None) => Ok(plain.clone()),
        (None, None) => Err(ConnectError::Unnamed(
            "nats target needs url or urlSecretRef".into(),
        )),
    }
}
