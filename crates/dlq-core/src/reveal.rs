//! The reveal API as data: `deadletterpayloads.payloads.dlq.dev`, one read-only object per
//! record holding its job's opened payload and headers. The operator serves it behind the
//! apiserver (an aggregated API), so every reveal is authenticated by the apiserver, authorized
//! twice (the apiserver's RBAC and the operator's SubjectAccessReview), written to the
//! apiserver's audit log and announced by a `PayloadRevealed` Event.
//!
//! Two views: the resource itself shows card numbers and the queue's `maskPaths` masked (what a
//! person needs to diagnose); its `unmasked` subresource shows the exact bytes, so RBAC can
//! grant the two separately.

use base64::Engine;
use serde_json::{Value, json};

use crate::dead_letter::{DeadLetter, Job};
use crate::events::{EventPlan, action, reason};
use crate::mask;

pub const GROUP: &str = "payloads.dlq.dev";
pub const VERSION: &str = "v1alpha1";
pub const GROUP_VERSION: &str = "payloads.dlq.dev/v1alpha1";
pub const RESOURCE: &str = "deadletterpayloads";
pub const KIND: &str = "DeadLetterPayload";
/// The subresource showing the exact bytes.
pub const UNMASKED: &str = "unmasked";

/// Which view of a payload a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    Masked,
    Unmasked,
}

impl View {
    /// The subresource a SubjectAccessReview names for this view.
    pub fn subresource(self) -> Option<&'static str> {
        match self {
            View::Masked => None,
            View::Unmasked => Some(UNMASKED),
        }
    }

    fn name(self) -> &'static str {
        match self {
            View::Masked => "masked",
            View::Unmasked => "unmasked",
        }
    }
}

/// `GET /apis` (legacy discovery): the one group served here.
pub fn api_group_list() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]})
}

/// `GET /apis/payloads.dlq.dev`.
pub fn api_group() -> Value {
    let version = json!({"groupVersion": GROUP_VERSION, "version": VERSION});
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": [version.clone()],
        "preferredVersion": version,
    })
}

/// `GET /apis/payloads.dlq.dev/v1alpha1`: get only, no list or watch, so payloads are read one
/// record at a time, each in the audit log.
pub fn api_resource_list() -> Value {
    let resource = |name: String| {
        json!({
            "name": name,
            "singularName": if name == RESOURCE { "deadletterpayload" } else { "" },
            "namespaced": true,
            "kind": KIND,
            "verbs": ["get"],
        })
    };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            resource(RESOURCE.to_string()),
            resource(format!("{RESOURCE}/{UNMASKED}")),
        ],
    })
}

/// A `metav1.Status` failure, as the apiserver answers (kubectl prints its message).
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// The `DeadLetterPayload` of `record`, whose job `opened` is (`seal::open`), in `view`; masked,
/// card numbers in the payload (text or binary) and in header names and values, and the values
/// at `mask_paths` (a JSON payload) are masked.
pub fn payload_object(
    record: &DeadLetter,
    opened: &Job,
    view: View,
    mask_paths: &[String],
) -> Value {
    let mut object = json!({
        "apiVersion": GROUP_VERSION,
        "kind": KIND,
        "metadata": {
            "name": record.metadata.name,
            "namespace": record.metadata.namespace,
            "creationTimestamp": record.metadata.creation_timestamp,
        },
        "queue": record.spec.queue,
        "jobId": opened.id,
        "view": view.name(),
    });
    let fields = match object.as_object_mut() {
        Some(fields) => fields,
        None => return object,
    };
    if let Some(sealed) = &record.spec.job.sealed {
        fields.insert("sealedTo".into(), json!(sealed.recipient));
    }
    let masked = view == View::Masked;
    if let Some(text) = &opened.payload {
        let shown = if masked {
            mask::mask_payload(text, mask_paths)
        } else {
            text.clone()
        };
        fields.insert("payload".into(), json!(shown));
    }
    if let Some(b64) = &opened.payload_base64 {
        fields.insert("payloadBase64".into(), json!(binary(b64, masked)));
    }
    if opened.payload_null {
        fields.insert("payloadNull".into(), json!(true));
    }
    let mut headers = serde_json::Map::new();
    for (name, value) in &opened.headers {
        if !masked {
            headers.insert(name.clone(), json!(value));
            continue;
        }
        // A name can carry a card number too; two names masked alike both stay shown.
        let mut shown = mask::mask_cards(name);
        let base = shown.clone();
        let mut n = 1;
        while headers.contains_key(&shown) {
            n += 1;
            shown = format!("{base} ({n})");
        }
        headers.insert(shown, json!(mask::mask_cards(value)));
    }
    if !headers.is_empty() {
        fields.insert("headers".into(), Value::Object(headers));
    }
    object
}

/// A binary payload as shown: masked in place when asked (one that is not base64 shows as is:
/// the schema makes that impossible for a record).
fn binary(b64: &str, masked: bool) -> String {
    let engine = base64::engine::general_purpose::STANDARD;
    match (masked, engine.decode(b64)) {
        (true, Ok(bytes)) => engine.encode(mask::mask_card_bytes(&bytes)),
        _ => b64.to_string(),
    }
}

/// Bytes of a stored body (`spec.job.body`) the JSON views show: its head. The exact bytes come
/// from the unmasked view asked with `Accept: application/octet-stream` ([`RAW`]).
pub const BODY_HEAD: usize = 1024;
/// Bytes read past [`BODY_HEAD`] before masking, so a card number crossing the cut is masked
/// whole (a card with separators is under 30 characters).
pub const BODY_HEAD_MARGIN: usize = 64;
/// The media type asking the unmasked view for the job's exact bytes rather than its object.
pub const RAW: &str = "application/octet-stream";

/// `object` (a [`payload_object`]) with the stored body `body` described (`ref`, `size`,
/// `sha256`) and its head shown: `head` is the opened body's first bytes (up to
/// [`BODY_HEAD`] + [`BODY_HEAD_MARGIN`]), `whole` says whether that is all of it. Masked, card
/// numbers are masked in the bytes; a queue's `maskPaths` name values of a whole JSON
/// document, which a head cut from a larger one cannot be checked against, so a larger body's
/// head is withheld from the masked view when the queue has mask paths (`bodyHeadWithheld`
/// says so; the unmasked view shows it).
pub fn with_body(
    mut object: Value,
    body: &crate::dead_letter::BodyRef,
    head: &[u8],
    whole: bool,
    view: View,
    mask_paths: &[String],
) -> Value {
    let Some(fields) = object.as_object_mut() else {
        return object;
    };
    let mut described = json!({
        "ref": body.reference,
        "size": body.size,
        "sha256": body.sha256,
    });
    if let (Some(recipient), Some(d)) = (&body.recipient, described.as_object_mut()) {
        d.insert("sealedTo".into(), json!(recipient));
    }
    fields.insert("body".into(), described);
    let shown: Vec<u8> = match view {
        View::Unmasked => head.to_vec(),
        View::Masked if whole && !mask_paths.is_empty() => match std::str::from_utf8(head) {
            Ok(text) => mask::mask_payload(text, mask_paths).into_bytes(),
            Err(_) => mask::mask_card_bytes(head),
        },
        View::Masked if !mask_paths.is_empty() => {
            fields.insert(
                "bodyHeadWithheld".into(),
                json!(format!(
                    "the queue masks JSON paths ({}), which the first {BODY_HEAD} bytes of a larger body cannot be checked against: the unmasked view shows them",
                    mask_paths.join(", ")
                )),
            );
            return object;
        }
        View::Masked => mask::mask_card_bytes(head),
    };
    let cut = &shown[..shown.len().min(BODY_HEAD)];
    match std::str::from_utf8(cut) {
        Ok(text) => {
            fields.insert("bodyHead".into(), json!(text));
        }
        // Cut inside a character: the text up to it.
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => {
            let text = String::from_utf8_lossy(&cut[..e.valid_up_to()]).into_owned();
            fields.insert("bodyHead".into(), json!(text));
        }
        Err(_) => {
            let engine = base64::engine::general_purpose::STANDARD;
            fields.insert("bodyHeadBase64".into(), json!(engine.encode(cut)));
        }
    }
    object
}

/// The Event a download of a record's exact body writes: who, and how many bytes.
pub fn body_revealed_event(user: &str, size: i64) -> EventPlan {
    EventPlan::normal(
        reason::PAYLOAD_REVEALED,
        action::REVEAL,
        format!("payload revealed to {user} (unmasked, the body's {size} bytes)"),
    )
    .once()
}

/// The Event a reveal writes on a record whose stored body could not be read or opened
/// (`reason`: BodyMissing, BodyCorrupt, ...; `why` names the object, never its bytes).
pub fn body_unreadable_event(user: &str, view: View, reason: &str, why: &str) -> EventPlan {
    EventPlan::warning(
        reason::REVEAL_FAILED,
        action::REVEAL,
        format!(
            "payload could not be revealed to {user} ({}): {reason}: {why}",
            view.name()
        ),
    )
    // Each refusal its own Event, as each reveal is: a body missing, then changed, both show.
    .once()
}

/// The Event every reveal writes on its record: who, and which view.
pub fn revealed_event(user: &str, view: View) -> EventPlan {
    EventPlan::normal(
        reason::PAYLOAD_REVEALED,
        action::REVEAL,
        format!("payload revealed to {user} ({})", view.name()),
    )
    .once()
}

/// The Event a reveal writes on a record it could not open (`why`: the key is gone, or the
/// ciphertext is damaged): a Warning naming who asked, which view, and why (never the payload).
pub fn unopenable_event(user: &str, view: View, why: &crate::seal::OpenError) -> EventPlan {
    EventPlan::warning(
        reason::REVEAL_FAILED,
        action::REVEAL,
        format!(
            "payload could not be revealed to {user} ({}): {why}",
            view.name()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::RecordBuilder;

    fn record(id: &str) -> DeadLetter {
        RecordBuilder::job(id).build()
    }

    fn job_with(payload: &str) -> Job {
        let mut r = record("r1");
        r.spec.job.payload = Some(payload.into());
        r.spec
            .job
            .headers
            .insert("x-card".into(), "4111 1111 1111 1111".into());
        r.spec.job
    }

    #[test]
    fn the_masked_view_masks_cards_paths_and_headers_and_the_unmasked_one_nothing() {
        let r = record("r1");
        let job = job_with(r#"{"pan":"4111111111111111","name":"Ada"}"#);
        let paths = vec!["$.name".to_string()];
        let masked = payload_object(&r, &job, View::Masked, &paths);
        assert_eq!(masked["kind"], KIND);
        assert_eq!(masked["view"], "masked");
        assert_eq!(
            masked["payload"],
            r#"{"name":"****","pan":"411111******1111"}"#
        );
        assert_eq!(masked["headers"]["x-card"], "4111 11** **** 1111");
        let raw = payload_object(&r, &job, View::Unmasked, &paths);
        assert_eq!(raw["payload"], r#"{"pan":"4111111111111111","name":"Ada"}"#);
        assert_eq!(raw["headers"]["x-card"], "4111 1111 1111 1111");
    }

    #[test]
    fn the_masked_view_masks_card_numbers_in_header_names_and_keeps_every_header() {
        let r = record("r1");
        let mut job = r.spec.job.clone();
        job.headers
            .insert("x-pan-6011111111111117".into(), "a".into());
        job.headers
            .insert("x-pan-6011110000091117".into(), "b".into());
        let masked = payload_object(&r, &job, View::Masked, &[]);
        let shown = masked["headers"].to_string();
        assert!(!shown.contains("6011111111111117"), "{shown}");
        let headers = masked["headers"].as_object().expect("headers");
        assert_eq!(headers.len(), job.headers.len(), "{shown}");
        // In the names' order: ...0000091117 before ...1111111117.
        assert_eq!(headers["x-pan-601111******1117"], "b");
        assert_eq!(headers["x-pan-601111******1117 (2)"], "a");
        let raw = payload_object(&r, &job, View::Unmasked, &[]);
        assert_eq!(raw["headers"]["x-pan-6011111111111117"], "a");
    }

    #[test]
    fn binary_payloads_stay_base64_and_are_masked_in_place() {
        let r = record("r1");
        let mut job = r.spec.job.clone();
        let engine = base64::engine::general_purpose::STANDARD;
        job.payload = None;
        job.payload_base64 = Some(engine.encode(b"\xff4111111111111111"));
        let masked = payload_object(&r, &job, View::Masked, &[]);
        let shown = engine
            .decode(masked["payloadBase64"].as_str().unwrap())
            .unwrap();
        assert_eq!(shown, b"\xff411111******1111");
    }

    #[test]
    fn discovery_offers_get_only_and_an_unmasked_subresource() {
        let list = api_resource_list();
        assert_eq!(list["groupVersion"], GROUP_VERSION);
        let names: Vec<&str> = list["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["deadletterpayloads", "deadletterpayloads/unmasked"]);
        for r in list["resources"].as_array().unwrap() {
            assert_eq!(r["verbs"], json!(["get"]));
        }
        assert_eq!(api_group()["preferredVersion"]["version"], VERSION);
    }

    #[test]
    fn a_stored_bodys_head_is_masked_cut_and_withheld_under_mask_paths() {
        let r = record("r1");
        let body = crate::dead_letter::BodyRef {
            reference: "s3://b/sha256/ab".into(),
            size: 5000,
            sha256: "ab".repeat(32),
            recipient: None,
            external: false,
        };
        // A card crossing the cut at 1024 bytes is masked whole.
        let mut head = vec![b'x'; BODY_HEAD - 8];
        head.extend_from_slice(b"4111111111111111");
        head.extend(std::iter::repeat_n(b'y', 40));
        let base = payload_object(&r, &r.spec.job, View::Masked, &[]);
        let masked = with_body(base.clone(), &body, &head, false, View::Masked, &[]);
        let shown = masked["bodyHead"].as_str().unwrap();
        assert_eq!(shown.len(), BODY_HEAD);
        assert!(shown.ends_with("411111**"), "{}", &shown[1000..]);
        assert_eq!(masked["body"]["size"], 5000);
        assert_eq!(masked["body"]["ref"], "s3://b/sha256/ab");
        let raw = with_body(
            base.clone(),
            &body,
            &head,
            false,
            View::Unmasked,
            &["$.a".into()],
        );
        assert!(raw["bodyHead"].as_str().unwrap().ends_with("41111111"));
        let withheld = with_body(
            base.clone(),
            &body,
            &head,
            false,
            View::Masked,
            &["$.a".into()],
        );
        assert!(withheld.get("bodyHead").is_none());
        assert!(
            withheld["bodyHeadWithheld"]
                .as_str()
                .unwrap()
                .contains("$.a")
        );
        // Whole, a JSON body is masked like a payload; bytes that are not text stay base64.
        let doc = br#"{"a":"Ada","n":1}"#;
        let whole = with_body(
            base.clone(),
            &body,
            doc,
            true,
            View::Masked,
            &["$.a".into()],
        );
        assert_eq!(whole["bodyHead"], r#"{"a":"****","n":1}"#);
        let binary = with_body(
            base,
            &body,
            b"\xff\xfe4111111111111111",
            true,
            View::Masked,
            &[],
        );
        let engine = base64::engine::general_purpose::STANDARD;
        let bytes = engine
            .decode(binary["bodyHeadBase64"].as_str().unwrap())
            .unwrap();
        assert_eq!(bytes, b"\xff\xfe411111******1111");
    }

    #[test]
    fn every_reveal_is_its_own_event_naming_the_user() {
        let e = revealed_event("alice", View::Unmasked);
        assert_eq!(e.reason, "PayloadRevealed");
        assert!(e.once);
        assert!(e.note.contains("alice") && e.note.contains("unmasked"));
    }
}
