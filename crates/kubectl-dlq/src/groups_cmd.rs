//! `groups`: the failure groups the operator keeps (DeadLetterGroups), most parked first.

use clap::Args;
use kube::api::ListParams;
use kube::{Api, ResourceExt};

use dlq_core::api::LABEL_QUEUE;
use dlq_core::group::LABEL_GROUP;
use dlq_core::groups::{DeadLetterGroup, DeadLetterGroupStatus};

use crate::inspect::table;
use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct GroupsArgs {
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

/// One line of the table.
fn row(g: &DeadLetterGroup, with_ns: bool) -> Vec<String> {
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
        visible(&s.template),
    ]);
    row
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

/// The table `groups` prints (header included), or None when there is nothing to show.
pub fn render(groups: &[DeadLetterGroup], with_ns: bool) -> Option<String> {
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
            "TEMPLATE",
        ]
        .map(String::from),
    );
    let mut rows = vec![header];
    rows.extend(groups.iter().map(|g| row(g, with_ns)));
    Some(table(&rows))
}

pub async fn run(g: &Global, args: GroupsArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
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
    match render(&groups, g.all_namespaces) {
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
        let (l, c) = (row(&latin, false), row(&cyrillic, false));
        assert_eq!(l[9], "timeout talking to payer <hex>");
        assert_eq!(c[9], "timeout talking t\\u{43e} payer <hex>");
        assert_eq!(visible("a\\u{43e}\u{200b}\t"), "a\\\\u{43e}\\u{200b}\\u{9}");
    }

    #[test]
    fn a_group_not_yet_counted_shows_dashes_not_zero() {
        let fresh = DeadLetterGroup::new("f", DeadLetterGroupSpec::default());
        let fresh = row(&fresh, false);
        assert_eq!(fresh[4..8], ["-", "-", "-", "-"], "{fresh:?}");
        let counted = super::row(&group("g", 0, 0, Tier::Info), false);
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
        assert_eq!(row(&storm, false)[4..6], ["5000", "~175,000"]);
        let unknown = with("relayer-1111111111", 3, None);
        assert_eq!(row(&unknown, false)[5], "unknown");
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
        let text = render(&groups, false).unwrap_or_default();
        let first = text.lines().nth(1).unwrap_or_default();
        assert!(
            first.contains("critical") && first.contains("9/min"),
            "{text}"
        );
        assert_eq!(render(&[], false), None);
        let mut acked = group("e", 1, 0, Tier::Info);
        acked.spec.acknowledged = Some(dlq_core::groups::Acknowledgement {
            by: "carol".into(),
            note: None,
        });
        let text = render(std::slice::from_ref(&acked), false).unwrap_or_default();
        assert!(text.contains(" carol "), "{text}");
        if let Some(s) = acked.status.as_mut() {
            s.acknowledgement = Some(Default::default());
            s.silenced = false;
        }
        let text = render(&[acked], false).unwrap_or_default();
        assert!(text.contains("carol (new failures)"), "{text}");
    }
}
