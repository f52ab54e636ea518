//! `kubectl dlq`: inspect parked jobs, decide with your own identity, park from scripts.

pub mod decide;
pub mod inspect;
pub mod park;
pub mod runbook;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Errors shown to the person at the terminal, worded for them.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Refused(String),
    #[error("kubeconfig: {0}")]
    Config(String),
    #[error("{0}")]
    Api(String),
    #[error(transparent)]
    Park(#[from] crate::park::ParkError),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

impl From<kube::Error> for CliError {
    fn from(e: kube::Error) -> Self {
        match e {
            // The apiserver's own words (CEL messages, RBAC refusals) are the most useful.
            kube::Error::Api(s) => CliError::Api(s.message),
            other => CliError::Api(other.to_string()),
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "kubectl dlq",
    bin_name = "kubectl dlq",
    version,
    about = "Inspect, redrive and drop parked jobs (DeadLetter records)",
    long_about = "Inspect, redrive and drop parked jobs (DeadLetter records).\n\nJOB is a job id (pi_0003/settle) or a record name (pi-0003-settle-5d41402a-1)."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// kubectl's usual connection flags.
#[derive(Args, Debug, Clone)]
pub struct Global {
    /// Namespace (default: the kubeconfig context's, else "default").
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Every namespace (ls, stats).
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// Kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Path to the kubeconfig (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// Impersonate this user (as kubectl --as).
    #[arg(long = "as", global = true, value_name = "USER")]
    pub as_user: Option<String>,
    /// Impersonate this group (repeatable; as kubectl --as-group).
    #[arg(long = "as-group", global = true, value_name = "GROUP")]
    pub as_groups: Vec<String>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List records: job, deliveries, phase, intent snapshot, who decided, reason.
    Ls(inspect::LsArgs),
    /// One record in full: facts, payload, decision, conditions, recent Events.
    Show(inspect::ShowArgs),
    /// Per queue and failure kind: parked, redriven, dropped, oldest parked.
    Stats(inspect::StatsArgs),
    /// Redrive jobs (put the untouched job back on its queue), or replay a selection with
    /// --queue (the runbook: dry run, rate limit, stop conditions).
    Redrive(runbook::RedriveArgs),
    /// Drop jobs (resolve without enqueueing).
    Drop(decide::DropArgs),
    /// Park a job (for scripts and producers).
    Park(park::ParkArgs),
}

/// A client and namespace from kubectl-style flags.
pub async fn connect(g: &Global) -> Result<(Client, String), CliError> {
    let options = KubeConfigOptions {
        context: g.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &g.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|e| CliError::Config(e.to_string()))?;
            Config::from_custom_kubeconfig(kc, &options).await
        }
        None => Config::from_kubeconfig(&options).await,
    };
    let config = match config {
        Ok(c) => c,
        Err(e) if g.kubeconfig.is_none() && g.context.is_none() => {
            Config::incluster().map_err(|_| CliError::Config(e.to_string()))?
        }
        Err(e) => return Err(CliError::Config(e.to_string())),
    };
    let mut config = config;
    if let Some(user) = &g.as_user {
        config.auth_info.impersonate = Some(user.clone());
        if !g.as_groups.is_empty() {
            config.auth_info.impersonate_groups = Some(g.as_groups.clone());
        }
    }
    let namespace = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| CliError::Config(e.to_string()))?;
    Ok((client, namespace))
}

/// Runs one command; the binary prints the error and picks the exit code.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Ls(args) => inspect::ls(&cli.global, args).await,
        Command::Show(args) => inspect::show(&cli.global, args).await,
        Command::Stats(args) => inspect::stats(&cli.global, args).await,
        Command::Redrive(args) => runbook::redrive(&cli.global, args).await,
        Command::Drop(args) => decide::drop(&cli.global, args).await,
        Command::Park(args) => park::run(&cli.global, args).await,
    }
}

/// Looks up records by job id or record name.
pub mod lookup {
    use kube::api::ListParams;
    use kube::{Api, Client};

    use super::CliError;
    use crate::api::{DeadLetter, DeadLetterQueue, LABEL_JOB_KEY, Phase};
    use crate::park::job_key;

    /// Every cycle of JOB (a record name or a job id) in `ns`, oldest cycle first.
    pub async fn cycles(client: &Client, ns: &str, job: &str) -> Result<Vec<DeadLetter>, CliError> {
        let records: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
        // Only a valid object name can be a record name (a job id may hold '/').
        let is_name = !job.is_empty()
            && job.len() <= 253
            && job
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if is_name && let Some(r) = records.get_opt(job).await? {
            return Ok(vec![r]);
        }
        // A job id: its records carry job-key = hash(queue/jobId), so ask once per queue.
        let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
        let mut found = Vec::new();
        for q in queues.list(&ListParams::default()).await?.items {
            let queue = q.metadata.name.unwrap_or_default();
            let lp =
                ListParams::default().labels(&format!("{LABEL_JOB_KEY}={}", job_key(&queue, job)));
            found.extend(
                records
                    .list(&lp)
                    .await?
                    .items
                    .into_iter()
                    .filter(|r| r.spec.job.id == job),
            );
        }
        found.sort_by_key(|r| r.spec.cycle);
        Ok(found)
    }

    /// The record to act on: the Parked cycle, else the latest one (to explain the refusal).
    pub fn actionable(cycles: &[DeadLetter]) -> Option<&DeadLetter> {
        cycles
            .iter()
            .find(|r| r.phase() == Phase::Parked)
            .or_else(|| cycles.last())
    }
}
