//! Starts a local etcd + kube-apiserver (with `--node`: plus a real node, see
//! `dlq_testenv::node`) and keeps it up until SIGINT/SIGTERM, or until stdin closes when
//! `--until-stdin-closes` is given (how tests tie its life to theirs).

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use dlq_testenv::node::{Network, Node};
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
    /// Also start a real node: kubelet, containerd, kube-proxy, CNI (needs root).
    #[arg(long)]
    node: bool,
    /// Write the apiserver's audit log (request and response bodies, Secrets' left out).
    #[arg(long, conflicts_with = "node")]
    audit: bool,
    /// Also run kube-controller-manager's `resourcequota` controller, so that ResourceQuotas
    /// are counted as in a real cluster.
    #[arg(long, conflicts_with_all = ["node", "audit"])]
    quota_controller: bool,
    /// Serve the apiserver on this local address instead of 127.0.0.1 (one that processes in
    /// other network namespaces reach over a bridge: tests/knative).
    #[arg(long, conflicts_with_all = ["node", "audit"])]
    address: Option<std::net::IpAddr>,
}

/// The plane, and the node when asked for; the node goes first on stop (it lives in the
/// plane's dir).
fn start(
    with_node: bool,
    audit: bool,
    quota_controller: bool,
    address: Option<std::net::IpAddr>,
) -> anyhow::Result<(ControlPlane, Option<Node>)> {
    if quota_controller {
        // The controller is started in `main`, once the CRDs are in.
        let plane = ControlPlane::start().context("starting the local control plane")?;
        return Ok((plane, None));
    }
    if audit {
        let plane = ControlPlane::start_audited().context("starting the local control plane")?;
        return Ok((plane, None));
    }
    if !with_node {
        let plane = match address {
            Some(address) => ControlPlane::start_at(address),
            None => ControlPlane::start(),
        }
        .context("starting the local control plane")?;
        return Ok((plane, None));
    }
    let network = Network::create().context("creating the node's bridge")?;
    let plane =
        ControlPlane::start_at(network.address()).context("starting the local control plane")?;
    let node = Node::start(&plane, network).context("starting the node")?;
    Ok((plane, Some(node)))
}

async fn until_stopped(until_stdin_closes: bool) -> anyhow::Result<()> {
    // A plain thread, not spawn_blocking: the runtime would wait for a blocked read at exit.
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    if until_stdin_closes {
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            let _ = closed_tx.send(());
        });
    }
    let stdin_closed = async {
        if closed_rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = stdin_closed => {}
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (mut plane, mut node) = start(args.node, args.audit, args.quota_controller, args.address)?;
    if args.quota_controller {
        // The dlq.dev CRDs first: the quota controller then counts records from its start,
        // instead of finding their CRD at its next discovery, about 30 s on.
        let client = dlq_testenv::admin_client(&plane.kubeconfig).await;
        dlq_testenv::apply_crds(&client, dlq_testenv::CRDS).await;
        plane
            .start_quota_controller()
            .context("starting kube-controller-manager's resourcequota controller")?;
    }
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
    println!("etcd={}", plane.etcd_url());
    if let Some(audit) = plane.audit_log() {
        println!("audit={}", audit.display());
    }
    if let Some(node) = &node {
        println!("containerd={}", node.socket().display());
        println!("node_ready_secs={:.1}", node.timings.ready.as_secs_f64());
    }
    println!("KUBECONFIG={}", kubeconfig.display());
    println!("ready");

    until_stopped(args.until_stdin_closes).await?;
    if let Some(node) = &mut node {
        node.stop();
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
