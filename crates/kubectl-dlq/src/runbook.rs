//! `redrive`: per job, or the replay runbook over a selection (`--queue ...`): dry run,
//! rate-limited decisions, stop conditions, a summary, and a decision record (an Event on the
//! DeadLetterQueue).

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use dlq_client::events::to_recorder_event;
use dlq_core::api::{Action, DeadLetter, DeadLetterQueue, LABEL_QUEUE, Phase};
use dlq_core::duration::parse_duration;
use dlq_core::events::{EventPlan, action, reason};

use crate::cli::{CliError, Global, connect};
use crate::decision::{Sign, decide_jobs, signer};
use crate::inspect::{records, row, table};

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
}

/// How fast a replay goes and when it stops by itself.
#[derive(Args, Debug, Clone)]
pub struct Pace {
    /// Decisions per second, e.g. 20/s.
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
}

/// `--rate`: `20/s` or a bare `20`; must be positive, since it sets the ticker period.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.trim().trim_end_matches("/s");
    match n.parse::<f64>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!("{s:?} is not a rate such as 20/s")),
    }
}

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
    /// Whether a record is one the replay takes. Pure.
    pub fn matches(&self, r: &DeadLetter) -> bool {
        r.phase() == Phase::Parked && r.spec.action.is_none() && self.matches_facts(r)
    }

    /// Whether a record's immutable facts match, whatever its phase (the page's filters).
    pub fn matches_facts(&self, r: &DeadLetter) -> bool {
        let s = &r.spec;
        self.queue.as_ref().is_none_or(|q| &s.queue == q)
            && self
                .failure_kind
                .as_ref()
                .is_none_or(|k| s.failure_kind.label().eq_ignore_ascii_case(k))
            && self
                .reason_contains
                .as_ref()
                .is_none_or(|t| s.reason.contains(t.as_str()))
            && self.since.is_none_or(|t| s.failed_at.0 >= t)
            && self.until.is_none_or(|t| s.failed_at.0 < t)
            && self
                .service_version
                .as_ref()
                .is_none_or(|v| s.service_version.as_ref() == Some(v))
    }

    /// The selector in words, for the summary and the decision record.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(q) = &self.queue {
            parts.push(format!("queue={q}"));
        }
        if let Some(k) = &self.failure_kind {
            parts.push(format!("failureKind={k}"));
        }
        if let Some(t) = &self.reason_contains {
            parts.push(format!("reasonContains={t:?}"));
        }
        if let Some(t) = &self.since {
            parts.push(format!("since={t}"));
        }
        if let Some(t) = &self.until {
            parts.push(format!("until={t}"));
        }
        if let Some(v) = &self.service_version {
            parts.push(format!("serviceVersion={v}"));
        }
        parts.join(",")
    }
}

/// `redrive JOB...` signs those jobs; `redrive --queue Q ...` runs the replay runbook.
pub async fn redrive(g: &Global, args: RedriveArgs) -> Result<(), CliError> {
    match (args.jobs.is_empty(), &args.select.queue) {
        (false, None) => decide_jobs(g, &args.jobs, Action::Redrive, &args.sign).await,
        (false, Some(_)) => Err(CliError::Usage(
            "give either JOB... or --queue (a replay), not both".into(),
        )),
        (true, None) => Err(CliError::Usage(
            "name the jobs to redrive, or select a replay with --queue Q".into(),
        )),
        (true, Some(_)) => replay(g, &args).await,
    }
}

/// The outcome of one decided record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pending,
    Redriven,
    Failing,
}

/// Where a decided record stands, from its phase and a current `Requeued=False` condition.
fn outcome_of(r: &DeadLetter) -> Outcome {
    match r.phase() {
        Phase::Redriven => Outcome::Redriven,
        // Dropped by someone else meanwhile: settled, not a requeue failure.
        Phase::Dropped => Outcome::Redriven,
        Phase::Parked => {
            let failing = r.status.iter().flat_map(|s| &s.conditions).any(|c| {
                c.type_ == "Requeued"
                    && c.status == "False"
                    && c.observed_generation >= r.metadata.generation
            });
            if failing {
                Outcome::Failing
            } else {
                Outcome::Pending
            }
        }
    }
}

/// Failure share among the last `window` settled decisions (None until `window` settled).
pub fn failure_ratio(in_decision_order: &[Outcome], window: usize) -> Option<f64> {
    let settled: Vec<Outcome> = in_decision_order
        .iter()
        .rev()
        .filter(|o| **o != Outcome::Pending)
        .take(window.max(1))
        .copied()
        .collect();
    if settled.len() < window.max(1) {
        return None;
    }
    let failed = settled.iter().filter(|o| **o == Outcome::Failing).count();
    Some(failed as f64 / settled.len() as f64)
}

/// What a replay has done so far, as last observed.
#[derive(Default)]
struct Run {
    /// Names of the signed records, in the order they were signed.
    decided: Vec<String>,
    outcomes: HashMap<String, Outcome>,
    /// Records parked on the queue since the run started.
    new_parked: usize,
    /// Selected records that no longer matched (or were refused) when their turn came.
    skipped: usize,
}

impl Run {
    /// Outcomes in decision order (Pending until observed), for the failure-ratio window.
    fn ordered(&self) -> Vec<Outcome> {
        self.decided
            .iter()
            .map(|n| self.outcomes.get(n).copied().unwrap_or(Outcome::Pending))
            .collect()
    }

    fn count(&self, o: Outcome) -> usize {
        self.ordered().iter().filter(|x| **x == o).count()
    }

    /// Why the run must stop, if it must.
    fn stop_reason(&self, pace: &Pace) -> Option<String> {
        if let Some(ratio) = failure_ratio(&self.ordered(), pace.window)
            && ratio > pace.max_failure_ratio
        {
            return Some(format!(
                "requeue failure ratio {:.0}% over the last {} settled redrives exceeds {:.0}%",
                ratio * 100.0,
                pace.window,
                pace.max_failure_ratio * 100.0
            ));
        }
        if self.new_parked > pace.max_new_parked {
            return Some(format!(
                "{} new records parked on the queue during the run (bound {})",
                self.new_parked, pace.max_new_parked
            ));
        }
        None
    }
}

/// Lists the queue once and folds it into the run.
async fn observe(
    api: &Api<DeadLetter>,
    queue: &str,
    started: Timestamp,
    run: &mut Run,
) -> Result<(), CliError> {
    let items = list_queue(api, queue).await?;
    run.apply(&items, started);
    Ok(())
}

/// Every record of the queue (all phases: new parkings count, whatever their phase).
async fn list_queue(api: &Api<DeadLetter>, queue: &str) -> Result<Vec<DeadLetter>, CliError> {
    Ok(api
        .list(&ListParams::default().labels(&format!("{LABEL_QUEUE}={queue}")))
        .await?
        .items)
}

impl Run {
    /// Updates outcomes and the new-parkings count from a listing of the queue's records.
    fn apply(&mut self, items: &[DeadLetter], started: Timestamp) {
        let by_name: BTreeMap<String, &DeadLetter> =
            items.iter().map(|r| (r.name_any(), r)).collect();
        for name in &self.decided {
            if let Some(r) = by_name.get(name) {
                self.outcomes.insert(name.clone(), outcome_of(r));
            }
        }
        self.new_parked = items
            .iter()
            .filter(|r| {
                r.metadata
                    .creation_timestamp
                    .as_ref()
                    .is_some_and(|t| t.0 > started)
            })
            .count();
    }
}

/// One decision task's answer: the record, when it was issued, and whether it was signed.
type Signed = (String, Instant, Result<bool, CliError>);

/// A decision task that panicked or was cancelled fails the run: its outcome is unknown.
fn joined(r: Result<Signed, tokio::task::JoinError>) -> Result<Signed, CliError> {
    r.map_err(|e| CliError::Api(format!("a decision task failed: {e}")))
}

/// Records the answer to one issued decision.
fn settle_decision(
    (name, issued, signed): Signed,
    run: &mut Run,
    issued_at: &mut Vec<Instant>,
) -> Result<(), CliError> {
    if signed? {
        run.decided.push(name);
        issued_at.push(issued);
    } else {
        run.skipped += 1;
    }
    Ok(())
}

/// Takes back a decision that was not carried out, guarded by resourceVersion (the operator
/// may be writing a condition at the same moment). False when the record is no longer Parked.
async fn withdraw(api: &Api<DeadLetter>, name: &str) -> Result<bool, CliError> {
    for _ in 0..10 {
        let Some(r) = api.get_opt(name).await? else {
            return Ok(false);
        };
        if r.phase() != Phase::Parked {
            return Ok(false);
        }
        let patch = json!({
            "metadata": {"resourceVersion": r.resource_version()},
            "spec": {"action": null, "by": null, "note": null},
        });
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

/// Signs one selected record, guarded by its resourceVersion. A record that changed since the
/// selection (the operator wrote its status, say) is read again and signed if it still matches;
/// false when it no longer does.
async fn sign_record(
    api: &Api<DeadLetter>,
    record: &DeadLetter,
    select: &Selector,
    by: &str,
    note: &str,
) -> Result<bool, CliError> {
    let mut rv = record.resource_version();
    for _ in 0..5 {
        let patch = json!({
            "metadata": {"resourceVersion": rv},
            "spec": {"action": Action::Redrive, "by": by, "note": note},
        });
        match api
            .patch(
                &record.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let Some(fresh) = api.get_opt(&record.name_any()).await? else {
                    return Ok(false);
                };
                if !select.matches(&fresh) {
                    return Ok(false);
                }
                rv = fresh.resource_version();
            }
            // Refused by the apiserver (resolved meanwhile, or policy): leave it be.
            Err(kube::Error::Api(s)) if s.code == 422 => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

/// The progress bar on stderr: redrawn in place on a terminal; elsewhere (a CI log) a line per
/// tenth of the selection, so the log stays short.
struct Progress {
    total: usize,
    tty: bool,
    printed: usize,
    control: Control,
}

impl Progress {
    fn new(total: usize, control: Control) -> Self {
        Progress {
            total,
            tty: control.terminal && std::io::stderr().is_terminal(),
            printed: 0,
            control,
        }
    }

    fn show(&mut self, run: &Run) {
        let (done, total) = (run.decided.len(), self.total);
        let line = format!(
            "[{}{}] {done}/{total} decided, {} redriven, {} failing, {} new parked",
            "#".repeat(done * 30 / total.max(1)),
            ".".repeat(30 - done * 30 / total.max(1)),
            run.count(Outcome::Redriven),
            run.count(Outcome::Failing),
            run.new_parked
        );
        self.control.set_line(&line);
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

/// What every step of one replay shares.
struct Replay<'a> {
    api: Api<DeadLetter>,
    queue: String,
    select: &'a Selector,
    pace: &'a Pace,
    by: String,
    note: String,
    /// Records created after this were parked during the run (a stop condition).
    started: Timestamp,
    control: Control,
}

/// How someone other than the terminal follows and stops a replay (the page's Stop button):
/// the latest progress line, and a stop request that ends deciding and withdraws what was not
/// carried out yet, as the stop conditions do.
#[derive(Clone, Default)]
pub struct Control {
    stop: Arc<AtomicBool>,
    line: Arc<Mutex<String>>,
    /// Print progress to stderr (the CLI), or only keep the line (the page).
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

    /// The latest progress line.
    pub fn line(&self) -> String {
        self.line.lock().map(|l| l.clone()).unwrap_or_default()
    }

    fn set_line(&self, line: &str) {
        if let Ok(mut l) = self.line.lock() {
            *l = line.to_string();
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
}

/// How the paced decisions went.
struct Paced {
    /// Why deciding stopped early, if it did.
    stop: Option<String>,
    secs: f64,
    /// Decisions per second actually achieved.
    rate: f64,
}

/// How the replay ended, after the outcomes settled and undone decisions were withdrawn.
struct Ending {
    stop: Option<String>,
    /// Failing as the run ended, before withdrawing took those decisions back.
    failing: usize,
    withdrawn: usize,
}

/// The replay runbook: select, dry-run report or paced decisions, wait for outcomes, withdraw
/// on a stop, then a summary line and a decision record on the queue.
async fn replay(g: &Global, args: &RedriveArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let (select, pace) = (&args.select, &args.pace);
    let queue = select.queue.clone().unwrap_or_default();
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let Some(dlq) = queues.get_opt(&queue).await? else {
        return Err(CliError::Usage(format!(
            "no DeadLetterQueue {queue} in namespace {ns}"
        )));
    };
    let selected = select_records(&client, &ns, &queue, select, pace.max).await?;
    if pace.dry_run {
        dry_run_report(&selected, select);
        return Ok(());
    }
    let Some(rate) = pace.rate else {
        return Err(CliError::Usage(
            "a replay needs --rate N/s (or --dry-run)".into(),
        ));
    };
    let by = signer(&client, &args.sign).await?;
    let note = args
        .sign
        .note
        .clone()
        .unwrap_or_else(|| format!("replay {}", select.describe()));
    let plan = ReplayPlan {
        select: select.clone(),
        pace: pace.clone(),
        rate,
        by,
        note,
    };
    let end = run_replay(&client, &ns, &dlq, &selected, &plan, Control::terminal()).await?;
    println!("{}", end.summary);
    if let Some(w) = &end.warning {
        eprintln!("warning: {w}");
    }
    if end.stopped {
        return Err(CliError::Refused(String::new()));
    }
    Ok(())
}

/// How a replay ended.
pub struct ReplayEnd {
    pub stopped: bool,
    /// The summary line (also the decision record's note).
    pub summary: String,
    /// Why the decision record could not be written, if it could not.
    pub warning: Option<String>,
}

/// Paced decisions on `selected`, outcomes awaited, undone decisions withdrawn on a stop, and
/// the decision record on the queue.
pub async fn run_replay(
    client: &Client,
    ns: &str,
    dlq: &DeadLetterQueue,
    selected: &[DeadLetter],
    plan: &ReplayPlan,
    control: Control,
) -> Result<ReplayEnd, CliError> {
    let ctx = Replay {
        api: Api::namespaced(client.clone(), ns),
        queue: dlq.name_any(),
        select: &plan.select,
        pace: &plan.pace,
        by: plan.by.clone(),
        note: plan.note.clone(),
        started: Timestamp::now(),
        control: control.clone(),
    };
    let mut run = Run::default();
    let mut progress = Progress::new(selected.len(), control);
    let paced = decide_paced(&ctx, selected, plan.rate, &mut run, &mut progress).await?;
    let stop = match &paced.stop {
        Some(why) => Some(why.clone()),
        None => await_outcomes(&ctx, &mut run, &mut progress).await?,
    };
    progress.finish();
    let failing = run.count(Outcome::Failing);
    let withdrawn = match stop {
        Some(_) => withdraw_undone(&ctx, &mut run).await?,
        None => 0,
    };
    let ending = Ending {
        stop,
        failing,
        withdrawn,
    };
    let summary = summary(&ctx, &run, selected.len(), &paced, &ending);
    let warning = record_replay(client, &ctx.by, dlq, ending.stop.is_some(), &summary).await;
    Ok(ReplayEnd {
        stopped: ending.stop.is_some(),
        summary,
        warning,
    })
}

/// The parked records of `queue` the selector takes, oldest failure first, at most `max`.
pub async fn select_records(
    client: &Client,
    ns: &str,
    queue: &str,
    select: &Selector,
    max: Option<usize>,
) -> Result<Vec<DeadLetter>, CliError> {
    let mut selected: Vec<DeadLetter> = records(client, ns, false, Some(queue), None)
        .await?
        .into_iter()
        .filter(|r| select.matches(r))
        .collect();
    selected.sort_by_key(|r| (r.spec.failed_at.0, r.name_any()));
    if let Some(max) = max {
        selected.truncate(max);
    }
    Ok(selected)
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

/// Decides the selection at `rate`, checking the stop conditions whenever a fresh listing of
/// the queue arrives.
async fn decide_paced(
    ctx: &Replay<'_>,
    selected: &[DeadLetter],
    rate: f64,
    run: &mut Run,
    progress: &mut Progress,
) -> Result<Paced, CliError> {
    // Decisions are issued on the ticker and run concurrently, so a slow apiserver answer does
    // not slow the pace; at most MAX_IN_FLIGHT wait for an answer at once.
    const MAX_IN_FLIGHT: usize = 256;
    let clock = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Burst: a slow observation is caught up, so the average rate is the one asked for.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (lister, mut snapshots) = spawn_lister(&ctx.api, &ctx.queue);
    let mut stop = None;
    let mut in_flight = JoinSet::new();
    let mut issued_at: Vec<Instant> = Vec::new();
    for record in selected {
        ticker.tick().await;
        if ctx.control.stop_requested() {
            stop = Some(format!("stopped by {}", ctx.by));
            break;
        }
        while let Some(done) = in_flight.try_join_next() {
            settle_decision(joined(done)?, run, &mut issued_at)?;
        }
        if snapshots.has_changed().unwrap_or(false) {
            let items = snapshots.borrow_and_update().clone();
            run.apply(&items, ctx.started);
            if let Some(why) = run.stop_reason(ctx.pace) {
                stop = Some(why);
                break;
            }
        }
        while in_flight.len() >= MAX_IN_FLIGHT {
            if let Some(done) = in_flight.join_next().await {
                settle_decision(joined(done)?, run, &mut issued_at)?;
            }
        }
        issue(&mut in_flight, ctx, record);
        progress.show(run);
    }
    while let Some(done) = in_flight.join_next().await {
        settle_decision(joined(done)?, run, &mut issued_at)?;
    }
    lister.abort();
    Ok(Paced {
        stop,
        secs: clock.elapsed().as_secs_f64(),
        rate: achieved_rate(&mut issued_at),
    })
}

/// Lists the queue's records in the background every half second, so the pace never waits for
/// a slow listing; the receiver holds the latest listing.
fn spawn_lister(
    api: &Api<DeadLetter>,
    queue: &str,
) -> (JoinHandle<()>, watch::Receiver<Vec<DeadLetter>>) {
    let (snapshot_tx, snapshots) = watch::channel(Vec::<DeadLetter>::new());
    let (api, queue) = (api.clone(), queue.to_string());
    let lister = tokio::spawn(async move {
        loop {
            if let Ok(items) = list_queue(&api, &queue).await
                && snapshot_tx.send(items).is_err()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    (lister, snapshots)
}

/// Signs one record in a task of its own, stamped with when it was issued.
fn issue(in_flight: &mut JoinSet<Signed>, ctx: &Replay<'_>, record: &DeadLetter) {
    let issued = Instant::now();
    let (api, record, select, by, note) = (
        ctx.api.clone(),
        record.clone(),
        ctx.select.clone(),
        ctx.by.clone(),
        ctx.note.clone(),
    );
    in_flight.spawn(async move {
        let signed = sign_record(&api, &record, &select, &by, &note).await;
        (record.name_any(), issued, signed)
    });
}

/// The achieved pace: signed decisions after the first, over the time they were issued in.
fn achieved_rate(issued_at: &mut [Instant]) -> f64 {
    issued_at.sort();
    match (issued_at.first(), issued_at.last()) {
        (Some(first), Some(last)) if issued_at.len() > 1 => {
            (issued_at.len() - 1) as f64 / last.duration_since(*first).as_secs_f64().max(0.001)
        }
        _ => 0.0,
    }
}

/// Lets the decided records settle, still watching the stop conditions. The reason to stop,
/// if one comes up before every outcome is in or `--settle-timeout` passes.
async fn await_outcomes(
    ctx: &Replay<'_>,
    run: &mut Run,
    progress: &mut Progress,
) -> Result<Option<String>, CliError> {
    let settle_by = Instant::now() + Duration::from_secs(ctx.pace.settle_timeout);
    while Instant::now() < settle_by {
        observe(&ctx.api, &ctx.queue, ctx.started, run).await?;
        progress.show(run);
        if ctx.control.stop_requested() {
            return Ok(Some(format!("stopped by {}", ctx.by)));
        }
        if let Some(why) = run.stop_reason(ctx.pace) {
            return Ok(Some(why));
        }
        if run.count(Outcome::Pending) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(None)
}

/// Stopped: takes back the decisions that have not been carried out, so those records stay
/// Parked instead of being redriven when the broker returns. How many were taken back.
async fn withdraw_undone(ctx: &Replay<'_>, run: &mut Run) -> Result<usize, CliError> {
    observe(&ctx.api, &ctx.queue, ctx.started, run).await?;
    let mut withdrawn = 0;
    for name in &run.decided {
        if run.outcomes.get(name).copied().unwrap_or(Outcome::Pending) == Outcome::Redriven {
            continue;
        }
        if withdraw(&ctx.api, name).await? {
            withdrawn += 1;
        }
    }
    observe(&ctx.api, &ctx.queue, ctx.started, run).await?;
    Ok(withdrawn)
}

/// The run in one line: printed, and the note of the decision record.
fn summary(ctx: &Replay<'_>, run: &Run, selected: usize, paced: &Paced, end: &Ending) -> String {
    let ending = match &end.stop {
        Some(why) => format!("stopped: {why}"),
        None if run.count(Outcome::Pending) > 0 => {
            "finished deciding; some redrives still pending".to_string()
        }
        None => "completed".to_string(),
    };
    format!(
        "replay {} by {}: selected {selected}, decided {}, redriven {}, failing {}, withdrawn {}, skipped {}, new parkings {}; {} decisions in {:.1}s ({:.1}/s); {ending}",
        ctx.select.describe(),
        ctx.by,
        run.decided.len(),
        run.count(Outcome::Redriven),
        end.failing,
        end.withdrawn,
        run.skipped,
        run.new_parked,
        run.decided.len(),
        paced.secs,
        paced.rate,
    )
}

/// The decision record: an Event on the queue, for the incident log and for alerts. Failing to
/// write it is only a warning (returned); the replay itself happened.
async fn record_replay(
    client: &Client,
    by: &str,
    dlq: &DeadLetterQueue,
    stopped: bool,
    summary: &str,
) -> Option<String> {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "kubectl-dlq".into(),
            instance: Some(by.to_string()),
        },
    );
    let plan = if stopped {
        EventPlan::warning(reason::REPLAY_STOPPED, action::REPLAY, summary)
    } else {
        EventPlan::normal(reason::REPLAY, action::REPLAY, summary)
    };
    // The recorder directly (not `dlq_client::events::publish`, which only logs): the person
    // at the terminal or the page should see that the record is missing.
    recorder
        .publish(&to_recorder_event(&plan), &dlq.object_ref(&()))
        .await
        .err()
        .map(|e| {
            let why = match e {
                kube::Error::Api(s) => s.message,
                other => other.to_string(),
            };
            format!("could not record the replay as an Event on the queue: {why}")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Outcome::*;

    #[test]
    fn ratio_needs_a_full_window_of_settled_outcomes() {
        assert_eq!(failure_ratio(&[Failing, Pending], 2), None);
        assert_eq!(failure_ratio(&[Redriven, Failing, Pending], 2), Some(0.5));
        assert_eq!(
            failure_ratio(&[Failing, Failing, Redriven, Redriven], 2),
            Some(0.0),
            "recent window only"
        );
    }

    #[test]
    fn achieved_rate_counts_the_gaps_between_issued_decisions() {
        let t0 = Instant::now();
        let mut issued = [t0 + Duration::from_secs(2), t0, t0 + Duration::from_secs(1)];
        assert!((achieved_rate(&mut issued) - 1.0).abs() < 1e-9);
        assert_eq!(achieved_rate(&mut [t0]), 0.0, "one decision has no pace");
        assert_eq!(achieved_rate(&mut []), 0.0);
    }

    #[test]
    fn rates_and_times() {
        assert_eq!(parse_rate("20/s"), Ok(20.0));
        assert_eq!(parse_rate("0.5"), Ok(0.5));
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_time("2026-11-29T10:00:00Z").is_ok());
        let two_h = parse_time("2h").unwrap();
        let diff = Timestamp::now().duration_since(two_h).as_secs();
        assert!((7190..=7210).contains(&diff));
        assert!(parse_time("yesterday").is_err());
    }
}
