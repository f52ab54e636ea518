//! The DeadLetterReplay controller (leader only): carries out a replay with the runbook's
//! rules. Each reconcile is one step: observe the queue's records (the cache), stop if a bound
//! or `spec.stop` says so (withdrawing what was not carried out), else sign as many selected
//! records as the pace allows (compare-and-swap, signed with the replay's `by`, labelled with
//! the replay) and look again shortly. The DeadLetter reconciler carries each decision out.
//!
//! Progress is in the cluster: a restarted or new leader finds the decided records by their
//! label, and a decided record no longer matches the selection, so it is never decided twice.
//!
//! A redrive of one failure group (standing or not) is itself the signed decision: it sends
//! its records' jobs ahead (`super::ahead`, at the broker's pace or its `rate`) and signs the
//! records behind them ([`sign_behind`], at the apiserver's pace, a trickle while its
//! pass-through is busy); their reconciles then write only the resolutions.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use tokio::sync::Mutex;

use dlq_core::api::{DeadLetter, LABEL_QUEUE, Phase};
use dlq_core::conditions::{self, Cond};
use dlq_core::decide::redrive_key;
use dlq_core::events::{EventPlan, action, reason};
use dlq_core::group::LABEL_GROUP;
use dlq_core::record::{Facts, Summary};
use dlq_core::replay::{
    self, DeadLetterReplay, DeadLetterReplayStatus, Observed, Outcome, ReplayPhase, ReplayRef,
    approvals,
};

use super::ahead;
use super::context::{Context, LIST_WAIT};
use super::error::ReconcileError;
use crate::pass::{Cover, PassLog, Standing, Tally};
use crate::state::apiserver::{Apiserver, PassedThrough, Signature, is_conflict, reference};

/// Signatures in flight at once within one step.
const SIGN_CONCURRENCY: usize = 64;
/// CAS attempts on one record before it is skipped.
const ATTEMPTS: usize = 5;
/// How often a dry run recounts its selection.
const DRY_RUN_RESYNC: Duration = Duration::from_secs(30);
/// How often a replay awaiting approval looks again (an approval is a change of the replay,
/// seen at once; this is for expiry and the overdue Warning).
const APPROVAL_POLL: Duration = Duration::from_secs(30);
/// How long a replay may await approval before a Warning says so (once per wait).
pub const APPROVAL_OVERDUE: Duration = Duration::from_secs(3600);
/// How often a replay whose queue is missing looks again.
const PENDING_RETRY: Duration = Duration::from_secs(10);
/// How soon a start the cache was behind for looks again.
const CATCH_UP: Duration = Duration::from_millis(200);
/// How often a running replay writes its progress (phase changes are written at once).
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// How long a step waits for the record cache's first listing.
/// How often a replay waiting for outcomes looks again.
const SETTLE_POLL: Duration = Duration::from_millis(500);
/// How often a standing replay with nothing to decide looks again (well inside the cover's
/// `LAPSE`).
const STANDING_POLL: Duration = Duration::from_secs(2);
/// How long a standing replay's end waits for the messages still passing through.
const PASSING_WAIT: Duration = Duration::from_secs(10);
/// Most jobs one step sends ahead (a step renews its standing cover, and heeds stop and pause).
const SEND_PER_STEP: usize = 8192;
/// Records sent ahead signed in one step, and the pause before the next step while some wait.
const SIGN_BEHIND: usize = 256;
const SIGN_BEHIND_EVERY: Duration = Duration::from_millis(10);
/// The same while its pass-through is busy: passes wait for their own writes to the apiserver
/// before their sources acknowledge, and these signatures and resolutions must not crowd them.
const SIGN_BEHIND_BUSY: usize = 8;
const SIGN_BEHIND_BUSY_EVERY: Duration = Duration::from_millis(250);
/// A pass-through within this long makes it busy.
const PASSING_BUSY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("DeadLetterReplay has no namespace")]
    NoNamespace,
    #[error("reading DeadLetter {name}: {source}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("signing DeadLetter {name}: {source}")]
    Sign {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of DeadLetterReplay {name}: {source}")]
    WriteStatus {
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl ReconcileError for ReplayError {
    fn category(&self) -> &'static str {
        match self {
            ReplayError::NoNamespace => "InvalidObject",
            _ => "KubeApi",
        }
    }
}

type Result<T, E = ReplayError> = std::result::Result<T, E>;

/// What this process knows of a running replay beyond the cache: the status it last wrote
/// (the cache may not show it yet) and the records it signed.
#[derive(Default, Clone)]
struct Memory {
    status: Option<DeadLetterReplayStatus>,
    /// When `status` was written: progress is written at most every [`PROGRESS_EVERY`].
    written_at: Option<Instant>,
    signed: Vec<String>,
    /// Records whose jobs it sent ahead (`super::ahead`) and has not signed yet, oldest first.
    ahead: Vec<String>,
    first: Option<Instant>,
    last: Option<Instant>,
    /// This process started the run (wrote `startedAt`): its pace counts from its first
    /// decision, however long the steps before that took.
    started_here: bool,
}

/// The replay controller's context: the operator's, the standing replays running here (whose
/// groups it covers for the sources), and each replay's [`Memory`] by uid.
pub struct Replays {
    pub ctx: Arc<Context>,
    pub standing: Standing,
    memory: Mutex<HashMap<String, Memory>>,
}

impl Replays {
    pub fn new(ctx: Arc<Context>, standing: Standing) -> Self {
        Replays {
            ctx,
            standing,
            memory: Mutex::default(),
        }
    }
}

/// One replay, as this step sees it.
struct Run<'a> {
    ctx: &'a Context,
    standing: &'a Standing,
    replay: &'a DeadLetterReplay,
    ns: String,
    name: String,
    /// The queue's records from the cache.
    records: Vec<Arc<Summary>>,
    mem: Memory,
    status: DeadLetterReplayStatus,
    /// A standing replay's cover: what its sources pass, folded into every status write.
    cover: Option<Arc<Cover>>,
}

pub async fn reconcile(replay: Arc<DeadLetterReplay>, replays: Arc<Replays>) -> Result<Action> {
    let ns = replay.namespace().ok_or(ReplayError::NoNamespace)?;
    let uid = replay.uid().unwrap_or_default();
    let mem = replays
        .memory
        .lock()
        .await
        .get(&uid)
        .cloned()
        .unwrap_or_default();
    let status = mem
        .status
        .clone()
        .or_else(|| replay.status.clone())
        .unwrap_or_default();
    let ctx = &replays.ctx;
    if status.phase.is_some_and(ReplayPhase::is_final) {
        replays.memory.lock().await.remove(&uid);
        replays.standing.uncover(&ns, &uid);
        return Ok(Action::await_change());
    }
    if !ctx.records_ready().await || !ctx.queues_ready().await {
        // Right after start-up the caches may still be filling: a selection taken now would be
        // empty, and a queue not listed yet would look missing.
        return Ok(Action::requeue(LIST_WAIT));
    }
    let mut run = Run {
        records: queue_records(ctx, &ns, &replay.spec.queue),
        name: replay.name_any(),
        ns,
        ctx,
        standing: &replays.standing,
        replay: &replay,
        mem,
        status,
        cover: None,
    };
    // Kept when the step failed too: what it sent ahead is signed by the next step.
    let action = step(&mut run).await;
    let mut memory = replays.memory.lock().await;
    if run.status.phase.is_some_and(ReplayPhase::is_final) {
        memory.remove(&uid);
    } else {
        memory.insert(uid, run.mem);
    }
    action
}

/// The queue's records in `ns`, from the index.
fn queue_records(ctx: &Context, ns: &str, queue: &str) -> Vec<Arc<Summary>> {
    ctx.records.queue(ns, queue)
}

async fn step(run: &mut Run<'_>) -> Result<Action> {
    if run.ctx.queue(&run.ns, &run.replay.spec.queue).is_none() {
        return pending(run).await;
    }
    if run.replay.spec.dry_run() && run.status.started_at.is_none() {
        return dry_run(run).await;
    }
    if run.status.started_at.is_none() {
        if !caught_up(run).await? {
            return Ok(Action::requeue(CATCH_UP));
        }
        if let Some(wait) = await_approval(run).await? {
            return Ok(wait);
        }
        start(run).await?;
    }
    let status = run.status.clone();
    let selector = run.replay.spec.selector();
    let standing = run.replay.spec.standing().then_some(&selector);
    let Some(started) = replay::Start::of(&status, standing) else {
        return Ok(Action::requeue(PENDING_RETRY));
    };
    let observed = replay::observe(
        run.records.iter().map(|r| r.as_ref()),
        run.replay_ref(),
        &started,
        &run.mem.signed,
    );
    replay::counts(&mut run.status, &observed);
    // After the counts: a restarted leader's cover starts from what the records show decided.
    let pass_failures = if standing.is_some() { stand(run) } else { None };
    let stop = if run.replay.spec.stop_requested() {
        Some("stopped on request (spec.stop)".to_string())
    } else {
        observed
            .stop_reason(&run.replay.spec.bounds())
            .or(pass_failures)
    };
    if let Some(why) = stop {
        return finish(run, &observed, Some(why)).await;
    }
    // Jobs sent ahead are carried out: their records are signed, paused or not.
    let ahead = run.mem.ahead.len();
    if let Some(refusal) = sign_behind(run).await? {
        return finish(run, &observed, Some(refusal)).await;
    }
    // What this step signed is pending, not unseen: observed before it, the last records
    // signed behind were not this replay's yet, and the run settled without waiting for them.
    let observed = if run.mem.ahead.len() < ahead {
        replay::observe(
            run.records.iter().map(|r| r.as_ref()),
            run.replay_ref(),
            &started,
            &run.mem.signed,
        )
    } else {
        observed
    };
    if run.replay.spec.paused() {
        return pause(run).await;
    }
    if run.status.phase == Some(ReplayPhase::Paused) {
        resume(run).await?;
    }
    decide(run, &started, &observed).await
}

/// `spec.paused`: decides nothing and passes nothing through (its cover held, see [`stand`])
/// until resumed; what it decided stays decided and is carried out. The pause is said once, as
/// the phase and a Normal Event; the counts go on being written as decisions are carried out.
async fn pause(run: &mut Run<'_>) -> Result<Action> {
    if run.status.phase == Some(ReplayPhase::Paused) {
        write_progress(run).await?;
        return Ok(Action::requeue(next_step(run, STANDING_POLL)));
    }
    let message = format!(
        "paused (spec.paused) after {} decided and {} passed through: nothing more until resumed",
        run.status.decided, run.status.passed_through
    );
    set_phase(
        run,
        ReplayPhase::Paused,
        ReplayPhase::Paused.as_str(),
        &message,
    );
    write(run).await?;
    tracing::info!(namespace = %run.ns, replay = %run.name, decided = run.status.decided, passed_through = run.status.passed_through, "replay paused");
    let plan = EventPlan::normal(reason::REPLAY_PAUSED, action::REPLAY, message);
    run.ctx
        .apiserver
        .publish(reference(run.replay), &plan)
        .await;
    Ok(Action::requeue(next_step(run, STANDING_POLL)))
}

/// A paused run whose `spec.paused` is false again goes on where it was: Running, said at once
/// and as a Normal Event. Its pace catches up at most its burst.
async fn resume(run: &mut Run<'_>) -> Result<()> {
    let message = format!("resumed at {}/s", run.replay.spec.rate());
    set_phase(run, ReplayPhase::Running, "Running", &message);
    write(run).await?;
    tracing::info!(namespace = %run.ns, replay = %run.name, "replay resumed");
    let plan = EventPlan::normal(reason::REPLAY_RESUMED, action::REPLAY, message);
    run.ctx
        .apiserver
        .publish(reference(run.replay), &plan)
        .await;
    Ok(())
}

/// Before a run starts, its queue's approval policy (`dlq_core::replay::approvals`): a replay
/// that needs approvals it lacks waits as AwaitingApproval, deciding nothing and passing
/// nothing through (a standing one has no cover until it starts); each approver seen is
/// announced once (Normal `Approved`), a wait longer than [`APPROVAL_OVERDUE`] once (Warning
/// `ApprovalOverdue`). Approvals are judged until the run starts; the ones that let it start
/// stay in `status.approval` and are named in every record it signs. A stop requested while
/// waiting is not held: the run ends at once, deciding nothing.
async fn await_approval(run: &mut Run<'_>) -> Result<Option<Action>> {
    if run.replay.spec.stop_requested() {
        return Ok(None);
    }
    let now = Timestamp::now();
    let verdict = approval_verdict(run, now);
    if verdict == approvals::Verdict::NotNeeded {
        return Ok(None);
    }
    announce_approvals(run, &verdict).await;
    let Some(message) = verdict.waiting_message() else {
        // Approved: `start` writes the status, approvers included.
        if let Some(a) = run.status.approval.as_mut() {
            a.overdue_at = None;
        }
        return Ok(None);
    };
    let approval = run.status.approval.get_or_insert_with(Default::default);
    let since = approval.waiting_since.get_or_insert(Time(now)).0;
    let overdue = approval.overdue_at.is_none()
        && Duration::try_from(now.duration_since(since)).is_ok_and(|d| d >= APPROVAL_OVERDUE);
    if overdue {
        approval.overdue_at = Some(Time(now));
    }
    set_phase(
        run,
        ReplayPhase::AwaitingApproval,
        conditions::reason::AWAITING_APPROVAL,
        &message,
    );
    write(run).await?;
    if overdue {
        let waited = Duration::try_from(now.duration_since(since)).unwrap_or_default();
        let plan = EventPlan::warning(
            reason::APPROVAL_OVERDUE,
            action::REPLAY,
            format!(
                "replay {} by {} has awaited approval for {} min: {message}",
                run.name,
                run.replay.spec.by,
                waited.as_secs() / 60
            ),
        );
        tracing::warn!(namespace = %run.ns, replay = %run.name, "replay awaits approval too long");
        publish_on_queue(run, &plan).await;
        run.ctx
            .apiserver
            .publish(reference(run.replay), &plan)
            .await;
    }
    Ok(Some(Action::requeue(APPROVAL_POLL)))
}

/// The queue's approval policy applied to the replay as it would start now: its selection
/// from the cache, plus the group's estimated backlog for a replay of one failure group.
fn approval_verdict(run: &Run<'_>, now: Timestamp) -> approvals::Verdict {
    let spec = &run.replay.spec;
    let queue = run.ctx.queue(&run.ns, &spec.queue);
    let Some(policy) = queue.as_ref().and_then(|q| q.spec.approvals.as_ref()) else {
        return approvals::Verdict::NotNeeded;
    };
    let selector = spec.selector();
    let selected = replay::select(
        run.records.iter().map(|r| r.as_ref()),
        &spec.queue,
        &selector,
        None,
        spec.max(),
    )
    .len();
    let backlog = match (&selector.group, selector.names.is_empty()) {
        (Some(g), true) => run
            .ctx
            .views
            .group(&run.ns, &dlq_core::groups::group_name(&spec.queue, g))
            .and_then(|g| g.status.as_ref()?.backlog.as_ref()?.messages),
        _ => None,
    };
    approvals::check(
        Some(policy),
        &spec.approval_request(),
        approvals::size(selected, backlog),
        now,
    )
}

/// A Normal `Approved` Event on the replay for each approver not seen before; the approvers
/// that count now are kept in `status.approval`.
async fn announce_approvals(run: &mut Run<'_>, verdict: &approvals::Verdict) {
    let (required, by) = match verdict {
        approvals::Verdict::Waiting { required, by, .. } => (*required, by.clone()),
        approvals::Verdict::Approved { by, required } => (*required, by.clone()),
        approvals::Verdict::NotNeeded => return,
    };
    let approval = run.status.approval.get_or_insert_with(Default::default);
    let new: Vec<String> = by
        .iter()
        .filter(|b| !approval.approved_by.contains(b))
        .cloned()
        .collect();
    approval.approved_by = by.clone();
    approval.required = i64::try_from(required).unwrap_or(i64::MAX);
    for who in new {
        let note = run
            .replay
            .spec
            .approvals
            .iter()
            .rev()
            .find(|a| a.by.trim() == who)
            .and_then(|a| a.note.clone())
            .map(|n| format!(": {n}"))
            .unwrap_or_default();
        let position = by.iter().position(|b| *b == who).unwrap_or(0) + 1;
        let message = format!(
            "{who} approved replay {} by {} ({position} of {required}){note}",
            run.name, run.replay.spec.by
        );
        tracing::info!(namespace = %run.ns, replay = %run.name, approver = %who, "replay approved");
        let plan = EventPlan::normal(reason::APPROVED, action::REPLAY, message);
        run.ctx
            .apiserver
            .publish(reference(run.replay), &plan)
            .await;
    }
}

/// The queue does not exist (yet): say so and look again.
async fn pending(run: &mut Run<'_>) -> Result<Action> {
    let message = format!(
        "DeadLetterQueue {} does not exist in this namespace; the replay starts once it does",
        run.replay.spec.queue
    );
    set_phase(
        run,
        ReplayPhase::Pending,
        conditions::reason::QUEUE_NOT_FOUND,
        &message,
    );
    write(run).await?;
    Ok(Action::requeue(PENDING_RETRY))
}

/// `dryRun: true`: the selection as it is now, counted and named; nothing decided.
async fn dry_run(run: &mut Run<'_>) -> Result<Action> {
    let spec = &run.replay.spec;
    let selected = replay::select(
        run.records.iter().map(|r| r.as_ref()),
        &spec.queue,
        &spec.selector(),
        None,
        spec.max(),
    );
    run.status.selected = i64::try_from(selected.len()).unwrap_or(i64::MAX);
    run.status.first_names = selected
        .iter()
        .take(replay::FIRST_NAMES)
        .map(|r| r.name.to_string())
        .collect();
    let message = format!(
        "{} records would be decided; set dryRun: false to run",
        selected.len()
    );
    set_phase(run, ReplayPhase::DryRun, "DryRun", &message);
    write(run).await?;
    Ok(Action::requeue(DRY_RUN_RESYNC))
}

/// Whether the cache shows every record of the run's queue (and group) that etcd holds: a run
/// freezes what the cache shows, and a record parked a moment before the replay was created may
/// not have reached the cache yet; frozen out, it would count as a new parking.
async fn caught_up(run: &Run<'_>) -> Result<bool> {
    let spec = &run.replay.spec;
    let mut labels = format!("{LABEL_QUEUE}={}", spec.queue);
    if let Some(group) = spec.selector().group {
        labels.push_str(&format!(",{LABEL_GROUP}={group}"));
    }
    let names = run
        .ctx
        .apiserver
        .record_names(&run.ns, &labels)
        .await
        .map_err(|source| ReplayError::Read {
            name: labels.clone(),
            source,
        })?;
    let cached: HashSet<&str> = run.records.iter().map(|r| &*r.name).collect();
    let behind = names
        .iter()
        .filter(|n| !cached.contains(n.as_str()))
        .count();
    if behind > 0 {
        tracing::debug!(namespace = %run.ns, replay = %run.name, behind, "the cache is behind etcd; the run starts once it shows them");
    }
    Ok(behind == 0)
}

/// The run starts now: the selection is frozen to the records that exist now (which ones is
/// written in the status before any is decided).
async fn start(run: &mut Run<'_>) -> Result<()> {
    let now = Timestamp::now();
    let spec = &run.replay.spec;
    let frozen = replay::Frozen::of(run.records.iter().map(|r| r.as_ref()));
    let selected = replay::select(
        run.records.iter().map(|r| r.as_ref()),
        &spec.queue,
        &spec.selector(),
        Some(&replay::Start {
            at: now,
            frozen: Some(&frozen),
            standing: spec.standing().then_some(&spec.selector()),
        }),
        spec.max(),
    );
    let count = selected.len();
    let approved = match run.status.approval.as_ref() {
        Some(a) if !a.approved_by.is_empty() => {
            format!(", approved by {}", a.approved_by.join(", "))
        }
        _ => String::new(),
    };
    let message = format!("deciding {count} records at {}/s{approved}", spec.rate());
    tracing::info!(namespace = %run.ns, replay = %run.name, queue = %spec.queue, selected = count, cached = run.records.len(), all = run.ctx.records.len(), by = %spec.by, "replay started");
    run.status.selected = i64::try_from(count).unwrap_or(i64::MAX);
    run.status.started_at = Some(Time(now));
    run.status.frozen = Some(frozen);
    set_phase(run, ReplayPhase::Running, "Running", &message);
    write(run).await?;
    // The first decision's progress is written at once, not a throttle period later.
    run.mem.written_at = None;
    run.mem.started_here = true;
    if spec.standing() {
        announce_standing(run).await;
    }
    Ok(())
}

/// Says on the queue and the replay that a standing replay runs, and what it does to dead
/// messages that arrive: a standing drop discards them without a record, so it says so as a
/// Warning.
async fn announce_standing(run: &Run<'_>) {
    let spec = &run.replay.spec;
    let group = spec.selector().group.unwrap_or_default();
    let by = &spec.by;
    let plan = match spec.action() {
        dlq_core::api::Action::Drop => EventPlan::warning(
            reason::STANDING,
            action::REPLAY,
            format!(
                "standing drop {} by {by}: dead messages of group {group} arriving on this queue are DISCARDED without a record until it ends (spec.stop: true ends it)",
                run.name
            ),
        ),
        dlq_core::api::Action::Redrive => EventPlan::normal(
            reason::STANDING,
            action::REPLAY,
            format!(
                "standing redrive {} by {by}: dead messages of group {group} go straight back to the target until the broker holds none",
                run.name
            ),
        ),
    };
    publish_on_queue(run, &plan).await;
    run.ctx
        .apiserver
        .publish(reference(run.replay), &plan)
        .await;
}

/// Signs the next records the pace allows; when none are left, waits for outcomes.
async fn decide(
    run: &mut Run<'_>,
    started: &replay::Start<'_>,
    observed: &Observed,
) -> Result<Action> {
    let spec = &run.replay.spec;
    let decided = usize::try_from(run.status.decided).unwrap_or(0);
    let passed = usize::try_from(run.status.passed_through).unwrap_or(0);
    // A standing replay's cover holds the one budget of decisions and passes (claimed below).
    let ahead = run.mem.ahead.len();
    let quota = match &run.cover {
        Some(_) => usize::MAX,
        None => spec
            .max()
            .map_or(usize::MAX, |m| m.saturating_sub(decided + passed + ahead)),
    };
    let taken: std::collections::HashSet<&str> = run
        .mem
        .signed
        .iter()
        .chain(&run.mem.ahead)
        .map(String::as_str)
        .collect();
    let candidates: Vec<DeadLetter> = replay::select(
        run.records.iter().map(|r| r.as_ref()),
        &spec.queue,
        &spec.selector(),
        Some(started),
        None,
    )
    .into_iter()
    .filter(|r| !taken.contains(&*r.name))
    .take(quota)
    .map(|r| r.to_record())
    .collect();
    let candidates = match canary_gate(run, candidates).await? {
        Gate::Go(candidates) => candidates,
        Gate::Watch => {
            write_progress(run).await?;
            return Ok(Action::requeue(SETTLE_POLL));
        }
        Gate::Stop(why) => return finish(run, observed, Some(why)).await,
    };
    // A standing replay whose `max` is spent decides no more, even with records of its group
    // parked since (they would wait for a claim forever): it settles.
    let spent = run.cover.as_ref().is_some_and(|c| c.spent());
    if (candidates.is_empty() || spent) && !run.mem.ahead.is_empty() {
        // Its records' jobs went ahead: it ends once they are signed, behind.
        write_progress(run).await?;
        return Ok(Action::requeue(next_step(run, SIGN_BEHIND_EVERY)));
    }
    if candidates.is_empty() || spent {
        if spec.standing() && !standing_over(run, started) {
            // The rest of the incident may still be in the broker: keep covering it (a step
            // every STANDING_POLL, so each writes what changed).
            write(run).await?;
            return Ok(Action::requeue(STANDING_POLL));
        }
        return settle(run, observed).await;
    }
    let ahead = run.ctx.settings.mechanisms.send_ahead;
    if ahead && spec.sends_ahead() && !spec.canary_holds(&run.status) {
        return send_ahead(run, started, observed, &candidates).await;
    }
    let n = replay::budget(spec.rate(), paced_for(&run.mem, started, decided), decided);
    if n > 0 && run.ctx.settings.leadership.holds() {
        let clock = Instant::now();
        let batch = claim(run, &candidates[..n.min(candidates.len())]);
        if run.mem.first.is_none() {
            crate::failpoint::hit("replay-first-sign").await;
        }
        let before = run.mem.signed.len();
        let refused = sign_batch(run, batch).await;
        if let Some(cover) = &run.cover {
            // What was claimed and not signed (skipped, refused, failed) is not spent.
            cover.unclaim(batch.len() - (run.mem.signed.len() - before));
        }
        if let Some(refusal) = refused? {
            return finish(run, observed, Some(refusal)).await;
        }
        tracing::debug!(replay = %run.name, signed = batch.len(), took_ms = clock.elapsed().as_millis() as u64, "replay step");
    }
    write_progress(run).await?;
    Ok(Action::requeue(replay::step(spec.rate())))
}

/// A redrive of one failure group: the jobs its pace allows now go to the target ahead of
/// their decisions (`super::ahead`); they are signed behind ([`sign_behind`]). A record whose
/// job did not go is signed at once, for its own redrive (retried with backoff, counted
/// toward `failureRatio`).
async fn send_ahead(
    run: &mut Run<'_>,
    started: &replay::Start<'_>,
    observed: &Observed,
    candidates: &[DeadLetter],
) -> Result<Action> {
    let spec = &run.replay.spec;
    let decided = usize::try_from(run.status.decided).unwrap_or(0);
    let allowed = match spec.send_rate() {
        Some(rate) => {
            let paced = paced_for(&run.mem, started, decided);
            replay::budget(rate, paced, decided + run.mem.ahead.len())
        }
        None => SEND_PER_STEP,
    };
    let n = allowed.min(SEND_PER_STEP).min(candidates.len());
    if n > 0 && run.ctx.settings.leadership.holds() {
        let batch = claim(run, &candidates[..n]);
        let sent = send_batch(run, batch).await;
        let failed: Vec<DeadLetter> = batch
            .iter()
            .filter(|r| sent.failed.contains(&r.name_any()))
            .cloned()
            .collect();
        if let Some(cover) = &run.cover {
            // What was claimed and neither sent nor failed (to be signed) is not spent.
            cover.unclaim(batch.len() - sent.confirmed.len() - sent.failed.len());
        }
        run.mem.ahead.extend(sent.confirmed);
        if let Some(refusal) = sign_claimed(run, &failed).await? {
            return finish(run, observed, Some(refusal)).await;
        }
    }
    write_progress(run).await?;
    let next = replay::step(spec.rate());
    Ok(Action::requeue(next_step(run, next)))
}

/// Sends the jobs of `batch` ahead; what was sent is noted as the pace's progress.
async fn send_batch(run: &mut Run<'_>, batch: &[DeadLetter]) -> ahead::Sent {
    let spec = &run.replay.spec;
    let selector = spec.selector();
    let group = selector.group.clone().unwrap_or_default();
    let round = ahead::Round {
        ns: &run.ns,
        queue: &spec.queue,
        group: &group,
        by: &spec.by,
        selector: &selector,
    };
    let names: Vec<String> = batch.iter().map(|r| r.name_any()).collect();
    let clock = Instant::now();
    let sent = ahead::send(run.ctx, &round, &names).await;
    if !sent.confirmed.is_empty() || !sent.failed.is_empty() {
        let now = Instant::now();
        run.mem.first.get_or_insert(now);
        run.mem.last = Some(now);
    }
    tracing::info!(namespace = %run.ns, replay = %run.name, asked = names.len(), sent = sent.confirmed.len(), failed = sent.failed.len(), took_ms = clock.elapsed().as_millis() as u64, "jobs sent ahead of their decisions");
    sent
}

/// Signs `batch`, whose decisions a standing cover claimed: what was not signed is given back.
async fn sign_claimed(run: &mut Run<'_>, batch: &[DeadLetter]) -> Result<Option<String>> {
    if batch.is_empty() {
        return Ok(None);
    }
    let before = run.mem.signed.len();
    let refused = sign_batch(run, batch).await;
    if let Some(cover) = &run.cover {
        cover.unclaim(batch.len() - (run.mem.signed.len() - before));
    }
    refused
}

/// Signs the oldest records whose jobs were sent ahead: as many as the apiserver takes in a
/// step, a few while the replay's pass-through is busy. The refusal of a signature, if any.
async fn sign_behind(run: &mut Run<'_>) -> Result<Option<String>> {
    if run.mem.ahead.is_empty() || !run.ctx.settings.leadership.holds() {
        return Ok(None);
    }
    let most = if passing_busy(run) {
        SIGN_BEHIND_BUSY
    } else {
        SIGN_BEHIND
    };
    let names: Vec<String> = run
        .mem
        .ahead
        .drain(..most.min(run.mem.ahead.len()))
        .collect();
    let batch = records_named(run, &names);
    sign_batch(run, &batch).await
}

/// Signs every record whose job was sent ahead (a replay that stops: they were carried out).
async fn sign_all_behind(run: &mut Run<'_>) -> Result<()> {
    let names = std::mem::take(&mut run.mem.ahead);
    let batch = records_named(run, &names);
    if let Some(refusal) = sign_batch(run, &batch).await? {
        tracing::warn!(namespace = %run.ns, replay = %run.name, refusal, "records whose jobs were sent ahead stay undecided");
    }
    Ok(())
}

/// The records `names` as the index holds them (enough to sign that version); gone ones left
/// out.
fn records_named(run: &Run<'_>, names: &[String]) -> Vec<DeadLetter> {
    names
        .iter()
        .filter_map(|n| run.ctx.records.get(&run.ns, n))
        .map(|s| s.to_record())
        .collect()
}

/// Whether its standing cover passed a message within [`PASSING_BUSY`].
fn passing_busy(run: &Run<'_>) -> bool {
    let last = run.cover.as_ref().and_then(|c| c.passed().1.at);
    last.is_some_and(|at| {
        let since = Timestamp::now().duration_since(at);
        Duration::try_from(since).is_ok_and(|d| d < PASSING_BUSY)
    })
}

/// When the next step runs: soon while records sent ahead wait to be signed (later while its
/// pass-through is busy), else after `otherwise`.
fn next_step(run: &Run<'_>, otherwise: Duration) -> Duration {
    match (run.mem.ahead.is_empty(), passing_busy(run)) {
        (true, _) => otherwise,
        (false, true) => SIGN_BEHIND_BUSY_EVERY.min(otherwise),
        (false, false) => SIGN_BEHIND_EVERY.min(otherwise),
    }
}

/// What `spec.canary` lets a step decide.
enum Gate {
    /// These records (all the candidates once the canary passed, else the canary's own).
    Go(Vec<DeadLetter>),
    /// Nothing: the canary's records are being carried out or watched.
    Watch,
    /// The canary failed: why, naming its records.
    Stop(String),
}

/// Under `spec.canary`, the canary goes first: picked at the first step with candidates (spread
/// across them, written before any is signed so a restart keeps the same ones), signed at the
/// replay's pace, then watched (`dlq_core::replay::canary::verdict`); only once it passed do
/// the other candidates go. Without a canary, or once it passed, every candidate goes.
async fn canary_gate(run: &mut Run<'_>, candidates: Vec<DeadLetter>) -> Result<Gate> {
    let Some(canary) = run.replay.spec.canary.clone() else {
        return Ok(Gate::Go(candidates));
    };
    let status = run.status.canary.get_or_insert_with(Default::default);
    if status.passed() || (status.names.is_empty() && candidates.is_empty()) {
        return Ok(Gate::Go(candidates));
    }
    if status.names.is_empty() {
        let all: Vec<&DeadLetter> = candidates.iter().collect();
        status.names = replay::canary::picks(&all, canary.count())
            .iter()
            .map(|r| r.name_any())
            .collect();
        tracing::info!(namespace = %run.ns, replay = %run.name, canary = ?status.names, "replay canary picked");
        write(run).await?;
    }
    let names = run
        .status
        .canary
        .as_ref()
        .map(|c| c.names.clone())
        .unwrap_or_default();
    let first: Vec<DeadLetter> = candidates
        .into_iter()
        .filter(|r| names.contains(&r.name_any()))
        .collect();
    if !first.is_empty() {
        return Ok(Gate::Go(first));
    }
    let records: Vec<&Summary> = run.records.iter().map(|r| r.as_ref()).collect();
    let carried_out_at = run
        .status
        .canary
        .as_ref()
        .and_then(|c| c.carried_out_at.as_ref())
        .map(|t| t.0);
    let now = Timestamp::now();
    match replay::canary::verdict(&names, &records, carried_out_at, now, canary.observe()) {
        replay::canary::Verdict::Carrying => Ok(Gate::Watch),
        replay::canary::Verdict::Watching { since } => {
            if let Some(c) = run.status.canary.as_mut() {
                c.carried_out_at = Some(Time(since));
            }
            Ok(Gate::Watch)
        }
        replay::canary::Verdict::Failed(why) => Ok(Gate::Stop(why)),
        replay::canary::Verdict::Passed => {
            canary_passed(run, names.len()).await?;
            Ok(Gate::Watch)
        }
    }
}

/// The canary passed: said at once (status, a Normal Event); the next step decides the rest.
async fn canary_passed(run: &mut Run<'_>, count: usize) -> Result<()> {
    if let Some(canary) = run.status.canary.as_mut() {
        canary.passed_at = Some(Time(Timestamp::now()));
    }
    write(run).await?;
    let observe = run
        .replay
        .spec
        .canary
        .as_ref()
        .map(|c| c.observe())
        .unwrap_or_default();
    let message = format!(
        "canary passed: {count} records carried out, none came back or failed within {}s; deciding the rest",
        observe.as_secs()
    );
    tracing::info!(namespace = %run.ns, replay = %run.name, "{message}");
    let plan = EventPlan::normal(reason::CANARY_PASSED, action::REPLAY, message);
    run.ctx
        .apiserver
        .publish(reference(run.replay), &plan)
        .await;
    Ok(())
}

/// How long the pace has run. When this process started the run, since its first decision
/// (nothing before it): slow steps before the first decision must not buy a burst that outruns
/// the rate. A process that took the run over (a restart, a new leader) counts since the run
/// started, and so catches up, within the burst.
fn paced_for(mem: &Memory, started: &replay::Start<'_>, decided: usize) -> Duration {
    match mem.first {
        Some(first) if mem.started_here && mem.signed.len() == decided => first.elapsed(),
        None if mem.started_here && decided == 0 => Duration::ZERO,
        _ => Duration::try_from(Timestamp::now().duration_since(started.at)).unwrap_or_default(),
    }
}

/// The part of `batch` a standing replay's budget under `max` still allows (its sources'
/// passes take from the same budget); all of it for another replay.
fn claim<'b>(run: &Run<'_>, batch: &'b [DeadLetter]) -> &'b [DeadLetter] {
    match &run.cover {
        Some(cover) => &batch[..cover.claim(batch.len())],
        None => batch,
    }
}

/// Writes the progress at most every [`PROGRESS_EVERY`].
async fn write_progress(run: &mut Run<'_>) -> Result<()> {
    if run
        .mem
        .written_at
        .is_none_or(|t| t.elapsed() >= PROGRESS_EVERY)
    {
        write(run).await?;
    }
    Ok(())
}

/// Covers a standing replay's group for the sources (made at its first step in this process,
/// renewed at each), and folds what passed through since into its status. Why it must stop,
/// when its pass-through enqueues fail beyond `failureRatio`.
fn stand(run: &mut Run<'_>) -> Option<String> {
    let uid = run.replay.metadata.uid.clone().unwrap_or_default();
    let (status, spec, name) = (&run.status, &run.replay.spec, &run.name);
    let cover = run.standing.cover(&run.ns, &spec.queue, &uid, || {
        let tally = Tally {
            sample: status.sample.clone(),
            at: status.passed_at.as_ref().map(|t| t.0),
        };
        let log = Arc::new(ReplayLog {
            apiserver: run.ctx.apiserver.clone(),
            replay: run.replay.clone(),
        });
        let counts = (status.decided, status.passed_through);
        Cover::new(&uid, name, spec, counts, tally, log)
    });
    cover.renew();
    cover.hold(spec.paused() || spec.canary_holds(status));
    cover.decided_at_least(run.status.decided);
    fold(&mut run.status, &cover);
    run.cover = Some(cover.clone());
    let bounds = run.replay.spec.bounds();
    let ratio = cover.failure_ratio()?;
    (ratio > bounds.failure_ratio).then(|| {
        let why = cover
            .failures()
            .map(|f| format!(" ({f})"))
            .unwrap_or_default();
        format!(
            "pass-through enqueue failure ratio {:.0}% over the last {} exceeds {:.0}%{why}",
            ratio * 100.0,
            bounds.window,
            bounds.failure_ratio * 100.0
        )
    })
}

/// Where a standing replay's passes are written before their acknowledgement: its status'
/// pass-through fields alone.
struct ReplayLog {
    apiserver: Arc<dyn Apiserver>,
    replay: DeadLetterReplay,
}

impl PassLog for ReplayLog {
    fn write<'a>(
        &'a self,
        passed: i64,
        tally: &'a Tally,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        async move {
            let passed = PassedThrough {
                passed_through: passed,
                sample: tally.sample.clone(),
                passed_at: tally.at.map(Time),
            };
            self.apiserver
                .write_replay_passed(&self.replay, &passed)
                .await
        }
        .boxed()
    }
}

/// What `cover` passed through, into `status` (never below what it already says).
fn fold(status: &mut DeadLetterReplayStatus, cover: &Cover) {
    let (passed, tally) = cover.passed();
    status.passed_through = status.passed_through.max(passed);
    status.sample = tally.sample;
    status.passed_at = tally.at.map(Time);
}

/// Whether a standing replay with nothing left to decide is over: `max` reached, or its
/// group's dead messages stopped coming (`dlq_core::replay::standing_done`: the broker seen
/// empty since the last one, or none for `settleSeconds`).
fn standing_over(run: &Run<'_>, started: &replay::Start<'_>) -> bool {
    let spec = &run.replay.spec;
    let done = run.status.decided + run.status.passed_through;
    if spec.max.is_some_and(|m| done >= m) || run.cover.as_ref().is_some_and(|c| c.spent()) {
        return true;
    }
    let selector = spec.selector();
    let newest_record = run
        .records
        .iter()
        .filter(|r| selector.matches_facts(r.as_ref()))
        .filter_map(|r| r.created())
        .max();
    let passed_at = run.status.passed_at.as_ref().map(|t| t.0);
    // A message of the group seen in the broker, passed or not (one waiting behind others).
    let sighted = run.cover.as_ref().and_then(|c| c.last_sighted());
    let last_came = [Some(started.at), newest_record, passed_at, sighted]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(started.at);
    let backlog = run
        .ctx
        .queue(&run.ns, &spec.queue)
        .and_then(|q| q.status.as_ref()?.backlog.clone())
        .and_then(|b| Some((b.messages, b.observed_at?.0)));
    replay::standing_done(backlog, last_came, Timestamp::now(), spec.settle())
}

/// Signs `batch` concurrently; remembers what was signed. A refusal by the apiserver (an
/// admission policy, RBAC) ends the replay with its words.
async fn sign_batch(run: &mut Run<'_>, batch: &[DeadLetter]) -> Result<Option<String>> {
    let spec = &run.replay.spec;
    let approvers = run
        .status
        .approval
        .as_ref()
        .map(|a| a.approved_by.clone())
        .unwrap_or_default();
    let note = spec.decision_note(&run.name, &approvers);
    let signature = Signature {
        action: spec.action(),
        by: &spec.by,
        note: &note,
        replay: &run.name,
        replay_uid: run.replay.metadata.uid.as_deref().unwrap_or_default(),
    };
    let selector = spec.selector();
    let (ctx, ns) = (run.ctx, run.ns.as_str());
    let signing: Vec<BoxFuture<'_, (String, Result<Signed>)>> = batch
        .iter()
        .map(|r| {
            let (signature, selector) = (&signature, &selector);
            async move { (r.name_any(), sign(ctx, ns, r, signature, selector).await) }.boxed()
        })
        .collect();
    let results: Vec<(String, Result<Signed>)> = futures::stream::iter(signing)
        .buffer_unordered(SIGN_CONCURRENCY)
        .collect()
        .await;
    let mut refusal = None;
    for (name, result) in results {
        match result? {
            Signed::Yes => {
                let now = Instant::now();
                run.mem.first.get_or_insert(now);
                run.mem.last = Some(now);
                run.mem.signed.push(name);
            }
            Signed::Skipped => {}
            Signed::Refused(why) => refusal = Some(why),
        }
    }
    let signed = i64::try_from(run.mem.signed.len()).unwrap_or(i64::MAX);
    run.status.decided = run.status.decided.max(signed);
    Ok(refusal)
}

enum Signed {
    Yes,
    /// Changed since selected and no longer matching (resolved, decided by someone else).
    Skipped,
    Refused(String),
}

/// Signs one record with a compare-and-swap; on 409 re-reads and signs again if it still
/// matches.
async fn sign(
    ctx: &Context,
    ns: &str,
    record: &DeadLetter,
    signature: &Signature<'_>,
    selector: &replay::ReplaySelector,
) -> Result<Signed> {
    let name = record.name_any();
    let mut current = record.clone();
    for _ in 0..ATTEMPTS {
        match ctx.apiserver.sign_record(&current, signature).await {
            Ok(()) => return Ok(Signed::Yes),
            Err(e) if is_conflict(&e) => {
                let fresh = ctx.apiserver.get_record(ns, &name).await;
                match fresh.map_err(|source| ReplayError::Read {
                    name: name.clone(),
                    source,
                })? {
                    Some(fresh) if selector.matches(&fresh) => current = fresh,
                    _ => return Ok(Signed::Skipped),
                }
            }
            // Resolved or decided meanwhile: the CRD refuses the change.
            Err(kube::Error::Api(s)) if s.code == 422 => return Ok(Signed::Skipped),
            Err(kube::Error::Api(s)) if s.code == 403 => {
                return Ok(Signed::Refused(format!(
                    "the apiserver refused to sign {name}: {}",
                    s.message
                )));
            }
            Err(source) => return Err(ReplayError::Sign { name, source }),
        }
    }
    Ok(Signed::Skipped)
}

/// Nothing left to decide: complete once every decision is carried out or the settle time
/// passed (the records keep their decisions; the DeadLetter reconciler goes on retrying).
async fn settle(run: &mut Run<'_>, observed: &Observed) -> Result<Action> {
    let now = Timestamp::now();
    let decided_at = run.status.decided_at.get_or_insert(Time(now)).0;
    let waited = Duration::try_from(now.duration_since(decided_at)).unwrap_or_default();
    let pending = observed.count(Outcome::Pending) + observed.count(Outcome::Failing);
    if pending == 0 || waited >= run.replay.spec.settle() {
        return finish(run, observed, None).await;
    }
    write(run).await?;
    Ok(Action::requeue(SETTLE_POLL))
}

/// Ends the run: on a stop, withdraws the decisions not carried out yet; then the final
/// status, and the decision record (an Event on the queue and on the replay).
async fn finish(run: &mut Run<'_>, observed: &Observed, stop: Option<String>) -> Result<Action> {
    let uid = run.replay.metadata.uid.clone().unwrap_or_default();
    if let Some(cover) = run.standing.uncover(&run.ns, &uid) {
        // Messages in the middle of passing through when the cover ended are counted too.
        cover.passing_done(PASSING_WAIT).await;
        run.cover = Some(cover);
    }
    if let Some(cover) = &run.cover {
        fold(&mut run.status, cover);
    }
    let now = Timestamp::now();
    if stop.is_some() {
        sign_all_behind(run).await?;
        let withdrawn = withdraw_undone(run).await?;
        run.status.withdrawn += i64::try_from(withdrawn).unwrap_or(0);
    }
    let failing = observed.count(Outcome::Failing);
    let status = &mut run.status;
    status.failed = i64::try_from(failing).unwrap_or(0);
    status.decided_at.get_or_insert(Time(now));
    status.finished_at = Some(Time(now));
    status.skipped = (status.selected - status.decided).max(0);
    let secs = decide_secs(&run.mem, status);
    status.achieved_rate = Some(achieved_rate(&run.mem, status, secs));
    status.stop_reason = stop.clone();
    let phase = match &stop {
        Some(_) => ReplayPhase::Stopped,
        None => ReplayPhase::Completed,
    };
    let summary = replay::summary(run.replay, &run.status, secs);
    run.status.summary = Some(summary.clone());
    set_phase(
        run,
        phase,
        phase.as_str(),
        stop.as_deref().unwrap_or("completed"),
    );
    write(run).await?;
    tracing::info!(namespace = %run.ns, replay = %run.name, phase = phase.as_str(), summary = %summary, "replay ended");
    record(run, stop.is_some(), &summary).await;
    Ok(Action::await_change())
}

/// Takes back this replay's decisions that were not carried out (re-read, still Parked with a
/// decision and our label), so those records stay Parked. How many were taken back.
async fn withdraw_undone(run: &Run<'_>) -> Result<usize> {
    let mut names: Vec<String> = run
        .records
        .iter()
        .filter(|r| ours(run, r.as_ref()))
        .filter(|r| {
            matches!(
                replay::outcome_of(r.as_ref()),
                Outcome::Pending | Outcome::Failing
            )
        })
        .map(|r| r.name.to_string())
        .collect();
    names.extend(run.mem.signed.iter().cloned());
    names.sort();
    names.dedup();
    let mut withdrawn = 0;
    for name in names {
        if withdraw(run, &name).await? {
            withdrawn += 1;
        }
    }
    Ok(withdrawn)
}

/// Whether this replay signed `r`.
fn ours(run: &Run<'_>, r: &impl Facts) -> bool {
    replay::decided_by(r, run.replay_ref())
}

impl Run<'_> {
    fn replay_ref(&self) -> ReplayRef<'_> {
        ReplayRef {
            name: &self.name,
            uid: self.replay.metadata.uid.as_deref().unwrap_or_default(),
        }
    }
}

/// Withdraws one decision, re-reading on conflict (the record reconciler may be writing a
/// condition). False when there is nothing of ours to take back.
async fn withdraw(run: &Run<'_>, name: &str) -> Result<bool> {
    for _ in 0..ATTEMPTS {
        let read = run.ctx.apiserver.get_record(&run.ns, name).await;
        let Some(r) = read.map_err(|source| ReplayError::Read {
            name: name.to_string(),
            source,
        })?
        else {
            return Ok(false);
        };
        if r.phase() != Phase::Parked || r.spec.action.is_none() || !ours(run, &r) {
            return Ok(false);
        }
        if run.ctx.claims.confirmed_by(&redrive_key(&r)).is_some() {
            // Its job is on the target: its reconcile writes the resolution.
            return Ok(false);
        }
        match run.ctx.apiserver.withdraw_record(&r).await {
            Ok(()) => return Ok(true),
            Err(e) if is_conflict(&e) => continue,
            Err(source) => {
                return Err(ReplayError::Sign {
                    name: name.to_string(),
                    source,
                });
            }
        }
    }
    Ok(false)
}

/// Seconds spent deciding: measured by this process when it made every decision, else from
/// the status times.
fn decide_secs(mem: &Memory, status: &DeadLetterReplayStatus) -> f64 {
    match (mem.first, mem.last) {
        (Some(first), Some(last)) if mem.signed.len() as i64 == status.decided => {
            last.duration_since(first).as_secs_f64()
        }
        _ => match (&status.started_at, &status.decided_at) {
            (Some(s), Some(d)) => d.0.duration_since(s.0).as_secs_f64().max(0.0),
            _ => 0.0,
        },
    }
}

/// Decisions per second: the gaps between decisions (the first goes at once), rounded to 0.1.
fn achieved_rate(mem: &Memory, status: &DeadLetterReplayStatus, secs: f64) -> f64 {
    let gaps = if mem.signed.len() as i64 == status.decided {
        status.decided - 1
    } else {
        status.decided
    };
    if gaps <= 0 || secs <= 0.0 {
        return 0.0;
    }
    (gaps as f64 / secs * 10.0).round() / 10.0
}

fn set_phase(run: &mut Run<'_>, phase: ReplayPhase, reason: &str, message: &str) {
    let generation = run.replay.metadata.generation;
    let status = &mut run.status;
    status.phase = Some(phase);
    status.observed_generation = generation;
    conditions::set(
        &mut status.conditions,
        Cond {
            type_: conditions::READY,
            status: !matches!(
                phase,
                ReplayPhase::Pending | ReplayPhase::Paused | ReplayPhase::AwaitingApproval
            ),
            reason,
            message,
        },
        generation,
        &Time(Timestamp::now()),
    );
}

/// Writes the status when it changed since this process last wrote it. A standing replay's
/// passes are folded in during its cover's journal turn: its sources' own writes of them
/// take turns with this one, so `passedThrough` never goes back.
async fn write(run: &mut Run<'_>) -> Result<()> {
    let cover = run.cover.clone();
    let mut journal = match &cover {
        Some(cover) => {
            let turn = cover.journal().await;
            fold(&mut run.status, cover);
            Some(turn)
        }
        None => None,
    };
    if run.mem.status.as_ref() == Some(&run.status) {
        return Ok(());
    }
    run.ctx
        .apiserver
        .write_replay_status(run.replay, &run.status)
        .await
        .map_err(|source| ReplayError::WriteStatus {
            name: run.name.clone(),
            source,
        })?;
    if let Some(logged) = journal.as_deref_mut() {
        *logged = (*logged).max(run.status.passed_through);
    }
    run.mem.status = Some(run.status.clone());
    run.mem.written_at = Some(Instant::now());
    Ok(())
}

/// The decision record's Event on the queue (as the CLI runbook wrote it); the replay's own
/// status is the permanent one.
async fn record(run: &Run<'_>, stopped: bool, summary: &str) {
    let plan = if stopped {
        EventPlan::warning(reason::REPLAY_STOPPED, action::REPLAY, summary)
    } else {
        EventPlan::normal(reason::REPLAY, action::REPLAY, summary)
    };
    publish_on_queue(run, &plan).await;
}

async fn publish_on_queue(run: &Run<'_>, plan: &EventPlan) {
    if let Some(queue) = run.ctx.queue(&run.ns, &run.replay.spec.queue) {
        run.ctx
            .apiserver
            .publish(reference(queue.as_ref()), plan)
            .await;
    }
}

#[cfg(test)]
mod tests;
