//! A real Flux for the GitOps tests: source-controller and kustomize-controller (built from
//! their Go modules by `tools/build.sh flux`) against the shared plane, pulling from a git
//! server on loopback (`gitserver`: `git http-backend`) that serves one bare repository the
//! test commits to. Everything stops when the [`Flux`] is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::GroupVersionKind;

use crate::plane::{free_port, spawn_guarded, terminate};

/// The branch Flux follows.
pub const BRANCH: &str = "main";

/// Flux and its git server, running.
pub struct Flux {
    children: Vec<(String, Child)>,
    logs: Vec<PathBuf>,
    /// The work tree the test commits in (pushed to the served bare repository).
    work: PathBuf,
    /// The repository's URL as source-controller pulls it.
    pub url: String,
}

/// `git` in `dir`, failing the test with git's words.
fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "carol")
        .env("GIT_AUTHOR_EMAIL", "carol@example.com")
        .env("GIT_COMMITTER_NAME", "carol")
        .env("GIT_COMMITTER_EMAIL", "carol@example.com")
        .output()
        .unwrap_or_else(|e| panic!("running git {args:?}: {e}"));
    assert!(
        out.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Flux's CRDs (GitRepository, Kustomization, ...) once per test binary.
async fn install_flux_crds(client: &Client, crds: &Path) {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| async {
        let mut yaml = String::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(crds)
            .unwrap_or_else(|e| panic!("reading {}: {e}", crds.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        files.sort();
        for f in files {
            yaml.push_str("---\n");
            yaml.push_str(&std::fs::read_to_string(&f).expect("a Flux CRD"));
        }
        crate::cluster::apply_crds(client, &yaml).await;
    })
    .await;
}

impl Flux {
    /// Builds (once) and starts Flux and the git server; the repository starts with one commit.
    pub async fn start(client: &Client, runtime_ns: &str) -> Flux {
        let dirs = crate::plane::tool_dirs(&["flux"])
            .unwrap_or_else(|e| panic!("building Flux failed: {e}"));
        let bin = dirs.first().cloned().expect("the flux bin dir");
        install_flux_crds(client, &bin.join("../crds")).await;
        let scratch = crate::chart::scratch_dir("gitops");
        let (repos, work) = (scratch.join("repos"), scratch.join("work"));
        std::fs::create_dir_all(&repos).expect("repos dir");
        git(
            &repos,
            &["init", "-q", "--bare", "-b", BRANCH, "payments.git"],
        );
        git(&scratch, &["clone", "-q", "repos/payments.git", "work"]);
        git(&work, &["checkout", "-q", "-b", BRANCH]);
        let mut flux = Flux {
            children: Vec::new(),
            logs: Vec::new(),
            work,
            url: String::new(),
        };
        flux.commit(&[("README.md", "decisions, reviewed\n")], &[], "start");
        let git_port = free_port().expect("a port for the git server");
        flux.url = format!("http://127.0.0.1:{git_port}/payments.git");
        let root = repos.display().to_string();
        let git_addr = format!("127.0.0.1:{git_port}");
        flux.spawn(
            &bin,
            &scratch,
            "gitserver",
            &["-root", &root, "-addr", &git_addr],
            runtime_ns,
        );
        let storage_port = free_port().expect("a port for Flux's artifact storage");
        let storage = scratch.join("storage");
        std::fs::create_dir_all(&storage).expect("Flux's artifact storage");
        let storage = storage.display().to_string();
        let storage_addr = format!("127.0.0.1:{storage_port}");
        let source_args = [
            format!("--storage-path={storage}"),
            format!("--storage-addr={storage_addr}"),
            format!("--storage-adv-addr={storage_addr}"),
        ];
        flux.spawn_controller(
            &bin,
            &scratch,
            "source-controller",
            &source_args,
            runtime_ns,
        );
        flux.spawn_controller(&bin, &scratch, "kustomize-controller", &[], runtime_ns);
        flux
    }

    fn spawn_controller(
        &mut self,
        bin: &Path,
        scratch: &Path,
        name: &str,
        args: &[String],
        runtime_ns: &str,
    ) {
        let port = |what: &str| free_port().unwrap_or_else(|e| panic!("a port for {what}: {e}"));
        let mut all = vec![
            format!("--metrics-addr=127.0.0.1:{}", port("metrics")),
            format!("--health-addr=127.0.0.1:{}", port("health")),
            "--log-level=info".to_string(),
        ];
        all.extend(args.iter().cloned());
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        self.spawn(bin, scratch, name, &refs, runtime_ns);
    }

    fn spawn(&mut self, bin: &Path, scratch: &Path, name: &str, args: &[&str], runtime_ns: &str) {
        let log = scratch.join(format!("{name}.log"));
        let mut cmd = Command::new(bin.join(name));
        cmd.args(args)
            .env("KUBECONFIG", &crate::cluster::plane().kubeconfig)
            .env("RUNTIME_NAMESPACE", runtime_ns);
        let child =
            spawn_guarded(&mut cmd, &log).unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.children.push((name.to_string(), child));
        self.logs.push(log);
    }

    /// Writes `files`, removes `remove`, commits as carol and pushes; the commit's sha.
    pub fn commit(&self, files: &[(&str, &str)], remove: &[&str], message: &str) -> String {
        for (path, text) in files {
            let path = self.work.join(path);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).expect("a directory in the work tree");
            }
            std::fs::write(&path, text).expect("a file in the work tree");
        }
        for path in remove {
            git(&self.work, &["rm", "-q", path]);
        }
        git(&self.work, &["add", "-A"]);
        git(&self.work, &["commit", "-q", "-m", message]);
        git(&self.work, &["push", "-q", "origin", BRANCH]);
        git(&self.work, &["rev-parse", "HEAD"])
    }

    /// Every controller's log, for a failing test.
    pub fn logs(&self) -> String {
        self.logs
            .iter()
            .map(|l| {
                let text = std::fs::read_to_string(l).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("== {}\n{}", l.display(), tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Flux {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            terminate(child, Duration::from_secs(5));
        }
    }
}

/// A Kustomization's API (kustomize.toolkit.fluxcd.io/v1).
pub fn kustomizations(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kustomize.toolkit.fluxcd.io", "v1", "Kustomization"),
        "kustomizations",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// Whether the Kustomization applied `sha` and is Ready; its Ready message otherwise.
pub fn applied(k: &DynamicObject, sha: &str) -> Result<(), String> {
    let status = &k.data["status"];
    let revision = status["lastAppliedRevision"].as_str().unwrap_or_default();
    let ready = status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .unwrap_or_default();
    if revision.ends_with(sha) && ready["status"] == "True" {
        return Ok(());
    }
    Err(format!(
        "revision {revision:?}, Ready {} {}",
        ready["status"], ready["message"]
    ))
}
