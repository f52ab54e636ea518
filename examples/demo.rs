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
use dlq_core::api::{DeadLetter, Phase};
use dlq_testenv::paths::try_bin;
use dlq_testenv::plane::{self as testenv, ControlPlane};
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, Config};
use redis::aio::MultiplexedConnection;

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

fn run(cmd: &mut Command) -> anyhow::Result<(bool, String)> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

/// Server-side applies every document of `yaml` (kinds the demo creates: CRDs, a Namespace, a
/// Secret, a DeadLetterQueue) as the field manager `demo`.
async fn apply(client: &Client, yaml: &str) -> anyhow::Result<()> {
    use kube::api::{DynamicObject, Patch, PatchParams};
    use kube::discovery::ApiResource;
    use serde::Deserialize;
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let obj = DynamicObject::deserialize(doc)?;
        let types = obj
            .types
            .clone()
            .context("a document without apiVersion/kind")?;
        let (group, version) = types
            .api_version
            .split_once('/')
            .unwrap_or(("", types.api_version.as_str()));
        let plural = match types.kind.as_str() {
            "CustomResourceDefinition" => "customresourcedefinitions",
            "Namespace" => "namespaces",
            "Secret" => "secrets",
            "DeadLetterQueue" => "deadletterqueues",
            other => bail!("the demo does not apply {other}"),
        };
        let ar = ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: types.api_version.clone(),
            kind: types.kind.clone(),
            plural: plural.into(),
        };
        let name = obj
            .metadata
            .name
            .clone()
            .context("a document without a name")?;
        let api: Api<DynamicObject> = match obj.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        api.patch(
            &name,
            &PatchParams::apply("demo").force(),
            &Patch::Apply(&obj),
        )
        .await
        .with_context(|| format!("applying {} {name}", types.kind))?;
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

/// Waits until every record is in `phase`.
async fn wait_all(records: &Api<DeadLetter>, phase: Phase) -> anyhow::Result<()> {
    for r in records.list(&ListParams::default()).await?.items {
        wait_phase(records, &r.metadata.name.clone().unwrap_or_default(), phase).await?;
    }
    Ok(())
}

/// Everything the demo runs, found before anything starts.
struct Binaries {
    operator: PathBuf,
    dlq: PathBuf,
    worker: PathBuf,
    redis: PathBuf,
}

impl Binaries {
    fn locate() -> anyhow::Result<Binaries> {
        let operator = try_bin("deadletter-operator").map_err(anyhow::Error::msg)?;
        let dlq = try_bin("kubectl-dlq").map_err(anyhow::Error::msg)?;
        let worker = try_bin("dlq-demo-worker").map_err(anyhow::Error::msg)?;
        let redis = std::env::var_os("PATH")
            .and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("redis-server"))
                    .find(|p| p.is_file())
            })
            .context(
                "redis-server not found: run scripts/ensure-deps.sh (apt-get install redis-server)",
            )?;
        Ok(Binaries {
            operator,
            dlq,
            worker,
            redis,
        })
    }
}

/// A control plane with the dlq.dev CRDs established, and a client of it.
async fn start_plane() -> anyhow::Result<(ControlPlane, Client)> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::runtime::conditions::is_crd_established;
    let plane = ControlPlane::start().context("starting the control plane")?;
    let client = client(&plane.kubeconfig).await?;
    apply(&client, include_str!("../crds/dlq.dev.yaml")).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in ["deadletters.dlq.dev", "deadletterqueues.dlq.dev"] {
        tokio::time::timeout(
            Duration::from_secs(60),
            await_condition(crds.clone(), name, is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {name} not established within 60 s"))??;
    }
    Ok((plane, client))
}

/// redis-server on a free port, once it answers: the guard, its URL and a connection.
async fn start_redis(
    bin: &Path,
    dir: &Path,
) -> anyhow::Result<(Guard, String, MultiplexedConnection)> {
    let port = testenv::free_port()?;
    let guard = Guard(testenv::spawn_guarded(
        Command::new(bin).args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]),
        &dir.join("redis.log"),
    )?);
    let url = format!("redis://127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str())?;
    for _ in 0..100 {
        if let Ok(c) = client.get_multiplexed_async_connection().await {
            return Ok((guard, url, c));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("redis-server did not start")
}

/// Namespace `payments` with the queue `relayer` redriving onto the list `relayer:jobs`.
async fn create_queue(client: &Client, redis_url: &str) -> anyhow::Result<()> {
    apply(
        client,
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NS}}}\n---\napiVersion: v1\nkind: Secret\nmetadata: {{name: redis, namespace: {NS}}}\nstringData: {{url: \"{redis_url}\"}}\n---\napiVersion: dlq.dev/v1alpha1\nkind: DeadLetterQueue\nmetadata: {{name: relayer, namespace: {NS}}}\nspec:\n  target:\n    redis: {{urlSecretRef: {{name: redis, key: url}}, list: \"relayer:jobs\"}}\n"
        ),
    )
    .await
}

fn start_operator(bin: &Path, kubeconfig: &Path, dir: &Path) -> anyhow::Result<Guard> {
    let metrics_port = testenv::free_port()?;
    Ok(Guard(testenv::spawn_guarded(
        Command::new(bin)
            .args([
                "run",
                "--leader-election=false",
                &format!("--metrics-addr=127.0.0.1:{metrics_port}"),
                &format!("--watch-namespaces={NS}"),
            ])
            .env("KUBECONFIG", kubeconfig),
        &dir.join("operator.log"),
    )?))
}

/// The worker; its stdout is the demo's event stream: one line per processed job.
fn start_worker(bin: &Path, redis_url: &str) -> anyhow::Result<(Guard, mpsc::Receiver<String>)> {
    let mut worker = Command::new(bin)
        .args(["--redis", redis_url, "--list", "relayer:jobs"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let worker_out = worker.stdout.take().context("worker stdout")?;
    let guard = Guard(worker);
    let (tx, worker_lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(worker_out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok((guard, worker_lines))
}

/// Sets the state of an intent in the worker's store.
async fn set_intent(
    redis: &mut MultiplexedConnection,
    intent: &str,
    state: &str,
) -> anyhow::Result<()> {
    let _: () = redis::cmd("HSET")
        .arg(format!("intent:{intent}"))
        .arg("state")
        .arg(state)
        .query_async(redis)
        .await?;
    Ok(())
}

async fn client(kubeconfig: &Path) -> anyhow::Result<Client> {
    Ok(Client::try_from(
        Config::from_custom_kubeconfig(
            Kubeconfig::read_from(kubeconfig)?,
            &KubeConfigOptions::default(),
        )
        .await?,
    )?)
}

/// The running scenario: `kubectl dlq` as a human would type it, the records, the worker's
/// store and its output.
struct Scenario {
    dlq_bin: PathBuf,
    kubeconfig: PathBuf,
    records: Api<DeadLetter>,
    redis: MultiplexedConnection,
    worker_lines: mpsc::Receiver<String>,
}

impl Scenario {
    fn dlq(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.dlq_bin);
        c.args(["--kubeconfig", &self.kubeconfig.to_string_lossy(), "-n", NS])
            .args(args);
        c
    }

    /// The worker gives up on the three jobs: each is parked with `kubectl dlq park`.
    async fn park_jobs(&self) -> anyhow::Result<()> {
        for j in &JOBS {
            let payload = format!("{{\"intent\":\"{}\",\"ref\":\"settle\"}}", j.intent);
            let (ok, text) = run(self
                .dlq(&[
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
        wait_all(&self.records, Phase::Parked).await?;
        let (_, table) = run(&mut self.dlq(&["ls", "--no-headers"]))?;
        println!("dlq     {} parked", table.lines().count());
        for line in table.lines() {
            println!("        {line}");
        }
        println!();
        Ok(())
    }

    /// The payer of pi_0003 signs at last.
    async fn sign_pi_0003(&mut self) -> anyhow::Result<()> {
        set_intent(&mut self.redis, "pi_0003", "authorized").await?;
        println!("sign    pi_0003 signed at last, back to authorized");
        println!();
        Ok(())
    }

    /// `ops` redrives each job; the worker says what it did with it.
    fn redrive_each(&self) -> anyhow::Result<()> {
        for j in &JOBS {
            let (ok, text) = run(&mut self.dlq(&["redrive", j.id, "--by", "ops"]))?;
            print!("{text}");
            if !ok {
                bail!("redrive of {} was refused", j.id);
            }
            let line = self
                .worker_lines
                .recv_timeout(Duration::from_secs(60))
                .with_context(|| format!("the worker never saw {}", j.id))?;
            println!("{line}");
        }
        Ok(())
    }

    /// The second press on pi_0003: refused, exit code non-zero.
    fn press_again(&self) -> anyhow::Result<()> {
        let (ok, text) = run(&mut self.dlq(&["redrive", "pi_0003/settle", "--by", "ops"]))?;
        print!("{text}");
        if ok {
            bail!("the second redrive of pi_0003/settle was not refused");
        }
        println!();
        Ok(())
    }

    /// Every record redriven, and the worker saw nothing more.
    async fn summary(&self) -> anyhow::Result<()> {
        wait_all(&self.records, Phase::Redriven).await?;
        let items = self.records.list(&ListParams::default()).await?.items;
        let parked = items.iter().filter(|r| r.phase() == Phase::Parked).count();
        let redriven = items
            .iter()
            .filter(|r| r.phase() == Phase::Redriven)
            .count();
        println!("dlq     {parked} parked, {redriven} redriven");
        if let Ok(extra) = self.worker_lines.recv_timeout(Duration::from_millis(500)) {
            bail!("the worker processed more than expected: {extra}");
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let bins = Binaries::locate()?;
    eprintln!(
        "starting a local control plane, redis-server, the operator and the sample worker..."
    );
    let (plane, client) = start_plane().await?;
    let dir = plane.dir().to_path_buf();
    let (_redis, redis_url, mut redis) = start_redis(&bins.redis, &dir).await?;
    create_queue(&client, &redis_url).await?;
    let kubeconfig = plane.kubeconfig.clone();
    let _operator = start_operator(&bins.operator, &kubeconfig, &dir)?;
    let (_worker, worker_lines) = start_worker(&bins.worker, &redis_url)?;
    for j in &JOBS {
        set_intent(&mut redis, j.intent, j.state).await?;
    }
    let records = Api::namespaced(client, NS);
    let mut demo = Scenario {
        dlq_bin: bins.dlq,
        kubeconfig,
        records,
        redis,
        worker_lines,
    };

    demo.park_jobs().await?;
    demo.sign_pi_0003().await?;
    demo.redrive_each()?;
    demo.press_again()?;
    demo.summary().await?;
    eprintln!("shutting everything down");
    Ok(())
}
