//! A real node beside the control plane: kube-controller-manager and kube-scheduler (Deployments
//! become pods), containerd + runc (Debian's), kubelet and kube-proxy (the same `k8s.io/kubernetes`
//! build as the apiserver), the CNI plugins bridge, host-local, loopback and portmap, and a
//! `pause` image made here.
//!
//! Networking stays on this machine, in the benchmark range 198.18.0.0/15: a bridge [`BRIDGE`]
//! holds [`NODE_ADDRESS`], the pods' gateway and the address kube-apiserver, kubelet and test
//! brokers listen on; pods get addresses of [`POD_CIDR`] in their own network namespaces, and
//! Services are ClusterIPs of [`crate::plane::SERVICE_CIDR`] that kube-proxy's iptables rules
//! turn into those addresses. Nothing is masqueraded and IP forwarding is left as it is: a pod
//! reaches the host (apiserver, brokers) directly, and the host reaches pods through Services.
//!
//! Needs root (network devices, mounts, cgroups). Everything lives under the control plane's
//! temp dir; [`Node::stop`] kills the pods, unmounts, removes iptables rules and the bridge.

use std::collections::BTreeSet;
use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::image::{self, Archive};
use crate::plane::{
    ControlPlane, NODE_NAME, TestenvError, find_binary, free_port, io, spawn_guarded, tail,
    terminate, tool_dirs, write,
};

type Result<T, E = TestenvError> = std::result::Result<T, E>;

/// The node's bridge: the pods' veths attach to it; it holds [`NODE_ADDRESS`].
pub const BRIDGE: &str = "dlq0";
/// The node's address: gateway of the pods, where kube-apiserver, kubelet and brokers listen.
pub const NODE_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The pods' addresses (host-local IPAM on the bridge).
pub const POD_CIDR: &str = "198.18.0.0/24";
/// The repository of the sandbox image; containerd's `sandbox_image` names it.
const PAUSE_REPOSITORY: &str = "dlq.local/pause";
/// Seconds the node gets to become Ready once the tools are built.
const READY_SECS: u64 = 90;

fn setup(msg: impl Into<String>) -> TestenvError {
    TestenvError::Setup(msg.into())
}

/// Runs a command to completion; its stderr in the error.
fn run(what: &str, cmd: &mut Command) -> Result<String> {
    let out = io(format!("running {what}"), cmd.output())?;
    if !out.status.success() {
        return Err(setup(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<String> {
    run(
        &format!("ip {}", args.join(" ")),
        Command::new("ip").args(args),
    )
}

/// The bridge with the node's address, made before kube-apiserver starts (it binds there).
/// Deleted on drop.
pub struct Network {
    created: bool,
    /// [`NODE_LOCK`], held while the bridge exists (released by the kernel if we die).
    _lock: fs::File,
}

/// One test node per machine at a time (one [`BRIDGE`]): test binaries with a node (chart_node,
/// release) in parallel lanes wait here for each other instead of failing on the bridge.
const NODE_LOCK: &str = "/run/dlq-testenv-node.lock";
/// How long a second node waits for the first one's lock.
const NODE_LOCK_WAIT: Duration = Duration::from_secs(900);

fn node_lock() -> Result<fs::File> {
    use std::os::fd::AsRawFd;
    let file = io(
        format!("opening {NODE_LOCK}"),
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(NODE_LOCK),
    )?;
    let deadline = Instant::now() + NODE_LOCK_WAIT;
    let mut said = false;
    loop {
        // SAFETY: flock on a descriptor we own; LOCK_NB never blocks.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        if Instant::now() > deadline {
            return Err(setup(format!(
                "another test node held {NODE_LOCK} for {}s",
                NODE_LOCK_WAIT.as_secs()
            )));
        }
        if !said {
            eprintln!("test node: waiting for another test node to stop ({NODE_LOCK})");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

impl Network {
    /// Creates [`BRIDGE`] with [`NODE_ADDRESS`]; refuses when it exists (another node runs, or a
    /// killed run left it: `ip link del dlq0`).
    pub fn create() -> Result<Network> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(setup(
                "a real node needs root (network devices, mounts, cgroups)",
            ));
        }
        let lock = node_lock()?;
        if ip(&["link", "show", BRIDGE]).is_ok() {
            return Err(setup(format!(
                "the bridge {BRIDGE} exists: another test node is running, or a killed one left \
                 it (then: ip link del {BRIDGE})"
            )));
        }
        ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        let net = Network {
            created: true,
            _lock: lock,
        };
        ip(&["addr", "add", &format!("{NODE_ADDRESS}/24"), "dev", BRIDGE])?;
        ip(&["link", "set", BRIDGE, "up"])?;
        Ok(net)
    }

    /// The address kube-apiserver should listen on.
    pub fn address(&self) -> IpAddr {
        IpAddr::V4(NODE_ADDRESS)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        if self.created {
            let _ = ip(&["link", "del", BRIDGE]);
        }
    }
}

/// How long the node took, for the report.
#[derive(Debug, Clone, Copy)]
pub struct NodeTimings {
    /// From starting the node's processes to the Node's condition Ready=True.
    pub ready: Duration,
}

/// A running node; stopped (pods killed, mounts and rules removed) on [`Node::stop`] or drop.
pub struct Node {
    dir: PathBuf,
    /// In start order; stopped in reverse.
    children: Vec<(&'static str, Child)>,
    socket: PathBuf,
    ctr: PathBuf,
    kube_proxy: PathBuf,
    /// Network namespaces present before the node started: the others are its pods'.
    netns_before: BTreeSet<String>,
    pub timings: NodeTimings,
    network: Option<Network>,
}

/// Paths the node's processes share.
struct Layout<'a> {
    dir: &'a Path,
    pki: PathBuf,
    admin: &'a Path,
    bins: Vec<PathBuf>,
}

impl Layout<'_> {
    fn bin(&self, name: &str) -> Result<PathBuf> {
        find_binary(&self.bins, name)
    }

    fn cert_dir(&self, component: &str) -> Result<PathBuf> {
        let d = self.dir.join(component);
        io(format!("creating {}", d.display()), fs::create_dir_all(&d))?;
        Ok(d)
    }
}

/// A program from Debian's packages (containerd, ctr, runc), or what to install.
fn debian_tool(name: &str, package: &str) -> Result<PathBuf> {
    crate::brokers::which(name).ok_or_else(|| {
        setup(format!(
            "{name} not found: run scripts/ensure-deps.sh (apt-get install {package})"
        ))
    })
}

/// A control-plane component as the admin, serving its own HTTPS on a free loopback port (certs
/// self-made in its dir), without leader election (there is one of it).
fn component(l: &Layout, bin: &str, dir: &str) -> Result<Command> {
    let mut cmd = Command::new(l.bin(bin)?);
    cmd.arg(format!("--kubeconfig={}", l.admin.display()))
        .arg(format!("--cert-dir={}", l.cert_dir(dir)?.display()))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", free_port()?))
        .arg("--leader-elect=false")
        .arg("--v=0");
    Ok(cmd)
}

fn controller_manager(l: &Layout) -> Result<Command> {
    let mut cmd = component(l, "kube-controller-manager", "kcm")?;
    // The kube-root-ca.crt ConfigMap of every namespace: projected ServiceAccount volumes.
    cmd.arg(format!("--root-ca-file={}", l.pki.join("ca.crt").display()))
        .arg(format!(
            "--service-account-private-key-file={}",
            l.pki.join("sa.key").display()
        ));
    Ok(cmd)
}

fn containerd_toml(dir: &Path, socket: &Path, cni_bin: &Path, pause: &str) -> String {
    let d = dir.join("containerd").display().to_string();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  level = "warn"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # Root here lacks CAP_SYS_RESOURCE (this VM): lowering oom_score_adj below ours fails in runc
  # ("failed to update /proc/self/oom_score_adj: Permission denied"), so clamp it instead.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Registry hosts (`<host:port>/hosts.toml`, read at each pull): see [`plain_http_registry`].
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
"#,
        socket = socket.display(),
        cni = cni_bin.display(),
        cni_conf = dir.join("cni").display(),
        hosts = registry_hosts_dir(socket).display(),
    )
}

/// containerd's registry hosts directory (`config_path`) of the node whose socket is `socket`.
fn registry_hosts_dir(socket: &Path) -> PathBuf {
    socket.with_file_name("certs.d")
}

/// Lets the node whose containerd listens on `socket` pull from the registry at `host_port`
/// (`127.0.0.1:5000`) over plain HTTP, as a loopback test registry serves: a `hosts.toml` for
/// that host only, which containerd reads at the next pull. Every other registry keeps HTTPS.
pub fn plain_http_registry(socket: &Path, host_port: &str) -> Result<()> {
    let dir = registry_hosts_dir(socket).join(host_port);
    io("creating the registry hosts dir", fs::create_dir_all(&dir))?;
    write(
        &dir.join("hosts.toml"),
        &format!(
            "server = \"http://{host_port}\"\n\n[host.\"http://{host_port}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        ),
    )
}

/// bridge + host-local on [`BRIDGE`], no masquerading (nothing leaves the machine), portmap for
/// hostPorts.
fn cni_conflist() -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "dlq",
        "plugins": [
            {
                "type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_ADDRESS.to_string()}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": "DATA_DIR"
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string()
}

fn kubelet_yaml(l: &Layout, socket: &Path, port: u16) -> Result<String> {
    Ok(format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_ADDRESS}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
containerRuntimeEndpoint: unix://{socket}
# This VM mounts cgroup v1, which kubelet 1.35+ refuses unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
podLogsDir: {logs}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
maxPods: 32
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
shutdownGracePeriod: 0s
"#,
        healthz = free_port()?,
        socket = socket.display(),
        logs = l.cert_dir("pod-logs")?.display(),
        ca = l.pki.join("ca.crt").display(),
    ))
}

fn kubelet(l: &Layout, socket: &Path) -> Result<Command> {
    let config = l.dir.join("kubelet.yaml");
    write(&config, &kubelet_yaml(l, socket, free_port()?)?)?;
    let mut cmd = Command::new(l.bin("kubelet")?);
    cmd.arg(format!("--config={}", config.display()))
        .arg(format!(
            "--kubeconfig={}",
            l.pki.join("kubelet.kubeconfig").display()
        ))
        .arg(format!("--root-dir={}", l.cert_dir("kubelet")?.display()))
        .arg(format!(
            "--cert-dir={}",
            l.cert_dir("kubelet-pki")?.display()
        ))
        .arg(format!("--hostname-override={NODE_NAME}"))
        .arg(format!("--node-ip={NODE_ADDRESS}"))
        .arg("--v=0");
    Ok(cmd)
}

fn kube_proxy(l: &Layout) -> Result<Command> {
    let config = l.dir.join("kube-proxy.yaml");
    write(
        &config,
        &format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {{kubeconfig: {kubeconfig}}}
hostnameOverride: {NODE_NAME}
clusterCIDR: {POD_CIDR}
healthzBindAddress: 127.0.0.1:{healthz}
metricsBindAddress: 127.0.0.1:{metrics}
nodePortAddresses: ["{NODE_ADDRESS}/32"]
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
iptables: {{minSyncPeriod: 0s, syncPeriod: 30s}}
"#,
            kubeconfig = l.pki.join("kube-proxy.kubeconfig").display(),
            healthz = free_port()?,
            metrics = free_port()?,
        ),
    )?;
    let mut cmd = Command::new(l.bin("kube-proxy")?);
    cmd.arg(format!("--config={}", config.display()))
        .arg("--v=0");
    Ok(cmd)
}

fn netns_names() -> BTreeSet<String> {
    fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Node {
    /// Starts the node's processes against `plane` (started at `network`'s address), loads the
    /// pause image and waits until the Node is Ready.
    pub fn start(plane: &ControlPlane, network: Network) -> Result<Node> {
        let started = Instant::now();
        let bins = tool_dirs(&["kube", "cni", "pause"])?;
        let dir = plane.dir().join("node");
        io("creating the node dir", fs::create_dir_all(&dir))?;
        let mut node = Node {
            socket: dir.join("containerd.sock"),
            ctr: debian_tool("ctr", "containerd")?,
            kube_proxy: find_binary(&bins, "kube-proxy")?,
            dir: dir.clone(),
            children: Vec::new(),
            netns_before: netns_names(),
            timings: NodeTimings {
                ready: Duration::ZERO,
            },
            network: Some(network),
        };
        debian_tool("runc", "runc")?;
        debian_tool("iptables", "iptables")?;
        let layout = Layout {
            dir: &dir,
            pki: plane.dir().join("pki"),
            admin: &plane.kubeconfig,
            bins,
        };
        node.spawn("kube-controller-manager", controller_manager(&layout)?)?;
        node.spawn(
            "kube-scheduler",
            component(&layout, "kube-scheduler", "scheduler")?,
        )?;
        node.start_containerd(&layout)?;
        node.spawn("kubelet", kubelet(&layout, &node.socket.clone())?)?;
        node.spawn("kube-proxy", kube_proxy(&layout)?)?;
        node.wait_ready(plane)?;
        node.timings.ready = started.elapsed();
        Ok(node)
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let child = spawn_guarded(&mut cmd, &log)?;
        self.children.push((name, child));
        Ok(())
    }

    /// containerd with the CNI config and the pause image in place.
    fn start_containerd(&mut self, l: &Layout) -> Result<()> {
        let pause = image::pause_image(
            &l.bin("pause")?,
            PAUSE_REPOSITORY,
            &self.dir.join("pause-build"),
            &self.dir.join("pause.tar"),
        )?;
        let cni_bin = l
            .bin("bridge")?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let cni_dir = l.cert_dir("cni")?;
        let conflist =
            cni_conflist().replace("DATA_DIR", &self.dir.join("cni-ipam").display().to_string());
        write(&cni_dir.join("10-dlq.conflist"), &conflist)?;
        let config = self.dir.join("containerd.toml");
        write(
            &config,
            &containerd_toml(&self.dir, &self.socket, &cni_bin, &pause.reference),
        )?;
        let mut cmd = Command::new(debian_tool("containerd", "containerd")?);
        cmd.arg("--config").arg(&config);
        self.spawn("containerd", cmd)?;
        self.wait_containerd()?;
        self.import(&pause)
    }

    fn wait_containerd(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = image::ctr(&self.ctr, &self.socket)
                .arg("version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            self.check_children()?;
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(self.not_ready("containerd", 30))
    }

    /// Imports an image archive into the node's containerd (see [`image::import`]).
    pub fn import(&self, archive: &Archive) -> Result<()> {
        image::import(&self.ctr, &self.socket, archive)
    }

    /// The containerd socket (`ctr --address`, `crictl --runtime-endpoint`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Fails with the log of a node process that exited.
    fn check_children(&mut self) -> Result<()> {
        for (name, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                let log = self.dir.join(format!("{name}.log"));
                return Err(setup(format!(
                    "{name} exited at start ({status}):\n{}",
                    tail(&log, 30)
                )));
            }
        }
        Ok(())
    }

    fn not_ready(&self, what: &'static str, secs: u64) -> TestenvError {
        let log = self.dir.join(format!("{what}.log"));
        TestenvError::NotReady {
            what,
            secs,
            log: log.display().to_string(),
            tail: tail(&log, 30),
        }
    }

    fn wait_ready(&mut self, plane: &ControlPlane) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(READY_SECS);
        let jsonpath = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;
        while Instant::now() < deadline {
            self.check_children()?;
            let out = plane
                .kubectl()?
                .args(["get", "node", NODE_NAME, "-o", jsonpath])
                .stderr(Stdio::null())
                .output();
            if out.is_ok_and(|o| o.stdout == b"True") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(self.not_ready("kubelet", READY_SECS))
    }

    /// Stops kubelet and kube-proxy, kills the pods' processes and shims, stops containerd,
    /// unmounts what they mounted, removes kube-proxy's iptables rules and the bridge.
    pub fn stop(&mut self) {
        let mut children = std::mem::take(&mut self.children);
        while let Some((name, mut child)) = children.pop() {
            if name == "containerd" {
                kill_pods(&self.socket);
            }
            terminate(&mut child, Duration::from_secs(5));
        }
        unmount_under(&self.dir);
        for ns in netns_names().difference(&self.netns_before) {
            if ns.starts_with("cni-") {
                let _ = ip(&["netns", "del", ns]);
            }
        }
        remove_pod_cgroups();
        self.remove_rules();
        self.network.take();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Node {
    /// kube-proxy's chains (`kube-proxy --cleanup`) and kubelet's canary chains.
    fn remove_rules(&self) {
        let _ = Command::new(&self.kube_proxy)
            .arg("--cleanup")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let kubelet_rules: [&[&str]; 7] = [
            &["-t", "mangle", "-X", "KUBE-KUBELET-CANARY"],
            &["-t", "nat", "-X", "KUBE-KUBELET-CANARY"],
            &["-t", "filter", "-X", "KUBE-KUBELET-CANARY"],
            &["-t", "mangle", "-X", "KUBE-IPTABLES-HINT"],
            &["-D", "INPUT", "-j", "KUBE-FIREWALL"],
            &["-D", "OUTPUT", "-j", "KUBE-FIREWALL"],
            &["-F", "KUBE-FIREWALL"],
        ];
        for tool in ["iptables", "ip6tables"] {
            for args in kubelet_rules
                .iter()
                .copied()
                .chain([&["-X", "KUBE-FIREWALL"][..]])
            {
                let _ = Command::new(tool)
                    .args(args)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// Pids of the processes of every pod: kubelet's `kubepods` cgroup (pids controller).
fn pod_pids() -> Vec<i32> {
    fn walk(dir: &Path, out: &mut Vec<i32>) {
        if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&entry.path(), out);
            }
        }
    }
    let mut pids = Vec::new();
    walk(Path::new("/sys/fs/cgroup/pids/kubepods"), &mut pids);
    pids
}

/// containerd-shim processes serving this node's containerd (their command line names its
/// socket).
fn shim_pids(socket: &Path) -> Vec<i32> {
    let needle = socket.display().to_string();
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains("containerd-shim") && c.contains(&needle)
            })
        })
        .collect()
}

/// SIGKILLs the pods' processes, then their shims.
fn kill_pods(socket: &Path) {
    for pid in pod_pids().into_iter().chain(shim_pids(socket)) {
        // SAFETY: a signal to a process of this node (its pods, its shims).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// Lazily unmounts every mount at or below `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let prefix = dir.display().to_string();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<&str> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        if let Ok(c) = std::ffi::CString::new(p) {
            // SAFETY: a valid C string; MNT_DETACH never blocks.
            unsafe {
                libc::umount2(c.as_ptr(), libc::MNT_DETACH);
            }
        }
    }
}

/// Removes the (now empty) `kubepods` cgroups kubelet made, deepest first, in every hierarchy.
fn remove_pod_cgroups() {
    fn dirs(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs(&entry.path(), out);
            }
        }
        out.push(dir.to_path_buf());
    }
    for hierarchy in fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let root = hierarchy.path().join("kubepods");
        let mut all = Vec::new();
        if root.is_dir() {
            dirs(&root, &mut all);
        }
        for d in all {
            let _ = fs::remove_dir(d);
        }
    }
}
