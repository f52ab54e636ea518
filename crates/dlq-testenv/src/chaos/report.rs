//! The run's figures and the invariant checks, as a table and as `report.json`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use dlq_core::api::{Action, DeadLetter, Phase};
use serde::Serialize;

use super::history::{Arrival, History};
use super::storm::{self, StormOutcome, StormSize};

/// What one run measured. Zero is the goal for every count but `duplicate_enqueues` (allowed
/// by "requeue first, then mark": at most the jobs in flight at a fault; what a consumer that
/// drops repeated idempotency keys still sees of them is `duplicates_after_dedupe`, goal 0).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub seed: u64,
    /// Faults injected, per kind, and their total.
    pub faults: BTreeMap<String, u64>,
    pub faults_total: u64,
    /// Dead messages the producers handed to the brokers (acknowledged).
    pub messages: u64,
    pub records: u64,
    /// Dead messages without a record.
    pub lost: u64,
    /// Records beyond one per job id + cycle.
    pub duplicate_records: u64,
    /// Second and later arrivals of a job on its target, by the kind of the last fault before.
    pub duplicate_enqueues: BTreeMap<String, u64>,
    pub duplicate_enqueues_total: u64,
    /// Those a consumer that drops a repeated idempotency key still receives (a second arrival
    /// without a key, or with another key), by the kind of the last fault before.
    pub duplicates_after_dedupe: BTreeMap<String, u64>,
    pub duplicates_after_dedupe_total: u64,
    /// Jobs that arrived on a target although their record ended Dropped or undecided.
    pub stray_enqueues: u64,
    /// Decided records still Parked at the end.
    pub unresolved: u64,
    /// Records nobody decided (the workload leaves a few; not an error).
    pub undecided: u64,
    /// Records whose outcome is not their decision (redrive → Dropped, drop → Redriven).
    pub wrong_outcome: u64,
    /// Redriven records whose decision changed to drop after the broker had confirmed the
    /// redrive (`Requeued` says `RequeuedBeforeDrop`): what happened, said; not an error.
    pub late_drops: u64,
    /// Redriven records whose job never arrived on the target.
    pub redriven_not_on_target: u64,
    /// Records resolved more than once (a second resolvedAt seen by the watch).
    pub duplicate_resolutions: u64,
    /// Phase changes that went backwards in the watch history.
    pub status_regressions: u64,
    /// `panicked at` lines in every operator log.
    pub panics: u64,
    pub redriven: u64,
    pub dropped: u64,
    /// Messages still in each broker queue at the end (dead lists, dead-letter queues,
    /// targets), to tell a message the operator never saw from one it lost.
    pub broker_leftovers: BTreeMap<String, u64>,
    /// The storm's standing redrive as its status ended (None: no storm, or never created).
    pub storm: Option<StormOutcome>,
    /// Storm messages (0: no storm).
    pub storm_messages: u64,
    /// Storm jobs that arrived and never had a record (passed straight through).
    pub storm_jobs_without_record: u64,
    /// Storm jobs that had a record (parked while the queue was Full, or after a fault).
    pub storm_jobs_with_record: u64,
    /// Storm jobs that arrived under two different idempotency keys (also counted in
    /// `duplicates_after_dedupe`): one dead message must keep one key however it goes back.
    pub storm_jobs_two_keys: u64,
    /// Storm jobs that never arrived on the target.
    pub storm_lost: u64,
    /// Storm messages still in its dead list, processing list or inflight hash at the end.
    pub storm_left_in_broker: u64,
    /// Storm records not Redriven at the end.
    pub storm_left_parked: u64,
    /// 1 when the standing redrive did not end Completed.
    pub storm_replay_incomplete: u64,
    /// `passedThrough + redriven` minus the storm: what the replay's counts count twice (a
    /// message passed again after a fault); not below 0 since a pass is in the status before
    /// its acknowledgement (issue 57). Reported, not an invariant: the jobs themselves are
    /// checked one by one.
    pub storm_count_gap: i64,
    /// Up to five job ids per failed invariant, to start an investigation from.
    pub examples: BTreeMap<String, Vec<String>>,
    pub duration_secs: f64,
}

impl Report {
    /// Checks the final records, the watch history and the target arrivals.
    pub fn compute(
        produced: &[String],
        finals: &[DeadLetter],
        history: &History,
        enqueues: &HashMap<String, Enqueues>,
    ) -> Report {
        let mut r = Report {
            messages: produced.len() as u64,
            records: finals.len() as u64,
            ..Report::default()
        };
        let mut per_job: HashMap<&str, u64> = HashMap::new();
        for d in finals {
            *per_job.entry(d.spec.job.id.as_str()).or_default() += 1;
        }
        let lost: Vec<&str> = produced
            .iter()
            .map(String::as_str)
            .filter(|id| !per_job.contains_key(id))
            .collect();
        r.lost = lost.len() as u64;
        r.example("lost", lost);
        let doubled = per_job.iter().filter(|(_, n)| **n > 1).map(|(j, _)| *j);
        r.example("duplicate_records", doubled);
        // A job is redriven when any of its records (cycles) is.
        let redriven_jobs: std::collections::HashSet<&str> = finals
            .iter()
            .filter(|d| d.phase() == Phase::Redriven)
            .map(|d| d.spec.job.id.as_str())
            .collect();
        r.duplicate_records = per_job.values().map(|n| n.saturating_sub(1)).sum();
        let arrivals = history.arrivals();
        for d in finals {
            let arrived = arrivals.contains_key(&d.spec.job.id);
            match (d.phase(), d.spec.action) {
                (Phase::Parked, Some(_)) => {
                    r.unresolved += 1;
                    // No condition written: the operator never acted on the record at all (its
                    // phase reads Parked by the CRD's default either way).
                    let unmarked = d.status.as_ref().is_none_or(|s| s.conditions.is_empty());
                    let id = format!(
                        "{}{}",
                        d.spec.job.id,
                        if unmarked { "(untouched)" } else { "" }
                    );
                    r.example("unresolved", [id.as_str()]);
                }
                (Phase::Parked, None) => r.undecided += 1,
                (Phase::Redriven, a) => {
                    r.redriven += 1;
                    let late = requeued_before_drop(d);
                    r.late_drops += u64::from(late);
                    r.wrong_outcome += u64::from(a == Some(Action::Drop) && !late);
                    r.redriven_not_on_target += u64::from(!arrived);
                    if !arrived {
                        r.example("redriven_not_on_target", [d.spec.job.id.as_str()]);
                    }
                }
                (Phase::Dropped, a) => {
                    r.dropped += 1;
                    r.wrong_outcome += u64::from(a == Some(Action::Redrive));
                }
            }
            if arrived && !redriven_jobs.contains(d.spec.job.id.as_str()) {
                r.stray_enqueues += 1;
                r.example("stray_enqueues", [d.spec.job.id.as_str()]);
            }
        }
        // A job without any record may arrive only under its dead message's key (a `msg-` key:
        // a standing replay's pass-through); a record's redrive always has a record.
        let recorded: HashSet<&str> = per_job.keys().copied().collect();
        for (job, list) in &arrivals {
            if !recorded.contains(job.as_str()) && !list.iter().all(Arrival::keyed_by_message) {
                r.stray_enqueues += 1;
                r.example("stray_enqueues", [job.as_str()]);
            }
        }
        for (job, list) in &arrivals {
            r.count_duplicates(job, list, history, enqueues.get(job));
        }
        for h in history.records().values() {
            r.status_regressions += u64::from(h.regressions);
            r.duplicate_resolutions += (h.resolutions.len() as u64).saturating_sub(1);
        }
        for (_, kind) in history.faults() {
            *r.faults.entry(kind.to_string()).or_default() += 1;
            r.faults_total += 1;
        }
        r
    }

    /// Counts the second and later arrivals of `job`, and those of them a consumer that drops
    /// repeated idempotency keys would still take.
    fn count_duplicates(
        &mut self,
        job: &str,
        arrivals: &[Arrival],
        history: &History,
        enqueues: Option<&Enqueues>,
    ) {
        if arrivals.len() > 1 {
            self.example("duplicate_enqueues", [job]);
        }
        let mut keys = HashSet::new();
        for (i, a) in arrivals.iter().enumerate() {
            let repeated = a.key.as_ref().is_some_and(|k| !keys.insert(k.clone()));
            if i == 0 {
                continue;
            }
            let mut kind = history.blame_between(arrivals[i - 1].at, a.at);
            let process_fault = matches!(kind, "operator_sigkill" | "leader_pause");
            if !process_fault && enqueues.is_some_and(Enqueues::once) {
                // No replica that could have enqueued unlogged was killed or paused between,
                // and the operators' logs show one confirmed enqueue and no failed one.
                kind = BROKER_REDELIVERY;
            }
            let kind = kind.to_string();
            self.example(&format!("duplicate_enqueues after {kind}"), [job]);
            *self.duplicate_enqueues.entry(kind.clone()).or_default() += 1;
            self.duplicate_enqueues_total += 1;
            if !repeated {
                *self.duplicates_after_dedupe.entry(kind).or_default() += 1;
                self.duplicates_after_dedupe_total += 1;
                self.example("duplicates_after_dedupe", [job]);
            }
        }
    }

    /// The storm's invariants: every job on the target, nothing left in its dead list,
    /// processing list or inflight hash, no record of it left undecided, pass-through only for
    /// the storm's jobs, and its standing redrive Completed with each job counted once.
    pub fn check_storm(
        &mut self,
        size: StormSize,
        outcome: Option<StormOutcome>,
        ids: &[String],
        finals: &[DeadLetter],
        history: &History,
        leftovers: &BTreeMap<String, u64>,
    ) {
        self.storm_messages = size.messages as u64;
        let arrivals = history.arrivals();
        let mine: HashSet<&str> = ids.iter().map(String::as_str).collect();
        let recorded: HashSet<String> = history
            .records()
            .into_values()
            .map(|h| h.job)
            .chain(finals.iter().map(|d| d.spec.job.id.clone()))
            .collect();
        let lost: Vec<&str> = ids
            .iter()
            .map(String::as_str)
            .filter(|id| !arrivals.contains_key(*id))
            .collect();
        self.storm_lost = lost.len() as u64;
        self.example("storm_lost", lost);
        for id in ids {
            let Some(list) = arrivals.get(id) else {
                continue;
            };
            if recorded.contains(id) {
                self.storm_jobs_with_record += 1;
            } else {
                self.storm_jobs_without_record += 1;
            }
            let keys: HashSet<&str> = list.iter().filter_map(|a| a.key.as_deref()).collect();
            if keys.len() > 1 {
                self.storm_jobs_two_keys += 1;
                self.example("storm_jobs_two_keys", [id.as_str()]);
            }
        }
        // Only a standing redrive sends a job without a record, and only the storm has one.
        for job in arrivals.keys() {
            if !mine.contains(job.as_str()) && !recorded.contains(job) {
                self.stray_enqueues += 1;
                self.example("stray_enqueues", [job.as_str()]);
            }
        }
        self.storm_left_in_broker = ["", ":processing", ":inflight"]
            .iter()
            .map(|suffix| {
                let key = format!("{}{suffix}", storm::DEAD);
                // Unreadable counts as left: nothing says it is empty.
                leftovers.get(&key).copied().unwrap_or(u64::MAX)
            })
            .fold(0, u64::saturating_add);
        let parked = storm::left_parked(finals);
        self.storm_left_parked = parked.len() as u64;
        self.example("storm_left_parked", parked);
        self.storm_replay_incomplete = u64::from(!outcome.as_ref().is_some_and(storm::completed));
        self.storm_count_gap = outcome.as_ref().map_or(0, |o| {
            o.passed_through + o.redriven - i64::try_from(size.messages).unwrap_or(i64::MAX)
        });
        self.storm = outcome;
    }

    fn example<'a>(&mut self, what: &str, ids: impl IntoIterator<Item = &'a str>) {
        let list = self.examples.entry(what.to_string()).or_default();
        for id in ids {
            if list.len() < 5 {
                list.push(id.to_string());
            }
        }
        if list.is_empty() {
            self.examples.remove(what);
        }
    }

    /// True when every invariant held (effectively once included: no job on a target its
    /// record did not redrive, none a deduplicating consumer would take twice).
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicate_records == 0
            && self.unresolved == 0
            && self.wrong_outcome == 0
            && self.redriven_not_on_target == 0
            && self.duplicate_resolutions == 0
            && self.status_regressions == 0
            && self.panics == 0
            && self.stray_enqueues == 0
            && self.duplicates_after_dedupe_total == 0
            && self.storm_lost == 0
            && self.storm_left_in_broker == 0
            && self.storm_left_parked == 0
            && self.storm_replay_incomplete == 0
    }

    /// The table `make chaos` prints (and the README quotes).
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![
            ("seed".into(), self.seed.to_string()),
            ("faults".into(), self.faults_total.to_string()),
        ];
        for (k, n) in &self.faults {
            rows.push((format!("  {k}"), n.to_string()));
        }
        for (k, v) in [
            ("messages", self.messages),
            ("records", self.records),
            ("redriven", self.redriven),
            ("dropped", self.dropped),
            ("undecided (left parked)", self.undecided),
            ("lost", self.lost),
            ("duplicate_records", self.duplicate_records),
            ("unresolved", self.unresolved),
            ("wrong_outcome", self.wrong_outcome),
            ("late_drops (redriven before the drop)", self.late_drops),
            ("redriven_not_on_target", self.redriven_not_on_target),
            ("duplicate_resolutions", self.duplicate_resolutions),
            ("status_regressions", self.status_regressions),
            ("panics", self.panics),
            ("stray_enqueues", self.stray_enqueues),
            ("duplicate_enqueues", self.duplicate_enqueues_total),
        ] {
            rows.push((k.into(), v.to_string()));
        }
        for (k, n) in &self.duplicate_enqueues {
            rows.push((format!("  after {k}"), n.to_string()));
        }
        rows.push((
            "duplicates_after_dedupe".into(),
            self.duplicates_after_dedupe_total.to_string(),
        ));
        for (k, n) in &self.duplicates_after_dedupe {
            rows.push((format!("  after {k}"), n.to_string()));
        }
        if self.storm_messages > 0 {
            for (k, v) in [
                ("storm messages", self.storm_messages),
                (
                    "  jobs without a record (passed through)",
                    self.storm_jobs_without_record,
                ),
                ("  jobs with a record", self.storm_jobs_with_record),
                ("  jobs under two keys", self.storm_jobs_two_keys),
                ("storm_lost", self.storm_lost),
                ("storm_left_in_broker", self.storm_left_in_broker),
                ("storm_left_parked", self.storm_left_parked),
                ("storm_replay_incomplete", self.storm_replay_incomplete),
            ] {
                rows.push((k.into(), v.to_string()));
            }
            rows.push((
                "storm count gap (passedThrough + redriven - storm)".into(),
                self.storm_count_gap.to_string(),
            ));
        }
        if let Some(o) = &self.storm {
            rows.push((
                "storm replay".into(),
                format!(
                    "{} (maxParked {}, group {}, {} waiting at {:.0}s): passed through {}, redriven {}{}",
                    o.phase,
                    o.max_parked,
                    o.group,
                    o.waiting_at_start.map_or("unknown".into(), |n| n.to_string()),
                    o.created_at_secs,
                    o.passed_through,
                    o.redriven,
                    o.stop_reason.as_ref().map_or(String::new(), |w| format!("; stopped: {w}"))
                ),
            ));
        }
        for (q, n) in &self.broker_leftovers {
            rows.push((format!("left in {q}"), n.to_string()));
        }
        for (what, ids) in &self.examples {
            rows.push((format!("e.g. {what}"), ids.join(" ")));
        }
        rows.push(("duration".into(), format!("{:.0}s", self.duration_secs)));
        let mut out = String::from("| figure | value |\n|---|---:|\n");
        for (k, v) in rows {
            out.push_str(&format!("| {k} | {v} |\n"));
        }
        out
    }

    /// Writes `report.json` into `dir`.
    pub fn write(&self, dir: &Path) {
        let _ = std::fs::create_dir_all(dir);
        let json = serde_json::to_string_pretty(self).unwrap_or_default();
        if let Err(e) = std::fs::write(dir.join("report.json"), json) {
            crate::harness::report(&format!("chaos: writing report.json: {e}"));
        }
    }
}

/// `panicked at` lines in the logs kept in `dir`.
/// What the blame of a second arrival says when the operators enqueued the job once: the
/// broker (or the harness's consumer) delivered it again, nobody enqueued it twice.
pub const BROKER_REDELIVERY: &str = "broker_redelivery";

/// A job's enqueues as the operators' logs tell them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Enqueues {
    /// `job requeued` lines: enqueues a broker confirmed.
    pub confirmed: u32,
    /// `requeue failed` lines: enqueues that may or may not have reached the broker.
    pub failed: u32,
}

impl Enqueues {
    fn once(&self) -> bool {
        self.confirmed == 1 && self.failed == 0
    }
}

/// Every job's enqueues in the operator logs of `dir` (each replica's, killed ones included).
pub fn count_enqueues(dir: &Path) -> HashMap<String, Enqueues> {
    let mut all: HashMap<String, Enqueues> = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return all;
    };
    let logs = entries.flatten().filter(|e| {
        let name = e.file_name();
        name.to_string_lossy().starts_with("op-")
    });
    for text in logs.filter_map(|e| std::fs::read_to_string(e.path()).ok()) {
        for line in text.lines() {
            let confirmed = line.contains("job requeued");
            // A failed pass-through may have reached the broker too (its answer lost).
            let failed = line.contains("requeue failed") || line.contains("pass-through failed");
            if !confirmed && !failed {
                continue;
            }
            let Some(job) = line.split(" job=").nth(1).and_then(|r| r.split(' ').next()) else {
                continue;
            };
            let e = all.entry(job.trim_matches('"').to_string()).or_default();
            if confirmed {
                e.confirmed += 1;
            } else {
                e.failed += 1;
            }
        }
    }
    all
}

/// Whether the record says its drop came after the broker confirmed its redrive.
fn requeued_before_drop(d: &DeadLetter) -> bool {
    let conditions = d.status.as_ref().map(|s| s.conditions.as_slice());
    conditions.unwrap_or_default().iter().any(|c| {
        c.type_ == dlq_core::conditions::REQUEUED
            && c.reason == dlq_core::conditions::reason::REQUEUED_BEFORE_DROP
    })
}

pub fn count_panics(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|text| text.matches("panicked at").count() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_key_is_a_duplicate_enqueue_but_not_after_dedupe() {
        let history = History::default();
        history.fault("etcd_restart");
        history.arrived("a", Some("u-1-1".into()));
        history.arrived("a", Some("u-1-1".into()));
        history.arrived("b", None);
        history.arrived("b", None);
        history.arrived("c", Some("u-3-1".into()));
        history.arrived("c", Some("u-4-1".into()));
        let r = Report::compute(&[], &[], &history, &HashMap::new());
        assert_eq!(r.duplicate_enqueues_total, 3);
        assert_eq!(r.duplicate_enqueues["etcd_restart"], 3);
        assert_eq!(r.duplicates_after_dedupe_total, 2, "no key, or another key");
        assert_eq!(r.duplicates_after_dedupe["etcd_restart"], 2);
        let mut ids = r.examples["duplicates_after_dedupe"].clone();
        ids.sort();
        assert_eq!(ids, ["b", "c"]);
    }

    #[test]
    fn a_duplicate_is_blamed_on_the_fault_between_its_arrivals_that_explains_it() {
        let history = History::default();
        history.arrived("a", Some("k".into()));
        history.fault("leader_pause");
        history.fault("apiserver_restart");
        history.arrived("a", Some("k".into()));
        let r = Report::compute(&[], &[], &history, &HashMap::new());
        assert_eq!(r.duplicate_enqueues["leader_pause"], 1);
        assert!(
            !r.duplicate_enqueues.contains_key("apiserver_restart"),
            "the last fault before is not the one that explains it"
        );
    }

    #[test]
    fn a_second_arrival_the_operators_enqueued_once_is_the_brokers() {
        let history = History::default();
        history.arrived("a", Some("k".into()));
        history.fault("rabbitmq_restart");
        history.arrived("a", Some("k".into()));
        let once = Enqueues {
            confirmed: 1,
            failed: 0,
        };
        let logged = HashMap::from([("a".to_string(), once)]);
        let r = Report::compute(&[], &[], &history, &logged);
        assert_eq!(r.duplicate_enqueues[BROKER_REDELIVERY], 1);
        let retried = Enqueues {
            confirmed: 1,
            failed: 1,
        };
        let logged = HashMap::from([("a".to_string(), retried)]);
        let r = Report::compute(&[], &[], &history, &logged);
        assert_eq!(
            r.duplicate_enqueues["rabbitmq_restart"], 1,
            "a retry may have doubled it"
        );
    }

    fn pass(n: u8) -> Option<String> {
        let raw = [n];
        Some(dlq_core::park::message_key(
            "chaos",
            storm::QUEUE,
            Some(&format!("storm:dead#{n}")),
            &raw,
        ))
    }

    /// Issue 47: one dead message keeps one key however it goes back: a pass-through repeated
    /// after a crash, or a record of it redriven later, carries it (a deduplicating consumer
    /// takes the job once); a second, different key is a duplicate after dedupe; a job with
    /// neither a record nor a message key on the target is a stray.
    #[test]
    fn one_dead_message_keeps_one_key_however_it_goes_back() {
        let history = History::default();
        history.arrived("s-00000", pass(0));
        history.fault("operator_sigkill");
        history.arrived("s-00000", pass(0));
        history.arrived("s-00001", pass(1));
        history.arrived("s-00001", Some("uid-1".into()));
        history.arrived("r-7", Some("uid-7-1".into()));
        let r = Report::compute(&[], &[], &history, &HashMap::new());
        assert_eq!(r.duplicate_enqueues_total, 2);
        assert_eq!(r.duplicates_after_dedupe_total, 1);
        assert_eq!(r.examples["duplicates_after_dedupe"], ["s-00001"]);
        let mut stray = r.examples["stray_enqueues"].clone();
        stray.sort();
        assert_eq!(
            stray,
            ["r-7", "s-00001"],
            "no record, and not only message keys"
        );
    }

    #[test]
    fn a_message_key_is_told_from_a_records_key() {
        assert!(super::super::history::is_message_key(
            &pass(3).unwrap_or_default()
        ));
        assert!(!super::super::history::is_message_key("msg-nothex"));
        assert!(!super::super::history::is_message_key("0b1c-uid-1"));
    }

    /// The storm fails on a job missing from the target, on what its dead list, processing
    /// list or inflight hash still hold (an unreadable one counts as left), on a job of another
    /// queue arriving without a record, on a job under two keys, and on a replay not Completed;
    /// the replay's count gap is reported.
    #[test]
    fn the_storm_fails_on_a_missing_job_a_leftover_or_an_incomplete_replay() {
        let ids = storm::ids(3);
        let history = History::default();
        history.arrived("s-00000", pass(0));
        history.arrived("s-00001", pass(1));
        history.arrived("r-1", pass(9));
        let size = StormSize {
            messages: 3,
            max_parked: 10,
        };
        let completed = StormOutcome {
            messages: 3,
            phase: "Completed".into(),
            passed_through: 2,
            redriven: 0,
            ..StormOutcome::default()
        };
        let empty: BTreeMap<String, u64> = ["", ":processing", ":inflight"]
            .iter()
            .map(|s| (format!("{}{s}", storm::DEAD), 0))
            .collect();
        let mut r = Report::compute(&[], &[], &history, &HashMap::new());
        r.check_storm(size, Some(completed.clone()), &ids, &[], &history, &empty);
        assert_eq!(r.storm_lost, 1);
        assert_eq!(r.examples["storm_lost"], ["s-00002"]);
        assert_eq!(
            (r.storm_jobs_without_record, r.storm_jobs_with_record),
            (2, 0)
        );
        assert_eq!(
            r.stray_enqueues, 1,
            "r-1 arrived without a record, not the storm's"
        );
        assert_eq!((r.storm_left_in_broker, r.storm_replay_incomplete), (0, 0));
        assert_eq!(r.storm_count_gap, -1, "reported, not failed");
        assert!(!r.passed());

        history.arrived("s-00002", pass(2));
        history.arrived("s-00001", pass(7));
        let mut unread = empty.clone();
        unread.remove(&format!("{}:inflight", storm::DEAD));
        let stopped = StormOutcome {
            phase: "Stopped".into(),
            ..completed.clone()
        };
        let mut r = Report::default();
        r.check_storm(size, Some(stopped), &ids, &[], &history, &unread);
        assert_eq!(r.storm_lost, 0);
        assert_eq!(r.storm_jobs_two_keys, 1);
        assert_eq!(r.storm_left_in_broker, u64::MAX);
        assert_eq!(r.storm_replay_incomplete, 1);
        let mut r = Report::default();
        r.check_storm(size, None, &ids, &[], &history, &empty);
        assert_eq!(r.storm_replay_incomplete, 1, "never created");
    }

    #[test]
    fn enqueues_are_read_from_every_replicas_log() {
        let dir = std::env::temp_dir().join(format!("chaos-enqueues-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("op-0.log"),
            "x INFO job requeued namespace=\"n\" name=a-1-x job=a-1 queue=orders\n\
             x WARN requeue failed; record stays Parked namespace=n name=a-2-x job=a-2 reason=Unreachable\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("op-1.log"),
            "x INFO job requeued name=a-1-x job=a-1 queue=o\n",
        )
        .unwrap();
        std::fs::write(dir.join("rabbitmq-0.log"), "job requeued job=zzz\n").unwrap();
        let e = count_enqueues(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            e["a-1"],
            Enqueues {
                confirmed: 2,
                failed: 0
            }
        );
        assert_eq!(
            e["a-2"],
            Enqueues {
                confirmed: 0,
                failed: 1
            }
        );
        assert!(!e.contains_key("zzz"), "only the operators' logs");
    }
}
