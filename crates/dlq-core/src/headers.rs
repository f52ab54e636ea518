//! Header codecs shared by a backend's source (broker → record) and target (record → broker),
//! so what a source keeps is exactly what the target puts back.

/// NATS: a header may have several values; a record's header has one. Single values are
/// carried as they are; repeated headers travel together in one job header, [`nats::MULTI_HEADER`]
/// (a JSON object of name to list of values), which the target expands again.
pub mod nats {
    use std::collections::BTreeMap;

    use crate::api;

    /// The job header holding NATS headers with more than one value (see the module doc).
    pub const MULTI_HEADER: &str = "nats-multi";

    /// The job headers of a NATS message (name to its values, in order), and the names a record
    /// cannot hold.
    pub fn carried_headers(
        headers: &BTreeMap<String, Vec<String>>,
    ) -> (BTreeMap<String, String>, Vec<String>) {
        let mut out = BTreeMap::new();
        let mut multi = serde_json::Map::new();
        let mut lost = Vec::new();
        for (name, values) in headers {
            // Publish preconditions, not data: carried back they would make every redrive fail.
            if name.to_ascii_lowercase().starts_with("nats-expected-") {
                continue;
            }
            match values.as_slice() {
                [one] if name != MULTI_HEADER => {
                    out.insert(name.clone(), one.clone());
                }
                _ => {
                    multi.insert(name.clone(), serde_json::json!(values));
                }
            }
        }
        if !multi.is_empty() {
            let json = serde_json::Value::Object(multi.clone()).to_string();
            if json.len() <= api::MAX_HEADER_VALUE_LEN {
                out.insert(MULTI_HEADER.into(), json);
            } else {
                lost.extend(multi.keys().cloned());
            }
        }
        for (name, value) in out.clone() {
            if value.len() > api::MAX_HEADER_VALUE_LEN {
                out.remove(&name);
                lost.push(name);
            }
        }
        while out.len() > api::MAX_HEADERS {
            let Some(name) = out.keys().next_back().cloned() else {
                break;
            };
            out.remove(&name);
            lost.push(name);
        }
        lost.sort();
        (out, lost)
    }

    /// Parses a NATS header block (`NATS/1.0\r\nName: value\r\n...`), keeping every value of a
    /// repeated header.
    pub fn parse_header_block(block: &[u8]) -> Result<BTreeMap<String, Vec<String>>, String> {
        let text = std::str::from_utf8(block).map_err(|_| "headers are not UTF-8".to_string())?;
        let mut lines = text.split("\r\n");
        match lines.next() {
            Some(first) if first.starts_with("NATS/1.0") => {}
            _ => return Err("header block does not start with NATS/1.0".into()),
        }
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for line in lines {
            if line.is_empty() {
                continue;
            }
            let (k, v) = line
                .split_once(':')
                .ok_or_else(|| format!("malformed header line {line:?}"))?;
            out.entry(k.to_string())
                .or_default()
                .push(v.trim().to_string());
        }
        Ok(out)
    }
}

/// SQS: message attributes are typed (`String`, `Number`, `Binary`, each with an optional
/// custom suffix such as `Number.int`). A plain `String` attribute is carried as a job header
/// of the same name; every other one travels in one job header, [`sqs::ATTRIBUTES_HEADER`] (a
/// JSON object of name to `{"DataType", "StringValue" | "BinaryValue" (base64)}`), so the
/// target sends back the same types and bytes. A FIFO message's group id is kept in
/// [`sqs::GROUP_HEADER`].
pub mod sqs {
    use std::collections::BTreeMap;

    use base64::Engine;
    use serde::{Deserialize, Serialize};

    use crate::api;

    /// The job header holding the attributes that are not plain strings (see the module doc).
    pub const ATTRIBUTES_HEADER: &str = "sqs-attributes";
    /// The job header holding a FIFO message's `MessageGroupId`.
    pub const GROUP_HEADER: &str = "sqs-message-group-id";
    /// SQS accepts at most this many message attributes per message.
    pub const MAX_ATTRIBUTES: usize = 10;

    /// One message attribute, as SQS types it.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Attribute {
        #[serde(rename = "DataType")]
        pub data_type: String,
        #[serde(
            rename = "StringValue",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        pub string_value: Option<String>,
        /// The bytes, base64 in the job header.
        #[serde(
            rename = "BinaryValue",
            default,
            skip_serializing_if = "Option::is_none",
            with = "b64"
        )]
        pub binary_value: Option<Vec<u8>>,
    }

    impl Attribute {
        pub fn string(value: impl Into<String>) -> Attribute {
            Attribute {
                data_type: "String".into(),
                string_value: Some(value.into()),
                binary_value: None,
            }
        }
    }

    mod b64 {
        use base64::Engine;
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(b) => s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
            let text = Option::<String>::deserialize(d)?;
            text.map(|t| {
                base64::engine::general_purpose::STANDARD
                    .decode(t)
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
        }
    }

    fn reserved(name: &str) -> bool {
        name == ATTRIBUTES_HEADER || name == GROUP_HEADER
    }

    /// The job headers of an SQS message (its attributes and FIFO group id), and the attribute
    /// names a record cannot hold (too large).
    pub fn to_headers(
        attributes: &BTreeMap<String, Attribute>,
        group_id: Option<&str>,
    ) -> (BTreeMap<String, String>, Vec<String>) {
        let mut out = BTreeMap::new();
        let mut typed = BTreeMap::new();
        for (name, attr) in attributes {
            match (&attr.string_value, &attr.binary_value) {
                (Some(v), None) if attr.data_type == "String" && !reserved(name) => {
                    out.insert(name.clone(), v.clone());
                }
                _ => {
                    typed.insert(name.clone(), attr.clone());
                }
            }
        }
        let mut lost = Vec::new();
        if !typed.is_empty() {
            let json = serde_json::to_string(&typed).unwrap_or_default();
            if json.len() <= api::MAX_HEADER_VALUE_LEN {
                out.insert(ATTRIBUTES_HEADER.into(), json);
            } else {
                lost.extend(typed.keys().cloned());
            }
        }
        out.retain(|name, value| {
            let keep = value.len() <= api::MAX_HEADER_VALUE_LEN;
            if !keep {
                lost.push(name.clone());
            }
            keep
        });
        if let Some(g) = group_id {
            out.insert(GROUP_HEADER.into(), g.to_string());
        }
        lost.sort();
        (out, lost)
    }

    /// Why a job's headers cannot be sent to SQS untouched.
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    pub enum AttributesError {
        #[error("job header {ATTRIBUTES_HEADER} is not valid: {0}")]
        Malformed(String),
        #[error("{count} message attributes; SQS carries at most {MAX_ATTRIBUTES}")]
        TooMany { count: usize },
        #[error("header {0:?} is not a valid SQS attribute name")]
        BadName(String),
    }

    /// A job's headers back as SQS attributes, and its FIFO group id.
    pub fn from_headers(
        headers: &BTreeMap<String, String>,
    ) -> Result<(BTreeMap<String, Attribute>, Option<String>), AttributesError> {
        let mut attrs = BTreeMap::new();
        for (name, value) in headers {
            if !reserved(name) {
                attrs.insert(name.clone(), Attribute::string(value.clone()));
            }
        }
        if let Some(json) = headers.get(ATTRIBUTES_HEADER) {
            let typed: BTreeMap<String, Attribute> = serde_json::from_str(json)
                .map_err(|e| AttributesError::Malformed(e.to_string()))?;
            for (name, attr) in typed {
                if attr.string_value.is_some() == attr.binary_value.is_some() {
                    return Err(AttributesError::Malformed(format!(
                        "{name} needs exactly one of StringValue and BinaryValue"
                    )));
                }
                attrs.insert(name, attr);
            }
        }
        if attrs.len() > MAX_ATTRIBUTES {
            return Err(AttributesError::TooMany { count: attrs.len() });
        }
        if let Some(bad) = attrs.keys().find(|n| !valid_name(n)) {
            return Err(AttributesError::BadName(bad.clone()));
        }
        Ok((attrs, headers.get(GROUP_HEADER).cloned()))
    }

    /// SQS's attribute name rule: 1-256 of `A-Za-z0-9_-.`, no leading/trailing or double
    /// period, not starting with `AWS.` or `Amazon.`.
    pub fn valid_name(name: &str) -> bool {
        let lower = name.to_ascii_lowercase();
        !name.is_empty()
            && name.len() <= 256
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            && !name.starts_with('.')
            && !name.ends_with('.')
            && !name.contains("..")
            && !lower.starts_with("aws.")
            && !lower.starts_with("amazon.")
    }

    /// Whether SQS accepts `text` as a message body (XML 1.0 characters only).
    pub fn valid_body(text: &str) -> bool {
        text.chars().all(|c| {
            matches!(c, '\u{9}' | '\u{a}' | '\u{d}' | '\u{20}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}' | '\u{10000}'..='\u{10ffff}')
        })
    }

    /// base64 of bytes, for tests and callers building [`Attribute`]s by hand.
    pub fn encode_binary(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn typed_attributes_round_trip_through_job_headers() {
            let mut attrs = BTreeMap::new();
            attrs.insert("trace".to_string(), Attribute::string("abc"));
            attrs.insert(
                "n".to_string(),
                Attribute {
                    data_type: "Number.int".into(),
                    string_value: Some("42".into()),
                    binary_value: None,
                },
            );
            attrs.insert(
                "blob".to_string(),
                Attribute {
                    data_type: "Binary".into(),
                    string_value: None,
                    binary_value: Some(vec![0, 255, 7]),
                },
            );
            attrs.insert(
                GROUP_HEADER.to_string(),
                Attribute::string("clash: kept typed"),
            );
            let (headers, lost) = to_headers(&attrs, Some("g1"));
            assert!(lost.is_empty());
            assert_eq!(headers.get("trace").map(String::as_str), Some("abc"));
            assert!(!headers.contains_key("n"));
            assert_eq!(headers.get(GROUP_HEADER).map(String::as_str), Some("g1"));
            let (back, group) = from_headers(&headers).expect("decodes");
            assert_eq!(back, attrs);
            assert_eq!(group.as_deref(), Some("g1"));
        }

        #[test]
        fn what_sqs_cannot_carry_is_refused() {
            let many: BTreeMap<String, String> =
                (0..11).map(|i| (format!("h{i}"), "v".into())).collect();
            assert_eq!(
                from_headers(&many),
                Err(AttributesError::TooMany { count: 11 })
            );
            let bad: BTreeMap<String, String> = [("x trace".to_string(), "v".to_string())].into();
            assert!(matches!(
                from_headers(&bad),
                Err(AttributesError::BadName(_))
            ));
            assert!(!valid_name("AWS.x") && valid_name("x-trace.id"));
            assert!(valid_body("héllo\n") && !valid_body("a\u{0}b"));
        }
    }
}
