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
}
