//! `redrive`: per job, or the replay runbook over a selection (`--queue ...`): dry run,
//! rate-limited decisions, stop conditions, a summary, and a decision record (an Event on the
//! DeadLetterQueue).

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use clap::Args;
use jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::decide::{Sign, decide_jobs, signer};
use super::inspect::{records, row, table};
use super::{CliError, Global, connect};
use crate::api::{Action, DeadLetter, DeadLetterQueue, LABEL_QUEUE, Phase};

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

pub fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.trim().trim_end_matches("/s");
    match n.parse::<f64>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!("{s:?} is not a rate such as 20/s")),
    }
}

pub fn parse_time(s: &str) -> Result<Timestamp, String> {
    if let Ok(t) = s.parse::<Timestamp>() {
        return Ok(t);
    }
    crate::decide::parse_duration(s)
        .and_then(|d| jiff::SignedDuration::try_from(d).ok())
        .and_then(|d| Timestamp::now().checked_sub(d).ok())
        .ok_or_else(|| format!("{s:?} is neither an RFC 3339 time nor a duration such as 2h"))
}

impl Selector {
    /// Whether a record is one the replay takes. Pure.
    pub fn matches(&self, r: &DeadLetter) -> bool {
        let s = &r.spec;
        r.phase() == Phase::Parked
            && s.action.is_none()
            && self.queue.as_ref().is_none_or(|q| &s.queue == q)
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

#[derive(Default)]
struct Run {
    decided: Vec<String>,
    outcomes: HashMap<String, Outcome>,
    new_parked: usize,
    skipped: usize,
}

impl Run {
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

type Signed = (String, Instant, Result<bool, CliError>);

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

fn progress(run: &Run, total: usize, tty: bool, last_printed: &mut usize) {
    let done = run.decided.len();
    let line = format!(
        "[{}{}] {done}/{total} decided, {} redriven, {} failing, {} new parked",
        "#".repeat(done * 30 / total.max(1)),
        ".".repeat(30 - done * 30 / total.max(1)),
        run.count(Outcome::Redriven),
        run.count(Outcome::Failing),
        run.new_parked
    );
    let mut err = std::io::stderr();
    if tty {
        let _ = write!(err, "\r{line}");
        let _ = err.flush();
    } else if (done == total && *last_printed != total)
        || done >= *last_printed + (total / 10).max(1)
    {
        let _ = writeln!(err, "{line}");
        *last_printed = done;
    }
}

async fn replay(g: &Global, args: &RedriveArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let select = &args.select;
    let pace = &args.pace;
    let queue = select.queue.clone().unwrap_or_default();
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    let Some(dlq) = queues.get_opt(&queue).await? else {
        return Err(CliError::Usage(format!(
            "no DeadLetterQueue {queue} in namespace {ns}"
        )));
    };
    let mut selected: Vec<DeadLetter> = records(&client, &ns, false, Some(&queue), None)
        .await?
        .into_iter()
        .filter(|r| select.matches(r))
        .collect();
    selected.sort_by_key(|r| (r.spec.failed_at.0, r.name_any()));
    if let Some(max) = pace.max {
        selected.truncate(max);
    }
    if pace.dry_run {
        let rows: Vec<Vec<String>> = selected.iter().map(|r| row(r, false)).collect();
        print!("{}", table(&rows));
        println!(
            "dry run: {} records would be redriven ({}); nothing changed",
            selected.len(),
            select.describe()
        );
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
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let started = Timestamp::now();
    let clock = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut run = Run::default();
    let mut printed = 0;
    let mut stop: Option<String> = None;
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Burst: a slow observation is caught up, so the average rate is the one asked for.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    // Outcomes are listed in the background, so the pace never waits for a slow listing.
    let (snapshot_tx, mut snapshots) = tokio::sync::watch::channel(Vec::<DeadLetter>::new());
    let lister = {
        let (api, queue) = (api.clone(), queue.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(items) = list_queue(&api, &queue).await
                    && snapshot_tx.send(items).is_err()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    // Decisions are issued on the ticker and run concurrently, so a slow apiserver answer does
    // not slow the pace; at most MAX_IN_FLIGHT wait for an answer at once.
    const MAX_IN_FLIGHT: usize = 256;
    let mut in_flight = tokio::task::JoinSet::new();
    let mut issued_at: Vec<Instant> = Vec::new();
    for record in &selected {
        ticker.tick().await;
        while let Some(done) = in_flight.try_join_next() {
            settle_decision(joined(done)?, &mut run, &mut issued_at)?;
        }
        if snapshots.has_changed().unwrap_or(false) {
            let items = snapshots.borrow_and_update().clone();
            run.apply(&items, started);
            if let Some(why) = run.stop_reason(pace) {
                stop = Some(why);
                break;
            }
        }
        while in_flight.len() >= MAX_IN_FLIGHT {
            if let Some(done) = in_flight.join_next().await {
                settle_decision(joined(done)?, &mut run, &mut issued_at)?;
            }
        }
        let issued = Instant::now();
        let (api, record, select, by, note) = (
            api.clone(),
            record.clone(),
            select.clone(),
            by.clone(),
            note.clone(),
        );
        in_flight.spawn(async move {
            let signed = sign_record(&api, &record, &select, &by, &note).await;
            (record.name_any(), issued, signed)
        });
        progress(&run, selected.len(), tty, &mut printed);
    }
    while let Some(done) = in_flight.join_next().await {
        settle_decision(joined(done)?, &mut run, &mut issued_at)?;
    }
    lister.abort();
    let decide_secs = clock.elapsed().as_secs_f64();
    // The achieved pace: signed decisions after the first, over the time they were issued in.
    issued_at.sort();
    let achieved = match (issued_at.first(), issued_at.last()) {
        (Some(first), Some(last)) if issued_at.len() > 1 => {
            (issued_at.len() - 1) as f64 / last.duration_since(*first).as_secs_f64().max(0.001)
        }
        _ => 0.0,
    };

    // Let the decided records settle, still watching the stop conditions.
    let settle_by = Instant::now() + Duration::from_secs(pace.settle_timeout);
    while stop.is_none() && Instant::now() < settle_by {
        observe(&api, &queue, started, &mut run).await?;
        progress(&run, selected.len(), tty, &mut printed);
        if let Some(why) = run.stop_reason(pace) {
            stop = Some(why);
            break;
        }
        if run.count(Outcome::Pending) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if tty {
        eprintln!();
    }

    // Stopped: take back the decisions that have not been carried out, so those records stay
    // Parked instead of being redriven when the broker returns.
    let failing = run.count(Outcome::Failing);
    let mut withdrawn = 0;
    if stop.is_some() {
        observe(&api, &queue, started, &mut run).await?;
        for name in &run.decided {
            if run.outcomes.get(name).copied().unwrap_or(Outcome::Pending) == Outcome::Redriven {
                continue;
            }
            if withdraw(&api, name).await? {
                withdrawn += 1;
            }
        }
        observe(&api, &queue, started, &mut run).await?;
    }

    let redriven = run.count(Outcome::Redriven);
    let ending = match &stop {
        Some(why) => format!("stopped: {why}"),
        None if run.count(Outcome::Pending) > 0 => {
            "finished deciding; some redrives still pending".to_string()
        }
        None => "completed".to_string(),
    };
    let summary = format!(
        "replay {} by {by}: selected {}, decided {}, redriven {redriven}, failing {failing}, withdrawn {withdrawn}, skipped {}, new parkings {}; {} decisions in {:.1}s ({:.1}/s); {ending}",
        select.describe(),
        selected.len(),
        run.decided.len(),
        run.skipped,
        run.new_parked,
        run.decided.len(),
        decide_secs,
        achieved,
    );
    println!("{summary}");

    // The decision record, on the queue, for the incident log and for alerts.
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "kubectl-dlq".into(),
            instance: Some(by.clone()),
        },
    );
    let (type_, reason) = if stop.is_some() {
        (EventType::Warning, "ReplayStopped")
    } else {
        (EventType::Normal, "Replay")
    };
    let ev = crate::controller::event(type_, reason, "Replay", summary);
    if let Err(e) = recorder.publish(&ev, &dlq.object_ref(&())).await {
        eprintln!("warning: could not record the replay as an Event on the queue: {e}");
    }
    if stop.is_some() {
        return Err(CliError::Refused(String::new()));
    }
    Ok(())
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
