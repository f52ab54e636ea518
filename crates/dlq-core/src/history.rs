//! A failure group's story over time (`DeadLetterGroup.status.history`): records parked per
//! hour for the last 7 days as one dense array, first and last seen, the service versions and
//! error classes it spans, and its trend (the last hour against the hour before).
//!
//! It is a pure fold of the previous history and the group's records, so that it outlives the
//! records (retention deletes resolved ones) and the process (it lives in status). A record is
//! counted for good once it is [`SETTLE`] old, and `settled` moves past it: no later fold, in
//! this process or a new leader, counts it again, and its hour stays counted after the record
//! is deleted. Newer records are counted as `unsettled`, recounted at each fold, so a parking
//! shows at once.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::facts::Facts;

/// Hours a history keeps: 7 days.
pub const HOURS: usize = 168;
/// Service versions (and error classes) a history names; the rest are counted as `other`.
pub const SPANNED: usize = 10;
const HOUR: i64 = 3600;

/// A group's `status.history`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GroupHistory {
    /// The start (UTC) of the hour the last of `parked` counts; absent before any parking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through: Option<Time>,
    /// Records parked each hour, oldest first, the last one the hour of `through`. Hours
    /// before the first parking of the last 7 days are left out, so at most 168.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 168))]
    pub parked: Vec<u32>,
    /// The group's first parking ever seen (kept after its record is gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seen: Option<Time>,
    /// The group's latest parking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// Records per service version, most first.
    #[serde(default)]
    pub service_versions: Spans,
    /// Records per error class, most first.
    #[serde(default)]
    pub error_classes: Spans,
    #[serde(default)]
    pub trend: Trend,
    /// Every record created before this time is in the counts above once, for good (whether
    /// or not it still exists); the newer ones are `unsettled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settled: Option<Time>,
    /// The part of the counts above from records created at or after `settled`: counted again
    /// at each fold, until they are [`SETTLE`] old.
    #[serde(default, skip_serializing_if = "Unsettled::is_empty")]
    pub unsettled: Unsettled,
}

/// The newest records' share of a history's counts (at most the last [`SETTLE`] seconds' and
/// whatever parked since the operator last folded).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Unsettled {
    /// Per hour, the last one the hour of the history's `through`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 168))]
    pub parked: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_versions: Vec<Spanned>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub error_classes: Vec<Spanned>,
}

impl Unsettled {
    pub fn is_empty(&self) -> bool {
        self.parked.is_empty() && self.service_versions.is_empty() && self.error_classes.is_empty()
    }
}

/// The most frequent values and how many records had any other.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Spans {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub top: Vec<Spanned>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub other: i64,
}

/// One value and its records.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Spanned {
    #[schemars(length(max = 256))]
    pub name: String,
    pub count: i64,
}

/// Records parked in the last hour and in the hour before it (rolling, not clock hours).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Trend {
    #[serde(default)]
    pub last_hour: i64,
    #[serde(default)]
    pub hour_before: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl Trend {
    /// For a person: `↑ 12→52`, `↓ 20→3`, `= 5→5`.
    pub fn shown(&self) -> String {
        let arrow = match self.last_hour.cmp(&self.hour_before) {
            std::cmp::Ordering::Greater => '↑',
            std::cmp::Ordering::Less => '↓',
            std::cmp::Ordering::Equal => '=',
        };
        format!("{arrow} {}→{}", self.hour_before, self.last_hour)
    }
}

/// The start of the hour `at` falls in, in seconds.
fn hour_of(at: Timestamp) -> i64 {
    at.as_second().div_euclid(HOUR) * HOUR
}

/// When a record was parked (created), or failed when it was never stored.
fn seen(r: &dyn Facts) -> Timestamp {
    r.created().unwrap_or_else(|| r.failed_at())
}

impl GroupHistory {
    /// Parked per hour by the hour's start (seconds), as kept.
    fn by_hour(&self) -> BTreeMap<i64, u32> {
        let Some(through) = self.through.as_ref().map(|t| hour_of(t.0)) else {
            return BTreeMap::new();
        };
        by_hour(&self.parked, through).collect()
    }

    /// The last `hours` hours up to the one `now` falls in, oldest first, zero where nothing
    /// was parked (or the history does not reach back).
    pub fn hourly(&self, now: Timestamp, hours: usize) -> Vec<u32> {
        let by_hour = self.by_hour();
        let end = hour_of(now);
        (0..hours as i64)
            .rev()
            .map(|back| by_hour.get(&(end - back * HOUR)).copied().unwrap_or(0))
            .collect()
    }
}

/// How old a record must be (seconds) to be counted for good: the operator's record watch
/// shows a new record well within it, so no record older than this is missing from a fold.
pub const SETTLE: i64 = 15;

/// Counts of some records: by hour (its start, seconds), by service version, by error class.
#[derive(Default)]
struct Counts {
    hours: BTreeMap<i64, u32>,
    versions: BTreeMap<String, i64>,
    classes: BTreeMap<String, i64>,
    /// Records of versions (classes) no longer named, from a previous history's `other`.
    other_versions: i64,
    other_classes: i64,
}

impl Counts {
    fn add(&mut self, r: &dyn Facts, at: Timestamp) {
        *self.hours.entry(hour_of(at)).or_default() += 1;
        if let Some(v) = r.service_version() {
            *self.versions.entry(v.to_string()).or_default() += 1;
        }
        if let Some(c) = r.error_class() {
            *self.classes.entry(c.to_string()).or_default() += 1;
        }
    }

    /// What a previous history counted for good: its counts less its unsettled part.
    fn settled(previous: &GroupHistory) -> Counts {
        let mut hours = previous.by_hour();
        let through = previous.through.as_ref().map_or(0, |t| hour_of(t.0));
        for (hour, n) in by_hour(&previous.unsettled.parked, through) {
            if let Some(kept) = hours.get_mut(&hour) {
                *kept = kept.saturating_sub(n);
            }
        }
        let (versions, other_versions) = less(
            &previous.service_versions,
            &previous.unsettled.service_versions,
        );
        let (classes, other_classes) =
            less(&previous.error_classes, &previous.unsettled.error_classes);
        Counts {
            hours,
            versions,
            classes,
            other_versions,
            other_classes,
        }
    }

    fn plus(mut self, more: &Counts) -> Counts {
        for (hour, n) in &more.hours {
            *self.hours.entry(*hour).or_default() += n;
        }
        for (v, n) in &more.versions {
            *self.versions.entry(v.clone()).or_default() += n;
        }
        for (c, n) in &more.classes {
            *self.classes.entry(c.clone()).or_default() += n;
        }
        self
    }
}

/// Counts of `parked`, its last one the hour `through` (seconds), by hour.
fn by_hour(parked: &[u32], through: i64) -> impl Iterator<Item = (i64, u32)> + '_ {
    let n = parked.len() as i64;
    parked
        .iter()
        .enumerate()
        .map(move |(i, c)| (through - (n - 1 - i as i64) * HOUR, *c))
}

/// `spans` less `unsettled`, by name (a name no longer among the top is taken from `other`).
fn less(spans: &Spans, unsettled: &[Spanned]) -> (BTreeMap<String, i64>, i64) {
    let mut named: BTreeMap<String, i64> = spans
        .top
        .iter()
        .map(|s| (s.name.clone(), s.count))
        .collect();
    let mut other = spans.other;
    for u in unsettled {
        match named.get_mut(&u.name) {
            Some(n) => *n = (*n - u.count).max(0),
            None => other = (other - u.count).max(0),
        }
    }
    named.retain(|_, n| *n > 0);
    (named, other)
}

/// The next history of a group from its `previous` one and its `records` (all of them, of every
/// phase) at `now`.
///
/// A record is counted for good once it is [`SETTLE`] old: `settled` moves past it, and no
/// later fold counts it again, whether the record is still there or retention deleted it. A
/// newer record is counted as `unsettled`, taken back out and counted again at each fold, so
/// the counts show it at once. A restart or a new leader folds on from the stored history: it
/// counts nothing twice and keeps the hours of deleted records.
pub fn fold<'a>(
    previous: Option<&GroupHistory>,
    records: impl IntoIterator<Item = &'a dyn Facts>,
    now: Timestamp,
) -> GroupHistory {
    let empty = GroupHistory::default();
    let previous = previous.unwrap_or(&empty);
    let since = previous.settled.as_ref().map(|t| t.0.as_second());
    let cutoff = now.as_second() - SETTLE;
    let mut settled = Counts::settled(previous);
    let mut unsettled = Counts::default();
    let mut newest_settled: Option<i64> = None;
    let mut first: Option<Timestamp> = None;
    let mut last: Option<Timestamp> = None;
    let mut trend = Trend::default();
    for r in records {
        let at = seen(r);
        first = Some(first.map_or(at, |f| f.min(at)));
        last = Some(last.map_or(at, |l| l.max(at)));
        match now.as_second() - at.as_second() {
            ago if ago < HOUR => trend.last_hour += 1,
            ago if ago < 2 * HOUR => trend.hour_before += 1,
            _ => {}
        }
        let second = at.as_second();
        if since.is_some_and(|since| second < since) {
            continue; // counted for good before
        }
        if second < cutoff {
            settled.add(r, at);
            newest_settled = Some(newest_settled.map_or(second, |n| n.max(second)));
        } else {
            unsettled.add(r, at);
        }
    }
    let settled_through = [since, newest_settled.map(|n| n + 1)]
        .into_iter()
        .flatten()
        .max();
    let total = settled.plus(&unsettled);
    let mut hours = total.hours;
    let oldest = hour_of(now) - (HOURS as i64 - 1) * HOUR;
    hours.retain(|hour, n| *hour >= oldest && *n > 0);
    let (through, parked) = dense(&hours);
    let pending = match (through, unsettled.hours.first_key_value()) {
        (Some(through), Some((&from, _))) if from <= through => (0..=(through - from) / HOUR)
            .map(|i| {
                unsettled
                    .hours
                    .get(&(from + i * HOUR))
                    .copied()
                    .unwrap_or(0)
            })
            .collect(),
        _ => Vec::new(),
    };
    let prev_first = previous.first_seen.as_ref().map(|t| t.0);
    let prev_last = previous.last_seen.as_ref().map(|t| t.0);
    let time = |s: i64| Timestamp::from_second(s).ok().map(Time);
    GroupHistory {
        through: through.and_then(time),
        parked,
        first_seen: [prev_first, first].into_iter().flatten().min().map(Time),
        last_seen: [prev_last, last].into_iter().flatten().max().map(Time),
        service_versions: spans(total.versions, total.other_versions),
        error_classes: spans(total.classes, total.other_classes),
        trend,
        settled: settled_through.and_then(time),
        unsettled: Unsettled {
            parked: pending,
            service_versions: named(unsettled.versions),
            error_classes: named(unsettled.classes),
        },
    }
}

/// The newest hour and the counts from the oldest to it, at most [`HOURS`] long (the window
/// the caller kept).
fn dense(hours: &BTreeMap<i64, u32>) -> (Option<i64>, Vec<u32>) {
    let (Some((&first, _)), Some((&last, _))) = (hours.first_key_value(), hours.last_key_value())
    else {
        return (None, Vec::new());
    };
    let parked = (0..=(last - first) / HOUR)
        .map(|i| hours.get(&(first + i * HOUR)).copied().unwrap_or(0))
        .rev()
        .take(HOURS)
        .collect::<Vec<u32>>()
        .into_iter()
        .rev()
        .collect();
    (Some(last), parked)
}

/// Counts by name, by name.
fn named(counts: BTreeMap<String, i64>) -> Vec<Spanned> {
    counts
        .into_iter()
        .map(|(name, count)| Spanned { name, count })
        .collect()
}

/// The [`SPANNED`] most frequent of `counted`, the rest added to `other`.
fn spans(counted: BTreeMap<String, i64>, other: i64) -> Spans {
    let mut all = named(counted);
    all.sort_by(|a, b| b.count.cmp(&a.count).then(a.name.cmp(&b.name)));
    let rest: i64 = all.iter().skip(SPANNED).map(|s| s.count).sum();
    all.truncate(SPANNED);
    Spans {
        top: all,
        other: other + rest,
    }
}

/// Counts as a line of Unicode blocks (`▁▂▃▄▅▆▇█`), the largest a full block; an hour
/// without parkings is the lowest block, any other at least the second.
pub fn sparkline(counts: &[u32]) -> String {
    sparkline_against(counts, counts.iter().copied().max().unwrap_or(0))
}

/// [`sparkline`] scaled to `max` (the busiest hour of a longer span, so that lines of several
/// days compare).
pub fn sparkline_against(counts: &[u32], max: u32) -> String {
    const BLOCKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let max = max.max(1) as u64;
    counts
        .iter()
        .map(|&n| match n {
            0 => BLOCKS[0],
            n => BLOCKS[((n as u64 * 7).div_ceil(max)).clamp(1, 7) as usize],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::DeadLetter;
    use crate::testing::{RecordBuilder, at};

    /// Noon of a day, on an hour boundary.
    const NOW: i64 = 1_700_000_000 / HOUR * HOUR + 1800;

    fn parked(id: &str, ago: i64) -> DeadLetter {
        RecordBuilder::job(id)
            .reason("timeout")
            .service_version("relayer@1.4.2")
            .error_class("TimeoutError")
            .created(at(NOW - ago))
            .build()
    }

    fn facts(records: &[DeadLetter]) -> impl Iterator<Item = &dyn Facts> {
        records.iter().map(|r| r as &dyn Facts)
    }

    #[test]
    fn parkings_are_counted_per_hour_ending_at_the_newest() {
        let records = vec![
            parked("a", 10),
            parked("b", 20),
            parked("c", 1800 + 10), // the hour before
            parked("d", 3 * HOUR),
        ];
        let h = fold(None, facts(&records), at(NOW));
        assert_eq!(h.parked, [1, 0, 1, 2]);
        assert_eq!(h.unsettled.parked, [1], "a, parked 10 s ago");
        assert_eq!(h.settled, Some(Time(at(NOW - 19))), "past b, 20 s ago");
        assert_eq!(h.through, Some(Time(at(NOW - 1800))));
        assert_eq!(h.first_seen, Some(Time(at(NOW - 3 * HOUR))));
        assert_eq!(h.last_seen, Some(Time(at(NOW - 10))));
        assert_eq!(
            h.trend,
            Trend {
                last_hour: 3,
                hour_before: 0
            }
        );
        assert_eq!(h.hourly(at(NOW), 6), [0, 0, 1, 0, 1, 2]);
        assert_eq!(
            h.hourly(at(NOW + 2 * HOUR), 3),
            [2, 0, 0],
            "later hours without parkings read as zero"
        );
        assert_eq!(
            h.service_versions.top,
            [Spanned {
                name: "relayer@1.4.2".into(),
                count: 4
            }]
        );
        assert_eq!(h.error_classes.top[0].name, "TimeoutError");
    }

    #[test]
    fn folding_the_same_records_again_counts_nothing_twice() {
        let records: Vec<DeadLetter> = (0..50).map(|i| parked(&format!("j{i}"), i * 600)).collect();
        let once = fold(None, facts(&records), at(NOW));
        let twice = fold(Some(&once), facts(&records), at(NOW));
        assert_eq!(twice, once, "a restart or a new leader re-deriving it");
        // A new leader whose record index holds only some records yet lowers nothing.
        let partial = fold(Some(&once), facts(&records[..10]), at(NOW));
        assert_eq!(partial.parked, once.parked);
        assert_eq!(partial.service_versions, once.service_versions);
        assert_eq!(partial.first_seen, once.first_seen);
        assert_eq!(
            once.parked.iter().sum::<u32>(),
            50,
            "agrees with the records"
        );
    }

    #[test]
    fn hours_outlive_their_deleted_records_and_seven_days_are_kept() {
        let old = vec![parked("old", 6 * 24 * HOUR), parked("older", 8 * 24 * HOUR)];
        let h = fold(None, facts(&old), at(NOW));
        assert_eq!(h.parked, [1], "8 days ago is beyond the window");
        assert_eq!(h.first_seen, Some(Time(at(NOW - 8 * 24 * HOUR))));
        let new = vec![parked("new", 5)];
        let h = fold(Some(&h), facts(&new), at(NOW));
        assert_eq!(h.parked.len(), 6 * 24 + 1);
        assert_eq!(
            h.parked.iter().sum::<u32>(),
            2,
            "the deleted record still counts"
        );
        assert_eq!(
            h.first_seen,
            Some(Time(at(NOW - 8 * 24 * HOUR))),
            "first seen stays"
        );
        assert_eq!(
            h.service_versions.top[0].count, 3,
            "the 2 counted for good, deleted since, and the new one"
        );
        // A day later the old hour has fallen out; never more than 168 hours.
        let later = fold(Some(&h), facts(&new), at(NOW + 24 * HOUR));
        assert_eq!(later.parked, [1]);
        let storm: Vec<DeadLetter> = (0..400)
            .map(|i| parked(&format!("s{i}"), i * 1800))
            .collect();
        assert_eq!(fold(None, facts(&storm), at(NOW)).parked.len(), HOURS);
    }

    #[test]
    fn versions_and_classes_keep_the_top_ten_and_count_the_rest() {
        let records: Vec<DeadLetter> = (0..15)
            .flat_map(|v| {
                (0..=v).map(move |i| {
                    RecordBuilder::job(&format!("v{v}-{i}"))
                        .service_version(&format!("r@{v:02}"))
                        .created(at(NOW - 60))
                        .build()
                })
            })
            .collect();
        let h = fold(None, facts(&records), at(NOW));
        let top = &h.service_versions.top;
        assert_eq!(top.len(), SPANNED);
        assert_eq!((top[0].name.as_str(), top[0].count), ("r@14", 15));
        assert_eq!(h.service_versions.other, 1 + 2 + 3 + 4 + 5);
        assert_eq!(h.error_classes, Spans::default(), "no class, none counted");
        assert_eq!(fold(Some(&h), facts(&records), at(NOW)), h, "idempotent");
    }

    #[test]
    fn a_record_counts_at_once_and_for_good_once_settled() {
        let fresh = vec![parked("a", 1), parked("b", 2)];
        let h1 = fold(None, facts(&fresh), at(NOW));
        assert_eq!(
            (h1.parked.clone(), h1.unsettled.parked.clone()),
            (vec![2], vec![2])
        );
        assert_eq!(h1.settled, None);
        assert_eq!(h1.unsettled.service_versions[0].count, 2);
        assert_eq!(fold(Some(&h1), facts(&fresh), at(NOW)), h1, "nothing twice");
        // Once SETTLE old they are counted for good ...
        let h2 = fold(Some(&h1), facts(&fresh), at(NOW + SETTLE + 5));
        assert_eq!(h2.parked, [2]);
        assert!(h2.unsettled.is_empty(), "{:?}", h2.unsettled);
        assert_eq!(
            h2.settled,
            Some(Time(at(NOW))),
            "past the newest, b at NOW - 1"
        );
        assert_eq!(h2.service_versions.top[0].count, 2);
        // ... so that one deleted since still counts beside a new one of the same hour (a
        // new leader folding on from the stored history does the same).
        let later = vec![parked("b", 2), parked("c", -60)];
        let h3 = fold(Some(&h2), facts(&later), at(NOW + 61));
        assert_eq!(h3.parked, [3]);
        assert_eq!(h3.service_versions.top[0].count, 3);
        assert_eq!(h3.unsettled.parked, [1]);
        assert_eq!(fold(Some(&h3), facts(&later), at(NOW + 61)), h3);
    }

    #[test]
    fn a_sparkline_scales_to_the_largest_hour() {
        assert_eq!(sparkline(&[0, 1, 2, 4, 8]), "▁▂▃▅█");
        assert_eq!(sparkline(&[0, 0]), "▁▁");
        assert_eq!(sparkline(&[3]), "█");
        assert_eq!(sparkline_against(&[1, 8, 16], 16), "▂▅█");
        assert_eq!(
            Trend {
                last_hour: 52,
                hour_before: 12
            }
            .shown(),
            "↑ 12→52"
        );
    }
}
