//! Which record events wake the records reconciler: a record seen for the first time, and a
//! record whose spec a human changed (a new generation). Status writes, ours or another
//! replica's, wake nothing: ours would defeat the requeue backoff, and another replica's
//! resolution leaves nothing to do.
//!
//! kube's predicate filter does the same, but keys every record by three strings (0.25 KiB a
//! record, 25 MiB at 100,000); this keeps 32 bytes: the uid as a number and the generation.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use dlq_core::api::DeadLetter;

/// What is remembered of a record: its last generation and when it was last seen.
#[derive(Clone, Copy)]
struct Seen {
    generation: Option<i64>,
    /// Seconds since [`SpecChanges::started`].
    at: u32,
}

/// The generations seen, by record; records not seen for `memory` are forgotten (a deleted
/// record sends no event this filter sees), so one seen again after that wakes once more.
pub struct SpecChanges {
    seen: HashMap<u128, Seen>,
    memory: Duration,
    started: Instant,
    swept: u32,
}

impl SpecChanges {
    pub fn new(memory: Duration) -> Self {
        SpecChanges {
            seen: HashMap::new(),
            memory,
            started: Instant::now(),
            swept: 0,
        }
    }

    /// Whether `dl` wakes the reconciler: first seen, or seen with another generation.
    pub fn wakes(&mut self, dl: &DeadLetter, now: Instant) -> bool {
        let at = self.seconds(now);
        self.sweep(at);
        let generation = dl.metadata.generation;
        let previous = self.seen.insert(key(dl), Seen { generation, at });
        previous.is_none_or(|p| p.generation != generation)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.seen.len()
    }

    fn seconds(&self, now: Instant) -> u32 {
        let secs = now.saturating_duration_since(self.started).as_secs();
        u32::try_from(secs).unwrap_or(u32::MAX)
    }

    /// Forgets records not seen for `memory`, at most once per tenth of it.
    fn sweep(&mut self, at: u32) {
        let memory = u32::try_from(self.memory.as_secs()).unwrap_or(u32::MAX);
        if at.saturating_sub(self.swept) < (memory / 10).max(1) {
            return;
        }
        self.swept = at;
        self.seen.retain(|_, s| at.saturating_sub(s.at) < memory);
    }
}

/// A record's identity as a number: its uid (a UUID, so 128 bits hold it whole and two records
/// never share a key), or, for an object without one, a hash of its namespace, name and uid.
fn key(dl: &DeadLetter) -> u128 {
    let uid = dl.metadata.uid.as_deref().unwrap_or_default();
    uuid_number(uid).unwrap_or_else(|| {
        let mut h = DefaultHasher::new();
        (&dl.metadata.namespace, &dl.metadata.name, uid).hash(&mut h);
        u128::from(h.finish())
    })
}

/// The 32 hex digits of a UUID as one number, read in place (this runs for every record event).
fn uuid_number(uid: &str) -> Option<u128> {
    let mut digits = 0;
    let n = uid.chars().filter(|c| *c != '-').try_fold(0u128, |n, c| {
        digits += 1;
        Some((n << 4) | u128::from(c.to_digit(16)?))
    })?;
    (digits == 32).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Job;
    use dlq_core::park::{ParkRequest, new_record};

    fn record(uid: &str, generation: i64) -> DeadLetter {
        let req = ParkRequest::new(
            "relayer",
            Job {
                id: "order-1".into(),
                ..Job::default()
            },
        );
        let mut r = new_record(&req, 1);
        r.metadata.namespace = Some("payments".into());
        r.metadata.uid = Some(uid.into());
        r.metadata.generation = Some(generation);
        r
    }

    const A: &str = "6f1c9a52-1c1e-4d0b-9a43-0d5b6c6a0001";
    const B: &str = "6f1c9a52-1c1e-4d0b-9a43-0d5b6c6a0002";

    #[test]
    fn a_record_wakes_when_first_seen_and_when_its_spec_changes() {
        let mut f = SpecChanges::new(Duration::from_secs(900));
        let now = Instant::now();
        assert!(f.wakes(&record(A, 1), now), "first seen");
        assert!(!f.wakes(&record(A, 1), now), "a status write");
        assert!(f.wakes(&record(A, 2), now), "a decision");
        assert!(!f.wakes(&record(A, 2), now));
        assert!(
            f.wakes(&record(B, 2), now),
            "the name deleted and created again"
        );
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn records_unseen_for_the_memory_are_forgotten_and_wake_again() {
        let mut f = SpecChanges::new(Duration::from_secs(100));
        let start = Instant::now();
        assert!(f.wakes(&record(A, 1), start));
        assert!(f.wakes(&record(B, 1), start + Duration::from_secs(60)));
        let later = start + Duration::from_secs(120);
        assert!(!f.wakes(&record(B, 1), later), "seen 60 s ago: remembered");
        assert_eq!(f.len(), 1, "A, unseen for 120 s, was forgotten");
        assert!(f.wakes(&record(A, 1), later));
    }

    #[test]
    fn objects_without_a_uuid_are_told_apart_by_name() {
        let mut f = SpecChanges::new(Duration::from_secs(900));
        let now = Instant::now();
        let mut a = record("", 1);
        a.metadata.name = Some("a".into());
        let mut b = a.clone();
        b.metadata.name = Some("b".into());
        assert!(f.wakes(&a, now));
        assert!(f.wakes(&b, now));
        assert!(!f.wakes(&a, now));
    }
}
