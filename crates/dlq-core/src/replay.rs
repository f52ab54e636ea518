//! `DeadLetterReplay`: the replay runbook as an object, reviewed in git and carried out by the
//! operator, and the runbook's pure rules (selection, pace, outcomes, stop conditions, the
//! summary) that `kubectl dlq` and the operator share.
//!
//! Progress lives in the cluster, never only in memory: every record a replay signs gets the
//! label [`LABEL_REPLAY`] in the same compare-and-swap write, so a restarted or new leader
//! counts what was decided from the records themselves, and a decided record no longer
//! matches the selection (it has an action), so nothing is decided twice.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube_derive::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::conditions::truncate;
use crate::dead_letter::{Action, FailureKind, Phase};
use crate::facts::Facts;

pub mod approvals;
pub mod canary;
mod outcome;
pub use approvals::{Approval, ApprovalPolicy, ApprovalStatus};
pub use canary::{Canary, CanaryStatus};
pub use outcome::{Outcome, outcome_of};

/// Label on every record a replay signed: the replay's name.
pub const LABEL_REPLAY: &str = "dlq.dev/replay";
/// Annotation beside it: the replay's uid, so a replay deleted and created again under the same
/// name does not count the first one's decisions as its own.
pub const ANNOTATION_REPLAY_UID: &str = "dlq.dev/replay-uid";

/// Which replay: its name (the label) and uid (the annotation).
#[derive(Debug, Clone, Copy)]
pub struct ReplayRef<'a> {
    pub name: &'a str,
    pub uid: &'a str,
}

/// Whether `r` was signed by this replay.
pub fn decided_by(r: &impl Facts, replay: ReplayRef<'_>) -> bool {
    r.signed_by_replay() == (Some(replay.name), Some(replay.uid))
}
/// Pace when `spec.rate` is not set.
pub const DEFAULT_RATE: f64 = 10.0;
/// A standing replay's pace for the records it decides one at a time (its canary) when
/// `spec.rate` is not set: its other records' jobs go ahead of their decisions at the broker's
/// speed ([`DeadLetterReplaySpec::send_rate`]), as its messages pass.
pub const DEFAULT_STANDING_RATE: f64 = 100.0;
/// Stop bounds when `spec.stopWhen` leaves them out (the CLI's defaults).
pub const DEFAULT_FAILURE_RATIO: f64 = 0.2;
pub const DEFAULT_WINDOW: usize = 20;
pub const DEFAULT_NEW_PARKED: usize = 10;
/// How long a replay waits for outcomes after its last decision, unless `settleSeconds` says.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(60);
/// Names a dry run lists in its status.
pub const FIRST_NAMES: usize = 20;
/// Most explicit record names one replay takes (keeps the object far below etcd's limit).
pub const MAX_NAMES: usize = 1000;
/// Job ids of pass-through messages a standing replay keeps in its status (the rest are counted).
pub const SAMPLE: usize = 20;

/// The spec fields that freeze once a replay runs (everything but `stop` and `paused`), as the
/// CEL rule and the admission policy compare them.
pub const FROZEN_FIELDS: [&str; 12] = [
    "queue",
    "selector",
    "action",
    "rate",
    "max",
    "stopWhen",
    "dryRun",
    "by",
    "note",
    "settleSeconds",
    "standing",
    "canary",
];

/// CEL: the frozen fields of `new` equal those of `old` (both `.spec` paths).
pub fn frozen_fields_equal(new: &str, old: &str) -> String {
    fields_equal(&FROZEN_FIELDS, new, old)
}

/// CEL: `fields` of `new` equal those of `old`.
fn fields_equal(fields: &[&str], new: &str, old: &str) -> String {
    fields
        .iter()
        .map(|f| {
            format!(
                "has({new}.{f}) == has({old}.{f}) && (!has({new}.{f}) || {new}.{f} == {old}.{f})"
            )
        })
        .collect::<Vec<_>>()
        .join(" && ")
}

fn frozen_rule() -> kube::core::Rule {
    kube::core::Rule::new(format!(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase in ['Pending', 'DryRun', 'AwaitingApproval'] || ({})",
        frozen_fields_equal("self.spec", "oldSelf.spec")
    ))
    .message(kube::core::Message::Expression(
        "'replay ' + self.metadata.name + ' is ' + oldSelf.status.phase.lowerAscii() + ': only spec.stop and spec.paused can change once it started'".into(),
    ))
    .reason(kube::core::Reason::FieldValueForbidden)
    .field_path(".spec")
}

/// Once a replay carries an approval, what it does is what was approved: a change of any frozen
/// field but `dryRun` is refused (remove the approvals first, and the replay waits for new
/// ones). `dryRun` may go: a dry run approved after its count is then run as approved.
fn approved_rule() -> kube::core::Rule {
    let fields: Vec<&str> = FROZEN_FIELDS
        .into_iter()
        .filter(|f| *f != "dryRun")
        .collect();
    kube::core::Rule::new(format!(
        "!has(oldSelf.spec.approvals) || size(oldSelf.spec.approvals) == 0 || ({})",
        fields_equal(&fields, "self.spec", "oldSelf.spec")
    ))
    .message(kube::core::Message::Expression(
        "'replay ' + self.metadata.name + ' is approved: only spec.stop, spec.paused, spec.dryRun and spec.approvals can change (remove the approvals first to change it, then it needs new ones)'".into(),
    ))
    .reason(kube::core::Reason::FieldValueForbidden)
    .field_path(".spec")
}

/// A replay of one queue's parked records: which, what to decide, how fast, when to stop.
/// Signed like any decision; only `stop` and `paused` change once it runs.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dlq.dev",
    version = "v1alpha1",
    kind = "DeadLetterReplay",
    namespaced,
    shortname = "dlr",
    category = "dlq-all",
    status = "DeadLetterReplayStatus",
    printcolumn = r#"{"name":"Queue","type":"string","jsonPath":".spec.queue"}"#,
    printcolumn = r#"{"name":"Action","type":"string","jsonPath":".spec.action"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Selected","type":"integer","jsonPath":".status.selected"}"#,
    printcolumn = r#"{"name":"Decided","type":"integer","jsonPath":".status.decided"}"#,
    printcolumn = r#"{"name":"Redriven","type":"integer","jsonPath":".status.redriven"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.failed"}"#,
    printcolumn = r#"{"name":"Withdrawn","type":"integer","jsonPath":".status.withdrawn","priority":1}"#,
    printcolumn = r#"{"name":"By","type":"string","jsonPath":".spec.by"}"#,
    printcolumn = r#"{"name":"Stop Reason","type":"string","jsonPath":".status.stopReason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = kube::core::Rule::new("size(self.metadata.name) <= 63").message("a replay's name is at most 63 characters (it labels the records it signs)"),
    validation = frozen_rule(),
    validation = approved_rule()
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.by.trim() != ''").message("every decision must be signed: set spec.by"),
    validation = kube::core::Rule::new("!has(self.standing) || !self.standing || (has(self.selector) && has(self.selector.group) && (!has(self.selector.names) || size(self.selector.names) == 0))").message("a standing replay covers one failure group: set selector.group (and no selector.names)"),
    validation = kube::core::Rule::new("!has(self.standing) || !self.standing || !has(self.dryRun) || !self.dryRun").message("a standing replay cannot be a dry run: run one without standing first to count"),
)]
pub struct DeadLetterReplaySpec {
    /// The DeadLetterQueue (same namespace) whose parked records are replayed.
    #[schemars(length(min = 1, max = 63))]
    pub queue: String,
    /// Which parked, undecided records; every field set must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<ReplaySelector>,
    /// `redrive` (default) or `drop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    /// Decisions per second, e.g. `20/s` (default 10/s). A redrive of a failure group
    /// (`selector.group`) sends its records' jobs ahead of their decisions: `rate` paces those
    /// jobs, and for a standing replay its passed messages too, each at most `rate` a second
    /// (a standing replay without `rate`: both at the broker's speed); the records' signatures
    /// and resolutions follow at the apiserver's pace, after the jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?(/s)?$"), length(max = 16))]
    pub rate: Option<String>,
    /// Decide at most this many records (standing: records decided plus messages passed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max: Option<i64>,
    /// When the replay stops by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_when: Option<StopWhen>,
    /// Only count the selection (status.selected, status.firstNames); decide nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry_run: Option<bool>,
    /// Who decided: every record is signed with this name.
    #[schemars(length(min = 1, max = 253))]
    pub by: String,
    /// Why (ticket, incident); the note of every decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub note: Option<String>,
    /// After the last decision, how long to wait for outcomes (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub settle_seconds: Option<i64>,
    /// `true` stops the replay for good: no more decisions, and those not carried out yet are
    /// withdrawn. The one field that may change once the replay runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<bool>,
    /// `true` pauses the replay: no more decisions, and a standing replay passes nothing
    /// through (its group's dead messages park, or wait in the broker, meanwhile); what it
    /// decided stays decided and is carried out. `false` resumes it where it was. Unlike
    /// `stop`, nothing is withdrawn and the replay does not end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// Keeps deciding the group's records as they are parked, not only those that existed when
    /// it started, and lets the source pass matching dead messages straight from the broker to
    /// the target without a record each (requeue, then ack; counted in
    /// `status.passedThrough`); until the group's backlog is empty, `max` or `stop`. Needs
    /// `selector.group`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standing: Option<bool>,
    /// Decide `count` records first, spread across the selection, and watch them for
    /// `observeSeconds` once carried out; go on only if none came back (parked again as its
    /// next cycle) or failed to enqueue, else stop naming them. A standing replay passes
    /// nothing through until its canary passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// Approvals by people other than the author, when its queue requires them
    /// (`spec.approvals` of the DeadLetterQueue): `{by, at, note}` each, appended by
    /// `kubectl dlq approve`. Once one exists, what the replay does cannot change.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub approvals: Vec<Approval>,
}

/// Which records a replay takes: Parked and undecided, and matching every field given.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReplaySelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_kind: Option<FailureKind>,
    /// The record's reason contains this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub reason_contains: Option<String>,
    /// Failed at or after this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// Failed before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Time>,
    /// Parked by this consumer version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub service_version: Option<String>,
    /// Only these records (names). A name whose record is gone (retention) is skipped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), inner(length(min = 1, max = 253)))]
    pub names: Vec<String>,
    /// Only the records of this failure group (its fingerprint, the `dlq.dev/group` label).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{10}$"))]
    pub group: Option<String>,
}

/// The bounds that stop a replay by itself.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StopWhen {
    /// Stop when more than this share of the last `window` settled redrives failed (0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub failure_ratio: Option<f64>,
    /// Settled redrives the failure ratio is computed over, and the least it needs (20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub window: Option<i32>,
    /// Stop when more than this many records were parked on the queue during the run (10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub new_parked: Option<i64>,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum ReplayPhase {
    /// Accepted, not started (e.g. its queue does not exist yet).
    #[default]
    Pending,
    /// `dryRun: true`: the selection is counted and kept up to date; nothing is decided.
    DryRun,
    Running,
    /// `spec.paused`: decides and passes nothing until resumed; nothing is withdrawn.
    Paused,
    /// Its queue requires approvals it does not have yet: decides and passes nothing.
    AwaitingApproval,
    /// Ended early: a stop bound, or `spec.stop`.
    Stopped,
    Completed,
}

impl ReplayPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayPhase::Pending => "Pending",
            ReplayPhase::DryRun => "DryRun",
            ReplayPhase::Running => "Running",
            ReplayPhase::Paused => "Paused",
            ReplayPhase::AwaitingApproval => "AwaitingApproval",
            ReplayPhase::Stopped => "Stopped",
            ReplayPhase::Completed => "Completed",
        }
    }

    /// Stopped or Completed: nothing more happens.
    pub fn is_final(self) -> bool {
        matches!(self, ReplayPhase::Stopped | ReplayPhase::Completed)
    }
}

/// The replay's decision log: counts, times, why it stopped.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterReplayStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ReplayPhase>,
    /// Records the selection took when the run started (a dry run: matching now).
    #[serde(default)]
    pub selected: i64,
    /// Records this replay signed.
    #[serde(default)]
    pub decided: i64,
    #[serde(default)]
    pub redriven: i64,
    #[serde(default)]
    pub dropped: i64,
    /// Decided records whose requeue is failing (Requeued=False).
    #[serde(default)]
    pub failed: i64,
    /// Decisions taken back when the replay stopped before they were carried out.
    #[serde(default)]
    pub withdrawn: i64,
    /// Selected records that were no longer parked and undecided when their turn came.
    #[serde(default)]
    pub skipped: i64,
    /// Records parked on the queue during the run.
    #[serde(default)]
    pub new_parked: i64,
    /// A standing replay's dead messages passed straight from the broker to the target (or,
    /// for `drop`, acknowledged and discarded) without a record: each requeued, then acked.
    #[serde(default)]
    pub passed_through: i64,
    /// Job ids of the first pass-through messages ([`SAMPLE`] at most).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sample: Vec<String>,
    /// When a dead message was last passed through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed_at: Option<Time>,
    /// Which of the queue's records existed when the run started: the selection is taken from
    /// those alone, whatever is parked later (a restarted leader reads it here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen: Option<Frozen>,
    /// A dry run's first selected record names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_names: Vec<String>,
    /// Who approved it and how long it waited (`spec.approvals`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalStatus>,
    /// The canary's records and whether it passed (`spec.canary`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// The run in one line (what `kubectl dlq redrive --queue` prints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Decisions per second achieved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub achieved_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the last decision was made (then outcomes settle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl DeadLetterReplay {
    pub fn phase(&self) -> ReplayPhase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or_default()
    }
}

/// `20/s` or a bare `20`; must be positive.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.trim().trim_end_matches("/s");
    match n.parse::<f64>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!("{s:?} is not a rate such as 20/s")),
    }
}

impl FailureKind {
    /// `Transient`/`Invalid`, in any case.
    pub fn from_label(s: &str) -> Option<FailureKind> {
        [FailureKind::Transient, FailureKind::Invalid]
            .into_iter()
            .find(|k| k.label().eq_ignore_ascii_case(s))
    }
}

impl ReplaySelector {
    /// Whether a record is one a replay takes: Parked, undecided, facts matching.
    pub fn matches(&self, r: &impl Facts) -> bool {
        r.phase() == Phase::Parked && r.action().is_none() && self.matches_facts(r)
    }

    /// Whether a record's immutable facts (and name) match, whatever its phase.
    pub fn matches_facts(&self, r: &impl Facts) -> bool {
        let name = r.name();
        self.failure_kind.is_none_or(|k| r.failure_kind() == k)
            && self
                .reason_contains
                .as_ref()
                .is_none_or(|t| r.reason().contains(t.as_str()))
            && self.since.as_ref().is_none_or(|t| r.failed_at() >= t.0)
            && self.until.as_ref().is_none_or(|t| r.failed_at() < t.0)
            && self
                .service_version
                .as_ref()
                .is_none_or(|v| r.service_version() == Some(v.as_str()))
            && (self.names.is_empty() || self.names.iter().any(|n| n == name))
            && self.group.as_ref().is_none_or(|g| r.group() == g.as_str())
    }

    /// The selector in words (`queue=relayer,failureKind=Transient,...`).
    pub fn describe(&self, queue: &str) -> String {
        let mut parts = vec![format!("queue={queue}")];
        if let Some(k) = self.failure_kind {
            parts.push(format!("failureKind={k:?}"));
        }
        if let Some(t) = &self.reason_contains {
            parts.push(format!("reasonContains={t:?}"));
        }
        if let Some(t) = &self.since {
            parts.push(format!("since={}", t.0));
        }
        if let Some(t) = &self.until {
            parts.push(format!("until={}", t.0));
        }
        if let Some(v) = &self.service_version {
            parts.push(format!("serviceVersion={v}"));
        }
        if !self.names.is_empty() {
            parts.push(format!("names={}", self.names.len()));
        }
        if let Some(g) = &self.group {
            parts.push(format!("group={g}"));
        }
        parts.join(",")
    }
}

/// The stop bounds with their defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub failure_ratio: f64,
    pub window: usize,
    pub new_parked: usize,
}

impl DeadLetterReplaySpec {
    pub fn selector(&self) -> ReplaySelector {
        self.selector.clone().unwrap_or_default()
    }

    pub fn action(&self) -> Action {
        self.action.unwrap_or(Action::Redrive)
    }

    /// Decisions per second; a rate the CRD let through but that does not parse is the default
    /// (a standing replay's: [`DEFAULT_STANDING_RATE`]).
    pub fn rate(&self) -> f64 {
        let default = if self.standing() {
            DEFAULT_STANDING_RATE
        } else {
            DEFAULT_RATE
        };
        self.rate
            .as_deref()
            .and_then(|r| parse_rate(r).ok())
            .unwrap_or(default)
    }

    pub fn bounds(&self) -> Bounds {
        let s = self.stop_when.clone().unwrap_or_default();
        Bounds {
            failure_ratio: s.failure_ratio.unwrap_or(DEFAULT_FAILURE_RATIO),
            window: s
                .window
                .and_then(|w| usize::try_from(w).ok())
                .unwrap_or(DEFAULT_WINDOW)
                .max(1),
            new_parked: s
                .new_parked
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(DEFAULT_NEW_PARKED),
        }
    }

    pub fn settle(&self) -> Duration {
        self.settle_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(DEFAULT_SETTLE, Duration::from_secs)
    }

    pub fn max(&self) -> Option<usize> {
        self.max.and_then(|m| usize::try_from(m).ok())
    }

    pub fn dry_run(&self) -> bool {
        self.dry_run.unwrap_or(false)
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.unwrap_or(false)
    }

    /// Whether its canary still holds the rest back (its standing passes too): it has one
    /// that has not passed.
    pub fn canary_holds(&self, status: &DeadLetterReplayStatus) -> bool {
        self.canary.is_some() && !status.canary.as_ref().is_some_and(CanaryStatus::passed)
    }

    /// Whether it is paused (see [`DeadLetterReplaySpec::paused`]).
    pub fn paused(&self) -> bool {
        self.paused.unwrap_or(false)
    }

    /// Whether it is a standing replay (see [`DeadLetterReplaySpec::standing`]).
    pub fn standing(&self) -> bool {
        self.standing.unwrap_or(false)
    }

    /// The pace of pass-through, messages per second: `rate` when the spec sets one, else
    /// none (the broker's speed).
    pub fn pass_rate(&self) -> Option<f64> {
        self.rate.as_deref().and_then(|r| parse_rate(r).ok())
    }

    /// Whether its records' jobs go to the target ahead of their decisions: a redrive of one
    /// failure group (`selector.group`, no `names`), standing or not. The replay itself is the
    /// signed decision; each record is signed and resolved after its job's confirmation.
    pub fn sends_ahead(&self) -> bool {
        let selector = self.selector();
        self.action() == Action::Redrive && selector.group.is_some() && selector.names.is_empty()
    }

    /// The pace of the jobs a replay that [`sends_ahead`](Self::sends_ahead) sends for its
    /// records, jobs per second: a standing replay's [`pass_rate`](Self::pass_rate) (None: the
    /// broker's speed), any other's [`rate`](Self::rate).
    pub fn send_rate(&self) -> Option<f64> {
        if self.standing() {
            self.pass_rate()
        } else {
            Some(self.rate())
        }
    }

    /// What the approval check (`approvals::check`) reads of it.
    pub fn approval_request(&self) -> approvals::Request<'_> {
        approvals::Request {
            author: &self.by,
            kind: approvals::ApprovalFor::of(self.standing(), self.action()),
            dry_run: self.dry_run(),
            approvals: &self.approvals,
        }
    }

    /// What every signed record's `spec.note` says: the replay, who approved it (the decision
    /// log of each record names the second pair of eyes), and the replay's note.
    pub fn decision_note(&self, replay: &str, approvers: &[String]) -> String {
        let note = self.note.clone().unwrap_or_default();
        let approved = if approvers.is_empty() {
            String::new()
        } else {
            format!(" (approved by {})", approvers.join(", "))
        };
        truncate(
            &format!(
                "replay {replay}{approved}{}{note}",
                if note.is_empty() { "" } else { ": " }
            ),
            1024,
        )
    }
}

/// The queue's records when a run started, told apart from any parked later. A creation time
/// has whole seconds, so "created at or before the start" also took records parked in the
/// start's second after it (and ones the operator's cache had not shown yet): the newest
/// second the start saw is kept by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Frozen {
    /// The newest creation time among the queue's records the start saw (none: it saw none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest: Option<Time>,
    /// The records the start saw created in that second.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub newest_names: Vec<String>,
}

impl Frozen {
    /// What a run starting now over `queue_records` (every record of its queue) freezes.
    pub fn of<'a, R: Facts + 'a>(queue_records: impl IntoIterator<Item = &'a R>) -> Frozen {
        let records: Vec<&R> = queue_records.into_iter().collect();
        let newest = records.iter().filter_map(|r| r.created()).max();
        let second = newest.map(|t| t.as_second());
        let mut newest_names: Vec<String> = records
            .iter()
            .filter(|r| r.created().map(|c| c.as_second()) == second && second.is_some())
            .map(|r| r.name().to_string())
            .collect();
        newest_names.sort();
        Frozen {
            newest: newest.map(Time),
            newest_names,
        }
    }

    /// Whether `r` was one of the queue's records when the run started.
    pub fn existed(&self, r: &impl Facts) -> bool {
        let (Some(created), Some(newest)) = (r.created(), &self.newest) else {
            return false;
        };
        let (c, n) = (created.as_second(), newest.0.as_second());
        c < n || (c == n && self.newest_names.iter().any(|x| x == r.name()))
    }
}

/// When a run started and what it froze: which records it may take, and which are new.
#[derive(Debug, Clone, Copy)]
pub struct Start<'a> {
    pub at: Timestamp,
    /// None for a run started by an operator that froze nothing (before 0.3): then records
    /// created at or before `at` count as existing.
    pub frozen: Option<&'a Frozen>,
    /// A standing replay's selection: the records it matches are the replay's own whenever
    /// they are parked (they are the rest of its incident, not new parkings).
    pub standing: Option<&'a ReplaySelector>,
}

impl<'a> Start<'a> {
    /// A run's start from its status (None: not started); `standing` from its spec.
    pub fn of(
        status: &'a DeadLetterReplayStatus,
        standing: Option<&'a ReplaySelector>,
    ) -> Option<Start<'a>> {
        Some(Start {
            at: status.started_at.as_ref()?.0,
            frozen: status.frozen.as_ref(),
            standing,
        })
    }

    /// Whether `r` existed when the run started.
    pub fn existed(&self, r: &impl Facts) -> bool {
        match self.frozen {
            Some(f) => f.existed(r),
            None => r.created().is_some_and(|c| c <= self.at),
        }
    }

    /// Whether the run may take `r` (besides matching the selector): one that existed when it
    /// started, or any record of a standing replay's selection.
    pub fn takes(&self, r: &impl Facts) -> bool {
        self.standing.is_some() || self.existed(r)
    }

    /// Whether `r` is a new parking during the run, as the `newParked` bound counts them: not
    /// there at the start, and not one of a standing replay's own.
    pub fn is_new_parking(&self, r: &impl Facts) -> bool {
        !self.existed(r) && self.standing.is_none_or(|s| !s.matches_facts(r))
    }
}

/// The records of a queue a replay takes, oldest failure first, at most `max`. With `started`,
/// only records that existed when the run started: the selection does not grow during a run
/// (records parked later are new parkings, not more of the selection).
pub fn select<'a, R: Facts + 'a>(
    records: impl IntoIterator<Item = &'a R>,
    queue: &str,
    selector: &ReplaySelector,
    started: Option<&Start<'_>>,
    max: Option<usize>,
) -> Vec<&'a R> {
    let mut out: Vec<&R> = records
        .into_iter()
        .filter(|r| r.queue() == queue && selector.matches(*r))
        .filter(|r| started.is_none_or(|s| s.takes(*r)))
        .collect();
    out.sort_by(|a, b| (a.failed_at(), a.name()).cmp(&(b.failed_at(), b.name())));
    if let Some(max) = max {
        out.truncate(max);
    }
    out
}

/// Failure share among the last `window` settled decisions (None until `window` settled).
pub fn failure_ratio(in_decision_order: &[Outcome], window: usize) -> Option<f64> {
    let settled: Vec<Outcome> = in_decision_order
        .iter()
        .rev()
        .filter(|o| matches!(o, Outcome::Redriven | Outcome::Dropped | Outcome::Failing))
        .take(window.max(1))
        .copied()
        .collect();
    if settled.len() < window.max(1) {
        return None;
    }
    let failed = settled.iter().filter(|o| **o == Outcome::Failing).count();
    Some(failed as f64 / settled.len() as f64)
}

/// What a replay has done, as the records show it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Outcomes of the records this replay signed, in decision order (oldest failure first).
    pub outcomes: Vec<Outcome>,
    /// Records of the queue parked since the run started.
    pub new_parked: usize,
}

impl Observed {
    pub fn count(&self, o: Outcome) -> usize {
        self.outcomes.iter().filter(|x| **x == o).count()
    }

    /// Why the run must stop, if a bound says so.
    pub fn stop_reason(&self, b: &Bounds) -> Option<String> {
        if let Some(ratio) = failure_ratio(&self.outcomes, b.window)
            && ratio > b.failure_ratio
        {
            return Some(format!(
                "requeue failure ratio {:.0}% over the last {} settled redrives exceeds {:.0}%",
                ratio * 100.0,
                b.window,
                b.failure_ratio * 100.0
            ));
        }
        if self.new_parked > b.new_parked {
            return Some(format!(
                "{} new records parked on the queue during the run (bound {})",
                self.new_parked, b.new_parked
            ));
        }
        None
    }
}

/// Observes a replay from its queue's records: the ones it signed (plus
/// `just_signed`, names signed that the records' view does not show yet, counted Pending) and
/// the records that did not exist when it `started`.
pub fn observe<'a, R: Facts + 'a>(
    queue_records: impl IntoIterator<Item = &'a R>,
    replay: ReplayRef<'_>,
    started: &Start<'_>,
    just_signed: &[String],
) -> Observed {
    let mut mine: Vec<&R> = Vec::new();
    let mut new_parked = 0;
    for r in queue_records {
        if started.is_new_parking(r) {
            new_parked += 1;
        }
        if decided_by(r, replay) {
            mine.push(r);
        }
    }
    mine.sort_by(|a, b| (a.failed_at(), a.name()).cmp(&(b.failed_at(), b.name())));
    let mut outcomes: Vec<Outcome> = mine.iter().map(|r| outcome_of(*r)).collect();
    let unseen = just_signed
        .iter()
        .filter(|n| !mine.iter().any(|r| r.name() == n.as_str()))
        .count();
    outcomes.extend(std::iter::repeat_n(Outcome::Pending, unseen));
    Observed {
        outcomes,
        new_parked,
    }
}

/// Whether a standing replay with nothing left to decide is done: its queue's broker was seen
/// holding no dead message since the last one passed through (`backlog`: the queue's
/// `status.backlog`, messages and when observed), or nothing of its group came, parked or
/// passed, for `quiet` (a broker that cannot say its backlog, or one whose backlog is other
/// groups' messages).
pub fn standing_done(
    backlog: Option<(Option<i64>, Timestamp)>,
    last_came: Timestamp,
    now: Timestamp,
    quiet: Duration,
) -> bool {
    if let Some((Some(0), observed)) = backlog
        && observed > last_came
    {
        return true;
    }
    let since = Duration::try_from(now.duration_since(last_came)).unwrap_or_default();
    since >= quiet
}

/// How many more decisions the pace allows now: `rate` per second since `started`, the
/// first one at once, with at most two seconds' worth in a burst (after a restart or a slow
/// step the replay catches up gently, never all at once).
pub fn budget(rate: f64, elapsed: Duration, decided: usize) -> usize {
    let due = (rate * elapsed.as_secs_f64()).floor() as usize + 1;
    let burst = ((2.0 * rate).ceil() as usize).max(1);
    due.saturating_sub(decided).min(burst)
}

/// How long to wait between two steps of a running replay at `rate`.
pub fn step(rate: f64) -> Duration {
    Duration::from_secs_f64((1.0 / rate).clamp(0.1, 1.0))
}

/// The status counts from an observation (`selected` and times are the run's own).
pub fn counts(into: &mut DeadLetterReplayStatus, o: &Observed) {
    let n = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
    // Never below what was already recorded: retention may delete resolved records mid-run.
    into.decided = into.decided.max(n(o.outcomes.len()));
    into.redriven = into.redriven.max(n(o.count(Outcome::Redriven)));
    into.dropped = into.dropped.max(n(o.count(Outcome::Dropped)));
    into.failed = n(o.count(Outcome::Failing));
    into.withdrawn = n(o.count(Outcome::Withdrawn));
    into.new_parked = n(o.new_parked);
}

/// The run in one line: the CLI prints it, the decision record (an Event) carries it.
pub fn summary(
    replay: &DeadLetterReplay,
    status: &DeadLetterReplayStatus,
    decide_secs: f64,
) -> String {
    let spec = &replay.spec;
    let ending = match (&status.stop_reason, status.phase) {
        (Some(why), _) => format!("stopped: {why}"),
        (None, _) if status.decided > status.redriven + status.dropped + status.failed => {
            "completed; some decisions still pending".to_string()
        }
        _ => "completed".to_string(),
    };
    let dropped = match spec.action() {
        Action::Drop => format!("dropped {}, ", status.dropped),
        Action::Redrive => String::new(),
    };
    let passed = if spec.standing() {
        format!("passed through {}, ", status.passed_through)
    } else {
        String::new()
    };
    format!(
        "replay {} by {}: selected {}, decided {}, redriven {}, {dropped}{passed}failing {}, withdrawn {}, skipped {}, new parkings {}; {} decisions in {:.1}s ({:.1}/s); {ending}",
        spec.selector().describe(&spec.queue),
        spec.by,
        status.selected,
        status.decided,
        status.redriven,
        status.failed,
        status.withdrawn,
        status.skipped,
        status.new_parked,
        status.decided,
        decide_secs,
        status.achieved_rate.unwrap_or(0.0),
    )
}

/// The progress line (`[####....] 12/300 decided, ...`) for a terminal or the page.
pub fn progress_line(status: &DeadLetterReplayStatus) -> String {
    match progress_counts(status) {
        None => progress_words(status),
        Some((done, total)) => {
            let filled = (done * 30 / total.max(1)).min(30);
            format!(
                "[{}{}] {}",
                "#".repeat(filled),
                ".".repeat(30 - filled),
                progress_words(status)
            )
        }
    }
}

/// Decisions made and records selected, for a bar; None for a standing replay, which has no
/// total to fill a bar with (what is left is in the broker).
pub fn progress_counts(status: &DeadLetterReplayStatus) -> Option<(usize, usize)> {
    (status.passed_through == 0).then(|| {
        (
            usize::try_from(status.decided).unwrap_or(0),
            usize::try_from(status.selected).unwrap_or(0),
        )
    })
}

/// [`progress_line`] without its bar (the page draws a `<progress>` element instead).
pub fn progress_words(status: &DeadLetterReplayStatus) -> String {
    match progress_counts(status) {
        None => format!(
            "standing: {} passed through, {} decided, {} redriven, {} failing, {} new parked",
            status.passed_through,
            status.decided,
            status.redriven + status.dropped,
            status.failed,
            status.new_parked
        ),
        Some((done, total)) => format!(
            "{done}/{total} decided, {} redriven, {} failing, {} new parked",
            status.redriven + status.dropped,
            status.failed,
            status.new_parked
        ),
    }
}

#[cfg(test)]
mod tests;
