//! The command line: its flags and the dispatch to each command.

use clap::{Parser, Subcommand};

use crate::session::{CliError, Global};
use crate::{
    approve, export, groups_cmd, inspect, ls_search, park_cmd, park_from, pause, runbook, seal_key,
    ui,
};

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

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List records: job, deliveries, phase, intent snapshot, who decided, reason; or search
    /// them (--grep TEXT, --where PATH=VALUE).
    Ls(inspect::LsArgs),
    /// One record in full: facts, payload, decision, conditions, recent Events.
    Show(inspect::ShowArgs),
    /// Per queue and failure kind: parked, redriven, dropped, oldest parked.
    Stats(inspect::StatsArgs),
    /// Redrive jobs (put the untouched job back on its queue), or replay a selection with
    /// --queue or --group (the runbook: dry run, rate limit, stop conditions).
    Redrive(runbook::RedriveArgs),
    /// Drop jobs (resolve without enqueueing), or a selection with --queue or --group (a
    /// replay that drops).
    Drop(runbook::DropArgs),
    /// Pause a running replay (spec.paused): it decides and passes nothing more until resumed;
    /// nothing it decided is withdrawn (unlike a stop).
    Pause(pause::PauseArgs),
    /// Resume a paused replay where it was.
    Resume(pause::PauseArgs),
    /// Approve a replay in your own name (dual control: its queue's spec.approvals), with an
    /// optional --note; the author cannot, nor anyone twice.
    Approve(approve::ApproveArgs),
    /// Failure groups (DeadLetterGroups), most parked first: group, queue, kind, version,
    /// parked, rate, tier, the last 24 hours, trend, template; `groups NAME`: one group's 7
    /// days. Act on one with redrive/drop --group G.
    Groups(groups_cmd::GroupsArgs),
    /// Park a job (for scripts and producers), or the records of an export again (--from).
    Park(park_cmd::ParkArgs),
    /// Every fact of the selected records to stdout, NDJSON or CSV, a page at a time: the job
    /// as bytes (payload and headers base64, a sealed job as its ciphertext), card numbers
    /// masked in every text.
    Export(export::ExportArgs),
    /// A local web page (127.0.0.1, token in the printed URL) acting as you: queues, records,
    /// payloads, Events, decisions on explicit selections.
    Ui(ui::UiArgs),
    /// Create a fresh age identity in a Secret and put it first in the queue's sealing keys
    /// (new records are sealed to it; older keys stay to open older records).
    SealKey(seal_key::SealKeyArgs),
    /// Print kubectl-dlq's version (what `--version` prints), e.g. after `kubectl krew install`.
    Version,
}

/// Runs one command; the binary prints the error and picks the exit code.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Ls(args) if args.searches() => ls_search::run(&cli.global, args).await,
        Command::Ls(args) => inspect::ls(&cli.global, args).await,
        Command::Show(args) => inspect::show(&cli.global, args).await,
        Command::Stats(args) => inspect::stats(&cli.global, args).await,
        Command::Redrive(args) => runbook::redrive(&cli.global, args).await,
        Command::Drop(args) => runbook::drop_jobs(&cli.global, args).await,
        Command::Pause(args) => pause::run(&cli.global, args, true).await,
        Command::Resume(args) => pause::run(&cli.global, args, false).await,
        Command::Approve(args) => approve::run(&cli.global, args).await,
        Command::Groups(args) => groups_cmd::run(&cli.global, args).await,
        Command::Park(args) => match &args.from {
            Some(from) => park_from::run(&cli.global, from, args.queue.as_deref()).await,
            None => park_cmd::run(&cli.global, args).await,
        },
        Command::Export(args) => export::run(&cli.global, args).await,
        Command::Ui(args) => ui::run(&cli.global, args).await,
        Command::SealKey(args) => seal_key::run(&cli.global, args).await,
        Command::Version => {
            println!("kubectl dlq {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
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
