//! `redrive` and `drop`: per job, or a replay over a selection (`--queue ...`). A dry run lists what the
//! selection takes; a real replay is a `DeadLetterReplay` that the operator carries out (pace,
//! stop conditions, withdrawal, the decision record), which this command creates and follows.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, FailureKind, LABEL_QUEUE};
use dlq_core::duration::parse_duration;
use dlq_core::groups::DeadLetterGroup;
use dlq_core::replay::{
    self, Canary, DeadLetterReplay, DeadLetterReplaySpec, DeadLetterReplayStatus, ReplayPhase,
    ReplaySelector, StopWhen,
};

use crate::decision::{Sign, decide_jobs, signer};
use crate::inspect::{records, row, table};
use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct RedriveArgs {
    /// Job ids or record names. Without them, --queue selects records (the runbook).
    pub jobs: Vec<String>,
    #[command(flatten)]
    pub sign: Sign,
    #[command(flatten)]
    pub select: Selector,
    #[command(flatten)]
    pub pace: Pace,
}

#[derive(Args, Debug)]
pub struct DropArgs {
    /// Job ids or record names. Without them, --queue or --group selects records (a replay
    /// that drops).
    pub jobs: Vec<String>,
    #[command(flatten)]
    pub sign: Sign,
    #[command(flatten)]
    pub select: Selector,
    #[command(flatten)]
    pub pace: Pace,
}

/// Which parked records a replay takes.
#[derive(Args, Debug, Clone, Default)]
pub struct Selector {
    /// Replay parked records of this DeadLetterQueue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only Transient or Invalid records.
    #[arg(long)]
    pub failure_kind: Option<String>,
    /// Only records whose reason contains this text.
    #[arg(long)]
    pub reason_contains: Option<String>,
    /// Only records that failed at or after T (RFC 3339, or a duration ago such as 2h).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<Timestamp>,
    /// Only records that failed before T (RFC 3339, or a duration ago such as 30m).
    #[arg(long, value_parser = parse_time)]
    pub until: Option<Timestamp>,
    /// Only records parked by this consumer version.
    #[arg(long)]
    pub service_version: Option<String>,
    /// Only records of this failure group (its fingerprint, `kubectl dlq groups`); the queue
    /// is the group's unless --queue says.
    #[arg(long, value_parser = parse_group)]
    pub group: Option<String>,
}

/// `--group`: a fingerprint, ten hex digits.
fn parse_group(s: &str) -> Result<String, String> {
    let g = s.trim().to_ascii_lowercase();
    if dlq_core::group::is_fingerprint(&g) {
        Ok(g)
    } else {
        Err(format!(
            "{s:?} is not a failure group (ten hex digits, as kubectl dlq groups shows)"
        ))
    }
}

/// How fast a replay goes and when it stops by itself.
#[derive(Args, Debug, Clone)]
pub struct Pace {
    /// Decisions per second, e.g. 20/s (default 10/s); for --group, jobs per second (its
    /// records' jobs go first, their decisions follow).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Decide at most this many records.
    #[arg(long)]
    pub max: Option<usize>,
    /// List what would be redriven; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Stop when more than this share of recent requeues failed.
    #[arg(long, default_value_t = 0.2)]
    pub max_failure_ratio: f64,
    /// Recent settled redrives the failure ratio is computed over (and the least it needs).
    #[arg(long, default_value_t = 20)]
    pub window: usize,
    /// Stop when more than this many records were newly parked on the queue during the run.
    #[arg(long, default_value_t = 10)]
    pub max_new_parked: usize,
    /// After the last decision, how long to wait for outcomes, in seconds.
    #[arg(long, default_value_t = 60)]
    pub settle_timeout: u64,
    /// Keep deciding the group's records as they park, and pass its dead messages straight
    /// from the broker to the target without a record each, until the broker holds none of
    /// them (a storm: one command). Needs --group. Without --rate, messages and the records'
    /// jobs go at the broker's speed, the records' decisions after them.
    #[arg(long)]
    pub standing: bool,
    /// Decide this many records first (1-100, spread across the selection) and watch them for
    /// --observe; go on only if none came back or failed to enqueue. A standing replay passes
    /// nothing through until its canary passed.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub canary: Option<u8>,
    /// How long to watch the canary once carried out, e.g. 2m (default 2m).
    #[arg(long, requires = "canary", value_parser = parse_observe)]
    pub observe: Option<std::time::Duration>,
}

/// `--observe`: a duration such as 90s or 2m, at most an hour.
fn parse_observe(s: &str) -> Result<std::time::Duration, String> {
    match parse_duration(s) {
        Some(d) if d <= std::time::Duration::from_secs(3600) => Ok(d),
        Some(_) => Err(format!("{s:?} is longer than an hour")),
        None => Err(format!("{s:?} is not a duration such as 2m")),
    }
}

/// `--rate`: `20/s` or a bare `20`; must be positive.
pub use dlq_core::replay::parse_rate;

/// `--since`/`--until`: an RFC 3339 time, or a Go duration meaning that long ago.
pub fn parse_time(s: &str) -> Result<Timestamp, String> {
    if let Ok(t) = s.parse::<Timestamp>() {
        return Ok(t);
    }
    parse_duration(s)
        .and_then(|d| jiff::SignedDuration::try_from(d).ok())
        .and_then(|d| Timestamp::now().checked_sub(d).ok())
        .ok_or_else(|| format!("{s:?} is neither an RFC 3339 time nor a duration such as 2h"))
}

impl Selector {
    /// The selector as a replay's spec holds it; a failure kind other than Transient or
    /// Invalid is an error, never a silently wider selection.
    pub fn core(&self) -> Result<ReplaySelector, String> {
        let failure_kind =
            match &self.failure_kind {
                Some(k) => Some(FailureKind::from_label(k).ok_or_else(|| {
                    format!("failure kind {k:?} is neither Transient nor Invalid")
                })?),
                None => None,
            };
        Ok(ReplaySelector {
            failure_kind,
            reason_contains: self.reason_contains.clone(),
            since: self.since.map(Time),
            until: self.until.map(Time),
            service_version: self.service_version.clone(),
            names: Vec::new(),
            group: self.group.clone(),
        })
    }

    /// Whether a record's immutable facts match, whatever its phase (the page's filters).
    pub fn matches_facts(&self, r: &DeadLetter) -> bool {
        self.matches_queue(r) && self.core().is_ok_and(|s| s.matches_facts(r))
    }

    fn matches_queue(&self, r: &DeadLetter) -> bool {
        self.queue.as_ref().is_none_or(|q| &r.spec.queue == q)
    }

    /// The selector in words, for the summary and the decision record.
    pub fn describe(&self) -> String {
        let queue = self.queue.as_deref().unwrap_or_default();
        match self.core() {
            Ok(s) => s.describe(queue),
            Err(e) => e,
        }
    }
}

/// `drop JOB...`, or a replay that drops a selection; named apart from `std::mem::drop`.
pub async fn drop_jobs(g: &Global, args: DropArgs) -> Result<(), CliError> {
    decide(
        g,
        &args.jobs,
        &args.sign,
        &args.select,
        &args.pace,
        Action::Drop,
    )
    .await
}

/// `redrive JOB...` signs those jobs; `redrive --queue Q ...` or `--group G` runs a replay.
pub async fn redrive(g: &Global, args: RedriveArgs) -> Result<(), CliError> {
    decide(
        g,
        &args.jobs,
        &args.sign,
        &args.select,
        &args.pace,
        Action::Redrive,
    )
    .await
}

/// Signs `jobs`, or runs a replay of `action` over a selection (`--queue`, `--group`).
pub async fn decide(
    g: &Global,
    jobs: &[String],
    sign: &Sign,
    select: &Selector,
    pace: &Pace,
    action: Action,
) -> Result<(), CliError> {
    let verb = match action {
        Action::Redrive => "redrive",
        Action::Drop => "drop",
    };
    let selects = select.queue.is_some() || select.group.is_some();
    match (jobs.is_empty(), selects) {
        (false, false) => decide_jobs(g, jobs, action, sign).await,
        (false, true) => Err(CliError::Usage(
            "give either JOB... or --queue/--group (a replay), not both".into(),
        )),
        (true, false) => Err(CliError::Usage(format!(
            "name the jobs to {verb}, or select a replay with --queue Q or --group G"
        ))),
        (true, true) => replay(g, sign, select, pace, action).await,
    }
}

/// The queue of failure group `group` in `ns`: its DeadLetterGroup's, else one of its records'.
async fn queue_of_group(client: &Client, ns: &str, group: &str) -> Result<String, CliError> {
    let lp = ListParams::default()
        .labels(&format!("{}={group}", dlq_core::group::LABEL_GROUP))
        .limit(1);
    let groups: Api<DeadLetterGroup> = Api::namespaced(client.clone(), ns);
    let from_group = groups.list(&lp).await?.items.into_iter().next();
    if let Some(queue) = from_group.and_then(|g| g.labels().get(LABEL_QUEUE).cloned()) {
        return Ok(queue);
    }
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    match records.list(&lp).await?.items.into_iter().next() {
        Some(r) => Ok(r.spec.queue),
        None => Err(CliError::Usage(format!(
            "no failure group {group} in namespace {ns} (kubectl dlq groups lists them)"
        ))),
    }
}

/// The progress bar on stderr: redrawn in place on a terminal; elsewhere (a CI log) a line per
/// tenth of the selection, so the log stays short.
struct Progress {
    tty: bool,
    printed: i64,
    control: Control,
}

impl Progress {
    fn new(control: Control) -> Self {
        Progress {
            tty: control.terminal && std::io::stderr().is_terminal(),
            printed: 0,
            control,
        }
    }

    fn show(&mut self, status: &DeadLetterReplayStatus) {
        let (done, total) = (status.decided, status.selected);
        let line = replay::progress_line(status);
        self.control.set_status(status);
        if !self.control.terminal {
            return;
        }
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r{line}");
            let _ = err.flush();
        } else if (done == total && self.printed != total)
            || done >= self.printed + (total / 10).max(1)
        {
            let _ = writeln!(err, "{line}");
            self.printed = done;
        }
    }

    /// Ends the redrawn line, so what follows starts on a line of its own.
    fn finish(&self) {
        if self.tty && self.control.terminal {
            eprintln!();
        }
    }
}

/// How someone other than the terminal follows and stops a replay (the page's Stop button):
/// the latest progress line, and a stop request (the replay's `spec.stop`), after which the
/// operator withdraws what was not carried out yet, as the stop conditions do.
#[derive(Clone, Default)]
pub struct Control {
    stop: Arc<AtomicBool>,
    status: Arc<Mutex<Option<DeadLetterReplayStatus>>>,
    /// Print progress to stderr (the CLI), or only keep the status (the page).
    terminal: bool,
}

impl Control {
    /// The CLI's: progress on stderr, never stopped from outside.
    pub fn terminal() -> Self {
        Control {
            terminal: true,
            ..Control::default()
        }
    }

    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// The latest progress as the replay reported it (None before its first report).
    pub fn status(&self) -> Option<DeadLetterReplayStatus> {
        self.status.lock().ok().and_then(|s| s.clone())
    }

    fn set_status(&self, status: &DeadLetterReplayStatus) {
        if let Ok(mut s) = self.status.lock() {
            *s = Some(status.clone());
        }
    }
}

/// What a replay decides, as the CLI flags or the page's form give it.
pub struct ReplayPlan {
    pub select: Selector,
    pub pace: Pace,
    pub rate: f64,
    pub by: String,
    pub note: String,
    /// Redrive, or drop (`drop --group`).
    pub action: Action,
}

impl ReplayPlan {
    /// The DeadLetterReplay for this plan on `queue`; `names` (the page's reviewed selection)
    /// pins it to exactly those records.
    fn spec(&self, queue: &str, names: Vec<String>) -> Result<DeadLetterReplaySpec, CliError> {
        let mut selector = self.select.core().map_err(CliError::Usage)?;
        selector.names = names;
        let count = |n: usize| i64::try_from(n).ok();
        Ok(DeadLetterReplaySpec {
            queue: queue.to_string(),
            selector: Some(selector),
            action: Some(self.action),
            // A standing replay without --rate passes messages at the broker's speed.
            rate: (!self.pace.standing || self.pace.rate.is_some())
                .then(|| format!("{}/s", self.rate)),
            max: self.pace.max.and_then(count),
            stop_when: Some(StopWhen {
                failure_ratio: Some(self.pace.max_failure_ratio),
                window: i32::try_from(self.pace.window).ok(),
                new_parked: count(self.pace.max_new_parked),
            }),
            dry_run: None,
            by: self.by.clone(),
            note: Some(self.note.clone()),
            settle_seconds: i64::try_from(self.pace.settle_timeout).ok(),
            stop: None,
            paused: None,
            standing: self.pace.standing.then_some(true),
            canary: self.pace.canary.map(|count| Canary {
                count: i64::from(count),
                observe_seconds: self
                    .pace
                    .observe
                    .and_then(|d| i64::try_from(d.as_secs()).ok()),
            }),
            approvals: Vec::new(),
        })
    }
}

/// A dry run lists the selection here; a replay is created for the operator and followed.
async fn replay(
    g: &Global,
    sign: &Sign,
    select: &Selector,
    pace: &Pace,
    action: Action,
) -> Result<(), CliError> {
    check_standing(select, pace, action)?;
    let (client, ns) = connect(g).await?;
    let mut select = select.clone();
    if let (None, Some(group)) = (&select.queue, &select.group) {
        select.queue = Some(queue_of_group(&client, &ns, group).await?);
    }
    let select = &select;
    let queue = select.queue.clone().unwrap_or_default();
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let Some(dlq) = queues.get_opt(&queue).await? else {
        return Err(CliError::Usage(format!(
            "no DeadLetterQueue {queue} in namespace {ns}"
        )));
    };
    if pace.dry_run {
        let selected = select_records(&client, &ns, &queue, select, pace.max).await?;
        dry_run_report(&selected, select);
        return Ok(());
    }
    let by = signer(&client, sign).await?;
    let note = sign
        .note
        .clone()
        .unwrap_or_else(|| format!("replay {}", select.describe()));
    let plan = ReplayPlan {
        select: select.clone(),
        pace: pace.clone(),
        rate: pace.rate.unwrap_or(replay::DEFAULT_RATE),
        by,
        note,
        action,
    };
    let api: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let created = create(&api, &dlq, plan.spec(&queue, Vec::new())?).await?;
    let name = created.name_any();
    eprintln!(
        "replay {name} created; the operator carries it out (kubectl get dlr -n {ns} {name})"
    );
    let end = tokio::select! {
        end = follow(&api, &name, Control::terminal()) => end?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\n{}", left_running(&ns, &name));
            return Ok(());
        }
    };
    println!("{}", end.summary);
    if end.stopped {
        return Err(CliError::Refused(String::new()));
    }
    Ok(())
}

/// `--standing` covers one failure group, decides for real, and a standing drop is said aloud.
fn check_standing(select: &Selector, pace: &Pace, action: Action) -> Result<(), CliError> {
    if !pace.standing {
        return Ok(());
    }
    if select.group.is_none() {
        return Err(CliError::Usage(
            "--standing covers one failure group: give --group G (kubectl dlq groups lists them)"
                .into(),
        ));
    }
    if pace.dry_run {
        return Err(CliError::Usage(
            "--standing cannot be a dry run: run --dry-run without --standing to see the records"
                .into(),
        ));
    }
    if action == Action::Drop {
        eprintln!(
            "WARNING: a standing drop DISCARDS every dead message of this group that arrives while it runs, without a record (stop it with spec.stop: true)"
        );
    }
    Ok(())
}

/// What Ctrl-C says: the replay goes on without this terminal, and how to stop it.
fn left_running(ns: &str, name: &str) -> String {
    format!(
        "replay {name} goes on in the operator. Follow it: kubectl get dlr -n {ns} {name} -w\nStop it (decisions not carried out are withdrawn): kubectl patch dlr -n {ns} {name} --type merge -p '{{\"spec\":{{\"stop\":true}}}}'"
    )
}

/// Creates the replay, named after its queue and the time.
async fn create(
    api: &Api<DeadLetterReplay>,
    dlq: &DeadLetterQueue,
    spec: DeadLetterReplaySpec,
) -> Result<DeadLetterReplay, CliError> {
    let mut replay = DeadLetterReplay::new("", spec);
    let queue: String = dlq.name_any().chars().take(40).collect();
    replay.metadata.name = None;
    replay.metadata.generate_name = Some(format!(
        "{queue}-{}-",
        Timestamp::now().strftime("%Y%m%d-%H%M%S")
    ));
    Ok(api.create(&PostParams::default(), &replay).await?)
}

/// How a replay ended.
pub struct ReplayEnd {
    pub stopped: bool,
    /// The summary line (also the decision record's note).
    pub summary: String,
    /// Nothing to warn about since the operator writes the decision record; kept for the page.
    pub warning: Option<String>,
}

/// Follows a replay's status until it ends; a stop request from `control` sets `spec.stop`.
async fn follow(
    api: &Api<DeadLetterReplay>,
    name: &str,
    control: Control,
) -> Result<ReplayEnd, CliError> {
    let mut progress = Progress::new(control.clone());
    let mut stop_sent = false;
    loop {
        let r = api.get(name).await?;
        let status = r.status.clone().unwrap_or_default();
        progress.show(&status);
        if r.phase().is_final() {
            progress.finish();
            return Ok(ReplayEnd {
                stopped: status.stop_reason.is_some(),
                summary: status.summary.unwrap_or_default(),
                warning: None,
            });
        }
        if r.phase() == ReplayPhase::AwaitingApproval {
            // Someone else must approve it: following it here would wait for a person.
            progress.finish();
            return Err(CliError::Refused(awaiting(&r)));
        }
        if control.stop_requested() && !stop_sent {
            let stop = Patch::Merge(json!({"spec": {"stop": true}}));
            api.patch(name, &PatchParams::default(), &stop).await?;
            stop_sent = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the command says of a replay its queue holds for approvals: why, and who does what.
fn awaiting(r: &DeadLetterReplay) -> String {
    let name = r.name_any();
    let ns = r.namespace().unwrap_or_default();
    let why = r
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.message.clone())
        .unwrap_or_else(|| "awaiting approval".into());
    format!(
        "replay {name} was created and waits ({why}): it runs once someone else approves it with `kubectl dlq approve -n {ns} {name} --note ...`; follow it: kubectl get dlr -n {ns} {name} -w"
    )
}

/// The page's replay: a DeadLetterReplay pinned to the reviewed records, created and followed.
pub async fn run_replay(
    client: &Client,
    ns: &str,
    dlq: &DeadLetterQueue,
    selected: &[DeadLetter],
    plan: &ReplayPlan,
    control: Control,
) -> Result<ReplayEnd, CliError> {
    let api: Api<DeadLetterReplay> = Api::namespaced(client.clone(), ns);
    // More names than a replay holds: the filter and the count (max) pin it instead.
    let names: Vec<String> = if selected.len() <= replay::MAX_NAMES {
        selected.iter().map(|r| r.name_any()).collect()
    } else {
        Vec::new()
    };
    let mut spec = plan.spec(&dlq.name_any(), names)?;
    spec.max = i64::try_from(selected.len()).ok();
    let created = create(&api, dlq, spec).await?;
    follow(&api, &created.name_any(), control).await
}

/// The parked records of `queue` the selector takes, oldest failure first, at most `max`
/// (the operator's selection rule, from `dlq_core::replay`).
pub async fn select_records(
    client: &Client,
    ns: &str,
    queue: &str,
    select: &Selector,
    max: Option<usize>,
) -> Result<Vec<DeadLetter>, CliError> {
    let core = select.core().map_err(CliError::Usage)?;
    let all = records(client, ns, false, Some(queue), None).await?;
    Ok(replay::select(&all, queue, &core, None, max)
        .into_iter()
        .cloned()
        .collect())
}

/// What a dry run shows: the records that would be redriven, as `ls` rows, and how many.
fn dry_run_report(selected: &[DeadLetter], select: &Selector) {
    let rows: Vec<Vec<String>> = selected.iter().map(|r| row(r, false)).collect();
    print!("{}", table(&rows));
    println!(
        "dry run: {} records would be redriven ({}); nothing changed",
        selected.len(),
        select.describe()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_a_duration_ago() {
        assert!(parse_time("2026-11-29T10:00:00Z").is_ok());
        let two_h = parse_time("2h").unwrap();
        let diff = Timestamp::now().duration_since(two_h).as_secs();
        assert!((7190..=7210).contains(&diff));
        assert!(parse_time("yesterday").is_err());
    }

    #[test]
    fn the_cli_selector_becomes_the_replays() {
        let s = Selector {
            queue: Some("relayer".into()),
            failure_kind: Some("transient".into()),
            reason_contains: Some("timeout".into()),
            ..Selector::default()
        };
        let core = s.core().unwrap();
        assert_eq!(core.failure_kind, Some(FailureKind::Transient));
        assert_eq!(
            s.describe(),
            "queue=relayer,failureKind=Transient,reasonContains=\"timeout\""
        );
        let bad = Selector {
            failure_kind: Some("flaky".into()),
            ..Selector::default()
        };
        assert!(bad.core().is_err());
        let by_group = Selector {
            queue: Some("relayer".into()),
            group: parse_group("3F9A1C07D2").ok(),
            ..Selector::default()
        };
        assert_eq!(
            by_group.core().unwrap().group.as_deref(),
            Some("3f9a1c07d2")
        );
        assert_eq!(by_group.describe(), "queue=relayer,group=3f9a1c07d2");
        assert!(parse_group("overflow").is_err() && parse_group("3f9a").is_err());
    }

    /// Issue 47: `--standing` needs a group and is never a dry run; without --rate its
    /// messages pass at the broker's speed (records at the default rate), with one both do.
    #[test]
    fn a_standing_replay_covers_one_group_at_the_brokers_speed_unless_paced() {
        let pace = Pace {
            rate: None,
            max: None,
            dry_run: false,
            max_failure_ratio: 0.2,
            window: 20,
            max_new_parked: 10,
            settle_timeout: 60,
            standing: true,
            canary: None,
            observe: None,
        };
        let group = Selector {
            group: parse_group("3f9a1c07d2").ok(),
            ..Selector::default()
        };
        assert!(check_standing(&Selector::default(), &pace, Action::Redrive).is_err());
        let dry = Pace {
            dry_run: true,
            ..pace.clone()
        };
        assert!(check_standing(&group, &dry, Action::Redrive).is_err());
        assert!(check_standing(&group, &pace, Action::Redrive).is_ok());
        let plan = |pace: &Pace| ReplayPlan {
            select: group.clone(),
            pace: pace.clone(),
            rate: pace.rate.unwrap_or(replay::DEFAULT_RATE),
            by: "carol".into(),
            note: "INC-1".into(),
            action: Action::Redrive,
        };
        let spec = plan(&pace).spec("relayer", Vec::new()).unwrap();
        assert_eq!((spec.standing, spec.rate.as_deref()), (Some(true), None));
        assert_eq!(spec.pass_rate(), None);
        let paced = Pace {
            rate: Some(500.0),
            ..pace.clone()
        };
        let spec = plan(&paced).spec("relayer", Vec::new()).unwrap();
        assert_eq!(spec.pass_rate(), Some(500.0));
        let plain = Pace {
            standing: false,
            ..pace
        };
        let spec = plan(&plain).spec("relayer", Vec::new()).unwrap();
        assert_eq!((spec.standing, spec.rate.as_deref()), (None, Some("10/s")));
        let canary = Pace {
            canary: Some(5),
            observe: Some(std::time::Duration::from_secs(120)),
            ..plain
        };
        let spec = plan(&canary).spec("relayer", Vec::new()).unwrap();
        let want = Canary {
            count: 5,
            observe_seconds: Some(120),
        };
        assert_eq!(spec.canary, Some(want));
        assert!(parse_observe("2h").is_err(), "at most an hour");
    }

    #[test]
    fn ctrl_c_says_how_to_stop() {
        let s = left_running("payments", "relayer-1");
        assert!(s.contains("kubectl patch dlr -n payments relayer-1 --type merge"));
    }
}
