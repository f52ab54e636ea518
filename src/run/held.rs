//! The form a record takes when the operator holds it whole: in the records controller's store
//! (only records with something to do: see [`super::feeder`]) and the decided records' store.
//! Everything else reads the record index's summaries ([`crate::state::records`]).
//!
//! What is dropped is never written back: every write to a record is a merge patch of the
//! fields it changes (see [`crate::state::apiserver`]), so the held copy never replaces the stored
//! one. A reconciler that needs a dropped field reads the record (see
//! [`crate::reconcile::record`]).

use std::collections::BTreeMap;

use dlq_core::api::{ANNOTATION_SLOT_BLOCK, ANNOTATION_SOURCE_MESSAGE, DeadLetter, Phase};
use dlq_core::replay::{ANNOTATION_REPLAY_UID, LABEL_REPLAY};

/// Payloads up to this size stay held while their decision waits to be carried out, so
/// redriving a small job needs no extra read.
pub const HELD_PAYLOAD_MAX: usize = 1024;

/// The only label a held record keeps: the replay that signed it (`replay::decided_by`). The
/// job key and source message are read by the job index before the store strips them.
const KEPT_LABELS: [&str; 1] = [LABEL_REPLAY];
/// The only annotations a held record keeps: the signing replay's uid, and the block of slots
/// the queue counter reckons (`reconcile::queue`).
const KEPT_ANNOTATIONS: [&str; 2] = [ANNOTATION_REPLAY_UID, ANNOTATION_SLOT_BLOCK];
/// And once it has a decision, the source message it was parked from: its
/// redrive's idempotency key is that message's (`dlq_core::decide::redrive_key`).
const KEPT_ANNOTATIONS_WITH_WORK: [&str; 3] = [
    ANNOTATION_REPLAY_UID,
    ANNOTATION_SLOT_BLOCK,
    ANNOTATION_SOURCE_MESSAGE,
];

/// Drops what the reconcilers never read from a held record:
/// - the job's bytes (payload and headers) unless [`keeps_job_bytes`];
/// - managed fields (the whole list, 0.7 KiB a record), but an empty stand-in while the record
///   needs its mark, which they tell ([`dlq_core::decide::managed_fields_kept`]);
/// - labels and annotations but [`KEPT_LABELS`] and [`KEPT_ANNOTATIONS`] (each map is a
///   0.5 KiB tree node however few entries it holds; kubectl's last-applied copy would hold
///   the payload again);
/// - the conditions of a record with nothing to do (waiting for a decision, or resolved) but
///   a failing one (status False, which alerts read): conditions are read only to write the
///   next status, which only a record with work gets (0.2 KiB a record);
/// - the spare room of the conditions list (a list deserialised from JSON grows to four
///   entries, 0.4 KiB more than the one a parked record has).
///
/// A record that is decided later arrives again, whole, in the watch event that carries the
/// decision; one whose bytes were dropped is read when acting.
pub fn strip(dl: &mut DeadLetter) {
    if !keeps_job_bytes(dl) {
        dl.spec.job.payload = None;
        dl.spec.job.payload_base64 = None;
        dl.spec.job.headers = Default::default();
        dl.spec.job.sealed = None;
        // A stored body's reference goes with the bytes: a held record with one and no
        // headers would otherwise read as whole (`Job::has_payload`).
        dl.spec.job.body = None;
    }
    let decided = dl.spec.action.is_some();
    let needs_mark = dlq_core::decide::needs_mark(dl);
    let meta = &mut dl.metadata;
    meta.managed_fields = dlq_core::decide::managed_fields_kept(needs_mark);
    meta.labels = keep(meta.labels.take(), &KEPT_LABELS);
    let kept: &[&str] = if decided {
        &KEPT_ANNOTATIONS_WITH_WORK
    } else {
        &KEPT_ANNOTATIONS
    };
    meta.annotations = keep(meta.annotations.take(), kept);
    let has_work = dlq_core::decide::has_work(dl);
    if let Some(status) = dl.status.as_mut() {
        if !has_work {
            status.conditions.retain(|c| c.status == "False");
        }
        status.conditions.shrink_to_fit();
    }
}

/// `map` with only the `kept` keys, or None when none is there (no tree node allocated).
fn keep(map: Option<BTreeMap<String, String>>, kept: &[&str]) -> Option<BTreeMap<String, String>> {
    let mut map = map?;
    map.retain(|k, _| kept.contains(&k.as_str()));
    (!map.is_empty()).then_some(map)
}

/// Whether a held record keeps its job's bytes: only a small job whose decision waits to be
/// carried out. The many records parked without a decision, or resolved and kept as history,
/// cost the store their metadata only (100,000 records of 1 KiB held 605 MiB with every small
/// payload kept).
fn keeps_job_bytes(dl: &DeadLetter) -> bool {
    let job = &dl.spec.job;
    let size = job.payload.as_ref().map_or(0, String::len)
        + job.payload_base64.as_ref().map_or(0, |b| b.len() / 4 * 3)
        + job.sealed.as_deref().map_or(0, dlq_core::seal::content_len);
    dl.spec.action.is_some() && dl.phase() == Phase::Parked && size <= HELD_PAYLOAD_MAX
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::{Job, LABEL_JOB_KEY, LABEL_QUEUE};
    use dlq_core::park::{ParkRequest, new_record};
    use dlq_core::replay::{ReplayRef, decided_by};
    use kube::ResourceExt;

    fn parked() -> DeadLetter {
        let mut req = ParkRequest::new(
            "relayer",
            Job {
                id: "order-1".into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
        );
        req.message = Some("amqp/relayer.dead/7".into());
        let mut r = new_record(&req, 1);
        r.annotations_mut()
            .insert(ANNOTATION_SLOT_BLOCK.into(), "b-1".into());
        r.annotations_mut().insert(
            "kubectl.kubernetes.io/last-applied-configuration".into(),
            "{\"spec\":{\"job\":{\"payload\":\"secret\"}}}".into(),
        );
        r
    }

    /// What tells a record that needs its mark survives the strip, and nothing more of it.
    #[test]
    fn a_record_that_needs_its_mark_still_does_once_stripped() {
        let mut r = parked();
        r.metadata.managed_fields = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                manager: Some("dlq-parker".into()),
                fields_v1: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1(
                    serde_json::json!({"f:spec": {"f:job": {}}}),
                )),
                ..Default::default()
            },
        ]);
        assert!(dlq_core::decide::needs_mark(&r));
        let mut marked = r.clone();
        strip(&mut r);
        assert!(dlq_core::decide::needs_mark(&r));
        assert_eq!(
            r.metadata.managed_fields,
            dlq_core::decide::managed_fields_kept(true),
            "the fields themselves are dropped"
        );
        marked.metadata.managed_fields = Some(Vec::new());
        strip(&mut marked);
        assert_eq!(marked.metadata.managed_fields, None);
        assert!(!dlq_core::decide::has_work(&marked));
    }

    #[test]
    fn a_parked_record_keeps_no_label_and_only_its_slot_block() {
        let mut r = parked();
        assert!(r.labels().contains_key(LABEL_QUEUE));
        strip(&mut r);
        assert_eq!(
            r.metadata.labels, None,
            "no tree node for labels nobody reads"
        );
        let annotations: Vec<&String> = r.annotations().keys().collect();
        assert_eq!(annotations, [ANNOTATION_SLOT_BLOCK]);
    }

    /// Issue 47: a decided record parked from a dead message keeps that message's identity, so
    /// its redrive carries the message's key (the key a pass-through of it carried); without a
    /// decision it costs no annotation.
    #[test]
    fn a_decided_record_keeps_its_source_message_for_its_redrive_key() {
        let mut r = parked();
        r.annotations_mut()
            .insert(ANNOTATION_SOURCE_MESSAGE.into(), "storm:dead#7".into());
        r.metadata.uid = Some("u-9".into());
        let mut undecided = r.clone();
        strip(&mut undecided);
        assert!(
            !undecided
                .annotations()
                .contains_key(ANNOTATION_SOURCE_MESSAGE)
        );
        r.spec.action = Some(dlq_core::api::Action::Redrive);
        r.spec.by = Some("ops".into());
        let key = dlq_core::decide::redrive_key(&r);
        assert!(key.starts_with("msg-"), "{key}");
        strip(&mut r);
        assert_eq!(dlq_core::decide::redrive_key(&r), key);
    }

    #[test]
    fn a_record_a_replay_signed_is_still_known_as_its_after_stripping() {
        let mut r = parked();
        r.labels_mut().insert(LABEL_REPLAY.into(), "nightly".into());
        r.annotations_mut()
            .insert(ANNOTATION_REPLAY_UID.into(), "u-1".into());
        let replay = ReplayRef {
            name: "nightly",
            uid: "u-1",
        };
        assert!(decided_by(&r, replay));
        strip(&mut r);
        assert!(decided_by(&r, replay));
        assert!(!r.labels().contains_key(LABEL_JOB_KEY));
    }

    /// Conditions as the watch brings them (a list of unknown length grows in steps).
    fn with_conditions(r: &mut DeadLetter, conditions: &[(&str, &str)]) {
        let list: Vec<serde_json::Value> = conditions
            .iter()
            .map(|(type_, status)| {
                serde_json::json!({"type": type_, "status": status, "reason": "R",
                    "message": "m", "lastTransitionTime": "2026-12-01T10:00:00Z"})
            })
            .collect();
        let json = serde_json::json!({"phase": "Parked", "conditions": list});
        r.status = serde_json::from_value(json).ok();
    }

    fn kept_conditions(r: DeadLetter) -> Vec<String> {
        let status = r.status.unwrap_or_default();
        status.conditions.into_iter().map(|c| c.type_).collect()
    }

    #[test]
    fn a_record_waiting_for_a_decision_keeps_only_a_failing_condition() {
        let mut r = parked();
        with_conditions(&mut r, &[("Ready", "True")]);
        strip(&mut r);
        assert!(kept_conditions(r).is_empty());

        let mut r = parked();
        with_conditions(&mut r, &[("Ready", "True"), ("Requeued", "False")]);
        strip(&mut r);
        assert_eq!(kept_conditions(r), ["Requeued"]);
    }

    #[test]
    fn a_decided_record_keeps_every_condition_for_its_next_status_write() {
        let mut r = parked();
        r.spec.action = Some(dlq_core::api::Action::Redrive);
        r.spec.by = Some("ops".into());
        with_conditions(&mut r, &[("Ready", "True"), ("Requeued", "False")]);
        strip(&mut r);
        assert_eq!(kept_conditions(r), ["Ready", "Requeued"]);
    }

    #[test]
    fn the_conditions_list_holds_no_spare_room() {
        let mut r = parked();
        r.spec.action = Some(dlq_core::api::Action::Drop);
        r.spec.by = Some("ops".into());
        // Read from text, as the watch does: a list of unknown length grows in steps.
        let json = r#"{"phase": "Parked", "conditions": [{"type": "Parked", "status": "True",
            "reason": "Parked", "message": "waiting", "lastTransitionTime": "2026-12-01T10:00:00Z"}]}"#;
        r.status = serde_json::from_str(json).ok();
        assert!(
            r.status
                .as_ref()
                .is_some_and(|s| s.conditions.capacity() > 1)
        );
        strip(&mut r);
        let conditions = r.status.map(|s| s.conditions).unwrap_or_default();
        assert_eq!((conditions.len(), conditions.capacity()), (1, 1));
    }
}
