use std::collections::BTreeMap;

use super::*;
use crate::dead_letter::{DeadLetter, DeadLetterStatus};
use crate::testing::at;
use Outcome::*;

fn record(name: &str, failed: i64, created: i64) -> DeadLetter {
    crate::testing::RecordBuilder::job(name)
        .named(name)
        .reason("timeout talking to the node")
        .service_version("relayer@1.4.2")
        .failed_at(at(failed))
        .created(at(created))
        .build()
}

fn signed_by(mut r: DeadLetter, replay: &str, phase: Phase) -> DeadLetter {
    r.spec.action = Some(Action::Redrive);
    r.spec.by = Some("carol".into());
    r.metadata.labels = Some(BTreeMap::from([(LABEL_REPLAY.into(), replay.into())]));
    r.metadata.annotations = Some(BTreeMap::from([(
        ANNOTATION_REPLAY_UID.into(),
        format!("uid-{replay}"),
    )]));
    r.status = Some(DeadLetterStatus {
        phase: Some(phase),
        ..Default::default()
    });
    r
}

fn spec(selector: ReplaySelector) -> DeadLetterReplaySpec {
    DeadLetterReplaySpec {
        queue: "relayer".into(),
        selector: Some(selector),
        action: None,
        rate: Some("20/s".into()),
        max: None,
        stop_when: None,
        dry_run: None,
        by: "carol".into(),
        note: Some("INC-1234".into()),
        settle_seconds: None,
        stop: None,
        paused: None,
        standing: None,
        canary: None,
        approvals: Vec::new(),
    }
}

/// A start by an operator that froze nothing: records created at or before it existed.
fn legacy(second: i64) -> Start<'static> {
    Start {
        at: at(second),
        frozen: None,
        standing: None,
    }
}

/// Issue 45 item 13: a replay of 5 selected records also redrove 2 parked right after it
/// started, in the same second (creation times have whole seconds).
#[test]
fn the_selection_is_frozen_to_the_records_the_start_saw_even_within_its_second() {
    let seen = vec![
        record("a", 10, 99),
        record("b", 11, 100),
        signed_by(record("c", 12, 100), "other", Phase::Redriven),
    ];
    let frozen = Frozen::of(&seen);
    assert_eq!(frozen.newest, Some(Time(at(100))));
    assert_eq!(
        frozen.newest_names,
        ["b", "c"],
        "the newest second, by name"
    );
    // Parked after the start: in its second (the start was at 100.5), and later.
    let later = [record("d", 1, 100), record("e", 2, 101)];
    let all: Vec<DeadLetter> = seen.iter().chain(&later).cloned().collect();
    let start = Start {
        at: at(100) + jiff::SignedDuration::from_millis(500),
        frozen: Some(&frozen),
        standing: None,
    };
    let sel = ReplaySelector::default();
    let names = |v: Vec<&DeadLetter>| -> Vec<String> {
        v.iter()
            .map(|r| r.metadata.name.clone().unwrap_or_default())
            .collect()
    };
    assert_eq!(
        names(select(&all, "relayer", &sel, Some(&start), None)),
        ["a", "b"],
        "exactly what the start saw"
    );
    let mine = ReplayRef {
        name: "inc",
        uid: "uid-inc",
    };
    assert_eq!(observe(&all, mine, &start, &[]).new_parked, 2);
    // Without the frozen names, `d` (created in the start's second) was taken.
    let loose = Start {
        frozen: None,
        ..start
    };
    assert_eq!(
        names(select(&all, "relayer", &sel, Some(&loose), None)),
        ["d", "a", "b"]
    );
    // A start that saw no record of its queue takes none.
    let empty = Frozen::of(std::iter::empty::<&DeadLetter>());
    let start = Start {
        frozen: Some(&empty),
        ..start
    };
    assert!(select(&all, "relayer", &sel, Some(&start), None).is_empty());
    assert_eq!(observe(&all, mine, &start, &[]).new_parked, 5);
}

#[test]
fn selection_takes_parked_undecided_matching_records_oldest_failure_first() {
    let mut other_queue = record("d", 1, 1);
    other_queue.spec.queue = "billing".into();
    let mut invalid = record("e", 1, 1);
    invalid.spec.failure_kind = FailureKind::Invalid;
    let records = vec![
        record("b", 30, 1),
        record("a", 20, 1),
        signed_by(record("c", 10, 1), "other", Phase::Parked),
        other_queue,
        invalid,
        record("late", 5, 100),
    ];
    let sel = ReplaySelector {
        failure_kind: Some(FailureKind::Transient),
        reason_contains: Some("timeout".into()),
        ..ReplaySelector::default()
    };
    let names = |v: Vec<&DeadLetter>| -> Vec<String> {
        v.iter()
            .map(|r| r.metadata.name.clone().unwrap_or_default())
            .collect()
    };
    assert_eq!(
        names(select(&records, "relayer", &sel, None, None)),
        ["late", "a", "b"]
    );
    assert_eq!(
        names(select(&records, "relayer", &sel, Some(&legacy(50)), None)),
        ["a", "b"],
        "records parked after the start are not taken"
    );
    assert_eq!(
        names(select(&records, "relayer", &sel, None, Some(1))),
        ["late"]
    );
    let by_name = ReplaySelector {
        names: vec!["b".into(), "gone".into()],
        ..ReplaySelector::default()
    };
    assert_eq!(
        names(select(&records, "relayer", &by_name, None, None)),
        ["b"]
    );
    // Records of another group: their labels say so (set at park from their facts).
    let other = |name: &str, reason: &str, kind: FailureKind| {
        crate::testing::RecordBuilder::job(name)
            .named(name)
            .reason(reason)
            .failure_kind(kind)
            .service_version("relayer@1.4.2")
            .failed_at(at(25))
            .created(at(1))
            .build()
    };
    // ("e" had its kind changed after parking, its label kept: left out here.)
    let grouped: Vec<DeadLetter> = records
        .iter()
        .filter(|r| r.metadata.name.as_deref() != Some("e"))
        .cloned()
        .chain([
            other("f", "a different failure", FailureKind::Transient),
            other("g", "timeout talking to the node", FailureKind::Invalid),
            other("h", "timeout talking to the node", FailureKind::Transient),
        ])
        .collect();
    let by_group = ReplaySelector {
        group: Some(crate::facts::Facts::group(&records[0]).into_owned()),
        ..ReplaySelector::default()
    };
    assert_eq!(
        names(select(&grouped, "relayer", &by_group, None, None)),
        ["late", "a", "h", "b"],
        "the group's parked undecided records, another group's never"
    );
}

#[test]
fn selector_time_and_version_bounds() {
    let r = record("a", 100, 1);
    let sel = |since: Option<i64>, until: Option<i64>, version: Option<&str>| ReplaySelector {
        since: since.map(|s| Time(at(s))),
        until: until.map(|s| Time(at(s))),
        service_version: version.map(str::to_string),
        ..ReplaySelector::default()
    };
    assert!(sel(Some(100), Some(101), None).matches(&r));
    assert!(!sel(Some(101), None, None).matches(&r));
    assert!(
        !sel(None, Some(100), None).matches(&r),
        "until is exclusive"
    );
    assert!(sel(None, None, Some("relayer@1.4.2")).matches(&r));
    assert!(!sel(None, None, Some("relayer@1.4.3")).matches(&r));
    assert_eq!(
        sel(Some(100), None, Some("v")).describe("relayer"),
        "queue=relayer,since=1970-01-01T00:01:40Z,serviceVersion=v"
    );
}

#[test]
fn observation_counts_this_replays_records_in_decision_order() {
    let mut failing = signed_by(record("b", 20, 1), "inc", Phase::Parked);
    failing.status.get_or_insert_default().conditions =
        vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: "Requeued".into(),
            status: "False".into(),
            reason: "BrokerUnreachable".into(),
            message: String::new(),
            observed_generation: Some(1),
            last_transition_time: Time(at(1)),
        }];
    let mut withdrawn = signed_by(record("d", 40, 1), "inc", Phase::Parked);
    withdrawn.spec.action = None;
    let records = vec![
        signed_by(record("c", 30, 1), "inc", Phase::Parked),
        failing,
        signed_by(record("a", 10, 1), "inc", Phase::Redriven),
        signed_by(record("x", 10, 1), "other", Phase::Redriven),
        withdrawn,
        record("new", 1, 60),
    ];
    let mut recreated = signed_by(record("y", 10, 1), "inc", Phase::Redriven);
    recreated.metadata.annotations = None;
    let records = [records, vec![recreated]].concat();
    let inc = ReplayRef {
        name: "inc",
        uid: "uid-inc",
    };
    let o = observe(&records, inc, &legacy(50), &["e".into(), "c".into()]);
    assert_eq!(o.outcomes, [Redriven, Failing, Pending, Withdrawn, Pending]);
    assert_eq!(o.new_parked, 1);
    let mut status = DeadLetterReplayStatus {
        decided: 9,
        ..Default::default()
    };
    counts(&mut status, &o);
    assert_eq!(
        (
            status.decided,
            status.redriven,
            status.failed,
            status.withdrawn
        ),
        (9, 1, 1, 1),
        "decided never goes down"
    );
}

#[test]
fn stop_bounds() {
    let b = spec(ReplaySelector::default()).bounds();
    assert_eq!((b.failure_ratio, b.window, b.new_parked), (0.2, 20, 10));
    let mut o = Observed {
        outcomes: [vec![Redriven; 16], vec![Failing; 4]].concat(),
        new_parked: 10,
    };
    assert_eq!(o.stop_reason(&b), None, "4/20 = 20% is within the bound");
    o.outcomes.push(Failing);
    assert!(
        o.stop_reason(&b)
            .is_some_and(|s| s.starts_with("requeue failure ratio 25%")),
        "5 of the last 20"
    );
    o.outcomes.clear();
    o.new_parked = 11;
    assert!(
        o.stop_reason(&b)
            .is_some_and(|s| s.contains("11 new records"))
    );
}

#[test]
fn ratio_needs_a_full_window_of_settled_outcomes() {
    assert_eq!(failure_ratio(&[Failing, Pending], 2), None);
    assert_eq!(failure_ratio(&[Redriven, Failing, Pending], 2), Some(0.5));
    assert_eq!(
        failure_ratio(&[Failing, Failing, Redriven, Dropped], 2),
        Some(0.0),
        "recent window only"
    );
    assert_eq!(failure_ratio(&[Failing, Withdrawn], 2), None);
}

#[test]
fn the_pace_starts_at_once_and_bursts_at_most_two_seconds() {
    let s = Duration::from_secs_f64;
    assert_eq!(
        budget(20.0, s(0.0), 0),
        1,
        "the first decision goes at once"
    );
    assert_eq!(budget(20.0, s(0.5), 1), 10);
    assert_eq!(budget(20.0, s(0.5), 11), 0);
    assert_eq!(
        budget(20.0, s(600.0), 11),
        40,
        "after a restart: two seconds' worth"
    );
    assert_eq!(budget(0.5, s(3.0), 1), 1);
    assert_eq!(step(50.0), s(0.1));
    assert_eq!(step(0.5), s(1.0));
}

#[test]
fn rates_and_defaults() {
    assert_eq!(parse_rate("20/s"), Ok(20.0));
    assert_eq!(parse_rate("0.5"), Ok(0.5));
    assert!(parse_rate("0/s").is_err());
    assert!(parse_rate("fast").is_err());
    let mut s = spec(ReplaySelector::default());
    assert_eq!(s.rate(), 20.0);
    s.rate = None;
    assert_eq!(s.rate(), DEFAULT_RATE);
    s.standing = Some(true);
    assert_eq!(s.rate(), DEFAULT_STANDING_RATE, "a storm's records");
    assert_eq!(s.pass_rate(), None, "its messages at the broker's speed");
    s.standing = None;
    assert_eq!(s.action(), Action::Redrive);
    assert_eq!(s.settle(), DEFAULT_SETTLE);
    assert_eq!(
        s.decision_note("inc-1234", &[]),
        "replay inc-1234: INC-1234"
    );
    assert_eq!(
        s.decision_note("inc-1234", &["bob".into(), "dave".into()]),
        "replay inc-1234 (approved by bob, dave): INC-1234"
    );
    assert_eq!(
        FailureKind::from_label("TRANSIENT"),
        Some(FailureKind::Transient)
    );
    assert_eq!(FailureKind::from_label("flaky"), None);
}

/// Issue 58 item 4: a redrive of one failure group sends its records' jobs ahead of their
/// decisions; a standing one at the broker's speed unless `rate` says, another at its `rate`;
/// a drop, a selection by other facts or by names decides first as before.
#[test]
fn a_group_redrive_sends_ahead_at_its_pace() {
    let group = ReplaySelector {
        group: Some("3f9a1c07d2".into()),
        ..ReplaySelector::default()
    };
    let mut s = spec(group.clone());
    assert!(s.sends_ahead());
    assert_eq!(s.send_rate(), Some(20.0), "a group replay at its rate");
    s.rate = None;
    assert_eq!(s.send_rate(), Some(DEFAULT_RATE), "or the default rate");
    s.standing = Some(true);
    assert_eq!(s.send_rate(), None, "a standing one at the broker's speed");
    s.rate = Some("500/s".into());
    assert_eq!(s.send_rate(), Some(500.0), "unless its rate says");
    s.action = Some(Action::Drop);
    assert!(!s.sends_ahead(), "a drop sends nothing");
    let named = ReplaySelector {
        names: vec!["r1".into()],
        ..group
    };
    assert!(
        !spec(named).sends_ahead(),
        "reviewed names are decided first"
    );
    assert!(!spec(ReplaySelector::default()).sends_ahead());
}

#[test]
fn summary_and_progress_read_like_the_runbook() {
    let replay = DeadLetterReplay::new("inc", spec(ReplaySelector::default()));
    let status = DeadLetterReplayStatus {
        selected: 300,
        decided: 300,
        redriven: 300,
        achieved_rate: Some(49.8),
        ..Default::default()
    };
    assert_eq!(
        summary(&replay, &status, 6.0),
        "replay queue=relayer by carol: selected 300, decided 300, redriven 300, failing 0, withdrawn 0, skipped 0, new parkings 0; 300 decisions in 6.0s (49.8/s); completed"
    );
    let stopped = DeadLetterReplayStatus {
        stop_reason: Some("stopped by spec.stop".into()),
        ..status.clone()
    };
    assert!(summary(&replay, &stopped, 6.0).ends_with("; stopped: stopped by spec.stop"));
    let half = DeadLetterReplayStatus {
        decided: 150,
        ..status
    };
    assert!(progress_line(&half).starts_with("[###############...............] 150/300 decided"));
}

#[test]
fn frozen_fields_rule_names_every_field_but_stop() {
    let rule = frozen_fields_equal("self.spec", "oldSelf.spec");
    assert!(rule.contains("self.spec.dryRun == oldSelf.spec.dryRun"));
    assert!(!rule.contains("stop =="));
    let fields = serde_json::to_value(spec(ReplaySelector::default())).expect("json");
    let mut names: Vec<&str> = fields
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .filter(|k| *k != "stop")
        .collect();
    names.sort();
    for f in names {
        assert!(FROZEN_FIELDS.contains(&f), "{f} is not frozen");
    }
}

/// Issue 47: a standing replay of a group takes that group's records parked after it started
/// (the rest of its incident), and the `newParked` bound counts only other records.
#[test]
fn a_standing_replay_takes_its_groups_later_records_and_counts_only_others_as_new() {
    let before = record("a", 10, 99);
    let group = before.group().into_owned();
    let frozen = Frozen::of([&before]);
    let same_group_later = record("b", 11, 120);
    let other_group_later = crate::testing::RecordBuilder::job("c")
        .named("c")
        .reason("card declined")
        .failed_at(at(12))
        .created(at(121))
        .build();
    let selector = ReplaySelector {
        group: Some(group),
        ..ReplaySelector::default()
    };
    let all = [before, same_group_later, other_group_later];
    let frozen_start = Start {
        at: at(100),
        frozen: Some(&frozen),
        standing: None,
    };
    let names = |start: &Start<'_>| -> Vec<String> {
        select(&all, "relayer", &selector, Some(start), None)
            .into_iter()
            .map(|r| r.name().to_string())
            .collect()
    };
    assert_eq!(names(&frozen_start), ["a"], "a plain replay stays frozen");
    let standing = Start {
        standing: Some(&selector),
        ..frozen_start
    };
    assert_eq!(
        names(&standing),
        ["a", "b"],
        "a standing one takes the group's later record"
    );
    let replay = ReplayRef {
        name: "r",
        uid: "uid-r",
    };
    assert_eq!(observe(&all, replay, &frozen_start, &[]).new_parked, 2);
    assert_eq!(
        observe(&all, replay, &standing, &[]).new_parked,
        1,
        "only the other group's record is a new parking"
    );
}

/// Issue 47: a standing replay ends when the broker was seen empty after the last message
/// came, or when nothing came for the quiet time; a backlog read before the last message
/// proves nothing.
#[test]
fn a_standing_replay_is_done_when_the_broker_is_seen_empty_or_nothing_came() {
    let quiet = Duration::from_secs(60);
    let came = at(100);
    assert!(standing_done(
        Some((Some(0), at(101))),
        came,
        at(102),
        quiet
    ));
    assert!(
        !standing_done(Some((Some(0), at(99))), came, at(102), quiet),
        "an empty backlog read before the last message came"
    );
    assert!(!standing_done(
        Some((Some(7), at(101))),
        came,
        at(102),
        quiet
    ));
    assert!(!standing_done(None, came, at(159), quiet));
    assert!(standing_done(None, came, at(160), quiet), "quiet for 60 s");
    assert!(
        standing_done(Some((None, at(101))), came, at(161), quiet),
        "a broker that cannot say"
    );
}
