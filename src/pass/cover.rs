//! One running standing replay as the sources see it: a [`Cover`] of its failure group on its
//! queue, with what a pass-through needs of it: the one budget under `max` for the replay's
//! decisions and its passes, the pace (`rate`), the lapse of a cover its replay stopped
//! renewing, the window of pass-through outcomes its `failureRatio` reads, and the log
//! ([`PassLog`]) a pass is written into before the source acknowledges it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use jiff::Timestamp;

use dlq_core::api::Action;
use dlq_core::conditions::truncate;
use dlq_core::replay::{DeadLetterReplaySpec, ReplaySelector, SAMPLE};

use crate::targets::enqueue::EnqueueError;

/// How long a cover lasts without a step of its replay (a running replay steps at least every
/// two seconds).
pub const LAPSE: Duration = Duration::from_secs(15);

/// Writes what a replay passed through into its status (the replay controller gives it, with
/// the replay's name): the count auditors read, written before the source acknowledges.
pub trait PassLog: Send + Sync {
    /// Writes `passed` and `tally` (never a smaller count than an earlier write of the same
    /// cover: the writes are taken in turn, see [`Cover::journal`]).
    fn write<'a>(&'a self, passed: i64, tally: &'a Tally)
    -> BoxFuture<'a, Result<(), kube::Error>>;
}

/// The log of a cover made without one (unit tests): nothing to write.
pub struct NoLog;

impl PassLog for NoLog {
    fn write<'a>(&'a self, _: i64, _: &'a Tally) -> BoxFuture<'a, Result<(), kube::Error>> {
        Box::pin(async { Ok(()) })
    }
}

/// How long a pass's log write is retried before the source acknowledges it anyway (the
/// count then stays in memory, for the replay's next status write).
const LOG_RETRY: Duration = Duration::from_millis(200);

/// One running standing replay, as a source sees it.
pub struct Cover {
    /// The replay's uid: one cover per run, kept across its steps.
    pub(super) uid: String,
    pub replay: String,
    selector: ReplaySelector,
    pub(super) action: Action,
    /// Seconds between two pass-throughs (None: the broker's speed).
    gap: Option<Duration>,
    next_slot: tokio::sync::Mutex<tokio::time::Instant>,
    /// When the cover lapses unless its replay's next step renews it: a replay deleted while
    /// it runs, or a leader that stopped reconciling, passes nothing more.
    lapses_at: Mutex<tokio::time::Instant>,
    /// Most records decided and messages passed together (the replay's `max`).
    limit: Option<i64>,
    /// What it decided, passed, and is passing: one budget under `limit`.
    spent: Mutex<Spent>,
    /// Where passes are written before they are acknowledged, and the count written last
    /// (held while writing: writes are taken in turn, so a count never goes back).
    log: Arc<dyn PassLog>,
    logged: tokio::sync::Mutex<i64>,
    /// When a message of its group was last seen in the broker, passed or not.
    sighted: Mutex<Option<Timestamp>>,
    /// The last `stopWhen.window` pass-through outcomes, which the replay's `failureRatio`
    /// bound reads as it reads its records' redrives, and why the last failure failed.
    recent: Mutex<Recent>,
    window: usize,
    tally: Mutex<Tally>,
    /// Its replay is paused (`spec.paused`): it still sees its group's messages (so the run
    /// does not look over when it resumes), but passes none.
    held: std::sync::atomic::AtomicBool,
}

/// The last pass-through outcomes of a cover: None an enqueue that went, else its failure's
/// reason (`EnqueueError::reason`, a bounded set); and the last failure in its words.
#[derive(Default)]
struct Recent {
    outcomes: VecDeque<Option<&'static str>>,
    last_failure: Option<String>,
}

/// How much of the last failure's words a stop reason quotes.
const LAST_FAILURE_BYTES: usize = 256;

/// A cover's budget under `max`.
#[derive(Default, Debug, Clone, Copy)]
struct Spent {
    decided: i64,
    passed: i64,
    /// Messages taken, their requeue not answered yet.
    passing: i64,
}

impl Spent {
    fn room(&self, limit: Option<i64>) -> i64 {
        limit.map_or(i64::MAX, |l| {
            (l - self.decided - self.passed - self.passing).max(0)
        })
    }
}

/// What passed through, beyond the count.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct Tally {
    pub sample: Vec<String>,
    pub at: Option<Timestamp>,
}

impl Cover {
    /// The cover of a running standing replay, counting on from what its status says it
    /// decided and passed; `log` writes its passes.
    pub fn new(
        uid: &str,
        replay: &str,
        spec: &DeadLetterReplaySpec,
        (decided, passed): (i64, i64),
        tally: Tally,
        log: Arc<dyn PassLog>,
    ) -> Self {
        Cover {
            uid: uid.to_string(),
            replay: replay.to_string(),
            selector: spec.selector(),
            action: spec.action(),
            gap: spec.pass_rate().map(|r| Duration::from_secs_f64(1.0 / r)),
            next_slot: tokio::sync::Mutex::new(tokio::time::Instant::now()),
            lapses_at: Mutex::new(tokio::time::Instant::now() + LAPSE),
            limit: spec.max,
            spent: Mutex::new(Spent {
                decided,
                passed,
                passing: 0,
            }),
            log,
            logged: tokio::sync::Mutex::new(passed),
            sighted: Mutex::default(),
            recent: Mutex::default(),
            window: spec.bounds().window,
            tally: Mutex::new(tally),
            held: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Keeps the cover for another [`LAPSE`] (each step of its replay).
    pub fn renew(&self) {
        *lock(&self.lapses_at) = tokio::time::Instant::now() + LAPSE;
    }

    fn lapsed(&self) -> bool {
        *lock(&self.lapses_at) <= tokio::time::Instant::now()
    }

    /// Holds its passes while its replay is paused (`true`), or lets them go again.
    pub fn hold(&self, paused: bool) {
        self.held.store(paused, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether its passes are held (its replay paused).
    pub(super) fn held(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Takes one message of the budget; false once `max` is spent.
    pub(super) fn take(&self) -> bool {
        let mut spent = lock(&self.spent);
        if spent.room(self.limit) == 0 {
            return false;
        }
        spent.passing += 1;
        true
    }

    /// Gives back a message taken with [`Cover::take`] that did not pass.
    pub(super) fn give_back(&self) {
        lock(&self.spent).passing -= 1;
    }

    /// Takes up to `n` decisions of the budget (what `max` leaves beside the passes); how
    /// many the replay may sign now.
    pub fn claim(&self, n: usize) -> usize {
        let mut spent = lock(&self.spent);
        let n = i64::try_from(n)
            .unwrap_or(i64::MAX)
            .min(spent.room(self.limit));
        spent.decided += n;
        usize::try_from(n).unwrap_or(0)
    }

    /// Whether `max` leaves room for one more message.
    pub(super) fn has_room(&self) -> bool {
        lock(&self.spent).room(self.limit) > 0
    }

    /// Whether `max` is spent: decided, passed and passing fill it, so the replay can do
    /// nothing more (records of its group parked since wait for another decision).
    pub fn spent(&self) -> bool {
        self.limit.is_some() && lock(&self.spent).room(self.limit) == 0
    }

    /// Gives back `n` claimed decisions that were not signed (a record resolved meanwhile).
    pub fn unclaim(&self, n: usize) {
        lock(&self.spent).decided -= i64::try_from(n).unwrap_or(0);
    }

    /// What the records show was decided (a restarted leader's signatures): never less.
    pub fn decided_at_least(&self, decided: i64) {
        let mut spent = lock(&self.spent);
        spent.decided = spent.decided.max(decided);
    }

    /// A message of its group was seen in the broker now.
    pub(super) fn sight(&self) {
        *lock(&self.sighted) = Some(Timestamp::now());
    }

    /// When a message of its group was last seen in the broker (passed or not).
    pub fn last_sighted(&self) -> Option<Timestamp> {
        *lock(&self.sighted)
    }

    /// Whether it covers `facts` now: running, and of its group.
    pub(super) fn takes(&self, facts: &impl dlq_core::facts::Facts) -> bool {
        !self.lapsed() && self.selector.matches(facts)
    }

    /// The turn to write this cover's passes: the count written last, held while writing so
    /// that writes of the replay's status are taken in turn and a count never goes back.
    pub async fn journal(&self) -> tokio::sync::MutexGuard<'_, i64> {
        self.logged.lock().await
    }

    /// Waits until the replay's status says at least `passed` (one write for every pass
    /// waiting meanwhile), so the source acknowledges only what the log holds. Gives up, the
    /// count left in memory for the next status write, once the cover lapsed.
    pub(super) async fn logged(&self, passed: i64) {
        let mut attempt = 0u32;
        loop {
            let mut logged = self.journal().await;
            if *logged >= passed {
                return;
            }
            let (now, tally) = self.passed();
            match self.log.write(now, &tally).await {
                Ok(()) => {
                    *logged = now;
                    return;
                }
                Err(error) if self.lapsed() => {
                    tracing::warn!(replay = %self.replay, %error, "writing passed-through messages failed and the replay no longer steps; acknowledging, the count stays in memory");
                    return;
                }
                Err(error) => {
                    drop(logged);
                    attempt = attempt.saturating_add(1);
                    let wait = dlq_core::decide::backoff(attempt, LOG_RETRY);
                    tracing::debug!(replay = %self.replay, %error, retry_in = ?wait, "writing passed-through messages failed; the source acknowledges none until it is written");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Waits (at most `wait`) until no message is in the middle of passing through, so an
    /// uncovered replay's final count includes them.
    pub async fn passing_done(&self, wait: Duration) {
        let until = tokio::time::Instant::now() + wait;
        while lock(&self.spent).passing > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The share of failed enqueues among the last `window` pass-throughs (None until there
    /// were `window`).
    pub fn failure_ratio(&self) -> Option<f64> {
        let recent = lock(&self.recent);
        let outcomes = &recent.outcomes;
        if outcomes.len() < self.window {
            return None;
        }
        let failed = outcomes.iter().filter(|o| o.is_some()).count();
        Some(failed as f64 / outcomes.len() as f64)
    }

    /// Why the pass-throughs of the window failed, for a stop reason: each reason with its
    /// count, most first, and the last failure's words (cut to a few hundred bytes), as in
    /// `3 BrokerUnreachable; last: ...`. None when none of them failed.
    pub fn failures(&self) -> Option<String> {
        let recent = lock(&self.recent);
        let mut counts: Vec<(&str, usize)> = Vec::new();
        for reason in recent.outcomes.iter().flatten() {
            match counts.iter_mut().find(|(r, _)| r == reason) {
                Some((_, n)) => *n += 1,
                None => counts.push((reason, 1)),
            }
        }
        if counts.is_empty() {
            return None;
        }
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let mut said = counts
            .iter()
            .map(|(reason, n)| format!("{n} {reason}"))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(last) = &recent.last_failure {
            said.push_str("; last: ");
            said.push_str(&truncate(last, LAST_FAILURE_BYTES));
        }
        Some(said)
    }

    /// Keeps one pass-through's outcome in the window: `failure` when its enqueue failed.
    pub(super) fn outcome(&self, failure: Option<&EnqueueError>) {
        let mut recent = lock(&self.recent);
        if recent.outcomes.len() == self.window {
            recent.outcomes.pop_front();
        }
        recent.outcomes.push_back(failure.map(EnqueueError::reason));
        if let Some(e) = failure {
            recent.last_failure = Some(e.to_string());
        }
    }

    /// Messages passed through so far, with the sample and the last time.
    pub fn passed(&self) -> (i64, Tally) {
        (lock(&self.spent).passed, lock(&self.tally).clone())
    }

    /// Waits for this message's turn at the replay's rate (none: at once).
    pub(super) async fn turn(&self) {
        let Some(gap) = self.gap else { return };
        let at = {
            let mut next = self.next_slot.lock().await;
            let now = tokio::time::Instant::now();
            let at = (*next).max(now);
            *next = at + gap;
            at
        };
        tokio::time::sleep_until(at).await;
    }

    /// Counts a message that passed; the count with it, for [`Cover::logged`].
    pub(super) fn count(&self, job: &str) -> i64 {
        let passed = {
            let mut spent = lock(&self.spent);
            spent.passing -= 1;
            spent.passed += 1;
            spent.passed
        };
        let mut tally = lock(&self.tally);
        if tally.sample.len() < SAMPLE {
            tally.sample.push(job.to_string());
        }
        tally.at = Some(Timestamp::now());
        passed
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
