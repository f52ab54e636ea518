//! `deadletter-operator`: `run` the controller, or print the `crds`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use deadletter::alert::{Alerting, Alertmanager};
use deadletter::metrics::Metrics;
use deadletter::reconcile::{Mechanisms, Settings};
use deadletter::run::{self, Process};
use deadletter::server::{self, Probes};
use deadletter::source::http::ParkEndpoint;
use deadletter::source::http::service::LeaderService;
use deadletter::state::leadership::Leadership;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::runtime::events::Reporter;

#[derive(Parser)]
#[command(
    version,
    about = "Parks given-up queue jobs as DeadLetter resources; redrives or drops them on a signed decision"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controllers, /metrics, /healthz and /readyz.
    Run(Box<RunArgs>),
    /// Print the CustomResourceDefinitions (YAML).
    Crds,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "DLQ_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Only one replica acts at a time (a Lease). Correctness never depends on it: every
    /// resolution is a compare-and-swap.
    #[arg(long, env = "DLQ_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    #[arg(long, default_value = "deadletter-operator")]
    lease_name: String,
    /// Namespaces to watch, comma-separated; empty means all.
    #[arg(
        long,
        env = "WATCH_NAMESPACES",
        value_delimiter = ',',
        default_value = ""
    )]
    watch_namespaces: Vec<String>,
    /// Identity in Events and the Lease.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    #[arg(long, env = "DLQ_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Concurrent reconciles per controller.
    #[arg(long, default_value_t = 32)]
    concurrency: u16,
    /// Longest wait between requeue attempts while a broker is down, in seconds.
    #[arg(long, default_value_t = 60)]
    backoff_cap_seconds: u64,
    /// How often the records decided and still Parked are listed again, in seconds (a watch
    /// event lost across an apiserver restart costs one period, not the decision).
    #[arg(long, default_value_t = 30)]
    decided_resync_seconds: u64,
    /// A leader that has not attempted a decided record for this long (seconds; at least two
    /// backoff caps plus a resync period) gives up its Lease: /readyz false, a Warning Event
    /// `LeaderStalled` on the queue, a log line, and the process exits for a standby to lead.
    #[arg(long, default_value_t = 180)]
    stall_after_seconds: u64,
    #[command(flatten)]
    alerts: AlertArgs,
    #[command(flatten)]
    park: ParkArgs,
    #[command(flatten)]
    reveal: RevealArgs,
    /// Throughput mechanisms to switch off, comma-separated (`deadletter::reconcile::Mechanisms`):
    /// only for the bench's A/B of what each buys, so not in `--help`.
    #[arg(long, env = "DLQ_DISABLE", value_delimiter = ',', hide = true)]
    disable: Vec<String>,
}

/// The HTTP park endpoint: on once an address is given.
#[derive(clap::Args)]
struct ParkArgs {
    /// Serve the HTTP park endpoint (CloudEvents or a plain body POSTed to
    /// /v1/namespaces/{ns}/queues/{queue}) on this address.
    #[arg(long, env = "DLQ_PARK_ADDR")]
    park_addr: Option<SocketAddr>,
    /// Directory holding tls.crt and tls.key (a kubernetes.io/tls Secret mounted, as
    /// cert-manager writes it); re-read every minute.
    #[arg(long, env = "DLQ_PARK_TLS_DIR")]
    park_tls_dir: Option<std::path::PathBuf>,
    /// Serve the endpoint without TLS (bearer tokens then travel in clear: only on loopback
    /// or behind a mesh that encrypts).
    #[arg(long, env = "DLQ_PARK_PLAINTEXT", default_value_t = false)]
    park_plaintext: bool,
    /// The endpoint's URL as senders reach it (its Service), e.g.
    /// https://deadletter-operator-park.dlq-system.svc; queues with spec.http show
    /// status.address under it.
    #[arg(long, env = "DLQ_PARK_URL")]
    park_url: Option<String>,
    /// Networks (CIDRs, comma-separated or repeated) inside the cluster, usually its pod
    /// network: queues with spec.http.allowAnonymous take callers without a token only from
    /// these. None: no anonymous parking at all.
    #[arg(long, env = "DLQ_PARK_ANONYMOUS_FROM", value_delimiter = ',')]
    park_anonymous_from: Vec<ipnet::IpNet>,
    /// A selector-less Service in the operator's namespace (POD_NAMESPACE) that the leader
    /// points at itself with an EndpointSlice of the same name, so that senders never reach a
    /// standby. Needs --pod-ip.
    #[arg(long, env = "DLQ_PARK_SERVICE", requires = "pod_ip")]
    park_service: Option<String>,
    /// This replica's address in the park Service's EndpointSlice (the pod's IP).
    #[arg(long, env = "POD_IP")]
    pod_ip: Option<std::net::IpAddr>,
}

/// The reveal API (`deadletterpayloads.payloads.dlq.dev`, behind an APIService): on once an
/// address is given.
#[derive(clap::Args)]
struct RevealArgs {
    /// Serve the reveal API on this address (every replica serves it).
    #[arg(long, env = "DLQ_REVEAL_ADDR", requires = "reveal_tls_dir")]
    reveal_addr: Option<SocketAddr>,
    /// Directory holding its tls.crt and tls.key (the APIService's caBundle trusts their
    /// issuer); re-read every minute.
    #[arg(long, env = "DLQ_REVEAL_TLS_DIR")]
    reveal_tls_dir: Option<std::path::PathBuf>,
}

/// Per-record alerts: on once an Alertmanager URL is given.
#[derive(clap::Args)]
struct AlertArgs {
    /// Alertmanager base URL (repeat or comma-separate for an HA pair); every Parked record
    /// raises an alert there.
    #[arg(
        long = "alertmanager-url",
        env = "DLQ_ALERTMANAGER_URL",
        value_delimiter = ','
    )]
    alertmanager_urls: Vec<String>,
    /// PEM CA certificates to trust for https Alertmanager URLs (default: the web roots).
    #[arg(long, env = "DLQ_ALERTMANAGER_CA_FILE")]
    alertmanager_ca_file: Option<std::path::PathBuf>,
    /// File holding a bearer token sent to Alertmanager (mounted from a Secret).
    #[arg(long, env = "DLQ_ALERTMANAGER_TOKEN_FILE")]
    alertmanager_token_file: Option<std::path::PathBuf>,
    /// An alert's endsAt is this far ahead while its record is Parked (resent every quarter);
    /// if every replica dies, alerts lapse after it.
    #[arg(long, env = "DLQ_ALERT_LEASE", default_value = "4m")]
    alert_lease: String,
    /// A Warning Event on the affected queues once alerts cannot be delivered for this long.
    #[arg(long, default_value = "5m")]
    alertmanager_undeliverable_after: String,
    /// Each alert's runbook_url is this + `#alert-<alertname in lower case>`.
    #[arg(
        long,
        env = "DLQ_ALERT_RUNBOOK_BASE_URL",
        default_value = "https://github.com/deadletter-operator/deadletter-operator/blob/main/docs/runbooks.md"
    )]
    alert_runbook_base_url: String,
}

/// The alerting configuration, None without an Alertmanager URL.
fn alerting(args: &AlertArgs) -> anyhow::Result<Option<Arc<Alerting>>> {
    let urls: Vec<&str> = args
        .alertmanager_urls
        .iter()
        .map(|u| u.trim())
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() {
        return Ok(None);
    }
    let read = |p: &Option<std::path::PathBuf>, what: &str| {
        p.as_ref()
            .map(|p| {
                std::fs::read_to_string(p)
                    .with_context(|| format!("reading {what} {}", p.display()))
            })
            .transpose()
    };
    let ca = read(&args.alertmanager_ca_file, "--alertmanager-ca-file")?;
    let token = read(&args.alertmanager_token_file, "--alertmanager-token-file")?;
    let duration = |text: &str, flag: &str| {
        dlq_core::duration::parse_duration(text)
            .filter(|d| !d.is_zero())
            .with_context(|| format!("{flag} {text:?} is not a duration such as 4m"))
    };
    let alertmanagers = urls
        .iter()
        .map(|u| Alertmanager::new(u, token.as_deref(), ca.as_deref()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Arc::new(Alerting {
        alertmanagers,
        lease: duration(&args.alert_lease, "--alert-lease")?,
        undeliverable_after: duration(
            &args.alertmanager_undeliverable_after,
            "--alertmanager-undeliverable-after",
        )?,
        links: dlq_core::alert::Links {
            runbook_base_url: args.alert_runbook_base_url.clone(),
        },
    })))
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

#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once at start: freed pages go back to the kernel at once instead
/// of after 10 s. Every watch event and status-write reply decodes a whole record (payloads up
/// to 256 KiB) that `strip` drops right away; with the default decay those freed pages stayed
/// in RSS (10,000 x 64 KiB parked: 87.2 MiB peak, 82.7 steady; with this, 75.8 and 75.3).
/// `_RJEM_MALLOC_CONF` in the environment still overrides it.
#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 34] = b"dirty_decay_ms:0,muzzy_decay_ms:0\0";

type Shutdown = Shared<BoxFuture<'static, ()>>;

/// Resolves on SIGTERM or Ctrl-C.
fn termination() -> Shutdown {
    async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutting down");
    }
    .boxed()
    .shared()
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    init_tracing(args.log_format);
    deadletter::https::install_crypto_provider();
    let mut settings = settings(&args)?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes (KUBECONFIG or in-cluster config)")?;
    let identity = args
        .pod_name
        .clone()
        .unwrap_or_else(|| format!("deadletter-operator-{}", std::process::id()));
    let alerts = alerting(&args.alerts)?;
    let metrics = Metrics::default();
    let ready = Arc::new(AtomicBool::new(false));
    let shutdown = termination();
    let server = tokio::spawn(server::serve(
        args.metrics_addr,
        Probes {
            metrics: metrics.clone(),
            ready: ready.clone(),
        },
        shutdown.clone(),
    ));
    let park_endpoint = park_endpoint(&args.park, &client, &metrics, &shutdown).await?;
    let reporter = Reporter {
        controller: "deadletter-operator".into(),
        instance: Some(identity.clone()),
    };
    reveal_api(&args.reveal, &client, &reporter, &shutdown).await?;
    let Some(Lead { lost, lease }) = lead(&args, &client, &identity, &ready, &shutdown).await?
    else {
        return Ok(());
    };
    if let Some(service) = leader_service(&args, &identity) {
        let client = client.clone();
        tokio::spawn(async move { service.point_here(client).await });
    }
    let leadership = follow_lease(&args, &client, &identity);
    let (stall_alarm, stalled) = run::decided::StallAlarm::new();
    let stalled = stalled_leader(stalled, ready.clone());
    let stop = either(shutdown.clone(), either(lost.clone(), stalled.clone()));
    let scopes = scopes(&args.watch_namespaces);
    ready.store(true, Ordering::Relaxed);
    tracing::info!(namespaces = ?scopes, "controllers starting");
    settings.leadership = leadership;
    let process = Process {
        client: client.clone(),
        metrics: metrics.clone(),
        reporter,
        settings,
        alerts,
        park_endpoint,
        vigil: run::decided::Vigil {
            resync: Duration::from_secs(args.decided_resync_seconds.max(1)),
            stall_after: Duration::from_secs(args.stall_after_seconds.max(1)),
        },
        stall_alarm: Some(stall_alarm),
    };
    futures::future::join_all(
        scopes
            .into_iter()
            .map(|ns| run::run_scope(process.clone(), ns, stop.clone())),
    )
    .await;
    if lost.clone().now_or_never().is_some() {
        anyhow::bail!("lost leadership");
    }
    if stalled.clone().now_or_never().is_some() {
        // Handed over at once: the standby need not wait for the Lease to expire.
        lease.release().await;
        anyhow::bail!("gave up leadership: no progress on decided records");
    }
    // The controllers have stopped: hand the Lease over now rather than make the standby
    // wait for it to expire.
    lease.release().await;
    let _ = server.await;
    Ok(())
}

/// The park Service to point at this replica once it leads, when `--park-service` is given.
fn leader_service(args: &RunArgs, identity: &str) -> Option<LeaderService> {
    let park = &args.park;
    Some(LeaderService {
        namespace: args.lease_namespace.clone(),
        service: park.park_service.clone()?,
        pod: identity.to_string(),
        ip: park.pod_ip?,
        port: park.park_addr?.port(),
    })
}

/// Starts the HTTP park endpoint when `--park-addr` is given: from the start, so a standby
/// answers 503 (its scopes register once it leads).
async fn park_endpoint(
    args: &ParkArgs,
    client: &kube::Client,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> anyhow::Result<Option<ParkEndpoint>> {
    let Some(addr) = args.park_addr else {
        return Ok(None);
    };
    let tls = match (&args.park_tls_dir, args.park_plaintext) {
        (Some(dir), false) => {
            Some(deadletter::serving_tls::server_config(dir).context("--park-tls-dir")?)
        }
        (None, true) => None,
        (Some(_), true) => anyhow::bail!("--park-tls-dir and --park-plaintext exclude each other"),
        (None, false) => anyhow::bail!(
            "--park-addr needs --park-tls-dir (tls.crt, tls.key), or --park-plaintext"
        ),
    };
    let endpoint = ParkEndpoint::new(
        client.clone(),
        metrics.clone(),
        args.park_anonymous_from.clone(),
    );
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the park endpoint to {addr}"))?;
    tracing::info!(%addr, tls = tls.is_some(), url = args.park_url.as_deref().unwrap_or(""), "serving the HTTP park endpoint");
    let served = endpoint.clone();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        if let Err(e) = deadletter::source::http::serve(served, listener, tls, shutdown).await {
            tracing::error!(error = %e, "the HTTP park endpoint stopped");
        }
    });
    Ok(Some(endpoint))
}

/// Starts the reveal API when `--reveal-addr` is given: on every replica, leading or not.
async fn reveal_api(
    args: &RevealArgs,
    client: &kube::Client,
    reporter: &Reporter,
    shutdown: &Shutdown,
) -> anyhow::Result<()> {
    let (Some(addr), Some(dir)) = (args.reveal_addr, args.reveal_tls_dir.clone()) else {
        return Ok(());
    };
    deadletter::serving_tls::check(&dir).context("--reveal-tls-dir")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the reveal API to {addr}"))?;
    tracing::info!(%addr, "serving the reveal API (deadletterpayloads.payloads.dlq.dev)");
    let (client, reporter, shutdown) = (client.clone(), reporter.clone(), shutdown.clone());
    tokio::spawn(async move {
        if let Err(e) = deadletter::reveal::serve(client, reporter, listener, &dir, shutdown).await
        {
            tracing::error!(error = %e, "the reveal API stopped");
        }
    });
    Ok(())
}

/// A leader's term: `lost` resolves when the Lease is lost (losing it ends the process, and the
/// Deployment restarts it as a standby, which is simpler than tearing down); `lease` gives it
/// up on a clean shutdown.
struct Lead {
    lost: Shutdown,
    lease: LeaseHandle,
}

/// Gives the Lease up once the controllers have stopped (a rolling update hands over at once
/// instead of after the Lease's 15 s).
struct LeaseHandle {
    release: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

/// How long a clean shutdown waits for the Lease to be released.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

impl LeaseHandle {
    fn none() -> Self {
        LeaseHandle {
            release: None,
            done: None,
        }
    }

    async fn release(mut self) {
        if let Some(tx) = self.release.take() {
            let _ = tx.send(());
        }
        if let Some(done) = self.done.take()
            && tokio::time::timeout(RELEASE_TIMEOUT, done).await.is_err()
        {
            tracing::warn!("releasing the Lease took too long; the standby waits for it to expire");
        }
    }
}

/// Leadership: controllers run only while this replica holds the Lease. Waits until it does.
/// None when `shutdown` came first. Without leader election, leadership is never lost.
async fn lead(
    args: &RunArgs,
    client: &kube::Client,
    identity: &str,
    ready: &AtomicBool,
    shutdown: &Shutdown,
) -> anyhow::Result<Option<Lead>> {
    if !args.leader_election {
        return Ok(Some(Lead {
            lost: std::future::pending::<()>().boxed().shared(),
            lease: LeaseHandle::none(),
        }));
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &args.lease_namespace);
    let (mut leader, task) = loop {
        let manager =
            kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &args.lease_name)
                .with_namespace(&args.lease_namespace)
                .with_identity(identity)
                .with_duration(15)
                .with_grace(5)
                .build()
                .await
                .context("setting up leader election")?;
        let (mut leader, task) = manager.watch().await;
        ready.store(true, Ordering::Relaxed);
        tracing::info!(lease = %args.lease_name, identity = %identity, "waiting for leadership");
        // The lease manager sleeps until the holder's term ends; a holder that gave the
        // Lease up (a clean shutdown) is noticed by polling, and a fresh manager takes it.
        let released = tokio::select! {
            r = leader.wait_for(|held| *held) => { r.context("leader election stopped")?; false }
            () = lease_released(&leases, &args.lease_name) => true,
            _ = shutdown.clone() => return Ok(None),
        };
        if !released {
            break (leader, task);
        }
        drop(leader);
        let _ = task.await;
    };
    tracing::info!(identity = %identity, "became leader");
    let (lost_tx, lost_rx) = tokio::sync::watch::channel(false);
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        tokio::select! {
            _ = leader.wait_for(|held| !*held) => {
                tracing::error!("lost leadership; exiting so a standby takes over");
                let _ = lost_tx.send(true);
                return;
            }
            _ = released => {}
        }
        // The lease manager releases the Lease once its last receiver is gone.
        drop(leader);
        match task.await {
            Ok(Ok(_)) => tracing::info!("released the Lease"),
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the Lease failed"),
            Err(e) => tracing::warn!(error = %e, "the lease manager stopped"),
        }
    });
    let lost = async move {
        let mut lost_rx = lost_rx;
        let _ = lost_rx.wait_for(|lost| *lost).await;
    };
    Ok(Some(Lead {
        lost: lost.boxed().shared(),
        lease: LeaseHandle {
            release: Some(release),
            done: Some(done),
        },
    }))
}

/// Resolves once the Lease, after being held by another replica, has no holder (it was given
/// up). Polls once a second, as the requeue guard does.
async fn lease_released(leases: &Api<Lease>, name: &str) {
    let mut held_by_another = false;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let holder = match leases.get_opt(name).await {
            Ok(lease) => lease
                .and_then(|l| l.spec)
                .and_then(|s| s.holder_identity)
                .filter(|h| !h.is_empty()),
            Err(_) => continue,
        };
        match holder {
            Some(_) => held_by_another = true,
            None if held_by_another => return,
            None => {}
        }
    }
}

/// The requeue guard of a leader: its term as the Lease says, refreshed every second (see
/// `deadletter::state::leadership::Leadership`). Without leader election it never runs out.
fn follow_lease(args: &RunArgs, client: &kube::Client, identity: &str) -> Leadership {
    if !args.leader_election {
        return Leadership::always();
    }
    let leadership = Leadership::not_yet();
    tokio::spawn(leadership.clone().follow(
        client.clone(),
        args.lease_namespace.clone(),
        args.lease_name.clone(),
        identity.to_string(),
        std::time::Duration::from_secs(1),
    ));
    leadership
}

/// Resolves once this leader stalled on decided records (`deadletter::run::decided`), after
/// turning `/readyz` false.
fn stalled_leader(
    mut stalled: tokio::sync::watch::Receiver<Option<String>>,
    ready: Arc<AtomicBool>,
) -> Shutdown {
    async move {
        let why = stalled
            .wait_for(Option::is_some)
            .await
            .map(|why| why.clone().unwrap_or_default());
        let Ok(why) = why else {
            // The alarm is gone with its scopes: nothing will raise it.
            return std::future::pending::<()>().await;
        };
        ready.store(false, Ordering::Relaxed);
        tracing::error!(why = %why, "stepping down: not ready, giving up the Lease");
    }
    .boxed()
    .shared()
}

/// Resolves when either does.
fn either(a: Shutdown, b: Shutdown) -> Shutdown {
    async move {
        tokio::select! {
            _ = a => {}
            _ = b => {}
        }
    }
    .boxed()
    .shared()
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

fn settings(args: &RunArgs) -> anyhow::Result<Settings> {
    let mechanisms = Mechanisms::without(&args.disable).context("--disable")?;
    if mechanisms != Mechanisms::default() {
        tracing::warn!(
            ?mechanisms,
            "throughput mechanisms switched off (--disable)"
        );
    }
    Ok(Settings {
        backoff_cap: Duration::from_secs(args.backoff_cap_seconds.max(1)),
        concurrency: args.concurrency.max(1),
        mechanisms,
        park_url: args
            .park
            .park_addr
            .and(args.park.park_url.clone())
            .filter(|u| !u.trim().is_empty()),
        park_ca_file: args.park.park_tls_dir.as_ref().map(|d| d.join("ca.crt")),
        ..Settings::default()
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => print!("{}", dlq_core::api::crds_yaml()?),
        Command::Run(args) => run(*args).await?,
    }
    Ok(())
}
