//! The servers a replica starts before it leads: the HTTP park endpoint (a standby answers
//! 503 until its scopes register) and the reveal API (every replica serves it); and the park
//! Service a leader points at itself.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use kube::runtime::events::Reporter;

use super::shutdown::Shutdown;
use crate::metrics::Metrics;
use crate::serving_tls::TlsError;
use crate::source::http::ParkEndpoint;
use crate::source::http::service::LeaderService;

/// The HTTP park endpoint: on once an address is given.
#[derive(Clone, Debug)]
pub struct ParkOptions {
    pub park_addr: Option<SocketAddr>,
    /// Directory holding tls.crt and tls.key.
    pub park_tls_dir: Option<PathBuf>,
    /// Serve without TLS.
    pub park_plaintext: bool,
    /// The endpoint's URL as senders reach it.
    pub park_url: Option<String>,
    /// Networks that queues allowing anonymous callers take them from.
    pub park_anonymous_from: Vec<ipnet::IpNet>,
    /// The selector-less Service the leader points at itself.
    pub park_service: Option<String>,
    /// This replica's address in that Service's EndpointSlice.
    pub pod_ip: Option<IpAddr>,
    /// Connections the endpoint holds at once (more are answered 503).
    pub park_max_connections: usize,
}

impl Default for ParkOptions {
    fn default() -> Self {
        ParkOptions {
            park_addr: None,
            park_tls_dir: None,
            park_plaintext: false,
            park_url: None,
            park_anonymous_from: Vec::new(),
            park_service: None,
            pod_ip: None,
            park_max_connections: crate::source::http::connections::MAX_CONNECTIONS,
        }
    }
}

/// The reveal API: on once an address (and its certificate's directory) is given.
#[derive(Clone, Debug, Default)]
pub struct RevealOptions {
    pub reveal_addr: Option<SocketAddr>,
    pub reveal_tls_dir: Option<PathBuf>,
}

/// Why a server could not start; names flags and addresses, never a key.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("{flag}")]
    Tls {
        flag: &'static str,
        #[source]
        source: TlsError,
    },
    #[error("--park-tls-dir and --park-plaintext exclude each other")]
    ParkTlsAndPlaintext,
    #[error("--park-addr needs --park-tls-dir (tls.crt, tls.key), or --park-plaintext")]
    ParkNeedsTls,
    #[error("binding the {server} to {addr}")]
    Bind {
        server: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The park Service to point at this replica once it leads, when `--park-service` is given.
pub fn leader_service(
    park: &ParkOptions,
    namespace: &str,
    identity: &str,
) -> Option<LeaderService> {
    Some(LeaderService {
        namespace: namespace.to_string(),
        service: park.park_service.clone()?,
        pod: identity.to_string(),
        ip: park.pod_ip?,
        port: park.park_addr?.port(),
    })
}

/// Starts the HTTP park endpoint when `--park-addr` is given: from the start, so a standby
/// answers 503 (its scopes register once it leads).
pub async fn park_endpoint(
    options: &ParkOptions,
    client: &kube::Client,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Result<Option<ParkEndpoint>, EndpointError> {
    let Some(addr) = options.park_addr else {
        return Ok(None);
    };
    let tls = match (&options.park_tls_dir, options.park_plaintext) {
        (Some(dir), false) => {
            Some(
                crate::serving_tls::server_config(dir).map_err(|source| EndpointError::Tls {
                    flag: "--park-tls-dir",
                    source,
                })?,
            )
        }
        (None, true) => None,
        (Some(_), true) => return Err(EndpointError::ParkTlsAndPlaintext),
        (None, false) => return Err(EndpointError::ParkNeedsTls),
    };
    let endpoint = ParkEndpoint::new(
        client.clone(),
        metrics.clone(),
        options.park_anonymous_from.clone(),
    );
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EndpointError::Bind {
            server: "park endpoint",
            addr,
            source,
        })?;
    tracing::info!(%addr, tls = tls.is_some(), url = options.park_url.as_deref().unwrap_or(""), max_connections = options.park_max_connections, "serving the HTTP park endpoint");
    let (served, max) = (endpoint.clone(), options.park_max_connections);
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        if let Err(e) = crate::source::http::serve(served, listener, tls, max, shutdown).await {
            tracing::error!(error = %e, "the HTTP park endpoint stopped");
        }
    });
    Ok(Some(endpoint))
}

/// Starts the reveal API when `--reveal-addr` is given: on every replica, leading or not.
pub async fn reveal_api(
    options: &RevealOptions,
    client: &kube::Client,
    reporter: &Reporter,
    shutdown: &Shutdown,
) -> Result<(), EndpointError> {
    let (Some(addr), Some(dir)) = (options.reveal_addr, options.reveal_tls_dir.clone()) else {
        return Ok(());
    };
    crate::serving_tls::check(&dir).map_err(|source| EndpointError::Tls {
        flag: "--reveal-tls-dir",
        source,
    })?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EndpointError::Bind {
            server: "reveal API",
            addr,
            source,
        })?;
    tracing::info!(%addr, "serving the reveal API (deadletterpayloads.payloads.dlq.dev)");
    let (client, reporter, shutdown) = (client.clone(), reporter.clone(), shutdown.clone());
    tokio::spawn(async move {
        if let Err(e) = crate::reveal::serve(client, reporter, listener, &dir, shutdown).await {
            tracing::error!(error = %e, "the reveal API stopped");
        }
    });
    Ok(())
}
