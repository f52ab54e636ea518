//! `kubectl dlq park`.

use std::collections::BTreeMap;
use std::io::Read;

use clap::Args;
use kube::ResourceExt;

use dlq_client::park::{ParkError, ParkOutcome, ParkRequest, Parker};
use dlq_core::api::{FailureKind, IntentSnapshot, Job, MAX_PAYLOAD_BYTES};
use dlq_core::park::validate;

use crate::park_endpoint::Size;
use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct ParkArgs {
    /// DeadLetterQueue the job came from (with --from: the queue every record is parked into,
    /// instead of the one it was exported from).
    #[arg(long, required_unless_present = "from")]
    pub queue: Option<String>,
    /// Job id (e.g. pi_0003/settle).
    #[arg(long, required_unless_present = "from")]
    pub id: Option<String>,
    /// Park the records of an export again (`kubectl dlq export`'s NDJSON; FILE, or - for
    /// stdin) into this namespace, a line at a time: each keeps its job id, its source message
    /// identity and its cycle, and is parked as any job is (a job already parked here answers
    /// with its record). Parked records only; resolved ones are counted and skipped.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "id", "payload", "payload_base64", "headers", "intent_id", "intent_state",
        "service_version", "error_class", "message", "token_file", "park_url"])]
    pub from: Option<std::path::PathBuf>,
    /// Payload: TEXT, @FILE, or @- for stdin. Non-UTF-8 bytes are stored as payloadBase64.
    /// A FILE or stdin over a record's limit (256 KiB) is streamed to the queue's HTTP park
    /// endpoint (`status.address`; the queue needs spec.http and spec.bodies), which keeps it
    /// in the queue's body store: this plugin never holds the store's credentials. Stdin is
    /// first copied to a private temp file (the endpoint wants its length), up to the queue's
    /// maxBytes.
    #[arg(long)]
    pub payload: Option<String>,
    /// With a payload over a record's limit: a bearer token for the park endpoint, with the
    /// queue's audience (e.g. `kubectl create token SA --audience AUDIENCE`); without one the
    /// endpoint takes it only from a queue allowing anonymous callers, from inside the cluster.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<std::path::PathBuf>,
    /// With a payload over a record's limit: the park endpoint's URL as reachable from here
    /// (default: the queue's status.address.url, an in-cluster address).
    #[arg(long, value_name = "URL")]
    pub park_url: Option<String>,
    /// Payload as base64 text: TEXT, @FILE, or @- for stdin.
    #[arg(long)]
    pub payload_base64: Option<String>,
    /// Original header, K=V (repeatable).
    #[arg(long = "header", value_name = "K=V")]
    pub headers: Vec<String>,
    #[arg(long, default_value = "")]
    pub reason: String,
    /// Deliveries in this cycle.
    #[arg(long, default_value_t = 0)]
    pub deliveries: i32,
    #[arg(long, value_parser = parse_kind, default_value = "Transient")]
    pub failure_kind: FailureKind,
    /// Business object id for the snapshot (with --intent-state).
    #[arg(long, requires = "intent_state")]
    pub intent_id: Option<String>,
    /// Business object state at parking time (with --intent-id).
    #[arg(long, requires = "intent_id")]
    pub intent_state: Option<String>,
    /// Consumer version that gave up (e.g. relayer@1.4.2).
    #[arg(long)]
    pub service_version: Option<String>,
    /// What kind of error it was (e.g. an exception class, PayerTimeout): records of one
    /// queue, failure kind, service version and error class whose reasons differ only in ids
    /// share a failure group (`kubectl dlq groups`).
    #[arg(long, value_name = "CLASS")]
    pub error_class: Option<String>,
    /// This dead message's own id (one your producer keeps per death, e.g. a broker message
    /// id). Parking with the same id again, such as a retry after a lost reply, answers with
    /// that message's record even if it was resolved meanwhile, instead of parking the same
    /// death as a new cycle.
    #[arg(long, value_name = "ID")]
    pub message: Option<String>,
}

impl ParkArgs {
    /// `--queue` (clap requires it unless `--from`).
    fn queue(&self) -> &str {
        self.queue.as_deref().unwrap_or_default()
    }

    /// `--id` (clap requires it unless `--from`).
    fn id(&self) -> &str {
        self.id.as_deref().unwrap_or_default()
    }
}

/// `--failure-kind` in any case.
fn parse_kind(s: &str) -> Result<FailureKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "transient" => Ok(FailureKind::Transient),
        "invalid" => Ok(FailureKind::Invalid),
        _ => Err(format!("{s:?} is not Transient or Invalid")),
    }
}

/// Text of `--payload-base64` for a payload at the limit, plus room for a trailing newline.
const MAX_BASE64_ARG: usize = dlq_core::api::MAX_PAYLOAD_BASE64_LEN + 2;

/// TEXT, @FILE or @- as bytes, at most `limit` of them: reads `limit + 1` bytes at most, so
/// an endless file or pipe (`/dev/zero`, `yes |`) is refused after that much, not read into
/// memory.
fn read_arg(flag: &str, value: &str, limit: usize) -> Result<Vec<u8>, CliError> {
    let bytes = match value.strip_prefix('@') {
        Some("-") => read_bounded(std::io::stdin().lock(), limit)
            .map_err(|e| CliError::Io(format!("{flag} @-: reading stdin"), e))?,
        Some(path) => read_file(flag, path, limit)?,
        None => value.as_bytes().to_vec(),
    };
    if bytes.len() > limit {
        return Err(CliError::Usage(format!(
            "{flag} {}: larger than the limit of {limit} bytes",
            shown(value)
        )));
    }
    Ok(bytes)
}

/// A regular file or a pipe, read up to `limit + 1` bytes; a directory or a device is
/// refused by its type, before any read (a device such as /dev/zero never ends).
fn read_file(flag: &str, path: &str, limit: usize) -> Result<Vec<u8>, CliError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |e| CliError::Io(format!("{flag} @{path}: reading {path}"), e);
    let file = std::fs::File::open(path).map_err(io)?;
    let kind = file.metadata().map_err(io)?.file_type();
    let what = if kind.is_dir() {
        Some("a directory")
    } else if kind.is_char_device() || kind.is_block_device() {
        Some("a device")
    } else {
        None
    };
    if let Some(what) = what {
        return Err(CliError::Usage(format!(
            "{flag} @{path}: {path} is {what}; give a regular file, a pipe, or @- for stdin"
        )));
    }
    read_bounded(file, limit).map_err(io)
}

/// At most `limit + 1` bytes of `r`: one more than allowed says "too long" without reading on.
fn read_bounded(r: impl Read, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(limit as u64 + 1).read_to_end(&mut buf)?;
    Ok(buf)
}

/// The flag's value as the person typed it, cut short when it is long inline text.
fn shown(value: &str) -> String {
    match value.char_indices().nth(40) {
        Some((i, _)) => format!("{:?}...", &value[..i]),
        None => format!("{value:?}"),
    }
}

/// The park request the flags describe, with `stdin` already read for `--payload @-`; reads
/// payload files, so it can fail before any I/O to the cluster.
pub fn request(args: &ParkArgs, stdin: Option<Vec<u8>>) -> Result<ParkRequest, CliError> {
    let mut job = Job {
        id: args.id().to_string(),
        ..Job::default()
    };
    if let Some(p) = &args.payload {
        let bytes = match stdin {
            Some(bytes) => bytes,
            None => read_arg("--payload", p, MAX_PAYLOAD_BYTES)?,
        };
        match String::from_utf8(bytes) {
            Ok(text) => job.payload = Some(text),
            Err(e) => {
                use base64::Engine;
                if args.payload_base64.is_some() {
                    return Err(CliError::Usage(
                        "give either --payload or --payload-base64, not both".into(),
                    ));
                }
                job.payload_base64 =
                    Some(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()));
            }
        }
    }
    if let Some(p) = &args.payload_base64 {
        let text = String::from_utf8(read_arg("--payload-base64", p, MAX_BASE64_ARG)?)
            .map_err(|_| CliError::Usage("--payload-base64 must be base64 text".into()))?;
        job.payload_base64 = Some(text.trim().to_string());
    }
    let mut headers = BTreeMap::new();
    for h in &args.headers {
        let (k, v) = h
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--header {h:?}: expected K=V")))?;
        headers.insert(k.to_string(), v.to_string());
    }
    job.headers = headers;
    let mut req = ParkRequest::new(args.queue(), job);
    req.reason = args.reason.clone();
    req.deliveries = args.deliveries;
    req.failure_kind = args.failure_kind;
    req.service_version = args.service_version.clone();
    req.error_class = args.error_class.clone();
    req.intent = match (&args.intent_id, &args.intent_state) {
        (Some(id), Some(state)) => Some(IntentSnapshot {
            id: id.clone(),
            state: state.clone(),
        }),
        _ => None,
    };
    match args.message.as_deref().map(str::trim) {
        Some("") => return Err(CliError::Usage("--message must not be empty".into())),
        Some(message) => req = req.with_message(message),
        None => {}
    }
    Ok(req)
}

/// The path and size of `--payload @FILE` when the file is over a record's limit.
fn large_file(args: &ParkArgs) -> Result<Option<(String, u64)>, CliError> {
    let Some(path) = args.payload.as_deref().and_then(|p| p.strip_prefix('@')) else {
        return Ok(None);
    };
    if path == "-" {
        return Ok(None);
    }
    let meta = std::fs::metadata(path)
        .map_err(|e| CliError::Io(format!("--payload @{path}: reading {path}"), e))?;
    Ok((meta.is_file() && meta.len() > MAX_PAYLOAD_BYTES as u64)
        .then(|| (path.to_string(), meta.len())))
}

/// A payload over a record's limit: a file, or what stdin gave so far (the rest still unread).
enum Large<'a> {
    File { path: &'a str, size: u64 },
    Stdin(Vec<u8>),
}

/// Stdin's bytes in a temp file of this user's alone (the park endpoint wants a length before
/// the body), deleted when dropped.
struct Spool {
    path: std::path::PathBuf,
    size: u64,
}

impl Spool {
    /// `head` and the rest of stdin, at most `max + 1` bytes in all (one more says "too long").
    fn from_stdin(head: &[u8], max: u64) -> Result<Spool, CliError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path =
            std::env::temp_dir().join(format!("kubectl-dlq-park-{}-{nanos}", std::process::id()));
        let io = |e| CliError::Io("--payload @-: copying stdin to a temp file".into(), e);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        // Deleted on drop from here on, whatever fails next.
        let mut spool = Spool { path, size: 0 };
        file.write_all(head).map_err(io)?;
        let rest = (max + 1).saturating_sub(head.len() as u64);
        let copied =
            std::io::copy(&mut std::io::stdin().lock().take(rest), &mut file).map_err(io)?;
        file.flush().map_err(io)?;
        spool.size = head.len() as u64 + copied;
        Ok(spool)
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `park` of a payload over a record's limit, through the queue's park endpoint.
async fn park_large(global: &Global, args: &ParkArgs, large: Large<'_>) -> Result<(), CliError> {
    if args.payload_base64.is_some()
        || args.intent_id.is_some()
        || args.service_version.is_some()
        || args.message.is_some()
    {
        return Err(CliError::Usage(
            "a payload over a record's limit goes through the park endpoint, which takes the job id, reason, deliveries, failure kind, error class and headers: not --payload-base64, --intent-*, --service-version or --message".into(),
        ));
    }
    let (client, ns) = connect(global).await?;
    let queues: kube::Api<dlq_core::api::DeadLetterQueue> = kube::Api::namespaced(client, &ns);
    let queue = queues.get_opt(args.queue()).await?.ok_or_else(|| {
        CliError::Usage(format!(
            "no DeadLetterQueue {} in namespace {ns}",
            args.queue()
        ))
    })?;
    let spool;
    let (path, size) = match large {
        Large::File { path, size } => (path.to_string(), size),
        Large::Stdin(head) => {
            // What the queue lacks is said before the rest of stdin is read.
            crate::park_endpoint::endpoint_of(&queue, Size::OverARecord, args.park_url.as_deref())?;
            let max = queue
                .spec
                .bodies
                .as_ref()
                .map_or(MAX_PAYLOAD_BYTES as u64, |b| b.max());
            spool = Spool::from_stdin(&head, max)?;
            if spool.size > max {
                return Err(CliError::Refused(format!(
                    "the payload on stdin is over DeadLetterQueue {}'s limit of {max} bytes (spec.bodies.maxBytes, or a record's limit without a body store)",
                    args.queue()
                )));
            }
            (spool.path.display().to_string(), spool.size)
        }
    };
    let endpoint =
        crate::park_endpoint::endpoint_of(&queue, Size::Exactly(size), args.park_url.as_deref())?;
    let described = crate::park_endpoint::Described {
        id: args.id(),
        deliveries: args.deliveries,
        reason: &args.reason,
        failure_kind: args.failure_kind,
        error_class: args.error_class.as_deref(),
        headers: &args.headers,
        token_file: args.token_file.as_deref(),
    };
    let (name, new) = crate::park_endpoint::park_file(&described, &endpoint, &path, size).await?;
    if new {
        println!(
            "parked {name} (new; {size} bytes sent to the queue's park endpoint {}, kept in its body store)",
            endpoint.url
        );
    } else {
        println!(
            "already parked {name} (nothing changed; the queue's park endpoint {} answered with its record)",
            endpoint.url
        );
    }
    Ok(())
}

/// `park`: validates locally, parks once, and says whether the record is new.
pub async fn run(global: &Global, args: ParkArgs) -> Result<(), CliError> {
    if let Some((path, size)) = large_file(&args)? {
        return park_large(global, &args, Large::File { path: &path, size }).await;
    }
    let stdin = match args.payload.as_deref() {
        Some("@-") => {
            let head = read_bounded(std::io::stdin().lock(), MAX_PAYLOAD_BYTES)
                .map_err(|e| CliError::Io("--payload @-: reading stdin".into(), e))?;
            if head.len() > MAX_PAYLOAD_BYTES {
                return park_large(global, &args, Large::Stdin(head)).await;
            }
            Some(head)
        }
        _ => None,
    };
    let req = request(&args, stdin)?;
    // Refused before connecting: a malformed request needs no cluster to say so.
    validate(&req).map_err(ParkError::Invalid)?;
    let (client, ns) = connect(global).await?;
    let outcome = Parker::new(client).park(&ns, req).await?;
    println!("{}", said(&outcome));
    Ok(())
}

/// What a park did, in one line.
pub fn said(outcome: &ParkOutcome) -> String {
    let r = outcome.record();
    match outcome {
        ParkOutcome::Parked(_) => format!("parked {} (new, cycle {})", r.name_any(), r.spec.cycle),
        ParkOutcome::AlreadyParked(_) => format!(
            "already parked {} (cycle {}; nothing changed)",
            r.name_any(),
            r.spec.cycle
        ),
        ParkOutcome::SameMessage(_) => format!(
            "this message already has a record: {} (cycle {}, {:?}; nothing changed)",
            r.name_any(),
            r.spec.cycle,
            r.phase()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_at_most_one_byte_past_the_limit() {
        let endless = std::io::repeat(b'x');
        assert_eq!(read_bounded(endless, 10).unwrap().len(), 11);
        assert_eq!(read_bounded(&b"abc"[..], 10).unwrap(), b"abc");
    }

    #[test]
    fn refuses_devices_and_directories_by_type() {
        for (path, what) in [("/dev/zero", "a device"), ("/", "a directory")] {
            let e = read_arg("--payload", &format!("@{path}"), 10).unwrap_err();
            assert!(e.to_string().contains(what), "{path}: {e}");
        }
    }

    #[test]
    fn names_the_limit_when_over_it() {
        let dir = std::env::temp_dir().join(format!("park-cmd-{}", std::process::id()));
        std::fs::write(&dir, [0u8; 11]).unwrap();
        let arg = format!("@{}", dir.display());
        let e = read_arg("--payload", &arg, 10).unwrap_err().to_string();
        assert!(e.contains("limit of 10 bytes"), "{e}");
        assert_eq!(read_arg("--payload", &arg, 11).unwrap().len(), 11);
        std::fs::remove_file(&dir).unwrap();
        let e = read_arg("--payload", &"y".repeat(100), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("limit of 10 bytes") && e.len() < 120, "{e}");
    }
}
