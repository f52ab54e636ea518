//! `ls`, `show`, `stats`: what is parked and why, at a glance.

use clap::{Args, ValueEnum};
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use dlq_core::api::{
    DeadLetter, DeadLetterQueue, Job, KindCounts, LABEL_FAILURE_KIND, LABEL_QUEUE, Phase,
};

use dlq_core::mask::mask_cards;

use crate::lookup;
use crate::session::{CliError, Global, connect};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only this DeadLetterQueue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this phase (Parked, Redriven, Dropped; any case).
    #[arg(long, value_parser = parse_phase)]
    pub phase: Option<Phase>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// Omit the header line.
    #[arg(long)]
    pub no_headers: bool,
    /// At most this many records (0: all, still read a page at a time).
    #[arg(long, default_value_t = 500)]
    pub limit: usize,
    /// Go on where an earlier `--limit` stopped (the token it printed).
    #[arg(long = "continue", value_name = "TOKEN")]
    pub continue_token: Option<String>,
    /// Only records where TEXT occurs, in any ASCII case, in the job id, reason, error class,
    /// service version, intent, a header's name or value, or the payload; each text as `show`
    /// prints it (card numbers and the queue's mask paths masked). Sealed payloads and headers,
    /// and bodies in a body store, are not searched (the answer counts them). `--limit` then
    /// counts matches. At most 256 bytes.
    #[arg(long, value_name = "TEXT")]
    pub grep: Option<String>,
    /// Only records where PATH equals VALUE exactly, as shown (repeatable: all must hold).
    /// PATH: job.id, reason, errorClass, serviceVersion, intent.id, intent.state, headers.NAME
    /// (any case), payload, or payload.KEY with .KEY, [N] and [*] steps, e.g.
    /// payload.customer=cus_42, payload.items[*].sku=A-1 (a string's text, else its JSON).
    #[arg(long = "where", value_name = "PATH=VALUE")]
    pub wheres: Vec<String>,
}

impl LsArgs {
    /// Whether `ls` searches (`--grep`, `--where`) rather than lists.
    pub fn searches(&self) -> bool {
        self.grep.is_some() || !self.wheres.is_empty()
    }
}

/// `--phase` in any case, as people type it.
pub fn parse_phase(s: &str) -> Result<Phase, String> {
    match s.to_ascii_lowercase().as_str() {
        "parked" => Ok(Phase::Parked),
        "redriven" => Ok(Phase::Redriven),
        "dropped" => Ok(Phase::Dropped),
        _ => Err(format!("{s:?} is not Parked, Redriven or Dropped")),
    }
}

/// Records in scope (one namespace, or all with -A), filtered by queue label.
pub async fn records(
    client: &Client,
    ns: &str,
    all: bool,
    queue: Option<&str>,
    kind: Option<&str>,
) -> Result<Vec<DeadLetter>, CliError> {
    let api: Api<DeadLetter> = if all {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), ns)
    };
    let mut selectors = Vec::new();
    if let Some(q) = queue {
        selectors.push(format!("{LABEL_QUEUE}={q}"));
    }
    if let Some(k) = kind {
        selectors.push(format!("{LABEL_FAILURE_KIND}={}", k.to_ascii_lowercase()));
    }
    let mut items = api
        .list(&ListParams::default().labels(&selectors.join(",")))
        .await?
        .items;
    items.sort_by(|a, b| {
        (a.namespace(), &a.spec.job.id, a.spec.cycle).cmp(&(
            b.namespace(),
            &b.spec.job.id,
            b.spec.cycle,
        ))
    });
    Ok(items)
}

/// Columns padded to their widest cell plus two spaces; the last column is not padded.
pub fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(widths[c] - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One `ls` row: job, #deliveries, phase, intent snapshot, by, reason.
pub fn row(r: &DeadLetter, with_ns: bool) -> Vec<String> {
    let mut row = Vec::new();
    if with_ns {
        row.push(r.namespace().unwrap_or_default());
    }
    row.extend([
        r.spec.job.id.clone(),
        format!("#{}", r.spec.deliveries),
        r.phase().as_str().to_lowercase(),
        r.spec
            .intent
            .as_ref()
            .map_or("-".into(), |i| mask_cards(&i.state)),
        r.spec
            .by
            .clone()
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "-".into()),
        mask_cards(&r.spec.reason),
    ]);
    row
}

/// Most records asked of the apiserver per request: the first rows print after one page.
const PAGE: u32 = 500;

/// `ls`: one row per record (cycle), or the records themselves with `-o json|yaml`. Queue and
/// phase are selected by the apiserver (label and field selectors) and the list is read a page
/// at a time, each printed as it arrives; `--limit` stops early and prints how to continue.
pub async fn ls(g: &Global, args: LsArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<DeadLetter> = if g.all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), &ns)
    };
    let mut lp = ls_params(&args);
    let mut shown = 0usize;
    let mut collected = Vec::new();
    loop {
        let want = if args.limit == 0 {
            PAGE
        } else {
            u32::try_from(args.limit - shown).unwrap_or(PAGE).min(PAGE)
        };
        let page = api.list(&lp.clone().limit(want)).await?;
        let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        let mut items = page.items;
        sort(&mut items);
        shown += items.len();
        match args.output {
            Output::Table => print_rows(g, &args, &items, shown == items.len()),
            Output::Json | Output::Yaml => collected.extend(items),
        }
        let Some(token) = next else { break };
        if args.limit != 0 && shown >= args.limit {
            eprintln!(
                "more records: add --continue {token} for the next {}",
                args.limit
            );
            break;
        }
        lp.continue_token = Some(token);
    }
    if args.output != Output::Table {
        return print_list(&collected, args.output);
    }
    if shown == 0 {
        eprintln!("no records");
    }
    Ok(())
}

/// The apiserver's side of `ls`: the queue as a label selector, the phase as a field selector
/// (records not yet marked by the operator have no phase and count as Parked).
pub fn ls_params(args: &LsArgs) -> ListParams {
    let mut lp = ListParams::default();
    if let Some(q) = &args.queue {
        lp = lp.labels(&format!("{LABEL_QUEUE}={q}"));
    }
    if let Some(p) = args.phase {
        lp = lp.fields(&match p {
            Phase::Parked => "status.phase!=Redriven,status.phase!=Dropped".to_string(),
            other => format!("status.phase={}", other.as_str()),
        });
    }
    lp.continue_token = args.continue_token.clone();
    lp
}

pub fn sort(items: &mut [DeadLetter]) {
    items.sort_by(|a, b| {
        (a.namespace(), &a.spec.job.id, a.spec.cycle).cmp(&(
            b.namespace(),
            &b.spec.job.id,
            b.spec.cycle,
        ))
    });
}

/// One page of `ls` as table rows; the header above the first.
fn print_rows(g: &Global, args: &LsArgs, items: &[DeadLetter], first: bool) {
    let mut rows = Vec::new();
    if first && !args.no_headers && !items.is_empty() {
        rows.push(header(g.all_namespaces));
    }
    rows.extend(items.iter().map(|r| row(r, g.all_namespaces)));
    if !rows.is_empty() {
        print!("{}", table(&rows));
    }
}

/// `ls`'s header row.
pub fn header(with_ns: bool) -> Vec<String> {
    let mut h: Vec<String> = Vec::new();
    if with_ns {
        h.push("NAMESPACE".into());
    }
    h.extend(["JOB", "#", "PHASE", "INTENT", "BY", "REASON"].map(String::from));
    h
}

/// Records as a kubectl `List`, so the output feeds back into `kubectl apply`/`jq` as usual.
pub fn print_list(items: &[DeadLetter], output: Output) -> Result<(), CliError> {
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    let text = match output {
        Output::Yaml => serde_yaml::to_string(&list).map_err(|e| CliError::Usage(e.to_string()))?,
        _ => {
            serde_json::to_string_pretty(&list).map_err(|e| CliError::Usage(e.to_string()))? + "\n"
        }
    };
    print!("{text}");
    Ok(())
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// Job id or record name.
    pub job: String,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// Show the payload and headers through the reveal API (as you: needs the role
    /// dlq-payload-reader; an Event and the apiserver's audit log record it), opened when
    /// sealed, card numbers and the queue's mask paths masked.
    #[arg(long)]
    pub reveal: bool,
    /// With --reveal: the exact bytes, nothing masked (the `unmasked` subresource).
    #[arg(long, requires = "reveal")]
    pub unmasked: bool,
    /// Write the job's exact bytes (its stored body, else its payload) to stdout, e.g.
    /// `> file`: through the reveal API as you (the unmasked view: needs the role
    /// dlq-payload-reader; an Event and the audit log record it), streamed, and checked
    /// against the record's size and SHA-256.
    #[arg(long, conflicts_with_all = ["reveal", "unmasked"])]
    pub body: bool,
}

/// One record in full; the table form reads the record's recent Events too.
pub async fn show(g: &Global, args: ShowArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let cycles = lookup::cycles(&client, &ns, &args.job).await?;
    let Some(r) = cycles.last() else {
        return Err(CliError::Usage(format!(
            "no record of {} in namespace {ns}",
            args.job
        )));
    };
    if args.body {
        return download_body(&client, &ns, r).await;
    }
    if args.output != Output::Table {
        return print_list(std::slice::from_ref(r), args.output);
    }
    let events = recent_events(&client, &ns, &r.name_any()).await?;
    let mut out = String::new();
    show_facts(&mut out, r, &ns, cycles.len());
    show_decision(&mut out, r);
    if let Some(body) = r.spec.job.stored_body() {
        // The head is in the store, not the record: only the reveal API reads it.
        let revealed = crate::reveal::fetch(&client, &ns, &r.name_any(), args.unmasked).await;
        if args.reveal {
            let revealed = revealed?;
            let masking = if args.unmasked {
                Masking::None
            } else {
                Masking::Cards(Vec::new())
            };
            show_job(&mut out, &revealed.clone().into_job(&r.spec.job), &masking);
            show_body(&mut out, &r.spec.job.id, body, Ok(revealed));
        } else {
            let mask = mask_paths(&client, &ns, &r.spec.queue).await;
            show_job(&mut out, &r.spec.job, &Masking::Cards(mask));
            show_body(&mut out, &r.spec.job.id, body, revealed);
        }
    } else if args.reveal {
        let revealed = crate::reveal::fetch(&client, &ns, &r.name_any(), args.unmasked).await?;
        // Masked by the server already; the unmasked view is shown exactly.
        let masking = if args.unmasked {
            Masking::None
        } else {
            Masking::Cards(Vec::new())
        };
        show_job(&mut out, &revealed.into_job(&r.spec.job), &masking);
    } else {
        let mask = mask_paths(&client, &ns, &r.spec.queue).await;
        show_job(&mut out, &r.spec.job, &Masking::Cards(mask));
    }
    show_conditions(&mut out, r);
    show_events(&mut out, &events);
    print!("{out}");
    Ok(())
}

/// One `Key:  value` line of `show`.
fn kv(out: &mut String, k: &str, v: impl std::fmt::Display) {
    out.push_str(&format!("{k:<16}{v}\n"));
}

/// What was parked and why: name, job, queue, cycle, phase, failure, intent snapshot. The
/// reason and the intent are never sealed, and are shown with card numbers masked like the
/// payload (`-o yaml` keeps them as they are).
fn show_facts(out: &mut String, r: &DeadLetter, ns: &str, cycles: usize) {
    let s = &r.spec;
    kv(out, "Name:", r.name_any());
    kv(out, "Namespace:", ns);
    kv(out, "Job:", &s.job.id);
    kv(out, "Queue:", &s.queue);
    kv(out, "Cycle:", format!("{} (of {cycles} recorded)", s.cycle));
    kv(out, "Phase:", r.phase().as_str());
    kv(out, "Failure kind:", format!("{:?}", s.failure_kind));
    kv(out, "Deliveries:", s.deliveries);
    kv(out, "Reason:", mask_cards(&s.reason));
    kv(out, "Failed at:", s.failed_at.0);
    kv(out, "Service:", s.service_version.as_deref().unwrap_or("-"));
    kv(
        out,
        "Intent:",
        s.intent.as_ref().map_or("-".into(), |i| {
            mask_cards(&format!("{} was {} when parked", i.id, i.state))
        }),
    );
}

/// Who decided what, why, and when the operator carried it out.
fn show_decision(out: &mut String, r: &DeadLetter) {
    let s = &r.spec;
    kv(
        out,
        "Decision:",
        match (&s.action, &s.by) {
            (Some(a), Some(by)) => format!("{a:?} by {by}").to_lowercase(),
            _ => "none yet".into(),
        },
    );
    if let Some(n) = &s.note {
        kv(out, "Note:", n);
    }
    if let Some(st) = &r.status
        && let (Some(by), Some(at)) = (&st.resolved_by, &st.resolved_at)
    {
        kv(out, "Resolved:", format!("by {by} at {}", at.0));
    }
}

/// The queue's `spec.protection.mask` paths (none when the queue cannot be read: card numbers
/// are masked anyway).
pub async fn mask_paths(client: &kube::Client, ns: &str, queue: &str) -> Vec<String> {
    let api: kube::Api<dlq_core::api::DeadLetterQueue> = kube::Api::namespaced(client.clone(), ns);
    match api.get_opt(queue).await {
        Ok(Some(q)) => q.mask_paths().to_vec(),
        _ => Vec::new(),
    }
}

/// The mask paths of every queue in scope (none known when the queues cannot be read: card
/// numbers are masked anyway, as in [`mask_paths`]).
pub async fn queue_masks(client: &Client, namespace: Option<&str>) -> crate::search::Masks {
    let api: Api<DeadLetterQueue> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    match api.list(&ListParams::default()).await {
        Ok(l) => crate::search::Masks::of_queues(&l.items),
        Err(_) => crate::search::Masks::default(),
    }
}

/// How a payload is shown.
enum Masking {
    /// Card numbers and these JSON paths masked (`dlq_core::mask`).
    Cards(Vec<String>),
    /// Exactly as it is (`show --reveal --unmasked`).
    None,
}

impl Masking {
    fn header(&self, value: &str) -> String {
        match self {
            Masking::Cards(_) => dlq_core::mask::mask_cards(value),
            Masking::None => value.to_string(),
        }
    }

    fn payload(&self, text: &str) -> String {
        match self {
            Masking::Cards(paths) => dlq_core::mask::mask_payload(text, paths),
            Masking::None => text.to_string(),
        }
    }

    /// A binary payload's base64, card numbers masked in the bytes before encoding (base64 of
    /// the bytes as they are decodes to the whole number).
    fn binary(&self, bytes: &[u8]) -> String {
        use base64::Engine;
        let engine = base64::engine::general_purpose::STANDARD;
        match self {
            Masking::Cards(_) => engine.encode(dlq_core::mask::mask_card_bytes(bytes)),
            Masking::None => engine.encode(bytes),
        }
    }
}

/// The job's headers and payload: UTF-8 as text, anything else as its base64; card numbers and
/// the queue's `mask` paths masked unless asked (`dlq_core::mask`); a sealed job as sealed.
fn show_job(out: &mut String, job: &Job, masking: &Masking) {
    if let Some(origin) = &job.origin {
        kv(out, "Origin:", origin_line(origin));
    }
    // A stored body is not in the record: its lines follow (`show_body`).
    const IN_STORE: &str = "in the queue's body store (Body: below)";
    if let Some(sealed) = &job.sealed {
        kv(out, "Headers:", "sealed");
        if job.stored_body().is_some() {
            kv(out, "Payload:", IN_STORE);
        } else {
            kv(out, "Payload:", dlq_core::seal::sealed_label(sealed));
        }
        return;
    }
    let headers = if job.headers.is_empty() {
        "-".to_string()
    } else {
        job.headers
            .iter()
            .map(|(k, v)| format!("{}={}", masking.header(k), masking.header(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    kv(out, "Headers:", headers);
    if job.stored_body().is_some() {
        kv(out, "Payload:", IN_STORE);
        return;
    }
    let bytes = job.payload_bytes().unwrap_or_default();
    let payload = match std::str::from_utf8(&bytes) {
        _ if job.payload_null => "(null: no value at all, a Kafka tombstone)".to_string(),
        Ok(text) => format!("({} bytes, UTF-8)\n{}", bytes.len(), masking.payload(text)),
        Err(_) => format!(
            "({} bytes, binary; base64)\n{}",
            bytes.len(),
            masking.binary(&bytes)
        ),
    };
    kv(out, "Payload:", payload);
    show_backtrace(out, &bytes);
}

/// `show --body`: the exact bytes to stdout, never to a terminal.
async fn download_body(client: &Client, ns: &str, r: &DeadLetter) -> Result<(), CliError> {
    use std::io::IsTerminal;
    if std::io::stdout().is_terminal() {
        return Err(CliError::Usage(
            "--body writes the job's exact bytes to stdout: redirect it (> file)".into(),
        ));
    }
    let want = r.spec.job.stored_body().filter(|b| b.recipient.is_none());
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    crate::reveal::download(client, ns, &r.name_any(), want, &mut out).await?;
    Ok(())
}

/// A body kept in the queue's store: its size, digest and reference from the record, and its
/// first KiB as the reveal API showed it (or why not).
fn show_body(
    out: &mut String,
    job: &str,
    body: &dlq_core::api::BodyRef,
    revealed: Result<crate::reveal::Revealed, CliError>,
) {
    let size = body.size.max(0).unsigned_abs();
    kv(
        out,
        "Body:",
        format!(
            "{} ({size} bytes{}) in the queue's body store",
            human_bytes(size),
            if body.recipient.is_some() {
                ", sealed: the ciphertext's size and digest"
            } else {
                ""
            }
        ),
    );
    kv(out, "Body sha256:", &body.sha256);
    kv(out, "Body ref:", &body.reference);
    if let Some(recipient) = &body.recipient {
        kv(out, "Body sealed:", format!("to {recipient}"));
    }
    let head = match revealed {
        Err(e) => format!("(not shown: {e})"),
        Ok(r) => match (r.body_head, r.body_head_base64, r.body_head_withheld) {
            (Some(text), _, _) => format!("(first {} bytes, UTF-8)\n{text}", text.len()),
            (None, Some(b64), _) => format!("(first KiB, binary; base64)\n{b64}"),
            (None, None, Some(why)) => format!("(not shown: {why})"),
            (None, None, None) => "(not shown: the reveal API described no body)".to_string(),
        },
    };
    kv(out, "Body head:", head);
    kv(
        out,
        "",
        format!("kubectl dlq show {job} --body > FILE downloads all of it"),
    );
}

/// Bytes for a person: `2.0 MiB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Where the broker says the job was before it died, as `field=value` pairs.
fn origin_line(origin: &dlq_core::api::Origin) -> String {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(origin) else {
        return "-".into();
    };
    fields
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A Sidekiq job's backtrace, decoded for reading (the payload above keeps its bytes).
fn show_backtrace(out: &mut String, payload: &[u8]) {
    match dlq_core::sidekiq::backtrace(payload) {
        None => {}
        Some(Ok(lines)) => {
            out.push_str("Backtrace:\n");
            for line in lines {
                out.push_str(&format!("  {line}\n"));
            }
        }
        Some(Err(why)) => kv(out, "Backtrace:", format!("(kept in the payload; {why})")),
    }
}

/// The operator's conditions, one line each: what it did and what is failing. A Parked record
/// has none until a redrive fails (the operator's mark writes no status).
fn show_conditions(out: &mut String, r: &DeadLetter) {
    out.push_str("Conditions:\n");
    if r.status.as_ref().is_none_or(|s| s.conditions.is_empty()) {
        out.push_str("  none\n");
    }
    for c in r.status.iter().flat_map(|s| &s.conditions) {
        out.push_str(&format!(
            "  {:<10}{:<6}{:<20}{}\n",
            c.type_, c.status, c.reason, c.message
        ));
    }
}

/// The record's last ten Events, oldest first.
pub async fn recent_events(client: &Client, ns: &str, name: &str) -> Result<Vec<Event>, CliError> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().fields(&format!("regarding.name={name}"));
    let mut evs = events.list(&lp).await?.items;
    evs.sort_by_key(|e| e.metadata.creation_timestamp.as_ref().map(|t| t.0));
    let skip = evs.len().saturating_sub(10);
    Ok(evs.split_off(skip))
}

/// The recent Events, one line each: the record's history as the operator told it.
fn show_events(out: &mut String, events: &[Event]) {
    out.push_str("Events:\n");
    for e in events {
        out.push_str(&format!(
            "  {:<8}{:<16}{}\n",
            e.type_.as_deref().unwrap_or_default(),
            e.reason.as_deref().unwrap_or_default(),
            e.note.as_deref().unwrap_or_default()
        ));
    }
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    #[arg(long)]
    pub queue: Option<String>,
}

/// `stats`: counts per queue and failure kind, with the age of the oldest parked record (the
/// one an alert would be about). Read from the queues' status counters, which the operator
/// keeps, so it costs one small list however many records there are.
pub async fn stats(g: &Global, args: StatsArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<DeadLetterQueue> = if g.all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), &ns)
    };
    let queues = api.list(&ListParams::default()).await?.items;
    let now = jiff::Timestamp::now();
    let mut rows = vec![Vec::new()];
    if g.all_namespaces {
        rows[0].push("NAMESPACE".to_string());
    }
    rows[0].extend(
        [
            "QUEUE",
            "KIND",
            "PARKED",
            "REDRIVEN",
            "DROPPED",
            "OLDEST PARKED",
            "WAITING",
        ]
        .map(String::from),
    );
    for q in queues
        .iter()
        .filter(|q| args.queue.as_ref().is_none_or(|want| *want == q.name_any()))
    {
        let mut kinds = kind_counts(q);
        let waiting = waiting(q);
        // A storm's queue whose records were all resolved still shows what waits.
        if kinds.is_empty() && waiting != "-" {
            kinds.push(("-".into(), KindCounts::default()));
        }
        for (i, (kind, c)) in kinds.into_iter().enumerate() {
            let mut row = Vec::new();
            if g.all_namespaces {
                row.push(q.namespace().unwrap_or_default());
            }
            row.extend([
                q.name_any(),
                kind,
                c.parked.to_string(),
                c.redriven.to_string(),
                c.dropped.to_string(),
                c.oldest_parked_at
                    .map_or("-".into(), |o| human_age(now.duration_since(o.0).as_secs())),
                // The queue's, on its first line only: per kind it is not known.
                if i == 0 {
                    waiting.clone()
                } else {
                    String::new()
                },
            ]);
            rows.push(row);
        }
    }
    if rows.len() == 1 {
        eprintln!("no records");
    } else {
        print!("{}", table(&rows));
    }
    Ok(())
}

/// What waits beyond a queue's records: its source's backlog (`14,968`, `unknown` where the
/// broker cannot say), or what its park endpoint refused in the last minute (`37 refused/min`);
/// `-` for neither.
pub fn waiting(q: &DeadLetterQueue) -> String {
    let Some(s) = &q.status else {
        return "-".into();
    };
    match (&s.backlog, &s.http) {
        (Some(b), _) => b.shown(),
        (None, Some(h)) if h.refused_last_minute > 0 => {
            format!(
                "{} refused/min",
                dlq_core::api::thousands(h.refused_last_minute)
            )
        }
        _ => "-".into(),
    }
}

/// A queue's counters per failure kind (lower case, as labels spell it), kinds without any
/// record left out; a queue the operator has not counted per kind yet shows its totals as `-`.
fn kind_counts(q: &DeadLetterQueue) -> Vec<(String, KindCounts)> {
    let Some(s) = &q.status else {
        return Vec::new();
    };
    if s.failure_kinds.is_empty() {
        let total = KindCounts {
            parked: s.parked,
            redriven: s.redriven,
            dropped: s.dropped,
            oldest_parked_at: s.oldest_parked_at.clone(),
        };
        let any = total.parked + total.redriven + total.dropped > 0;
        return if any {
            vec![("-".into(), total)]
        } else {
            Vec::new()
        };
    }
    let mut kinds: Vec<(String, KindCounts)> = s
        .failure_kinds
        .iter()
        .filter(|(_, c)| c.parked + c.redriven + c.dropped > 0)
        .map(|(k, c)| (k.to_ascii_lowercase(), c.clone()))
        .collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    kinds
}

/// `42s`, `5m`, `3h`, `2d`: the way kubectl shows ages.
pub fn human_age(secs: i64) -> String {
    let secs = secs.max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_queues_waiting_column_shows_its_backlog_unknown_or_refusals() {
        use dlq_core::api::{
            DeadLetterQueue, DeadLetterQueueSpec, DeadLetterQueueStatus, HttpParkStatus,
            QueueBacklog,
        };
        let with = |status: Option<DeadLetterQueueStatus>| {
            let mut q = DeadLetterQueue::new("relayer", DeadLetterQueueSpec::default());
            q.status = status;
            super::waiting(&q)
        };
        assert_eq!(with(None), "-");
        assert_eq!(with(Some(DeadLetterQueueStatus::default())), "-");
        let backlog = |messages| {
            Some(DeadLetterQueueStatus {
                backlog: Some(QueueBacklog {
                    messages,
                    observed_at: None,
                }),
                ..Default::default()
            })
        };
        assert_eq!(with(backlog(Some(14_968))), "14,968");
        assert_eq!(with(backlog(Some(0))), "0");
        assert_eq!(with(backlog(None)), "unknown", "never 0");
        let refused = |n| {
            Some(DeadLetterQueueStatus {
                http: Some(HttpParkStatus {
                    refused_last_minute: n,
                }),
                ..Default::default()
            })
        };
        assert_eq!(with(refused(1_200)), "1,200 refused/min");
        assert_eq!(with(refused(0)), "-");
    }

    use super::*;

    #[test]
    fn tables_align_on_the_widest_cell() {
        let rows = vec![
            vec![
                "pi_0001/settle".to_string(),
                "#1".into(),
                "parked".into(),
                "x".into(),
            ],
            vec!["a".to_string(), "#12".into(), "redriven".into(), "y".into()],
        ];
        assert_eq!(
            table(&rows),
            "pi_0001/settle  #1   parked    x\na               #12  redriven  y\n"
        );
    }

    /// A Sidekiq job shows where it ran and its backtrace decoded; the payload stays as it is.
    #[test]
    fn a_sidekiq_job_shows_its_origin_and_decoded_backtrace() {
        let raw = r#"{"jid":"j","queue":"default","class":"SettleJob","error_backtrace":"eJyLVkrUK0qyMrTKzFNIqFBX0lFKAvGNlGIBZEUHOw==\n"}"#;
        let job = dlq_core::sidekiq::request_for("relayer", raw.as_bytes()).job;
        let mut out = String::new();
        show_job(&mut out, &job, &Masking::Cards(Vec::new()));
        assert!(
            out.contains("Origin:         class=SettleJob, queue=default\n"),
            "{out}"
        );
        assert!(out.contains(raw), "the payload as it is: {out}");
        assert!(
            out.contains("Backtrace:\n  a.rb:1:in `x'\n  b.rb:2\n"),
            "{out}"
        );
        let mut plain = String::new();
        show_job(
            &mut plain,
            &Job::from_bytes("j", b"{}"),
            &Masking::Cards(Vec::new()),
        );
        assert!(
            !plain.contains("Origin:") && !plain.contains("Backtrace:"),
            "{plain}"
        );
    }

    /// Card numbers and the queue's paths are masked; a sealed job shows only its recipient.
    #[test]
    fn show_masks_cards_and_paths_and_keeps_sealed_jobs_sealed() {
        let mut job = Job::from_bytes("j", br#"{"card":"4111 1111 1111 1111","holder":"Ada"}"#);
        job.headers
            .insert("x-card".into(), "4111111111111111".into());
        let mut out = String::new();
        show_job(
            &mut out,
            &job,
            &Masking::Cards(vec!["$.holder".to_string()]),
        );
        assert!(out.contains("x-card=411111******1111"), "{out}");
        assert!(
            out.contains(r#"{"card":"4111 11** **** 1111","holder":"****"}"#),
            "{out}"
        );
        assert!(
            !out.contains("Ada") && !out.contains("4111111111111111"),
            "{out}"
        );
        let (_, recipient) = dlq_core::seal::generate_identity();
        let sealed = dlq_core::seal::seal(&job, &recipient).unwrap();
        let mut out = String::new();
        show_job(&mut out, &sealed, &Masking::Cards(Vec::new()));
        assert!(
            out.contains(&format!("sealed (recipient {recipient})")),
            "{out}"
        );
        assert!(!out.contains("4111"), "{out}");
        // `show --reveal --unmasked`: exactly as revealed.
        let mut out = String::new();
        show_job(&mut out, &job, &Masking::None);
        assert!(
            out.contains("x-card=4111111111111111") && out.contains("Ada"),
            "{out}"
        );
    }

    /// A binary payload's base64 decodes to its card number masked, a header's name is masked
    /// like its value, and so are the reason and the intent (never sealed).
    #[test]
    fn show_masks_binary_payloads_header_names_reasons_and_intents() {
        use base64::Engine;
        let engine = base64::engine::general_purpose::STANDARD;
        let mut job = Job::from_bytes("j", b"\xff\x00pan=4242424242424242;");
        job.headers
            .insert("x-pan-6011111111111117".into(), "v".into());
        let mut out = String::new();
        show_job(&mut out, &job, &Masking::Cards(Vec::new()));
        let shown = out
            .lines()
            .skip_while(|l| !l.contains("binary; base64"))
            .nth(1)
            .unwrap_or_default();
        let decoded = engine.decode(shown.trim()).expect("base64");
        assert_eq!(decoded, b"\xff\x00pan=424242******4242;");
        assert!(out.contains("x-pan-601111******1117=v"), "{out}");
        assert!(!out.contains("6011111111111117"), "{out}");
        let mut exact = String::new();
        show_job(&mut exact, &job, &Masking::None);
        assert!(
            exact.contains(job.payload_base64.as_deref().unwrap_or("?")),
            "{exact}"
        );

        let mut req = dlq_core::park::ParkRequest::new("q", Job::from_bytes("j", b"{}"));
        req.reason = "card 4000056655665556 declined".into();
        req.intent = Some(dlq_core::api::IntentSnapshot {
            id: "card-4000056655665556".into(),
            state: "failed".into(),
        });
        let r = dlq_core::park::new_record(&req, 1);
        let mut facts = String::new();
        show_facts(&mut facts, &r, "ns", 1);
        assert!(!facts.contains("4000056655665556"), "{facts}");
        assert!(
            facts.contains("card-400005******5556 was failed"),
            "{facts}"
        );
        assert!(facts.contains("card 400005******5556 declined"), "{facts}");
        let listed = row(&r, false).join(" ");
        assert!(!listed.contains("4000056655665556"), "{listed}");
    }

    #[test]
    fn a_stored_body_shows_its_facts_and_head_or_why_not() {
        let body = dlq_core::api::BodyRef {
            reference: "s3://b/p/sha256/ab".into(),
            size: 3 << 20,
            sha256: "ab".repeat(32),
            recipient: None,
            external: false,
        };
        let mut job = Job::from_bytes("j", b"");
        job.payload = None;
        job.body = Some(Box::new(body.clone()));
        let mut out = String::new();
        show_job(&mut out, &job, &Masking::Cards(Vec::new()));
        let revealed = crate::reveal::Revealed {
            body_head: Some("{\"card\":\"411111******1111\"".into()),
            ..Default::default()
        };
        show_body(&mut out, "j", &body, Ok(revealed));
        assert!(
            out.contains("Payload:        in the queue's body store"),
            "{out}"
        );
        assert!(
            out.contains("3.0 MiB (3145728 bytes) in the queue's body store"),
            "{out}"
        );
        assert!(
            out.contains(&"ab".repeat(32)) && out.contains("s3://b/p/sha256/ab"),
            "{out}"
        );
        assert!(
            out.contains("411111******1111") && out.contains("show j --body"),
            "{out}"
        );
        let mut out = String::new();
        let refused =
            CliError::Refused("revealing payloads needs the dlq-payload-reader role".into());
        show_body(&mut out, "j", &body, Err(refused));
        assert!(
            out.contains("(not shown: revealing payloads needs the dlq-payload-reader role)"),
            "{out}"
        );
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2 << 20), "2.0 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn ages() {
        assert_eq!(human_age(5), "5s");
        assert_eq!(human_age(600), "10m");
        assert_eq!(human_age(3 * 3600), "3h");
        assert_eq!(human_age(3 * 86400), "3d");
    }
}
