//! Per-record Alertmanager alerts as data: which alerts a record raises, their labels and
//! annotations, and their Alertmanager v2 form (`POST /api/v2/alerts`).
//!
//! An alert is identified by its labels; `startsAt` is always the record's creation (when it
//! was parked), so a resend by any replica is idempotent and never moves the alert. `endsAt` is
//! a lease while the alert is current, and "now" when it is resolved.

use std::collections::BTreeMap;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

use crate::conditions::REQUEUED;
use crate::dead_letter::{DeadLetter, FailureKind, Phase};
use crate::queue::DeadLetterQueue;
use crate::queue::{AlertPer, AlertSettings};

/// Alert raised while a record is Parked.
pub const PARKED: &str = "DeadLetterParked";
/// Alert raised while a failure group has Parked records and no acknowledgement silences it
/// (one per group: the default, see [`AlertSettings::per`]).
pub const GROUP_PARKED: &str = "DeadLetterGroupParked";
/// Alert raised while a Parked record's requeue keeps failing (`Requeued=False`).
pub const REQUEUE_FAILING: &str = "DeadLetterRequeueFailing";
/// Severity when the queue does not name one.
pub const DEFAULT_SEVERITY: &str = "warning";
/// Labels the operator sets itself; a queue's `alerts.labels` cannot override them.
pub const RESERVED_LABELS: &[&str] = &[
    "alertname",
    "namespace",
    "queue",
    "deadletter",
    "job",
    "failure_kind",
    "severity",
    "service_version",
];
/// Longest annotation value we send (the reason and intent come from producers).
const MAX_ANNOTATION: usize = 1024;

impl AlertSettings {
    pub fn enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }

    /// Whether parked records alert one by one (else per failure group).
    pub fn per_record(&self) -> bool {
        self.per == Some(AlertPer::Record)
    }

    pub fn severity(&self, kind: FailureKind) -> &str {
        let s = self.severity.as_ref();
        match kind {
            FailureKind::Invalid => s.and_then(|s| s.invalid.as_deref()),
            FailureKind::Transient => s.and_then(|s| s.transient.as_deref()),
        }
        .unwrap_or(DEFAULT_SEVERITY)
    }
}

/// One alert, in Alertmanager's v2 `postableAlert` form.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Alert {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
}

/// An alert a record currently raises, before its `endsAt` is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Current {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub starts_at: Timestamp,
}

impl Current {
    /// Firing, kept so until `now + lease` unless resent.
    pub fn firing(&self, now: Timestamp, lease: SignedDuration) -> Alert {
        self.with_end(now.checked_add(lease).unwrap_or(now))
    }

    /// Resolved at `now`.
    pub fn resolved(&self, now: Timestamp) -> Alert {
        self.with_end(now.max(self.starts_at))
    }

    fn with_end(&self, ends_at: Timestamp) -> Alert {
        Alert {
            labels: self.labels.clone(),
            annotations: self.annotations.clone(),
            starts_at: self.starts_at,
            ends_at,
        }
    }
}

/// Operator-wide alert settings.
#[derive(Clone, Debug, Default)]
pub struct Links {
    /// `runbook_url` is this + `#alert-<alertname in lower case>`.
    pub runbook_base_url: String,
}

/// The alerts `record` raises now: none unless Parked (or when its queue turned alerts off);
/// `DeadLetterParked`, plus `DeadLetterRequeueFailing` while `Requeued=False`.
pub fn current(
    record: &DeadLetter,
    queue: Option<&DeadLetterQueue>,
    links: &Links,
) -> Vec<Current> {
    let default = AlertSettings::default();
    let settings = queue
        .and_then(|q| q.spec.alerts.as_ref())
        .unwrap_or(&default);
    if !settings.enabled() || record.phase() != Phase::Parked || !record_has_identity(record) {
        return Vec::new();
    }
    let mut out = vec![parked(record, settings, links)];
    if let Some(msg) = requeue_failure(record) {
        out.push(requeue_failing(record, settings, links, msg));
    }
    out
}

fn record_has_identity(record: &DeadLetter) -> bool {
    record.metadata.name.is_some() && record.metadata.creation_timestamp.is_some()
}

/// The message of a `Requeued=False` condition.
fn requeue_failure(record: &DeadLetter) -> Option<&str> {
    record
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == REQUEUED && c.status == "False")
        .map(|c| c.message.as_str())
}

/// The identifying labels shared by both alerts of a record.
fn labels(
    record: &DeadLetter,
    settings: &AlertSettings,
    alertname: &str,
) -> BTreeMap<String, String> {
    let mut l: BTreeMap<String, String> = settings
        .labels
        .iter()
        .filter(|(k, _)| !RESERVED_LABELS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let spec = &record.spec;
    let mut set = |k: &str, v: &str| l.insert(k.to_string(), v.to_string());
    set("alertname", alertname);
    set(
        "namespace",
        record.metadata.namespace.as_deref().unwrap_or_default(),
    );
    set("queue", &spec.queue);
    set(
        "deadletter",
        record.metadata.name.as_deref().unwrap_or_default(),
    );
    set("job", &spec.job.id);
    set("failure_kind", spec.failure_kind.label());
    set("severity", settings.severity(spec.failure_kind));
    if let Some(v) = spec.service_version.as_deref().filter(|v| !v.is_empty()) {
        set("service_version", v);
    }
    l
}

fn parked_at(record: &DeadLetter) -> Timestamp {
    record
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or_default()
}

fn annotations(
    record: &DeadLetter,
    links: &Links,
    alertname: &str,
    summary: String,
) -> BTreeMap<String, String> {
    let spec = &record.spec;
    let ns = record.metadata.namespace.as_deref().unwrap_or_default();
    let intent = spec
        .intent
        .as_ref()
        .map_or("none".to_string(), |i| format!("{} was {}", i.id, i.state));
    let description = format!(
        "{} deliveries in cycle {} on queue {ns}/{}; intent snapshot: {intent}; {} failure ({})",
        spec.deliveries,
        spec.cycle,
        spec.queue,
        spec.failure_kind.label(),
        truncate(&spec.reason),
    );
    let mut a = BTreeMap::new();
    a.insert("summary".into(), truncate(&summary));
    a.insert("description".into(), truncate(&description));
    a.insert(
        "runbook_url".into(),
        format!(
            "{}#alert-{}",
            links.runbook_base_url.trim_end_matches('/'),
            alertname.to_lowercase()
        ),
    );
    a.insert("command".into(), show_command(ns, &spec.job.id));
    a
}

/// The command that shows the record, quoted for a POSIX shell when needed.
pub fn show_command(namespace: &str, job: &str) -> String {
    let plain = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./:@=+,".contains(c))
    };
    let quote = |s: &str| {
        if plain(s) {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', r"'\''"))
        }
    };
    format!("kubectl dlq show -n {} {}", quote(namespace), quote(job))
}

fn parked(record: &DeadLetter, settings: &AlertSettings, links: &Links) -> Current {
    let spec = &record.spec;
    let summary = format!("{} parked on {}: {}", spec.job.id, spec.queue, spec.reason);
    Current {
        labels: labels(record, settings, PARKED),
        annotations: annotations(record, links, PARKED, summary),
        starts_at: parked_at(record),
    }
}

fn requeue_failing(
    record: &DeadLetter,
    settings: &AlertSettings,
    links: &Links,
    error: &str,
) -> Current {
    let spec = &record.spec;
    let summary = format!(
        "redrive of {} to {} keeps failing: {error}",
        spec.job.id, spec.queue
    );
    Current {
        labels: labels(record, settings, REQUEUE_FAILING),
        annotations: annotations(record, links, REQUEUE_FAILING, summary),
        starts_at: parked_at(record),
    }
}

/// The alert a failure group raises now: none unless it has Parked records, no acknowledgement
/// silences it, and its queue alerts per group. Labels: namespace, queue, group, failure kind,
/// service version, tier (and `severity`, the tier); annotations: count, template, samples,
/// runbook. `startsAt` is the group's first seen, so a resend never moves it.
pub fn group_alert(
    group: &crate::groups::DeadLetterGroup,
    queue: Option<&DeadLetterQueue>,
    links: &Links,
) -> Option<Current> {
    let default = AlertSettings::default();
    let settings = queue
        .and_then(|q| q.spec.alerts.as_ref())
        .unwrap_or(&default);
    let status = group.status.as_ref()?;
    if !settings.enabled() || settings.per_record() || status.parked == 0 || status.silenced {
        return None;
    }
    let meta = &group.metadata;
    let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
    let (queue_name, fingerprint) = (
        label(crate::dead_letter::LABEL_QUEUE)?,
        label(crate::group::LABEL_GROUP)?,
    );
    let ns = meta.namespace.clone().unwrap_or_default();
    let mut l: BTreeMap<String, String> = settings
        .labels
        .iter()
        .filter(|(k, _)| !RESERVED_LABELS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut set = |k: &str, v: &str| l.insert(k.to_string(), v.to_string());
    set("alertname", GROUP_PARKED);
    set("namespace", &ns);
    set("queue", &queue_name);
    set("group", &fingerprint);
    set("tier", status.tier.as_str());
    set("severity", status.tier.as_str());
    if let Some(k) = status.failure_kind {
        set("failure_kind", k.label());
    }
    if let Some(v) = status.service_version.as_deref().filter(|v| !v.is_empty()) {
        set("service_version", v);
    }
    let mut a = BTreeMap::new();
    // A storm's real size: what still waits in the broker beyond the records, when the queue
    // has a source that can say.
    let waiting = status
        .backlog
        .as_ref()
        .map(|b| format!(", {} waiting in the broker", b.shown()))
        .unwrap_or_default();
    a.insert(
        "summary".into(),
        truncate(&format!(
            "{} parked on {queue_name}{waiting} ({}): {}",
            status.parked,
            status.tier.as_str(),
            status.template
        )),
    );
    a.insert("count".into(), status.parked.to_string());
    if let Some(b) = &status.backlog {
        a.insert("waiting".into(), b.shown());
    }
    a.insert("template".into(), truncate(&status.template));
    a.insert("samples".into(), truncate(&status.samples.join(", ")));
    a.insert(
        "runbook_url".into(),
        format!(
            "{}#alert-{}",
            links.runbook_base_url.trim_end_matches('/'),
            GROUP_PARKED.to_lowercase()
        ),
    );
    a.insert(
        "command".into(),
        format!("kubectl dlq groups -n {ns} --queue {queue_name}"),
    );
    Some(Current {
        labels: l,
        annotations: a,
        starts_at: status.first_seen.as_ref().map(|t| t.0).unwrap_or_default(),
    })
}

fn truncate(s: &str) -> String {
    if s.len() <= MAX_ANNOTATION {
        return s.to_string();
    }
    let mut end = MAX_ANNOTATION;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{DeadLetterQueueSpec, Severities};
    use crate::testing::{RecordBuilder, at};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn record(phase: Phase) -> DeadLetter {
        RecordBuilder::job("pi_0003/settle")
            .named("pi-0003-settle-5d41402a-1")
            .intent("pi_0003", "created")
            .service_version("relayer@1.4.2")
            .failed_at(at(100))
            .created(at(1000))
            .phase(phase)
            .build()
    }

    fn queue(alerts: AlertSettings) -> DeadLetterQueue {
        DeadLetterQueue::new(
            "relayer",
            DeadLetterQueueSpec {
                alerts: Some(alerts),
                ..DeadLetterQueueSpec::default()
            },
        )
    }

    fn links() -> Links {
        Links {
            runbook_base_url: "https://example.org/dlq/".into(),
        }
    }

    #[test]
    fn a_parked_record_raises_one_alert_labelled_for_routing() {
        let mut settings = AlertSettings::default();
        settings.labels.insert("team".into(), "payments".into());
        settings.labels.insert("job".into(), "ignored".into());
        settings.severity = Some(Severities {
            transient: Some("page".into()),
            invalid: None,
        });
        let q = queue(settings);
        let alerts = current(&record(Phase::Parked), Some(&q), &links());
        assert_eq!(alerts.len(), 1);
        let a = &alerts[0];
        let l = |k: &str| a.labels.get(k).map(String::as_str);
        assert_eq!(l("alertname"), Some(PARKED));
        assert_eq!(l("namespace"), Some("payments"));
        assert_eq!(l("queue"), Some("relayer"));
        assert_eq!(l("deadletter"), Some("pi-0003-settle-5d41402a-1"));
        assert_eq!(l("job"), Some("pi_0003/settle"));
        assert_eq!(l("failure_kind"), Some("transient"));
        assert_eq!(l("severity"), Some("page"));
        assert_eq!(l("service_version"), Some("relayer@1.4.2"));
        assert_eq!(l("team"), Some("payments"));
        assert_eq!(a.starts_at, at(1000), "startsAt is when it was parked");
        assert_eq!(
            a.annotations["command"],
            "kubectl dlq show -n payments pi_0003/settle"
        );
        assert_eq!(
            a.annotations["runbook_url"],
            "https://example.org/dlq#alert-deadletterparked"
        );
        assert!(a.annotations["summary"].contains("pi_0003/settle"));
        assert!(a.annotations["description"].contains("pi_0003 was created"));
    }

    #[test]
    fn a_group_raises_one_alert_until_acknowledged_or_empty() {
        use crate::groups::{AcknowledgedAt, DeadLetterGroupStatus, Tier, group_object};
        let status = DeadLetterGroupStatus {
            template: "timeout after <n> ms".into(),
            failure_kind: Some(FailureKind::Transient),
            service_version: Some("relayer@1.4.2".into()),
            parked: 312,
            tier: Tier::Critical,
            first_seen: Some(Time(at(1000))),
            samples: vec!["a-1".into(), "b-1".into()],
            ..Default::default()
        };
        let mut settings = AlertSettings::default();
        settings.labels.insert("team".into(), "payments".into());
        let mut q = queue(settings.clone());
        q.metadata.namespace = Some("payments".into());
        let g = group_object(&q, "3f9a1c07d2", status.clone());
        let a = group_alert(&g, Some(&q), &links()).expect("an alert");
        let l = |k: &str| a.labels.get(k).map(String::as_str);
        assert_eq!(l("alertname"), Some(GROUP_PARKED));
        assert_eq!(
            (l("namespace"), l("queue"), l("group")),
            (Some("payments"), Some("relayer"), Some("3f9a1c07d2"))
        );
        assert_eq!(
            (
                l("tier"),
                l("failure_kind"),
                l("service_version"),
                l("team")
            ),
            (
                Some("critical"),
                Some("transient"),
                Some("relayer@1.4.2"),
                Some("payments")
            )
        );
        assert_eq!(a.annotations["count"], "312");
        assert_eq!(
            a.annotations["summary"],
            "312 parked on relayer (critical): timeout after <n> ms"
        );
        assert!(
            !a.annotations.contains_key("waiting"),
            "no backlog, no line"
        );
        assert_eq!(a.annotations["template"], "timeout after <n> ms");
        assert_eq!(a.annotations["samples"], "a-1, b-1");
        assert!(a.annotations["runbook_url"].ends_with("#alert-deadlettergroupparked"));
        assert_eq!(a.starts_at, at(1000));
        let silenced = group_object(
            &q,
            "3f9a1c07d2",
            DeadLetterGroupStatus {
                acknowledgement: Some(AcknowledgedAt::default()),
                silenced: true,
                ..status.clone()
            },
        );
        assert_eq!(group_alert(&silenced, Some(&q), &links()), None);
        let empty = group_object(
            &q,
            "3f9a1c07d2",
            DeadLetterGroupStatus {
                parked: 0,
                ..status.clone()
            },
        );
        assert_eq!(
            group_alert(&empty, Some(&q), &links()),
            None,
            "resolved when nothing is parked"
        );
        settings.per = Some(AlertPer::Record);
        let per_record = queue(settings);
        assert_eq!(group_alert(&g, Some(&per_record), &links()), None);
    }

    #[test]
    fn a_storms_group_alert_says_what_waits_in_the_broker() {
        use crate::groups::{DeadLetterGroupStatus, GroupBacklog, Tier, group_object};
        let mut q = queue(AlertSettings::default());
        q.metadata.namespace = Some("payments".into());
        let status = |messages| DeadLetterGroupStatus {
            template: "timeout talking to payer".into(),
            parked: 5_000,
            tier: Tier::Critical,
            backlog: Some(GroupBacklog { messages }),
            ..Default::default()
        };
        let g = group_object(&q, "3f9a1c07d2", status(Some(175_000)));
        let a = group_alert(&g, Some(&q), &links()).expect("an alert");
        assert_eq!(
            a.annotations["summary"],
            "5000 parked on relayer, ~175,000 waiting in the broker (critical): timeout talking to payer"
        );
        assert_eq!(a.annotations["waiting"], "~175,000");
        assert_eq!(a.annotations["count"], "5000");
        let g = group_object(&q, "3f9a1c07d2", status(None));
        let a = group_alert(&g, Some(&q), &links()).expect("an alert");
        assert_eq!(a.annotations["waiting"], "unknown", "never 0");
    }

    #[test]
    fn resolved_or_disabled_records_raise_nothing() {
        for phase in [Phase::Redriven, Phase::Dropped] {
            assert!(current(&record(phase), None, &links()).is_empty());
        }
        let off = queue(AlertSettings {
            enabled: Some(false),
            ..AlertSettings::default()
        });
        assert!(current(&record(Phase::Parked), Some(&off), &links()).is_empty());
        let defaults = current(&record(Phase::Parked), None, &links());
        assert_eq!(defaults[0].labels["severity"], DEFAULT_SEVERITY);
    }

    #[test]
    fn a_failing_requeue_raises_a_second_alert_until_it_succeeds() {
        let mut dl = record(Phase::Parked);
        dl.status.as_mut().unwrap().conditions.push(Condition {
            type_: REQUEUED.into(),
            status: "False".into(),
            reason: "Unreachable".into(),
            message: "connection refused".into(),
            last_transition_time: Time(at(1100)),
            observed_generation: None,
        });
        let alerts = current(&dl, None, &links());
        let names: Vec<_> = alerts
            .iter()
            .map(|a| a.labels["alertname"].clone())
            .collect();
        assert_eq!(names, vec![PARKED, REQUEUE_FAILING]);
        assert!(alerts[1].annotations["summary"].contains("connection refused"));
        dl.status.as_mut().unwrap().conditions[0].status = "True".into();
        assert_eq!(current(&dl, None, &links()).len(), 1);
    }

    #[test]
    fn firing_ends_after_the_lease_and_resolution_ends_now() {
        let a = &current(&record(Phase::Parked), None, &links())[0];
        let f = a.firing(at(2000), SignedDuration::from_secs(240));
        assert_eq!((f.starts_at, f.ends_at), (at(1000), at(2240)));
        let r = a.resolved(at(2000));
        assert_eq!((r.starts_at, r.ends_at), (at(1000), at(2000)));
        let json = serde_json::to_value(&f).unwrap();
        assert_eq!(json["startsAt"], "1970-01-01T00:16:40Z");
        assert_eq!(json["endsAt"], "1970-01-01T00:37:20Z");
        assert_eq!(json["labels"]["alertname"], PARKED);
    }

    #[test]
    fn the_show_command_is_quoted_for_a_shell() {
        assert_eq!(
            show_command("ns", "a b'c"),
            r"kubectl dlq show -n ns 'a b'\''c'"
        );
    }
}
