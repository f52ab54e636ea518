//! A parking storm's `Parked` Events as one Kubernetes Event series per failure group and
//! reason, as data.
//!
//! A trickle keeps one `Parked` Event per record: people and Event-based alerting read them by
//! name. In a storm each would be one more apiserver write and 1,069 bytes of etcd for an hour
//! per record, and nobody reads a thousand of them. So per (namespace, queue, failure group,
//! reason), once more than [`STORM_ABOVE`] arrive within [`STORM_WINDOW`], the rest become ONE
//! Event about the group (events.k8s.io/v1 with `series`, as client-go's events recorder folds
//! isomorphic Events): created after the storm's first second with the records it brought,
//! its `series.count` and `series.lastObservedTime` patched at most every [`WRITE_EVERY`], and finished (a last patch)
//! once the group's rate stayed at or below [`CALM_AT_MOST`] a second for [`CALM_FOR`]; after
//! that a trickle gets its own Events again.
//!
//! Every record is counted by exactly one Event: its own, or one series' `count`. A storm that
//! turns out to be one record (nothing followed within a window) gets its own Event after all.
//!
//! [`Storms`] holds the state and answers with what to do; the caller does the I/O and tells
//! it how each write went ([`Storms::written`]). Time is the caller's clock, passed in.

use std::collections::{BTreeMap, VecDeque};

use jiff::{SignedDuration, Timestamp};

use crate::events::{self, EventPlan};

/// More than this many Events of one key within [`STORM_WINDOW`] is a storm. Below the
/// operator's own pace: while its sources park a backlog it marks (and so announces) at most
/// ten records a second (`parking_first::MARK_EVERY`), and a threshold at ten would never see
/// a source's storm until the broker was drained. Above a trickle: a worker giving up a few
/// jobs at once still names each.
pub const STORM_ABOVE: usize = 5;

/// The window [`STORM_ABOVE`] counts over, and how long a storm of one record is waited on.
pub const STORM_WINDOW: SignedDuration = SignedDuration::from_secs(1);

/// A series' count is written at most this often: a storm costs a write every few seconds,
/// not one a record, and `kubectl get events` still sees it climb.
pub const WRITE_EVERY: SignedDuration = SignedDuration::from_secs(5);

/// A series is finished once its key's rate stayed at or below [`CALM_AT_MOST`] this long.
pub const CALM_FOR: SignedDuration = SignedDuration::from_secs(5);

/// Events a [`STORM_WINDOW`] at or below which a storm is calm: below the threshold that began
/// it, so that a storm whose marks hover about [`STORM_ABOVE`] a second (a busy machine's
/// paced marks) stays one series instead of ending and beginning again, each time with its
/// first records' own Events.
pub const CALM_AT_MOST: usize = 2;

/// Record names a series' note gives: some to look at, short enough for one line of
/// `kubectl events` (`kubectl get dl -l dlq.dev/group=...` lists them all).
pub const NAMES: usize = 10;

/// What one series is about: a failure group's Events of one reason in a queue.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    pub namespace: String,
    pub queue: String,
    /// The `dlq.dev/group` fingerprint; None for a record without one.
    pub group: Option<String>,
    pub reason: &'static str,
}

/// How many occurrences an Event stands for, as its `series` says (`count` at least 2: the
/// apiserver refuses a series of one, which is a plain Event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrences {
    pub count: u32,
    pub last_observed: Timestamp,
}

/// What to do with one arriving Event.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival<T> {
    /// Publish it as it is, now.
    Own(T),
    /// Counted in its key's series; nothing to write now.
    Folded,
}

/// A write a tick asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum SeriesWrite<T> {
    /// A storm of one after all: the record's own Event, as it arrived.
    Own(T),
    /// The series' Event: `plan` about what `about` (the storm's first arrival) belongs to,
    /// standing for `occurrences` (None: one record, a plain Event).
    Create {
        key: SeriesKey,
        about: T,
        plan: EventPlan,
        occurrences: Option<Occurrences>,
    },
    /// The count of the series' Event `event`.
    Patch {
        key: SeriesKey,
        event: String,
        occurrences: Occurrences,
    },
}

/// How a write went, told back with [`Storms::written`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// The Event exists under this name.
    Created(String),
    Patched,
    /// Not written; asked again when next due.
    Failed,
    /// The Event is gone (expired, deleted): what it counted goes with it, the rest start a
    /// new one.
    Gone,
}

/// Every key's state: a window of recent arrivals, or a storm's series.
#[derive(Debug)]
pub struct Storms<T> {
    keys: BTreeMap<SeriesKey, State<T>>,
}

impl<T> Default for Storms<T> {
    fn default() -> Self {
        Storms {
            keys: BTreeMap::new(),
        }
    }
}

#[derive(Debug)]
enum State<T> {
    /// When the last arrivals (at most [`STORM_ABOVE`]) came.
    Calm(VecDeque<Timestamp>),
    Storm(Series<T>),
}

#[derive(Debug)]
struct Series<T> {
    /// The first arrival folded: what the series is about, and its own Event if it stays alone.
    first: T,
    began: Timestamp,
    /// Records the current Event stands for.
    count: u32,
    /// The count the apiserver holds (0: no Event yet).
    written: u32,
    /// The Event's name once created.
    event: Option<String>,
    /// The last write asked for (failed ones too: they wait [`WRITE_EVERY`] as well).
    asked_at: Option<Timestamp>,
    last_observed: Timestamp,
    /// The first [`NAMES`] records the current Event stands for.
    names: Vec<String>,
    /// The rate check: arrivals since `measured_from`, and when the rate was last above the
    /// threshold.
    measured_from: Timestamp,
    since: u32,
    stormy_at: Timestamp,
}

impl<T: Clone> Storms<T> {
    /// An Event of `key` about record `name` arrived at `now`: its own, or folded into a
    /// series (begun by this one when it is the first over the threshold).
    pub fn arrive(&mut self, key: SeriesKey, name: &str, item: T, now: Timestamp) -> Arrival<T> {
        let state = self
            .keys
            .entry(key)
            .or_insert_with(|| State::Calm(VecDeque::new()));
        match state {
            State::Calm(recent) => {
                while recent
                    .front()
                    .is_some_and(|t| now.duration_since(*t) >= STORM_WINDOW)
                {
                    recent.pop_front();
                }
                if recent.len() < STORM_ABOVE {
                    recent.push_back(now);
                    return Arrival::Own(item);
                }
                *state = State::Storm(Series {
                    first: item,
                    began: now,
                    count: 1,
                    written: 0,
                    event: None,
                    asked_at: None,
                    last_observed: now,
                    names: vec![name.to_string()],
                    measured_from: now,
                    since: 1,
                    stormy_at: now,
                });
                Arrival::Folded
            }
            State::Storm(s) => {
                s.count = s.count.saturating_add(1);
                s.since = s.since.saturating_add(1);
                s.last_observed = now;
                if s.names.len() < NAMES {
                    s.names.push(name.to_string());
                }
                Arrival::Folded
            }
        }
    }

    /// What is due at `now`: first writes of new series, counts not written for
    /// [`WRITE_EVERY`], last writes of finished series (which are then forgotten). Quiet
    /// windows are dropped.
    pub fn tick(&mut self, now: Timestamp) -> Vec<SeriesWrite<T>> {
        let mut writes = Vec::new();
        let mut done = Vec::new();
        for (key, state) in &mut self.keys {
            let s = match state {
                State::Calm(recent) => {
                    if recent
                        .back()
                        .is_none_or(|t| now.duration_since(*t) >= STORM_WINDOW)
                    {
                        done.push(key.clone());
                    }
                    continue;
                }
                State::Storm(s) => s,
            };
            s.measure(now);
            let finished = now.duration_since(s.stormy_at) >= CALM_FOR;
            if s.asked_at.is_none() {
                // A storm's first second: the series' Event counts and names what it brought.
                if now.duration_since(s.began) < STORM_WINDOW {
                    continue;
                }
                // One record over the threshold and none after it: not a storm.
                if s.count == 1 {
                    writes.push(SeriesWrite::Own(s.first.clone()));
                    done.push(key.clone());
                    continue;
                }
            }
            let due = finished
                || s.asked_at
                    .is_none_or(|at| now.duration_since(at) >= WRITE_EVERY);
            if due && let Some(write) = s.write(key) {
                s.asked_at = Some(now);
                writes.push(write);
            }
            if finished {
                done.push(key.clone());
            }
        }
        for key in done {
            self.keys.remove(&key);
        }
        writes
    }

    /// How a write of `key` asked for by [`Storms::tick`] went; `count` is the count it wrote.
    /// A series finished meanwhile is not there any more and nothing changes.
    pub fn written(&mut self, key: &SeriesKey, count: u32, outcome: Written) {
        let Some(State::Storm(s)) = self.keys.get_mut(key) else {
            return;
        };
        match outcome {
            Written::Created(name) => {
                s.event = Some(name);
                s.written = count;
            }
            Written::Patched => s.written = count,
            Written::Failed => {}
            Written::Gone => {
                s.count = s.count.saturating_sub(s.written);
                s.written = 0;
                s.event = None;
                s.names.clear();
            }
        }
    }

    /// Whether `key` is in a storm now.
    pub fn storming(&self, key: &SeriesKey) -> bool {
        matches!(self.keys.get(key), Some(State::Storm(_)))
    }
}

impl<T: Clone> Series<T> {
    /// Whether the rate since the last measure was above calm, once a window passed.
    fn measure(&mut self, now: Timestamp) {
        let span = now.duration_since(self.measured_from);
        if span < STORM_WINDOW {
            return;
        }
        let per_window = i128::from(self.since) * STORM_WINDOW.as_millis();
        if per_window > CALM_AT_MOST as i128 * span.as_millis() {
            self.stormy_at = now;
        }
        self.measured_from = now;
        self.since = 0;
    }

    /// The write that brings the apiserver up to `count`, when it is behind.
    fn write(&self, key: &SeriesKey) -> Option<SeriesWrite<T>> {
        if self.count <= self.written {
            return None;
        }
        let occurrences = Occurrences {
            count: self.count,
            last_observed: self.last_observed,
        };
        Some(match &self.event {
            Some(event) => SeriesWrite::Patch {
                key: key.clone(),
                event: event.clone(),
                occurrences,
            },
            None => SeriesWrite::Create {
                key: key.clone(),
                about: self.first.clone(),
                plan: series_plan(key, self.count, &self.names),
                occurrences: (self.count >= 2).then_some(occurrences),
            },
        })
    }
}

/// The series' Event: the count when it began and the records it names first; its
/// `series.count` says the rest (the note cannot change once written).
pub fn series_plan(key: &SeriesKey, count: u32, names: &[String]) -> EventPlan {
    let group = key
        .group
        .as_deref()
        .map(|g| format!(", failure group {g}"))
        .unwrap_or_default();
    let head = format!(
        "{count} records of queue {}{group} {} in a storm (more than {STORM_ABOVE} a second): \
         series.count counts every one from here",
        key.queue,
        events::verb(key.reason),
    );
    let note = if names.is_empty() {
        head
    } else {
        events::listed(format!("{head}; first "), names, count as usize)
    };
    EventPlan::warning(key.reason, events::action::PARK, note).once()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(group: &str) -> SeriesKey {
        SeriesKey {
            namespace: "payments".into(),
            queue: "relayer".into(),
            group: Some(group.into()),
            reason: events::reason::PARKED,
        }
    }

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(1_800_000_000_000 + ms).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// Drives `storms` like the operator: each tick's writes succeed, created as `ev-N`.
    fn tick_ok(storms: &mut Storms<String>, now: Timestamp) -> Vec<SeriesWrite<String>> {
        let writes = storms.tick(now);
        for (i, w) in writes.iter().enumerate() {
            match w {
                SeriesWrite::Create {
                    key, occurrences, ..
                } => {
                    let n = occurrences.map_or(1, |o| o.count);
                    storms.written(key, n, Written::Created(format!("ev-{i}")));
                }
                SeriesWrite::Patch {
                    key, occurrences, ..
                } => storms.written(key, occurrences.count, Written::Patched),
                SeriesWrite::Own(_) => {}
            }
        }
        writes
    }

    /// (own Events, writes of series, the last count written per series in order)
    fn run(arrivals: &[(i64, &str)], until: i64) -> (usize, usize, Vec<u32>) {
        let mut storms = Storms::default();
        let (mut own, mut series_writes, mut counts) = (0, 0, Vec::new());
        let mut next_tick = 1_000;
        let mut i = 0;
        let mut current: BTreeMap<SeriesKey, usize> = BTreeMap::new();
        while next_tick <= until {
            while i < arrivals.len() && arrivals[i].0 < next_tick {
                let (t, g) = arrivals[i];
                let name = format!("r{i}");
                if let Arrival::Own(_) = storms.arrive(key(g), &name, name.clone(), at(t)) {
                    own += 1;
                }
                i += 1;
            }
            for w in tick_ok(&mut storms, at(next_tick)) {
                match w {
                    SeriesWrite::Own(_) => own += 1,
                    SeriesWrite::Create {
                        key, occurrences, ..
                    } => {
                        series_writes += 1;
                        counts.push(occurrences.map_or(1, |o| o.count));
                        current.insert(key, counts.len() - 1);
                    }
                    SeriesWrite::Patch {
                        key, occurrences, ..
                    } => {
                        series_writes += 1;
                        if let Some(&series) = current.get(&key) {
                            counts[series] = occurrences.count;
                        }
                    }
                }
            }
            next_tick += 1_000;
        }
        (own, series_writes, counts)
    }

    #[test]
    fn a_trickle_keeps_one_event_per_record() {
        // Five a second for a minute: at the threshold, never over it.
        let arrivals: Vec<(i64, &str)> = (0..300).map(|i| (i * 200, "g")).collect();
        let (own, writes, counts) = run(&arrivals, 70_000);
        assert_eq!((own, writes), (300, 0), "{counts:?}");
    }

    #[test]
    fn a_storm_of_a_thousand_in_a_second_is_a_handful_of_writes() {
        let arrivals: Vec<(i64, &str)> = (0..1_000).map(|i| (i, "g")).collect();
        let (own, writes, counts) = run(&arrivals, 20_000);
        assert_eq!(own, STORM_ABOVE);
        assert_eq!(counts, vec![1_000 - STORM_ABOVE as u32]);
        assert_eq!(writes, 1, "created once with the whole count");
        assert_eq!(own + counts[0] as usize, 1_000, "every record counted once");
    }

    #[test]
    fn a_long_storm_is_patched_every_few_seconds_then_finished_and_a_trickle_is_own_again() {
        // 100 a second for 30 s, then quiet, then one a second.
        let mut arrivals: Vec<(i64, &str)> = (0..3_000).map(|i| (i * 10, "g")).collect();
        arrivals.extend((0..10).map(|i| (45_000 + i * 1_000, "g")));
        let (own, writes, counts) = run(&arrivals, 70_000);
        assert_eq!(counts.len(), 1, "one series");
        assert_eq!(counts[0], 3_000 - STORM_ABOVE as u32);
        assert_eq!(
            own,
            STORM_ABOVE + 10,
            "the trickle after the storm is own again"
        );
        // A create, a patch every 5 s while it grows, the last one when it ended.
        assert!((6..=9).contains(&writes), "{writes} writes");
    }

    #[test]
    fn a_storm_hovering_about_the_threshold_stays_one_series() {
        // A burst, then four a second for 20 s (marks paced on a busy machine), then quiet.
        let mut arrivals: Vec<(i64, &str)> = (0..50).map(|i| (i * 10, "g")).collect();
        arrivals.extend((0..80).map(|i| (1_000 + i * 250, "g")));
        let (own, _, counts) = run(&arrivals, 40_000);
        assert_eq!(own, STORM_ABOVE);
        assert_eq!(counts, vec![130 - STORM_ABOVE as u32]);
    }

    #[test]
    fn groups_and_reasons_are_series_of_their_own() {
        let arrivals: Vec<(i64, &str)> = (0..200)
            .map(|i| (i, if i % 2 == 0 { "a" } else { "b" }))
            .collect();
        let (own, _, counts) = run(&arrivals, 20_000);
        assert_eq!(own, 2 * STORM_ABOVE);
        assert_eq!(counts.iter().sum::<u32>() as usize + own, 200);
        assert_eq!(counts.len(), 2);
        let mut storms: Storms<()> = Storms::default();
        let mut other = key("a");
        other.reason = events::reason::REQUEUE_FAILED;
        for i in 0..=STORM_ABOVE {
            storms.arrive(key("a"), "r", (), at(i as i64));
        }
        assert!(storms.storming(&key("a")));
        assert_eq!(storms.arrive(other, "r", (), at(10)), Arrival::Own(()));
    }

    #[test]
    fn one_over_the_threshold_alone_gets_its_own_event_after_a_window() {
        let mut storms: Storms<String> = Storms::default();
        for i in 0..=STORM_ABOVE {
            let name = format!("r{i}");
            storms.arrive(key("g"), &name, name.clone(), at(i as i64 * 10));
        }
        assert!(tick_ok(&mut storms, at(500)).is_empty(), "more may come");
        let writes = tick_ok(&mut storms, at(1_100));
        assert_eq!(writes, vec![SeriesWrite::Own(format!("r{STORM_ABOVE}"))]);
        assert!(!storms.storming(&key("g")));
    }

    #[test]
    fn a_failed_create_is_asked_again_when_due_and_a_gone_event_starts_anew() {
        let mut storms: Storms<String> = Storms::default();
        let arrive = |storms: &mut Storms<String>, n: i64, from: i64| {
            for i in 0..n {
                let name = format!("r{}", from + i);
                storms.arrive(key("g"), &name, name.clone(), at(from + i));
            }
        };
        let created = |writes: &[SeriesWrite<String>]| match writes {
            [SeriesWrite::Create { occurrences, .. }] => occurrences.map(|o| o.count),
            other => panic!("{other:?}"),
        };
        arrive(&mut storms, 20, 0);
        assert_eq!(created(&storms.tick(at(1_010))), Some(15));
        storms.written(&key("g"), 15, Written::Failed);
        arrive(&mut storms, 100, 1_000);
        assert!(storms.tick(at(2_010)).is_empty(), "not before WRITE_EVERY");
        assert_eq!(created(&storms.tick(at(6_010))), Some(115));
        storms.written(&key("g"), 115, Written::Created("ev".into()));
        arrive(&mut storms, 100, 6_000);
        assert!(storms.tick(at(7_010)).is_empty());
        let writes = storms.tick(at(11_010));
        let [
            SeriesWrite::Patch {
                event, occurrences, ..
            },
        ] = &writes[..]
        else {
            panic!("{writes:?}")
        };
        assert_eq!((event.as_str(), occurrences.count), ("ev", 215));
        storms.written(&key("g"), 215, Written::Gone);
        // What the gone Event counted went with it; the rest make a new one as it finishes.
        let writes = storms.tick(at(16_010));
        let [
            SeriesWrite::Create {
                occurrences, plan, ..
            },
        ] = &writes[..]
        else {
            panic!("{writes:?}")
        };
        assert_eq!(occurrences.map(|o| o.count), Some(100));
        assert!(plan.note.starts_with("100 records"), "{}", plan.note);
        assert!(!storms.storming(&key("g")), "calm for 5 s: finished");
    }

    #[test]
    fn the_note_names_the_count_group_and_first_records_within_the_limit() {
        let names: Vec<String> = (0..NAMES)
            .map(|i| format!("pi-{i:04}-settle-5d41402a-1"))
            .collect();
        let plan = series_plan(&key("3f9a1c07d2"), 995, &names);
        assert!(
            plan.note.starts_with(
                "995 records of queue relayer, failure group 3f9a1c07d2 parked in a storm"
            ),
            "{}",
            plan.note
        );
        assert!(plan.note.contains("pi-0000-settle-5d41402a-1, pi-0001"));
        assert!(plan.note.ends_with(" more"), "{}", plan.note);
        assert!(plan.note.len() <= events::MAX_NOTE);
        assert_eq!(plan.type_, events::EventType::Warning);
        assert!(plan.once);
    }
}
