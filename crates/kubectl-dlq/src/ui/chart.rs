//! A failure group's history as a chart the server draws: an inline SVG of its parked records
//! per hour over the kept 7 days (`status.history`), no script and no front-end framework. Pure,
//! so that tests read the SVG without a browser.

use jiff::Timestamp;
use maud::{Markup, html};

use dlq_core::groups::DeadLetterGroupStatus;
use dlq_core::history::{GroupHistory, HOURS};

/// Width of one hour's bar, in SVG units.
const BAR: usize = 5;
/// Room left of the plot for the scale.
const LEFT: usize = 40;
const TOP: usize = 10;
const PLOT_HEIGHT: usize = 120;
/// Room under the plot for the days.
const BOTTOM: usize = 24;
const WIDTH: usize = LEFT + HOURS * BAR + 10;
const HEIGHT: usize = TOP + PLOT_HEIGHT + BOTTOM;
/// Room a day's label ("12-08", 10 units high) takes: a midnight in the last hours has its line
/// but no label, which would run past the chart's edge.
const DATE_WIDTH: usize = 30;

/// The chart and its caption: each hour of the last 168 up to `now`'s a bar (an hour with none
/// draws none; each bar's tooltip says its hour and count), a line at each UTC midnight with
/// its date, the scale's top the busiest hour; then what the group holds now beside it (the
/// backlog estimate and what standing replays passed through are totals, not hours, so they are
/// told, not drawn).
pub fn group_chart(status: &DeadLetterGroupStatus, now: Timestamp) -> Markup {
    let history = status.history.clone().unwrap_or_default();
    let counts = history.hourly(now, HOURS);
    let max = counts.iter().copied().max().unwrap_or(0);
    let first_hour = now.as_second().div_euclid(3600) - (HOURS as i64 - 1);
    let total: u64 = counts.iter().map(|&n| u64::from(n)).sum();
    let base = TOP + PLOT_HEIGHT;
    html! {
        figure #group-history {
            figcaption {
                "Parked per hour, last 7 days (UTC): " (total) " in all, busiest hour " (max)
                " · trend " (history.trend.shown())
            }
            svg #history-chart xmlns="http://www.w3.org/2000/svg" role="img"
                viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) width="100%"
                aria-label=(format!("records parked per hour over the last 7 days: {total} in all, busiest hour {max}")) {
                line x1=(LEFT) y1=(base) x2=(WIDTH - 10) y2=(base) stroke="#888" {}
                text x=(LEFT - 4) y=(TOP + 8) text-anchor="end" font-size="10" { (max) }
                text x=(LEFT - 4) y=(base) text-anchor="end" font-size="10" { "0" }
                @for (i, hour) in (0..HOURS).map(|i| (i, first_hour + i as i64)) {
                    @if hour.rem_euclid(24) == 0 {
                        line.midnight x1=(LEFT + i * BAR) y1=(TOP) x2=(LEFT + i * BAR) y2=(base + 4) stroke="#ccc" {}
                        @if LEFT + i * BAR + 2 + DATE_WIDTH <= WIDTH {
                            text x=(LEFT + i * BAR + 2) y=(base + 16) font-size="10" { (date(hour)) }
                        }
                    }
                }
                @for (i, n) in counts.iter().enumerate().filter(|(_, n)| **n > 0) {
                    @let height = bar_height(*n, max);
                    rect.parked x=(LEFT + i * BAR) y=(base - height) width=(BAR - 1) height=(height) fill="#c0392b" {
                        title { (hour_label(first_hour + i as i64)) ": " (n) " parked" }
                    }
                }
            }
            p.muted #history-totals { (story(status, &history)) }
        }
    }
}

/// A bar's height for `n` of the busiest `max`: at least 1, so one record shows.
fn bar_height(n: u32, max: u32) -> usize {
    let h = (u64::from(n) * PLOT_HEIGHT as u64).div_ceil(u64::from(max.max(1)));
    (h as usize).clamp(1, PLOT_HEIGHT)
}

/// `12-07` for the hour (hours since the epoch) a day starts at.
fn date(hour: i64) -> String {
    Timestamp::from_second(hour * 3600)
        .map_or_else(|_| "-".into(), |t| t.strftime("%m-%d").to_string())
}

/// `2026-12-07 14:00 UTC`.
fn hour_label(hour: i64) -> String {
    Timestamp::from_second(hour * 3600).map_or_else(
        |_| "-".into(),
        |t| t.strftime("%Y-%m-%d %H:00 UTC").to_string(),
    )
}

/// What the group holds now and what it spans, in words.
fn story(status: &DeadLetterGroupStatus, history: &GroupHistory) -> String {
    let mut parts = vec![dlq_core::groups::parked_and_waiting(
        status.parked,
        status.backlog.as_ref(),
    )];
    if status.passed_through > 0 {
        parts.push(format!(
            "{} passed through by standing replays",
            status.passed_through
        ));
    }
    let first = history.first_seen.as_ref().or(status.first_seen.as_ref());
    if let Some(first) = first {
        parts.push(format!("first seen {}", first.0));
    }
    let versions: Vec<String> = history
        .service_versions
        .top
        .iter()
        .map(|v| format!("{} ({})", v.name, v.count))
        .collect();
    if !versions.is_empty() {
        parts.push(format!("versions {}", versions.join(", ")));
    }
    parts.join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::groups::GroupBacklog;
    use dlq_core::history::{Spanned, Spans, Trend};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    /// 2025-12-01 10:30 UTC.
    fn now() -> Timestamp {
        Timestamp::from_second(1_764_585_000).unwrap()
    }

    fn status(per_hour: &[u32]) -> DeadLetterGroupStatus {
        DeadLetterGroupStatus {
            parked: 20,
            passed_through: 7,
            backlog: Some(GroupBacklog {
                messages: Some(175_000),
            }),
            history: Some(GroupHistory {
                through: Some(Time(Timestamp::from_second(1_764_583_200).unwrap())),
                parked: per_hour.to_vec(),
                service_versions: Spans {
                    top: vec![Spanned {
                        name: "relayer@1.4.2".into(),
                        count: 20,
                    }],
                    other: 0,
                },
                trend: Trend {
                    last_hour: 4,
                    hour_before: 0,
                },
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn every_hour_with_parkings_is_a_bar_scaled_to_the_busiest() {
        let svg = group_chart(&status(&[16, 0, 0, 4]), now()).into_string();
        assert_eq!(svg.matches("<rect").count(), 2, "{svg}");
        assert!(
            svg.contains("height=\"120\""),
            "the busiest fills the plot: {svg}"
        );
        assert!(svg.contains("height=\"30\""), "4 of 16: {svg}");
        assert!(svg.contains("2025-12-01 10:00 UTC: 4 parked"), "{svg}");
        assert!(svg.contains("2025-12-01 07:00 UTC: 16 parked"), "{svg}");
        assert_eq!(
            svg.matches("class=\"midnight\"").count(),
            7,
            "a line a midnight"
        );
        assert!(svg.contains(">12-01<") && svg.contains(">11-25<"), "{svg}");
        assert!(
            svg.contains("20 in all, busiest hour 16 · trend ↑ 0→4"),
            "{svg}"
        );
        assert!(
            svg.contains("20 parked, ~175,000 waiting in the broker · 7 passed through"),
            "{svg}"
        );
        assert!(!svg.contains("<script"), "no script");
    }

    #[test]
    fn a_midnight_in_the_last_hours_has_its_line_but_no_label_past_the_edge() {
        let just_after = Timestamp::from_second(1_764_547_200 + 1_800).unwrap(); // 12-01 00:30
        let svg = group_chart(&status(&[1]), just_after).into_string();
        assert_eq!(svg.matches("class=\"midnight\"").count(), 7, "{svg}");
        assert!(!svg.contains(">12-01<"), "clipped at the edge: {svg}");
        assert!(svg.contains(">11-30<"), "{svg}");
    }

    #[test]
    fn a_group_without_a_history_draws_an_empty_chart() {
        let svg = group_chart(&DeadLetterGroupStatus::default(), now()).into_string();
        assert_eq!(svg.matches("<rect").count(), 0);
        assert!(svg.contains("0 in all"), "{svg}");
        assert_eq!(bar_height(1, 1_000), 1, "one record still shows");
    }
}
