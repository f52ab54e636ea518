//! Property tests of the pure parts (issue 14, item 6): arbitrary input never panics, and the
//! encodings round-trip. Sources feed these functions whatever a broker holds, so "never
//! panics" is a safety property, not a nicety.

use std::collections::BTreeMap;

use dlq_core::api::FailureKind;
use dlq_core::api::{Action, Job, Phase};
use dlq_core::decide::{Decision, decide};
use dlq_core::envelope::request_for;
use dlq_core::group::{Key, MAX_TEMPLATE, is_fingerprint, template};
use dlq_core::headers::{nats, sqs};
use dlq_core::park::{Disposition, ParkRequest, dispose, invalid_request, validate};
use proptest::prelude::*;

fn phase() -> impl Strategy<Value = Phase> {
    prop_oneof![
        Just(Phase::Parked),
        Just(Phase::Redriven),
        Just(Phase::Dropped)
    ]
}

fn action() -> impl Strategy<Value = Option<Action>> {
    prop_oneof![
        Just(None),
        Just(Some(Action::Redrive)),
        Just(Some(Action::Drop))
    ]
}

/// Header names every backend accepts.
fn name() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_-]{0,15}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decide_is_total_and_never_acts_on_a_resolved_record(
        p in phase(), m in any::<bool>(), a in action(), by in proptest::option::of(".{0,20}")
    ) {
        let d = decide(p, m, a, by.as_deref());
        if matches!(p, Phase::Redriven | Phase::Dropped) {
            prop_assert_eq!(&d, &Decision::Done);
        }
        if let Decision::Redrive { by } | Decision::Drop { by } = d {
            prop_assert!(!by.trim().is_empty(), "every decision is signed");
        }
    }

    #[test]
    fn envelope_parsing_never_panics_on_arbitrary_bytes(raw in proptest::collection::vec(any::<u8>(), 0..512)) {
        let req = request_for("relayer", &raw);
        // Whatever came in is parked (valid), or kept in the broker: never lost.
        match dispose(req, &raw) {
            Disposition::Park(r) => prop_assert!(validate(&r).is_ok()),
            Disposition::Reject(_) => {}
        }
    }

    #[test]
    fn an_envelope_keeps_its_job_id_and_payload(id in "[a-zA-Z0-9_/.:-]{1,60}", payload in ".{0,200}") {
        let env = serde_json::json!({"id": id, "payload": payload, "reason": "r"});
        let req = request_for("relayer", env.to_string().as_bytes());
        prop_assert_eq!(&req.job.id, &id);
        prop_assert_eq!(req.job.payload.as_deref(), Some(payload.as_str()));
    }

    #[test]
    fn invalid_records_keep_the_exact_bytes_and_a_stable_id(raw in proptest::collection::vec(any::<u8>(), 0..512)) {
        let a = invalid_request("relayer", &raw, "bad".into());
        let b = invalid_request("relayer", &raw, "bad".into());
        prop_assert_eq!(&a.job.id, &b.job.id, "the id comes from the bytes: re-parking dedupes");
        prop_assert_eq!(a.job.payload_bytes().expect("decodable"), raw);
    }

    #[test]
    fn park_validation_never_panics(
        queue in ".{0,70}", id in ".{0,300}", payload in proptest::option::of(".{0,64}"),
        headers in proptest::collection::btree_map(".{0,20}", ".{0,20}", 0..6), deliveries in any::<i32>()
    ) {
        let mut req = ParkRequest::new(queue, Job { id, payload, headers, ..Job::default() });
        req.deliveries = deliveries;
        let raw = req.job.payload.clone().unwrap_or_default().into_bytes();
        let _ = validate(&req);
        let _ = dispose(req, &raw);
    }

    #[test]
    fn nats_header_blocks_never_panic(block in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = nats::parse_header_block(&block);
        let mut text = b"NATS/1.0\r\n".to_vec();
        text.extend(block);
        if let Ok(h) = nats::parse_header_block(&text) {
            let _ = nats::carried_headers(&h);
        }
    }

    #[test]
    fn nats_headers_round_trip_through_a_record(
        headers in proptest::collection::btree_map(name(), proptest::collection::vec("[ -~]{0,12}", 1..4), 0..6)
    ) {
        let (carried, lost) = nats::carried_headers(&headers);
        prop_assert!(lost.is_empty());
        let mut back: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (k, v) in &carried {
            if k == nats::MULTI_HEADER {
                let multi: BTreeMap<String, Vec<String>> = serde_json::from_str(v).expect("multi JSON");
                back.extend(multi);
            } else {
                back.insert(k.clone(), vec![v.clone()]);
            }
        }
        let want: BTreeMap<String, Vec<String>> = headers
            .into_iter()
            .filter(|(k, _)| !k.starts_with("nats-expected-"))
            .collect();
        prop_assert_eq!(back, want);
    }

    #[test]
    fn sqs_attributes_round_trip_through_a_record(
        strings in proptest::collection::btree_map("[A-Za-z][A-Za-z0-9_-]{0,15}", ".{0,20}", 0..5),
        binaries in proptest::collection::btree_map("[A-Za-z][A-Za-z0-9_-]{0,15}", proptest::collection::vec(any::<u8>(), 0..20), 0..4),
        group in proptest::option::of("[a-z0-9]{1,10}")
    ) {
        let mut attrs: BTreeMap<String, sqs::Attribute> = strings
            .into_iter()
            .map(|(k, v)| (k, sqs::Attribute::string(v)))
            .collect();
        for (k, v) in binaries {
            attrs.insert(k, sqs::Attribute { data_type: "Binary".into(), string_value: None, binary_value: Some(v) });
        }
        prop_assume!(attrs.len() <= sqs::MAX_ATTRIBUTES);
        let (headers, lost) = sqs::to_headers(&attrs, group.as_deref());
        prop_assert!(lost.is_empty());
        let (back, back_group) = sqs::from_headers(&headers).expect("headers go back to attributes");
        prop_assert_eq!(back, attrs);
        prop_assert_eq!(back_group, group);
    }

    #[test]
    fn sqs_headers_from_anywhere_never_panic(headers in proptest::collection::btree_map(".{0,20}", ".{0,40}", 0..8)) {
        let _ = sqs::from_headers(&headers);
    }
}

/// The kinds of value that vary between records of one failure: the masks must hide each.
const VARIABLE_KINDS: [&str; 10] = [
    "[0-9]{1,12}",
    "[0-9a-f]{7}[0-9][a-f]",
    "0x[0-9a-f]{2,16}",
    "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}(:[0-9]{2,5})?",
    "[0-9]{1,5}(ms|s|m|h)",
    "\"[a-zA-Z0-9 ]{0,12}\"",
    "[a-z]{2,8}[0-9]?\\.(svc|example)\\.(local|com)",
    "[a-z]{1,8}@[a-z]{2,8}\\.(com|org)",
    "[A-Z][a-z][0-9][A-Za-z0-9]{13,20}",
];

/// Two values of one kind, as two records of one failure would carry.
fn variable_pair() -> impl Strategy<Value = (String, String)> {
    (0..VARIABLE_KINDS.len()).prop_flat_map(|k| (VARIABLE_KINDS[k], VARIABLE_KINDS[k]))
}

/// Words that stay in a template: lower-case words of letters that are not hex.
fn fixed_word() -> impl Strategy<Value = String> {
    "[g-z][a-z]{0,7}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn templates_are_bounded_numberless_and_never_panic(reason in ".{0,1100}") {
        let t = template(&reason);
        prop_assert!(t.chars().count() <= MAX_TEMPLATE);
        prop_assert_eq!(template(&reason), t.clone(), "the same every time");
        let bare = t.replace("<b64>", "");
        prop_assert!(!bare.bytes().any(|b| b.is_ascii_digit()), "no number survives: {}", t);
        let key = Key {
            queue: "relayer",
            failure_kind: FailureKind::Transient,
            service_version: None,
            error_class: None,
            reason: &reason,
        };
        prop_assert!(is_fingerprint(&key.fingerprint()));
    }

    #[test]
    fn reasons_differing_only_in_variable_parts_share_a_group(
        slots in proptest::collection::vec((fixed_word(), variable_pair()), 1..6),
        version in "[a-z]{1,8}@[0-9]\\.[0-9]",
    ) {
        let reason = |pick: fn(&(String, String)) -> &String| {
            slots.iter().map(|s| format!("{} {}", s.0, pick(&s.1))).collect::<Vec<_>>().join(" ")
        };
        let (a, b) = (reason(|p| &p.0), reason(|p| &p.1));
        let key = |reason| Key {
            queue: "relayer",
            failure_kind: FailureKind::Transient,
            service_version: Some(&version),
            error_class: None,
            reason,
        };
        let (ka, kb) = (key(&a), key(&b));
        for s in &slots {
            prop_assert!(ka.template().contains(&s.0), "{} lost {}", ka.template(), s.0);
            let bare = ka.template().replace("<b64>", "");
            prop_assert!(!bare.contains(&s.1.0), "{} kept {}", ka.template(), s.1.0);
        }
        prop_assert_eq!(ka.hashed_template(), kb.hashed_template());
        prop_assert_eq!(ka.fingerprint(), kb.fingerprint());
    }
}

/// A Luhn-valid card number of `len` digits (13–19) built from `body` digits: the check digit
/// is computed.
fn card(body: Vec<u8>) -> String {
    let mut digits = body;
    for check in 0..10 {
        digits.push(check);
        if dlq_core::mask::luhn(&digits) {
            return digits.iter().map(|d| char::from(b'0' + d)).collect();
        }
        digits.pop();
    }
    unreachable!("one check digit always passes")
}

fn card_number() -> impl Strategy<Value = String> {
    (12usize..=18).prop_flat_map(|n| proptest::collection::vec(0u8..10, n).prop_map(card))
}

/// Text around a card that ends and starts with no digit, space or dash.
fn around() -> impl Strategy<Value = String> {
    "([a-zA-Z\"{}:,]{1,12})?".prop_map(|s| if s.is_empty() { "x".into() } else { s })
}

proptest! {
    // Issue 32, item 4: a Luhn-valid run of 13–19 digits shows only its first six and last four.
    #[test]
    fn every_card_number_is_masked(before in around(), pan in card_number(), after in around(), dash in any::<bool>()) {
        let grouped: String = if dash {
            pan.as_bytes().chunks(4).map(|c| std::str::from_utf8(c).unwrap()).collect::<Vec<_>>().join("-")
        } else {
            pan.clone()
        };
        let text = format!("{before}{grouped}{after}");
        let masked = dlq_core::mask::mask_cards(&text);
        let digits: String = masked.chars().filter(|c| c.is_ascii_digit() || *c == '*').collect();
        prop_assert!(!masked.contains(&grouped), "{masked}");
        prop_assert_eq!(masked.len(), text.len());
        prop_assert!(digits.starts_with(&pan[..6]), "{masked}");
        prop_assert!(digits.ends_with(&pan[pan.len() - 4..]), "{masked}");
        prop_assert_eq!(digits.matches('*').count(), pan.len() - 10);
        prop_assert!(masked.starts_with(&before) && masked.ends_with(&after));
    }

    #[test]
    fn numbers_that_fail_luhn_are_untouched(pan in card_number(), bump in 1u8..10) {
        let last = pan.as_bytes()[pan.len() - 1] - b'0';
        let wrong = format!("{}{}", &pan[..pan.len() - 1], (last + bump) % 10);
        prop_assert_eq!(dlq_core::mask::mask_cards(&wrong), wrong);
    }

    #[test]
    fn masking_never_panics_and_keeps_text_without_digits(text in ".{0,200}", path in ".{0,40}") {
        let _ = dlq_core::mask::mask_payload(&text, &[path]);
        if !text.chars().any(|c| c.is_ascii_digit()) {
            prop_assert_eq!(dlq_core::mask::mask_cards(&text), text);
        }
    }
}
