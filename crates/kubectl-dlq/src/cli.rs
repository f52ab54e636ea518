//! The command line: flags, the connection they describe, and the dispatch to each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::{decision, inspect, park_cmd, runbook, ui};

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
    Park(#[from] dlq_client::park::ParkError),
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
    Drop(decision::DropArgs),
    /// Park a job (for scripts and producers).
    Park(park_cmd::ParkArgs),
    /// A local web page (127.0.0.1, token in the printed URL) acting as you: queues, records,
    /// payloads, Events, decisions on explicit selections.
    Ui(ui::UiArgs),
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
        Command::Drop(args) => decision::drop_jobs(&cli.global, args).await,
        Command::Park(args) => park_cmd::run(&cli.global, args).await,
        Command::Ui(args) => ui::run(&cli.global, args).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Clap checks conflicting flags and bad `requires` only when a command is built; this
    /// builds every subcommand so a mistake fails here, not at someone's terminal.
    #[test]
    fn flags_are_consistent() {
        Cli::command().debug_assert();
    }
}
