//! `kubectl dlq` (a kubectl plugin: put `kubectl-dlq` on PATH): inspect parked jobs, decide
//! with your own identity, park from scripts.
//!
//! [`cli`] holds the flags and the dispatch; [`session`] the connection and the errors every
//! command shares (so commands never import the dispatch); each command group is a sibling
//! module. The CLI's modules are named apart from the core's (`decision`, not `decide`;
//! `park_cmd`, not `park`) so `dlq_core::decide` and `dlq_core::park` stay unambiguous.

mod approve;
mod cli;
mod decision;
mod export;
mod groups_cmd;
mod inspect;
mod lookup;
mod ls_search;
mod paged;
mod park_cmd;
mod park_endpoint;
mod park_from;
mod pause;
mod reveal;
mod runbook;
mod seal_key;
mod search;
mod session;
mod ui;

use std::process::ExitCode;

use clap::Parser;

use cli::Cli;
use session::CliError;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Refused(msg)) => {
            // Already printed per job; the exit code says something was refused.
            if !msg.is_empty() {
                eprintln!("{msg}");
            }
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
