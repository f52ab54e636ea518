//! Production packaging (issue 7), the alert rules the chart renders: checked and unit-tested
//! with the real promtool, and each alert tested both ways and documented with a runbook.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use dlq_testenv::chart::{chart_dir, check, only, render, scratch_dir, tools};
use dlq_testenv::workspace_root;
use serde_json::Value;

/// GitHub's anchor for a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// `promtool check rules` of the rendered rules, written to `dir/rules.yaml`.
fn check_rules(rule: &Value, dir: &Path) {
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml::to_string(&rule["spec"]).expect("rules YAML"),
    )
    .expect("writing rules.yaml");
    let out = check(
        "promtool check rules",
        Command::new(tools().promtool())
            .args(["check", "rules", "rules.yaml"])
            .current_dir(dir),
        None,
    );
    assert!(out.contains("SUCCESS"), "{out}");
}

/// Runs the unit tests next to the chart against the rendered rules in `dir`; returns the
/// test files.
fn run_chart_unit_tests(dir: &Path) -> Vec<PathBuf> {
    let mut tests = Vec::new();
    for entry in std::fs::read_dir(chart_dir().join("tests")).expect("chart tests dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
            tests.push(path);
        }
    }
    assert!(!tests.is_empty(), "no promtool tests in the chart's tests/");
    let mut test = Command::new(tools().promtool());
    test.args(["test", "rules"]).current_dir(dir);
    for path in &tests {
        test.arg(path.file_name().expect("name"));
    }
    check("promtool test rules", &mut test, None);
    tests
}

/// Which alerts the unit tests expect to fire, and to stay quiet, somewhere.
fn alerts_tested(tests: &[PathBuf]) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for path in tests {
        let text = std::fs::read_to_string(path).expect("test file");
        let doc: Value = serde_yaml::from_str(&text).expect("test YAML");
        for case in doc["tests"].as_array().expect("tests") {
            for art in case["alert_rule_test"].as_array().into_iter().flatten() {
                let name = art["alertname"].as_str().expect("alertname").to_string();
                if art["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()) {
                    fires.insert(name);
                } else {
                    quiet.insert(name);
                }
            }
        }
    }
    (fires, quiet)
}

/// Runbooks: the anchors of every heading in docs/runbooks.md, where `runbook_url` points.
fn runbook_anchors() -> BTreeSet<String> {
    let text = std::fs::read_to_string(workspace_root().join("docs/runbooks.md"))
        .expect("docs/runbooks.md");
    text.lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| anchor(heading.trim_start_matches('#')))
        .collect()
}

/// One alerting rule: a tier's severity (info, warning or critical), a summary, a runbook that exists, and promtool cases
/// where it fires and where it stays quiet. Returns its severity.
fn assert_alert_rule<'a>(
    r: &'a Value,
    anchors: &BTreeSet<String>,
    (fires, quiet): &(BTreeSet<String>, BTreeSet<String>),
) -> &'a str {
    let alert = r["alert"].as_str().expect("only alerting rules");
    let severity = r["labels"]["severity"].as_str().unwrap_or("");
    assert!(
        ["info", "warning", "critical"].contains(&severity),
        "{alert}: severity {severity:?}"
    );
    assert!(
        r["annotations"]["summary"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{alert} has no summary"
    );
    let slug = format!("alert-{}", alert.to_lowercase());
    assert_eq!(
        r["annotations"]["runbook_url"],
        format!(
            "https://github.com/deadletter-operator/deadletter-operator/blob/main/docs/runbooks.md#{slug}"
        ),
        "{alert}"
    );
    assert!(
        anchors.contains(&slug),
        "{alert}: no runbook heading `Alert: {alert}` in docs/runbooks.md"
    );
    assert!(
        fires.contains(alert),
        "{alert}: no promtool case where it fires"
    );
    assert!(
        quiet.contains(alert),
        "{alert}: no promtool case where it stays quiet"
    );
    severity
}

#[test]
fn alert_rules_pass_promtool_and_each_alert_is_tested_and_documented() {
    let docs = render(
        "deadletter-operator",
        "dlq-system",
        "prometheusRule:\n  enabled: true\n",
    );
    let rule = only(&docs, "PrometheusRule");
    let dir = scratch_dir("promtool");
    check_rules(rule, &dir);
    let tests = run_chart_unit_tests(&dir);
    let tested = alerts_tested(&tests);
    let anchors = runbook_anchors();

    let rules = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules");
    let severities: BTreeSet<&str> = rules
        .iter()
        .map(|r| assert_alert_rule(r, &anchors, &tested))
        .collect();
    assert_eq!(
        severities,
        ["critical", "info", "warning"].into(),
        "alerts are tiered like the failure groups: info, warning, critical"
    );
    for kind in ["Invalid", "Transient"] {
        for tier in ["Parked", "Sustained", "Storm"] {
            let name = format!("DLQ{kind}{tier}");
            assert!(
                rules.iter().any(|r| r["alert"] == name.as_str()),
                "{name} missing: invalid and transient are alerted separately"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The rules' tier thresholds default to the failure groups' (`spec.groups`): a queue's rule
/// alerts and its groups' tiers say the same thing about the same rate.
#[test]
fn the_rules_tiers_default_to_the_failure_groups_thresholds() {
    use dlq_core::groups::{DEFAULT_CRITICAL_PER_MINUTE, DEFAULT_WARNING_PER_HOUR};
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let values: serde_yaml::Value = serde_yaml::from_str(&text).expect("values.yaml parses");
    let pr = &values["prometheusRule"];
    assert_eq!(
        pr["sustained"]["perHour"].as_i64(),
        Some(DEFAULT_WARNING_PER_HOUR)
    );
    for kind in ["invalidPerMinute", "transientPerMinute"] {
        assert_eq!(
            pr["storm"][kind].as_i64(),
            Some(DEFAULT_CRITICAL_PER_MINUTE),
            "{kind}"
        );
    }
}
