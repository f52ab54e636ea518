//! `kubectl dlq` (a kubectl plugin: put `kubectl-dlq` on PATH).

use clap::Parser;
use deadletter::cli::{self, Cli};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(cli::CliError::Refused(msg)) => {
            // Already printed per job; the exit code says something was refused.
            if !msg.is_empty() {
                eprintln!("{msg}");
            }
            std::process::ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
