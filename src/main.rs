//! `deadletter-operator`: `run` the controller, or print the `crds`. This file parses the
//! command line and hands over: `run` to [`deadletter::run::start`], which wires the process.

use std::net::SocketAddr;

use clap::{Parser, Subcommand, ValueEnum};
use deadletter::run;
use deadletter::run::endpoints::{ParkOptions, RevealOptions};
use deadletter::run::lease::LeaseOptions;
use deadletter::run::start::{AlertOptions, Options};

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
    /// How often each queue's body store is swept of objects no record references, in seconds.
    #[arg(long, env = "DLQ_BODY_SWEEP_SECONDS", default_value_t = 300)]
    body_sweep_seconds: u64,
    /// The SQS source's long poll, in seconds (1-20). 20, SQS's longest, costs least; shorter
    /// only for an emulator that does not end a long poll when its redrive policy moves a
    /// message in (ElasticMQ: the message waits out the poll).
    #[arg(long, env = "DLQ_SQS_LONG_POLL_SECONDS", default_value_t = 20,
          value_parser = clap::value_parser!(u8).range(1..=20))]
    sqs_long_poll_seconds: u8,
    /// How often the records decided and still Parked are listed again, in seconds (a watch
    /// event lost across an apiserver restart costs one period, not the decision).
    #[arg(long, default_value_t = 30)]
    decided_resync_seconds: u64,
    /// A leader that has not attempted a decided record for this long (seconds; at least two
    /// backoff caps plus a resync period) gives up its Lease: /readyz false, a Warning Event
    /// `LeaderStalled` on the queue, a log line, and the process exits for a standby to lead.
    #[arg(long, default_value_t = 180)]
    stall_after_seconds: u64,
    /// The records the operator keeps across every queue it watches, any phase: beyond it the
    /// operator's sources and park endpoint park nothing more (dead messages stay in their
    /// brokers, queues say Full=True MaxRecordsReached) until records are deleted. Kept exact
    /// in a ConfigMap `<lease-name>-records` in the operator's namespace. Unset: no ceiling.
    #[arg(long, env = "DLQ_MAX_RECORDS", value_parser = clap::value_parser!(u64).range(1..))]
    max_records: Option<u64>,
    #[command(flatten)]
    alerts: AlertArgs,
    #[command(flatten)]
    park: ParkArgs,
    #[command(flatten)]
    reveal: RevealArgs,
    /// Throughput mechanisms to switch off, comma-separated (`deadletter::reconcile::Mechanisms`):
    /// only for the bench's A/B of what each buys, so only in a build with feature `bench`,
    /// and not in `--help`.
    #[cfg(feature = "bench")]
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
    /// Connections the endpoint holds open at once, from all clients (each address holds 32 at
    /// most); a connection beyond is answered 503 with Retry-After. Keep it well under the
    /// process's file descriptor limit.
    #[arg(long, env = "DLQ_PARK_MAX_CONNECTIONS", default_value_t = deadletter::source::http::connections::MAX_CONNECTIONS, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u32).range(1..), |n| n as usize))]
    park_max_connections: usize,
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

impl From<LogFormat> for run::start::LogFormat {
    fn from(format: LogFormat) -> Self {
        match format {
            LogFormat::Text => run::start::LogFormat::Text,
            LogFormat::Json => run::start::LogFormat::Json,
        }
    }
}

impl RunArgs {
    /// What `run` hands over to [`run::start::operator`].
    fn into_options(self) -> Options {
        let RunArgs {
            metrics_addr,
            leader_election,
            lease_namespace,
            lease_name,
            watch_namespaces,
            pod_name,
            log_format,
            concurrency,
            backoff_cap_seconds,
            body_sweep_seconds,
            sqs_long_poll_seconds,
            decided_resync_seconds,
            stall_after_seconds,
            max_records,
            alerts,
            park,
            reveal,
            #[cfg(feature = "bench")]
            disable,
        } = self;
        #[cfg(not(feature = "bench"))]
        let disable = Vec::new();
        Options {
            metrics_addr,
            lease: LeaseOptions {
                leader_election,
                namespace: lease_namespace,
                name: lease_name,
            },
            watch_namespaces,
            pod_name,
            log_format: log_format.into(),
            concurrency,
            backoff_cap_seconds,
            body_sweep_seconds,
            sqs_long_poll_seconds,
            decided_resync_seconds,
            stall_after_seconds,
            max_records,
            alerts: AlertOptions {
                alertmanager_urls: alerts.alertmanager_urls,
                alertmanager_ca_file: alerts.alertmanager_ca_file,
                alertmanager_token_file: alerts.alertmanager_token_file,
                alert_lease: alerts.alert_lease,
                alertmanager_undeliverable_after: alerts.alertmanager_undeliverable_after,
                alert_runbook_base_url: alerts.alert_runbook_base_url,
            },
            park: ParkOptions {
                park_addr: park.park_addr,
                park_tls_dir: park.park_tls_dir,
                park_plaintext: park.park_plaintext,
                park_url: park.park_url,
                park_anonymous_from: park.park_anonymous_from,
                park_service: park.park_service,
                pod_ip: park.pod_ip,
                park_max_connections: park.park_max_connections,
            },
            reveal: RevealOptions {
                reveal_addr: reveal.reveal_addr,
                reveal_tls_dir: reveal.reveal_tls_dir,
            },
            disable,
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => print!("{}", dlq_core::api::crds_yaml()?),
        Command::Run(args) => run::start::operator(args.into_options()).await?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(["deadletter-operator", "run"].iter().chain(args))
    }

    #[cfg(not(feature = "bench"))]
    #[test]
    fn a_production_build_has_no_disable_flag_and_ignores_dlq_disable() {
        let refused = parse(&["--disable=mark_quota"]).err().map(|e| e.kind());
        assert_eq!(refused, Some(clap::error::ErrorKind::UnknownArgument));
        // No flag reads DLQ_DISABLE either.
        let command = <Cli as clap::CommandFactory>::command();
        let run = command.find_subcommand("run");
        let envs: Vec<String> = run
            .into_iter()
            .flat_map(|run| run.get_arguments())
            .filter_map(|arg| arg.get_env())
            .map(|env| env.to_string_lossy().into_owned())
            .collect();
        assert!(envs.iter().any(|e| e == "DLQ_PARK_ADDR"), "{envs:?}");
        assert!(!envs.iter().any(|e| e == "DLQ_DISABLE"), "{envs:?}");
    }

    #[cfg(feature = "bench")]
    #[test]
    fn a_bench_build_takes_the_disable_flag() {
        let Ok(Cli {
            command: Command::Run(args),
        }) = parse(&["--disable=mark_quota,aggregation"])
        else {
            panic!("--disable parses in a bench build");
        };
        assert_eq!(args.into_options().disable, ["mark_quota", "aggregation"]);
    }

    #[test]
    fn run_hands_its_flags_over_unchanged() {
        let Ok(Cli {
            command: Command::Run(args),
        }) = parse(&[
            "--leader-election=false",
            "--lease-namespace=ops",
            "--stall-after-seconds=7",
            "--decided-resync-seconds=3",
            "--park-addr=127.0.0.1:9000",
            "--park-plaintext",
        ])
        else {
            panic!("the flags parse");
        };
        let options = args.into_options();
        assert!(!options.lease.leader_election);
        assert_eq!(options.lease.namespace, "ops");
        assert_eq!(options.stall_after_seconds, 7);
        assert_eq!(options.decided_resync_seconds, 3);
        assert_eq!(options.park.park_addr, "127.0.0.1:9000".parse().ok());
        assert!(options.park.park_plaintext);
    }
}
