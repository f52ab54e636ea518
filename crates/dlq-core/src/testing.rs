//! Records as tests build them (feature `testing`, enabled by the workspace's dev-dependencies;
//! never in a release build): one builder with the defaults of a parked job instead of a
//! near-identical fixture in every test module, so a new field of the API is set in one place.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::dead_letter::{
    Action, DeadLetter, DeadLetterStatus, FailureKind, IntentSnapshot, Job, Origin, Phase,
};
use crate::park::{ParkRequest, new_record};

/// The namespace a [`RecordBuilder`] puts its record in unless told otherwise.
pub const NAMESPACE: &str = "payments";
/// The queue a [`RecordBuilder`] parks its job on unless told otherwise.
pub const QUEUE: &str = "relayer";

/// `secs` after the Unix epoch, for fixed times in tests.
pub fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(secs).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// A [`DeadLetter`] as a parker creates it ([`new_record`]: named after its job and cycle,
/// labelled with queue, failure kind and job key), then whatever a test sets on top.
///
/// Defaults: job `id` of queue `relayer` in namespace `payments`, cycle 1, payload `{}`,
/// 3 deliveries, reason `no luck`, Transient, failed at the Unix epoch, generation 1, no
/// uid, resourceVersion, decision or status.
#[derive(Clone, Debug)]
#[must_use]
pub struct RecordBuilder {
    req: ParkRequest,
    cycle: i32,
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    generation: Option<i64>,
    created: Option<Timestamp>,
    action: Option<Action>,
    by: Option<String>,
    note: Option<String>,
    status: Option<DeadLetterStatus>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

impl RecordBuilder {
    /// The record of job `id`.
    pub fn job(id: &str) -> Self {
        let mut req = ParkRequest::new(
            QUEUE,
            Job {
                id: id.into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
        );
        req.deliveries = 3;
        req.reason = "no luck".into();
        req.failed_at = Some(Timestamp::UNIX_EPOCH);
        RecordBuilder {
            req,
            cycle: 1,
            name: None,
            namespace: Some(NAMESPACE.into()),
            uid: None,
            resource_version: None,
            generation: Some(1),
            created: None,
            action: None,
            by: None,
            note: None,
            status: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
        }
    }

    /// A name of the test's choosing instead of the parker's (`park::record_name`).
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }

    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    pub fn queue(mut self, queue: &str) -> Self {
        self.req.queue = queue.into();
        self
    }

    pub fn cycle(mut self, cycle: i32) -> Self {
        self.cycle = cycle;
        self
    }

    /// The job's bytes: `payload` when they are UTF-8, else `payloadBase64` (as parkers do).
    pub fn payload(mut self, bytes: impl AsRef<[u8]>) -> Self {
        let parsed = Job::from_bytes(self.req.job.id.clone(), bytes.as_ref());
        self.req.job.payload = parsed.payload;
        self.req.job.payload_base64 = parsed.payload_base64;
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.req.job.headers.insert(name.into(), value.into());
        self
    }

    pub fn headers(self, headers: &[(&str, &str)]) -> Self {
        headers.iter().fold(self, |b, (k, v)| b.header(k, v))
    }

    pub fn origin(mut self, origin: Origin) -> Self {
        self.req.job.origin = Some(Box::new(origin));
        self
    }

    pub fn deliveries(mut self, deliveries: i32) -> Self {
        self.req.deliveries = deliveries;
        self
    }

    pub fn reason(mut self, reason: &str) -> Self {
        self.req.reason = reason.into();
        self
    }

    pub fn failure_kind(mut self, kind: FailureKind) -> Self {
        self.req.failure_kind = kind;
        self
    }

    pub fn intent(mut self, id: &str, state: &str) -> Self {
        self.req.intent = Some(IntentSnapshot {
            id: id.into(),
            state: state.into(),
        });
        self
    }

    pub fn service_version(mut self, version: &str) -> Self {
        self.req.service_version = Some(version.into());
        self
    }

    pub fn error_class(mut self, class: &str) -> Self {
        self.req.error_class = Some(class.into());
        self
    }

    pub fn failed_at(mut self, at: Timestamp) -> Self {
        self.req.failed_at = Some(at);
        self
    }

    /// The broker's identity of the dead message (`dlq.dev/source-message`).
    pub fn message(mut self, message: &str) -> Self {
        self.req = self.req.with_message(message);
        self
    }

    pub fn uid(mut self, uid: &str) -> Self {
        self.uid = Some(uid.into());
        self
    }

    pub fn resource_version(mut self, version: &str) -> Self {
        self.resource_version = Some(version.into());
        self
    }

    pub fn generation(mut self, generation: i64) -> Self {
        self.generation = Some(generation);
        self
    }

    /// When the apiserver stored it (`creationTimestamp`).
    pub fn created(mut self, at: Timestamp) -> Self {
        self.created = Some(at);
        self
    }

    /// A signed decision.
    pub fn decided(mut self, action: Action, by: &str) -> Self {
        self.action = Some(action);
        self.by = Some(by.into());
        self
    }

    pub fn note(mut self, note: &str) -> Self {
        self.note = Some(note.into());
        self
    }

    /// Marked by the operator and now in `phase`.
    pub fn phase(self, phase: Phase) -> Self {
        self.status(DeadLetterStatus {
            phase: Some(phase),
            ..DeadLetterStatus::default()
        })
    }

    /// Resolved as `phase` at `at`.
    pub fn resolved(self, phase: Phase, by: &str, at: Timestamp) -> Self {
        self.status(DeadLetterStatus {
            phase: Some(phase),
            resolved_by: Some(by.into()),
            resolved_at: Some(Time(at)),
            ..DeadLetterStatus::default()
        })
    }

    pub fn status(mut self, status: DeadLetterStatus) -> Self {
        self.status = Some(status);
        self
    }

    pub fn label(mut self, name: &str, value: &str) -> Self {
        self.labels.insert(name.into(), value.into());
        self
    }

    pub fn annotation(mut self, name: &str, value: &str) -> Self {
        self.annotations.insert(name.into(), value.into());
        self
    }

    pub fn build(self) -> DeadLetter {
        let mut r = new_record(&self.req, self.cycle);
        if let Some(name) = self.name {
            r.metadata.name = Some(name);
        }
        r.metadata.namespace = self.namespace;
        r.metadata.uid = self.uid;
        r.metadata.resource_version = self.resource_version;
        r.metadata.generation = self.generation;
        r.metadata.creation_timestamp = self.created.map(Time);
        if !self.labels.is_empty() {
            r.metadata
                .labels
                .get_or_insert_default()
                .extend(self.labels);
        }
        if !self.annotations.is_empty() {
            r.metadata
                .annotations
                .get_or_insert_default()
                .extend(self.annotations);
        }
        r.spec.action = self.action;
        r.spec.by = self.by;
        r.spec.note = self.note;
        r.status = self.status;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::{ANNOTATION_SOURCE_MESSAGE, LABEL_JOB_KEY, LABEL_QUEUE};
    use crate::park::{job_key, record_name};

    #[test]
    fn the_defaults_are_a_parkers_record_and_every_setting_lands() {
        let plain = RecordBuilder::job("pi_0003/settle").build();
        assert_eq!(
            plain.metadata.name.as_deref(),
            Some(record_name(QUEUE, "pi_0003/settle", 1).as_str())
        );
        assert_eq!(plain.metadata.namespace.as_deref(), Some(NAMESPACE));
        let labels = plain.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[LABEL_QUEUE], QUEUE);
        assert_eq!(labels[LABEL_JOB_KEY], job_key(QUEUE, "pi_0003/settle"));
        assert_eq!(plain.spec.job.payload.as_deref(), Some("{}"));
        assert_eq!(
            (plain.spec.deliveries, plain.spec.reason.as_str()),
            (3, "no luck")
        );
        assert_eq!(plain.spec.failed_at, Time(Timestamp::UNIX_EPOCH));
        assert_eq!(plain.status, None);

        let r = RecordBuilder::job("a")
            .named("a-1")
            .queue("mailer")
            .cycle(2)
            .payload(b"\xff\x00")
            .header("x-trace", "abc")
            .message("m-1")
            .uid("u")
            .resource_version("7")
            .created(at(5))
            .decided(Action::Drop, "ops")
            .resolved(Phase::Dropped, "ops", at(9))
            .label("l", "v")
            .annotation("a", "b")
            .build();
        assert_eq!(r.metadata.name.as_deref(), Some("a-1"));
        assert_eq!((r.spec.queue.as_str(), r.spec.cycle), ("mailer", 2));
        assert_eq!(r.spec.job.payload, None);
        assert_eq!(
            r.spec.job.payload_bytes().ok().as_deref(),
            Some(&b"\xff\x00"[..])
        );
        assert_eq!(r.spec.job.headers["x-trace"], "abc");
        let annotations = r.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations[ANNOTATION_SOURCE_MESSAGE], "m-1");
        assert_eq!(annotations["a"], "b");
        assert_eq!(r.metadata.labels.clone().unwrap_or_default()["l"], "v");
        assert_eq!(
            (
                r.metadata.uid.as_deref(),
                r.metadata.resource_version.as_deref()
            ),
            (Some("u"), Some("7"))
        );
        assert_eq!(r.metadata.creation_timestamp, Some(Time(at(5))));
        assert_eq!(
            (r.spec.action, r.spec.by.as_deref()),
            (Some(Action::Drop), Some("ops"))
        );
        assert_eq!(r.phase(), Phase::Dropped);
        assert_eq!(r.status.and_then(|s| s.resolved_at), Some(Time(at(9))));
    }
}
