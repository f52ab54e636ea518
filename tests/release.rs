//! The release as a user meets it (issue 49): `scripts/release.sh all` (what `make release-local`
//! runs) against a loopback OCI registry (go-containerregistry's `crane registry serve`), with this
//! build's debug binaries in the image. Then, as a platform team would:
//! - `cosign verify` of the image and the chart with the release's public key passes, and fails
//!   for an image pushed under the same tag with one byte of its config changed, and for another
//!   key; the SBOM attested to the image lists the operator's crates and no test crate;
//! - the plugin from its krew manifest and archive with a real krew (`kubectl krew install
//!   --manifest … --archive …`, KREW_ROOT of its own): `kubectl dlq version` prints the release;
//! - on the real node (`dlq_testenv::node`; containerd pulls from the registry over plain HTTP on
//!   loopback, by digest), the previous release's chart (0.1.x, from git history) installed with
//!   the release's image, records parked, one redriven and one dropped; the new CRDs applied as
//!   the release's NOTES print them (`helm show crds oci://… | kubectl apply --server-side
//!   --force-conflicts`, that very line run, aimed at the test registry), `helm
//!   upgrade` to the release from the registry: 2 Ready replicas running the image by digest, the
//!   records and their decisions unchanged (same objects, same phases), none re-parked, nothing
//!   re-enqueued, the failure groups made from the records and kept; the parked one redriven;
//! - `helm uninstall`, then docs/operations.md's block for a registry served over plain HTTP run
//!   as printed (cosign verify of the chart and its image, `helm install oci://…`): 2 Ready
//!   replicas, a record parked and redriven.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dlq_core::api::{Action, DeadLetter, Phase};
use dlq_core::groups::DeadLetterGroup;
use dlq_testenv::brokers::Redis;
use dlq_testenv::chart::{check, helm, run, scratch_dir, show};
use dlq_testenv::node::NODE_ADDRESS;
use dlq_testenv::{
    LIST, Plane, create_queue, decide, eventually, list_target, namespace, node_plane, record,
    report, wait_phase,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};

const RELEASE: &str = "dlo";
const RELEASE_NS: &str = "dlq-system";
const FULLNAME: &str = "dlo-deadletter-operator";
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The release name docs/operations.md installs under.
const DOCS_RELEASE: &str = "deadletter-operator";
/// The chart's public address, as the NOTES and the docs print it.
const PUBLIC_CHART: &str = "oci://ghcr.io/deadletter-operator/charts/deadletter-operator";

fn tool(name: &str, tool: &str) -> PathBuf {
    let dirs = dlq_testenv::plane::tool_dirs(&[tool])
        .unwrap_or_else(|e| panic!("building {tool} (tools/build.sh {tool}): {e}"));
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not in {dirs:?}"))
}

/// `crane registry serve` on a free loopback port, stopped (and its content gone) on drop.
struct Registry {
    child: Child,
    host: String,
}

impl Registry {
    fn start(dir: &Path) -> Registry {
        let log = dir.join("registry.log");
        let child = dlq_testenv::plane::spawn_guarded(
            Command::new(tool("crane", "crane")).args([
                "registry",
                "serve",
                "--address",
                "127.0.0.1:0",
            ]),
            &log,
        )
        .expect("starting crane registry serve");
        let host = std::iter::repeat_with(|| {
            std::thread::sleep(Duration::from_millis(100));
            std::fs::read_to_string(&log).unwrap_or_default()
        })
        .take(100)
        .find_map(|text| {
            let port = text
                .split("serving on port ")
                .nth(1)?
                .split_whitespace()
                .next()?;
            Some(format!("127.0.0.1:{port}"))
        })
        .expect("crane registry serve says its port within 10s");
        Registry { child, host }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The previous release's chart: the chart directory at the last commit whose Chart.yaml says
/// version 0.1.x (there are no tags; the commit that bumped it to 0.2.0 is the release's).
fn previous_chart(dest: &Path) -> PathBuf {
    let root = dlq_testenv::workspace_root();
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .expect("git runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let chart_yaml = "charts/deadletter-operator/Chart.yaml";
    let (ok, commits) = git(&["log", "--format=%H", "--", chart_yaml]);
    assert!(
        ok,
        "git log of {chart_yaml} failed: is {} a git checkout?",
        root.display()
    );
    // Newest first: the first 0.1.x Chart.yaml is the last change to it before the bump; the
    // chart as released is the whole directory just before the bump (templates changed after
    // the last Chart.yaml edit too).
    let commits: Vec<&str> = commits.lines().collect();
    let found = commits.iter().position(|c| {
        let (ok, text) = git(&["show", &format!("{c}:{chart_yaml}")]);
        ok && text.lines().any(|l| l.trim().starts_with("version: 0.1."))
    });
    let commit = found.map(|i| match i {
        0 => commits[0].to_string(),
        _ => format!("{}^", commits[i - 1]),
    });
    let Some(commit) = commit.as_deref() else {
        let (_, shallow) = git(&["rev-parse", "--is-shallow-repository"]);
        panic!(
            "no commit in git history has a 0.1.x {chart_yaml}: the upgrade test installs the \
             previous release's chart from history (shallow clone: {}; run `git fetch \
             --unshallow`)",
            shallow.trim()
        );
    };
    std::fs::create_dir_all(dest).expect("the old chart's dir");
    let tar = dest.join("chart.tar");
    let archive = Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["archive", "--format=tar", "-o"])
        .arg(&tar)
        .args([commit, "charts/deadletter-operator"])
        .status()
        .expect("git archive");
    assert!(
        archive.success(),
        "git archive of the 0.1.x chart at {commit}"
    );
    let status = Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(dest)
        .status()
        .expect("tar");
    assert!(status.success(), "extracting the 0.1.x chart of {commit}");
    report(&format!(
        "release: the previous chart is {chart_yaml} at {commit}"
    ));
    dest.join("charts/deadletter-operator")
}

/// What `scripts/release.sh all` wrote to its `release.env`.
fn release(registry: &str, out: &Path) -> BTreeMap<String, String> {
    let started = Instant::now();
    let bin_dir = dlq_testenv::bin("deadletter-operator")
        .parent()
        .expect("the binaries' dir")
        .to_path_buf();
    let output = check(
        "scripts/release.sh all",
        Command::new("bash")
            .arg(dlq_testenv::workspace_root().join("scripts/release.sh"))
            .arg("all")
            .env("REGISTRY", registry)
            .env("BIN_DIR", &bin_dir)
            .env("OUT", out)
            .env("DLQ_IMAGE_BIN", dlq_testenv::bin("dlq-image")),
        None,
    );
    report(&format!(
        "release: scripts/release.sh all to {registry} in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
    assert!(output.contains("IMAGE="), "{output}");
    std::fs::read_to_string(out.join("release.env"))
        .expect("release.env")
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn cosign() -> Command {
    Command::new(tool("cosign", "cosign"))
}

/// `cosign verify` (or `verify-attestation`) with a key, offline; its output.
fn verify(what: &str, key: &Path, trusted_root: &Path, reference: &str) -> std::process::Output {
    run(
        cosign()
            .arg(what)
            .arg("--key")
            .arg(key)
            .args(["--insecure-ignore-tlog=true", "--allow-http-registry"])
            .arg("--trusted-root")
            .arg(trusted_root)
            .args(if what == "verify-attestation" {
                &["--type", "spdxjson"][..]
            } else {
                &[][..]
            })
            .arg(reference),
        None,
    )
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The release's image layout with one byte of its config changed (the creation second), the
/// manifest and index rewritten to match, pushed under the release's tag.
fn push_tampered(layout: &Path, work: &Path, reference: &str) {
    let _ = std::fs::remove_dir_all(work);
    check(
        "cp -a layout",
        Command::new("cp").arg("-a").arg(layout).arg(work),
        None,
    );
    let blob = |d: &str| {
        work.join("blobs/sha256")
            .join(d.trim_start_matches("sha256:"))
    };
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.join("index.json")).expect("index.json"))
            .expect("index JSON");
    let manifest_digest = index["manifests"][0]["digest"]
        .as_str()
        .expect("a manifest");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(blob(manifest_digest)).expect("manifest"))
            .expect("manifest JSON");
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .expect("config")
        .to_string();
    let config = std::fs::read(blob(&config_digest)).expect("config");
    let at = config
        .windows(20)
        .position(|w| w == b"1970-01-01T00:00:00Z")
        .expect("the config's creation time");
    let mut tampered = config.clone();
    tampered[at + 18] = b'1';
    assert_eq!(
        config.iter().zip(&tampered).filter(|(a, b)| a != b).count(),
        1
    );
    let new_config = format!("sha256:{}", sha256(&tampered));
    std::fs::write(blob(&new_config), &tampered).expect("writing the config");
    manifest["config"]["digest"] = json!(new_config);
    let manifest_bytes = serde_json::to_vec(&manifest).expect("manifest");
    let new_manifest = format!("sha256:{}", sha256(&manifest_bytes));
    std::fs::write(blob(&new_manifest), &manifest_bytes).expect("writing the manifest");
    let mut index = index.clone();
    index["manifests"][0]["digest"] = json!(new_manifest);
    index["manifests"][0]["size"] = json!(manifest_bytes.len());
    std::fs::write(work.join("index.json"), index.to_string()).expect("index.json");
    check(
        "crane push (tampered)",
        Command::new(tool("crane", "crane"))
            .args(["push", "--insecure"])
            .arg(work)
            .arg(reference),
        None,
    );
}

/// Signatures and the SBOM, as someone who holds only the public key checks them.
fn signatures(env: &BTreeMap<String, String>, out: &Path) {
    let key = PathBuf::from(&env["COSIGN_PUBLIC_KEY"]);
    let trusted_root = out.join("offline-trusted-root.json");
    let registry = &env["REGISTRY"];
    let by_tag = format!("{registry}/deadletter-operator:{VERSION}");
    let chart_tag = format!("{registry}/charts/deadletter-operator:{VERSION}");
    for reference in [&env["IMAGE"], &by_tag, &env["CHART_REF"], &chart_tag] {
        let out = verify("verify", &key, &trusted_root, reference);
        assert!(
            out.status.success(),
            "cosign verify {reference}: {}",
            show(&out)
        );
    }

    // Another key verifies nothing.
    let other = out.join("other");
    std::fs::create_dir_all(&other).expect("dir");
    check(
        "cosign generate-key-pair",
        cosign()
            .current_dir(&other)
            .env("COSIGN_PASSWORD", "")
            .arg("generate-key-pair"),
        None,
    );
    let wrong = verify(
        "verify",
        &other.join("cosign.pub"),
        &trusted_root,
        &env["IMAGE"],
    );
    assert!(
        !wrong.status.success(),
        "verified with another key: {}",
        show(&wrong)
    );

    // One byte changed under the same tag: the tag's signature check fails; the digest's holds.
    push_tampered(&out.join("image/layout"), &out.join("tampered"), &by_tag);
    let tampered = verify("verify", &key, &trusted_root, &by_tag);
    assert!(
        !tampered.status.success(),
        "the tampered image verified: {}",
        show(&tampered)
    );
    let text = String::from_utf8_lossy(&tampered.stderr);
    assert!(text.contains("no signatures found"), "{text}");
    let original = verify("verify", &key, &trusted_root, &env["IMAGE"]);
    assert!(original.status.success(), "{}", show(&original));

    // The SBOM attested to the image: the operator's crates, no test crate.
    let att = verify("verify-attestation", &key, &trusted_root, &env["IMAGE"]);
    assert!(
        att.status.success(),
        "cosign verify-attestation: {}",
        show(&att)
    );
    let envelope: serde_json::Value = serde_json::from_slice(
        att.stdout
            .split(|b| *b == b'\n')
            .next()
            .expect("an attestation"),
    )
    .expect("a DSSE envelope");
    use base64::Engine;
    let statement = base64::engine::general_purpose::STANDARD
        .decode(envelope["payload"].as_str().expect("payload"))
        .expect("base64 payload");
    let statement: serde_json::Value =
        serde_json::from_slice(&statement).expect("an in-toto statement");
    assert_eq!(statement["predicateType"], "https://spdx.dev/Document");
    let crates: BTreeSet<&str> = statement["predicate"]["packages"]
        .as_array()
        .expect("SPDX packages")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for want in [
        "deadletter-operator",
        "kubectl-dlq",
        "dlq-core",
        "dlq-client",
        "kube",
        "kube-runtime",
        "k8s-openapi",
        "tokio",
    ] {
        assert!(crates.contains(want), "the SBOM lacks {want}: {crates:?}");
    }
    for test_only in ["dlq-testenv", "rcgen", "fantoccini"] {
        assert!(
            !crates.contains(test_only),
            "the SBOM lists the test crate {test_only}"
        );
    }
    report(&format!(
        "release: cosign verify ok for image and chart (by digest and tag), refused for another \
         key and for the tampered image; SBOM of {} crates",
        crates.len()
    ));
}

/// `kubectl krew install --manifest … --archive …` with a real krew, then `kubectl dlq version`.
fn krew(env: &BTreeMap<String, String>, out: &Path) {
    let krew_root = out.join("krew-root");
    let shims = out.join("krew-shims");
    std::fs::create_dir_all(&shims).expect("dir");
    let _ = std::fs::remove_file(shims.join("kubectl-krew"));
    std::os::unix::fs::symlink(tool("krew", "krew"), shims.join("kubectl-krew"))
        .expect("kubectl-krew on PATH");
    let kubectl = tool("kubectl", "kube");
    // kubectl, krew and what krew installs; not the workspace's target dir.
    let path = std::env::join_paths([
        krew_root.join("bin"),
        shims.clone(),
        kubectl.parent().expect("kubectl's dir").to_path_buf(),
        PathBuf::from("/usr/bin"),
        PathBuf::from("/bin"),
    ])
    .expect("PATH");
    let kubectl_cmd = || {
        let mut c = Command::new(&kubectl);
        c.env("PATH", &path)
            .env("KREW_ROOT", &krew_root)
            .env("KREW_NO_UPGRADE_CHECK", "1")
            .env("HOME", out);
        c
    };
    check(
        "kubectl krew install",
        kubectl_cmd()
            .args(["krew", "install"])
            .arg(format!("--manifest={}", env["KREW_MANIFEST"]))
            .arg(format!("--archive={}", env["KREW_ARCHIVE"])),
        None,
    );
    assert!(
        krew_root.join("bin/kubectl-dlq").exists(),
        "krew put no kubectl-dlq in its bin"
    );
    let said = check(
        "kubectl dlq version",
        kubectl_cmd().args(["dlq", "version"]),
        None,
    );
    assert_eq!(said.trim(), format!("kubectl dlq {VERSION}"));
    // krew's receipt of the install (`krew list` itself wants a plugin index: none here).
    let receipt = std::fs::read_to_string(krew_root.join("receipts/dlq.yaml")).expect("receipt");
    assert!(
        receipt.contains(&format!("version: v{VERSION}")),
        "{receipt}"
    );
    report(&format!(
        "release: kubectl krew install -> kubectl dlq version: {}",
        said.trim()
    ));
}

/// `bash -c script` as a user at a terminal runs it: this test's helm (and its homes), kubectl,
/// cosign and crane first on PATH, against `plane`.
fn user_shell(plane: &Plane, script: &str) -> Command {
    let helm = helm_on(plane);
    let mut cmd = Command::new("bash");
    for (var, value) in helm.get_envs() {
        if let Some(value) = value {
            cmd.env(var, value);
        }
    }
    let programs = [
        PathBuf::from(helm.get_program()),
        plane.tool("kubectl"),
        tool("cosign", "cosign"),
        tool("crane", "crane"),
    ];
    let dirs = programs
        .iter()
        .filter_map(|p| p.parent().map(Path::to_path_buf));
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(dirs.chain(std::env::split_paths(&path))).expect("PATH");
    cmd.env("PATH", path)
        .args(["-euo", "pipefail", "-c", script]);
    cmd
}

/// The CRD command the release's NOTES print on `helm upgrade` (rendered by a dry run), with the
/// chart's public address replaced by `chart` in the test registry (served over plain HTTP).
fn notes_crd_command(plane: &Plane, chart: &str) -> String {
    let printed = check(
        "helm upgrade --dry-run (the release's NOTES)",
        helm_on(plane)
            .args([
                "upgrade",
                RELEASE,
                chart,
                "--version",
                VERSION,
                "--plain-http",
            ])
            .args(["--namespace", RELEASE_NS, "--reset-values", "--dry-run"]),
        None,
    );
    let (_, notes) = printed
        .split_once("NOTES:")
        .unwrap_or_else(|| panic!("helm upgrade prints the NOTES: {printed}"));
    let line = notes
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("helm show crds"))
        .unwrap_or_else(|| panic!("the NOTES give the CRD command: {notes}"));
    // (a placeholder, as NOTES once printed, is filled in as a user would)
    line.replace("<this chart>", &format!("{chart} --version {VERSION}"))
        .replace(PUBLIC_CHART, chart)
        .replacen("helm show crds", "helm show crds --plain-http", 1)
}

/// docs/operations.md's block for a registry served over plain HTTP, `registry` put in.
fn docs_plain_http_block(registry: &str) -> String {
    let docs = std::fs::read_to_string(dlq_testenv::workspace_root().join("docs/operations.md"))
        .expect("docs/operations.md");
    let blocks: Vec<&str> = docs.split("```").collect();
    let block = blocks
        .iter()
        .skip(1)
        .step_by(2)
        .find(|b| b.contains("REGISTRY=registry.internal:5000"))
        .expect("docs/operations.md shows verifying over plain HTTP");
    let block = block.strip_prefix("sh").unwrap_or(block);
    block
        .lines()
        .map(|l| {
            if l.starts_with("REGISTRY=") {
                format!("REGISTRY={registry}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn helm_on(plane: &Plane) -> Command {
    let mut cmd = helm();
    cmd.env("KUBECONFIG", &plane.kubeconfig);
    cmd
}

fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits for exactly `n` Ready operator pods and none other, running `image`; their names.
async fn ready_pods(pods: &Api<Pod>, n: usize, image: &str, secs: u64) -> BTreeSet<String> {
    eventually(
        secs,
        &format!("{n} Ready operator pods of {image}"),
        || async {
            let all = pods.list(&ListParams::default()).await.ok()?.items;
            let ready: BTreeSet<String> = all
                .iter()
                .filter(|p| is_ready(p))
                .filter(|p| {
                    p.spec.as_ref().is_some_and(|s| {
                        s.containers
                            .iter()
                            .any(|c| c.image.as_deref() == Some(image))
                    })
                })
                .map(|p| p.name_any())
                .collect();
            (ready.len() == n && all.len() == n).then_some(ready)
        },
    )
    .await
}

/// Each record: (uid, phase, decided by).
async fn snapshot(
    api: &Api<DeadLetter>,
) -> BTreeMap<String, (String, Option<Phase>, Option<String>)> {
    api.list(&ListParams::default())
        .await
        .expect("LIST records")
        .items
        .into_iter()
        .map(|r| {
            let by = r.spec.by.clone();
            (
                r.name_any(),
                (
                    r.uid().unwrap_or_default(),
                    // The phase as every reader takes it: a record whose status was never
                    // written reads as Parked (the new CRD serves that as its default; the
                    // previous release's CRD, which this build's operator runs against before
                    // the upgrade, leaves it unset).
                    Some(r.phase()),
                    by,
                ),
            )
        })
        .collect()
}

async fn park_one(api: &Api<DeadLetter>, name: &str, payload: &str) {
    api.create(
        &PostParams::default(),
        &record(name, &format!("release/{name}"), payload.as_bytes(), &[]),
    )
    .await
    .unwrap_or_else(|e| panic!("parking {name}: {e}"));
    wait_phase(api, name, Phase::Parked, 60).await;
}

/// Every parked record in a failure group, the groups' counts adding up to the records'.
async fn groups_cover(client: &Client, ns: &str, parked: i64, redriven: i64, dropped: i64) {
    let groups: Api<DeadLetterGroup> = Api::namespaced(client.clone(), ns);
    eventually(60, "the failure groups count the records", || async {
        let items = groups.list(&ListParams::default()).await.ok()?.items;
        let sum = |f: fn(&dlq_core::groups::DeadLetterGroupStatus) -> i64| {
            items
                .iter()
                .filter_map(|g| g.status.as_ref())
                .map(f)
                .sum::<i64>()
        };
        (!items.is_empty()
            && sum(|s| s.parked) == parked
            && sum(|s| s.redriven) == redriven
            && sum(|s| s.dropped) == dropped)
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_from_a_registry_verifies_installs_and_upgrades() {
    let started = Instant::now();
    let out = scratch_dir("release");
    let old_chart = previous_chart(&out.join("old"));
    let plane = node_plane();
    let client = plane.client().await;

    let registry = Registry::start(&out);
    dlq_testenv::node::plain_http_registry(
        plane
            .containerd
            .as_ref()
            .expect("the node's containerd socket"),
        &registry.host,
    )
    .expect("the node pulls from the loopback registry");
    let env = release(&registry.host, &out.join("dist"));
    let image = env["IMAGE"].clone();
    let (repository, digest) = image.split_once('@').expect("REPO@DIGEST");
    let chart = env["CHART"].clone();
    assert_eq!(
        chart,
        format!("oci://{}/charts/deadletter-operator", registry.host)
    );
    signatures(&env, &out.join("dist"));
    krew(&env, &out.join("dist"));

    // The previous release, with a stand-in for its image (the old chart only needs a
    // reference): this build's image labelled 0.1.0, so that its digest differs and the upgrade
    // replaces every pod, as a real one does.
    let old_image = check(
        "crane mutate (the 0.1.x stand-in)",
        Command::new(tool("crane", "crane"))
            .args(["mutate", "--insecure", &image])
            .args(["--label", "org.opencontainers.image.version=0.1.0"])
            .args(["--tag", &format!("{repository}:0.1.0")]),
        None,
    );
    let old_image = old_image.trim().to_string();
    let (_, old_digest) = old_image
        .split_once('@')
        .expect("crane mutate prints REF@DIGEST");
    assert_ne!(old_digest, digest);
    let installed = Instant::now();
    check(
        "helm install (0.1.x from git history)",
        helm_on(plane)
            .args(["install", RELEASE])
            .arg(&old_chart)
            .args(["--namespace", RELEASE_NS, "--create-namespace"])
            .args(["--set", &format!("image.repository={repository}")])
            .args(["--set", &format!("image.digest={old_digest}")]),
        None,
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NS);
    let old_pods = ready_pods(&pods, 2, &format!("{repository}@{old_digest}"), 120).await;
    report(&format!(
        "release: 0.1.x chart -> 2 pods Ready (image pulled from the registry) in {:.1}s",
        installed.elapsed().as_secs_f64()
    ));

    let redis = Redis::start_on(IpAddr::V4(NODE_ADDRESS));
    let ns = namespace(&client, "release").await;
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    for name in ["redriven", "dropped", "waiting"] {
        park_one(&records, name, name).await;
    }
    decide(&records, "redriven", Action::Redrive, "admin").await;
    decide(&records, "dropped", Action::Drop, "admin").await;
    wait_phase(&records, "redriven", Phase::Redriven, 60).await;
    wait_phase(&records, "dropped", Phase::Dropped, 60).await;
    assert_eq!(redis.list(LIST).await, vec![b"redriven".to_vec()]);
    let before = snapshot(&records).await;

    // The upgrade as the release's NOTES say (printed by `helm upgrade`): the CRDs first, with
    // the very command the NOTES print, aimed at the test registry. CRDs that Helm installed are
    // Helm's fields: a command without --force-conflicts is refused.
    let upgraded = Instant::now();
    let crds_command = notes_crd_command(plane, &chart);
    let applied = check(
        "the NOTES' CRD command",
        &mut user_shell(plane, &crds_command),
        None,
    );
    assert!(
        applied.contains("deadlettergroups.dlq.dev"),
        "the release's CRDs: {applied}"
    );
    check(
        "helm upgrade (the release, from the registry)",
        helm_on(plane)
            .args([
                "upgrade",
                RELEASE,
                &chart,
                "--version",
                VERSION,
                "--plain-http",
            ])
            // Not the old release's image pin: the release's chart pins its own image digest
            // (with no values given, helm upgrade would reuse the old ones).
            .args(["--namespace", RELEASE_NS, "--reset-values"]),
        None,
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NS);
    let deployment = deployments.get(FULLNAME).await.expect("the Deployment");
    let running = deployment
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].image.clone().unwrap_or_default())
        .unwrap_or_default();
    assert_eq!(
        running, image,
        "the release's chart runs its image by digest"
    );
    let new_pods = ready_pods(&pods, 2, &image, 180).await;
    assert!(
        new_pods.is_disjoint(&old_pods),
        "{new_pods:?} / {old_pods:?}"
    );
    report(&format!(
        "release: CRDs applied, helm upgrade -> 2 new pods Ready in {:.1}s ({new_pods:?})",
        upgraded.elapsed().as_secs_f64()
    ));

    // Records, decisions and groups survive; nothing re-parked, nothing re-enqueued.
    groups_cover(&client, &ns, 1, 1, 1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        snapshot(&records).await,
        before,
        "records changed by the upgrade"
    );
    assert_eq!(
        redis.list(LIST).await,
        vec![b"redriven".to_vec()],
        "re-enqueued"
    );
    decide(&records, "waiting", Action::Redrive, "admin").await;
    wait_phase(&records, "waiting", Phase::Redriven, 60).await;
    assert_eq!(
        redis.list(LIST).await,
        vec![b"waiting".to_vec(), b"redriven".to_vec()]
    );
    groups_cover(&client, &ns, 0, 2, 1).await;

    // A fresh install from the registry as docs/operations.md says for a registry served over
    // plain HTTP: its block run as it is printed (the registry's address put in), verifying the
    // chart and the image it pins with the release's key before `helm install`.
    check(
        "helm uninstall",
        helm_on(plane).args(["uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait"]),
        None,
    );
    let fresh = Instant::now();
    let work = out.join("user");
    std::fs::create_dir_all(&work).expect("the user's directory");
    std::fs::copy(&env["COSIGN_PUBLIC_KEY"], work.join("cosign.pub")).expect("cosign.pub");
    let mut install = user_shell(plane, &docs_plain_http_block(&registry.host));
    install.current_dir(&work).env("VERSION", VERSION);
    check(
        "docs/operations.md: verify and install over plain HTTP",
        &mut install,
        None,
    );
    ready_pods(&pods, 2, &image, 120).await;
    park_one(&records, "fresh", "fresh").await;
    decide(&records, "fresh", Action::Redrive, "admin").await;
    wait_phase(&records, "fresh", Phase::Redriven, 60).await;
    assert_eq!(redis.list(LIST).await.first(), Some(&b"fresh".to_vec()));
    report(&format!(
        "release: helm install {chart} --version {VERSION} -> 2 Ready, parked and redriven in \
         {:.1}s; the story took {:.1}s",
        fresh.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
    check(
        "helm uninstall",
        helm_on(plane).args([
            "uninstall",
            DOCS_RELEASE,
            "--namespace",
            RELEASE_NS,
            "--wait",
        ]),
        None,
    );
    drop(registry);
    let _ = std::fs::remove_dir_all(&out);
}
