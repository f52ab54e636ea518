//! The operator under test: a `deadletter-operator run` process against the shared plane.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::cluster::plane;
use crate::harness::report;

/// A `deadletter-operator run` process watching one namespace (without leader election unless
/// the arguments ask for it). Killed on drop; its log is kept when the test fails.
pub struct Operator {
    child: Option<Child>,
    /// Where /metrics, /healthz and /readyz answer.
    pub metrics_port: u16,
    /// Its stdout and stderr.
    pub log: PathBuf,
    /// Its identity (POD_NAME, the Lease holder when it leads).
    pub name: String,
}

impl Operator {
    /// Starts one watching `ns` and waits until it is ready.
    pub fn start(ns: &str) -> Operator {
        Self::start_with(ns, &[], &[])
    }

    /// Starts one with extra arguments and environment (which win over the defaults).
    pub fn start_with(ns: &str, args: &[&str], env: &[(&str, &str)]) -> Operator {
        Self::start_on(&plane().kubeconfig, ns, args, env)
    }

    /// Like [`Operator::start_with`], against the control plane of `kubeconfig` (the chaos
    /// harness owns a plane it restarts, not the shared one).
    pub fn start_on(
        kubeconfig: &std::path::Path,
        ns: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Operator {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let metrics_port = crate::plane::free_port().expect("a free port for the metrics server");
        let log =
            std::env::temp_dir().join(format!("dlq-operator-{}-{ns}-{n}.log", std::process::id()));
        // DLQ_OPERATOR_BIN runs another build (the chaos harness's before/after comparison).
        let bin = std::env::var_os("DLQ_OPERATOR_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::paths::bin("deadletter-operator"));
        let mut cmd = Command::new(bin);
        cmd.arg("run");
        if !args.iter().any(|a| a.starts_with("--leader-election")) {
            cmd.arg("--leader-election=false");
        }
        cmd.arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
            .arg(format!("--watch-namespaces={ns}"))
            .arg("--backoff-cap-seconds=2")
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", format!("op-{n}"))
            .env("RUST_LOG", "info,kube=warn,lapin=error")
            // ElasticMQ does not end a long poll when its redrive policy moves a message in:
            // at SQS's 20 s each such message waited out the poll (20 s of a test, each time).
            .env("DLQ_SQS_LONG_POLL_SECONDS", "2");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = crate::plane::spawn_guarded(&mut cmd, &log).expect("starting the operator");
        let op = Operator {
            child: Some(child),
            metrics_port,
            log,
            name: format!("op-{n}"),
        };
        op.wait_ready();
        op
    }

    fn wait_ready(&self) {
        for _ in 0..200 {
            if self
                .http_get("/readyz")
                .is_some_and(|b| b.starts_with("ok"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("operator not ready; log:\n{}", self.logs());
    }

    /// Everything it logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `secs` until the operator logged that it reached failpoint `name` (it hangs
    /// or holds there, see `DLQ_FAILPOINT`).
    pub async fn reached_failpoint(&self, name: &str, secs: u64) {
        self.reached_failpoint_times(name, 1, secs).await;
    }

    /// Waits until the operator has reached failpoint `name` `times` times in all.
    pub async fn reached_failpoint_times(&self, name: &str, times: usize, secs: u64) {
        let reached = format!("failpoint {name} reached");
        let what = format!("the operator to reach failpoint {name} {times} times");
        crate::harness::eventually(secs, &what, || async {
            (self.logs().matches(&reached).count() >= times).then_some(())
        })
        .await;
    }

    /// GET a path on the metrics port; None when not answering.
    pub fn http_get(&self, path: &str) -> Option<String> {
        http_get(("127.0.0.1", self.metrics_port), path)
    }

    /// The value of one metric, e.g. `dlq_redrives_total`: the sum of every series whose
    /// labels contain all of `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric(&self.http_get("/metrics").unwrap_or_default(), name, labels)
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`) to the process, if it has not been reaped: once
    /// reaped, its pid may already belong to another process (another test's broker).
    pub fn signal(&mut self, signal: i32) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: a signal to our own child, not reaped (a zombie at worst keeps its pid).
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }

    /// Whether the process is still running (false once it exited by itself).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL: no chance to finish anything.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Graceful stop (SIGTERM), as Kubernetes does.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        crate::plane::terminate(&mut c, Duration::from_secs(10));
        c.wait().ok()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            report(&format!("operator log kept at {}", self.log.display()));
        }
    }
}

/// GET `path` over plain HTTP/1.0 at `addr`; the body, or None when nothing answers.
pub fn http_get(addr: impl std::net::ToSocketAddrs, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// The value of metric `name` in a Prometheus text `body`: the sum of every series whose
/// labels contain all of `labels`.
pub fn metric(body: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            let (series, _) = l.rsplit_once(' ').unwrap_or((l, ""));
            series.split(['{', '}']).next() == Some(name)
                && labels
                    .iter()
                    .all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}
