//! `deadletter-operator`: `run` the controller, or print the `crds`.

use clap::{Parser, Subcommand};

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
    /// Print the CustomResourceDefinitions (YAML).
    Crds,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => print!("{}", deadletter::api::crds_yaml()?),
    }
    Ok(())
}
