//! A replay's canary: its first few decisions, spread across the selection, carried out and
//! watched for a while before anything else is decided or passed through. A canary job that
//! comes back (parked again as its next cycle) or whose requeue fails stops the replay, naming
//! it: "retry one, watch it, then the rest" as a rule the operator keeps, not a habit.

use std::collections::HashMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::KubeSchema;
use serde::{Deserialize, Serialize};

use super::outcome::{Outcome, outcome_of};
use crate::facts::Facts;

/// How long a canary is watched when the spec does not say.
pub const DEFAULT_OBSERVE: Duration = Duration::from_secs(120);
/// Most canary records one replay takes.
pub const MAX_CANARY: i64 = 100;

/// `spec.canary`: decide `count` records first and watch them before the rest.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Canary {
    /// How many records go first, spread across the selection (not the oldest few).
    #[schemars(range(min = 1, max = 100))]
    pub count: i64,
    /// How long to watch them once the last is carried out, in seconds (default 120).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub observe_seconds: Option<i64>,
}

impl Canary {
    /// How many records it takes (within 1..=[`MAX_CANARY`]).
    pub fn count(&self) -> usize {
        usize::try_from(self.count.clamp(1, MAX_CANARY)).unwrap_or(1)
    }

    /// How long its records are watched.
    pub fn observe(&self) -> Duration {
        self.observe_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(DEFAULT_OBSERVE, Duration::from_secs)
    }
}

/// `status.canary`: which records went first, and how the watch ended.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// The canary's records (names), decided before any other.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// When every canary record was first seen carried out: the watch runs from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried_out_at: Option<Time>,
    /// When the watch ended well: the rest may go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed_at: Option<Time>,
}

impl CanaryStatus {
    /// Whether it passed (the rest may go).
    pub fn passed(&self) -> bool {
        self.passed_at.is_some()
    }
}

/// `count` records of `selection` (oldest failure first), spread across it: the middle of
/// each of `count` equal stretches, so a canary sees early, middle and late failures alike.
pub fn picks<T: Copy>(selection: &[T], count: usize) -> Vec<T> {
    let len = selection.len();
    if count >= len {
        return selection.to_vec();
    }
    (0..count)
        .map(|i| selection[(2 * i + 1) * len / (2 * count)])
        .collect()
}

/// Where a canary's watch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Some canary records are not carried out yet.
    Carrying,
    /// All carried out, watched for less than the observe time (`since`: when the watch began,
    /// now if it begins at this look).
    Watching { since: Timestamp },
    /// Every canary job went and none came back within the observe time.
    Passed,
    /// Why the replay must stop, naming the canary records.
    Failed(String),
}

/// The canary's verdict from the queue's `records` now, its watch begun at `carried_out_at`
/// (None: not yet). Failed, naming each record whose requeue fails or whose job was parked
/// again as a later cycle, once every canary record so failed or the watch is over (nothing
/// else is decided meanwhile, so waiting to name them all costs nothing); Passed once the
/// watch is over with none failed. A canary record gone (retention) counts as carried out.
pub fn verdict<'a, R: Facts + 'a>(
    names: &[String],
    records: &'a [&'a R],
    carried_out_at: Option<Timestamp>,
    now: Timestamp,
    observe: Duration,
) -> Verdict {
    let by_name: HashMap<&str, &R> = records.iter().map(|r| (r.name(), *r)).collect();
    let canary: Vec<&R> = names
        .iter()
        .filter_map(|n| by_name.get(n.as_str()).copied())
        .collect();
    let failed = failures(&canary, records);
    let all_failed = !canary.is_empty() && failed.len() == canary.len();
    let carrying = canary.iter().any(|r| outcome_of(*r) == Outcome::Pending);
    let since = carried_out_at.unwrap_or(now);
    let watched = Duration::try_from(now.duration_since(since)).unwrap_or_default();
    let over = !carrying && watched >= observe;
    match (failed.is_empty(), all_failed || over) {
        (false, true) => Verdict::Failed(format!(
            "canary failed: {} of {}: {}",
            failed.len(),
            names.len(),
            failed.join("; ")
        )),
        (true, true) => Verdict::Passed,
        _ if carrying => Verdict::Carrying,
        _ => Verdict::Watching { since },
    }
}

/// What went wrong with each canary record: its requeue failing, or its job back as a later
/// cycle.
fn failures<R: Facts>(canary: &[&R], records: &[&R]) -> Vec<String> {
    let mut out = Vec::new();
    for r in canary {
        if outcome_of(*r) == Outcome::Failing {
            out.push(format!("{} ({}) failed to enqueue", r.name(), r.job_id()));
            continue;
        }
        let back = records
            .iter()
            .filter(|o| o.job_id() == r.job_id() && o.cycle() > r.cycle())
            .map(|o| o.cycle())
            .max();
        if let Some(cycle) = back {
            out.push(format!(
                "{} ({}) came back, parked again as cycle {cycle}",
                r.name(),
                r.job_id()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::picks;

    #[test]
    fn picks_spread_across_the_selection() {
        let selection: Vec<usize> = (0..100).collect();
        assert_eq!(picks(&selection, 5), [10, 30, 50, 70, 90]);
        assert_eq!(picks(&selection, 1), [50]);
        assert_eq!(picks(&selection[..3], 5), [0, 1, 2], "all when fewer");
        assert!(picks::<usize>(&[], 5).is_empty());
    }
}
