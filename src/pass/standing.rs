//! Standing replays as the sources see them: which failure group of which queue a running
//! standing replay covers, so that a source passes a matching dead message straight from the
//! broker to the target (requeue, then the source acks) instead of making a record of it; and
//! what passed, which the replay controller writes into the replay's status.
//!
//! The replay controller (leader only) covers and uncovers; the sources (leader only too) ask
//! [`Standing::pass`] before parking. A message passes only while its replay is running here:
//! a stop, a bound or the end of the run uncovers it, and the next message parks as before. A
//! requeue that fails parks the message instead, so it stays visible as a record (which the
//! replay then decides, and whose failing requeue counts toward its `failureRatio`).
//!
//! `max` bounds the records a replay decides and the messages it passes together: both take
//! from one [`Cover`]'s budget. A pass is written into the replay's status ([`PassLog`])
//! before the source acknowledges it, passes waiting together sharing one write: the decision
//! log never says less than what reached the target, whenever the operator dies.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use jiff::Timestamp;
use kube::ResourceExt;

use dlq_core::api::{Action, DeadLetterQueue, Job};
use dlq_core::park::{ParkRequest, arriving, message_key};
use dlq_core::replay::{DeadLetterReplaySpec, ReplaySelector, SAMPLE};

use crate::target::TargetError;
use crate::target::enqueue::EnqueueError;

/// How long a cover lasts without a step of its replay (a running replay steps at least every
/// two seconds).
pub const LAPSE: Duration = Duration::from_secs(15);

/// Enqueues a passed-through job on its queue's target (the wiring gives the operator's
/// targets; a source never names a target).
pub trait PassTarget: Send + Sync {
    /// Enqueues `job` untouched with idempotency key `key`, answering once the broker confirmed
    /// it.
    fn requeue<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        job: &'a Job,
        key: String,
    ) -> BoxFuture<'a, Result<(), EnqueueError>>;
}

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

/// The target of a process that passes nothing through (tests that build no targets).
struct NoTarget;

impl PassTarget for NoTarget {
    fn requeue<'a>(
        &'a self,
        _: &'a DeadLetterQueue,
        _: &'a Job,
        _: String,
    ) -> BoxFuture<'a, Result<(), EnqueueError>> {
        Box::pin(async {
            Err(EnqueueError::NoTarget {
                source: TargetError::Config("no target to pass through to".into()),
            })
        })
    }
}

/// One running standing replay, as a source sees it.
pub struct Cover {
    /// The replay's uid: one cover per run, kept across its steps.
    uid: String,
    pub replay: String,
    selector: ReplaySelector,
    action: Action,
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
    /// The last `stopWhen.window` pass-through outcomes (false: the enqueue failed), which the
    /// replay's `failureRatio` bound reads as it reads its records' redrives.
    recent: Mutex<VecDeque<bool>>,
    window: usize,
    tally: Mutex<Tally>,
}

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
        }
    }

    /// Keeps the cover for another [`LAPSE`] (each step of its replay).
    pub fn renew(&self) {
        *lock(&self.lapses_at) = tokio::time::Instant::now() + LAPSE;
    }

    fn lapsed(&self) -> bool {
        *lock(&self.lapses_at) <= tokio::time::Instant::now()
    }

    /// Takes one message of the budget; false once `max` is spent.
    fn take(&self) -> bool {
        let mut spent = lock(&self.spent);
        if spent.room(self.limit) == 0 {
            return false;
        }
        spent.passing += 1;
        true
    }

    /// Gives back a message taken with [`Cover::take`] that did not pass.
    fn give_back(&self) {
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
    fn sight(&self) {
        *lock(&self.sighted) = Some(Timestamp::now());
    }

    /// When a message of its group was last seen in the broker (passed or not).
    pub fn last_sighted(&self) -> Option<Timestamp> {
        *lock(&self.sighted)
    }

    /// Whether it covers `facts` now: running, and of its group.
    fn takes(&self, facts: &impl dlq_core::facts::Facts) -> bool {
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
    async fn logged(&self, passed: i64) {
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
        if recent.len() < self.window {
            return None;
        }
        let failed = recent.iter().filter(|ok| !**ok).count();
        Some(failed as f64 / recent.len() as f64)
    }

    fn outcome(&self, ok: bool) {
        let mut recent = lock(&self.recent);
        if recent.len() == self.window {
            recent.pop_front();
        }
        recent.push_back(ok);
    }

    /// Messages passed through so far, with the sample and the last time.
    pub fn passed(&self) -> (i64, Tally) {
        (lock(&self.spent).passed, lock(&self.tally).clone())
    }

    /// Waits for this message's turn at the replay's rate (none: at once).
    async fn turn(&self) {
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
    fn count(&self, job: &str) -> i64 {
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

/// What became of a dead message a source offered.
#[derive(Debug, PartialEq, Eq)]
pub enum Passed {
    /// No standing replay covers it: park it.
    No,
    /// Requeued on the target (or, for a standing drop, discarded): acknowledge it.
    Through { replay: String },
    /// Covered, but its requeue failed: park it, so it stays visible.
    Failed { replay: String, error: EnqueueError },
}

/// The covers by namespace and queue.
type Covers = HashMap<(String, String), Vec<Arc<Cover>>>;

/// The standing replays running in this process, by queue.
#[derive(Clone)]
pub struct Standing {
    covers: Arc<Mutex<Covers>>,
    target: Arc<dyn PassTarget>,
}

impl Default for Standing {
    fn default() -> Self {
        Standing::new(Arc::new(NoTarget))
    }
}

impl Standing {
    pub fn new(target: Arc<dyn PassTarget>) -> Self {
        Standing {
            covers: Arc::default(),
            target,
        }
    }

    /// The cover of replay `uid` on queue `ns/queue`, made with `make` when it has none yet.
    pub fn cover(
        &self,
        ns: &str,
        queue: &str,
        uid: &str,
        make: impl FnOnce() -> Cover,
    ) -> Arc<Cover> {
        let mut covers = lock(&self.covers);
        let list = covers
            .entry((ns.to_string(), queue.to_string()))
            .or_default();
        if let Some(c) = list.iter().find(|c| c.uid == uid) {
            return c.clone();
        }
        let cover = Arc::new(make());
        list.push(cover.clone());
        cover
    }

    /// Ends replay `uid`'s cover: the next message of its group parks.
    pub fn uncover(&self, ns: &str, uid: &str) -> Option<Arc<Cover>> {
        let mut covers = lock(&self.covers);
        let mut gone = None;
        for ((n, _), list) in covers.iter_mut() {
            if n == ns
                && let Some(i) = list.iter().position(|c| c.uid == uid)
            {
                gone = Some(list.remove(i));
            }
        }
        covers.retain(|_, list| !list.is_empty());
        gone
    }

    /// The cover of replay `uid`, if it runs here.
    pub fn get(&self, ns: &str, uid: &str) -> Option<Arc<Cover>> {
        lock(&self.covers)
            .iter()
            .filter(|((n, _), _)| n == ns)
            .flat_map(|(_, list)| list.iter())
            .find(|c| c.uid == uid)
            .cloned()
    }

    /// Whether a standing replay runs on queue `ns/queue` (a source reaches past what waits
    /// for room only then).
    pub fn covers_queue(&self, ns: &str, queue: &str) -> bool {
        !self.covering(ns, queue).is_empty()
    }

    /// Whether a running standing replay with budget left would pass `req`; a message so
    /// covered counts as seen in the broker (its replay does not end while they are).
    pub fn would_pass(&self, queue: &DeadLetterQueue, req: &ParkRequest) -> bool {
        let Some(cover) = self.cover_of(queue, req) else {
            return false;
        };
        cover.sight();
        lock(&cover.spent).room(cover.limit) > 0
    }

    /// The running cover whose group `req` is of, if any.
    fn cover_of(&self, queue: &DeadLetterQueue, req: &ParkRequest) -> Option<Arc<Cover>> {
        let ns = queue.namespace().unwrap_or_default();
        let covers = self.covering(&ns, &queue.name_any());
        if covers.is_empty() {
            return None;
        }
        let facts = arriving(req, queue.seals());
        covers.into_iter().find(|c| c.takes(&facts))
    }

    /// The covers of a queue of `ns` (empty: the fast path of every park).
    fn covering(&self, ns: &str, queue: &str) -> Vec<Arc<Cover>> {
        lock(&self.covers)
            .get(&(ns.to_string(), queue.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    /// Passes `req` (exact bytes `raw`) through when a standing replay covers it: requeued on
    /// the target with the message's own idempotency key ([`message_key`]) and counted on the
    /// replay. The caller acknowledges the message only on [`Passed::Through`].
    pub async fn pass(&self, queue: &DeadLetterQueue, req: &ParkRequest, raw: &[u8]) -> Passed {
        let Some(cover) = self.cover_of(queue, req) else {
            return Passed::No;
        };
        cover.sight();
        if !cover.take() {
            return Passed::No;
        }
        cover.turn().await;
        if cover.action == Action::Redrive {
            let ns = queue.namespace().unwrap_or_default();
            let key = message_key(&ns, &queue.name_any(), req.message.as_deref(), raw);
            let result = self.target.requeue(queue, &req.job, key).await;
            cover.outcome(result.is_ok());
            if let Err(error) = result {
                cover.give_back();
                return Passed::Failed {
                    replay: cover.replay.clone(),
                    error,
                };
            }
        }
        let passed = cover.count(&req.job.id);
        cover.logged(passed).await;
        Passed::Through {
            replay: cover.replay.clone(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::DeadLetterQueueSpec;
    use dlq_core::facts::Facts;

    /// A target that remembers what it was given, or refuses.
    #[derive(Default)]
    struct Remember {
        got: Mutex<Vec<(String, String)>>,
        refuse: bool,
    }

    impl PassTarget for Remember {
        fn requeue<'a>(
            &'a self,
            _: &'a DeadLetterQueue,
            job: &'a Job,
            key: String,
        ) -> BoxFuture<'a, Result<(), EnqueueError>> {
            Box::pin(async move {
                if self.refuse {
                    return Err(EnqueueError::NotConfirmed {
                        target: "remember".into(),
                        source: TargetError::Unreachable("broker down".into()),
                    });
                }
                lock(&self.got).push((job.id.clone(), key));
                Ok(())
            })
        }
    }

    fn queue() -> DeadLetterQueue {
        let mut q = DeadLetterQueue::new("relayer", DeadLetterQueueSpec::default());
        q.metadata.namespace = Some("payments".into());
        q
    }

    fn dead(id: &str, reason: &str) -> ParkRequest {
        let mut r = ParkRequest::new(
            "relayer",
            Job {
                id: id.into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
        )
        .with_message(format!("relayer:dead#{id}"));
        r.reason = reason.into();
        r
    }

    fn standing_spec(req: &ParkRequest, action: Action) -> DeadLetterReplaySpec {
        let group = arriving(req, false).group().into_owned();
        serde_json::from_value(serde_json::json!({
            "queue": "relayer", "by": "carol", "standing": true,
            "selector": {"group": group}, "action": action,
        }))
        .expect("spec")
    }

    /// Issue 47: while a standing redrive covers a group, its dead messages go to the target
    /// with a key that repeats for the same message; other groups' messages park; once
    /// uncovered, the group's messages park again.
    #[tokio::test]
    async fn a_standing_redrive_passes_its_groups_messages_and_no_others() {
        let target = Arc::new(Remember::default());
        let standing = Standing::new(target.clone());
        let q = queue();
        let payer = dead("pi_1/settle", "payer timeout after 30s");
        let spec = standing_spec(&payer, Action::Redrive);
        standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        assert_eq!(
            standing.pass(&q, &payer, b"raw").await,
            Passed::Through {
                replay: "storm".into()
            }
        );
        let same_group = dead("pi_2/settle", "payer timeout after 31s");
        assert!(matches!(
            standing.pass(&q, &same_group, b"raw2").await,
            Passed::Through { .. }
        ));
        let other = dead("pi_3/settle", "card declined");
        assert_eq!(standing.pass(&q, &other, b"raw3").await, Passed::No);
        // The same message again (a crash before its ack): the same key.
        standing.pass(&q, &payer, b"raw").await;
        let got = lock(&target.got).clone();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], got[2], "a repeat carries the first delivery's key");
        assert_ne!(got[0].1, got[1].1);
        let (passed, tally) = standing.get("payments", "u1").expect("cover").passed();
        assert_eq!(passed, 3);
        assert_eq!(tally.sample, ["pi_1/settle", "pi_2/settle", "pi_1/settle"]);
        standing.uncover("payments", "u1");
        assert_eq!(standing.pass(&q, &payer, b"raw").await, Passed::No);
    }

    /// A requeue that fails is not counted and tells the source to park the message instead.
    #[tokio::test]
    async fn a_failed_pass_through_parks_the_message() {
        let standing = Standing::new(Arc::new(Remember {
            refuse: true,
            ..Remember::default()
        }));
        let payer = dead("pi_1/settle", "payer timeout");
        let spec = standing_spec(&payer, Action::Redrive);
        let cover = standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 7),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        assert!(matches!(
            standing.pass(&queue(), &payer, b"raw").await,
            Passed::Failed { .. }
        ));
        assert_eq!(
            cover.passed().0,
            7,
            "counts on from the status, not the failure"
        );
    }

    /// A standing drop acknowledges without enqueueing anything.
    #[tokio::test]
    async fn a_standing_drop_enqueues_nothing() {
        let target = Arc::new(Remember::default());
        let standing = Standing::new(target.clone());
        let payer = dead("pi_1/settle", "payer timeout");
        let spec = standing_spec(&payer, Action::Drop);
        standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        assert!(matches!(
            standing.pass(&queue(), &payer, b"raw").await,
            Passed::Through { .. }
        ));
        assert!(lock(&target.got).is_empty());
    }

    /// A rate paces pass-through: 10/s lets the first through at once and the next 100 ms apart.
    #[tokio::test(start_paused = true)]
    async fn pass_through_keeps_the_replays_rate() {
        let standing = Standing::new(Arc::new(Remember::default()));
        let payer = dead("pi_1/settle", "payer timeout");
        let mut spec = standing_spec(&payer, Action::Redrive);
        spec.rate = Some("10/s".into());
        standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        let start = tokio::time::Instant::now();
        for _ in 0..5 {
            standing.pass(&queue(), &payer, b"raw").await;
        }
        assert_eq!(start.elapsed(), Duration::from_millis(400));
    }

    /// A cover its replay stopped renewing (deleted while running, a leader that stepped down)
    /// passes nothing after [`LAPSE`]; `max` bounds what passes.
    #[tokio::test(start_paused = true)]
    async fn a_cover_lapses_without_its_replay_and_stops_at_max() {
        let standing = Standing::new(Arc::new(Remember::default()));
        let payer = dead("pi_1/settle", "payer timeout");
        let mut spec = standing_spec(&payer, Action::Redrive);
        spec.max = Some(2);
        let cover = standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        for _ in 0..2 {
            assert!(matches!(
                standing.pass(&queue(), &payer, b"raw").await,
                Passed::Through { .. }
            ));
        }
        assert_eq!(
            standing.pass(&queue(), &payer, b"raw").await,
            Passed::No,
            "max"
        );
        assert_eq!(cover.passed().0, 2);
        let roomy = standing_spec(&payer, Action::Redrive);
        standing.uncover("payments", "u1");
        standing.cover("payments", "relayer", "u2", || {
            Cover::new(
                "u2",
                "storm2",
                &roomy,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        tokio::time::advance(LAPSE).await;
        assert_eq!(
            standing.pass(&queue(), &payer, b"raw").await,
            Passed::No,
            "lapsed"
        );
        standing.get("payments", "u2").expect("cover").renew();
        assert!(matches!(
            standing.pass(&queue(), &payer, b"raw").await,
            Passed::Through { .. }
        ));
    }

    /// Issue 57: `max` is one budget for the replay's decisions and its passes: with `max: 3`
    /// and 2 decisions claimed, one message passes; a decision given back lets one more pass.
    #[tokio::test]
    async fn max_bounds_decisions_and_passes_together() {
        let standing = Standing::new(Arc::new(Remember::default()));
        let payer = dead("pi_1/settle", "payer timeout");
        let mut spec = standing_spec(&payer, Action::Redrive);
        spec.max = Some(3);
        let cover = standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        assert_eq!(cover.claim(2), 2);
        let q = queue();
        let pass = || standing.pass(&q, &payer, b"raw");
        assert!(matches!(pass().await, Passed::Through { .. }));
        assert_eq!(pass().await, Passed::No, "2 decided + 1 passed = max");
        assert_eq!(cover.claim(5), 0, "nothing left to decide either");
        cover.unclaim(1);
        assert!(matches!(pass().await, Passed::Through { .. }));
        assert_eq!(cover.passed().0, 2);
    }

    /// A log that remembers every count written, each write taking a while.
    #[derive(Default)]
    struct SlowLog {
        written: Mutex<Vec<i64>>,
    }

    impl PassLog for SlowLog {
        fn write<'a>(
            &'a self,
            passed: i64,
            _: &'a Tally,
        ) -> BoxFuture<'a, Result<(), kube::Error>> {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                lock(&self.written).push(passed);
                Ok(())
            })
        }
    }

    /// Issue 57: a pass returns (and its source acknowledges) only once the log holds its
    /// count; passes waiting together share a write, and a count written never goes back.
    #[tokio::test]
    async fn a_pass_returns_once_the_log_holds_it_and_waiting_passes_share_a_write() {
        let standing = Standing::new(Arc::new(Remember::default()));
        let log = Arc::new(SlowLog::default());
        let payer = dead("pi_1/settle", "payer timeout");
        let spec = standing_spec(&payer, Action::Redrive);
        let cover = standing.cover("payments", "relayer", "u1", || {
            Cover::new("u1", "storm", &spec, (0, 5), Tally::default(), log.clone())
        });
        let q = queue();
        let passes = (0..16).map(|_| standing.pass(&q, &payer, b"raw"));
        for passed in futures::future::join_all(passes).await {
            assert!(matches!(passed, Passed::Through { .. }));
        }
        let written = lock(&log.written).clone();
        assert_eq!(written.last(), Some(&21), "every pass logged: {written:?}");
        assert!(written.len() < 16, "one write per pass: {written:?}");
        assert!(written.windows(2).all(|w| w[0] < w[1]), "{written:?}");
        assert_eq!(*cover.journal().await, 21);
    }

    /// Failed enqueues count toward the replay's `failureRatio` once a window of them is seen.
    #[tokio::test]
    async fn failed_pass_throughs_make_a_failure_ratio_over_the_window() {
        let standing = Standing::new(Arc::new(Remember {
            refuse: true,
            ..Remember::default()
        }));
        let payer = dead("pi_1/settle", "payer timeout");
        let mut spec = standing_spec(&payer, Action::Redrive);
        spec.stop_when = Some(dlq_core::replay::StopWhen {
            window: Some(3),
            ..Default::default()
        });
        let cover = standing.cover("payments", "relayer", "u1", || {
            Cover::new(
                "u1",
                "storm",
                &spec,
                (0, 0),
                Tally::default(),
                Arc::new(NoLog),
            )
        });
        for _ in 0..2 {
            standing.pass(&queue(), &payer, b"raw").await;
        }
        assert_eq!(cover.failure_ratio(), None, "less than a window");
        standing.pass(&queue(), &payer, b"raw").await;
        assert_eq!(cover.failure_ratio(), Some(1.0));
    }
}
