//! Dual control: a queue may require that a replay be approved by people other than its author
//! before it decides anything or passes anything through. The queue says when
//! ([`ApprovalPolicy`]), the replay carries the approvals ([`Approval`]), and [`check`] says
//! whether they are enough now. Who may write an approval is the apiserver's business (the
//! chart's admission policy); here an approval only counts if it is distinct, not the author's
//! and not expired.

use std::collections::BTreeSet;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::dead_letter::Action;
use crate::duration::parse_duration;

/// How long an approval counts when the queue's `expireAfter` does not say (or cannot be read).
pub const DEFAULT_EXPIRE_AFTER: Duration = Duration::from_secs(24 * 3600);
/// Clock skew an approval's `at` may be ahead of the operator's clock; further ahead, it does
/// not count (an approval dated in the future would never expire).
pub const SKEW: Duration = Duration::from_secs(300);
/// Most approvals one replay carries.
pub const MAX_APPROVALS: usize = 16;

/// `spec.approvals` of a DeadLetterQueue: how many people besides a replay's author must
/// approve it, for which replays, above what size, and for how long an approval counts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalPolicy {
    /// Distinct approvers needed besides the author (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub required: Option<i64>,
    /// Which replays need them: `redrive`, `drop`, `standing` (a standing replay of either
    /// action). Empty: all of them.
    #[serde(rename = "for", default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 3))]
    pub for_: Vec<ApprovalFor>,
    /// Only when the selection (records selected, plus a group's backlog in its broker)
    /// exceeds this many. Absent: always.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub above: Option<i64>,
    /// How long an approval counts after its `at`, a Go duration (`24h`, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"), length(max = 32))]
    pub expire_after: Option<String>,
}

/// Which replays an [`ApprovalPolicy`] covers.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalFor {
    Redrive,
    Drop,
    Standing,
}

/// One approval of a replay: who, when, why. Written by the approver (`kubectl dlq approve`);
/// the admission policy refuses one in someone else's name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Approval {
    /// The approver's user name.
    #[schemars(length(min = 1, max = 253))]
    pub by: String,
    /// When it was given; it counts until `expireAfter` past this.
    pub at: Time,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub note: Option<String>,
}

/// `status.approval`: what the operator saw of a replay's approvals.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalStatus {
    /// Approvers whose approval counted, in the order seen (each announced once by an Event);
    /// once the run started, the ones that let it start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approved_by: Vec<String>,
    /// Approvals needed when it was last looked at.
    #[serde(default)]
    pub required: i64,
    /// When it began waiting for approvals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_since: Option<Time>,
    /// When the Warning that it waits too long was published (once per wait).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overdue_at: Option<Time>,
}

impl ApprovalPolicy {
    /// Approvers needed (at least 1).
    pub fn required(&self) -> usize {
        usize::try_from(self.required.unwrap_or(1).max(1)).unwrap_or(1)
    }

    /// How long an approval counts.
    pub fn expire_after(&self) -> Duration {
        self.expire_after
            .as_deref()
            .and_then(parse_duration)
            .unwrap_or(DEFAULT_EXPIRE_AFTER)
    }

    /// Whether it covers this kind of replay.
    pub fn covers(&self, kind: ApprovalFor) -> bool {
        self.for_.is_empty() || self.for_.contains(&kind)
    }
}

impl ApprovalFor {
    /// A replay's kind: a standing one counts as `standing` alone, whatever its action.
    pub fn of(standing: bool, action: Action) -> ApprovalFor {
        match (standing, action) {
            (true, _) => ApprovalFor::Standing,
            (false, Action::Redrive) => ApprovalFor::Redrive,
            (false, Action::Drop) => ApprovalFor::Drop,
        }
    }
}

/// What [`check`] reads of a replay (`DeadLetterReplaySpec::approval_request`).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `spec.by`: its approval never counts.
    pub author: &'a str,
    pub kind: ApprovalFor,
    /// A dry run decides nothing, so it needs none.
    pub dry_run: bool,
    pub approvals: &'a [Approval],
}

/// How big a replay is for [`ApprovalPolicy::above`]: the records it selects now plus, for a
/// failure group's replay, the group's messages still in the broker (they will pass too).
pub fn size(selected: usize, group_backlog: Option<i64>) -> i64 {
    i64::try_from(selected)
        .unwrap_or(i64::MAX)
        .saturating_add(group_backlog.unwrap_or(0).max(0))
}

/// Where a replay stands with its queue's approval policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No policy covers it (none, another kind, a dry run, or not above the threshold).
    NotNeeded,
    /// Enough approvals: these approvers, in the order given, of `required`.
    Approved { by: Vec<String>, required: usize },
    /// Not enough yet.
    Waiting {
        /// Approvers that count now.
        by: Vec<String>,
        required: usize,
        /// Approvals that do not count, each with why (expired, the author's, a repeat).
        ignored: Vec<String>,
    },
}

impl Verdict {
    /// The approvers that count, whichever way it stands.
    pub fn approvers(&self) -> &[String] {
        match self {
            Verdict::NotNeeded => &[],
            Verdict::Approved { by, .. } | Verdict::Waiting { by, .. } => by,
        }
    }

    /// The waiting in words, for a condition: `1 of 2 approvals (bob); ...`.
    pub fn waiting_message(&self) -> Option<String> {
        let Verdict::Waiting {
            by,
            required,
            ignored,
        } = self
        else {
            return None;
        };
        let who = if by.is_empty() {
            String::new()
        } else {
            format!(" ({})", by.join(", "))
        };
        let not_counted = if ignored.is_empty() {
            String::new()
        } else {
            format!("; not counted: {}", ignored.join("; "))
        };
        Some(format!(
            "awaiting approval: {} of {required} approvals{who}{not_counted}; `kubectl dlq approve` by someone other than the author",
            by.len()
        ))
    }
}

/// Whether the replay `req` needs approvals under `policy` at `size`, and whether those it
/// carries are enough at `now`: each approver counted once, never the author, never one older
/// than `expireAfter` or dated more than [`SKEW`] ahead of `now`.
pub fn check(
    policy: Option<&ApprovalPolicy>,
    req: &Request<'_>,
    size: i64,
    now: Timestamp,
) -> Verdict {
    let Some(policy) = policy else {
        return Verdict::NotNeeded;
    };
    if req.dry_run || !policy.covers(req.kind) || policy.above.is_some_and(|a| size <= a) {
        return Verdict::NotNeeded;
    }
    let expire = policy.expire_after();
    let mut seen = BTreeSet::new();
    let (mut by, mut ignored) = (Vec::new(), Vec::new());
    for a in req.approvals.iter().take(MAX_APPROVALS) {
        let who = a.by.trim();
        let age = now.duration_since(a.at.0);
        let why = if who == req.author.trim() {
            Some("the author's own")
        } else if Duration::try_from(-age).is_ok_and(|ahead| ahead > SKEW) {
            Some("dated in the future")
        } else if Duration::try_from(age).is_ok_and(|age| age > expire) {
            Some("expired")
        } else if !seen.insert(who) {
            Some("a second one")
        } else {
            None
        };
        match why {
            Some(why) => ignored.push(format!("{who}: {why}")),
            None => by.push(who.to_string()),
        }
    }
    let required = policy.required();
    if by.len() >= required {
        Verdict::Approved { by, required }
    } else {
        Verdict::Waiting {
            by,
            required,
            ignored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::at;

    /// A redrive by `by` carrying `approvals` (approver, second of its `at`).
    struct Replay {
        by: &'static str,
        kind: ApprovalFor,
        dry_run: bool,
        approvals: Vec<Approval>,
    }

    impl Replay {
        fn req(&self) -> Request<'_> {
            Request {
                author: self.by,
                kind: self.kind,
                dry_run: self.dry_run,
                approvals: &self.approvals,
            }
        }
    }

    fn spec(by: &'static str, approvals: &[(&str, i64)]) -> Replay {
        Replay {
            by,
            kind: ApprovalFor::Redrive,
            dry_run: false,
            approvals: approvals
                .iter()
                .map(|(by, second)| Approval {
                    by: (*by).into(),
                    at: Time(at(*second)),
                    note: None,
                })
                .collect(),
        }
    }

    fn policy(required: i64, for_: &[ApprovalFor], above: Option<i64>) -> ApprovalPolicy {
        ApprovalPolicy {
            required: Some(required),
            for_: for_.to_vec(),
            above,
            expire_after: Some("1h".into()),
        }
    }

    const NOW: i64 = 100_000;

    #[test]
    fn no_policy_a_small_selection_or_another_kind_needs_none() {
        let s = spec("alice", &[]);
        assert_eq!(check(None, &s.req(), 5000, at(NOW)), Verdict::NotNeeded);
        let above = policy(1, &[], Some(100));
        assert_eq!(
            check(Some(&above), &s.req(), 10, at(NOW)),
            Verdict::NotNeeded
        );
        assert_eq!(
            check(Some(&above), &s.req(), 100, at(NOW)),
            Verdict::NotNeeded
        );
        assert!(matches!(
            check(Some(&above), &s.req(), 101, at(NOW)),
            Verdict::Waiting { .. }
        ));
        let drops = policy(1, &[ApprovalFor::Drop], None);
        assert_eq!(
            check(Some(&drops), &s.req(), 5000, at(NOW)),
            Verdict::NotNeeded
        );
        let dry = Replay {
            dry_run: true,
            ..spec("alice", &[])
        };
        assert_eq!(
            check(Some(&policy(1, &[], None)), &dry.req(), 5000, at(NOW)),
            Verdict::NotNeeded,
            "a dry run decides nothing"
        );
    }

    #[test]
    fn a_standing_replay_counts_as_standing_whatever_its_action() {
        let standing = Replay {
            kind: ApprovalFor::of(true, Action::Drop),
            ..spec("alice", &[])
        };
        let redrives = policy(1, &[ApprovalFor::Redrive], None);
        assert_eq!(
            check(Some(&redrives), &standing.req(), 5, at(NOW)),
            Verdict::NotNeeded
        );
        let standings = policy(1, &[ApprovalFor::Standing], None);
        assert!(matches!(
            check(Some(&standings), &standing.req(), 5, at(NOW)),
            Verdict::Waiting { required: 1, .. }
        ));
    }

    #[test]
    fn only_distinct_fresh_approvals_by_others_count() {
        let two = policy(2, &[], None);
        let s = spec(
            "alice",
            &[
                ("alice", NOW - 10),
                ("bob", NOW - 10),
                ("bob", NOW - 5),
                ("dave", NOW - 7200),
                ("erin", NOW + 3600),
            ],
        );
        let v = check(Some(&two), &s.req(), 5000, at(NOW));
        assert_eq!(
            v,
            Verdict::Waiting {
                by: vec!["bob".into()],
                required: 2,
                ignored: vec![
                    "alice: the author's own".into(),
                    "bob: a second one".into(),
                    "dave: expired".into(),
                    "erin: dated in the future".into(),
                ],
            }
        );
        let message = v.waiting_message().unwrap_or_default();
        assert!(
            message.starts_with(
                "awaiting approval: 1 of 2 approvals (bob); not counted: alice: the author's own"
            ),
            "{message}"
        );

        let s = spec("alice", &[("bob", NOW - 10), ("carol", NOW + 60)]);
        assert_eq!(
            check(Some(&two), &s.req(), 5000, at(NOW)),
            Verdict::Approved {
                by: vec!["bob".into(), "carol".into()],
                required: 2
            },
            "a minute ahead is clock skew"
        );
    }

    #[test]
    fn an_expired_approval_followed_by_a_fresh_one_of_the_same_person_counts_once() {
        let s = spec("alice", &[("bob", NOW - 7200), ("bob", NOW - 1)]);
        let v = check(Some(&policy(1, &[], None)), &s.req(), 5000, at(NOW));
        assert_eq!(v.approvers(), ["bob"]);
        assert!(matches!(v, Verdict::Approved { .. }));
    }

    #[test]
    fn the_policy_defaults_and_the_size_of_a_group() {
        let p = ApprovalPolicy::default();
        assert_eq!(p.required(), 1);
        assert_eq!(p.expire_after(), DEFAULT_EXPIRE_AFTER);
        assert_eq!(
            policy(1, &[], None).expire_after(),
            Duration::from_secs(3600)
        );
        assert_eq!(size(10, None), 10);
        assert_eq!(size(10, Some(4990)), 5000);
        assert_eq!(size(10, Some(-1)), 10);
    }
}
