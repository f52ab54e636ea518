//! Masking a payload shown to a human (`kubectl dlq show`, the page): card numbers, and the
//! values at a queue's `spec.protection.maskPaths`.
//!
//! A card number is a run of 13 to 19 digits, possibly grouped by single spaces or dashes, that
//! passes the Luhn check; it shows its first six and last four digits only (PCI DSS 3.4.1), the
//! separators kept in place. Display only: records, redrive and the reveal API keep the bytes.

use serde_json::Value;

/// What a masked JSON path's value shows.
pub const MASKED: &str = "****";

/// `text` with every card number masked and, when it is JSON and `paths` are given, the values
/// at those paths replaced by [`MASKED`] (the JSON is then re-serialized, compact).
pub fn mask_payload(text: &str, paths: &[String]) -> String {
    let cards_masked = mask_cards(text);
    if paths.is_empty() {
        return cards_masked;
    }
    match serde_json::from_str::<Value>(&cards_masked) {
        Ok(mut value) => {
            for path in paths {
                mask_path(&mut value, path);
            }
            serde_json::to_string(&value).unwrap_or(cards_masked)
        }
        Err(_) => cards_masked,
    }
}

/// `text` with every Luhn-valid run of 13–19 digits (spaces or dashes between them allowed)
/// showing only its first six and last four digits.
pub fn mask_cards(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let end = run_end(bytes, i);
            out.push_str(&mask_run(&text[i..end]));
            i = end;
        } else {
            let next = text[i..]
                .find(|c: char| c.is_ascii_digit())
                .map_or(text.len(), |n| i + n);
            out.push_str(&text[i..next]);
            i = next;
        }
    }
    out
}

/// [`mask_cards`] over bytes that need not be text (a binary payload): card numbers written
/// as ASCII digits are masked in place, every other byte is kept, so the length never changes.
pub fn mask_card_bytes(bytes: &[u8]) -> Vec<u8> {
    // Every byte becomes one ASCII character (non-ASCII ones a NUL, which is no digit and no
    // separator), so the masked text lines up with the bytes position for position.
    let ascii: String = bytes
        .iter()
        .map(|&b| if b.is_ascii() { b as char } else { '\0' })
        .collect();
    let masked = mask_cards(&ascii);
    bytes
        .iter()
        .zip(masked.bytes())
        .map(|(&b, m)| {
            if m == b'*' && b.is_ascii_digit() {
                b'*'
            } else {
                b
            }
        })
        .collect()
}

/// The end of the digit run starting at `start`: digits, each pair possibly separated by one
/// space or dash.
fn run_end(bytes: &[u8], start: usize) -> usize {
    let mut end = start;
    let mut i = start;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            i += 1;
            end = i;
        } else if (bytes[i] == b' ' || bytes[i] == b'-')
            && bytes.get(i + 1).is_some_and(u8::is_ascii_digit)
        {
            i += 1;
        } else {
            break;
        }
    }
    end
}

/// One run: its groups (split at separators) scanned left to right, the longest window of
/// groups that is a card number masked at each step.
fn mask_run(run: &str) -> String {
    let groups = digit_groups(run);
    let mut out: Vec<u8> = run.as_bytes().to_vec();
    let mut g = 0;
    while g < groups.len() {
        match longest_card(run, &groups, g) {
            Some(last) => {
                mask_span(&mut out, groups[g].0, groups[last].1);
                g = last + 1;
            }
            None => g += 1,
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| run.to_string())
}

/// (start, end) of each group of digits in `run`.
fn digit_groups(run: &str) -> Vec<(usize, usize)> {
    let mut groups = Vec::new();
    let mut start = None;
    for (i, b) in run.bytes().enumerate() {
        match (b.is_ascii_digit(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                groups.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        groups.push((s, run.len()));
    }
    groups
}

/// The last group of the longest window starting at group `first` whose digits are a card
/// number.
fn longest_card(run: &str, groups: &[(usize, usize)], first: usize) -> Option<usize> {
    (first..groups.len()).rev().find(|&last| {
        let digits: Vec<u8> = run.as_bytes()[groups[first].0..groups[last].1]
            .iter()
            .filter(|b| b.is_ascii_digit())
            .map(|b| b - b'0')
            .collect();
        (13..=19).contains(&digits.len()) && luhn(&digits)
    })
}

/// Replaces every digit of `out[start..end]` but the first six and last four with `*`.
fn mask_span(out: &mut [u8], start: usize, end: usize) {
    let positions: Vec<usize> = (start..end).filter(|&i| out[i].is_ascii_digit()).collect();
    let keep_tail = positions.len().saturating_sub(4);
    for &i in positions.iter().take(keep_tail).skip(6) {
        out[i] = b'*';
    }
}

/// The Luhn check over decimal digits (0–9 each).
pub fn luhn(digits: &[u8]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| {
            let d = u32::from(d);
            if !i.is_multiple_of(2) {
                let twice = d * 2;
                if twice > 9 { twice - 9 } else { twice }
            } else {
                d
            }
        })
        .sum();
    !digits.is_empty() && sum.is_multiple_of(10)
}

/// Replaces the values at `path` (`$.a.b`, `$.items[0].pan`, `$.items[*].pan`, `$.*.x`) with
/// [`MASKED`]; a path that matches nothing changes nothing.
pub fn mask_path(value: &mut Value, path: &str) {
    let Some(path) = JsonPath::parse(path) else {
        return;
    };
    mask_at(value, &path.0);
}

/// A path into a JSON value in the grammar of a queue's mask paths (`$.a.b`, `$.items[0].pan`,
/// `$.items[*].pan`, `$.*.x`): also what `kubectl dlq ls --where payload.PATH=VALUE` reads, so
/// a path means the same wherever it is written.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonPath(Vec<Segment>);

#[derive(Debug, Clone, PartialEq)]
enum Segment {
    Key(String),
    Index(usize),
    Any,
}

impl JsonPath {
    /// The path, or None when it is not one (no `$`, a bad index, nothing after `$`).
    pub fn parse(path: &str) -> Option<JsonPath> {
        parse_path(path).map(JsonPath)
    }

    /// How many steps the path takes (a bound for paths people type).
    pub fn depth(&self) -> usize {
        self.0.len()
    }

    /// The values the path reaches in `value` (several through `*`; none when it leads nowhere).
    pub fn values<'a>(&self, value: &'a Value) -> Vec<&'a Value> {
        let mut here = vec![value];
        for segment in &self.0 {
            here = here
                .into_iter()
                .flat_map(|v| children(v, segment))
                .collect();
        }
        here
    }
}

/// The children of `value` one segment reaches.
fn children<'a>(value: &'a Value, segment: &Segment) -> Vec<&'a Value> {
    match (segment, value) {
        (Segment::Key(k), Value::Object(map)) => map.get(k).into_iter().collect(),
        (Segment::Index(n), Value::Array(items)) => items.get(*n).into_iter().collect(),
        (Segment::Any, Value::Array(items)) => items.iter().collect(),
        (Segment::Any, Value::Object(map)) => map.values().collect(),
        _ => Vec::new(),
    }
}

fn parse_path(path: &str) -> Option<Vec<Segment>> {
    let rest = path.strip_prefix('$')?;
    let mut segments = Vec::new();
    for part in rest.split('.').skip(1) {
        let (key, indexes) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        match key {
            "" => {}
            "*" => segments.push(Segment::Any),
            k => segments.push(Segment::Key(k.to_string())),
        }
        for index in indexes.split('[').skip(1) {
            let index = index.strip_suffix(']')?;
            segments.push(match index {
                "*" => Segment::Any,
                n => Segment::Index(n.parse().ok()?),
            });
        }
    }
    (!segments.is_empty()).then_some(segments)
}

fn mask_at(value: &mut Value, segments: &[Segment]) {
    let Some((first, rest)) = segments.split_first() else {
        *value = Value::String(MASKED.into());
        return;
    };
    let children: Vec<&mut Value> = match (first, value) {
        (Segment::Key(k), Value::Object(map)) => map.get_mut(k).into_iter().collect(),
        (Segment::Index(n), Value::Array(items)) => items.get_mut(*n).into_iter().collect(),
        (Segment::Any, Value::Array(items)) => items.iter_mut().collect(),
        (Segment::Any, Value::Object(map)) => map.values_mut().collect(),
        _ => Vec::new(),
    };
    for child in children {
        mask_at(child, rest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_payloads_have_their_card_numbers_masked_in_place() {
        let mut bytes = vec![0xff, 0x00];
        bytes.extend_from_slice(b"4111111111111111");
        bytes.extend_from_slice(&[0xc3, 0x28, b'7']);
        let masked = mask_card_bytes(&bytes);
        assert_eq!(masked.len(), bytes.len());
        assert_eq!(&masked[2..18], b"411111******1111");
        assert_eq!(&masked[..2], &bytes[..2]);
        assert_eq!(&masked[18..], &bytes[18..]);
    }

    #[test]
    fn card_numbers_show_first_six_and_last_four() {
        assert_eq!(
            mask_cards(r#"{"card":"4111111111111111"}"#),
            r#"{"card":"411111******1111"}"#
        );
        assert_eq!(
            mask_cards("pan 4111-1111-1111-1111 ok"),
            "pan 4111-11**-****-1111 ok"
        );
        assert_eq!(
            mask_cards("pan 4111 1111 1111 1111 1234"),
            "pan 4111 11** **** 1111 1234"
        );
        assert_eq!(
            mask_cards("{\"n\":4111111111111111}"),
            "{\"n\":411111******1111}"
        );
    }

    #[test]
    fn other_numbers_stay() {
        for text in [
            "4111111111111112",     // Luhn fails
            "411111111111",         // 12 digits
            "41111111111111111111", // 20 digits
            "order 12345, amount 10.00",
            "2026-11-29T10:00:00Z",
        ] {
            assert_eq!(mask_cards(text), text);
        }
    }

    #[test]
    fn luhn_known_values() {
        let digits = |s: &str| s.bytes().map(|b| b - b'0').collect::<Vec<_>>();
        assert!(luhn(&digits("4111111111111111")));
        assert!(luhn(&digits("5555555555554444")));
        assert!(luhn(&digits("378282246310005")));
        assert!(!luhn(&digits("4111111111111121")));
        assert!(!luhn(&[]));
    }

    #[test]
    fn paths_are_masked() {
        let paths = vec![
            "$.holder.name".to_string(),
            "$.items[*].token".to_string(),
            "$.cvv".to_string(),
            "$.missing.x".to_string(),
        ];
        let masked = mask_payload(
            r#"{"holder":{"name":"Ada","id":7},"items":[{"token":"t1"},{"token":"t2"}],"cvv":123}"#,
            &paths,
        );
        assert_eq!(
            masked,
            r#"{"cvv":"****","holder":{"id":7,"name":"****"},"items":[{"token":"****"},{"token":"****"}]}"#
        );
        assert_eq!(
            mask_payload("not json 4111111111111111", &paths),
            "not json 411111******1111"
        );
    }

    #[test]
    fn paths_read_the_values_they_mask() {
        let v: Value = serde_json::from_str(
            r#"{"customer":{"id":"cus_42"},"items":[{"sku":"a"},{"sku":"b"}],"n":7}"#,
        )
        .expect("json");
        let at = |p: &str| {
            JsonPath::parse(p).map(|path| path.values(&v).into_iter().cloned().collect::<Vec<_>>())
        };
        assert_eq!(at("$.customer.id"), Some(vec![Value::from("cus_42")]));
        assert_eq!(at("$.items[1].sku"), Some(vec![Value::from("b")]));
        assert_eq!(
            at("$.items[*].sku"),
            Some(vec![Value::from("a"), Value::from("b")])
        );
        assert_eq!(at("$.n"), Some(vec![Value::from(7)]));
        assert_eq!(at("$.missing.x"), Some(vec![]));
        assert_eq!(at("$.n.deeper"), Some(vec![]));
        for bad in ["customer", "$", "$.a[x]", "$.a[1"] {
            assert_eq!(JsonPath::parse(bad), None, "{bad}");
        }
        assert_eq!(JsonPath::parse("$.a.b[0]").map(|p| p.depth()), Some(3));
    }

    #[test]
    fn bad_paths_change_nothing() {
        let text = r#"{"a":1}"#;
        for path in ["a.b", "$", "$.a[x]", "$.a[1"] {
            assert_eq!(mask_payload(text, &[path.to_string()]), text);
        }
    }
}
