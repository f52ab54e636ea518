//! The standing replays running in this process, by queue ([`Standing`]): the replay
//! controller covers and uncovers their groups; a source offers each dead message through
//! [`PassThrough`], all it may ask, and a covered one is enqueued on the queue's target by the
//! one enqueue path (`crate::targets::enqueue`, keyed by `dlq_core::park::message_key`),
//! counted on its replay and written into its log before the source acknowledges it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use kube::ResourceExt;

use dlq_core::api::{Action, DeadLetter, DeadLetterQueue};
use dlq_core::park::{ParkRequest, arriving, message_key};

use super::cover::{Cover, lock};
use crate::targets::Targets;
use crate::targets::enqueue::{EnqueueError, enqueue_job};

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

/// What a source asks of the standing replays running here, and all it may: whether one runs
/// on its queue, whether one would take a message, and to pass one. Covering and uncovering are
/// the replay controller's, which holds the [`Standing`] itself.
pub trait PassThrough: Send + Sync {
    /// Whether a standing replay runs on queue `ns/queue` (a source reaches past what waits
    /// for room only then).
    fn covers_queue(&self, ns: &str, queue: &str) -> bool;
    /// Whether a running standing replay with budget left would pass `req` (seen, it keeps its
    /// replay running).
    fn would_pass(&self, queue: &DeadLetterQueue, req: &ParkRequest) -> bool;
    /// Passes `req` (exact bytes `raw`) through when a standing replay covers it, matched by
    /// `facts` (the record it would be: its park plan's `arriving`); the source acknowledges
    /// the message only on [`Passed::Through`].
    fn pass<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        req: &'a ParkRequest,
        facts: &'a DeadLetter,
        raw: &'a [u8],
    ) -> BoxFuture<'a, Passed>;
}

/// The standing replays running in this process, by queue, and the targets their passes go
/// to. Built once per scope by `crate::run`, which gives the sources its [`PassThrough`] and
/// the replay controller the whole of it.
#[derive(Clone)]
pub struct Standing {
    covers: Arc<Mutex<Covers>>,
    targets: Arc<dyn Targets>,
}

impl Standing {
    pub fn new(targets: Arc<dyn Targets>) -> Self {
        Standing {
            covers: Arc::default(),
            targets,
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

    /// Whether a standing replay runs on queue `ns/queue` (see [`PassThrough::covers_queue`]).
    pub fn covers_queue(&self, ns: &str, queue: &str) -> bool {
        !self.covering(ns, queue).is_empty()
    }

    /// Whether a running standing replay with budget left would pass `req`; a message so
    /// covered counts as seen in the broker (its replay does not end while they are).
    pub fn would_pass(&self, queue: &DeadLetterQueue, req: &ParkRequest) -> bool {
        let ns = queue.namespace().unwrap_or_default();
        if self.covering(&ns, &queue.name_any()).is_empty() {
            return false;
        }
        let Some(cover) = self.cover_of(queue, &arriving(req, queue.seals())) else {
            return false;
        };
        cover.sight();
        !cover.held() && cover.has_room()
    }

    /// The running cover whose group the record of `facts` is of, if any.
    fn cover_of(&self, queue: &DeadLetterQueue, facts: &DeadLetter) -> Option<Arc<Cover>> {
        let ns = queue.namespace().unwrap_or_default();
        let covers = self.covering(&ns, &queue.name_any());
        covers.into_iter().find(|c| c.takes(facts))
    }

    /// The covers of a queue of `ns` (empty: the fast path of every park).
    fn covering(&self, ns: &str, queue: &str) -> Vec<Arc<Cover>> {
        lock(&self.covers)
            .get(&(ns.to_string(), queue.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    /// [`Standing::pass_arriving`] with the facts a source's park plan gives `req`.
    #[cfg(test)]
    pub async fn pass(&self, queue: &DeadLetterQueue, req: &ParkRequest, raw: &[u8]) -> Passed {
        let facts = arriving(req, queue.seals());
        self.pass_arriving(queue, req, &facts, raw).await
    }

    /// Passes `req` (exact bytes `raw`) through when a standing replay covers the record of
    /// `facts`: requeued on the target with the message's own idempotency key
    /// ([`message_key`]) and counted on the replay. The caller acknowledges the message only on
    /// [`Passed::Through`].
    pub async fn pass_arriving(
        &self,
        queue: &DeadLetterQueue,
        req: &ParkRequest,
        facts: &DeadLetter,
        raw: &[u8],
    ) -> Passed {
        let Some(cover) = self.cover_of(queue, facts) else {
            return Passed::No;
        };
        cover.sight();
        if cover.held() || !cover.take() {
            return Passed::No;
        }
        cover.turn().await;
        if cover.action == Action::Redrive {
            let ns = queue.namespace().unwrap_or_default();
            let key = message_key(&ns, &queue.name_any(), req.message.as_deref(), raw);
            let result = enqueue_job(self.targets.as_ref(), queue, &req.job, key).await;
            cover.outcome(result.as_ref().err());
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

impl PassThrough for Standing {
    fn covers_queue(&self, ns: &str, queue: &str) -> bool {
        Standing::covers_queue(self, ns, queue)
    }

    fn would_pass(&self, queue: &DeadLetterQueue, req: &ParkRequest) -> bool {
        Standing::would_pass(self, queue, req)
    }

    fn pass<'a>(
        &'a self,
        queue: &'a DeadLetterQueue,
        req: &'a ParkRequest,
        facts: &'a DeadLetter,
        raw: &'a [u8],
    ) -> BoxFuture<'a, Passed> {
        Box::pin(Standing::pass_arriving(self, queue, req, facts, raw))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pass::cover::{LAPSE, NoLog, PassLog, Tally};
    use crate::targets::{JobMessage, Target, TargetError};
    use dlq_core::api::{DeadLetterQueueSpec, Job};
    use dlq_core::facts::Facts;
    use dlq_core::replay::DeadLetterReplaySpec;

    /// A target that remembers what it was given (job id and key), or refuses; every queue's.
    #[derive(Default, Clone)]
    struct Remember {
        got: Arc<Mutex<Vec<(String, String)>>>,
        refuse: bool,
    }

    impl Remember {
        fn refusing() -> Self {
            Remember {
                refuse: true,
                ..Remember::default()
            }
        }
    }

    impl Target for Remember {
        fn describe(&self) -> String {
            "remember".into()
        }

        fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
            Box::pin(async move {
                if self.refuse {
                    return Err(TargetError::Unreachable("broker down".into()));
                }
                let key = job.idempotency_key.clone().unwrap_or_default();
                lock(&self.got).push((job.id.clone(), key));
                Ok(())
            })
        }

        fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
            Box::pin(async { Ok(()) })
        }
    }

    impl Targets for Remember {
        fn target<'a>(
            &'a self,
            _: &'a DeadLetterQueue,
        ) -> BoxFuture<'a, Result<Arc<dyn Target>, TargetError>> {
            let target: Arc<dyn Target> = Arc::new(self.clone());
            Box::pin(async move { Ok(target) })
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

    /// Covers `spec`'s group on `payments/relayer` for replay `storm` (uid `uid`), which
    /// passed `passed` already and writes its passes into `log`.
    fn cover_group(
        standing: &Standing,
        uid: &str,
        spec: &DeadLetterReplaySpec,
        passed: i64,
        log: Arc<dyn PassLog>,
    ) -> Arc<Cover> {
        standing.cover("payments", "relayer", uid, || {
            Cover::new(uid, "storm", spec, (0, passed), Tally::default(), log)
        })
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
        cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
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
        let standing = Standing::new(Arc::new(Remember::refusing()));
        let payer = dead("pi_1/settle", "payer timeout");
        let spec = standing_spec(&payer, Action::Redrive);
        let cover = cover_group(&standing, "u1", &spec, 7, Arc::new(NoLog));
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
        cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
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
        cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
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
        let cover = cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
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
        cover_group(&standing, "u2", &roomy, 0, Arc::new(NoLog));
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
        let cover = cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
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
        let cover = cover_group(&standing, "u1", &spec, 5, log.clone());
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
        let standing = Standing::new(Arc::new(Remember::refusing()));
        let payer = dead("pi_1/settle", "payer timeout");
        let mut spec = standing_spec(&payer, Action::Redrive);
        spec.stop_when = Some(dlq_core::replay::StopWhen {
            window: Some(3),
            ..Default::default()
        });
        let cover = cover_group(&standing, "u1", &spec, 0, Arc::new(NoLog));
        for _ in 0..2 {
            standing.pass(&queue(), &payer, b"raw").await;
        }
        assert_eq!(cover.failure_ratio(), None, "less than a window");
        standing.pass(&queue(), &payer, b"raw").await;
        assert_eq!(cover.failure_ratio(), Some(1.0));
        assert_eq!(
            cover.failures().as_deref(),
            Some(
                "3 BrokerUnreachable; last: remember did not confirm the job: broker unreachable: broker down"
            ),
            "the reasons, bounded, for the replay's stop reason"
        );
    }
}
