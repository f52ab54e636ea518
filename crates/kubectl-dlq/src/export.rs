//! `kubectl dlq export`: every fact of the selected records to stdout, NDJSON or CSV, read a
//! page at a time (`crate::paged`) and written as read: memory bounded by three pages, however
//! many records.
//!
//! The job is exported as bytes: its payload as `payloadBase64` (exactly as parked) and its
//! headers as `headersBase64` (their JSON object, base64), so an export can be parked again
//! unchanged while no card number stands in its text; a sealed job as its ciphertext; a body in
//! the store as its reference (not fetched). Every text fact (reason, note, intent, error class,
//! service version, conditions) has its card numbers masked, as `show` prints them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;

use base64::Engine;
use clap::{Args, ValueEnum};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde::{Deserialize, Serialize};

use dlq_core::api::{
    BodyRef, DeadLetter, FailureKind, IntentSnapshot, LABEL_QUEUE, Origin, Phase, SealedJob,
};
use dlq_core::group::LABEL_GROUP;
use dlq_core::mask::mask_cards;

use crate::session::{CliError, Global, connect};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Format {
    Ndjson,
    Csv,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Only this DeadLetterQueue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this failure group (its fingerprint, `kubectl dlq groups`).
    #[arg(long)]
    pub group: Option<String>,
    /// Only records with these labels (a label selector, as kubectl's -l).
    #[arg(short = 'l', long = "selector", value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// One JSON object a line (what `kubectl dlq park --from` reads), or CSV with a header.
    #[arg(long, value_enum, default_value = "ndjson")]
    pub format: Format,
}

/// The format's name in each line: what a reader checks before trusting the fields.
pub const FORMAT: &str = "dlq.dev/export/v1";

/// One record as exported (and as `park --from` reads it back).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Exported {
    pub format: String,
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The broker's identity of the dead message (`dlq.dev/source-message`), when a source
    /// parked it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Time>,
    pub queue: String,
    pub cycle: i32,
    pub phase: Phase,
    pub job: ExportedJob,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intent: Option<IntentSnapshot>,
    pub deliveries: i32,
    pub reason: String,
    pub failure_kind: FailureKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    pub failed_at: Time,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved_by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved_at: Option<Time>,
    /// `type status reason: message`, one a condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<String>,
}

/// The job as bytes: exactly what redrive would send.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ExportedJob {
    pub id: String,
    /// The payload's bytes, when the record holds them (not sealed, not in the store, not null).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub payload_null: bool,
    /// The headers' JSON object, base64 (none when there are none, or sealed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers_base64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    /// A body in the queue's store: its reference and digest (the bytes are not fetched).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<BodyRef>,
    /// A sealed job: its recipient and ciphertext, as the record holds them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sealed: Option<SealedJob>,
}

/// Text facts as `show` prints them.
fn shown(text: &Option<String>) -> Option<String> {
    text.as_deref().map(mask_cards)
}

impl Exported {
    /// Every fact of `r`, text masked, the job as bytes.
    pub fn of(r: &DeadLetter) -> Exported {
        let s = &r.spec;
        let status = r.status.as_ref();
        Exported {
            format: FORMAT.to_string(),
            namespace: r.namespace().unwrap_or_default(),
            name: r.name_any(),
            labels: r.labels().clone(),
            source_message: r
                .annotations()
                .get(dlq_core::api::ANNOTATION_SOURCE_MESSAGE)
                .cloned(),
            created_at: r.metadata.creation_timestamp.clone(),
            queue: s.queue.clone(),
            cycle: s.cycle,
            phase: r.phase(),
            job: ExportedJob::of(&s.job),
            intent: s.intent.as_deref().map(|i| IntentSnapshot {
                id: mask_cards(&i.id),
                state: mask_cards(&i.state),
            }),
            deliveries: s.deliveries,
            reason: mask_cards(&s.reason),
            failure_kind: s.failure_kind,
            service_version: shown(&s.service_version),
            error_class: shown(&s.error_class),
            failed_at: s.failed_at.clone(),
            action: s.action.map(|a| format!("{a:?}").to_lowercase()),
            by: s.by.clone(),
            note: shown(&s.note),
            resolved_by: status.and_then(|st| st.resolved_by.clone()),
            resolved_at: status.and_then(|st| st.resolved_at.clone()),
            conditions: status
                .into_iter()
                .flat_map(|st| &st.conditions)
                .map(|c| {
                    let line = format!("{} {} {}: {}", c.type_, c.status, c.reason, c.message);
                    mask_cards(&line)
                })
                .collect(),
        }
    }
}

impl ExportedJob {
    fn of(job: &dlq_core::api::Job) -> ExportedJob {
        let engine = base64::engine::general_purpose::STANDARD;
        let inline = job.sealed.is_none() && job.stored_body().is_none() && !job.payload_null;
        let payload_base64 = match (&job.payload, &job.payload_base64) {
            _ if !inline => None,
            (Some(text), _) => Some(engine.encode(text.as_bytes())),
            (None, Some(b64)) => Some(b64.clone()),
            (None, None) => Some(String::new()),
        };
        let headers_base64 = (!job.headers.is_empty())
            .then(|| serde_json::to_vec(&job.headers).ok())
            .flatten()
            .map(|json| engine.encode(json));
        ExportedJob {
            id: job.id.clone(),
            payload_base64,
            payload_null: job.payload_null,
            headers_base64,
            origin: job.origin.as_deref().cloned(),
            body: job.body.as_deref().cloned(),
            sealed: job.sealed.as_deref().cloned(),
        }
    }
}

impl ExportedJob {
    /// The job again, exactly as exported (the way back of [`ExportedJob::of`]).
    pub fn into_job(self) -> Result<dlq_core::api::Job, String> {
        let engine = base64::engine::general_purpose::STANDARD;
        let decode = |what: &str, b64: &str| {
            engine
                .decode(b64)
                .map_err(|e| format!("{what} is not base64: {e}"))
        };
        let mut job = match &self.payload_base64 {
            Some(b64) => dlq_core::api::Job::from_bytes(self.id, &decode("payloadBase64", b64)?),
            None => dlq_core::api::Job {
                id: self.id,
                ..Default::default()
            },
        };
        job.payload_null = self.payload_null;
        if let Some(b64) = &self.headers_base64 {
            job.headers = serde_json::from_slice(&decode("headersBase64", b64)?)
                .map_err(|e| format!("headersBase64 is not a JSON object of strings: {e}"))?;
        }
        job.origin = self.origin.map(Box::new);
        job.body = self.body.map(Box::new);
        job.sealed = self.sealed.map(Box::new);
        Ok(job)
    }
}

/// The CSV header; [`csv_row`] writes the same columns.
pub const CSV_COLUMNS: [&str; 25] = [
    "namespace",
    "name",
    "queue",
    "job_id",
    "cycle",
    "phase",
    "failure_kind",
    "deliveries",
    "failed_at",
    "reason",
    "error_class",
    "service_version",
    "intent_id",
    "intent_state",
    "action",
    "by",
    "note",
    "resolved_by",
    "resolved_at",
    "payload_base64",
    "payload_null",
    "headers_base64",
    "sealed_recipient",
    "body_ref",
    "source_message",
];

/// One CSV line of `e` (RFC 4180 quoting; a text cell that a spreadsheet would read as a
/// formula is prefixed with `'`).
pub fn csv_row(e: &Exported) -> String {
    let time = |t: &Option<Time>| t.as_ref().map(|t| t.0.to_string()).unwrap_or_default();
    let opt = |o: &Option<String>| o.clone().unwrap_or_default();
    let intent = e.intent.as_ref();
    let text = [
        e.namespace.clone(),
        e.name.clone(),
        e.queue.clone(),
        e.job.id.clone(),
        e.cycle.to_string(),
        e.phase.as_str().to_string(),
        e.failure_kind.as_str().to_string(),
        e.deliveries.to_string(),
        e.failed_at.0.to_string(),
        e.reason.clone(),
        opt(&e.error_class),
        opt(&e.service_version),
        intent.map(|i| i.id.clone()).unwrap_or_default(),
        intent.map(|i| i.state.clone()).unwrap_or_default(),
        opt(&e.action),
        opt(&e.by),
        opt(&e.note),
        opt(&e.resolved_by),
        time(&e.resolved_at),
    ];
    let bytes = [
        opt(&e.job.payload_base64),
        e.job.payload_null.to_string(),
        opt(&e.job.headers_base64),
        e.job
            .sealed
            .as_ref()
            .map(|s| s.recipient.clone())
            .unwrap_or_default(),
        e.job
            .body
            .as_ref()
            .map(|b| b.reference.clone())
            .unwrap_or_default(),
        opt(&e.source_message),
    ];
    let cells: Vec<String> = text
        .iter()
        .map(|t| csv_cell(&defused(t)))
        .chain(bytes.iter().map(|b| csv_cell(b)))
        .collect();
    cells.join(",")
}

/// A text a spreadsheet would take for a formula (`=`, `+`, `-`, `@`, tab, CR first) with a
/// leading `'`, so opening an export runs nothing.
fn defused(text: &str) -> Cow<'_, str> {
    match text.chars().next() {
        Some('=' | '+' | '-' | '@' | '\t' | '\r') => Cow::Owned(format!("'{text}")),
        _ => Cow::Borrowed(text),
    }
}

/// One CSV cell: quoted when it holds a comma, a quote or a line break, quotes doubled.
fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// The label selector of `--queue`, `--group` and `-l`.
fn selector(args: &ExportArgs) -> String {
    let mut parts = Vec::new();
    if let Some(q) = &args.queue {
        parts.push(format!("{LABEL_QUEUE}={q}"));
    }
    if let Some(g) = &args.group {
        parts.push(format!("{LABEL_GROUP}={}", g.trim().to_ascii_lowercase()));
    }
    if let Some(l) = &args.selector {
        parts.push(l.clone());
    }
    parts.join(",")
}

/// `export`: the selected records, each line written as its page arrives.
pub async fn run(g: &Global, args: ExportArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<DeadLetter> = if g.all_namespaces {
        Api::all(client)
    } else {
        Api::namespaced(client, &ns)
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    let io = |e| CliError::Io("stdout".into(), e);
    if args.format == Format::Csv {
        writeln!(out, "{}", CSV_COLUMNS.join(",")).map_err(io)?;
    }
    let mut pages = crate::paged::pages(api, ListParams::default().labels(&selector(&args)));
    let mut written = 0usize;
    while let Some(page) = pages.recv().await {
        for r in &page? {
            write_one(&mut out, &Exported::of(r), args.format)?;
            written += 1;
        }
    }
    out.flush().map_err(io)?;
    eprintln!("exported {written} records");
    Ok(())
}

fn write_one(out: &mut impl Write, e: &Exported, format: Format) -> Result<(), CliError> {
    let line = match format {
        Format::Ndjson => serde_json::to_string(e).map_err(|e| CliError::Usage(e.to_string()))?,
        Format::Csv => csv_row(e),
    };
    writeln!(out, "{line}").map_err(|e| CliError::Io("stdout".into(), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Job;

    fn exported(job: Job) -> Exported {
        let mut req = dlq_core::park::ParkRequest::new("relayer", job);
        req.reason = "card 4111111111111111 declined".into();
        req.intent = Some(IntentSnapshot {
            id: "pi_1".into(),
            state: "=cmd|' /C calc'!A0".into(),
        });
        Exported::of(&dlq_core::park::new_record(&req, 2))
    }

    /// The job leaves as bytes, exactly; every text has its card numbers masked.
    #[test]
    fn the_job_is_exact_bytes_and_texts_are_masked() {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut job = Job::from_bytes("pi_1/settle", br#"{"pan":"4111111111111111"}"#);
        job.headers
            .insert("x-card".into(), "4242424242424242".into());
        let e = exported(job.clone());
        let line = serde_json::to_string(&e).expect("json");
        assert!(!line.contains("4111111111111111") && !line.contains("4242424242424242"));
        assert!(line.contains("card 411111******1111 declined"), "{line}");
        let payload = engine.decode(e.job.payload_base64.as_deref().unwrap_or_default());
        assert_eq!(payload.ok(), job.payload_bytes().ok());
        let headers = engine.decode(e.job.headers_base64.as_deref().unwrap_or_default());
        let headers: BTreeMap<String, String> =
            serde_json::from_slice(&headers.unwrap_or_default()).expect("headers");
        assert_eq!(headers, job.headers);
        assert_eq!((e.cycle, e.format.as_str()), (2, FORMAT));
        let binary = exported(Job::from_bytes("b", b"\xff\x00"));
        assert_eq!(binary.job.payload_base64.as_deref(), Some("/wA="));
        let null = exported(Job::null_value("n"));
        assert_eq!(
            (null.job.payload_base64, null.job.payload_null),
            (None, true)
        );
    }

    /// What `park --from` reads back is the job exactly, whatever its payload.
    #[test]
    fn a_job_round_trips_through_a_line() {
        let mut text = Job::from_bytes("t", br#"{"pan":"4111111111111111"}"#);
        text.headers
            .insert("x-card".into(), "4242424242424242".into());
        let (_, recipient) = dlq_core::seal::generate_identity();
        let sealed = dlq_core::seal::seal(&text, &recipient).expect("sealed");
        for job in [
            text,
            Job::from_bytes("b", b"\xff\x00"),
            Job::null_value("n"),
            sealed,
        ] {
            let line = serde_json::to_string(&exported(job.clone())).expect("json");
            let back: Exported = serde_json::from_str(&line).expect("a line");
            assert_eq!(back.job.into_job(), Ok(job));
        }
    }

    /// A sealed job leaves as its ciphertext, nothing opened.
    #[test]
    fn a_sealed_job_is_its_ciphertext() {
        let (_, recipient) = dlq_core::seal::generate_identity();
        let job = Job::from_bytes("s", br#"{"pan":"4111111111111111"}"#);
        let sealed = dlq_core::seal::seal(&job, &recipient).expect("sealed");
        let e = exported(sealed.clone());
        assert_eq!(e.job.sealed.as_ref(), sealed.sealed.as_deref());
        assert_eq!((e.job.payload_base64, e.job.headers_base64), (None, None));
    }

    /// CSV: one quoted line per record, formulas defused in text cells only.
    #[test]
    fn csv_rows_quote_and_defuse() {
        let mut job = Job::from_bytes("a,b", b"+x");
        job.headers.insert("k".into(), "v".into());
        let row = csv_row(&exported(job));
        assert!(row.contains(",'=cmd|' /C calc'!A0,"), "{row}");
        assert!(row.contains(",\"a,b\","), "{row}");
        assert!(row.contains(",K3g=,"), "base64 is never defused: {row}");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn the_selector_joins_queue_group_and_labels() {
        let args = ExportArgs {
            queue: Some("relayer".into()),
            group: Some("3F9A1C07D2".into()),
            selector: Some("team=pay".into()),
            format: Format::Ndjson,
        };
        assert_eq!(
            selector(&args),
            "dlq.dev/queue=relayer,dlq.dev/group=3f9a1c07d2,team=pay"
        );
    }
}
