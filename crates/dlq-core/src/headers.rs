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
/// of the same name (unless its value has CR, LF or NUL, which a record cannot hold); every
/// other one travels in one job header, [`sqs::ATTRIBUTES_HEADER`] (a
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
                (Some(v), None)
                    if attr.data_type == "String"
                        && !reserved(name)
                        && crate::park::header_holdable(name, v) =>
                {
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
            let crlf: BTreeMap<String, Attribute> =
                [("note".to_string(), Attribute::string("a\r\nb"))].into();
            let (headers, lost) = to_headers(&crlf, None);
            assert!(
                lost.is_empty() && !headers.contains_key("note"),
                "{headers:?}"
            );
            assert_eq!(from_headers(&headers).expect("decodes").0, crlf);
            assert!(valid_body("héllo\n") && !valid_body("a\u{0}b"));
        }
    }
}

/// Kafka: record headers are (name, bytes) pairs, may repeat and may be null; a job header is one
/// UTF-8 value per name. Distinct UTF-8 headers are carried as they are; everything else (a
/// repeated name, a binary or null value, a name this codec reserves, a name that is not a
/// token or a value with CR, LF or NUL, which a record cannot hold) travels losslessly in
/// [`kafka::RAW_HEADER`] (a JSON list of `[name, base64 | null]`), which the target expands
/// again. The record key is bytes too: [`kafka::KEY_HEADER`] when UTF-8, else
/// [`kafka::KEY_BASE64_HEADER`]. Dead-letter bookkeeping headers (Spring's `kafka_dlt-*`, Kafka
/// Connect's `__connect.errors.*`) are read into the record's origin and reason, not carried:
/// a redrive must not look like a dead letter again.
pub mod kafka {
    use std::collections::BTreeMap;

    use crate::park::header_holdable;

    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;

    use crate::api;

    /// The job header holding the record key when it is UTF-8.
    pub const KEY_HEADER: &str = "kafka-key";
    /// The job header holding the record key (base64) when it is not UTF-8.
    pub const KEY_BASE64_HEADER: &str = "kafka-key-base64";
    /// The job header holding headers a plain job header cannot (see the module doc).
    pub const RAW_HEADER: &str = "kafka-headers-raw";

    /// Spring Kafka's `DeadLetterPublishingRecoverer` headers.
    pub const SPRING_PREFIX: &str = "kafka_dlt-";
    /// Kafka Connect's `errors.deadletterqueue.context.headers.enable` headers.
    pub const CONNECT_PREFIX: &str = "__connect.errors.";

    /// One Kafka record header.
    pub type Header = (String, Option<Vec<u8>>);

    /// What the dead-letter bookkeeping headers say about where the record came from and why.
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub struct DeadLetterInfo {
        pub topic: Option<String>,
        pub partition: Option<i32>,
        pub offset: Option<i64>,
        /// Milliseconds since the epoch of the original record.
        pub timestamp: Option<i64>,
        /// `exception class: message`, when a bookkeeping header said.
        pub reason: Option<String>,
        /// The exception class alone (Spring's `kafka_dlt-exception-fqcn`, Connect's
        /// `__connect.errors.exception.class.name`), bounded: the record's error class.
        pub error_class: Option<String>,
    }

    /// Whether `name` is dead-letter bookkeeping (never carried back on redrive).
    pub fn is_bookkeeping(name: &str) -> bool {
        name.starts_with(SPRING_PREFIX) || name.starts_with(CONNECT_PREFIX)
    }

    fn reserved(name: &str) -> bool {
        name == KEY_HEADER || name == KEY_BASE64_HEADER || name == RAW_HEADER
    }

    fn text(v: &Option<Vec<u8>>) -> Option<String> {
        v.as_ref()
            .and_then(|b| std::str::from_utf8(b).ok())
            .map(str::to_string)
    }

    /// Spring writes partition as a 4-byte and offset/timestamp as 8-byte big-endian integers;
    /// Connect writes decimal text. Both are accepted.
    fn number(v: &Option<Vec<u8>>) -> Option<i64> {
        let b = v.as_ref()?;
        match b.len() {
            4 => Some(i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))),
            8 => {
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                Some(i64::from_be_bytes(a))
            }
            _ => std::str::from_utf8(b).ok()?.trim().parse().ok(),
        }
    }

    /// Reads the bookkeeping headers of a dead-letter-topic record.
    pub fn dead_letter_info(headers: &[Header]) -> DeadLetterInfo {
        let get = |name: &str| {
            headers
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let pick = |spring: &str, connect: &str| {
            get(&format!("{SPRING_PREFIX}{spring}"))
                .or_else(|| get(&format!("{CONNECT_PREFIX}{connect}")))
        };
        let class = pick("exception-fqcn", "exception.class.name").and_then(|v| text(&v));
        let message = pick("exception-message", "exception.message").and_then(|v| text(&v));
        let error_class = class.as_deref().and_then(crate::group::bounded_error_class);
        let reason = match (class, message) {
            (Some(c), Some(m)) => Some(format!("{c}: {m}")),
            (Some(c), None) => Some(c),
            (None, Some(m)) => Some(m),
            (None, None) => None,
        };
        DeadLetterInfo {
            topic: pick("original-topic", "topic").and_then(|v| text(&v)),
            partition: pick("original-partition", "partition")
                .and_then(|v| number(&v))
                .and_then(|n| i32::try_from(n).ok()),
            offset: pick("original-offset", "offset").and_then(|v| number(&v)),
            timestamp: get("kafka_dlt-original-timestamp").and_then(|v| number(&v)),
            reason,
            error_class,
        }
    }

    /// The job headers of a record's key and headers, and the names a record cannot hold (too
    /// long, too many). Bookkeeping headers are left out (see the module doc).
    pub fn to_headers(
        key: Option<&[u8]>,
        headers: &[Header],
    ) -> (BTreeMap<String, String>, Vec<String>) {
        let mut out = BTreeMap::new();
        let mut raw: Vec<serde_json::Value> = Vec::new();
        let kept: Vec<&Header> = headers.iter().filter(|(n, _)| !is_bookkeeping(n)).collect();
        for (name, value) in &kept {
            let repeated = kept.iter().filter(|(n, _)| n == name).count() > 1;
            match text(value) {
                Some(t) if !repeated && !reserved(name) && header_holdable(name, &t) => {
                    out.insert(name.clone(), t);
                }
                _ => raw.push(serde_json::json!([
                    name,
                    value.as_ref().map(|b| STANDARD.encode(b))
                ])),
            }
        }
        let mut lost = Vec::new();
        if !raw.is_empty() {
            let json = serde_json::Value::Array(raw).to_string();
            if json.len() <= api::MAX_HEADER_VALUE_LEN {
                out.insert(RAW_HEADER.into(), json);
            } else {
                lost.push(RAW_HEADER.to_string());
            }
        }
        match key.map(std::str::from_utf8) {
            Some(Ok(k)) => {
                out.insert(KEY_HEADER.into(), k.to_string());
            }
            Some(Err(_)) => {
                out.insert(
                    KEY_BASE64_HEADER.into(),
                    STANDARD.encode(key.unwrap_or_default()),
                );
            }
            None => {}
        }
        out.retain(|name, value| {
            let fits = value.len() <= api::MAX_HEADER_VALUE_LEN;
            if !fits {
                lost.push(name.clone());
            }
            fits
        });
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

    /// The record key and headers a job's headers stand for (inverse of [`to_headers`]);
    /// bookkeeping headers are dropped.
    pub fn from_headers(
        headers: &BTreeMap<String, String>,
    ) -> Result<(Option<Vec<u8>>, Vec<Header>), String> {
        let key = match (headers.get(KEY_HEADER), headers.get(KEY_BASE64_HEADER)) {
            (Some(k), _) => Some(k.as_bytes().to_vec()),
            (None, Some(b64)) => Some(
                STANDARD
                    .decode(b64)
                    .map_err(|e| format!("{KEY_BASE64_HEADER} is not base64: {e}"))?,
            ),
            (None, None) => None,
        };
        let mut out: Vec<Header> = headers
            .iter()
            .filter(|(n, _)| !reserved(n) && !is_bookkeeping(n))
            .map(|(n, v)| (n.clone(), Some(v.as_bytes().to_vec())))
            .collect();
        if let Some(json) = headers.get(RAW_HEADER) {
            let list: Vec<(String, Option<String>)> = serde_json::from_str(json)
                .map_err(|e| format!("{RAW_HEADER} is not a list of [name, base64]: {e}"))?;
            for (name, value) in list {
                if is_bookkeeping(&name) {
                    continue;
                }
                let value =
                    match value {
                        Some(b64) => Some(STANDARD.decode(b64).map_err(|e| {
                            format!("{RAW_HEADER} value of {name} is not base64: {e}")
                        })?),
                        None => None,
                    };
                out.push((name, value));
            }
        }
        Ok((key, out))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn h(name: &str, v: &[u8]) -> Header {
            (name.to_string(), Some(v.to_vec()))
        }

        #[test]
        fn spring_headers_give_origin_and_reason() {
            let headers = vec![
                h("kafka_dlt-original-topic", b"orders"),
                h("kafka_dlt-original-partition", &3i32.to_be_bytes()),
                h("kafka_dlt-original-offset", &42i64.to_be_bytes()),
                h(
                    "kafka_dlt-original-timestamp",
                    &1_700_000_000_000i64.to_be_bytes(),
                ),
                h(
                    "kafka_dlt-exception-fqcn",
                    b"java.lang.IllegalStateException",
                ),
                h("kafka_dlt-exception-message", b"bad amount"),
                h("trace", b"abc"),
            ];
            let info = dead_letter_info(&headers);
            assert_eq!(info.topic.as_deref(), Some("orders"));
            assert_eq!(info.partition, Some(3));
            assert_eq!(info.offset, Some(42));
            assert_eq!(info.timestamp, Some(1_700_000_000_000));
            assert_eq!(
                info.reason.as_deref(),
                Some("java.lang.IllegalStateException: bad amount")
            );
            assert_eq!(
                info.error_class.as_deref(),
                Some("java.lang.IllegalStateException")
            );
            let (job, lost) = to_headers(Some(b"k1"), &headers);
            assert!(lost.is_empty());
            assert_eq!(job.get("trace").map(String::as_str), Some("abc"));
            assert_eq!(job.get(KEY_HEADER).map(String::as_str), Some("k1"));
            assert!(!job.keys().any(|k| is_bookkeeping(k)), "{job:?}");
        }

        #[test]
        fn connect_headers_give_origin_and_reason() {
            let headers = vec![
                h("__connect.errors.topic", b"payments"),
                h("__connect.errors.partition", b"1"),
                h("__connect.errors.offset", b"7"),
                h(
                    "__connect.errors.exception.class.name",
                    b"org.apache.kafka.connect.errors.DataException",
                ),
                h(
                    "__connect.errors.exception.message",
                    b"Converting byte[] failed",
                ),
            ];
            let info = dead_letter_info(&headers);
            assert_eq!(info.topic.as_deref(), Some("payments"));
            assert_eq!((info.partition, info.offset), (Some(1), Some(7)));
            assert_eq!(
                info.error_class.as_deref(),
                Some("org.apache.kafka.connect.errors.DataException")
            );
            assert!(
                info.reason
                    .unwrap_or_default()
                    .contains("DataException: Converting")
            );
        }

        #[test]
        fn binary_repeated_and_null_headers_and_keys_round_trip() {
            let headers = vec![
                h("bin", &[0, 159, 255]),
                h("dup", b"a"),
                h("dup", b"b"),
                ("nil".to_string(), None),
                h(KEY_HEADER, b"spoof"),
                h("plain", b"x"),
                h("crlf", b"a\r\nInjected: 1"),
                h("bad name\r\n", b"v"),
            ];
            let key = [0u8, 1, 255];
            let (job, lost) = to_headers(Some(&key), &headers);
            assert!(lost.is_empty());
            assert!(job.contains_key(KEY_BASE64_HEADER));
            assert!(!job.contains_key("crlf"), "a record cannot hold CR/LF: raw");
            let mut req = crate::park::ParkRequest::new(
                "q",
                crate::api::Job {
                    id: "j".into(),
                    payload: Some("x".into()),
                    headers: job.clone(),
                    ..Default::default()
                },
            );
            req.reason = "r".into();
            assert_eq!(crate::park::validate(&req), Ok(()), "every header held");
            let (k, mut back) = from_headers(&job).expect("decodes");
            assert_eq!(k.as_deref(), Some(&key[..]));
            let mut want = headers.clone();
            want.sort();
            back.sort();
            assert_eq!(back, want);
        }

        #[test]
        fn redrive_never_carries_bookkeeping_headers() {
            let job: BTreeMap<String, String> = [
                ("kafka_dlt-original-topic".to_string(), "t".to_string()),
                ("__connect.errors.topic".to_string(), "t".to_string()),
                ("keep".to_string(), "v".to_string()),
            ]
            .into();
            let (key, back) = from_headers(&job).expect("decodes");
            assert_eq!(key, None);
            assert_eq!(back, vec![h("keep", b"v")]);
        }
    }
}

/// Google Cloud Pub/Sub: a message's attributes are its job's headers. Pub/Sub allows 100
/// attributes of any name; a record holds 64 headers with token names. A message whose
/// attributes a record cannot all hold is parked whole: its payload is the message as JSON
/// ([`Whole`]: its data, every attribute, its ordering key), marked by [`WHOLE_HEADER`] beside
/// the attributes a record can hold ([`held_headers`], for a person to read), and the target
/// publishes the message it holds ([`Whole::from_payload`]) instead of the payload.
pub mod pubsub {
    use std::collections::BTreeMap;

    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::Deserialize;

    use crate::api;
    use crate::park::{ParkInvalid, header_holdable, validate_headers};

    /// The header marking a job whose payload is a whole Pub/Sub message (value [`WHOLE_JSON`]).
    pub const WHOLE_HEADER: &str = "pubsub-whole-message";
    /// [`WHOLE_HEADER`]'s value: the payload is [`Whole`] as JSON.
    pub const WHOLE_JSON: &str = "json";

    /// A whole Pub/Sub message: what a redrive publishes again.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Whole {
        pub attributes: BTreeMap<String, String>,
        /// The data when it is UTF-8 (as a person reads it), else in `dataBase64`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub data_base64: Option<String>,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub ordering_key: String,
    }

    impl Whole {
        pub fn new(data: &[u8], attributes: &BTreeMap<String, String>, ordering_key: &str) -> Self {
            let (data, data_base64) = match std::str::from_utf8(data) {
                Ok(text) => (Some(text.to_string()), None),
                Err(_) => (None, Some(STANDARD.encode(data))),
            };
            Whole {
                attributes: attributes.clone(),
                data,
                data_base64,
                ordering_key: ordering_key.to_string(),
            }
        }

        /// The message as the payload of its record: canonical JSON (keys sorted), so the same
        /// message is always the same bytes.
        pub fn to_payload(&self) -> Vec<u8> {
            use serde_json::{Map, Value};
            let attributes: Map<String, Value> = self
                .attributes
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            let mut whole = Map::new();
            whole.insert("attributes".into(), Value::Object(attributes));
            let fields = [
                ("data", self.data.as_deref()),
                ("dataBase64", self.data_base64.as_deref()),
                (
                    "orderingKey",
                    Some(self.ordering_key.as_str()).filter(|k| !k.is_empty()),
                ),
            ];
            for (name, value) in fields {
                if let Some(value) = value {
                    whole.insert(name.into(), Value::String(value.to_string()));
                }
            }
            Value::Object(whole).to_string().into_bytes()
        }

        /// The message a record's payload holds; an error (quoting nothing of it) when it is
        /// not one.
        pub fn from_payload(payload: &[u8]) -> Result<Whole, String> {
            let whole: Whole = serde_json::from_slice(payload)
                .map_err(|e| crate::park::json_error_without_values(&e))?;
            if whole.data.is_some() && whole.data_base64.is_some() {
                return Err("both data and dataBase64".into());
            }
            Ok(whole)
        }

        /// The message's data, byte for byte.
        pub fn data_bytes(&self) -> Result<Vec<u8>, String> {
            match (&self.data, &self.data_base64) {
                (Some(text), _) => Ok(text.clone().into_bytes()),
                (None, Some(b64)) => STANDARD
                    .decode(b64)
                    .map_err(|_| "dataBase64 is not base64".to_string()),
                (None, None) => Ok(Vec::new()),
            }
        }
    }

    /// Why a message's attributes cannot all be its record's headers (more than 64, a name
    /// that is not a token, or [`WHOLE_HEADER`] itself), if so: then it is parked whole.
    pub fn unholdable(attributes: &BTreeMap<String, String>) -> Option<ParkInvalid> {
        if attributes.contains_key(WHOLE_HEADER) {
            return Some(ParkInvalid::ReservedHeaderName(WHOLE_HEADER.to_string()));
        }
        validate_headers(attributes).err()
    }

    /// The headers of a message parked whole: [`WHOLE_HEADER`] and the attributes a record can
    /// hold, in name order, as many as fit beside it.
    pub fn held_headers(attributes: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let held = attributes
            .iter()
            .filter(|(k, v)| {
                k.as_str() != WHOLE_HEADER
                    && header_holdable(k, v)
                    && v.len() <= api::MAX_HEADER_VALUE_LEN
            })
            .take(api::MAX_HEADERS - 1)
            .map(|(k, v)| (k.clone(), v.clone()));
        std::iter::once((WHOLE_HEADER.to_string(), WHOLE_JSON.to_string()))
            .chain(held)
            .collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn attrs(n: usize) -> BTreeMap<String, String> {
            (0..n)
                .map(|i| (format!("a{i:03}"), format!("v{i}")))
                .collect()
        }

        #[test]
        fn a_whole_message_comes_back_byte_for_byte() {
            let mut attributes = attrs(100);
            attributes.insert("not a token".into(), "x\r\ny".into());
            for data in [&b"{\"a\":1}"[..], &[0xff, 0x00, 0x80][..], &[][..]] {
                let whole = Whole::new(data, &attributes, "k-1");
                let payload = whole.to_payload();
                assert_eq!(payload, whole.to_payload(), "canonical");
                let back = Whole::from_payload(&payload).expect("a whole message");
                assert_eq!(back, whole);
                assert_eq!(back.data_bytes().expect("data"), data);
                assert_eq!(back.attributes, attributes);
                assert_eq!(back.ordering_key, "k-1");
            }
            assert!(
                Whole::from_payload(b"{\"data\":\"x\"}").is_err(),
                "no attributes"
            );
            assert!(Whole::from_payload(b"[1]").is_err());
        }

        #[test]
        fn what_a_record_cannot_hold_is_parked_whole_beside_what_it_can() {
            assert_eq!(unholdable(&attrs(64)), None);
            assert!(matches!(
                unholdable(&attrs(100)),
                Some(ParkInvalid::TooManyHeaders { count: 100, .. })
            ));
            let mut spaced = attrs(2);
            spaced.insert("not a token".into(), "v".into());
            assert!(unholdable(&spaced).is_some());
            let mut marked = attrs(2);
            marked.insert(WHOLE_HEADER.into(), "mine".into());
            assert!(
                unholdable(&marked).is_some(),
                "the marker is never an attribute"
            );

            let held = held_headers(&spaced);
            assert_eq!(held.get(WHOLE_HEADER).map(String::as_str), Some(WHOLE_JSON));
            assert!(!held.contains_key("not a token"));
            assert_eq!(held.len(), 3);
            let held = held_headers(&attrs(100));
            assert_eq!(held.len(), api::MAX_HEADERS);
            assert_eq!(validate_headers(&held), Ok(()));
            let marked = held_headers(&marked);
            assert_eq!(
                marked.get(WHOLE_HEADER).map(String::as_str),
                Some(WHOLE_JSON)
            );
        }
    }
}
