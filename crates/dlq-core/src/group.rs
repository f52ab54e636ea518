//! Failure groups: the fingerprint that puts records failing the same way together.
//!
//! A fingerprint hashes the queue, failure kind, service version, error class and the reason
//! with its variable parts masked (the *template*), so `timeout after 3021 ms talking to payer
//! 7f3a9c21` and `timeout after 15 ms talking to payer 0b11e0aa` share one, and a record of
//! another service version does not. Every record carries it as [`LABEL_GROUP`].
//!
//! The label is an index the operator keeps, never read as the truth: a record's group is
//! computed from its immutable facts, and the operator labels again a record whose label is
//! missing or wrong. The hashed form below is part of the contract (a test pins known
//! fingerprints; changing it needs a new [`SCHEME`]). A mask that stops a group splitting
//! changes only the fingerprints of the reasons it now masks; the operator relabels those
//! records, and their split groups become one.

use std::sync::LazyLock;

use regex::{Captures, Regex};
use sha2::{Digest, Sha256};

use crate::dead_letter::{DeadLetter, FailureKind};
use crate::facts::Facts;

/// Label with a record's fingerprint: `kubectl get dl -l dlq.dev/group=...`.
pub const LABEL_GROUP: &str = "dlq.dev/group";
/// Longest reason template, in characters; longer ones are cut (with `...`) before hashing.
pub const MAX_TEMPLATE: usize = 256;
/// Characters of a reason its template is made from.
pub const MAX_INPUT: usize = 2 * MAX_TEMPLATE;
/// Longest error class a record holds (the CRD bounds `spec.errorClass` the same).
pub const MAX_ERROR_CLASS: usize = 256;
/// Hex digits of a fingerprint (40 bits: a birthday collision needs about a million groups
/// in one queue, which `maxGroups` never allows).
pub const FINGERPRINT_LEN: usize = 10;
const HEX_PLACEHOLDER: &str = "<hex>";
const BASE64_PLACEHOLDER: &str = "<b64>";
const TOKEN_PLACEHOLDER: &str = "<id>";
const NUMBER_PLACEHOLDER: &str = "<n>";
/// The hashed form's version, hashed first.
const SCHEME: &str = "dlq.dev/group/v1";

/// What a fingerprint is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key<'a> {
    pub queue: &'a str,
    pub failure_kind: FailureKind,
    pub service_version: Option<&'a str>,
    pub error_class: Option<&'a str>,
    pub reason: &'a str,
}

impl<'a> Key<'a> {
    /// The key of a record (or its summary).
    pub fn of<F: Facts + ?Sized>(record: &'a F) -> Key<'a> {
        Key {
            queue: record.queue(),
            failure_kind: record.failure_kind(),
            service_version: record.service_version(),
            error_class: record.error_class(),
            reason: record.reason(),
        }
    }

    /// The reason's template ([`template`]).
    pub fn template(&self) -> String {
        template(self.reason)
    }

    /// The group's fingerprint: [`FINGERPRINT_LEN`] hex digits of a sha256 over the parts,
    /// each length-prefixed so no two different keys hash the same text.
    /// The template as hashed: a random id is now and then all digits (`00012345`) or a
    /// base64 token all hex letters, so numbers, hex, base64 runs and prefixed tokens count as
    /// one kind of id there, and such a record stays in its group.
    pub fn hashed_template(&self) -> String {
        self.template()
            .replace(HEX_PLACEHOLDER, NUMBER_PLACEHOLDER)
            .replace(BASE64_PLACEHOLDER, NUMBER_PLACEHOLDER)
            .replace(TOKEN_PLACEHOLDER, NUMBER_PLACEHOLDER)
    }

    pub fn fingerprint(&self) -> String {
        let template = self.hashed_template();
        let parts = [
            self.queue,
            self.failure_kind.as_str(),
            self.service_version.map_or("", str::trim),
            self.error_class.map_or("", str::trim),
            &template,
        ];
        let mut h = Sha256::new();
        h.update(SCHEME.as_bytes());
        for part in parts {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let mut hex = hex::encode(&h.finalize()[..FINGERPRINT_LEN.div_ceil(2)]);
        hex.truncate(FINGERPRINT_LEN);
        hex
    }
}

/// The fingerprint a record's `dlq.dev/group` label holds, when it holds one.
pub fn labelled(record: &DeadLetter) -> Option<&str> {
    record
        .metadata
        .labels
        .as_ref()?
        .get(LABEL_GROUP)
        .map(String::as_str)
        .filter(|v| is_fingerprint(v))
}

/// Whether `value` can be a fingerprint (what a `group:` selector or `--group` accepts).
pub fn is_fingerprint(value: &str) -> bool {
    value.len() == FINGERPRINT_LEN
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// An error class cut to [`MAX_ERROR_CLASS`] characters and trimmed; None when empty. Sources
/// read classes from broker headers, which may be longer than a record holds.
pub fn bounded_error_class(class: &str) -> Option<String> {
    let class: String = class.trim().chars().take(MAX_ERROR_CLASS).collect();
    let class = class.trim();
    (!class.is_empty()).then(|| class.to_string())
}

/// One mask: what it finds and the placeholder it leaves. Applied in order; a placeholder
/// holds no dot, quote or colon, and the number mask skips placeholders, so later masks never
/// change one.
struct Mask {
    /// The value is the group `v`; the boundaries around it (`l`, `t`), when the pattern has
    /// them, are kept.
    find: Regex,
    placeholder: &'static str,
    /// Only replace values this accepts (a hex or base64 run must look random).
    accept: fn(&str) -> bool,
}

fn any(_: &str) -> bool {
    true
}

/// Hex that is not an English word: `0x...`, at least one digit and one letter, or letters
/// alone in a run of [`MIN_LETTER_HEX`] or more (a random 32-bit id is now and then all
/// letters: `baaeaaed`). All digits is left to the number mask (it hashes alike).
fn random_hex(s: &str) -> bool {
    let letters = s.bytes().any(|b| b.is_ascii_alphabetic());
    s.starts_with("0x")
        || (letters && s.len() >= MIN_LETTER_HEX)
        || (letters && s.bytes().any(|b| b.is_ascii_digit()))
}

/// The shortest hex run that is an id even without a digit. No English word of 8 or more
/// letters is made of a-f alone (the longest are 7: `defaced`, `effaced`), so prose is safe.
const MIN_LETTER_HEX: usize = 8;

/// The random part of a prefixed token (`pi_psHMeLRpDKwPMJaRaIsAMVrz`): digits and letters,
/// or both cases not in the shape of a CamelCase name (every capital followed by at least
/// two small letters: `on_MessageReceived` is a name). All small letters is a snake_case
/// name (`api_connection_error`), never masked.
fn random_token(s: &str) -> bool {
    let b = s.as_bytes();
    let has = |f: fn(&u8) -> bool| b.iter().any(f);
    let letters = has(u8::is_ascii_alphabetic);
    if has(u8::is_ascii_digit) {
        return true;
    }
    if !(letters && has(u8::is_ascii_uppercase) && has(u8::is_ascii_lowercase)) {
        return false;
    }
    let camel = b.iter().enumerate().all(|(i, c)| {
        !c.is_ascii_uppercase()
            || (b.get(i + 1).is_some_and(u8::is_ascii_lowercase)
                && b.get(i + 2).is_some_and(u8::is_ascii_lowercase))
    });
    !camel
}

/// Base64 that is not an identifier: upper- and lower-case letters and a digit, or padding.
fn random_base64(s: &str) -> bool {
    let has = |f: fn(&u8) -> bool| s.as_bytes().iter().any(f);
    s.ends_with('=')
        || (has(u8::is_ascii_uppercase) && has(u8::is_ascii_lowercase) && has(u8::is_ascii_digit))
}

/// A duration, not a hex id ending in `d` (`0000123d`): those are left to the hex mask.
fn duration(s: &str) -> bool {
    s.len() < 6 || !s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// An IPv6 address, not a `::` in prose: two colons or more and a hex digit.
fn ipv6(s: &str) -> bool {
    s.bytes().filter(|&b| b == b':').count() >= 2 && s.bytes().any(|b| b.is_ascii_hexdigit())
}

/// Not a placeholder left by an earlier mask.
fn not_placeholder(s: &str) -> bool {
    !s.starts_with('<')
}

fn mask(find: &str, placeholder: &'static str, accept: fn(&str) -> bool) -> Option<Mask> {
    // Patterns are constants a test compiles; a bad one would only skip its mask.
    Regex::new(find).ok().map(|find| Mask {
        find,
        placeholder,
        accept,
    })
}

/// The masks, in order: quoted values and e-mails first (they hold anything), then the
/// structured ids, then what is left of numbers.
static MASKS: LazyLock<Vec<Mask>> = LazyLock::new(|| {
    const HEX: &str = "[0-9A-Fa-f]";
    // Boundaries that regex's `\b` cannot give (`_` is a word character there, and there is
    // no look-around): not inside a word of letters, digits or `_`.
    const L: &str = "(?P<l>^|[^A-Za-z0-9_])";
    const T: &str = "(?P<t>[^A-Za-z0-9_]|$)";
    // A host name may end a sentence, but not continue as a class name (`java.lang.Foo`).
    const TH: &str = r"(?P<t>\.?(?:[^A-Za-z0-9_.-]|$))";
    let host = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[a-z][a-z0-9-]*[a-z0-9]";
    [
        mask(&format!(r#"{L}(?P<v>"[^"]*"|'[^'\n]*'|`[^`]*`)"#), "<q>", any),
        mask(
            r"(?P<v>[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,})",
            "<email>",
            any,
        ),
        mask(
            &format!("{L}(?P<v>{HEX}{{8}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{12}}){T}"),
            "<uuid>",
            any,
        ),
        mask(
            &format!(
                r"{L}(?P<v>[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}(?:[T ][0-9]{{2}}:[0-9]{{2}}(?::[0-9]{{2}}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{{2}}:?[0-9]{{2}})?)?){T}"
            ),
            "<time>",
            any,
        ),
        mask(
            &format!(r"{L}(?P<v>[0-9]{{1,3}}(?:\.[0-9]{{1,3}}){{3}}(?::[0-9]{{1,5}})?){T}"),
            "<ip>",
            any,
        ),
        mask(
            &format!(r"{L}(?P<v>[0-9]{{1,2}}:[0-9]{{2}}(?::[0-9]{{2}}(?:\.[0-9]+)?)?){T}"),
            "<time>",
            any,
        ),
        mask(
            &format!(r"{L}(?P<v>\[?(?:{HEX}{{0,4}}:){{2,7}}{HEX}{{0,4}}\]?(?::[0-9]{{1,5}})?){T}"),
            "<ip>",
            ipv6,
        ),
        mask(
            &format!("{L}(?P<v>{host}(?::[0-9]{{1,5}})?){TH}"),
            "<host>",
            any,
        ),
        // A prefixed token (Stripe's `pi_...`, `cus_...`): the prefix says what it is, kept.
        mask(
            &format!("{L}(?P<p>[a-z]{{2,4}}_)(?P<v>[A-Za-z0-9]{{10,}}){T}"),
            TOKEN_PLACEHOLDER,
            random_token,
        ),
        mask(
            &format!("{L}(?P<v>(?:[0-9]+(?:\\.[0-9]+)?(?:ns|us|µs|ms|s|m|h|d))+){T}"),
            "<dur>",
            duration,
        ),
        mask(
            &format!("{L}(?P<v>0x{HEX}+|{HEX}{{4,}}){T}"),
            HEX_PLACEHOLDER,
            random_hex,
        ),
        mask(
            &format!("{L}(?P<v>[A-Za-z0-9+/_-]{{16,}}={{0,2}}){T}"),
            BASE64_PLACEHOLDER,
            random_base64,
        ),
        // The placeholders are matched whole so that they are skipped; any other `<...>`
        // (`<12345>` in a reason) is text whose numbers are masked. A number is a run of
        // decimal digits of any script (`٣٠٢١`, `１２３`), with thousands separators
        // (`1,024.00`) and decimals.
        mask(
            r"(?P<v><(?:n|hex|b64|id|uuid|q|dur|time|ip|host|email)>|\d{1,3}(?:,\d{3})+(?:\.\d+)*|\d+(?:\.\d+)*)",
            NUMBER_PLACEHOLDER,
            not_placeholder,
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
});

/// Replaces the values `m` finds in `text` and accepts, keeping their boundaries; borrowed
/// when nothing matched (most masks, most reasons).
fn apply<'t>(m: &Mask, text: &'t str) -> std::borrow::Cow<'t, str> {
    m.find.replace_all(text, |c: &Captures| {
        let group = |name: &str| c.name(name).map_or("", |g| g.as_str());
        let value = group("v");
        if (m.accept)(value) {
            format!(
                "{}{}{}{}",
                group("l"),
                group("p"),
                m.placeholder,
                group("t")
            )
        } else {
            c.get(0).map_or("", |g| g.as_str()).to_string()
        }
    })
}

/// The reason with its variable parts masked (numbers `<n>`, hex runs `<hex>`, base64 runs
/// `<b64>`, UUIDs `<uuid>`, quoted values `<q>`, durations `<dur>`, times `<time>`, IP
/// addresses `<ip>`, host names `<host>`, e-mail addresses `<email>`) in its first
/// [`MAX_INPUT`] characters, white space collapsed, cut to [`MAX_TEMPLATE`] characters.
pub fn template(reason: &str) -> String {
    // Only the first two templates' worth is masked (a reason holds 1024 characters): the park
    // path pays for at most that much, and what is kept is cut at MAX_TEMPLATE anyway.
    let mut text: String = reason.chars().take(MAX_INPUT).collect();
    for m in MASKS.iter() {
        // Again after a match: adjacent matches share a boundary, so one pass may miss every
        // other one.
        if let std::borrow::Cow::Owned(once) = apply(m, &text) {
            text = apply(m, &once).into_owned();
        }
    }
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    if out.chars().count() > MAX_TEMPLATE {
        out = out.chars().take(MAX_TEMPLATE - 3).collect();
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(reason: &'a str, version: Option<&'a str>) -> Key<'a> {
        Key {
            queue: "relayer",
            failure_kind: FailureKind::Transient,
            service_version: version,
            error_class: None,
            reason,
        }
    }

    #[test]
    fn every_mask_compiles() {
        assert_eq!(MASKS.len(), 13);
    }

    #[test]
    fn numbers_in_angle_brackets_are_masked_and_placeholders_kept() {
        // Found by the property test: `<0>` looked like a placeholder and kept its number.
        assert_eq!(template("a¡  A\0 <0>"), "a¡ A\0 <<n>>");
        assert_eq!(
            template("object <12345> not found"),
            "object <<n>> not found"
        );
        assert_eq!(template("<n> <b64> <hex>"), "<n> <b64> <hex>");
    }

    #[test]
    fn the_issues_example_falls_in_one_group_and_another_version_does_not() {
        let a = key(
            "timeout after 3021 ms talking to payer 7f3a9c21",
            Some("relayer@1.4.2"),
        );
        let b = key(
            "timeout after 15 ms talking to payer 0b11e0aa",
            Some("relayer@1.4.2"),
        );
        assert_eq!(a.template(), "timeout after <n> ms talking to payer <hex>");
        assert_eq!(a.fingerprint(), b.fingerprint());
        let all_digits = key(
            "timeout after 15 ms talking to payer 00012345",
            Some("relayer@1.4.2"),
        );
        assert_eq!(
            a.fingerprint(),
            all_digits.fingerprint(),
            "a hex id of digits only"
        );
        let c = key(
            "timeout after 15 ms talking to payer 0b11e0aa",
            Some("relayer@1.4.3"),
        );
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn each_variable_part_is_masked() {
        let cases = [
            ("order 12345 failed", "order <n> failed"),
            ("job pi_0003/settle", "job pi_<n>/settle"),
            ("payer 0x7f3a", "payer <hex>"),
            ("sha deadbeef00", "sha <hex>"),
            ("a decade of added faces", "a decade of added faces"),
            ("id 0000123d or 3d", "id <hex> or <dur>"),
            (
                "id 123e4567-e89b-12d3-a456-426614174000 gone",
                "id <uuid> gone",
            ),
            ("token dGhpcyBpcyBhIHRva2VuMTI= bad", "token <b64> bad"),
            ("token aGVsbG8gV29ybGQgMTIzNDU2 bad", "token <b64> bad"),
            (
                "IllegalStateException in order_processing_handler",
                "IllegalStateException in order_processing_handler",
            ),
            ("field \"amount\" missing", "field <q> missing"),
            ("can't parse 'x-1'", "can't parse <q>"),
            ("after 1.5s and 2h30m", "after <dur> and <dur>"),
            ("dial tcp 10.0.3.7:5432: refused", "dial tcp <ip>: refused"),
            ("dial [fe80::1ff:fe23:4567:890a]:443 down", "dial <ip> down"),
            (
                "no route to payer.svc.cluster.local:8443",
                "no route to <host>",
            ),
            (
                "mail to ops+x@pay.example.com bounced",
                "mail to <email> bounced",
            ),
            (
                "at 2026-11-29T10:00:00Z and 10:01:02",
                "at <time> and <time>",
            ),
            ("version relayer@1.4.2", "version relayer@<n>"),
            ("  spaced\tout\n words ", "spaced out words"),
        ];
        for (reason, want) in cases {
            assert_eq!(template(reason), want, "{reason}");
        }
    }

    /// Issue 45 item 12 and issue 44 item 6: ids that did not look like ids split groups.
    #[test]
    fn ids_of_every_shape_fold_into_one_group() {
        let same = |a: &str, b: &str| {
            assert_eq!(
                key(a, None).fingerprint(),
                key(b, None).fingerprint(),
                "{a:?} ({}) and {b:?} ({})",
                template(a),
                template(b)
            )
        };
        same(
            "charge pi_psHMeLRpDKwPMJaRaIsAMVrz declined",
            "charge pi_3MtwBwLkdIwHu7ix28a3tqPa declined",
        );
        same("retry ٣٠٢١ of order", "retry 3021 of order");
        same("retry １２３ of order", "retry 3021 of order");
        same("amount 1,024.00 over limit", "amount 12.50 over limit");
        same(
            "timeout talking to payer baaeaaed",
            "timeout talking to payer 7f3a9c21",
        );
        same(
            "timeout talking to payer DEADBEEFCAFEFACE",
            "timeout talking to payer 0b11e0aa0b11e0aa",
        );
        assert_eq!(
            template("charge pi_psHMeLRpDKwPMJaRaIsAMVrz declined"),
            "charge pi_<id> declined"
        );
        assert_eq!(template("amount 1,024.00 over"), "amount <n> over");
        assert_eq!(template("payer baaeaaed"), "payer <hex>");
    }

    /// What looks like an id only by its shape stays text: snake_case and CamelCase names
    /// after a short prefix, a-f words shorter than 8 letters, lists of small numbers.
    #[test]
    fn names_and_words_are_not_taken_for_ids() {
        let kept = [
            "api_connection_error from upstream",
            "handler on_MessageReceived failed",
            "record defaced, effaced and faded",
            "a decade of added faces",
            "cafe and feedback and deadbeat",
        ];
        for reason in kept {
            assert_eq!(template(reason), reason);
        }
        assert_eq!(template("values 1,2,3"), "values <n>,<n>,<n>");
    }

    use proptest::prelude::Strategy;

    /// A random hex id of `len` digits: any, letters alone, or digits alone.
    fn hex_id(len: usize) -> impl Strategy<Value = String> {
        proptest::prop_oneof![
            proptest::collection::vec(proptest::num::u8::ANY, len / 2).prop_map(hex::encode),
            proptest::string::string_regex(&format!("[a-f]{{{len}}}")).expect("a pattern"),
            proptest::string::string_regex(&format!("[0-9]{{{len}}}")).expect("a pattern"),
        ]
    }

    proptest::proptest! {
        /// Random ids of each kind (32-, 64- and 128-bit hex in either case, prefixed tokens,
        /// numbers of any script or with thousands separators) fold into one group.
        #[test]
        fn random_ids_of_each_kind_fold_into_one_group(
            // Uniform hex is all letters once in 2,600 draws (32 bits): drawn on purpose too.
            hex32 in hex_id(8),
            hex64 in hex_id(16),
            hex128 in hex_id(32),
            upper in proptest::bool::ANY,
            prefix in "[a-z]{2,4}",
            // A token of letters alone in CamelCase shape is taken for a name (see
            // `names_and_words_are_not_taken_for_ids`); at these lengths about 1 in 10^4 is.
            token in "[A-Za-z0-9]{14,28}".prop_filter("a CamelCase name", |t| random_token(t)),
            number in proptest::num::u32::ANY,
            script in proptest::sample::select(vec!['0', '٠', '０', '०', '০']),
        ) {
            let case = |s: String| if upper { s.to_uppercase() } else { s };
            let digits: String = number
                .to_string()
                .chars()
                .map(|c| {
                    let d = c.to_digit(10).unwrap_or(0);
                    char::from_u32(script as u32 + d).unwrap_or(c)
                })
                .collect();
            let thousands = {
                let plain = number.to_string();
                let mut out = String::new();
                for (i, c) in plain.chars().enumerate() {
                    if i > 0 && (plain.len() - i) % 3 == 0 {
                        out.push(',');
                    }
                    out.push(c);
                }
                out
            };
            let reason = format!(
                "timeout after {digits} ms ({thousands}.00 units) talking to payer {} via {} and {} for {prefix}_{token}",
                case(hex32),
                case(hex64),
                case(hex128),
            );
            let pinned = "timeout after 3021 ms (1.50 units) talking to payer 7f3a9c21 via 0b11e0aa0b11e0aa and 123e4567e89b12d3a456426614174000 for pi_3MtwBwLkdIwHu7ix28a3tqPa";
            let prefixed = pinned.replace("pi_", &format!("{prefix}_"));
            proptest::prop_assert_eq!(
                key(&reason, None).fingerprint(),
                key(&prefixed, None).fingerprint(),
                "{} vs {}", template(&reason), template(&prefixed)
            );
        }
    }

    #[test]
    fn a_java_class_in_the_reason_is_not_a_host() {
        assert_eq!(
            template("java.lang.IllegalStateException: bad amount"),
            "java.lang.IllegalStateException: bad amount"
        );
    }

    #[test]
    fn templates_are_bounded() {
        let long = "word ".repeat(400);
        let t = template(&long);
        assert_eq!(t.chars().count(), MAX_TEMPLATE);
        assert!(t.ends_with("..."));
    }

    #[test]
    fn every_part_of_the_key_counts() {
        let base = key("boom", Some("v1"));
        let fp = base.fingerprint();
        assert!(is_fingerprint(&fp), "{fp}");
        let others = [
            Key {
                queue: "other",
                ..base
            },
            Key {
                failure_kind: FailureKind::Invalid,
                ..base
            },
            Key {
                service_version: None,
                ..base
            },
            Key {
                error_class: Some("E"),
                ..base
            },
            Key {
                reason: "bang",
                ..base
            },
        ];
        for other in others {
            assert_ne!(other.fingerprint(), fp, "{other:?}");
        }
        // Length prefixes: moving text from one part to the next is another key.
        let a = Key {
            service_version: Some("ab"),
            error_class: Some("c"),
            ..base
        };
        let b = Key {
            service_version: Some("a"),
            error_class: Some("bc"),
            ..base
        };
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    /// Records keep their label for ever: these must never change (a change needs a new
    /// scheme and a migration of every record's label).
    #[test]
    fn known_fingerprints_are_pinned() {
        let pinned = [
            (
                key(
                    "timeout after 3021 ms talking to payer 7f3a9c21",
                    Some("relayer@1.4.2"),
                ),
                "b2fcbc9d65",
            ),
            (key("no luck after 3 deliveries", None), "716779e2ab"),
            (
                Key {
                    queue: "orders",
                    failure_kind: FailureKind::Invalid,
                    service_version: Some("orders@2.0.0"),
                    error_class: Some("java.lang.IllegalStateException"),
                    reason: "field \"amount\" is not a number",
                },
                "ef5d3fb3e9",
            ),
            // Fingerprints that changed once (issue 45 item 12, issue 44 item 6): these ids
            // were not masked before, and each record was a group of its own.
            (
                key("timeout talking to payer baaeaaed", Some("relayer@1.4.2")),
                "bc30a95e39",
            ),
            (
                key("charge pi_psHMeLRpDKwPMJaRaIsAMVrz declined", None),
                "79c3c532af",
            ),
            (key("amount 1,024.00 over limit", None), "60b919744e"),
            (key("retry ٣٠٢١ of order", None), "ed25546342"),
        ];
        for (key, want) in pinned {
            assert_eq!(key.fingerprint(), want, "{key:?}");
        }
    }

    #[test]
    fn error_classes_are_bounded_and_trimmed() {
        assert_eq!(bounded_error_class("  "), None);
        assert_eq!(bounded_error_class(" E ").as_deref(), Some("E"));
        let long = "x".repeat(1000);
        assert_eq!(
            bounded_error_class(&long).map(|c| c.len()),
            Some(MAX_ERROR_CLASS)
        );
    }
}

#[cfg(test)]
mod cost {
    use super::*;

    /// What grouping adds to a park: one fingerprint of a realistic reason (the bench's
    /// parks take milliseconds at the apiserver). `cargo test -p dlq-core --release --lib
    /// fingerprint_cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn fingerprint_cost() {
        let reasons: Vec<String> = (0..1000)
            .map(|i| {
                format!(
                    "timeout after {} ms talking to payer {:08x} at 10.0.{}.{}:8443 for order \"pi_{i:04}\" (trace 123e4567-e89b-12d3-a456-{:012x})",
                    i * 7,
                    i * 7919,
                    i % 250,
                    i % 7,
                    i
                )
            })
            .collect();
        let start = std::time::Instant::now();
        let mut n = 0usize;
        for _ in 0..10 {
            for r in &reasons {
                let k = Key {
                    queue: "relayer",
                    failure_kind: FailureKind::Transient,
                    service_version: Some("relayer@1.4.2"),
                    error_class: None,
                    reason: r,
                };
                n += k.fingerprint().len();
            }
        }
        let per = start.elapsed() / 10_000;
        eprintln!(
            "fingerprint of a {}-character reason: {per:?} each ({n})",
            reasons[0].len()
        );
        let long = "x1 ".repeat(341);
        let long = long.trim_end();
        let start = std::time::Instant::now();
        for _ in 0..1000 {
            n += template(long).len();
        }
        eprintln!(
            "template of a {}-character reason of 341 numbers: {:?} each ({n})",
            long.len(),
            start.elapsed() / 1000
        );
    }
}
