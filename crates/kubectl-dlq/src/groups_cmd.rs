//! `groups`: the failure groups the operator keeps (DeadLetterGroups), most parked first, each
//! with its last 24 hours as a sparkline and its trend; `groups NAME`: one group's story, its
//! 7 days of parkings a day a line.

use clap::Args;
use kube::api::ListParams;
use kube::{Api, ResourceExt};

use dlq_core::api::LABEL_QUEUE;
use dlq_core::group::LABEL_GROUP;
use dlq_core::groups::{DeadLetterGroup, DeadLetterGroupStatus};
use dlq_core::history::{self, GroupHistory};
use jiff::Timestamp;

use crate::inspect::table;
use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct GroupsArgs {
    /// One group (its object name, or its fingerprint): its 7-day history, versions, classes.
    pub name: Option<String>,
    /// Only the groups of this DeadLetterQueue.
    #[arg(long)]
    pub queue: Option<String>,
}

/// Most parked first, then the fastest parking, then the highest tier; ties by name.
pub fn sort(groups: &mut [DeadLetterGroup]) {
    let key = |g: &DeadLetterGroup| {
        let s = g.status.clone().unwrap_or_default();
        (
            std::cmp::Reverse(s.parked),
            std::cmp::Reverse(s.rate_per_minute),
            std::cmp::Reverse(s.tier),
        )
    };
    groups.sort_by(|a, b| key(a).cmp(&key(b)).then(a.name_any().cmp(&b.name_any())));
}

/// One line of the table, the sparkline's hours ending at `now`'s.
fn row(g: &DeadLetterGroup, with_ns: bool, now: Timestamp) -> Vec<String> {
    // A group the operator has created but not yet counted (its status writes are coalesced)
    // shows dashes, not a parked count of 0 it does not have.
    let counted = g.status.is_some();
    let s: DeadLetterGroupStatus = g.status.clone().unwrap_or_default();
    let or_dash = |v: String| if counted { v } else { "-".into() };
    let label = |k: &str| g.labels().get(k).cloned().unwrap_or_else(|| "-".into());
    let ack = acknowledged(g, &s);
    let waiting = if counted { waiting(&s) } else { "-".into() };
    let mut row = Vec::new();
    if with_ns {
        row.push(g.namespace().unwrap_or_default());
    }
    row.extend([
        label(LABEL_GROUP),
        label(LABEL_QUEUE),
        s.failure_kind.map_or("-".into(), |k| k.label().to_string()),
        s.service_version.unwrap_or_else(|| "-".into()),
        or_dash(s.parked.to_string()),
        waiting,
        or_dash(format!("{}/min", s.rate_per_minute)),
        or_dash(s.tier.as_str().to_string()),
        ack,
        s.history
            .as_ref()
            .map_or("-".into(), |h| history::sparkline(&h.hourly(now, 24))),
        s.history.as_ref().map_or("-".into(), |h| h.trend.shown()),
        visible(&s.template),
    ]);
    row
}

/// `groups NAME`: a group's story for on-call, its last 7 days a UTC day a line (8 lines: the
/// first day's early hours are past the kept 168), every line
/// scaled to the week's busiest hour so that the days compare.
pub fn story(g: &DeadLetterGroup, now: Timestamp) -> String {
    let s = g.status.clone().unwrap_or_default();
    let h = s.history.clone().unwrap_or_default();
    let label = |k: &str| g.labels().get(k).cloned().unwrap_or_else(|| "-".into());
    let time = |t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
        t.map_or("-".into(), |t| t.0.to_string())
    };
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<12}{v}\n"));
    line("Group:", g.name_any());
    line("Queue:", label(LABEL_QUEUE));
    line("Template:", visible(&s.template));
    line(
        "Parked:",
        format!(
            "{} now, {} redriven, {} dropped, {} tier",
            s.parked,
            s.redriven,
            s.dropped,
            s.tier.as_str()
        ),
    );
    line(
        "First seen:",
        time(h.first_seen.as_ref().or(s.first_seen.as_ref())),
    );
    line(
        "Last seen:",
        time(h.last_seen.as_ref().or(s.last_seen.as_ref())),
    );
    line(
        "Trend:",
        format!(
            "{} (parked in the hour before, in the last hour)",
            h.trend.shown()
        ),
    );
    line("Versions:", spans(&h.service_versions));
    line("Classes:", spans(&h.error_classes));
    out.push_str(&days(&h, now));
    out
}

/// `relayer@1.4.2 (12), relayer@1.4.1 (3), other (2)`, or `-`.
fn spans(s: &history::Spans) -> String {
    let mut parts: Vec<String> = s
        .top
        .iter()
        .map(|v| format!("{} ({})", visible(&v.name), v.count))
        .collect();
    if s.other > 0 {
        parts.push(format!("other ({})", s.other));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

/// The UTC days of the last 7 up to `now`, a line each: date, 24 hours of blocks, the day's total.
fn days(h: &GroupHistory, now: Timestamp) -> String {
    let today_hours = now.as_second().rem_euclid(86_400) / 3600 + 1;
    let hours = 7 * 24 + today_hours as usize;
    let counts = h.hourly(now, hours);
    let max = counts.iter().copied().max().unwrap_or(0);
    let total: u64 = counts.iter().map(|&n| u64::from(n)).sum();
    let mut out = format!(
        "Parked per hour, last 7 days (UTC, 00h to 23h; busiest hour {max}, {total} in all):\n"
    );
    for (day, hours) in counts.chunks(24).enumerate() {
        let date = now
            .checked_sub(jiff::SignedDuration::from_hours(24 * (7 - day as i64)))
            .map_or_else(|_| "-".into(), |t| t.strftime("%m-%d").to_string());
        let sum: u64 = hours.iter().map(|&n| u64::from(n)).sum();
        out.push_str(&format!(
            "  {date}  {:<24}  {sum}\n",
            history::sparkline_against(hours, max)
        ));
    }
    out
}

/// The group's estimated share of what waits in the broker (`~175,000`, `unknown` where the
/// broker cannot say); `-` for a queue without a source that reports one.
fn waiting(s: &DeadLetterGroupStatus) -> String {
    s.backlog.as_ref().map_or_else(|| "-".into(), |b| b.shown())
}

/// A template as a person can tell it apart from every other: each character outside
/// printable ASCII written as its code point (`\u{43e}`), so a Cyrillic `о` never reads as a
/// Latin `o`, and a control character or an invisible one (a zero-width space, a direction
/// override) shows where it is. The backslash itself is doubled, so nothing reads as an escape
/// that is not one.
pub fn visible(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            ' '..='~' => out.push(c),
            other => out.push_str(&format!("\\u{{{:x}}}", u32::from(other))),
        }
    }
    out
}

/// Who acknowledged the group; `(new failures)` once that no longer silences it (parked count
/// doubled or tier risen since).
fn acknowledged(g: &DeadLetterGroup, s: &DeadLetterGroupStatus) -> String {
    match &g.spec.acknowledged {
        None => "-".into(),
        Some(a) if s.acknowledgement.is_some() && !s.silenced => {
            format!("{} (new failures)", a.by)
        }
        Some(a) => a.by.clone(),
    }
}

/// The size of the biggest group's incident in words, when part of it still waits in the
/// broker: `relayer-70b206ffc3: 5,000 parked, ~175,000 waiting in the broker`.
pub fn storm_line(groups: &[DeadLetterGroup]) -> Option<String> {
    let top = groups.iter().find(|g| {
        g.status
            .as_ref()
            .and_then(|s| s.backlog.as_ref())
            .is_some_and(|b| b.messages != Some(0))
    })?;
    let s = top.status.as_ref()?;
    Some(format!(
        "{}: {}",
        top.name_any(),
        dlq_core::groups::parked_and_waiting(s.parked, s.backlog.as_ref())
    ))
}

/// The table `groups` prints (header included) at `now`, or None when there is nothing to show.
pub fn render(groups: &[DeadLetterGroup], with_ns: bool, now: Timestamp) -> Option<String> {
    if groups.is_empty() {
        return None;
    }
    let mut header = Vec::new();
    if with_ns {
        header.push("NAMESPACE".to_string());
    }
    header.extend(
        [
            "GROUP", "QUEUE", "KIND", "VERSION", "PARKED", "WAITING", "RATE", "TIER", "ACK",
            "LAST 24H", "TREND", "TEMPLATE",
        ]
        .map(String::from),
    );
    let mut rows = vec![header];
    rows.extend(groups.iter().map(|g| row(g, with_ns, now)));
    Some(table(&rows))
}

pub async fn run(g: &Global, args: GroupsArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    if let Some(name) = &args.name {
        let api: Api<DeadLetterGroup> = Api::namespaced(client, &ns);
        let group = match api.get_opt(name).await? {
            Some(group) => group,
            None => {
                let lp = ListParams::default().labels(&format!("{LABEL_GROUP}={name}"));
                let mut found = api.list(&lp).await?.items;
                match (found.pop(), found.is_empty()) {
                    (Some(group), true) => group,
                    (Some(_), false) => {
                        return Err(CliError::Usage(format!(
                            "{name} is the fingerprint of groups of several queues: name the group (`kubectl dlq groups` lists them)"
                        )));
                    }
                    (None, _) => {
                        return Err(CliError::Usage(format!(
                            "no failure group {name} in namespace {ns}"
                        )));
                    }
                }
            }
        };
        print!("{}", story(&group, Timestamp::now()));
        return Ok(());
    }
    let api: Api<DeadLetterGroup> = if g.all_namespaces {
        Api::all(client)
    } else {
        Api::namespaced(client, &ns)
    };
    let mut lp = ListParams::default();
    if let Some(q) = &args.queue {
        lp = lp.labels(&format!("{LABEL_QUEUE}={q}"));
    }
    let mut groups = api.list(&lp).await?.items;
    sort(&mut groups);
    match render(&groups, g.all_namespaces, Timestamp::now()) {
        Some(text) => {
            print!("{text}");
            if let Some(line) = storm_line(&groups) {
                println!("{line}");
            }
        }
        None => eprintln!("no failure groups"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::groups::{DeadLetterGroupSpec, Tier};

    /// A Monday, 10:30 UTC.
    #[allow(non_snake_case)]
    fn NOW() -> Timestamp {
        Timestamp::from_second(1_764_585_000).unwrap()
    }

    /// A group whose history parked `per_hour` in the hours up to `NOW()`'s, newest last.
    fn with_history(name: &str, per_hour: &[u32]) -> DeadLetterGroup {
        let mut g = group(
            name,
            per_hour.iter().map(|&n| i64::from(n)).sum(),
            0,
            Tier::Info,
        );
        let through = NOW().as_second() / 3600 * 3600;
        if let Some(s) = g.status.as_mut() {
            s.history = Some(GroupHistory {
                through: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    Timestamp::from_second(through).unwrap(),
                )),
                parked: per_hour.to_vec(),
                service_versions: history::Spans {
                    top: vec![history::Spanned {
                        name: "relayer@1.4.2".into(),
                        count: 12,
                    }],
                    other: 3,
                },
                trend: history::Trend {
                    last_hour: 8,
                    hour_before: 2,
                },
                ..Default::default()
            });
        }
        g
    }

    #[test]
    fn a_group_shows_its_last_24_hours_and_its_trend() {
        let g = with_history("g", &[1, 0, 0, 2, 8]);
        let r = row(&g, false, NOW());
        assert_eq!(r[9], format!("{}▂▁▁▃█", "▁".repeat(19)), "{r:?}");
        assert_eq!(r[10], "↑ 2→8");
        let none = row(&group("n", 1, 0, Tier::Info), false, NOW());
        assert_eq!(
            none[9..11],
            ["-", "-"],
            "before the operator wrote a history"
        );
        let text = render(&[g], false, NOW()).unwrap_or_default();
        assert!(
            text.lines().next().is_some_and(|l| l.contains("LAST 24H")),
            "{text}"
        );
    }

    #[test]
    fn a_groups_story_draws_seven_days_a_day_a_line() {
        let mut per_hour = vec![0; 7 * 24];
        per_hour[0] = 16; // a week ago, 11:00
        let last = per_hour.len() - 1;
        per_hour[last] = 4; // now, 10:00
        let text = story(&with_history("relayer-3f9a1c07d2", &per_hour), NOW());
        assert!(text.contains("Trend:      ↑ 2→8"), "{text}");
        assert!(
            text.contains("Versions:   relayer@1.4.2 (12), other (3)"),
            "{text}"
        );
        assert!(text.contains("Classes:    -"), "{text}");
        assert!(text.contains("busiest hour 16, 20 in all"), "{text}");
        let days: Vec<&str> = text.lines().filter(|l| l.starts_with("  ")).collect();
        assert_eq!(days.len(), 8, "{text}");
        let first = format!("  11-24  {}█{}  16", "▁".repeat(11), "▁".repeat(12));
        assert_eq!(days[0], first, "{text}");
        assert!(
            days[1].starts_with("  11-25  ") && days[1].ends_with("  0"),
            "{text}"
        );
        assert_eq!(
            days[7],
            format!("  12-01  {}▃{}  4", "▁".repeat(10), " ".repeat(13))
        );
    }

    fn group(name: &str, parked: i64, rate: i64, tier: Tier) -> DeadLetterGroup {
        let mut g = DeadLetterGroup::new(name, DeadLetterGroupSpec::default());
        g.status = Some(DeadLetterGroupStatus {
            parked,
            rate_per_minute: rate,
            tier,
            template: format!("t {name}"),
            ..Default::default()
        });
        g
    }

    /// Latin `o` against Cyrillic `о`: two groups whose templates look alike print apart.
    #[test]
    fn look_alike_templates_print_apart() {
        let mut latin = group("l", 1, 0, Tier::Info);
        let mut cyrillic = group("c", 1, 0, Tier::Info);
        if let (Some(l), Some(c)) = (latin.status.as_mut(), cyrillic.status.as_mut()) {
            l.template = "timeout talking to payer <hex>".into();
            c.template = "timeout talking t\u{43e} payer <hex>".into();
        }
        let (l, c) = (row(&latin, false, NOW()), row(&cyrillic, false, NOW()));
        assert_eq!(l[11], "timeout talking to payer <hex>");
        assert_eq!(c[11], "timeout talking t\\u{43e} payer <hex>");
        assert_eq!(visible("a\\u{43e}\u{200b}\t"), "a\\\\u{43e}\\u{200b}\\u{9}");
    }

    #[test]
    fn a_group_not_yet_counted_shows_dashes_not_zero() {
        let fresh = DeadLetterGroup::new("f", DeadLetterGroupSpec::default());
        let fresh = row(&fresh, false, NOW());
        assert_eq!(fresh[4..8], ["-", "-", "-", "-"], "{fresh:?}");
        let counted = super::row(&group("g", 0, 0, Tier::Info), false, NOW());
        assert_eq!(counted[4..8], ["0", "-", "0/min", "info"], "{counted:?}");
    }

    #[test]
    fn a_storms_group_shows_what_waits_in_the_broker_and_unknown_as_unknown() {
        use dlq_core::groups::GroupBacklog;
        let with = |name: &str, parked, messages| {
            let mut g = group(name, parked, 0, Tier::Critical);
            if let Some(s) = g.status.as_mut() {
                s.backlog = Some(GroupBacklog { messages });
            }
            g
        };
        let storm = with("relayer-70b206ffc3", 5_000, Some(175_000));
        assert_eq!(row(&storm, false, NOW())[4..6], ["5000", "~175,000"]);
        let unknown = with("relayer-1111111111", 3, None);
        assert_eq!(row(&unknown, false, NOW())[5], "unknown");
        let mut groups = vec![unknown, storm];
        sort(&mut groups);
        assert_eq!(
            storm_line(&groups).as_deref(),
            Some("relayer-70b206ffc3: 5,000 parked, ~175,000 waiting in the broker")
        );
        let drained = with("relayer-2222222222", 10, Some(0));
        assert_eq!(storm_line(&[drained]), None, "nothing waits");
        assert_eq!(storm_line(&[group("g", 1, 0, Tier::Info)]), None);
    }

    #[test]
    fn most_parked_first_then_rate_then_tier() {
        let mut groups = vec![
            group("a", 1, 0, Tier::Info),
            group("b", 5, 1, Tier::Info),
            group("c", 5, 9, Tier::Info),
            group("d", 5, 9, Tier::Critical),
        ];
        sort(&mut groups);
        let names: Vec<String> = groups.iter().map(|g| g.name_any()).collect();
        assert_eq!(names, ["d", "c", "b", "a"]);
        let text = render(&groups, false, NOW()).unwrap_or_default();
        let first = text.lines().nth(1).unwrap_or_default();
        assert!(
            first.contains("critical") && first.contains("9/min"),
            "{text}"
        );
        assert_eq!(render(&[], false, NOW()), None);
        let mut acked = group("e", 1, 0, Tier::Info);
        acked.spec.acknowledged = Some(dlq_core::groups::Acknowledgement {
            by: "carol".into(),
            note: None,
        });
        let text = render(std::slice::from_ref(&acked), false, NOW()).unwrap_or_default();
        assert!(text.contains(" carol "), "{text}");
        if let Some(s) = acked.status.as_mut() {
            s.acknowledgement = Some(Default::default());
            s.silenced = false;
        }
        let text = render(&[acked], false, NOW()).unwrap_or_default();
        assert!(text.contains("carol (new failures)"), "{text}");
    }
}
