//! Starts a local etcd + kube-apiserver and keeps it up until SIGINT/SIGTERM, or until stdin
//! closes when `--until-stdin-closes` is given (how tests tie its life to theirs).

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use dlq_testenv::plane::ControlPlane;

#[derive(Parser)]
#[command(about = "A throwaway local Kubernetes control plane (etcd + kube-apiserver)")]
struct Args {
    /// Also copy the admin kubeconfig here.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Write this process's pid here (for `make cluster-down`).
    #[arg(long)]
    pid_file: Option<PathBuf>,
    /// Stop when standard input reaches EOF (the parent died or closed it).
    #[arg(long)]
    until_stdin_closes: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut plane = ControlPlane::start().context("starting the local control plane")?;
    let kubeconfig = match &args.kubeconfig_out {
        Some(path) => {
            plane.export_kubeconfig(path)?;
            path.clone()
        }
        None => plane.kubeconfig.clone(),
    };
    if let Some(pid_file) = &args.pid_file {
        std::fs::write(pid_file, std::process::id().to_string())
            .with_context(|| format!("writing {}", pid_file.display()))?;
    }
    println!("server={}", plane.server);
    println!("dir={}", plane.dir().display());
    println!("KUBECONFIG={}", kubeconfig.display());
    println!("ready");

    let stdin_closed = async {
        if args.until_stdin_closes {
            let _ = tokio::task::spawn_blocking(|| {
                let mut sink = [0u8; 256];
                let mut stdin = std::io::stdin();
                while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            })
            .await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = stdin_closed => {}
    }
    plane.stop();
    if let Some(pid_file) = &args.pid_file {
        let _ = std::fs::remove_file(pid_file);
    }
    if let Some(path) = &args.kubeconfig_out {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
