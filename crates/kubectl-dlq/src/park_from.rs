//! `kubectl dlq park --from FILE`: an export (`kubectl dlq export`, NDJSON) parked again into
//! this namespace a line at a time, so records move between namespaces or clusters. Each keeps
//! its job (exact bytes), job id, source message identity and cycle
//! (`ParkRequest::least_cycle`), and is parked as any job is: the same dedupe, the same
//! `maxParked`, so running it twice parks nothing twice. A sealed job is not parked again: the
//! park rules read a job's plaintext, which an export never holds; it is counted and skipped.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use dlq_client::park::{ParkError, ParkOutcome, ParkRequest, Parker};
use dlq_core::api::Phase;
use dlq_core::park::validate;

use crate::export::{Exported, FORMAT};
use crate::park_cmd::said;
use crate::session::{CliError, Global, connect};

/// Longest line read: a sealed job's ciphertext (1 MiB of base64) and the rest of its facts.
pub const MAX_LINE: usize = 2 << 20;

/// Parks the Parked records of the export at `path` (`-`: stdin), into `queue` when given.
pub async fn run(global: &Global, path: &Path, queue: Option<&str>) -> Result<(), CliError> {
    let io = |e| CliError::Io(format!("--from {}", path.display()), e);
    let input: Box<dyn Read> = if path == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(path).map_err(io)?)
    };
    let mut lines = BufReader::new(input);
    let (client, ns) = connect(global).await?;
    let parker = Parker::new(client);
    let mut tally = Tally::default();
    let mut number = 0usize;
    while let Some(line) = next_line(&mut lines).map_err(io)? {
        number += 1;
        let req = match request(&line, queue).map_err(|why| at_line(number, &why))? {
            Line::Park(req) => req,
            Line::Resolved => {
                tally.resolved += 1;
                continue;
            }
            Line::Sealed => {
                tally.sealed += 1;
                continue;
            }
        };
        validate(&req).map_err(|e| at_line(number, &ParkError::Invalid(e).to_string()))?;
        let outcome = parker.park(&ns, *req).await?;
        println!("{}", said(&outcome));
        tally.count(&outcome);
    }
    eprintln!("{}", tally.summary());
    Ok(())
}

fn at_line(number: usize, why: &str) -> CliError {
    CliError::Usage(format!("line {number}: {why}"))
}

/// The next non-empty line, at most [`MAX_LINE`] bytes (reads one byte past it, no more).
fn next_line(input: &mut impl BufRead) -> std::io::Result<Option<String>> {
    loop {
        let mut buf = Vec::new();
        let read = input
            .by_ref()
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)?;
        if read == 0 {
            return Ok(None);
        }
        if buf.len() > MAX_LINE {
            return Err(std::io::Error::other(format!(
                "a line longer than {MAX_LINE} bytes: not an export"
            )));
        }
        let text = String::from_utf8(buf).map_err(std::io::Error::other)?;
        if !text.trim().is_empty() {
            return Ok(Some(text));
        }
    }
}

/// What one export line is to `park --from`.
#[derive(Debug, PartialEq)]
pub enum Line {
    Park(Box<ParkRequest>),
    /// Not Parked where it was exported: its decision is history, not work.
    Resolved,
    /// Sealed: only its ciphertext was exported.
    Sealed,
}

/// What one export line asks.
pub fn request(line: &str, queue: Option<&str>) -> Result<Line, String> {
    let e: Exported = serde_json::from_str(line)
        .map_err(|e| format!("not a line of kubectl dlq export (NDJSON): {e}"))?;
    if e.format != FORMAT {
        return Err(format!("format {:?}; this reads {FORMAT}", e.format));
    }
    if e.phase != Phase::Parked {
        return Ok(Line::Resolved);
    }
    if e.job.sealed.is_some() {
        return Ok(Line::Sealed);
    }
    let job = e.job.into_job()?;
    let mut req = ParkRequest::new(queue.unwrap_or(&e.queue), job);
    req.intent = e.intent;
    req.deliveries = e.deliveries;
    req.reason = e.reason;
    req.failure_kind = e.failure_kind;
    req.service_version = e.service_version;
    req.error_class = e.error_class;
    req.failed_at = Some(e.failed_at.0);
    req.least_cycle = Some(e.cycle);
    if let Some(message) = e.source_message {
        req = req.with_message(message);
    }
    Ok(Line::Park(Box::new(req)))
}

/// What the lines came to.
#[derive(Default)]
struct Tally {
    parked: usize,
    already: usize,
    resolved: usize,
    sealed: usize,
}

impl Tally {
    fn count(&mut self, outcome: &ParkOutcome) {
        match outcome {
            ParkOutcome::Parked(_) => self.parked += 1,
            ParkOutcome::AlreadyParked(_) | ParkOutcome::SameMessage(_) => self.already += 1,
        }
    }

    fn summary(&self) -> String {
        format!(
            "{} parked, {} already had their record here, {} resolved records skipped, {} \
             sealed records skipped (an export holds only their ciphertext)",
            self.parked, self.already, self.resolved, self.sealed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::{IntentSnapshot, Job};

    fn line(cycle: i32, resolved: bool) -> String {
        let mut req = ParkRequest::new("relayer", Job::from_bytes("pi_1/settle", b"{\"a\":1}"));
        req.reason = "timeout".into();
        req.deliveries = 3;
        req.intent = Some(IntentSnapshot {
            id: "pi_1".into(),
            state: "created".into(),
        });
        req = req.with_message("dead#7");
        let mut r = dlq_core::park::new_record(&req, cycle);
        if resolved {
            r.status = Some(dlq_core::api::DeadLetterStatus {
                phase: Some(Phase::Redriven),
                ..Default::default()
            });
        }
        serde_json::to_string(&Exported::of(&r)).expect("a line")
    }

    /// An export line parks as the job it was: its id, bytes, facts, identity and cycle.
    #[test]
    fn a_line_becomes_the_same_request_with_its_cycle_and_identity() {
        let Ok(Line::Park(req)) = request(&line(3, false), None) else {
            panic!("a Parked record parks");
        };
        assert_eq!(req.job, Job::from_bytes("pi_1/settle", b"{\"a\":1}"));
        assert_eq!((req.queue.as_str(), req.deliveries), ("relayer", 3));
        assert_eq!(req.least_cycle, Some(3));
        assert_eq!(req.message.as_deref(), Some("dead#7"));
        assert_eq!(req.reason, "timeout");
        let moved = request(&line(1, false), Some("other"));
        assert!(matches!(moved, Ok(Line::Park(r)) if r.queue == "other"));
        assert_eq!(request(&line(1, true), None), Ok(Line::Resolved));
    }

    #[test]
    fn other_lines_are_refused_in_words() {
        let e = request("{\"a\":1}", None).expect_err("not an export");
        assert!(e.contains("not a line of kubectl dlq export"), "{e}");
        let other = line(1, false).replace(FORMAT, "dlq.dev/export/v9");
        let e = request(&other, None).expect_err("another format");
        assert!(e.contains("this reads dlq.dev/export/v1"), "{e}");
    }

    #[test]
    fn lines_are_bounded_and_blank_ones_skipped() {
        let mut input = &b"\n  \nabc\n"[..];
        assert_eq!(
            next_line(&mut input).ok().flatten().as_deref(),
            Some("abc\n")
        );
        assert_eq!(next_line(&mut input).ok().flatten(), None);
        let long = vec![b'x'; MAX_LINE + 10];
        assert!(next_line(&mut &long[..]).is_err());
    }
}
