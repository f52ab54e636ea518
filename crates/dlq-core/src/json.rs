//! Reading the few members a dead message's JSON is looked at for, without reading the rest
//! into JSON values: an array or object of small items takes many times its text as values (a
//! 4 MiB array of small numbers took 67 MB), so one dead message read whole could take the
//! operator past its memory limit, and again after each restart, since it is taken again.

use std::collections::HashMap;

use serde_json::Value;
use serde_json::value::RawValue;

/// The longest JSON text of a member that is not a string read into values: strings are read
/// whatever their length (their value is no larger than their text).
pub const MAX_VALUE_JSON: usize = 64 * 1024;

/// Why a JSON text is not an object whose members can be read.
#[derive(Debug)]
pub enum NotObject {
    /// Not JSON at all.
    Syntax(serde_json::Error),
    /// JSON of another shape: "a JSON array", "a JSON string", ...
    Shape(&'static str),
}

/// A member too large to be read into values (see [`MAX_VALUE_JSON`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("member `{name}` is {len} bytes of JSON that is not a string, more than the {max} read")]
pub struct TooLarge {
    pub name: String,
    pub len: usize,
    pub max: usize,
}

/// The members of the JSON object `raw`, as their text (a repeated name: its last value, as
/// JSON values read it).
pub fn members(raw: &[u8]) -> Result<HashMap<String, &RawValue>, NotObject> {
    match serde_json::from_slice(raw) {
        Ok(members) => Ok(members),
        Err(_) => match serde_json::from_slice::<serde::de::IgnoredAny>(raw) {
            Err(e) => Err(NotObject::Syntax(e)),
            Ok(_) => Err(NotObject::Shape(shape(raw))),
        },
    }
}

/// What JSON text `raw`, which is not an object, is.
fn shape(raw: &[u8]) -> &'static str {
    match raw.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => "a JSON array",
        Some(b'"') => "a JSON string",
        Some(b't' | b'f') => "a JSON boolean",
        Some(b'n') => "JSON null",
        _ => "a JSON number",
    }
}

/// One member's value: a string whatever its length, anything else up to [`MAX_VALUE_JSON`].
pub fn value(name: &str, text: &RawValue) -> Result<Value, TooLarge> {
    let json = text.get();
    if !json.starts_with('"') && json.len() > MAX_VALUE_JSON {
        return Err(TooLarge {
            name: name.to_string(),
            len: json.len(),
            max: MAX_VALUE_JSON,
        });
    }
    // RawValue holds valid JSON: it reads back.
    Ok(serde_json::from_str(json).unwrap_or(Value::Null))
}

/// The object of `members` to deserialize a type from: the members `read` names with their
/// values ([`value`]), the others present as null (so a type that refuses unknown members
/// still sees their names) or left out (`keep_others` false).
pub fn object(
    members: &HashMap<String, &RawValue>,
    read: &[&str],
    keep_others: bool,
) -> Result<Value, TooLarge> {
    let mut object = serde_json::Map::new();
    for (name, text) in members {
        if read.contains(&name.as_str()) {
            object.insert(name.clone(), value(name, text)?);
        } else if keep_others {
            object.insert(name.clone(), Value::Null);
        }
    }
    Ok(Value::Object(object))
}

/// Decodes the JSON string whose text (its quotes included) is `buf[text]`, in its own place:
/// its value is written from `text.start` on (an escape is never shorter than what it stands
/// for, so writing never overtakes reading). With `write` false nothing is written: a first
/// pass says whether, and to how many bytes, it decodes. `None`: not a string a `String` can
/// hold (not quoted, a bad escape, a lone surrogate), or `text` outside `buf`.
///
/// So a large string member is read out of its message without a second buffer: the message
/// and the value read from it are never held at once.
pub fn unescape_in_place(
    buf: &mut [u8],
    text: std::ops::Range<usize>,
    write: bool,
) -> Option<usize> {
    let quoted = buf.get(text.clone())?;
    if quoted.len() < 2 || quoted.first() != Some(&b'"') || quoted.last() != Some(&b'"') {
        return None;
    }
    let (stop, mut read, mut wrote) = (text.end - 1, text.start + 1, text.start);
    while read < stop {
        if buf[read] != b'\\' {
            let run = buf[read..stop]
                .iter()
                .position(|b| *b == b'\\')
                .map_or(stop, |at| read + at);
            if write {
                buf.copy_within(read..run, wrote);
            }
            wrote += run - read;
            read = run;
            continue;
        }
        let (c, used) = escape(buf.get(read + 1..stop)?)?;
        let mut utf8 = [0u8; 4];
        let c = c.encode_utf8(&mut utf8).as_bytes();
        if write {
            buf[wrote..wrote + c.len()].copy_from_slice(c);
        }
        wrote += c.len();
        read += 1 + used;
    }
    Some(wrote - text.start)
}

/// The character the escape after a backslash (`rest`) stands for, and how many bytes of
/// `rest` it takes.
fn escape(rest: &[u8]) -> Option<(char, usize)> {
    let c = match rest.first()? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => return unicode_escape(rest),
        _ => return None,
    };
    Some((c, 1))
}

/// `uXXXX`, or a surrogate pair `uD83D\uDE00`.
fn unicode_escape(rest: &[u8]) -> Option<(char, usize)> {
    let high = hex4(rest.get(1..5)?)?;
    if !(0xD800..0xE000).contains(&high) {
        return Some((char::from_u32(high)?, 5));
    }
    if high >= 0xDC00 || rest.get(5..7)? != b"\\u" {
        return None;
    }
    let low = hex4(rest.get(7..11)?)?;
    if !(0xDC00..0xE000).contains(&low) {
        return None;
    }
    let c = char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))?;
    Some((c, 11))
}

fn hex4(digits: &[u8]) -> Option<u32> {
    if !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_as_text_and_only_named_ones_as_values() {
        let raw = br#"{"id":"a","big":[1,2,3],"id":"b","s":"x"}"#;
        let m = members(raw).expect("an object");
        assert_eq!(m["id"].get(), r#""b""#, "the last of a repeated name");
        let o = object(&m, &["id", "s"], false).expect("read");
        assert_eq!(o, serde_json::json!({"id": "b", "s": "x"}));
        let o = object(&m, &["id"], true).expect("read");
        assert_eq!(o, serde_json::json!({"id": "b", "big": null, "s": null}));

        let long = format!(
            r#"{{"a":[{}0],"s":"{}"}}"#,
            "0,".repeat(40_000),
            "x".repeat(100_000)
        );
        let m = members(long.as_bytes()).expect("an object");
        assert!(value("s", m["s"]).is_ok(), "a string of any length");
        let err = value("a", m["a"]).expect_err("too large");
        assert_eq!((err.name.as_str(), err.max), ("a", MAX_VALUE_JSON));

        for (raw, want) in [
            (&b" [1]"[..], "a JSON array"),
            (b"\"s\"", "a JSON string"),
            (b"true", "a JSON boolean"),
            (b"null", "JSON null"),
            (b"-1.5", "a JSON number"),
        ] {
            assert!(
                matches!(members(raw), Err(NotObject::Shape(s)) if s == want),
                "{want}"
            );
        }
        assert!(matches!(members(b"{\"a\":"), Err(NotObject::Syntax(_))));
    }

    /// Every string serde reads decodes in place to what serde reads, in both passes; what
    /// serde refuses (a lone surrogate, a bad escape) does not decode.
    #[test]
    fn a_string_decodes_in_its_own_place_as_serde_reads_it() {
        let strings = [
            r#""""#,
            r#""plain""#,
            r#""{\"a\":1,\"b\":\"x\\y\"}\n\t\r\b\f\/""#,
            r#""\u00e9t\u00E9 \ud83d\ude00 \u20ac""#,
            "\"d\u{e9}j\u{e0} \u{1F600}\\\"\"",
        ];
        for text in strings {
            let want: String = serde_json::from_str(text).expect("a JSON string");
            let mut buf = format!("{{\"x\":{text}}}").into_bytes();
            let at = 5..5 + text.len();
            let len = unescape_in_place(&mut buf, at.clone(), false);
            assert_eq!(len, Some(want.len()), "{text}");
            assert_eq!(unescape_in_place(&mut buf, at, true), Some(want.len()));
            assert_eq!(&buf[5..5 + want.len()], want.as_bytes(), "{text}");
        }
        for bad in [
            r#""\ud83d""#,
            r#""\ude00x""#,
            r#""\ud83d\u0041""#,
            r#""\x""#,
            r#""\"#,
            "x",
            r#""\u12""#,
            r#""\u+123""#,
            r#""\""#,
        ] {
            let mut buf = bad.as_bytes().to_vec();
            let len = buf.len();
            assert_eq!(unescape_in_place(&mut buf, 0..len, false), None, "{bad}");
        }
        assert_eq!(unescape_in_place(&mut b"\"a\"".to_vec(), 0..9, false), None);
    }
}
