//! The safety nets under the record watch for decided records: whatever the watch
//! or a reconcile lost, a decision is never left unattempted for long.
//!
//! - Every [`Vigil::resync`] the records decided and still Parked are listed from the
//!   apiserver ([`DECIDED`]) and handed to the feeder ([`super::feeder::Feeder::resync`]),
//!   which holds and wakes those it does not hold and nudges those not attempted lately. A
//!   watch event lost across an apiserver restart costs one period, not the decision.
//! - A leader that has not attempted a decided record for [`Vigil::stall_after`] (a reconcile
//!   that hangs, a wake nobody runs), and has attempted no other decision either in that time,
//!   makes no progress and will not: it says so (a log line, a Warning Event `LeaderStalled` on
//!   the queue, `/readyz` false) and gives up its Lease, so the standby takes over. Waiting out a
//!   broker's backoff is progress: each retry is an attempt; so is working through a backlog
//!   of 30,000 decisions, where one waits its turn longer than the bound.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt};

use dlq_core::api::DeadLetter;
use dlq_core::decide::{self, Decision};
use dlq_core::events::EventPlan;

use crate::reconcile::{Context, record};
use crate::state::apiserver;

/// Why a Warning Event says this replica gave up its Lease.
pub const REASON_STALLED: &str = "LeaderStalled";

/// Records per page of the re-list (few are decided and not yet carried out).
const PAGE: u32 = 100;

/// How often decided records are re-listed and how long one may go unattempted.
#[derive(Clone, Copy, Debug)]
pub struct Vigil {
    /// Between two re-lists of the decided records.
    pub resync: Duration,
    /// A decided record listed and not attempted for this long means the leader is stalled.
    /// Kept above twice the backoff cap (see [`Vigil::bound`]): a record whose broker is down
    /// is retried at least once per cap.
    pub stall_after: Duration,
}

impl Default for Vigil {
    fn default() -> Self {
        Vigil {
            resync: Duration::from_secs(30),
            stall_after: Duration::from_secs(180),
        }
    }
}

impl Vigil {
    /// The stall bound in effect: `stall_after`, but never below two backoff caps plus a
    /// re-list period, so a record waiting out its backoff never looks stalled.
    pub fn bound(&self, backoff_cap: Duration) -> Duration {
        self.stall_after.max(2 * backoff_cap + self.resync)
    }
}

/// Tells the process that this leader stalled (it gives up the Lease): the message says why.
#[derive(Clone)]
pub struct StallAlarm {
    tx: Arc<tokio::sync::watch::Sender<Option<String>>>,
}

impl StallAlarm {
    /// An alarm and the receiver the process waits on.
    pub fn new() -> (StallAlarm, tokio::sync::watch::Receiver<Option<String>>) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (StallAlarm { tx: Arc::new(tx) }, rx)
    }

    fn raise(&self, why: String) {
        self.tx.send_replace(Some(why));
    }
}

/// A record the re-list found decided, and whether the feeder should wake it even when it
/// holds it already (not attempted for a while: its wake may have been lost).
pub type Listed = (DeadLetter, bool);

/// What one look at the decided records found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Look {
    /// Records to wake even if held (by uid).
    pub nudge: HashSet<String>,
    /// Records listed for longer than the bound and not attempted within it (namespace,
    /// queue, name).
    pub stalled: Vec<(String, String, String)>,
}

/// Follows which decided records were seen when, across re-lists.
#[derive(Default)]
pub struct Watchman {
    /// When each decided record (uid) was first listed.
    first_listed: HashMap<String, Instant>,
}

impl Watchman {
    /// Judges one re-list at `now`: `last_attempt` says when a reconcile acting on a record
    /// last ended, `latest` when one acting on any decision did. Records no longer listed are
    /// forgotten.
    pub fn look(
        &mut self,
        now: Instant,
        decided: &[DeadLetter],
        (last_attempt, latest): (impl Fn(&str) -> Option<Instant>, Option<Instant>),
        vigil: &Vigil,
        backoff_cap: Duration,
    ) -> Look {
        let bound = vigil.bound(backoff_cap);
        // Some decision attempted within the bound: the leader works (a backlog takes its time).
        let working = latest.is_some_and(|t| now.duration_since(t) < bound);
        // A record not attempted within one cap and one period should have been retried.
        let overdue = backoff_cap + vigil.resync;
        let listed: HashSet<String> = decided.iter().filter_map(|d| d.uid()).collect();
        self.first_listed.retain(|uid, _| listed.contains(uid));
        let mut look = Look::default();
        for d in decided {
            // Only signed decisions are carried out; an unsigned one waits, refused, for a
            // signature (and the apiserver refuses those anyway).
            if !matches!(
                decide::for_record(d),
                Decision::Redrive { .. } | Decision::Drop { .. }
            ) {
                continue;
            }
            let Some(uid) = d.uid() else { continue };
            let first = *self.first_listed.entry(uid.clone()).or_insert(now);
            let last = last_attempt(&uid);
            let idle_since = |limit: Duration| {
                now.duration_since(first) >= limit
                    && last.is_none_or(|t| now.duration_since(t) >= limit)
            };
            if idle_since(overdue) {
                look.nudge.insert(uid.clone());
            }
            if idle_since(bound) && !working {
                look.stalled.push((
                    d.namespace().unwrap_or_default(),
                    d.spec.queue.clone(),
                    d.name_any(),
                ));
            }
        }
        look
    }
}

/// Re-lists the decided records every `vigil.resync` and hands them to the feeder; raises
/// `alarm` (and returns) once a decided record went unattempted past the bound.
pub async fn keep_watch(
    api: Api<DeadLetter>,
    ctx: Arc<Context>,
    feeder: UnboundedSender<Vec<Listed>>,
    vigil: Vigil,
    alarm: Option<StallAlarm>,
) {
    let mut watchman = Watchman::default();
    let backoff_cap = ctx.settings.backoff_cap;
    loop {
        tokio::time::sleep(vigil.resync).await;
        let decided = match list_decided(&api).await {
            Ok(d) => d,
            Err(e) => {
                // The apiserver away: nothing is known, and a leader that cannot reach it
                // cannot renew its Lease either.
                tracing::debug!(error = %e, "re-listing decided records failed; trying again next period");
                continue;
            }
        };
        let look = watchman.look(
            Instant::now(),
            &decided,
            (
                |uid: &str| record::last_attempt(&ctx, uid),
                record::latest_attempt(&ctx),
            ),
            &vigil,
            backoff_cap,
        );
        let listed: HashSet<String> = decided.iter().filter_map(|d| d.uid()).collect();
        record::retain_attempts(&ctx, |uid| listed.contains(uid));
        if !look.stalled.is_empty() {
            step_down(
                &ctx,
                &look.stalled,
                vigil.bound(backoff_cap),
                alarm.as_ref(),
            )
            .await;
            return;
        }
        let batch: Vec<Listed> = decided
            .into_iter()
            .map(|d| {
                let nudge = d.uid().is_some_and(|u| look.nudge.contains(&u));
                (d, nudge)
            })
            .collect();
        if !batch.is_empty() && feeder.unbounded_send(batch).is_err() {
            return;
        }
    }
}

/// Records with a decision not yet carried out: Parked, `spec.action` set (both selectable
/// fields of the CRD; an unset field selects as ""). Here, beside the re-list that reads it;
/// the decisions controller (`super`) watches it too.
pub const DECIDED: &str = "status.phase=Parked,spec.action!=";

/// Records decided without a phase: none where the CRD defaults `status` to Parked (the
/// apiserver then serves every unwritten phase as Parked, which [`DECIDED`] selects); kept for a
/// CRD older than the operator, which selects an unset field as "".
const DECIDED_UNMARKED: &str = "status.phase=,spec.action!=";

/// Every record decided and not resolved (marked Parked or not yet marked), page by page.
async fn list_decided(api: &Api<DeadLetter>) -> Result<Vec<DeadLetter>, kube::Error> {
    let mut out = Vec::new();
    for selector in [DECIDED, DECIDED_UNMARKED] {
        let mut params = ListParams::default().fields(selector).limit(PAGE);
        loop {
            let page = api.list(&params).await?;
            out.extend(page.items);
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
    }
    Ok(out)
}

/// Says why this leader gives up (a log line, a Warning Event per queue) and raises the alarm.
async fn step_down(
    ctx: &Context,
    stalled: &[(String, String, String)],
    bound: Duration,
    alarm: Option<&StallAlarm>,
) {
    let examples: Vec<&str> = stalled.iter().take(5).map(|s| s.2.as_str()).collect();
    let why = format!(
        "{} decided records not attempted for {}s (e.g. {}); giving up the Lease so that another replica carries them out",
        stalled.len(),
        bound.as_secs(),
        examples.join(", ")
    );
    tracing::error!(stalled = stalled.len(), bound_secs = bound.as_secs(), examples = ?examples, "no progress on decided records; giving up the Lease");
    let mut per_queue: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for (ns, queue, name) in stalled {
        per_queue.entry((ns, queue)).or_default().push(name);
    }
    for ((ns, queue), names) in per_queue {
        let note = format!(
            "{} decided records of this queue not attempted for {}s (e.g. {}): this replica gives up its Lease so that another carries them out",
            names.len(),
            bound.as_secs(),
            names.first().copied().unwrap_or_default()
        );
        let plan = EventPlan::warning(REASON_STALLED, "StepDown", note);
        // About the queue; about its first stalled record when the queue is not cached.
        let regarding = match ctx.queue(ns, queue) {
            Some(q) => apiserver::reference(q.as_ref()),
            None => ObjectReference {
                api_version: Some(DeadLetter::api_version(&()).to_string()),
                kind: Some(DeadLetter::kind(&()).to_string()),
                namespace: Some(ns.to_string()),
                name: names.first().map(|n| n.to_string()),
                ..ObjectReference::default()
            },
        };
        ctx.apiserver.publish(regarding, &plan).await;
    }
    if let Some(alarm) = alarm {
        alarm.raise(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::{Action, DeadLetterStatus, Phase};
    use dlq_core::testing::RecordBuilder;

    fn decided(id: &str, uid: &str) -> DeadLetter {
        let mut r = RecordBuilder::job(id).queue("orders").build();
        r.metadata.uid = Some(uid.into());
        r.spec.action = Some(Action::Redrive);
        r.spec.by = Some("ops".into());
        r.status = Some(DeadLetterStatus {
            phase: Some(Phase::Parked),
            ..Default::default()
        });
        r
    }

    const VIGIL: Vigil = Vigil {
        resync: Duration::from_secs(30),
        stall_after: Duration::from_secs(180),
    };
    const CAP: Duration = Duration::from_secs(60);

    #[test]
    fn the_bound_never_falls_below_two_backoff_caps_and_a_period() {
        assert_eq!(VIGIL.bound(CAP), Duration::from_secs(180));
        assert_eq!(
            VIGIL.bound(Duration::from_secs(120)),
            Duration::from_secs(270)
        );
    }

    #[test]
    fn a_record_retried_within_its_backoff_is_progress_and_a_leader_attempting_nothing_stalls() {
        let mut w = Watchman::default();
        let t0 = Instant::now();
        let records = [decided("a", "u-a"), decided("b", "u-b")];
        let look = w.look(t0, &records, (|_: &str| None, None), &VIGIL, CAP);
        assert_eq!(look, Look::default(), "just listed: nothing to say yet");

        // 100 s later: a was retried 50 s ago (its broker is down), b never was.
        let t1 = t0 + Duration::from_secs(100);
        let retried = |uid: &str| (uid == "u-a").then(|| t1 - Duration::from_secs(50));
        let look = w.look(
            t1,
            &records,
            (retried, Some(t1 - Duration::from_secs(50))),
            &VIGIL,
            CAP,
        );
        assert_eq!(
            look.nudge,
            HashSet::from(["u-b".to_string()]),
            "b is woken again"
        );
        assert!(look.stalled.is_empty(), "not past the bound yet");

        // Past the bound, a still retried: the leader works, b is nudged, not a stall.
        let t2 = t0 + Duration::from_secs(181);
        let retried = |uid: &str| (uid == "u-a").then(|| t2 - Duration::from_secs(40));
        let look = w.look(
            t2,
            &records,
            (retried, Some(t2 - Duration::from_secs(40))),
            &VIGIL,
            CAP,
        );
        assert!(look.stalled.is_empty());
        assert!(look.nudge.contains("u-b"));

        // Nothing attempted at all since the start: both listed past the bound are stalled.
        let look = w.look(t2, &records, (|_: &str| None, None), &VIGIL, CAP);
        let names: Vec<String> = look.stalled.iter().map(|s| s.2.clone()).collect();
        assert_eq!(names, [records[0].name_any(), records[1].name_any()]);
    }

    /// A leader working through a backlog of decisions (30,000 decided at once, redriven at
    /// 50/s) leaves the last ones unattempted for minutes: that is progress, not a stall. It
    /// stalls once nothing at all was attempted within the bound.
    #[test]
    fn a_record_waiting_its_turn_in_a_backlog_is_no_stall() {
        let mut w = Watchman::default();
        let t0 = Instant::now();
        let waiting = [decided("z", "u-z")];
        w.look(t0, &waiting, (|_: &str| None, None), &VIGIL, CAP);
        let t1 = t0 + Duration::from_secs(400);
        let busy = Some(t1 - Duration::from_millis(20));
        let look = w.look(t1, &waiting, (|_: &str| None, busy), &VIGIL, CAP);
        assert!(
            look.stalled.is_empty(),
            "other decisions were attempted just now"
        );
        assert_eq!(
            look.nudge,
            HashSet::from(["u-z".to_string()]),
            "but it is nudged"
        );
        let idle = Some(t1 - Duration::from_secs(181));
        let look = w.look(t1, &waiting, (|_: &str| None, idle), &VIGIL, CAP);
        assert_eq!(
            look.stalled.len(),
            1,
            "nothing attempted for longer than the bound"
        );
    }

    #[test]
    fn a_record_listed_again_later_starts_its_clock_again() {
        let mut w = Watchman::default();
        let t0 = Instant::now();
        let a = [decided("a", "u-a")];
        w.look(t0, &a, (|_: &str| None, None), &VIGIL, CAP);
        // Resolved (no longer listed), then decided again much later.
        w.look(
            t0 + Duration::from_secs(30),
            &[],
            (|_: &str| None, None),
            &VIGIL,
            CAP,
        );
        let t1 = t0 + Duration::from_secs(600);
        let look = w.look(t1, &a, (|_: &str| None, None), &VIGIL, CAP);
        assert_eq!(look, Look::default());
    }

    #[test]
    fn an_unsigned_decision_waiting_for_a_signature_is_no_stall() {
        let mut w = Watchman::default();
        let mut unsigned = decided("a", "u-a");
        unsigned.spec.by = None;
        let t0 = Instant::now();
        w.look(
            t0,
            std::slice::from_ref(&unsigned),
            (|_: &str| None, None),
            &VIGIL,
            CAP,
        );
        let later = t0 + Duration::from_secs(3600);
        let look = w.look(later, &[unsigned], (|_: &str| None, None), &VIGIL, CAP);
        assert_eq!(look, Look::default());
    }
}
