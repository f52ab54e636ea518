//! The session a command runs in: kubectl's connection flags, the client they describe, and
//! the errors worded for the person at the terminal. Every command uses it; only the dispatch
//! in `cli` knows the commands.

use std::path::PathBuf;

use clap::Args;
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
