//! A throwaway local control plane: etcd + kube-apiserver on free loopback ports.
//!
//! With a real node ([`crate::node`]) the apiserver listens on the node's address instead
//! ([`ControlPlane::start_at`]), so that pods reach it through the `kubernetes` Service.
//!
//! Used by the integration tests, `make cluster` and `make demo`. It is a real apiserver (built
//! from the Kubernetes Go modules by `tools/build.sh`), so CEL validation, resourceVersion
//! conflicts, RBAC and admission policies behave as in a cluster. Everything lives in one temp
//! dir that is removed on [`ControlPlane::stop`]; the children are killed by the kernel if this
//! process dies (`PR_SET_PDEATHSIG`), so an interrupted run leaves no servers behind.

use std::fs;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// Errors starting or stopping the local control plane.
#[derive(Debug, thiserror::Error)]
pub enum TestenvError {
    #[error("{0}")]
    Setup(String),
    #[error("io: {context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("certificate generation: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("{what} did not become ready within {secs}s; last lines of {log}:\n{tail}")]
    NotReady {
        what: &'static str,
        secs: u64,
        log: String,
        tail: String,
    },
}

type Result<T, E = TestenvError> = std::result::Result<T, E>;

pub(crate) fn io<T>(context: impl Into<String>, r: std::io::Result<T>) -> Result<T> {
    r.map_err(|source| TestenvError::Io {
        context: context.into(),
        source,
    })
}

/// Whether the apiserver answers `/readyz` with a success, asked as the admin of `kubeconfig`.
/// A thread of its own with its own runtime: the plane is started and restarted from
/// synchronous code that may itself run inside a runtime.
fn answers_readyz(kubeconfig: &Path) -> bool {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kubeconfig = kubeconfig.to_path_buf();
    let probe = move || -> Option<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        rt.block_on(async {
            let kc = Kubeconfig::read_from(&kubeconfig).ok()?;
            let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .ok()?;
            let client = kube::Client::try_from(config).ok()?;
            let req = http::Request::get("/readyz").body(Vec::new()).ok()?;
            let answer = tokio::time::timeout(Duration::from_secs(5), client.request_text(req));
            answer.await.ok()?.ok().map(drop)
        })
    };
    std::thread::spawn(probe).join().ok().flatten().is_some()
}

/// The `tools/build.sh` arguments of a control plane without a node: kube-apiserver of the kube
/// set (not kubectl or the node's binaries, so `make demo` builds only it) and etcd.
pub const PLANE_TOOLS: &[&str] = &["kube:kube-apiserver", "etcd"];

/// The same with kubectl, for a plane people and tests drive with it (`make cluster`).
pub const PLANE_TOOLS_WITH_KUBECTL: &[&str] = &["kube:kube-apiserver,kubectl", "etcd"];

/// The same with kube-controller-manager, for a plane whose ResourceQuotas are counted
/// ([`ControlPlane::start_quota_controller`]).
pub const PLANE_TOOLS_WITH_QUOTAS: &[&str] = &[
    "kube:kube-apiserver,kubectl,kube-controller-manager",
    "etcd",
];

/// Where the Go-built binaries are. `DLQ_TOOLS_BIN` (colon-separated dirs) wins; otherwise
/// `tools/build.sh` of this checkout (at the workspace root, see
/// [`find_workspace_root`](crate::paths::find_workspace_root)) builds them into its cache (once)
/// and names the dirs.
pub fn tool_dirs(tools: &[&str]) -> Result<Vec<PathBuf>> {
    if let Ok(dirs) = std::env::var("DLQ_TOOLS_BIN") {
        return Ok(std::env::split_paths(&dirs).collect());
    }
    let root = crate::paths::find_workspace_root().ok_or_else(|| {
        TestenvError::Setup(
            "cannot find the checkout's tools/build.sh to build kube-apiserver and etcd; \
             set DLQ_TOOLS_BIN to the dirs holding them"
                .into(),
        )
    })?;
    let script = root.join("tools/build.sh");
    let out = io(
        format!("running {}", script.display()),
        Command::new("bash")
            .arg(&script)
            .args(tools)
            .stderr(Stdio::inherit())
            .output(),
    )?;
    if !out.status.success() {
        return Err(TestenvError::Setup(format!(
            "{} {} failed ({}); see its message above",
            script.display(),
            tools.join(" "),
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect())
}

pub(crate) fn find_binary(dirs: &[PathBuf], name: &str) -> Result<PathBuf> {
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            TestenvError::Setup(format!(
                "{name} not found in {dirs:?}; run `tools/build.sh kube etcd` or set DLQ_TOOLS_BIN"
            ))
        })
}

/// The Service range: from the benchmark range 198.18.0.0/15 (RFC 2544), never a private range
/// that a real network of this machine could use.
pub const SERVICE_CIDR: &str = "198.19.0.0/24";
/// The `kubernetes` Service's ClusterIP (first of [`SERVICE_CIDR`]): pods' in-cluster config
/// connects there, so the serving certificate names it.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);
/// The node name of [`crate::node`]; its kubelet's client certificate is issued for it.
pub const NODE_NAME: &str = "dlq-node";
/// The front proxy's client certificate name (kube-apiserver's `--requestheader-allowed-names`).
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";
/// The audit policy of [`ControlPlane::start_audited`]: request and response bodies of every
/// request but Secrets' (whose bodies hold keys), as a PCI-minded cluster would log.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  resources: [{group: \"\", resources: [secrets]}]
- level: RequestResponse
";

/// A free loopback port. There is a window between closing the probe socket and the server
/// binding it; tests tolerate it because the next start picks another port.
pub fn free_port() -> Result<u16> {
    let l = io("binding a probe port", TcpListener::bind("127.0.0.1:0"))?;
    Ok(io("reading the probe port", l.local_addr())?.port())
}

/// Spawns a child that the kernel kills when the spawning thread's process dies.
pub fn spawn_guarded(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = io(format!("creating {}", log.display()), fs::File::create(log))?;
    let err = io("cloning log handle", out.try_clone())?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    io(format!("starting {:?}", cmd.get_program()), cmd.spawn())
}

/// Stops a child politely (SIGTERM), then firmly after `grace`.
pub fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: sending a signal to our own child.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running etcd + kube-apiserver.
pub struct ControlPlane {
    dir: PathBuf,
    etcd: Child,
    apiserver: Child,
    /// Admin kubeconfig (client cert in group system:masters).
    pub kubeconfig: PathBuf,
    /// `https://<address>:<port>` (127.0.0.1 unless started with [`ControlPlane::start_at`])
    pub server: String,
    /// Dirs holding kube-apiserver and etcd (and kubectl where it was built).
    pub bin_dirs: Vec<PathBuf>,
    /// etcd's client URL, peer port and kube-apiserver's port: a restart reuses them.
    ports: (String, u16, u16),
    /// Where kube-apiserver listens and what it advertises for the `kubernetes` Service.
    address: IpAddr,
    /// Flags added to kube-apiserver's (kept for its restarts).
    extra_args: Vec<String>,
    /// kube-controller-manager running only the `resourcequota` controller, once started.
    quota_controller: Option<Child>,
}

struct Pki {
    ca_pem: String,
    serving: (String, String),
    admin: (String, String),
    /// The node's client identities: kubelet (`system:node:<name>`, group `system:nodes`, for
    /// the Node authorizer) and kube-proxy (`system:kube-proxy`, bound by the default RBAC).
    kubelet: (String, String),
    kube_proxy: (String, String),
    /// The front proxy: kube-apiserver's client identity towards aggregated APIs (the reveal
    /// API), from its own CA, as kubeadm sets it up.
    front_proxy_ca_pem: String,
    front_proxy_client: (String, String),
    sa_key_pem: String,
    sa_pub_pem: String,
}

/// Names the serving certificate holds: loopback, the `kubernetes` Service (IP and DNS names, as
/// pods' in-cluster config checks them) and the address the apiserver listens on.
fn serving_names(address: IpAddr) -> Vec<String> {
    let mut names: Vec<String> = ["localhost", "127.0.0.1", "kubernetes", "kubernetes.default"]
        .into_iter()
        .map(String::from)
        .collect();
    names.push("kubernetes.default.svc".into());
    names.push("kubernetes.default.svc.cluster.local".into());
    names.push(KUBERNETES_SERVICE_IP.to_string());
    if !address.is_loopback() {
        names.push(address.to_string());
    }
    names
}

/// A self-signed CA named `name`.
fn new_ca(name: &str) -> Result<CertifiedIssuer<'static, KeyPair>> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name = DistinguishedName::new();
    ca.distinguished_name.push(DnType::CommonName, name);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?)
}

/// A certificate (PEM) and its key (PEM) for `cn` (in `org`) with `sans`, issued by `ca`.
fn leaf(
    ca: &CertifiedIssuer<'static, KeyPair>,
    sans: Vec<String>,
    cn: &str,
    org: Option<&str>,
) -> Result<(String, String)> {
    let mut p = CertificateParams::new(sans)?;
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, cn);
    if let Some(o) = org {
        p.distinguished_name.push(DnType::OrganizationName, o);
    }
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn pki(address: IpAddr) -> Result<Pki> {
    let ca = new_ca("dlq-testenv-ca")?;
    let front_proxy_ca = new_ca("dlq-testenv-front-proxy-ca")?;
    let sa = KeyPair::generate()?;
    Ok(Pki {
        ca_pem: ca.pem(),
        serving: leaf(&ca, serving_names(address), "kube-apiserver", None)?,
        admin: leaf(&ca, vec![], "admin", Some("system:masters"))?,
        kubelet: leaf(
            &ca,
            vec![],
            &format!("system:node:{NODE_NAME}"),
            Some("system:nodes"),
        )?,
        kube_proxy: leaf(&ca, vec![], "system:kube-proxy", None)?,
        front_proxy_ca_pem: front_proxy_ca.pem(),
        front_proxy_client: leaf(&front_proxy_ca, vec![], FRONT_PROXY_CLIENT, None)?,
        sa_key_pem: sa.serialize_pem(),
        sa_pub_pem: sa.public_key_pem(),
    })
}

pub(crate) fn write(path: &Path, contents: &str) -> Result<()> {
    io(
        format!("writing {}", path.display()),
        fs::write(path, contents),
    )
}

/// A kubeconfig for `server` trusting the plane's CA, authenticating with `client` (cert, key).
fn kubeconfig_yaml(server: &str, ca_pem: &str, client: &(String, String)) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: dlq-testenv\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: admin\n  user:\n    client-certificate-data: {cert}\n    client-key-data: {key}\ncontexts:\n- name: dlq-testenv\n  context:\n    cluster: dlq-testenv\n    user: admin\n    namespace: default\ncurrent-context: dlq-testenv\n",
        ca = b64(ca_pem),
        cert = b64(&client.0),
        key = b64(&client.1),
    )
}

/// The node's kubeconfigs (`kubelet.kubeconfig`, `kube-proxy.kubeconfig`) next to the admin's.
fn write_node_kubeconfigs(dir: &Path, server: &str, pki: &Pki) -> Result<()> {
    write(
        &dir.join("kubelet.kubeconfig"),
        &kubeconfig_yaml(server, &pki.ca_pem, &pki.kubelet),
    )?;
    write(
        &dir.join("kube-proxy.kubeconfig"),
        &kubeconfig_yaml(server, &pki.ca_pem, &pki.kube_proxy),
    )
}

/// A fresh state dir for one plane: `<tmp>/dlq-testenv-<pid>-<nanos>`.
fn state_dir() -> PathBuf {
    crate::paths::sweep_stale_scratch();
    std::env::temp_dir().join(format!(
        "dlq-testenv-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ))
}

/// Writes the CA, the serving pair and the ServiceAccount signing pair into `dir`.
fn write_pki(dir: &Path, pki: &Pki) -> Result<()> {
    io("creating the pki dir", fs::create_dir_all(dir))?;
    write(&dir.join("ca.crt"), &pki.ca_pem)?;
    write(&dir.join("serving.crt"), &pki.serving.0)?;
    write(&dir.join("serving.key"), &pki.serving.1)?;
    // kube-apiserver's client identity towards kubelets (`kubectl logs`, exec): system:masters,
    // which the kubelet's webhook authorization allows.
    write(&dir.join("admin.crt"), &pki.admin.0)?;
    write(&dir.join("admin.key"), &pki.admin.1)?;
    write(&dir.join("front-proxy-ca.crt"), &pki.front_proxy_ca_pem)?;
    write(
        &dir.join("front-proxy-client.crt"),
        &pki.front_proxy_client.0,
    )?;
    write(
        &dir.join("front-proxy-client.key"),
        &pki.front_proxy_client.1,
    )?;
    write(&dir.join("sa.key"), &pki.sa_key_pem)?;
    write(&dir.join("sa.pub"), &pki.sa_pub_pem)
}

/// A single-member etcd with its data in `data_dir`, serving clients on `client_url`.
fn etcd_command(bin: &Path, data_dir: &Path, client_url: &str, peer_port: u16) -> Command {
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--data-dir={}", data_dir.display()))
        .arg(format!("--listen-client-urls={client_url}"))
        .arg(format!("--advertise-client-urls={client_url}"))
        .arg(format!("--listen-peer-urls={peer_url}"))
        .arg(format!("--initial-advertise-peer-urls={peer_url}"))
        .arg(format!("--initial-cluster=default={peer_url}"))
        // A test store: durability across power loss is not a goal, speed is.
        .arg("--unsafe-no-fsync")
        .arg("--quota-backend-bytes=8589934592")
        .arg("--log-level=warn");
    cmd
}

/// kube-apiserver on `address:port` over etcd at `etcd_url`, with the certs of [`write_pki`] in
/// `pki_dir`: Node + RBAC authorization and ValidatingAdmissionPolicy on, as in a cluster.
fn apiserver_command(
    bin: &Path,
    pki_dir: &Path,
    etcd_url: &str,
    (address, port): (IpAddr, u16),
) -> Command {
    let p = |n: &str| pki_dir.join(n).display().to_string();
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--etcd-servers={etcd_url}"))
        .arg(format!("--cert-dir={}", pki_dir.display()))
        .arg(format!("--tls-cert-file={}", p("serving.crt")))
        .arg(format!("--tls-private-key-file={}", p("serving.key")))
        .arg(format!("--client-ca-file={}", p("ca.crt")))
        .arg(format!("--secure-port={port}"))
        .arg(format!("--bind-address={address}"))
        .arg(format!("--advertise-address={address}"))
        .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
        .arg(format!("--kubelet-client-certificate={}", p("admin.crt")))
        .arg(format!("--kubelet-client-key={}", p("admin.key")))
        .arg("--kubelet-preferred-address-types=InternalIP")
        .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
        .arg(format!("--service-account-key-file={}", p("sa.pub")))
        .arg(format!(
            "--service-account-signing-key-file={}",
            p("sa.key")
        ))
        // The front proxy: how kube-apiserver tells an aggregated API (the reveal API) who is
        // asking; the aggregated server finds these in kube-system/extension-apiserver-authentication.
        .arg(format!(
            "--requestheader-client-ca-file={}",
            p("front-proxy-ca.crt")
        ))
        .arg(format!(
            "--requestheader-allowed-names={FRONT_PROXY_CLIENT}"
        ))
        .arg("--requestheader-username-headers=X-Remote-User")
        .arg("--requestheader-group-headers=X-Remote-Group")
        .arg("--requestheader-extra-headers-prefix=X-Remote-Extra-")
        .arg(format!(
            "--proxy-client-cert-file={}",
            p("front-proxy-client.crt")
        ))
        .arg(format!(
            "--proxy-client-key-file={}",
            p("front-proxy-client.key")
        ))
        .arg("--authorization-mode=Node,RBAC")
        .arg("--enable-admission-plugins=ValidatingAdmissionPolicy")
        .arg("--allow-privileged=true")
        .arg("--max-requests-inflight=1000")
        .arg("--max-mutating-requests-inflight=500")
        .arg("--v=0");
    cmd
}

impl ControlPlane {
    /// Builds (if needed) and starts etcd and kube-apiserver on loopback, and waits until
    /// `/readyz` is ok.
    pub fn start() -> Result<Self> {
        Self::start_at(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// Like [`ControlPlane::start`], with kube-apiserver listening on (and advertising)
    /// `address`, which must be a local address: a real node's pods reach it there through the
    /// `kubernetes` Service.
    pub fn start_at(address: IpAddr) -> Result<Self> {
        Self::start_with(address, &[])
    }

    /// Like [`ControlPlane::start`], with `extra_args` added to kube-apiserver's flags (e.g.
    /// `--feature-gates=WatchList=false`, to act as an apiserver without a feature).
    pub fn start_with_apiserver_args(extra_args: &[&str]) -> Result<Self> {
        Self::start_with(IpAddr::V4(Ipv4Addr::LOCALHOST), extra_args)
    }

    /// Like [`ControlPlane::start`], with the apiserver's audit log on (request and response
    /// bodies, [`AUDIT_POLICY`]) at [`ControlPlane::audit_log`].
    pub fn start_audited() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("dlq-testenv-{}-audit", std::process::id()));
        io("creating the audit dir", fs::create_dir_all(&dir))?;
        let policy = dir.join("policy.yaml");
        write(&policy, AUDIT_POLICY)?;
        let log = dir.join("audit.log");
        let args = [
            format!("--audit-policy-file={}", policy.display()),
            format!("--audit-log-path={}", log.display()),
            "--audit-log-mode=blocking".to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start_with(IpAddr::V4(Ipv4Addr::LOCALHOST), &args)
    }

    /// The audit log, when started with [`ControlPlane::start_audited`].
    pub fn audit_log(&self) -> Option<PathBuf> {
        self.extra_args
            .iter()
            .find_map(|a| a.strip_prefix("--audit-log-path="))
            .map(PathBuf::from)
    }

    /// Ports are picked free, then bound by etcd and kube-apiserver a moment later; another
    /// process (a test in the other lane) can take one in between. That start is retried on
    /// fresh ports, twice at most.
    fn start_with(address: IpAddr, extra_args: &[&str]) -> Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once(address, extra_args) {
                Err(e) if attempt < 3 && e.to_string().contains("address already in use") => {
                    eprintln!(
                        "control plane: a port was taken before it was bound; retrying ({e})"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn start_once(address: IpAddr, extra_args: &[&str]) -> Result<Self> {
        let extra_args: Vec<String> = extra_args.iter().map(ToString::to_string).collect();
        let bin_dirs = tool_dirs(PLANE_TOOLS)?;
        let etcd_bin = find_binary(&bin_dirs, "etcd")?;
        let apiserver_bin = find_binary(&bin_dirs, "kube-apiserver")?;

        let dir = state_dir();
        let pki = pki(address)?;
        write_pki(&dir.join("pki"), &pki)?;

        let (client_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let etcd_log = dir.join("etcd.log");
        let etcd = spawn_guarded(
            &mut etcd_command(&etcd_bin, &dir.join("etcd"), &etcd_url, peer_port),
            &etcd_log,
        )?;
        let api_log = dir.join("kube-apiserver.log");
        let apiserver = spawn_guarded(
            apiserver_command(
                &apiserver_bin,
                &dir.join("pki"),
                &etcd_url,
                (address, api_port),
            )
            .args(&extra_args),
            &api_log,
        )?;
        let server = format!("https://{}", std::net::SocketAddr::new(address, api_port));
        let kubeconfig = dir.join("kubeconfig");
        write(
            &kubeconfig,
            &kubeconfig_yaml(&server, &pki.ca_pem, &pki.admin),
        )?;
        write_node_kubeconfigs(&dir.join("pki"), &server, &pki)?;

        let mut plane = ControlPlane {
            dir,
            etcd,
            apiserver,
            kubeconfig,
            server,
            bin_dirs,
            ports: (etcd_url, peer_port, api_port),
            address,
            extra_args,
            quota_controller: None,
        };
        // etcd exiting early (port race, bad flag) shows up here rather than as an apiserver hang.
        std::thread::sleep(Duration::from_millis(200));
        if let Ok(Some(status)) = plane.etcd.try_wait() {
            let err = TestenvError::Setup(format!(
                "etcd exited at start ({status}):\n{}",
                tail(&etcd_log, 20)
            ));
            plane.stop();
            return Err(err);
        }
        if let Err(e) = plane.wait_ready(&api_log) {
            // etcd may lose its port race later than the check above: the apiserver then
            // dials whatever holds the port and gives up on its storage. Say why, so that
            // `start_with` retries on fresh ports.
            let err = match plane.etcd.try_wait() {
                Ok(Some(status)) => TestenvError::Setup(format!(
                    "etcd exited at start ({status}):\n{}\n{e}",
                    tail(&etcd_log, 20)
                )),
                _ => e,
            };
            plane.stop();
            return Err(err);
        }
        Ok(plane)
    }

    fn wait_ready(&mut self, api_log: &Path) -> Result<()> {
        let secs = 120;
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.apiserver.try_wait() {
                return Err(TestenvError::Setup(format!(
                    "kube-apiserver exited at start ({status}):\n{}",
                    tail(api_log, 30)
                )));
            }
            if answers_readyz(&self.kubeconfig) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(TestenvError::NotReady {
            what: "kube-apiserver",
            secs,
            log: api_log.display().to_string(),
            tail: tail(api_log, 30),
        })
    }

    /// SIGKILLs kube-apiserver and starts it again on the same port over the same etcd (the
    /// chaos harness's apiserver restart), then waits for `/readyz`.
    pub fn restart_apiserver(&mut self) -> Result<()> {
        self.stop_apiserver();
        self.start_apiserver()
    }

    /// SIGKILLs kube-apiserver and leaves it down (an outage; [`Self::start_apiserver`] ends it).
    pub fn stop_apiserver(&mut self) {
        let _ = self.apiserver.kill();
        let _ = self.apiserver.wait();
    }

    /// Starts kube-apiserver again on the same port over the same etcd, then waits for `/readyz`.
    pub fn start_apiserver(&mut self) -> Result<()> {
        let bin = find_binary(&self.bin_dirs, "kube-apiserver")?;
        let log = self.dir.join("kube-apiserver.log");
        let (etcd_url, _, api_port) = self.ports.clone();
        self.apiserver = spawn_guarded(
            apiserver_command(
                &bin,
                &self.dir.join("pki"),
                &etcd_url,
                (self.address, api_port),
            )
            .args(&self.extra_args),
            &log,
        )?;
        self.wait_ready(&log)
    }

    /// SIGKILLs etcd and starts it again on the same ports with the same data dir (data kept;
    /// the apiserver reconnects by itself), then waits for the apiserver's `/readyz`.
    pub fn restart_etcd(&mut self) -> Result<()> {
        self.stop_etcd();
        self.start_etcd()
    }

    /// Stops etcd (the apiserver stays up, and holds or fails what needs storage).
    pub fn stop_etcd(&mut self) {
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
    }

    /// Starts etcd again on its data and port, and waits for the apiserver to be ready.
    pub fn start_etcd(&mut self) -> Result<()> {
        let bin = find_binary(&self.bin_dirs, "etcd")?;
        let (etcd_url, peer_port, _) = self.ports.clone();
        self.etcd = spawn_guarded(
            &mut etcd_command(&bin, &self.dir.join("etcd"), &etcd_url, peer_port),
            &self.dir.join("etcd.log"),
        )?;
        let log = self.dir.join("kube-apiserver.log");
        self.wait_ready(&log)
    }

    /// None while etcd and kube-apiserver both run; else which one exited, with the end of its
    /// log (a chaos fault must never leave the plane down).
    pub fn exited(&mut self) -> Option<String> {
        for (child, what, log) in [
            (&mut self.etcd, "etcd", "etcd.log"),
            (&mut self.apiserver, "kube-apiserver", "kube-apiserver.log"),
        ] {
            if let Ok(Some(status)) = child.try_wait() {
                let tail = tail(&self.dir.join(log), 30);
                return Some(format!("{what} exited ({status}):\n{tail}"));
            }
        }
        None
    }

    /// The kube-apiserver's process id (to measure its memory).
    /// etcd's client URL (`http://127.0.0.1:<port>`; its `/metrics` tells the database size).
    pub fn etcd_url(&self) -> &str {
        &self.ports.0
    }

    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.id()
    }

    /// etcd's process id (to measure the CPU a bench phase cost it).
    pub fn etcd_pid(&self) -> u32 {
        self.etcd.id()
    }

    /// The temp dir holding the data, certs and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kubectl command bound to this plane's admin kubeconfig; kubectl is built on first use
    /// when the plane's tools did not include it.
    pub fn kubectl(&self) -> Result<Command> {
        let bin = match find_binary(&self.bin_dirs, "kubectl") {
            Ok(bin) => bin,
            Err(_) => find_binary(&tool_dirs(&["kube:kubectl"])?, "kubectl")?,
        };
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()));
        Ok(cmd)
    }

    /// Copies the admin kubeconfig to `path` (for humans and scripts).
    pub fn export_kubeconfig(&self, path: &Path) -> Result<()> {
        if let Some(parent) = path.parent() {
            io("creating kubeconfig dir", fs::create_dir_all(parent))?;
        }
        let mut f = io(
            format!("creating {}", path.display()),
            fs::File::create(path),
        )?;
        let text = io("reading kubeconfig", fs::read_to_string(&self.kubeconfig))?;
        io("writing kubeconfig", f.write_all(text.as_bytes()))
    }

    /// Starts kube-controller-manager with only its `resourcequota` controller, as the admin, on
    /// loopback: what fills a ResourceQuota's `status.hard` and `status.used` and gives back
    /// what deleted objects used, as in every real cluster. Without it the apiserver's quota
    /// admission refuses every create a quota covers ("status unknown for quota") and never
    /// sees room again after deletes. No other controller runs (no ServiceAccount tokens, no
    /// garbage collector), so nothing else about the plane changes.
    pub fn start_quota_controller(&mut self) -> Result<()> {
        if self.quota_controller.is_some() {
            return Ok(());
        }
        let bin = match find_binary(&self.bin_dirs, "kube-controller-manager") {
            Ok(bin) => bin,
            Err(_) => find_binary(
                &tool_dirs(&["kube:kube-controller-manager"])?,
                "kube-controller-manager",
            )?,
        };
        let certs = self.dir.join("kcm");
        io("creating the kcm dir", fs::create_dir_all(&certs))?;
        let kubeconfig = self.kubeconfig.display().to_string();
        let log = self.dir.join("kube-controller-manager.log");
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--kubeconfig={kubeconfig}"))
            .arg(format!("--authentication-kubeconfig={kubeconfig}"))
            .arg(format!("--authorization-kubeconfig={kubeconfig}"))
            .arg("--controllers=resourcequota")
            // A deleted record's room is given back by the controller's watch at once; the
            // full recount is only the backstop.
            .arg("--resource-quota-sync-period=30s")
            .arg(format!("--cert-dir={}", certs.display()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()?))
            .arg("--leader-elect=false")
            .arg("--v=0");
        let mut child = spawn_guarded(&mut cmd, &log)?;
        std::thread::sleep(Duration::from_millis(500));
        if let Ok(Some(status)) = child.try_wait() {
            return Err(TestenvError::Setup(format!(
                "kube-controller-manager exited at start ({status}):\n{}",
                tail(&log, 30)
            )));
        }
        self.quota_controller = Some(child);
        Ok(())
    }

    /// Stops the apiserver, then etcd, and removes the temp dir.
    pub fn stop(&mut self) {
        if let Some(mut kcm) = self.quota_controller.take() {
            terminate(&mut kcm, Duration::from_secs(5));
        }
        terminate(&mut self.apiserver, Duration::from_secs(5));
        terminate(&mut self.etcd, Duration::from_secs(5));
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}
