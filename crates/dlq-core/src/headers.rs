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
