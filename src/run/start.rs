//! The process from its parsed options to its exit: tracing, the Kubernetes client, the probes
//! server, the park endpoint and the reveal API, then leadership, then every scope
//! ([`super::run_scope`]) until a stop signal. `main` parses the command line and hands over
//! here, so the wiring lives in one place.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use kube::runtime::events::Reporter;

use super::decided::{StallAlarm, Vigil};
use super::endpoints::{self, EndpointError, ParkOptions, RevealOptions};
use super::lease::{self, Lead, LeaseError, LeaseOptions};
use super::shutdown::{self, either};
use super::{Process, run_scope};
use crate::alert::{AlertError, Alerting, Alertmanager};
use crate::metrics::Metrics;
use crate::reconcile::{Mechanisms, Settings, UnknownMechanism};
use crate::server::{self, Probes};
use crate::state::apiserver::{Apiserver, KubeApiserver};
use crate::state::ceiling::Ceiling;

/// How the log lines are written.
#[derive(Clone, Copy, Debug, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Everything `run` was told on its command line.
#[derive(Clone, Debug)]
pub struct Options {
    /// Address for /metrics, /healthz and /readyz.
    pub metrics_addr: SocketAddr,
    pub lease: LeaseOptions,
    /// Namespaces to watch; empty means all.
    pub watch_namespaces: Vec<String>,
    /// Identity in Events and the Lease; None: one made of the process id.
    pub pod_name: Option<String>,
    pub log_format: LogFormat,
    /// Concurrent reconciles per controller.
    pub concurrency: u16,
    pub backoff_cap_seconds: u64,
    /// How often the body stores are swept, in seconds.
    pub body_sweep_seconds: u64,
    /// The SQS source's long poll, in seconds.
    pub sqs_long_poll_seconds: u8,
    pub decided_resync_seconds: u64,
    pub stall_after_seconds: u64,
    /// The records the operator keeps across every queue it watches (`--max-records`); None:
    /// no ceiling beyond each queue's maxParked and the namespaces' ResourceQuotas.
    pub max_records: Option<u64>,
    pub alerts: AlertOptions,
    pub park: ParkOptions,
    pub reveal: RevealOptions,
    /// Throughput mechanisms switched off ([`Mechanisms::without`]): only the bench's A/B sets
    /// them (feature `bench`).
    pub disable: Vec<String>,
}

/// Per-record alerts: on once an Alertmanager URL is given.
#[derive(Clone, Debug, Default)]
pub struct AlertOptions {
    pub alertmanager_urls: Vec<String>,
    pub alertmanager_ca_file: Option<PathBuf>,
    pub alertmanager_token_file: Option<PathBuf>,
    pub alert_lease: String,
    pub alertmanager_undeliverable_after: String,
    pub alert_runbook_base_url: String,
}

/// Why the process could not start, or why it stopped other than when asked to.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("--disable")]
    Disable(#[source] UnknownMechanism),
    #[error("connecting to Kubernetes (KUBECONFIG or in-cluster config)")]
    Connect(#[source] kube::Error),
    #[error("reading {flag} {}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {text:?} is not a duration such as 4m")]
    Duration { flag: &'static str, text: String },
    #[error(transparent)]
    Alertmanager(#[from] AlertError),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("lost leadership")]
    LostLeadership,
    #[error("gave up leadership: no progress on decided records")]
    Stalled,
}

/// The record watches' client: the default one without kube's retry of 503 and 429 answers.
/// That retry sleeps the apiserver's Retry-After inside the watch request: a restarting
/// apiserver answers a watch 503 with Retry-After 5, so the record watch slept 5 s while the
/// apiserver was serving again, and decisions made meanwhile waited (issue 44). A watch
/// retries on its own, after its backoff (0.8 s at first).
async fn watch_client() -> Result<kube::Client, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.default_retry = false;
    kube::Client::try_from(config)
}

/// Runs the operator until SIGTERM (Ok), a lost Lease or a stall (Err).
pub async fn operator(options: Options) -> Result<(), StartError> {
    init_tracing(options.log_format);
    crate::https::install_crypto_provider();
    let mut settings = settings(&options)?;
    let client = kube::Client::try_default()
        .await
        .map_err(StartError::Connect)?;
    let watch_client = watch_client().await.map_err(StartError::Connect)?;
    let identity = options
        .pod_name
        .clone()
        .unwrap_or_else(|| format!("deadletter-operator-{}", std::process::id()));
    let alerts = alerting(&options.alerts)?;
    let metrics = Metrics::default();
    let ready = Arc::new(AtomicBool::new(false));
    let shutdown = shutdown::termination();
    let server = tokio::spawn(server::serve(
        options.metrics_addr,
        Probes {
            metrics: metrics.clone(),
            ready: ready.clone(),
        },
        shutdown.clone(),
    ));
    let park_endpoint =
        endpoints::park_endpoint(&options.park, &client, &metrics, &shutdown).await?;
    let reporter = Reporter {
        controller: "deadletter-operator".into(),
        instance: Some(identity.clone()),
    };
    endpoints::reveal_api(&options.reveal, &client, &reporter, &shutdown).await?;
    let Some(Lead { lost, lease }) =
        lease::lead(&options.lease, &client, &identity, &ready, &shutdown).await?
    else {
        return Ok(());
    };
    if let Some(service) =
        endpoints::leader_service(&options.park, &options.lease.namespace, &identity)
    {
        let client = client.clone();
        tokio::spawn(async move { service.point_here(client).await });
    }
    let leadership = lease::follow_lease(&options.lease, &client, &identity);
    let (stall_alarm, stalled) = StallAlarm::new();
    let stalled = lease::stalled_leader(stalled, ready.clone());
    let stop = either(shutdown.clone(), either(lost.clone(), stalled.clone()));
    let scopes = scopes(&options.watch_namespaces);
    // The sources' backlogs and the park endpoint's refusals, into the queues' status.
    tokio::spawn(crate::source::backlog::write_backlogs(
        client.clone(),
        stop.clone(),
    ));
    let ceiling = options.max_records.map(|limit| {
        let ceiling = Ceiling::new(dlq_client::ceiling::Ceiling {
            namespace: options.lease.namespace.clone(),
            name: dlq_core::ceiling::ledger_name(&options.lease.name),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
        });
        tracing::info!(limit, ledger = %ceiling.ledger().name, namespace = %ceiling.ledger().namespace, "records kept across every watched queue bounded (--max-records)");
        let apiserver: Arc<dyn Apiserver> =
            Arc::new(KubeApiserver::new(client.clone(), reporter.clone()));
        tokio::spawn(ceiling.clone().keep_count(
            client.clone(),
            apiserver,
            metrics.clone(),
            scopes.len(),
            stop.clone(),
        ));
        ceiling
    });
    ready.store(true, Ordering::Relaxed);
    tracing::info!(namespaces = ?scopes, "controllers starting");
    settings.leadership = leadership;
    let mechanisms = settings.mechanisms;
    let process = Process {
        client: client.clone(),
        watch_client,
        metrics: metrics.clone(),
        reporter,
        settings,
        alerts,
        park_endpoint,
        vigil: Vigil {
            resync: Duration::from_secs(options.decided_resync_seconds.max(1)),
            stall_after: Duration::from_secs(options.stall_after_seconds.max(1)),
        },
        stall_alarm: Some(stall_alarm),
        ceiling,
        sources: crate::source::Tuning {
            kafka_in_flight: mechanisms.kafka_in_flight,
            sqs_receivers: mechanisms.sqs_receivers,
            sqs_long_poll: Duration::from_secs(options.sqs_long_poll_seconds.into()),
        },
        sweep_every: Duration::from_secs(options.body_sweep_seconds.max(1)),
    };
    futures::future::join_all(
        scopes
            .into_iter()
            .map(|ns| run_scope(process.clone(), ns, stop.clone())),
    )
    .await;
    if lost.clone().now_or_never().is_some() {
        return Err(StartError::LostLeadership);
    }
    if stalled.clone().now_or_never().is_some() {
        // Handed over at once: the standby need not wait for the Lease to expire.
        lease.release().await;
        return Err(StartError::Stalled);
    }
    // The controllers have stopped: hand the Lease over now rather than make the standby
    // wait for it to expire.
    lease.release().await;
    let _ = server.await;
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube=warn,lapin=error,async_nats=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a pod's log (or a file) would carry the escape codes.
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// The alerting configuration, None without an Alertmanager URL.
fn alerting(options: &AlertOptions) -> Result<Option<Arc<Alerting>>, StartError> {
    let urls: Vec<&str> = options
        .alertmanager_urls
        .iter()
        .map(|u| u.trim())
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() {
        return Ok(None);
    }
    let read = |p: &Option<PathBuf>, flag: &'static str| {
        p.as_deref()
            .map(|p: &Path| {
                std::fs::read_to_string(p).map_err(|source| StartError::Read {
                    flag,
                    path: p.to_path_buf(),
                    source,
                })
            })
            .transpose()
    };
    let ca = read(&options.alertmanager_ca_file, "--alertmanager-ca-file")?;
    let token = read(
        &options.alertmanager_token_file,
        "--alertmanager-token-file",
    )?;
    let duration = |text: &str, flag: &'static str| {
        dlq_core::duration::parse_duration(text)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| StartError::Duration {
                flag,
                text: text.to_string(),
            })
    };
    let alertmanagers = urls
        .iter()
        .map(|u| Alertmanager::new(u, token.as_deref(), ca.as_deref()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Arc::new(Alerting {
        alertmanagers,
        lease: duration(&options.alert_lease, "--alert-lease")?,
        undeliverable_after: duration(
            &options.alertmanager_undeliverable_after,
            "--alertmanager-undeliverable-after",
        )?,
        links: dlq_core::alert::Links {
            runbook_base_url: options.alert_runbook_base_url.clone(),
        },
    })))
}

/// The namespaces to watch: each named one, or all (None) when none is named.
fn scopes(watch_namespaces: &[String]) -> Vec<Option<String>> {
    let named: Vec<String> = watch_namespaces
        .iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if named.is_empty() {
        vec![None]
    } else {
        named.into_iter().map(Some).collect()
    }
}

fn settings(options: &Options) -> Result<Settings, StartError> {
    let mechanisms = Mechanisms::without(&options.disable).map_err(StartError::Disable)?;
    if mechanisms != Mechanisms::default() {
        tracing::warn!(
            ?mechanisms,
            "throughput mechanisms switched off (--disable)"
        );
    }
    Ok(Settings {
        backoff_cap: Duration::from_secs(options.backoff_cap_seconds.max(1)),
        concurrency: options.concurrency.max(1),
        mechanisms,
        park_url: options
            .park
            .park_addr
            .and(options.park.park_url.clone())
            .filter(|u| !u.trim().is_empty()),
        park_ca_file: options.park.park_tls_dir.as_ref().map(|d| d.join("ca.crt")),
        ..Settings::default()
    })
}
