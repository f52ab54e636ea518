//! The chart as users run it (issue 13): on a real node (kubelet, containerd, kube-proxy; see
//! `dlq_testenv::node`), `helm install` with only the image reference and pull policy changed;
//! the operator image built here without a Docker daemon. One story, in order: two Ready
//! replicas and a Lease held by a pod; a park → redrive → job on the broker; the leader pod
//! deleted during a 500-record replay, none lost; no error lines in the pods' logs; /metrics
//! through the chart's Service; the reveal API (an APIService proxied by the apiserver to the
//! pods through its Service) answers `kubectl get deadletterpayload`; `helm upgrade` rolls the
//! pods; `helm uninstall` keeps the CRDs and the records.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{Action, DeadLetter, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::chart::{chart_dir, check, helm};
use dlq_testenv::node::NODE_ADDRESS;
use dlq_testenv::operator::{http_get, metric};
use dlq_testenv::{
    LIST, Plane, create_queue, decide, eventually, list_target, namespace, node_plane, record,
    report, wait_phase,
};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const RELEASE: &str = "dlo";
const RELEASE_NS: &str = "dlq-system";
/// The chart's full name for release [`RELEASE`]: Deployment, Lease and Service prefix.
const FULLNAME: &str = "dlo-deadletter-operator";
const REPLAY: usize = 500;
/// The reveal API's serving certificate (a `kubernetes.io/tls` Secret in [`RELEASE_NS`]).
const REVEAL_TLS: &str = "dlo-reveal-tls";

/// The operator image from this build's binaries, imported into the node; its reference.
fn load_image(plane: &Plane) -> String {
    let started = Instant::now();
    let binaries = [
        dlq_testenv::bin("deadletter-operator"),
        dlq_testenv::bin("kubectl-dlq"),
    ];
    let refs: Vec<&std::path::Path> = binaries.iter().map(|p| p.as_path()).collect();
    let dir = dlq_testenv::paths::target_tmp_dir().join("node-image");
    let archive =
        dlq_testenv::image::operator_image(&refs, &dir.join("build"), &dir.join("operator.tar"))
            .unwrap_or_else(|e| panic!("building the operator image: {e}"));
    let ctr = dlq_testenv::brokers::which("ctr").expect("ctr (Debian's containerd) on PATH");
    let socket = plane
        .containerd
        .as_ref()
        .expect("the node's containerd socket");
    dlq_testenv::image::import(&ctr, socket, &archive)
        .unwrap_or_else(|e| panic!("importing the operator image: {e}"));
    report(&format!(
        "node: image {} built and imported in {:.1}s",
        archive.reference,
        started.elapsed().as_secs_f64()
    ));
    archive.reference
}

fn helm_on(plane: &Plane) -> Command {
    let mut cmd = helm();
    cmd.env("KUBECONFIG", &plane.kubeconfig);
    cmd
}

/// The reveal API's serving certificate, for its Service `<FULLNAME>-reveal.<RELEASE_NS>.svc`,
/// from a CA of its own: the Secret [`REVEAL_TLS`] in [`RELEASE_NS`] (created with the
/// namespace), and the CA's PEM in a file for the APIService's caBundle.
async fn reveal_tls(client: &Client) -> PathBuf {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("key")).expect("CA");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec![format!("{FULLNAME}-reveal.{RELEASE_NS}.svc")])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("certificate");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": RELEASE_NS}})).expect("ns");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("creating the release namespace");
    let secret = serde_json::from_value(json!({
        "metadata": {"name": REVEAL_TLS},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": cert.pem(), "tls.key": key.serialize_pem()},
    }))
    .expect("secret");
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), RELEASE_NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("creating the reveal API's TLS Secret");
    let path = dlq_testenv::paths::target_tmp_dir().join("node-reveal-ca.crt");
    std::fs::write(&path, ca.pem()).expect("writing the CA");
    path
}

/// `helm install` with only the image reference and pull policy set, and the reveal API on
/// (its certificate's Secret and CA from [`reveal_tls`]).
fn install(plane: &Plane, reference: &str, reveal_ca: &std::path::Path) {
    let (repository, tag) = reference.rsplit_once(':').expect("repository:tag");
    check(
        "helm install",
        helm_on(plane)
            .args(["install", RELEASE])
            .arg(chart_dir())
            .args(["--namespace", RELEASE_NS, "--create-namespace"])
            .args(["--set", &format!("image.repository={repository}")])
            // --set-string: a tag of hex digits can be all digits, which --set makes a number.
            .args(["--set-string", &format!("image.tag={tag}")])
            .args(["--set", "image.pullPolicy=Never"])
            .args(["--set", "revealApi.enabled=true"])
            .args(["--set", &format!("revealApi.tlsSecretName={REVEAL_TLS}")])
            .arg("--set-file")
            .arg(format!("revealApi.caBundle={}", reveal_ca.display())),
        None,
    );
}

/// `kubectl get deadletterpayload` of the redriven record `first`: the apiserver proxies it
/// to a pod through the chart's Service, and the payload comes back.
async fn reveal_through_pods(plane: &Plane, ns: &str) {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed().as_secs() < 90 {
        let out = plane
            .kubectl()
            .args(["get", "deadletterpayload", "-n", ns, "first", "-o", "json"])
            .output()
            .expect("kubectl runs");
        let object: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if object["payload"] == "first" {
            report(&format!(
                "node: kubectl get deadletterpayload answered through the pods in {:.1}s",
                started.elapsed().as_secs_f64()
            ));
            return;
        }
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    panic!("the reveal API did not answer through the pods in 90s: {last}");
}

fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits for `n` Ready operator pods (not being deleted) and none other; their names.
async fn ready_pods(pods: &Api<Pod>, n: usize, secs: u64) -> BTreeSet<String> {
    eventually(secs, &format!("{n} Ready operator pods"), || async {
        let all = pods.list(&ListParams::default()).await.ok()?.items;
        let ready: BTreeSet<String> = all
            .iter()
            .filter(|p| is_ready(p))
            .map(|p| p.name_any())
            .collect();
        (ready.len() == n && all.len() == n).then_some(ready)
    })
    .await
}

/// Seconds from each pod's creation to its Ready condition (1 s resolution).
fn start_to_ready(pod: &Pod) -> Option<i64> {
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let ready = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")?
        .last_transition_time
        .as_ref()?
        .0;
    Some(ready.as_second() - created.as_second())
}

async fn lease_holder(leases: &Api<Lease>) -> Option<String> {
    leases.get(FULLNAME).await.ok()?.spec?.holder_identity
}

/// One record parked, redriven by a human, its job on the broker.
async fn park_redrive(client: &Client, ns: &str, redis: &Redis) {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    api.create(
        &PostParams::default(),
        &record("first", "node/first", b"first", &[]),
    )
    .await
    .expect("parking the first record");
    wait_phase(&api, "first", Phase::Parked, 60).await;
    decide(&api, "first", Action::Redrive, "admin").await;
    wait_phase(&api, "first", Phase::Redriven, 60).await;
    assert_eq!(redis.list(LIST).await, vec![b"first".to_vec()]);
}

/// `n` jobs parked as producers park them (labels the runbook selects by), 16 at a time.
async fn park_many(client: &Client, ns: &str, n: usize) {
    let park_one = |i: usize| {
        let job = Job {
            id: format!("node/{i}"),
            payload: Some(format!("job-{i}")),
            ..Job::default()
        };
        park(client.clone(), ns, ParkRequest::new("relayer", job))
    };
    let parked: Vec<_> = futures::stream::iter((0..n).map(park_one))
        .buffer_unordered(16)
        .collect()
        .await;
    for p in parked {
        p.unwrap_or_else(|e| panic!("parking: {e}"));
    }
}

async fn count_in(api: &Api<DeadLetter>, phase: Phase) -> usize {
    api.list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter(|r| r.status.as_ref().and_then(|s| s.phase) == Some(phase))
                .count()
        })
        .unwrap_or(0)
}

/// `kubectl dlq redrive --queue relayer --rate 100/s` in the background (the runbook, signed
/// by the admin user it authenticates as), its output in a file.
struct Replay {
    child: Child,
    log: PathBuf,
}

impl Replay {
    fn start(plane: &Plane, ns: &str) -> Replay {
        let log = dlq_testenv::paths::target_tmp_dir().join("node-replay.log");
        let out = std::fs::File::create(&log).expect("creating the replay log");
        let err = out.try_clone().expect("cloning the replay log");
        let child = Command::new(dlq_testenv::bin("kubectl-dlq"))
            .env("KUBECONFIG", &plane.kubeconfig)
            .args(["redrive", "-n", ns, "--queue", "relayer", "--rate", "100/s"])
            .args(["--note", "node replay", "--settle-timeout", "120"])
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("starting kubectl dlq redrive");
        Replay { child, log }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with its output if it ended in failure.
    fn check_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            assert!(
                status.success(),
                "kubectl dlq redrive: {status}\n{}",
                self.output()
            );
        }
    }

    async fn finish(mut self) -> String {
        let status = tokio::task::spawn_blocking(move || {
            let status = self.child.wait();
            (status, self.log)
        })
        .await
        .expect("join");
        let (status, log) = status;
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.as_ref().is_ok_and(|s| s.success()),
            "kubectl dlq redrive: {status:?}\n{output}"
        );
        output
    }
}

/// `kubectl logs -f` of a pod into memory until the pod's container ends.
fn follow_logs(plane: &Plane, pod: &str) -> Child {
    plane
        .kubectl()
        .args(["logs", "-f", "-n", RELEASE_NS, pod])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl logs -f")
}

/// The leader pod deleted once the replay has started; the seconds from the delete until the
/// first redrive after the Lease names another pod.
async fn delete_leader_mid_replay(
    client: &Client,
    records: &Api<DeadLetter>,
    leader: &str,
    replay: &mut Replay,
) -> f64 {
    let leases: Api<Lease> = Api::namespaced(client.clone(), RELEASE_NS);
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while count_in(records, Phase::Redriven).await <= 1 {
        replay.check_running();
        assert!(
            Instant::now() < deadline,
            "no redrive 60s into the replay:\n{}",
            replay.output()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let before = count_in(records, Phase::Redriven).await;
    assert!(
        before < REPLAY,
        "the replay was over before the leader could be deleted"
    );
    let deleted = Instant::now();
    Api::<Pod>::namespaced(client.clone(), RELEASE_NS)
        .delete(leader, &DeleteParams::default())
        .await
        .expect("deleting the leader pod");
    let baseline = eventually(90, "another pod to hold the Lease", || async {
        let holder = lease_holder(&leases).await?;
        (holder != leader).then_some(())?;
        Some(count_in(records, Phase::Redriven).await)
    })
    .await;
    if baseline < REPLAY {
        eventually(90, "a redrive by the new leader", || async {
            (count_in(records, Phase::Redriven).await > baseline).then_some(())
        })
        .await;
    }
    let secs = deleted.elapsed().as_secs_f64();
    report(&format!(
        "node: leader {leader} deleted at {before}/{REPLAY} redriven; first redrive by the new \
         leader {secs:.1}s later"
    ));
    secs
}

/// Every replayed job reached the broker at least once.
async fn none_lost(records: &Api<DeadLetter>, redis: &Redis) {
    eventually(180, "all replayed records Redriven", || async {
        (count_in(records, Phase::Redriven).await == REPLAY + 1).then_some(())
    })
    .await;
    let jobs: BTreeSet<Vec<u8>> = redis.list(LIST).await.into_iter().collect();
    let missing: Vec<usize> = (0..REPLAY)
        .filter(|i| !jobs.contains(format!("job-{i}").as_bytes()))
        .collect();
    assert!(missing.is_empty(), "jobs never enqueued: {missing:?}");
}

fn error_lines(logs: &str) -> Vec<&str> {
    logs.lines()
        .filter(|l| l.contains(r#""level":"ERROR""#))
        .collect()
}

fn logs_of(plane: &Plane, pod: &str) -> String {
    check(
        "kubectl logs",
        plane.kubectl().args(["logs", "-n", RELEASE_NS, pod]),
        None,
    )
}

/// /metrics through the chart's Service (kube-proxy's rules), until a replica that redrove
/// answers.
async fn metrics_through_the_service(client: &Client) {
    let svc = Api::<Service>::namespaced(client.clone(), RELEASE_NS)
        .get(&format!("{FULLNAME}-metrics"))
        .await
        .expect("the chart's metrics Service");
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("a ClusterIP");
    let port = 8080;
    eventually(30, "/metrics through the Service", || async move {
        let body = tokio::task::spawn_blocking(move || http_get((ip, port), "/metrics"))
            .await
            .ok()??;
        let redriven = metric(&body, "dlq_redrives_total", &[("result", "success")]);
        (redriven > 0.0).then_some(())
    })
    .await;
    report(&format!(
        "node: /metrics answered through the Service at {ip}:{port}"
    ));
}

/// `helm upgrade` with one changed value: new pods replace both, Ready.
async fn upgrade_rolls(plane: &Plane, pods: &Api<Pod>, before: &BTreeSet<String>) {
    check(
        "helm upgrade",
        helm_on(plane)
            .args(["upgrade", RELEASE])
            .arg(chart_dir())
            .args(["--namespace", RELEASE_NS, "--reuse-values"])
            .args(["--set-string", "podAnnotations.dlq-test/rolled=yes"]),
        None,
    );
    let after = eventually(180, "the rollout to replace both pods", || async {
        let now = ready_pods_now(pods).await;
        (now.len() == 2 && now.is_disjoint(before)).then_some(now)
    })
    .await;
    report(&format!(
        "node: helm upgrade rolled {before:?} -> {after:?}"
    ));
}

async fn ready_pods_now(pods: &Api<Pod>) -> BTreeSet<String> {
    let all = pods
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    if all.iter().any(|p| !is_ready(p)) {
        return BTreeSet::new();
    }
    all.iter().map(|p| p.name_any()).collect()
}

/// `helm uninstall`: the pods go, the CRDs and every record stay.
async fn uninstall_keeps_records(plane: &Plane, client: &Client, records: &Api<DeadLetter>) {
    check(
        "helm uninstall",
        helm_on(plane).args(["uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait"]),
        None,
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NS);
    assert!(deployments.get_opt(FULLNAME).await.expect("GET").is_none());
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in ["deadletters.dlq.dev", "deadletterqueues.dlq.dev"] {
        assert!(
            crds.get_opt(crd).await.expect("GET").is_some(),
            "{crd} removed"
        );
    }
    let left = records
        .list(&ListParams::default())
        .await
        .expect("LIST")
        .items
        .len();
    assert_eq!(left, REPLAY + 1, "records lost by helm uninstall");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_on_a_real_node() {
    let started = Instant::now();
    let plane = node_plane();
    let client = plane.client().await;
    let reference = load_image(plane);
    let redis = Redis::start_on(IpAddr::V4(NODE_ADDRESS));

    let reveal_ca = reveal_tls(&client).await;
    let installed = Instant::now();
    install(plane, &reference, &reveal_ca);
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NS);
    let first_pods = ready_pods(&pods, 2, 120).await;
    let per_pod: Vec<i64> = pods
        .list(&ListParams::default())
        .await
        .expect("LIST pods")
        .items
        .iter()
        .filter_map(start_to_ready)
        .collect();
    report(&format!(
        "node: helm install -> 2 pods Ready in {:.1}s (pod created -> Ready: {per_pod:?} s)",
        installed.elapsed().as_secs_f64()
    ));
    let leases: Api<Lease> = Api::namespaced(client.clone(), RELEASE_NS);
    let leader = eventually(60, "a Lease holder", || lease_holder(&leases)).await;
    assert!(
        first_pods.contains(&leader),
        "Lease held by {leader}, not one of {first_pods:?}"
    );

    let ns = namespace(&client, "node").await;
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    park_redrive(&client, &ns, &redis).await;
    reveal_through_pods(plane, &ns).await;

    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    park_many(&client, &ns, REPLAY).await;
    eventually(120, "the replay's records Parked", || async {
        (count_in(&records, Phase::Parked).await == REPLAY).then_some(())
    })
    .await;
    let leader_logs = follow_logs(plane, &leader);
    let mut replay = Replay::start(plane, &ns);
    delete_leader_mid_replay(&client, &records, &leader, &mut replay).await;
    none_lost(&records, &redis).await;
    let summary = replay.finish().await;
    report(&format!(
        "node: replay summary: {}",
        summary
            .lines()
            .rev()
            .take(2)
            .collect::<Vec<_>>()
            .join(" | ")
    ));

    let deleted_logs = tokio::task::spawn_blocking(move || leader_logs.wait_with_output())
        .await
        .expect("join")
        .expect("the deleted leader's logs");
    let deleted_logs = String::from_utf8_lossy(&deleted_logs.stdout).into_owned();
    assert!(
        error_lines(&deleted_logs).is_empty(),
        "{leader}: {:?}",
        error_lines(&deleted_logs)
    );
    let current = ready_pods(&pods, 2, 120).await;
    for pod in &current {
        let logs = logs_of(plane, pod);
        assert!(
            error_lines(&logs).is_empty(),
            "{pod}: {:?}",
            error_lines(&logs)
        );
    }

    metrics_through_the_service(&client).await;
    upgrade_rolls(plane, &pods, &current).await;
    uninstall_keeps_records(plane, &client, &records).await;
    report(&format!(
        "node: the chart story took {:.1}s",
        started.elapsed().as_secs_f64()
    ));
}
