//! `BENCH_PROFILE=1`: what a phase cost each process (CPU time) and the apiserver (requests by
//! verb and resource), per record, printed beside the table so that an operator run can be
//! compared with its ceiling request by request: where a ratio is lost, not only how much.

use std::collections::BTreeMap;

use dlq_testenv::plane::ControlPlane;

pub fn enabled() -> bool {
    std::env::var_os("BENCH_PROFILE").is_some()
}

/// Other processes whose CPU each sample reads (the bench's Redis).
static ALSO: std::sync::Mutex<Vec<(&'static str, u32)>> = std::sync::Mutex::new(Vec::new());

/// Adds a process to every sample from now on.
pub fn also(who: &'static str, pid: u32) {
    ALSO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((who, pid));
}

/// Counters at one moment.
pub struct Sample {
    cpu: Vec<(&'static str, f64)>,
    requests: BTreeMap<String, f64>,
    /// Open watches of dlq.dev resources ([`watches`]).
    watches: String,
}

/// CPU seconds (user + system) a process has used; 0 once it is gone.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces) start at the state, field 3;
    // utime and stime are fields 14 and 15, in clock ticks of 1/100 s on Linux.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The apiserver's `/metrics` now (empty when it cannot be read).
fn metrics(plane: &ControlPlane) -> String {
    plane
        .kubectl()
        .ok()
        .and_then(|mut k| k.args(["get", "--raw", "/metrics"]).output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
}

/// The value of label `key` in a Prometheus line's `{...}` part.
fn label<'a>(labels: &'a str, key: &str) -> &'a str {
    labels
        .split_once(&format!("{key}=\""))
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("", |(v, _)| v)
}

/// The samples of metric `name` in `metrics`: (labels, value).
fn samples<'a>(metrics: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    metrics
        .lines()
        .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter_map(|line| line.rsplit_once(' '))
        .map(|(labels, value)| (labels, value.parse::<f64>().unwrap_or(0.0)))
}

/// The apiserver's open watches of dlq.dev resources (`apiserver_longrunning_requests`), as
/// "resource count": a watch left behind costs every later write its dispatch.
fn watches(metrics: &str) -> String {
    let mut by: BTreeMap<String, f64> = BTreeMap::new();
    for (labels, value) in samples(metrics, "apiserver_longrunning_requests") {
        if label(labels, "group") == "dlq.dev" && label(labels, "verb") == "WATCH" {
            *by.entry(label(labels, "resource").to_string())
                .or_insert(0.0) += value;
        }
    }
    by.iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `apiserver_request_total` summed over codes except 409, which is kept apart, keyed by
/// "VERB resource[/subresource]".
fn requests(metrics: &str) -> BTreeMap<String, f64> {
    let mut by = BTreeMap::new();
    for (labels, value) in samples(metrics, "apiserver_request_total") {
        let mut key = format!("{} {}", label(labels, "verb"), label(labels, "resource"));
        if !label(labels, "subresource").is_empty() {
            key = format!("{key}/{}", label(labels, "subresource"));
        }
        if label(labels, "code") == "409" {
            key.push_str(" (409)");
        }
        *by.entry(key).or_insert(0.0) += value;
    }
    by
}

impl Sample {
    pub fn take(plane: &ControlPlane, operator: Option<u32>) -> Option<Sample> {
        if !enabled() {
            return None;
        }
        let mut cpu = vec![
            ("apiserver", cpu_secs(plane.apiserver_pid())),
            ("etcd", cpu_secs(plane.etcd_pid())),
            ("bench", cpu_secs(std::process::id())),
        ];
        if let Some(pid) = operator {
            cpu.push(("operator", cpu_secs(pid)));
        }
        for (who, pid) in ALSO.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            cpu.push((who, cpu_secs(*pid)));
        }
        let metrics = metrics(plane);
        Some(Sample {
            cpu,
            requests: requests(&metrics),
            watches: watches(&metrics),
        })
    }

    /// Prints what happened since `self`, per record of `n`.
    pub fn report(&self, label: &str, plane: &ControlPlane, operator: Option<u32>, n: usize) {
        let Some(now) = Sample::take(plane, operator) else {
            return;
        };
        let n = n.max(1) as f64;
        let cpu: Vec<String> = now
            .cpu
            .iter()
            .map(|(who, secs)| {
                let before = self.cpu.iter().find(|(w, _)| w == who).map_or(0.0, |c| c.1);
                format!("{who} {:.2}", 1000.0 * (secs - before) / n)
            })
            .collect();
        let requests: Vec<String> = now
            .requests
            .iter()
            .filter_map(|(key, count)| {
                let made = count - self.requests.get(key).copied().unwrap_or(0.0);
                (made >= 1.0).then(|| format!("{key} {:.3} ({made})", made / n))
            })
            .collect();
        eprintln!(
            "profile {label}: CPU ms/record: {}; requests/record (all): {}; open watches: {}",
            cpu.join(", "),
            requests.join(", "),
            now.watches
        );
    }
}

/// `BENCH_PPROF=DIR`: a CPU profile of the apiserver (`/debug/pprof/profile`) taken during a
/// phase, from 0.5 s after it starts for `BENCH_PPROF_SECS` (default 3), written to
/// `DIR/<label>-<n>.pb.gz` for `go tool pprof` (e.g. `-top -diff_base` of two phases). The
/// handle ends when the profile is written; a phase shorter than the profile waits for it.
fn pprof(plane: &ControlPlane, label: &str) -> Option<std::thread::JoinHandle<()>> {
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::path::PathBuf::from(std::env::var_os("BENCH_PPROF")?);
    let secs = std::env::var("BENCH_PPROF_SECS").unwrap_or_else(|_| "3".into());
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("{label}-{seq}.pb.gz"));
    let mut kubectl = plane.kubectl().ok()?;
    kubectl.args([
        "get",
        "--raw",
        &format!("/debug/pprof/profile?seconds={secs}"),
    ]);
    Some(std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let written = std::fs::create_dir_all(&dir)
            .and_then(|()| kubectl.output())
            .and_then(|out| std::fs::write(&path, out.stdout));
        if let Err(e) = written {
            eprintln!("pprof {}: {e}", path.display());
        }
    }))
}

/// One timed run's profile: the counters at its start ([`Sample`], `BENCH_PROFILE`) and the
/// apiserver's CPU profile taken meanwhile ([`pprof`], `BENCH_PPROF`), both under one label.
pub struct Profiled {
    label: String,
    operator: Option<u32>,
    before: Option<Sample>,
    pprof: Option<std::thread::JoinHandle<()>>,
}

impl Profiled {
    /// Starts both, for a run labelled `label` (the pprof file takes it with `-` for
    /// punctuation) whose operator, if any, is `operator`.
    pub fn start(plane: &ControlPlane, label: &str, operator: Option<u32>) -> Profiled {
        let file: String = label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        Profiled {
            label: label.to_string(),
            operator,
            before: Sample::take(plane, operator),
            pprof: pprof(plane, &file),
        }
    }

    /// Prints the counters per record of `n` and waits for the CPU profile to be written.
    pub async fn end(self, plane: &ControlPlane, n: usize) {
        if let Some(before) = &self.before {
            before.report(&self.label, plane, self.operator, n);
        }
        if let Some(p) = self.pprof {
            let _ = tokio::task::spawn_blocking(move || p.join()).await;
        }
    }
}
