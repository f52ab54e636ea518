//! Search over records: `kubectl dlq ls --grep/--where` and the page's search box share this
//! one matcher, so the two answer alike.
//!
//! Every text is matched as `kubectl dlq show` prints it: card numbers masked
//! (`dlq_core::mask`), a payload with its queue's mask paths masked. A sealed job's payload and
//! headers are never searched (nothing here opens them), nor a body kept in the queue's body
//! store (a search reads records only; the store is not fetched): [`Unsearched`] counts both so
//! every answer says what it could not look at.

use std::borrow::Cow;
use std::cell::OnceCell;

use serde_json::Value;

use dlq_core::api::{DeadLetter, Job};
use dlq_core::mask::{JsonPath, mask_card_bytes, mask_cards, mask_path, mask_payload};

/// Longest `--grep` text, in bytes.
pub const MAX_GREP_LEN: usize = 256;
/// Most `--where` clauses in one search.
pub const MAX_WHERE: usize = 8;
/// Longest `--where` PATH, in bytes.
pub const MAX_PATH_LEN: usize = 256;
/// Most steps of a `payload.` path.
pub const MAX_PATH_DEPTH: usize = 16;
/// Longest `--where` VALUE: a header value's own limit.
pub const MAX_VALUE_LEN: usize = dlq_core::api::MAX_HEADER_VALUE_LEN;

/// The PATH forms, for help and errors.
pub const PATHS: &str = "job.id, reason, errorClass, serviceVersion, intent.id, intent.state, \
     headers.NAME, payload, or payload.KEY with .KEY, [N] and [*] steps (payload.items[0].sku)";

/// A search a person typed that cannot run, in words for them.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SearchError {
    #[error("--grep needs some text (an empty one would match every record)")]
    EmptyGrep,
    #[error("{what} is {len} bytes long; at most {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("at most {MAX_WHERE} --where clauses; got {0}")]
    TooMany(usize),
    #[error("--where {0:?} is not PATH=VALUE")]
    NotAClause(String),
    #[error("--where {path:?}: {why}; PATH is one of {PATHS}")]
    BadPath { path: String, why: &'static str },
}

/// What a clause compares.
#[derive(Debug, Clone, PartialEq)]
enum Field {
    JobId,
    Reason,
    ErrorClass,
    ServiceVersion,
    IntentId,
    IntentState,
    /// A header's name, compared in any ASCII case.
    Header(String),
    /// The whole payload as text.
    Payload,
    /// The values a JSON path reaches in a JSON payload.
    PayloadAt(JsonPath),
}

/// `PATH=VALUE`: the field at PATH equals VALUE exactly (as shown: masked).
#[derive(Debug, Clone, PartialEq)]
struct Clause {
    path: String,
    field: Field,
    value: String,
}

/// A parsed search: text anywhere (`--grep`, any ASCII case) and clauses that must all hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Search {
    /// Lower case (ASCII).
    grep: Option<String>,
    clauses: Vec<Clause>,
}

/// Where a record matched, for the MATCH column: the field and a masked excerpt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub field: String,
    pub excerpt: String,
}

impl Hit {
    /// `field: excerpt`, one line.
    pub fn line(&self) -> String {
        format!("{}: {}", self.field, self.excerpt)
    }
}

impl Search {
    /// The search `--grep` and `--where` describe, bounded; `None`/empty for both is no search.
    pub fn parse(grep: Option<&str>, wheres: &[String]) -> Result<Search, SearchError> {
        let grep = grep.map(parse_grep).transpose()?;
        if wheres.len() > MAX_WHERE {
            return Err(SearchError::TooMany(wheres.len()));
        }
        let clauses = wheres
            .iter()
            .map(|w| parse_clause(w))
            .collect::<Result<_, _>>()?;
        Ok(Search { grep, clauses })
    }

    /// Nothing asked: every record matches.
    pub fn is_empty(&self) -> bool {
        self.grep.is_none() && self.clauses.is_empty()
    }

    /// Whether the search reads the job (payload or headers), which sealed jobs and stored
    /// bodies keep out of reach.
    pub fn reads_job(&self) -> bool {
        self.grep.is_some()
            || self.clauses.iter().any(|c| {
                matches!(
                    c.field,
                    Field::Header(_) | Field::Payload | Field::PayloadAt(_)
                )
            })
    }

    /// Whether any clause reads the payload (so the queue's mask paths matter).
    pub fn reads_payload(&self) -> bool {
        self.grep.is_some()
            || self
                .clauses
                .iter()
                .any(|c| matches!(c.field, Field::Payload | Field::PayloadAt(_)))
    }

    /// Where `r` matches (every clause holds and the text occurs), or None. `mask` is the
    /// record's queue's `spec.protection.mask` paths.
    pub fn find(&self, r: &DeadLetter, mask: &[String]) -> Option<Hit> {
        let job = Shown::new(&r.spec.job, mask);
        for c in &self.clauses {
            if !holds(c, r, &job) {
                return None;
            }
        }
        match &self.grep {
            Some(needle) => grep(needle, r, &job),
            None => self.clauses.first().map(|c| Hit {
                field: c.path.clone(),
                excerpt: excerpt(&c.value, 0, c.value.len().min(CONTEXT)),
            }),
        }
    }
}

fn parse_grep(text: &str) -> Result<String, SearchError> {
    if text.is_empty() {
        return Err(SearchError::EmptyGrep);
    }
    if text.len() > MAX_GREP_LEN {
        return Err(SearchError::TooLong {
            what: "--grep",
            len: text.len(),
            max: MAX_GREP_LEN,
        });
    }
    Ok(text.to_ascii_lowercase())
}

fn parse_clause(raw: &str) -> Result<Clause, SearchError> {
    let (path, value) = raw
        .split_once('=')
        .ok_or_else(|| SearchError::NotAClause(raw.chars().take(64).collect()))?;
    let path = path.trim();
    for (what, len, max) in [
        ("--where PATH", path.len(), MAX_PATH_LEN),
        ("--where VALUE", value.len(), MAX_VALUE_LEN),
    ] {
        if len > max {
            return Err(SearchError::TooLong { what, len, max });
        }
    }
    let bad = |why| SearchError::BadPath {
        path: path.to_string(),
        why,
    };
    Ok(Clause {
        path: path.to_string(),
        field: field(path).map_err(bad)?,
        value: value.to_string(),
    })
}

/// The field a PATH names; fixed names in any ASCII case, header names and JSON keys as typed.
fn field(path: &str) -> Result<Field, &'static str> {
    let lower = path.to_ascii_lowercase();
    let fixed = match lower.as_str() {
        "job.id" => Some(Field::JobId),
        "reason" => Some(Field::Reason),
        "errorclass" => Some(Field::ErrorClass),
        "serviceversion" => Some(Field::ServiceVersion),
        "intent.id" => Some(Field::IntentId),
        "intent.state" => Some(Field::IntentState),
        "payload" => Some(Field::Payload),
        _ => None,
    };
    if let Some(f) = fixed {
        return Ok(f);
    }
    if lower.starts_with("headers.") {
        let name = &path["headers.".len()..];
        if name.is_empty() {
            return Err("a header's name follows headers.");
        }
        return Ok(Field::Header(name.to_ascii_lowercase()));
    }
    if lower.starts_with("payload.") || lower.starts_with("payload[") {
        let json = JsonPath::parse(&format!("${}", &path["payload".len()..]))
            .ok_or("not a JSON path (payload.key, payload.items[0].key, payload.items[*].key)")?;
        if json.depth() > MAX_PATH_DEPTH {
            return Err("a JSON path of at most 16 steps");
        }
        return Ok(Field::PayloadAt(json));
    }
    Err("not a field a search reads")
}

/// A record's job as `show` prints it, worked out only as far as a search needs it.
struct Shown<'a> {
    job: &'a Job,
    mask: &'a [String],
    /// The payload's text, masked: None when sealed, in the body store, or null.
    text: OnceCell<Option<String>>,
    /// The payload as JSON with the mask paths masked: None when it is not JSON.
    json: OnceCell<Option<Value>>,
}

impl<'a> Shown<'a> {
    fn new(job: &'a Job, mask: &'a [String]) -> Self {
        Shown {
            job,
            mask,
            text: OnceCell::new(),
            json: OnceCell::new(),
        }
    }

    /// Headers, unless sealed.
    fn headers(&self) -> impl Iterator<Item = (&'a String, &'a String)> {
        let open = self.job.sealed.is_none();
        self.job.headers.iter().filter(move |_| open)
    }

    /// The payload as it stands in the record, when a search may read it.
    fn raw(&self) -> Option<Cow<'a, str>> {
        let j = self.job;
        if j.sealed.is_some() || j.stored_body().is_some() || j.payload_null {
            return None;
        }
        match (&j.payload, &j.payload_base64) {
            (Some(text), _) => Some(Cow::Borrowed(text.as_str())),
            // Binary: its bytes, cards masked in place, read as text where they are text.
            (None, Some(_)) => j
                .payload_bytes()
                .ok()
                .map(|b| Cow::Owned(String::from_utf8_lossy(&mask_card_bytes(&b)).into_owned())),
            (None, None) => None,
        }
    }

    /// The payload's text as `show` prints it (cards and the queue's paths masked).
    fn text(&self) -> Option<&str> {
        self.text
            .get_or_init(|| self.raw().map(|raw| mask_payload(&raw, self.mask)))
            .as_deref()
    }

    /// The payload as JSON, the queue's paths masked (cards are masked per value compared).
    fn json(&self) -> Option<&Value> {
        self.json
            .get_or_init(|| {
                let raw = self.raw()?;
                let mut v: Value = serde_json::from_str(&raw).ok()?;
                for path in self.mask {
                    mask_path(&mut v, path);
                }
                Some(v)
            })
            .as_ref()
    }
}

/// Whether one clause holds for `r`.
fn holds(c: &Clause, r: &DeadLetter, job: &Shown<'_>) -> bool {
    let s = &r.spec;
    let intent = s.intent.as_deref();
    match &c.field {
        Field::JobId => equal_shown(&s.job.id, &c.value),
        Field::Reason => equal_shown(&s.reason, &c.value),
        Field::ErrorClass => s
            .error_class
            .as_deref()
            .is_some_and(|e| equal_shown(e, &c.value)),
        Field::ServiceVersion => s
            .service_version
            .as_deref()
            .is_some_and(|v| equal_shown(v, &c.value)),
        Field::IntentId => intent.is_some_and(|i| equal_shown(&i.id, &c.value)),
        Field::IntentState => intent.is_some_and(|i| equal_shown(&i.state, &c.value)),
        Field::Header(name) => job
            .headers()
            .any(|(k, v)| mask_cards(k).eq_ignore_ascii_case(name) && equal_shown(v, &c.value)),
        Field::Payload => job.text() == Some(c.value.as_str()),
        Field::PayloadAt(path) => payload_at(job, path, &c.value),
    }
}

/// `text` as shown (cards masked) equals `want`. A `want` without `*` cannot equal a masked
/// text it differs from unmasked, which spares the masking of nearly every field compared.
fn equal_shown(text: &str, want: &str) -> bool {
    if !want.contains('*') && text != want {
        return false;
    }
    mask_cards(text) == want
}

/// Some value at `path` in the JSON payload, as shown, equals `want`: a string as its text, any
/// other value as its compact JSON.
fn payload_at(job: &Shown<'_>, path: &JsonPath, want: &str) -> bool {
    if !may_hold(job, want) {
        return false;
    }
    let Some(json) = job.json() else {
        return false;
    };
    path.values(json).into_iter().any(|v| match v {
        Value::String(s) => mask_cards(s) == want,
        other => mask_cards(&other.to_string()) == want,
    })
}

/// Whether the payload may hold `want` at all: a string value or literal stands in the JSON
/// text as it is unless escaped, so most payloads are ruled out without parsing them.
fn may_hold(job: &Shown<'_>, want: &str) -> bool {
    let Some(raw) = job.raw() else {
        return false;
    };
    raw.contains('\\')
        || want.contains('*')
        || want.starts_with(['{', '['])
        || want.parse::<f64>().is_ok()
        || raw.contains(want)
}

/// The first field in which the lower-case `needle` occurs, as shown, in any ASCII case.
fn grep(needle: &str, r: &DeadLetter, job: &Shown<'_>) -> Option<Hit> {
    let s = &r.spec;
    let intent = s.intent.as_deref();
    let fixed = [
        ("job.id", Some(s.job.id.as_str())),
        ("reason", Some(s.reason.as_str())),
        ("errorClass", s.error_class.as_deref()),
        ("serviceVersion", s.service_version.as_deref()),
        ("intent.id", intent.map(|i| i.id.as_str())),
        ("intent.state", intent.map(|i| i.state.as_str())),
    ];
    for (field, text) in fixed {
        if let Some(hit) = text.and_then(|t| grep_text(needle, field, t)) {
            return Some(hit);
        }
    }
    for (k, v) in job.headers() {
        let field = format!("headers.{}", mask_cards(k));
        if let Some(hit) = grep_text(needle, &field, k).or_else(|| grep_text(needle, &field, v)) {
            return Some(hit);
        }
    }
    grep_payload(needle, job)
}

/// `needle` in one field's text, as shown. Without a `*` in it, a text that lacks it unmasked
/// lacks it masked too (masking only turns digits into `*`), so most texts are never masked.
fn grep_text(needle: &str, field: &str, text: &str) -> Option<Hit> {
    if !needle.contains('*') && find(text.as_bytes(), needle.as_bytes()).is_none() {
        return None;
    }
    let shown = mask_cards(text);
    let at = find(shown.as_bytes(), needle.as_bytes())?;
    Some(Hit {
        field: field.to_string(),
        excerpt: excerpt(&shown, at, needle.len()),
    })
}

/// `needle` in the payload as shown. With the queue's mask paths the JSON is written anew
/// (compact, escapes resolved), so only then is the raw text no guide.
fn grep_payload(needle: &str, job: &Shown<'_>) -> Option<Hit> {
    if job.mask.is_empty() && !needle.contains('*') {
        let raw = job.raw()?;
        find(raw.as_bytes(), needle.as_bytes())?;
    }
    let shown = job.text()?;
    let at = find(shown.as_bytes(), needle.as_bytes())?;
    Some(Hit {
        field: "payload".into(),
        excerpt: excerpt(shown, at, needle.len()),
    })
}

/// The first place the lower-case `needle` occurs in `hay`, in any ASCII case.
pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let last = hay.len().checked_sub(needle.len())?;
    let upper = first.to_ascii_uppercase();
    let mut from = 0;
    while from <= last {
        let at = from
            + hay[from..=last]
                .iter()
                .position(|&b| b == first || b == upper)?;
        if hay[at + 1..at + needle.len()].eq_ignore_ascii_case(rest) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Bytes shown either side of a match.
const CONTEXT: usize = 24;

/// One line around `text[at..at + len]`: up to [`CONTEXT`] bytes either side (on character
/// boundaries), line breaks as spaces, `…` where it was cut.
fn excerpt(text: &str, at: usize, len: usize) -> String {
    let mut start = at.saturating_sub(CONTEXT);
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = (at + len + CONTEXT).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let mut out = String::new();
    if start > 0 {
        out.push('…');
    }
    out.extend(text[start..end].chars().map(|c| match c {
        '\n' | '\r' | '\t' => ' ',
        c => c,
    }));
    if end < text.len() {
        out.push('…');
    }
    out
}

/// The mask paths of the queues that have any (`spec.protection.mask`), by namespace and
/// queue: what a search masks before it matches, as `show` does.
#[derive(Debug, Default, Clone)]
pub struct Masks(Vec<(String, String, Vec<String>)>);

impl Masks {
    /// From the queues in scope.
    pub fn of_queues(queues: &[dlq_core::api::DeadLetterQueue]) -> Masks {
        use kube::ResourceExt;
        Masks(
            queues
                .iter()
                .filter(|q| !q.mask_paths().is_empty())
                .map(|q| {
                    let ns = q.namespace().unwrap_or_default();
                    (ns, q.name_any(), q.mask_paths().to_vec())
                })
                .collect(),
        )
    }

    /// The paths masked in `r`'s payload (few queues have any: a scan beats a map's keys).
    pub fn of(&self, r: &DeadLetter) -> &[String] {
        let ns = r.metadata.namespace.as_deref().unwrap_or_default();
        self.0
            .iter()
            .find(|(n, q, _)| n == ns && *q == r.spec.queue)
            .map_or(&[], |(_, _, paths)| paths.as_slice())
    }
}

/// What a search could not look at, counted over the records it read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unsearched {
    /// Sealed jobs: payload and headers are ciphertext.
    pub sealed: usize,
    /// Payloads kept in a queue's body store: not fetched.
    pub stored: usize,
}

impl Unsearched {
    /// Counts `r` when `search` reads what `r` keeps out of reach.
    pub fn note(&mut self, search: &Search, r: &DeadLetter) {
        if !search.reads_job() {
            return;
        }
        let job = &r.spec.job;
        if job.sealed.is_some() {
            self.sealed += 1;
        } else if job.stored_body().is_some() && search.reads_payload() {
            self.stored += 1;
        }
    }

    /// The sentence saying so, when there is anything to say.
    pub fn describe(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.sealed > 0 {
            parts.push(format!(
                "{} sealed (payload and headers not searched)",
                self.sealed
            ));
        }
        if self.stored > 0 {
            parts.push(format!(
                "{} with the payload in the body store (not fetched, not searched)",
                self.stored
            ));
        }
        (!parts.is_empty()).then(|| format!("records not searched whole: {}", parts.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::{BodyRef, IntentSnapshot};

    fn record(job: Job) -> DeadLetter {
        let mut req = dlq_core::park::ParkRequest::new("relayer", job);
        req.reason = "timeout after 30000 ms talking to payer".into();
        req.error_class = Some("PayerTimeout".into());
        req.service_version = Some("relayer@1.4.2".into());
        req.intent = Some(IntentSnapshot {
            id: "pi_0042".into(),
            state: "created".into(),
        });
        dlq_core::park::new_record(&req, 1)
    }

    fn json_job(payload: &str) -> Job {
        let mut job = Job::from_bytes("pi_0042/settle", payload.as_bytes());
        job.headers.insert("X-Tenant".into(), "acme".into());
        job
    }

    fn search(grep: Option<&str>, wheres: &[&str]) -> Search {
        let wheres: Vec<String> = wheres.iter().map(|w| w.to_string()).collect();
        Search::parse(grep, &wheres).expect("a search")
    }

    fn hit(s: &Search, r: &DeadLetter) -> Option<String> {
        s.find(r, &[]).map(|h| h.line())
    }

    #[test]
    fn grep_finds_text_in_every_field_in_any_case_and_says_where() {
        let r = record(json_job(r#"{"customer":"cus_42","amount":1200}"#));
        let cases = [
            ("PI_0042/SETTLE", "job.id"),
            ("talking to PAYER", "reason"),
            ("payertimeout", "errorClass"),
            ("relayer@1.4", "serviceVersion"),
            ("created", "intent.state"),
            ("x-tenant", "headers.X-Tenant"),
            ("ACME", "headers.X-Tenant"),
            ("cus_42", "payload"),
        ];
        for (text, field) in cases {
            let h = search(Some(text), &[]).find(&r, &[]);
            assert_eq!(h.map(|h| h.field), Some(field.to_string()), "{text}");
        }
        assert_eq!(hit(&search(Some("cus_43"), &[]), &r), None);
        let line = hit(&search(Some("cus_42"), &[]), &r).unwrap_or_default();
        assert_eq!(line, r#"payload: {"customer":"cus_42","amount":1200}"#);
    }

    #[test]
    fn where_compares_fields_headers_and_json_paths_exactly() {
        let r = record(json_job(
            r#"{"customer":{"id":"cus_42"},"items":[{"sku":"a"},{"sku":"b"}],"n":7,"ok":true}"#,
        ));
        let yes = [
            "job.id=pi_0042/settle",
            "reason=timeout after 30000 ms talking to payer",
            "errorClass=PayerTimeout",
            "ERRORCLASS=PayerTimeout",
            "serviceVersion=relayer@1.4.2",
            "intent.id=pi_0042",
            "intent.state=created",
            "headers.x-tenant=acme",
            "payload.customer.id=cus_42",
            "payload.items[1].sku=b",
            "payload.items[*].sku=a",
            "payload.n=7",
            "payload.ok=true",
            r#"payload.customer={"id":"cus_42"}"#,
        ];
        for w in yes {
            assert!(hit(&search(None, &[w]), &r).is_some(), "{w}");
        }
        let no = [
            "job.id=pi_0042",
            "errorClass=payertimeout",
            "headers.x-tenant=ACME",
            "headers.x-other=acme",
            "payload.customer.id=cus_4",
            "payload.items[2].sku=a",
            "payload.n=8",
            "payload.missing=7",
        ];
        for w in no {
            assert!(hit(&search(None, &[w]), &r).is_none(), "{w}");
        }
        let both = search(Some("payer"), &["payload.n=7", "headers.x-tenant=acme"]);
        assert_eq!(hit(&both, &r).map(|l| l.starts_with("reason:")), Some(true));
        let one_fails = search(Some("payer"), &["payload.n=7", "intent.state=failed"]);
        assert_eq!(hit(&one_fails, &r), None, "every clause must hold");
    }

    #[test]
    fn card_numbers_never_match_and_show_masked() {
        let mut job = json_job(r#"{"pan":"4111 1111 1111 1111","holder":"Ada Lovelace"}"#);
        job.headers
            .insert("x-card".into(), "4242424242424242".into());
        let r = record(job);
        for whole in ["4111 1111 1111 1111", "4242424242424242", "1111 1111"] {
            assert_eq!(hit(&search(Some(whole), &[]), &r), None, "{whole}");
        }
        assert_eq!(
            hit(&search(None, &["headers.x-card=4242424242424242"]), &r),
            None
        );
        assert_eq!(
            hit(&search(None, &["payload.pan=4111 1111 1111 1111"]), &r),
            None
        );
        // As printed, the masked form is found, and the excerpt is masked.
        let line = hit(&search(Some("424242******4242"), &[]), &r).unwrap_or_default();
        assert_eq!(line, "headers.x-card: 424242******4242");
        assert!(hit(&search(None, &["payload.pan=4111 11** **** 1111"]), &r).is_some());
        let line = hit(&search(Some("ada"), &[]), &r).unwrap_or_default();
        assert!(
            line.contains("**** 1111") && !line.contains("1111 1111"),
            "{line}"
        );
    }

    #[test]
    fn the_queues_mask_paths_hide_values_from_search() {
        let r = record(json_job(r#"{"holder":{"name":"Ada"},"id":"cus_42"}"#));
        let mask = vec!["$.holder.name".to_string()];
        assert!(search(Some("ada"), &[]).find(&r, &[]).is_some());
        assert_eq!(search(Some("ada"), &[]).find(&r, &mask), None);
        assert_eq!(
            search(None, &["payload.holder.name=Ada"]).find(&r, &mask),
            None
        );
        assert!(
            search(None, &["payload.holder.name=****"])
                .find(&r, &mask)
                .is_some()
        );
        let h = search(Some("cus_42"), &[])
            .find(&r, &mask)
            .map(|h| h.excerpt);
        let shown = r#""name":"****"},"id":"cus_42"}"#;
        assert!(h.as_ref().is_some_and(|e| e.ends_with(shown)), "{h:?}");
    }

    #[test]
    fn sealed_jobs_and_stored_bodies_are_not_searched_and_are_counted() {
        let job = json_job(r#"{"customer":"cus_42"}"#);
        let (_, recipient) = dlq_core::seal::generate_identity();
        let sealed = record(dlq_core::seal::seal(&job, &recipient).expect("sealed"));
        let mut stored_job = Job::from_bytes("big/1", b"");
        stored_job.payload = None;
        stored_job.headers.insert("x-tenant".into(), "acme".into());
        stored_job.body = Some(Box::new(BodyRef {
            reference: "s3://b/k".into(),
            size: 1 << 20,
            sha256: "ab".repeat(32),
            ..BodyRef::default()
        }));
        let stored = record(stored_job);
        let s = search(Some("cus_42"), &[]);
        assert_eq!(hit(&s, &sealed), None);
        assert_eq!(hit(&s, &stored), None);
        assert_eq!(
            hit(&search(None, &["headers.x-tenant=acme"]), &sealed),
            None
        );
        assert!(hit(&search(None, &["headers.x-tenant=acme"]), &stored).is_some());
        // The facts of a sealed record are searched as any other's.
        assert!(hit(&search(Some("pi_0042"), &[]), &sealed).is_some());
        let mut blind = Unsearched::default();
        for r in [&sealed, &stored, &record(json_job("{}"))] {
            blind.note(&s, r);
        }
        assert_eq!(
            blind,
            Unsearched {
                sealed: 1,
                stored: 1
            }
        );
        let said = blind.describe().unwrap_or_default();
        assert!(
            said.contains("1 sealed") && said.contains("body store"),
            "{said}"
        );
        let mut facts_only = Unsearched::default();
        facts_only.note(&search(None, &["reason=x"]), &sealed);
        assert_eq!(
            facts_only.describe(),
            None,
            "a search of facts reads no job"
        );
    }

    #[test]
    fn binary_payloads_are_searched_as_their_text_cards_masked() {
        let r = record(Job::from_bytes(
            "b/1",
            b"\xff\x00cus_42;pan=4242424242424242",
        ));
        assert!(hit(&search(Some("cus_42"), &[]), &r).is_some());
        assert_eq!(hit(&search(Some("4242424242424242"), &[]), &r), None);
        assert_eq!(hit(&search(None, &["payload.x=1"]), &r), None, "not JSON");
    }

    #[test]
    fn escaped_json_strings_match_their_values() {
        let r = record(json_job(r#"{"city":"Z\u00fcrich","n":1e3}"#));
        assert!(hit(&search(None, &["payload.city=Zürich"]), &r).is_some());
        assert!(hit(&search(None, &["payload.n=1000.0"]), &r).is_some());
    }

    #[test]
    fn bad_searches_are_refused_in_words() {
        let parse = |g: Option<&str>, w: &[&str]| {
            let w: Vec<String> = w.iter().map(|s| s.to_string()).collect();
            Search::parse(g, &w).map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(
            parse(Some(""), &[]),
            Err(SearchError::EmptyGrep.to_string())
        );
        let long = "x".repeat(MAX_GREP_LEN + 1);
        assert!(parse(Some(&long), &[]).is_err_and(|e| e.contains("at most 256")));
        assert!(parse(None, &["reason"]).is_err_and(|e| e.contains("not PATH=VALUE")));
        for bad in [
            "customer=1",
            "payload.=1",
            "payloadx=1",
            "payload.a[x]=1",
            "headers.=1",
        ] {
            let e = parse(None, &[bad]).expect_err(bad);
            assert!(e.contains("PATH is one of job.id"), "{bad}: {e}");
        }
        let deep = format!("payload{}=1", ".k".repeat(MAX_PATH_DEPTH + 1));
        assert!(parse(None, &[&deep]).is_err_and(|e| e.contains("16 steps")));
        let many: Vec<&str> = ["reason=x"; MAX_WHERE + 1].to_vec();
        assert!(parse(None, &many).is_err_and(|e| e.contains("at most 8")));
        let value = format!("reason={}", "v".repeat(MAX_VALUE_LEN + 1));
        assert!(parse(None, &[&value]).is_err_and(|e| e.contains("VALUE")));
        assert_eq!(parse(None, &["reason=a=b"]), Ok(()), "the first = splits");
        assert!(Search::parse(None, &[]).is_ok_and(|s| s.is_empty()));
    }

    #[test]
    fn find_is_ascii_case_insensitive_and_bounded() {
        assert_eq!(find(b"Hello World", b"world"), Some(6));
        assert_eq!(find(b"abc", b"abcd"), None);
        assert_eq!(find(b"aaab", b"ab"), Some(2));
        assert_eq!(find(b"", b"a"), None);
        assert_eq!(find("Zürich".as_bytes(), "ürich".as_bytes()), Some(1));
    }

    #[test]
    fn excerpts_cut_on_character_boundaries_and_fold_lines() {
        let text = format!("{}needle\n{}", "é".repeat(30), "x".repeat(40));
        let at = text.find("needle").unwrap_or_default();
        let e = excerpt(&text, at, 6);
        assert!(
            e.starts_with('…') && e.ends_with('…') && e.contains("needle x"),
            "{e}"
        );
        assert_eq!(excerpt("short", 0, 5), "short");
    }
}
