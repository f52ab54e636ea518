//! `make image-local`: the operator image as an OCI archive, built without a Docker daemon from
//! binaries already built (the Dockerfile's final stage over a distroless-like base made of this
//! machine's Debian files; see `dlq_testenv::image`), optionally imported into a test node's
//! containerd. Prints the image reference as its last line.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use dlq_testenv::image;

#[derive(Parser)]
#[command(about = "Build the operator image without a Docker daemon")]
struct Args {
    /// Directory holding deadletter-operator and kubectl-dlq (e.g. target/release).
    #[arg(long)]
    bin_dir: PathBuf,
    /// Where to write the OCI image archive.
    #[arg(long, default_value = "target/image/deadletter-operator.tar")]
    out: PathBuf,
    /// A containerd socket to import the image into (namespace k8s.io, what kubelet uses).
    #[arg(long)]
    load_into: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let binaries = [
        args.bin_dir.join("deadletter-operator"),
        args.bin_dir.join("kubectl-dlq"),
    ];
    let refs: Vec<&std::path::Path> = binaries.iter().map(PathBuf::as_path).collect();
    let work = args.out.with_extension("build");
    let archive =
        image::operator_image(&refs, &work, &args.out).context("building the operator image")?;
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("image archive: {}", archive.path.display());
    if let Some(socket) = &args.load_into {
        let ctr = dlq_testenv::brokers::which("ctr")
            .context("ctr not found: run scripts/ensure-deps.sh (apt-get install containerd)")?;
        image::import(&ctr, socket, &archive).context("importing into the node's containerd")?;
        eprintln!("imported into {}", socket.display());
    }
    println!("{}", archive.reference);
    Ok(())
}
