//! `DeadLetterGroup`: one object per failure group of a queue (see [`crate::group`] for the
//! fingerprint), kept by the operator, and the pure plan of a queue's groups from its records:
//! counts, first and last seen, rates, tier, samples, which groups fit under the queue's bound
//! and which empty ones go.
//!
//! The operator computes this from its record index on every queue reconcile and writes only
//! what changed, at most once per group every few seconds; parking never waits for it.

use std::collections::{BTreeMap, HashSet};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::dead_letter::{FailureKind, Phase};
use crate::facts::Facts;
use crate::group::{self, LABEL_GROUP};
use crate::history::{self, GroupHistory};
use crate::queue::DeadLetterQueue;
pub use crate::queue::GroupSettings;

/// Most groups of one queue by default; beyond it records fall in the overflow group.
pub const DEFAULT_MAX_GROUPS: usize = 100;
/// The fingerprint (label value) of a queue's overflow group.
pub const OVERFLOW: &str = "overflow";
/// Record names a group's status shows.
pub const SAMPLES: usize = 5;
/// Default tier thresholds: a storm is critical, a sustained rate (one a minute over the
/// last hour) a warning, anything less a trickle (info, a data-quality ticket).
pub const DEFAULT_CRITICAL_PER_MINUTE: i64 = 100;
pub const DEFAULT_WARNING_PER_HOUR: i64 = 60;

/// One failure group of a queue. Created, kept and deleted by the operator; owned by its queue.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "dlq.dev",
    version = "v1alpha1",
    kind = "DeadLetterGroup",
    namespaced,
    shortname = "dlg",
    category = "dlq-all",
    status = "DeadLetterGroupStatus",
    printcolumn = r#"{"name":"Queue","type":"string","jsonPath":".metadata.labels.dlq\\.dev/queue"}"#,
    printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".status.failureKind"}"#,
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".status.serviceVersion"}"#,
    printcolumn = r#"{"name":"Parked","type":"integer","jsonPath":".status.parked"}"#,
    printcolumn = r#"{"name":"Rate/min","type":"integer","jsonPath":".status.ratePerMinute"}"#,
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".status.tier"}"#,
    printcolumn = r#"{"name":"Ack","type":"string","jsonPath":".spec.acknowledged.by"}"#,
    printcolumn = r#"{"name":"Last seen","type":"date","jsonPath":".status.lastSeen"}"#,
    printcolumn = r#"{"name":"Template","type":"string","jsonPath":".status.template"}"#,
    printcolumn = r#"{"name":"Class","type":"string","jsonPath":".status.errorClass","priority":1}"#,
    printcolumn = r#"{"name":"Redriven","type":"integer","jsonPath":".status.redriven","priority":1}"#,
    printcolumn = r#"{"name":"Dropped","type":"integer","jsonPath":".status.dropped","priority":1}"#,
    printcolumn = r#"{"name":"Recurring","type":"integer","jsonPath":".status.recurring","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterGroupSpec {
    /// Someone has this group in hand: its alert is silenced until a new failure says
    /// otherwise (parked count doubled, tier risen). Signed like a decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged: Option<Acknowledgement>,
}

/// Who acknowledged a group, and why.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.by.trim() != ''").message("every acknowledgement must be signed: set spec.acknowledged.by"))]
pub struct Acknowledgement {
    #[schemars(length(min = 1, max = 253))]
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub note: Option<String>,
}

/// What the group looked like when it was acknowledged (the operator writes it once per
/// acknowledgement): a new failure is judged against it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AcknowledgedAt {
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Parked records then.
    pub parked: i64,
    /// The tier then.
    pub tier: Tier,
}

/// The acknowledgement `status` keeps, given the group's `spec` and what `previous` kept: the
/// same as before while the acknowledgement is unchanged, a new baseline (this status's parked
/// count and tier) when it is new or changed, none without one.
pub fn acknowledged_at(
    spec: &DeadLetterGroupSpec,
    previous: Option<&AcknowledgedAt>,
    status: &DeadLetterGroupStatus,
) -> Option<AcknowledgedAt> {
    let ack = spec.acknowledged.as_ref()?;
    match previous {
        Some(p) if p.by == ack.by && p.note == ack.note => Some(p.clone()),
        _ => Some(AcknowledgedAt {
            by: ack.by.clone(),
            note: ack.note.clone(),
            parked: status.parked,
            tier: status.tier,
        }),
    }
}

/// Whether an acknowledgement still silences the group: acknowledged, and neither has its
/// parked count doubled nor its tier risen since. A new failure never hides behind it.
pub fn silenced(status: &DeadLetterGroupStatus) -> bool {
    status
        .acknowledgement
        .as_ref()
        .is_some_and(|a| status.parked < 2 * a.parked.max(1) && status.tier <= a.tier)
}

/// Info: a trickle (data quality). Warning: a sustained rate. Critical: a storm.
#[derive(
    schemars::JsonSchema,
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Default,
    PartialOrd,
    Ord,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    #[default]
    Info,
    Warning,
    Critical,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Info => "info",
            Tier::Warning => "warning",
            Tier::Critical => "critical",
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterGroupStatus {
    /// The reason with its variable parts masked (the overflow group says so instead).
    #[serde(default)]
    pub template: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_kind: Option<FailureKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    #[serde(default)]
    pub parked: i64,
    #[serde(default)]
    pub redriven: i64,
    #[serde(default)]
    pub dropped: i64,
    /// Records of cycle 2 or more: jobs that died again after a redrive.
    #[serde(default)]
    pub recurring: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seen: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// Records parked in the last minute.
    #[serde(default)]
    pub rate_per_minute: i64,
    /// Records parked in the last hour.
    #[serde(default)]
    pub rate_per_hour: i64,
    #[serde(default)]
    pub tier: Tier,
    /// A few record names, Parked ones first, newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<String>,
    /// The acknowledgement in force and what the group looked like then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledgement: Option<AcknowledgedAt>,
    /// Whether the acknowledgement silences the group's alert now ([`silenced`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub silenced: bool,
    /// Its estimated share of the queue's `status.backlog` (absent while the queue reports
    /// none): what of this group still waits in the broker beyond its records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<GroupBacklog>,
    /// Dead messages of this group that standing replays passed straight from the broker to
    /// the target without a record (the sum of their `status.passedThrough`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub passed_through: i64,
    /// Its story over time (see `dlq_core::history`): parked per hour for 7 days, what it
    /// spans, its trend. Kept here so that it outlives its records and the operator's restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<GroupHistory>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// A group's `status.backlog`: an estimate, the queue's backlog times the group's share of the
/// queue's newest [`RECENT_ARRIVALS`] records. The broker's dead messages cannot be read
/// without taking them, and the newest records are what died last, next to what waits.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GroupBacklog {
    /// Estimated messages; absent when the broker cannot say how many the queue has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<i64>,
}

/// How many of a queue's newest records its groups' shares of the backlog are read from.
pub const RECENT_ARRIVALS: usize = 1_000;

impl GroupBacklog {
    /// The estimate for a person: `~175,000`, `0` (nothing is an exact count), or `unknown`.
    pub fn shown(&self) -> String {
        match self.messages {
            None => "unknown".to_string(),
            Some(0) => "0".to_string(),
            Some(n) => format!("~{}", crate::queue::thousands(n)),
        }
    }
}

/// A group in one line: `5,000 parked, ~175,000 waiting in the broker` (`unknown` where the
/// broker cannot say; only the parked count for a queue without a backlog).
pub fn parked_and_waiting(parked: i64, backlog: Option<&GroupBacklog>) -> String {
    let parked = crate::queue::thousands(parked);
    match backlog {
        Some(b) => format!("{parked} parked, {} waiting in the broker", b.shown()),
        None => format!("{parked} parked"),
    }
}

/// A group's estimated share of `backlog`: `recent` of the queue's `recent_total` newest
/// records are the group's.
pub fn backlog_share(
    backlog: Option<&crate::queue::QueueBacklog>,
    recent: usize,
    recent_total: usize,
) -> Option<GroupBacklog> {
    let backlog = backlog?;
    let messages = backlog.messages.map(|m| {
        if recent_total == 0 || m <= 0 {
            return m.max(0);
        }
        let share = m as f64 * recent as f64 / recent_total as f64;
        share.round() as i64
    });
    Some(GroupBacklog { messages })
}

impl GroupSettings {
    pub fn max(&self) -> usize {
        self.max
            .and_then(|m| usize::try_from(m).ok())
            .filter(|m| *m > 0)
            .unwrap_or(DEFAULT_MAX_GROUPS)
    }

    /// The tier of a group parking at these rates.
    pub fn tier(&self, per_minute: i64, per_hour: i64) -> Tier {
        if per_minute
            >= self
                .critical_per_minute
                .unwrap_or(DEFAULT_CRITICAL_PER_MINUTE)
        {
            Tier::Critical
        } else if per_hour >= self.warning_per_hour.unwrap_or(DEFAULT_WARNING_PER_HOUR) {
            Tier::Warning
        } else {
            Tier::Info
        }
    }
}

/// The object name of a queue's group: `<queue>-<fingerprint>` (or `<queue>-overflow`).
pub fn group_name(queue: &str, fingerprint: &str) -> String {
    format!("{queue}-{fingerprint}")
}

/// A group object as the operator keeps it, its status set.
pub fn group_object(
    queue: &DeadLetterQueue,
    fingerprint: &str,
    status: DeadLetterGroupStatus,
) -> DeadLetterGroup {
    use kube_core::Resource;
    let queue_name = queue.meta().name.clone().unwrap_or_default();
    let mut g = DeadLetterGroup::new(
        &group_name(&queue_name, fingerprint),
        DeadLetterGroupSpec::default(),
    );
    g.metadata.namespace = queue.meta().namespace.clone();
    g.metadata.labels = Some(BTreeMap::from([
        (crate::dead_letter::LABEL_QUEUE.to_string(), queue_name),
        (LABEL_GROUP.to_string(), fingerprint.to_string()),
    ]));
    g.metadata.owner_references = queue.controller_owner_ref(&()).map(|mut o| {
        o.block_owner_deletion = None;
        vec![o]
    });
    g.status = Some(status);
    g
}

/// What one queue's groups should be now.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GroupsPlan {
    /// Every group with records, keyed by fingerprint (or [`OVERFLOW`]).
    pub groups: BTreeMap<String, DeadLetterGroupStatus>,
    /// Fingerprints folded into the overflow group (0: none).
    pub overflowed: usize,
    /// Existing group objects (fingerprints) to delete: no records left, past retention.
    pub delete: Vec<String>,
}

/// An existing group object, as the plan reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Existing<'a> {
    pub fingerprint: &'a str,
    pub last_seen: Option<Timestamp>,
    /// Its history as last written: the next one is folded from it.
    pub history: Option<&'a GroupHistory>,
}

/// Running totals of one group while the records are read.
#[derive(Default)]
struct Tally<'a> {
    status: DeadLetterGroupStatus,
    first_seen: Option<Timestamp>,
    last_seen: Option<Timestamp>,
    /// (parked?, seen, record) of candidate samples.
    samples: Vec<(bool, Timestamp, &'a dyn Facts)>,
}

/// When a record was parked (created), or failed when it was never stored.
fn seen(r: &dyn Facts) -> Timestamp {
    r.created().unwrap_or_else(|| r.failed_at())
}

impl<'a> Tally<'a> {
    fn add(&mut self, r: &'a dyn Facts, now: Timestamp) {
        let s = &mut self.status;
        match r.phase() {
            Phase::Parked => s.parked += 1,
            Phase::Redriven => s.redriven += 1,
            Phase::Dropped => s.dropped += 1,
        }
        if r.cycle() >= 2 {
            s.recurring += 1;
        }
        let at = seen(r);
        self.first_seen = Some(self.first_seen.map_or(at, |f| f.min(at)));
        self.last_seen = Some(self.last_seen.map_or(at, |l| l.max(at)));
        let ago = now.as_second() - at.as_second();
        if ago < 60 {
            s.rate_per_minute += 1;
        }
        if ago < 3600 {
            s.rate_per_hour += 1;
        }
        self.samples.push((r.phase() == Phase::Parked, at, r));
    }

    /// Its records seen at or after `since` (the queue's newest arrivals).
    fn recent(&self, since: Option<Timestamp>) -> usize {
        since.map_or(0, |since| {
            self.samples.iter().filter(|s| s.1 >= since).count()
        })
    }

    /// The group's next history from `previous` and the records counted.
    fn history(&self, previous: Option<&GroupHistory>, now: Timestamp) -> GroupHistory {
        history::fold(previous, self.samples.iter().map(|s| s.2), now)
    }

    fn finish(mut self, settings: &GroupSettings) -> DeadLetterGroupStatus {
        self.samples.sort_by(|a, b| {
            b.0.cmp(&a.0)
                .then(b.1.cmp(&a.1))
                .then(a.2.name().cmp(b.2.name()))
        });
        let samples = &self.samples[..self.samples.len().min(SAMPLES)];
        self.status.samples = samples.iter().map(|s| s.2.name().to_string()).collect();
        // The template shown: the samples' most telling one. A hex id that happens to be all
        // digits masks as `<n>` (the fingerprint counts both alike); another sample says `<hex>`.
        let shown = samples
            .iter()
            .map(|s| (group::Key::of(s.2), group::template(s.2.reason())))
            .rev()
            .max_by_key(|(_, t)| t.matches("<hex>").count());
        if let Some((key, template)) = shown {
            self.status.template = template;
            self.status.failure_kind = Some(key.failure_kind);
            self.status.service_version = key.service_version.map(str::to_string);
            self.status.error_class = key.error_class.map(str::to_string);
        }
        self.status.first_seen = self.first_seen.map(Time);
        self.status.last_seen = self.last_seen.map(Time);
        self.status.tier = settings.tier(self.status.rate_per_minute, self.status.rate_per_hour);
        self.status
    }
}

/// The groups of `queue` from its `records` at `now`. Groups that already have an object keep
/// their place under the bound; new ones take the free places oldest first (by first seen,
/// then fingerprint), and the records of the rest are counted in the overflow group.
pub fn plan<'a, R: Facts + 'a>(
    queue: &DeadLetterQueue,
    records: impl IntoIterator<Item = &'a R>,
    existing: &[Existing<'_>],
    now: Timestamp,
) -> GroupsPlan {
    let settings = queue.spec.groups.clone().unwrap_or_default();
    let mut tallies: BTreeMap<String, Tally<'a>> = BTreeMap::new();
    for r in records {
        tallies
            .entry(r.group().into_owned())
            .or_default()
            .add(r, now);
    }
    let known: HashSet<&str> = existing
        .iter()
        .map(|e| e.fingerprint)
        .filter(|f| *f != OVERFLOW)
        .collect();
    let mut order: Vec<(&String, bool, Option<Timestamp>)> = tallies
        .iter()
        .map(|(f, t)| (f, known.contains(f.as_str()), t.first_seen))
        .collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(b.0)));
    let kept: HashSet<String> = order
        .iter()
        .take(settings.max())
        .map(|(f, _, _)| (*f).clone())
        .collect();
    let since = newest_since(&tallies, RECENT_ARRIVALS);
    let recent_total: usize = tallies.values().map(|t| t.recent(since)).sum();
    let backlog = queue.status.as_ref().and_then(|s| s.backlog.as_ref());
    let mut plan = GroupsPlan::default();
    let mut overflow = Tally::default();
    let mut overflow_recent = 0;
    for (fingerprint, tally) in tallies {
        let recent = tally.recent(since);
        if kept.contains(&fingerprint) {
            let history = tally.history(previous(existing, &fingerprint), now);
            let mut status = tally.finish(&settings);
            status.history = Some(history);
            status.backlog = backlog_share(backlog, recent, recent_total);
            plan.groups.insert(fingerprint, status);
        } else {
            plan.overflowed += 1;
            overflow_recent += recent;
            merge(&mut overflow, tally);
        }
    }
    if plan.overflowed > 0 {
        let history = overflow.history(previous(existing, OVERFLOW), now);
        let mut status = overflow.finish(&settings);
        status.history = Some(history);
        status.backlog = backlog_share(backlog, overflow_recent, recent_total);
        status.template = format!(
            "records of {} more groups than this queue's {} (spec.groups.max)",
            plan.overflowed,
            settings.max()
        );
        status.failure_kind = None;
        status.service_version = None;
        status.error_class = None;
        plan.groups.insert(OVERFLOW.to_string(), status);
    }
    let keep = retention(queue);
    plan.delete = existing
        .iter()
        .filter(|e| !plan.groups.contains_key(e.fingerprint))
        .filter(|e| {
            e.last_seen
                .is_none_or(|l| now.as_second() - l.as_second() >= keep.as_secs() as i64)
        })
        .map(|e| e.fingerprint.to_string())
        .collect();
    plan
}

/// The history an existing group was last written with.
fn previous<'e>(existing: &[Existing<'e>], fingerprint: &str) -> Option<&'e GroupHistory> {
    existing
        .iter()
        .find(|e| e.fingerprint == fingerprint)
        .and_then(|e| e.history)
}

/// When the newest `n` records of all `tallies` began: the `n`-th newest record's time (None
/// without records).
fn newest_since(tallies: &BTreeMap<String, Tally<'_>>, n: usize) -> Option<Timestamp> {
    let mut seen: Vec<Timestamp> = tallies
        .values()
        .flat_map(|t| t.samples.iter().map(|s| s.1))
        .collect();
    if seen.is_empty() {
        return None;
    }
    let k = n.clamp(1, seen.len()) - 1;
    let (_, kth, _) = seen.select_nth_unstable_by(k, |a, b| b.cmp(a));
    Some(*kth)
}

/// How long an empty group stays: the queue's `retention.resolvedFor`, else not at all.
fn retention(queue: &DeadLetterQueue) -> std::time::Duration {
    queue
        .spec
        .retention
        .as_ref()
        .and_then(|r| crate::duration::parse_duration(&r.resolved_for))
        .unwrap_or_default()
}

/// Folds one group's tally into the overflow group's.
fn merge<'a>(into: &mut Tally<'a>, from: Tally<'a>) {
    let (a, b) = (&mut into.status, &from.status);
    a.parked += b.parked;
    a.redriven += b.redriven;
    a.dropped += b.dropped;
    a.recurring += b.recurring;
    a.rate_per_minute += b.rate_per_minute;
    a.rate_per_hour += b.rate_per_hour;
    into.first_seen = [into.first_seen, from.first_seen]
        .into_iter()
        .flatten()
        .min();
    into.last_seen = [into.last_seen, from.last_seen].into_iter().flatten().max();
    into.samples.extend(from.samples);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::DeadLetter;
    use crate::queue::{DeadLetterQueueSpec, Retention};
    use crate::testing::{RecordBuilder, at};

    fn queue(groups: Option<GroupSettings>) -> DeadLetterQueue {
        let mut q = DeadLetterQueue::new(
            "relayer",
            DeadLetterQueueSpec {
                groups,
                retention: Some(Retention {
                    resolved_for: "1h".into(),
                }),
                ..Default::default()
            },
        );
        q.metadata.namespace = Some("payments".into());
        q.metadata.uid = Some("q-uid".into());
        q
    }

    fn record(id: &str, reason: &str, version: &str, created: i64) -> RecordBuilder {
        RecordBuilder::job(id)
            .reason(reason)
            .service_version(version)
            .created(at(created))
    }

    const NOW: i64 = 100_000;

    fn timeouts() -> Vec<DeadLetter> {
        vec![
            record(
                "a",
                "timeout after 3021 ms talking to payer 7f3a9c21",
                "r@1",
                NOW - 10,
            )
            .build(),
            record(
                "b",
                "timeout after 15 ms talking to payer 0b11e0aa",
                "r@1",
                NOW - 120,
            )
            .cycle(2)
            .build(),
            record(
                "c",
                "timeout after 9 ms talking to payer 1234abcd",
                "r@1",
                NOW - 7200,
            )
            .resolved(Phase::Redriven, "ops", at(NOW - 7000))
            .build(),
            record(
                "d",
                "timeout after 9 ms talking to payer 1234abcd",
                "r@2",
                NOW - 5,
            )
            .resolved(Phase::Dropped, "ops", at(NOW))
            .build(),
        ]
    }

    #[test]
    fn a_group_counts_its_records_and_describes_itself() {
        let records = timeouts();
        let plan = plan(&queue(None), &records, &[], at(NOW));
        assert_eq!(plan.groups.len(), 2, "two versions, two groups");
        assert_eq!(plan.overflowed, 0);
        let g = &plan.groups[&*records[0].group()];
        assert_eq!(g.template, "timeout after <n> ms talking to payer <hex>");
        assert_eq!(g.failure_kind, Some(FailureKind::Transient));
        assert_eq!(g.service_version.as_deref(), Some("r@1"));
        assert_eq!((g.parked, g.redriven, g.dropped, g.recurring), (2, 1, 0, 1));
        assert_eq!((g.rate_per_minute, g.rate_per_hour), (1, 2));
        assert_eq!(g.first_seen, Some(Time(at(NOW - 7200))));
        assert_eq!(g.last_seen, Some(Time(at(NOW - 10))));
        assert_eq!(g.tier, Tier::Info);
        let names: Vec<&str> = records.iter().map(|r| r.name()).collect();
        assert_eq!(
            g.samples,
            [names[0], names[1], names[2]],
            "Parked first, newest first"
        );
        let other = &plan.groups[&*records[3].group()];
        assert_eq!((other.parked, other.dropped), (0, 1));
    }

    #[test]
    fn tiers_follow_the_rates_and_the_queues_thresholds() {
        let storm: Vec<DeadLetter> = (0..100)
            .map(|i| record(&format!("s{i}"), &format!("boom {i}"), "r@1", NOW - 30).build())
            .collect();
        let plan_of = |q: &DeadLetterQueue, n: usize| {
            let p = plan(q, &storm[..n], &[], at(NOW));
            p.groups.values().next().map(|g| g.tier)
        };
        assert_eq!(plan_of(&queue(None), 100), Some(Tier::Critical));
        assert_eq!(
            plan_of(&queue(None), 99),
            Some(Tier::Warning),
            "99 in the hour"
        );
        assert_eq!(plan_of(&queue(None), 59), Some(Tier::Info));
        let strict = queue(Some(GroupSettings {
            critical_per_minute: Some(10),
            warning_per_hour: Some(5),
            ..Default::default()
        }));
        assert_eq!(plan_of(&strict, 10), Some(Tier::Critical));
        assert_eq!(plan_of(&strict, 5), Some(Tier::Warning));
        assert_eq!(plan_of(&strict, 4), Some(Tier::Info));
    }

    #[test]
    fn beyond_the_bound_new_groups_overflow_and_known_ones_keep_their_place() {
        let records: Vec<DeadLetter> = (0..5)
            .map(|i| record(&format!("j{i}"), "boom", &format!("r@{i}"), NOW - 100 + i).build())
            .collect();
        let q = queue(Some(GroupSettings {
            max: Some(3),
            ..Default::default()
        }));
        let p = plan(&q, &records, &[], at(NOW));
        assert_eq!(p.overflowed, 2);
        assert_eq!(p.groups.len(), 4, "three groups and the overflow");
        for r in &records[..3] {
            assert!(p.groups.contains_key(&*r.group()), "the oldest keep places");
        }
        let overflow = &p.groups[OVERFLOW];
        assert_eq!(overflow.parked, 2);
        assert!(
            overflow.template.contains("2 more groups"),
            "{}",
            overflow.template
        );
        // A group that already has an object keeps its place, even a younger one.
        let young = records[4].group();
        let existing = [Existing {
            fingerprint: &young,
            last_seen: None,
            history: None,
        }];
        let p = plan(&q, &records, &existing, at(NOW));
        assert!(p.groups.contains_key(&*young));
        assert!(!p.groups.contains_key(&*records[2].group()));
    }

    #[test]
    fn empty_groups_go_after_the_queues_retention() {
        let records = timeouts();
        let live = records[0].group();
        let existing = [
            Existing {
                fingerprint: &live,
                last_seen: Some(at(NOW - 10)),
                history: None,
            },
            Existing {
                fingerprint: "0000000001",
                last_seen: Some(at(NOW - 3600)),
                history: None,
            },
            Existing {
                fingerprint: "0000000002",
                last_seen: Some(at(NOW - 3599)),
                history: None,
            },
        ];
        let p = plan(&queue(None), &records, &existing, at(NOW));
        assert_eq!(p.delete, ["0000000001"]);
    }

    #[test]
    fn an_acknowledgement_silences_until_the_group_doubles_or_its_tier_rises() {
        let status = |parked: i64, tier: Tier| DeadLetterGroupStatus {
            parked,
            tier,
            ..Default::default()
        };
        let spec = DeadLetterGroupSpec {
            acknowledged: Some(Acknowledgement {
                by: "carol".into(),
                note: Some("INC-1234".into()),
            }),
        };
        assert_eq!(
            acknowledged_at(
                &DeadLetterGroupSpec::default(),
                None,
                &status(3, Tier::Info)
            ),
            None
        );
        let at = acknowledged_at(&spec, None, &status(10, Tier::Warning));
        assert_eq!(
            at.as_ref().map(|a| (a.parked, a.tier)),
            Some((10, Tier::Warning))
        );
        let kept = acknowledged_at(&spec, at.as_ref(), &status(15, Tier::Warning));
        assert_eq!(
            kept, at,
            "the baseline stays while the acknowledgement does"
        );
        let with = |parked, tier| DeadLetterGroupStatus {
            acknowledgement: at.clone(),
            ..status(parked, tier)
        };
        assert!(silenced(&with(19, Tier::Warning)));
        assert!(silenced(&with(0, Tier::Info)));
        assert!(!silenced(&with(20, Tier::Warning)), "doubled");
        assert!(!silenced(&with(11, Tier::Critical)), "tier rose");
        assert!(!silenced(&status(1, Tier::Info)), "not acknowledged");
        let renewed = DeadLetterGroupSpec {
            acknowledged: Some(Acknowledgement {
                by: "dave".into(),
                note: None,
            }),
        };
        let again = acknowledged_at(&renewed, at.as_ref(), &status(25, Tier::Critical));
        assert_eq!(
            again.map(|a| (a.by, a.parked, a.tier)),
            Some(("dave".into(), 25, Tier::Critical))
        );
    }

    #[test]
    fn a_groups_backlog_is_its_share_of_the_queues_newest_arrivals() {
        use crate::queue::{DeadLetterQueueStatus, QueueBacklog};
        // The newest 1,000 records: 900 payer timeouts and 100 of a bug that stormed earlier
        // (its 2,000 older records say nothing of what waits now).
        let mut records: Vec<DeadLetter> = (0..900)
            .map(|i| {
                record(
                    &format!("t{i}"),
                    "timeout talking to payer",
                    "r@1",
                    NOW - 10,
                )
                .build()
            })
            .collect();
        records.extend((0..2_100).map(|i| {
            let created = if i < 100 { NOW - 20 } else { NOW - 5_000 };
            record(&format!("n{i}"), "null pointer", "r@1", created).build()
        }));
        let (timeouts, bug) = (records[0].group(), records[900].group());
        let with_backlog = |backlog: Option<QueueBacklog>| {
            let mut q = queue(None);
            q.status = Some(DeadLetterQueueStatus {
                backlog,
                ..Default::default()
            });
            plan(&q, &records, &[], at(NOW))
        };
        let p = with_backlog(Some(QueueBacklog {
            messages: Some(175_000),
            observed_at: None,
        }));
        let share = |p: &GroupsPlan, g: &str| p.groups[g].backlog.clone();
        assert_eq!(share(&p, &timeouts).and_then(|b| b.messages), Some(157_500));
        assert_eq!(share(&p, &bug).and_then(|b| b.messages), Some(17_500));
        assert_eq!(
            parked_and_waiting(p.groups[&*timeouts].parked, share(&p, &timeouts).as_ref()),
            "900 parked, ~157,500 waiting in the broker"
        );
        let unknown = with_backlog(Some(QueueBacklog::default()));
        let b = share(&unknown, &timeouts);
        assert_eq!(b, Some(GroupBacklog { messages: None }), "unknown, not 0");
        assert_eq!(
            parked_and_waiting(900, b.as_ref()),
            "900 parked, unknown waiting in the broker"
        );
        let empty = with_backlog(Some(QueueBacklog {
            messages: Some(0),
            observed_at: None,
        }));
        assert_eq!(share(&empty, &bug).and_then(|b| b.messages), Some(0));
        assert_eq!(GroupBacklog { messages: Some(0) }.shown(), "0");
        let none = with_backlog(None);
        assert_eq!(share(&none, &timeouts), None, "a queue without a backlog");
        assert_eq!(parked_and_waiting(5_000, None), "5,000 parked");
    }

    #[test]
    fn the_overflow_group_estimates_the_share_of_the_groups_it_holds() {
        use crate::queue::{DeadLetterQueueStatus, QueueBacklog};
        let records: Vec<DeadLetter> = (0..4)
            .map(|i| record(&format!("j{i}"), "boom", &format!("r@{i}"), NOW - 100 + i).build())
            .collect();
        let mut q = queue(Some(GroupSettings {
            max: Some(1),
            ..Default::default()
        }));
        q.status = Some(DeadLetterQueueStatus {
            backlog: Some(QueueBacklog {
                messages: Some(400),
                observed_at: None,
            }),
            ..Default::default()
        });
        let p = plan(&q, &records, &[], at(NOW));
        assert_eq!(
            p.groups[OVERFLOW].backlog.as_ref().and_then(|b| b.messages),
            Some(300)
        );
        assert_eq!(
            p.groups[&*records[0].group()]
                .backlog
                .as_ref()
                .and_then(|b| b.messages),
            Some(100)
        );
    }

    #[test]
    fn a_groups_history_is_folded_from_the_one_last_written() {
        let records = timeouts();
        let fingerprint = records[0].group().into_owned();
        let first = plan(&queue(None), &records, &[], at(NOW));
        let written = first.groups[&fingerprint]
            .history
            .clone()
            .unwrap_or_default();
        assert_eq!(
            written.parked.iter().sum::<u32>(),
            3,
            "every record, of any phase"
        );
        assert_eq!(written.trend.last_hour, 2);
        // Retention deleted the redriven record: its hour stays counted.
        let existing = [Existing {
            fingerprint: &fingerprint,
            last_seen: None,
            history: Some(&written),
        }];
        let again = plan(&queue(None), &records[..2], &existing, at(NOW));
        assert_eq!(again.groups[&fingerprint].history, Some(written));
    }

    #[test]
    fn a_group_object_is_named_labelled_and_owned_by_its_queue() {
        let q = queue(None);
        let g = group_object(&q, "3f9a1c07d2", DeadLetterGroupStatus::default());
        assert_eq!(g.metadata.name.as_deref(), Some("relayer-3f9a1c07d2"));
        assert_eq!(g.metadata.namespace.as_deref(), Some("payments"));
        let labels = g.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[LABEL_GROUP], "3f9a1c07d2");
        assert_eq!(labels[crate::dead_letter::LABEL_QUEUE], "relayer");
        let owner = &g.metadata.owner_references.clone().unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("DeadLetterQueue", "q-uid")
        );
    }
}
