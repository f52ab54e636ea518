//! The faults, each a real one: SIGKILL, SIGSTOP/SIGCONT, process restarts on the same ports
//! and data, and a cut TCP link.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;

use super::proxy::{Cut, Toxiproxy};
use super::shared::{Rng, Spawner, lock};
use crate::brokers::{Rabbit, Redis};
use crate::operator::Operator;
use crate::plane::ControlPlane;

/// Every kind of fault, in the order a run first covers them.
pub const KINDS: [&str; 8] = [
    "operator_sigkill",
    "leader_pause",
    "apiserver_restart",
    "redis_restart",
    "broker_cut",
    "broker_partition",
    "etcd_restart",
    "rabbitmq_restart",
];

/// How long a paused leader stays stopped: past its 15 s lease and 5 s grace.
pub const PAUSE: Duration = Duration::from_secs(23);

/// Everything a fault acts on.
pub struct Targets {
    pub plane: Arc<Mutex<ControlPlane>>,
    pub client: Client,
    pub ns: String,
    pub redis: Arc<Mutex<Redis>>,
    pub rabbit: Arc<Rabbit>,
    pub proxy: Toxiproxy,
    pub operators: Arc<Mutex<Vec<Operator>>>,
    /// Where killed operators' logs are kept (for the panic count and for people).
    pub logs: PathBuf,
    pub spawner: Spawner,
}

impl Targets {
    /// Starts one more replica (leader election on), blocking until it is ready.
    /// A replica that exits at start (the apiserver still settling) is started again, as a
    /// Deployment would.
    pub async fn start_replica(&self) {
        let kubeconfig = lock(&self.plane).kubeconfig.clone();
        for attempt in 1..=10 {
            let (kubeconfig, ns) = (kubeconfig.clone(), self.ns.clone());
            let started = self
                .spawner
                .run(move || {
                    let args = ["--leader-election=true", "--lease-namespace", &ns];
                    // CHAOS_OPERATOR_LOG: the replicas' RUST_LOG (e.g.
                    // `info,deadletter=debug,kube_runtime=debug` to follow the watches).
                    let log = std::env::var("CHAOS_OPERATOR_LOG").ok();
                    let env: Vec<(&str, &str)> =
                        log.iter().map(|l| ("RUST_LOG", l.as_str())).collect();
                    Operator::start_on(&kubeconfig, &ns, &args, &env)
                })
                .await;
            match started {
                Ok(op) => return lock(&self.operators).push(op),
                Err(_) if attempt < 10 => tokio::time::sleep(Duration::from_secs(2)).await,
                Err(e) => panic!("starting an operator replica failed 10 times: {e}"),
            }
        }
    }

    /// Panics (ending the run) when etcd or kube-apiserver is down after a fault.
    pub fn check_plane(&self) {
        if let Some(why) = lock(&self.plane).exited() {
            panic!("the control plane did not survive the fault: {why}");
        }
    }

    /// Removes replica `i` (already killed or exited) keeping its log.
    fn retire(&self, i: usize) {
        let mut ops = lock(&self.operators);
        if i < ops.len() {
            let mut op = ops.remove(i);
            op.kill();
            keep_log(&op.log, &self.logs, &op.name);
        }
        for (i, log) in self.rabbit.logs().iter().enumerate() {
            keep_log(log, &self.logs, &format!("rabbitmq-{i}"));
        }
    }

    /// The replica holding the Lease now, if the apiserver answers and it is one of ours.
    async fn leader(&self) -> Option<usize> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let lease = leases.get("deadletter-operator").await.ok()?;
        let holder = lease.spec?.holder_identity?;
        lock(&self.operators).iter().position(|o| o.name == holder)
    }

    /// Injects one fault of `kind` and waits until it is over (the component back).
    pub async fn inject(&self, kind: &str, rng: &mut Rng) {
        match kind {
            "operator_sigkill" => {
                let n = lock(&self.operators).len().max(1);
                let i = self.leader().await.filter(|_| rng.below(2) == 0);
                let i = i.unwrap_or_else(|| rng.below(n as u64) as usize);
                self.retire(i);
                sleep_ms(rng, 500, 3000).await;
                self.start_replica().await;
            }
            "leader_pause" => self.pause_leader().await,
            "apiserver_restart" => self.blocking(|p| p.restart_apiserver()).await,
            "etcd_restart" => self.blocking(|p| p.restart_etcd()).await,
            "redis_restart" => {
                lock(&self.redis).stop();
                sleep_ms(rng, 500, 3000).await;
                let redis = self.redis.clone();
                let restarted = self.spawner.run(move || lock(&redis).restart()).await;
                restarted.unwrap_or_else(|e| panic!("restarting redis: {e}"));
            }
            "rabbitmq_restart" => {
                let rabbit = self.rabbit.clone();
                let restarted = self
                    .spawner
                    .run(move || {
                        rabbit.stop();
                        std::thread::sleep(Duration::from_secs(1));
                        rabbit.restart();
                    })
                    .await;
                restarted.unwrap_or_else(|e| panic!("restarting rabbitmq: {e}"));
            }
            "broker_cut" => self.cut_link(Cut::Refuse, rng).await,
            "broker_partition" => self.cut_link(Cut::BlackHole, rng).await,
            other => panic!("unknown fault kind {other}"),
        }
    }

    /// Cuts the operator's link to Redis for 2-8 s, then restores it.
    async fn cut_link(&self, cut: Cut, rng: &mut Rng) {
        let failed = |e| panic!("toxiproxy {cut:?}: {e}");
        self.proxy.cut(cut).await.unwrap_or_else(failed);
        sleep_ms(rng, 2000, 8000).await;
        self.proxy.restore(cut).await.unwrap_or_else(failed);
    }

    /// A control-plane restart, off the async threads (it waits for /readyz).
    async fn blocking(&self, f: fn(&mut ControlPlane) -> Result<(), crate::plane::TestenvError>) {
        let plane = self.plane.clone();
        self.spawner
            .run(move || f(&mut lock(&plane)))
            .await
            .unwrap_or_else(|e| panic!("control plane restart panicked: {e}"))
            .unwrap_or_else(|e| panic!("control plane restart failed: {e}"));
    }

    /// SIGSTOP of the leader past its lease, then SIGCONT; a replica that exits on waking
    /// (it lost the Lease) is replaced.
    async fn pause_leader(&self) {
        let Some(i) = self.leader().await else {
            return;
        };
        if let Some(op) = lock(&self.operators).get_mut(i) {
            op.signal(libc::SIGSTOP);
        }
        tokio::time::sleep(PAUSE).await;
        let name = {
            let mut ops = lock(&self.operators);
            let Some(op) = ops.get_mut(i) else { return };
            op.signal(libc::SIGCONT);
            op.name.clone()
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        let exited = {
            let mut ops = lock(&self.operators);
            let j = ops.iter().position(|o| o.name == name);
            j.filter(|&j| !ops[j].running())
        };
        if let Some(j) = exited {
            self.retire(j);
            self.start_replica().await;
        }
    }

    /// Keeps every replica's log and stops them.
    pub fn stop_all(&self) {
        let mut ops = lock(&self.operators);
        for mut op in ops.drain(..) {
            op.kill();
            keep_log(&op.log, &self.logs, &op.name);
        }
        for (i, log) in self.rabbit.logs().iter().enumerate() {
            keep_log(log, &self.logs, &format!("rabbitmq-{i}"));
        }
    }
}

fn keep_log(log: &Path, dir: &Path, name: &str) {
    let _ = std::fs::create_dir_all(dir);
    let _ = std::fs::copy(log, dir.join(format!("{name}.log")));
}

async fn sleep_ms(rng: &mut Rng, lo: u64, hi: u64) {
    tokio::time::sleep(Duration::from_millis(lo + rng.below(hi - lo))).await;
}
