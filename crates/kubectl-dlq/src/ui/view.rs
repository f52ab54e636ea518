//! The pure parts of the pages: filters from the query string, how a payload is shown, counts
//! per queue. Unit-tested without a server.

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use dlq_core::api::{DeadLetter, Job, Phase};

use crate::runbook::{Selector, parse_time};
use crate::search::{Masks, Search, Unsearched};

/// Records per page.
pub const PAGE: usize = 50;

/// A query string or form body as its pairs, repeated keys kept (a selection is `sel=…&sel=…`).
pub fn pairs(raw: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(raw.unwrap_or_default().as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The first value of `key`, trimmed; empty counts as absent.
pub fn value<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

/// The records page's filters, as typed (so the form shows them back).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Filter {
    pub queue: String,
    pub kind: String,
    /// `Parked` unless the query says otherwise; empty means any phase.
    pub phase: String,
    pub reason: String,
    pub version: String,
    pub since: String,
    pub until: String,
    /// A failure group's fingerprint (a group's page is the records page with this filter).
    pub group: String,
    /// The search box: text anywhere (`ls --grep`).
    pub grep: String,
    /// `PATH=VALUE` clauses (`ls --where`), each its own `where=` in the query string.
    pub wheres: Vec<String>,
    pub page: usize,
}

/// The records a filter matched, newest failure first, with where each search matched.
pub struct Found {
    pub records: Vec<(Arc<DeadLetter>, Option<String>)>,
    /// What the search could not look at (sealed, in a body store).
    pub unsearched: Unsearched,
}

impl Filter {
    pub fn from_pairs(p: &[(String, String)]) -> Self {
        let text = |k: &str| value(p, k).unwrap_or_default().to_string();
        let phase = match p.iter().find(|(k, _)| k == "phase") {
            Some((_, v)) => v.trim().to_string(),
            None => Phase::Parked.as_str().to_string(),
        };
        Filter {
            queue: text("queue"),
            kind: text("kind"),
            phase,
            reason: text("reason"),
            version: text("version"),
            since: text("since"),
            until: text("until"),
            group: text("group").to_ascii_lowercase(),
            grep: text("grep"),
            wheres: p
                .iter()
                .filter(|(k, _)| k == "where")
                .map(|(_, v)| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .collect(),
            page: value(p, "page")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
                .max(1),
        }
    }

    /// The runbook's selector for the same facts; a time that does not parse is an error to
    /// show, never a silently wider selection.
    pub fn selector(&self) -> Result<Selector, String> {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let time = |s: &str| (!s.is_empty()).then(|| parse_time(s)).transpose();
        Ok(Selector {
            queue: opt(&self.queue),
            failure_kind: opt(&self.kind),
            reason_contains: opt(&self.reason),
            since: time(&self.since)?,
            until: time(&self.until)?,
            service_version: opt(&self.version),
            group: opt(&self.group),
        })
    }

    /// The search box's search (`kubectl dlq ls --grep/--where`'s, parsed the same way).
    pub fn search(&self) -> Result<Search, String> {
        let grep = (!self.grep.is_empty()).then_some(self.grep.as_str());
        Search::parse(grep, &self.wheres).map_err(|e| e.to_string())
    }

    /// A replay selects by facts a DeadLetterReplay can hold; a search is not one of them, so a
    /// searched list is never offered as a replay (it would take more than it shows).
    pub fn replayable(&self) -> Result<(), String> {
        if self.grep.is_empty() && self.wheres.is_empty() {
            return Ok(());
        }
        Err(
            "a replay cannot select by a search: tick the records and review the selection, \
             or clear the search"
                .into(),
        )
    }

    /// The records that match, newest failure first; `masks` are the queues' mask paths.
    pub fn apply(&self, all: &[Arc<DeadLetter>], masks: &Masks) -> Result<Found, String> {
        let sel = self.selector()?;
        let search = self.search()?;
        let mut unsearched = Unsearched::default();
        let mut records: Vec<(Arc<DeadLetter>, Option<String>)> = all
            .iter()
            .filter(|r| {
                self.phase.is_empty() || r.phase().as_str().eq_ignore_ascii_case(&self.phase)
            })
            .filter(|r| sel.matches_facts(r))
            .filter_map(|r| {
                if search.is_empty() {
                    return Some((r.clone(), None));
                }
                unsearched.note(&search, r);
                let hit = search.find(r, masks.of(r))?;
                Some((r.clone(), Some(hit.line())))
            })
            .collect();
        records.sort_by(|(a, _), (b, _)| {
            (b.spec.failed_at.0, b.name_any()).cmp(&(a.spec.failed_at.0, a.name_any()))
        });
        Ok(Found {
            records,
            unsearched,
        })
    }

    /// The query string of this filter at `page`.
    pub fn query(&self, page: usize) -> String {
        form_urlencoded::Serializer::new(String::new())
            .append_pair("queue", &self.queue)
            .append_pair("kind", &self.kind)
            .append_pair("phase", &self.phase)
            .append_pair("reason", &self.reason)
            .append_pair("version", &self.version)
            .append_pair("since", &self.since)
            .append_pair("until", &self.until)
            .append_pair("group", &self.group)
            .append_pair("grep", &self.grep)
            .extend_pairs(self.wheres.iter().map(|w| ("where", w)))
            .append_pair("page", &page.to_string())
            .finish()
    }
}

/// How a payload reads best.
#[derive(Debug, PartialEq)]
pub enum Payload {
    Json(String),
    Text(String),
    Hex(String),
}

/// Pretty JSON when it parses, UTF-8 text otherwise, else a hex dump (16 bytes a line); card
/// numbers and the queue's `mask` paths masked (`dlq_core::mask`); a sealed job as sealed.
pub fn payload(job: &Job, mask: &[String]) -> Payload {
    if let Some(sealed) = &job.sealed {
        return Payload::Text(dlq_core::seal::sealed_label(sealed));
    }
    let bytes = job.payload_bytes().unwrap_or_default();
    match std::str::from_utf8(&bytes) {
        _ if job.payload_null => Payload::Text("(null: no value at all, a Kafka tombstone)".into()),
        Ok(text) => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(mut v) if v.is_object() || v.is_array() => {
                for path in mask {
                    dlq_core::mask::mask_path(&mut v, path);
                }
                let pretty = serde_json::to_string_pretty(&v).unwrap_or_else(|_| text.into());
                Payload::Json(dlq_core::mask::mask_cards(&pretty))
            }
            _ => Payload::Text(dlq_core::mask::mask_cards(text)),
        },
        // Masked before the dump: a card number's digits read back from their hex all the same.
        Err(_) => Payload::Hex(
            dlq_core::mask::mask_card_bytes(&bytes)
                .chunks(16)
                .enumerate()
                .map(|(i, c)| format!("{:08x}  {}", i * 16, hex_bytes(c)))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    }
}

fn hex_bytes(c: &[u8]) -> String {
    c.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One queue's line on the queues page.
#[derive(Debug, Default, PartialEq)]
pub struct Tally {
    pub parked_transient: u64,
    pub parked_invalid: u64,
    pub redriven: u64,
    pub dropped: u64,
    pub oldest_parked: Option<Timestamp>,
    pub parked_last_hour: u64,
}

/// Counts per (namespace, queue), from the watched records.
pub fn tallies(all: &[Arc<DeadLetter>], now: Timestamp) -> BTreeMap<(String, String), Tally> {
    let mut by: BTreeMap<(String, String), Tally> = BTreeMap::new();
    let hour_ago = now
        .checked_sub(jiff::SignedDuration::from_hours(1))
        .unwrap_or(now);
    for r in all {
        let t = by
            .entry((r.namespace().unwrap_or_default(), r.spec.queue.clone()))
            .or_default();
        let created = r.metadata.creation_timestamp.as_ref().map(|t| t.0);
        if created.is_some_and(|c| c >= hour_ago) {
            t.parked_last_hour += 1;
        }
        match r.phase() {
            Phase::Parked => {
                match r.spec.failure_kind {
                    dlq_core::api::FailureKind::Transient => t.parked_transient += 1,
                    dlq_core::api::FailureKind::Invalid => t.parked_invalid += 1,
                }
                if let Some(c) = created {
                    t.oldest_parked = Some(t.oldest_parked.map_or(c, |o| o.min(c)));
                }
            }
            Phase::Redriven => t.redriven += 1,
            Phase::Dropped => t.dropped += 1,
        }
    }
    by
}

/// A selected record as the page saw it: `namespace/name/resourceVersion`.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub namespace: String,
    pub name: String,
    pub version: String,
}

impl Snapshot {
    pub fn of(r: &DeadLetter) -> Self {
        Snapshot {
            namespace: r.namespace().unwrap_or_default(),
            name: r.name_any(),
            version: r.resource_version().unwrap_or_default(),
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.splitn(3, '/');
        let (namespace, name, version) = (it.next()?, it.next()?, it.next()?);
        (!namespace.is_empty() && !name.is_empty() && !version.is_empty()).then(|| Snapshot {
            namespace: namespace.into(),
            name: name.into(),
            version: version.into(),
        })
    }

    pub fn encode(&self) -> String {
        format!("{}/{}/{}", self.namespace, self.name, self.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_show_cards_and_paths_masked_and_sealed_as_sealed() {
        let job = Job::from_bytes("j", br#"{"pan":"4111111111111111","cvv":"123"}"#);
        assert_eq!(
            payload(&job, &["$.cvv".into()]),
            Payload::Json("{\n  \"cvv\": \"****\",\n  \"pan\": \"411111******1111\"\n}".into())
        );
        let text = Job::from_bytes("t", b"pan 4111-1111-1111-1111");
        assert_eq!(
            payload(&text, &[]),
            Payload::Text("pan 4111-11**-****-1111".into())
        );
        let (_, recipient) = dlq_core::seal::generate_identity();
        let sealed = dlq_core::seal::seal(&job, &recipient).unwrap();
        assert_eq!(
            payload(&sealed, &[]),
            Payload::Text(format!("sealed (recipient {recipient})"))
        );
    }

    /// The hex dump of a binary payload shows a card number's digits masked: hex reads back.
    #[test]
    fn a_binary_payloads_hex_dump_masks_card_numbers() {
        // The card fills the dump's first line (16 bytes), the byte after it is not UTF-8.
        let job = Job::from_bytes("j", b"4242424242424242\xff");
        let Payload::Hex(dump) = payload(&job, &[]) else {
            panic!("binary shows as hex");
        };
        let digits = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<Vec<_>>();
        let whole = digits("4242424242424242").join(" ");
        let masked = digits("424242******4242").join(" ");
        let flat = dump.replace('\n', " ");
        assert!(!flat.contains(&whole) && flat.contains(&masked), "{dump}");
    }

    #[test]
    fn payloads_read_as_json_text_or_hex() {
        let json = Job::from_bytes("a", br#"{"b":1}"#);
        assert_eq!(
            payload(&json, &[]),
            Payload::Json("{\n  \"b\": 1\n}".into())
        );
        let text = Job::from_bytes("a", b"<script>alert(1)</script>");
        assert_eq!(
            payload(&text, &[]),
            Payload::Text("<script>alert(1)</script>".into())
        );
        let bin = Job::from_bytes("a", &[0xff, 0x00, 0x41]);
        assert_eq!(
            payload(&bin, &[]),
            Payload::Hex("00000000  ff 00 41".into())
        );
    }

    #[test]
    fn filters_default_to_parked_and_round_trip() {
        let f = Filter::from_pairs(&pairs(Some("queue=relayer&reason=time+out&page=2")));
        assert_eq!(f.phase, "Parked");
        assert_eq!(f.reason, "time out");
        assert_eq!(f.page, 2);
        assert_eq!(Filter::from_pairs(&pairs(Some(&f.query(2)))), f);
        let any = Filter::from_pairs(&pairs(Some("phase=")));
        assert_eq!(any.phase, "");
        let bad = Filter::from_pairs(&pairs(Some("since=yesterday")));
        assert!(bad.selector().is_err());
        let group = Filter::from_pairs(&pairs(Some("queue=relayer&group=3F9A1C07D2")));
        assert_eq!(Filter::from_pairs(&pairs(Some(&group.query(1)))), group);
        let sel = group.selector().expect("a selector");
        assert_eq!(
            sel.group.as_deref(),
            Some("3f9a1c07d2"),
            "a group's page is its filter"
        );
    }

    /// The search box is `ls --grep/--where` in the query string: it round-trips (a shareable
    /// URL), matches with the same matcher, refuses a bad PATH in words and is never a replay.
    #[test]
    fn a_search_round_trips_matches_and_is_not_replayable() {
        let q = "grep=CUS_42&where=headers.x-tenant%3Dacme&where=&where=payload.n%3D7&phase=";
        let f = Filter::from_pairs(&pairs(Some(q)));
        assert_eq!(f.grep, "CUS_42");
        assert_eq!(f.wheres, ["headers.x-tenant=acme", "payload.n=7"]);
        assert_eq!(
            Filter::from_pairs(&pairs(Some(&f.query(3)))),
            Filter {
                page: 3,
                ..f.clone()
            }
        );
        assert!(f.replayable().is_err());
        assert!(Filter::default().replayable().is_ok());
        let mut hit = Job::from_bytes("a/1", br#"{"customer":"cus_42","n":7}"#);
        hit.headers.insert("x-tenant".into(), "acme".into());
        let mut other = hit.clone();
        other.id = "b/1".into();
        other.headers.insert("x-tenant".into(), "globex".into());
        let all: Vec<Arc<DeadLetter>> = [hit, other]
            .into_iter()
            .map(|job| {
                let req = dlq_core::park::ParkRequest::new("relayer", job);
                Arc::new(dlq_core::park::new_record(&req, 1))
            })
            .collect();
        let found = f.apply(&all, &Masks::default()).expect("a search");
        let jobs: Vec<(&str, Option<&str>)> = found
            .records
            .iter()
            .map(|(r, m)| (r.spec.job.id.as_str(), m.as_deref()))
            .collect();
        assert_eq!(
            jobs,
            [("a/1", Some(r#"payload: {"customer":"cus_42","n":7}"#))]
        );
        let bad = Filter::from_pairs(&pairs(Some("where=customer%3Dx")));
        let said = bad
            .apply(&all, &Masks::default())
            .map(|_| ())
            .expect_err("a bad PATH");
        assert!(said.contains("PATH is one of job.id"), "{said}");
    }

    #[test]
    fn snapshots_round_trip() {
        let s = Snapshot::parse("payments/pi-1-abc-1/42").unwrap();
        assert_eq!(s.version, "42");
        assert_eq!(Snapshot::parse(&s.encode()), Some(s));
        assert_eq!(Snapshot::parse("a/b"), None);
    }
}
