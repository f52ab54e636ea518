//! `make demo`: the reference scenario of SPEC.md, end to end, on a machine with nothing
//! started. It starts a local control plane, redis-server, the operator and the sample worker,
//! parks three payment jobs, lets the payer of pi_0003 sign, redrives each job as `ops`, presses
//! redrive on pi_0003 a second time, and shuts everything down. Every pause waits for a status
//! or an output line, never for a fixed time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};
use deadletter::api::{DeadLetter, Phase};
use deadletter::testenv::{self, ControlPlane};
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, Config};

const NS: &str = "payments";

struct Jobs {
    id: &'static str,
    intent: &'static str,
    state: &'static str,
    deliveries: &'static str,
    kind: &'static str,
    reason: &'static str,
}

const JOBS: [Jobs; 3] = [
    Jobs {
        id: "pi_0001/settle",
        intent: "pi_0001",
        state: "failed",
        deliveries: "1",
        kind: "Invalid",
        reason: "retrying will not help; nothing was sent, so the intent failed",
    },
    Jobs {
        id: "pi_0002/settle",
        intent: "pi_0002",
        state: "needs_review",
        deliveries: "3",
        kind: "Transient",
        reason: "no luck after 3 deliveries; last broadcast unknown, needs review",
    },
    Jobs {
        id: "pi_0003/settle",
        intent: "pi_0003",
        state: "created",
        deliveries: "3",
        kind: "Transient",
        reason: "no luck after 3 deliveries; job dropped, intent still created",
    },
];

/// Kills its child on drop, so an error anywhere still leaves nothing running.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        testenv::terminate(&mut self.0, Duration::from_secs(5));
    }
}

fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let debug = exe
        .parent()
        .and_then(Path::parent)
        .context("cannot locate target dir")?;
    let path = if name == "worker" {
        debug.join("examples").join(name)
    } else {
        debug.join(name)
    };
    if !path.is_file() {
        bail!(
            "{} is not built: run `cargo build --bins --examples`",
            path.display()
        );
    }
    Ok(path)
}

fn run(cmd: &mut Command) -> anyhow::Result<(bool, String)> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

fn apply(plane: &ControlPlane, yaml: &str) -> anyhow::Result<()> {
    let mut child = plane
        .kubectl()?
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, yaml.as_bytes())?;
    drop(child.stdin.take());
    if !child.wait()?.success() {
        bail!("kubectl apply failed");
    }
    Ok(())
}

async fn wait_phase(api: &Api<DeadLetter>, name: &str, phase: Phase) -> anyhow::Result<()> {
    let cond = move |r: Option<&DeadLetter>| {
        r.is_some_and(|r| r.status.as_ref().and_then(|s| s.phase) == Some(phase))
    };
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(api.clone(), name, cond),
    )
    .await
    .with_context(|| format!("{name} did not become {phase:?}"))??;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let operator_bin = sibling("deadletter-operator")?;
    let dlq_bin = sibling("kubectl-dlq")?;
    let worker_bin = sibling("worker")?;
    let redis_bin = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("redis-server"))
                .find(|p| p.is_file())
        })
        .context(
            "redis-server not found: run scripts/ensure-deps.sh (apt-get install redis-server)",
        )?;

    eprintln!(
        "starting a local control plane, redis-server, the operator and the sample worker..."
    );
    let plane = ControlPlane::start().context("starting the control plane")?;
    let dir = plane.dir().to_path_buf();
    apply(&plane, include_str!("../crds/dlq.dev.yaml"))?;
    let (ok, text) = run(plane.kubectl()?.args([
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        "crd/deadletters.dlq.dev",
        "crd/deadletterqueues.dlq.dev",
    ]))?;
    if !ok {
        bail!("CRDs not established: {text}");
    }

    let redis_port = testenv::free_port()?;
    let _redis = Guard(testenv::spawn_guarded(
        Command::new(redis_bin).args([
            "--port",
            &redis_port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]),
        &dir.join("redis.log"),
    )?);
    let redis_url = format!("redis://127.0.0.1:{redis_port}/");
    let rclient = redis::Client::open(redis_url.as_str())?;
    let mut rconn = None;
    for _ in 0..100 {
        if let Ok(c) = rclient.get_multiplexed_async_connection().await {
            rconn = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut rconn = rconn.context("redis-server did not start")?;

    apply(
        &plane,
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NS}}}\n---\napiVersion: v1\nkind: Secret\nmetadata: {{name: redis, namespace: {NS}}}\nstringData: {{url: \"{redis_url}\"}}\n---\napiVersion: dlq.dev/v1alpha1\nkind: DeadLetterQueue\nmetadata: {{name: relayer, namespace: {NS}}}\nspec:\n  target:\n    redis: {{urlSecretRef: {{name: redis, key: url}}, list: \"relayer:jobs\"}}\n"
        ),
    )?;

    let kubeconfig = plane.kubeconfig.clone();
    let metrics_port = testenv::free_port()?;
    let _operator = Guard(testenv::spawn_guarded(
        Command::new(operator_bin)
            .args([
                "run",
                "--leader-election=false",
                &format!("--metrics-addr=127.0.0.1:{metrics_port}"),
                &format!("--watch-namespaces={NS}"),
            ])
            .env("KUBECONFIG", &kubeconfig),
        &dir.join("operator.log"),
    )?);

    // The worker's stdout is the demo's event stream: one line per processed job.
    let mut worker = Command::new(worker_bin)
        .args(["--redis", &redis_url, "--list", "relayer:jobs"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let worker_out = worker.stdout.take().context("worker stdout")?;
    let _worker = Guard(worker);
    let (tx, worker_lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(worker_out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });

    for j in &JOBS {
        let _: () = redis::cmd("HSET")
            .arg(format!("intent:{}", j.intent))
            .arg("state")
            .arg(j.state)
            .query_async(&mut rconn)
            .await?;
    }

    let client = Client::try_from(
        Config::from_custom_kubeconfig(
            Kubeconfig::read_from(&kubeconfig)?,
            &KubeConfigOptions::default(),
        )
        .await?,
    )?;
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), NS);
    let dlq = |args: &[&str]| {
        let mut c = Command::new(&dlq_bin);
        c.args(["--kubeconfig", &kubeconfig.to_string_lossy(), "-n", NS])
            .args(args);
        c
    };

    for j in &JOBS {
        let payload = format!("{{\"intent\":\"{}\",\"ref\":\"settle\"}}", j.intent);
        let (ok, text) = run(dlq(&[
            "park",
            "--queue",
            "relayer",
            "--id",
            j.id,
            "--payload",
            &payload,
            "--deliveries",
            j.deliveries,
            "--failure-kind",
            j.kind,
            "--reason",
            j.reason,
            "--intent-id",
            j.intent,
            "--intent-state",
            j.state,
            "--service-version",
            "relayer@1.4.2",
        ])
        .stdin(Stdio::null()))?;
        if !ok {
            bail!("parking {} failed: {text}", j.id);
        }
    }
    for r in records.list(&ListParams::default()).await?.items {
        wait_phase(
            &records,
            &r.metadata.name.clone().unwrap_or_default(),
            Phase::Parked,
        )
        .await?;
    }
    let (_, table) = run(&mut dlq(&["ls", "--no-headers"]))?;
    println!("dlq     {} parked", table.lines().count());
    for line in table.lines() {
        println!("        {line}");
    }
    println!();

    let _: () = redis::cmd("HSET")
        .arg("intent:pi_0003")
        .arg("state")
        .arg("authorized")
        .query_async(&mut rconn)
        .await?;
    println!("sign    pi_0003 signed at last, back to authorized");
    println!();

    for j in &JOBS {
        let (ok, text) = run(&mut dlq(&["redrive", j.id, "--by", "ops"]))?;
        print!("{text}");
        if !ok {
            bail!("redrive of {} was refused", j.id);
        }
        let line = worker_lines
            .recv_timeout(Duration::from_secs(60))
            .with_context(|| format!("the worker never saw {}", j.id))?;
        println!("{line}");
    }
    // The second press on pi_0003: refused, exit code non-zero.
    let (ok, text) = run(&mut dlq(&["redrive", "pi_0003/settle", "--by", "ops"]))?;
    print!("{text}");
    if ok {
        bail!("the second redrive of pi_0003/settle was not refused");
    }
    println!();

    let items = records.list(&ListParams::default()).await?.items;
    for r in &items {
        wait_phase(
            &records,
            &r.metadata.name.clone().unwrap_or_default(),
            Phase::Redriven,
        )
        .await?;
    }
    let items = records.list(&ListParams::default()).await?.items;
    let parked = items.iter().filter(|r| r.phase() == Phase::Parked).count();
    let redriven = items
        .iter()
        .filter(|r| r.phase() == Phase::Redriven)
        .count();
    println!("dlq     {parked} parked, {redriven} redriven");
    if let Ok(extra) = worker_lines.recv_timeout(Duration::from_millis(500)) {
        bail!("the worker processed more than expected: {extra}");
    }
    eprintln!("shutting everything down");
    Ok(())
}
