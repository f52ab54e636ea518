//! Which records this process is acting on, and which it has resolved.
//!
//! Two controllers reconcile records: the full one, and the decisions-only one that carries out
//! decisions while the full cache is still listing (see `crate::run`'s decisions controller). kube
//! runs one reconcile per object at a time within a controller, not across two, and the two
//! caches can disagree for a moment (the full list is a snapshot taken when it started). So a
//! record is claimed for the length of a reconcile, and a record this process resolved is
//! remembered: a resolution is final, so a copy that still shows it Parked is stale and must
//! not be enqueued again.
//!
//! A redrive whose job a broker confirmed is remembered too, by its key
//! (`dlq_core::decide::redrive_key`), until its resolution is written: a failed status write
//! (etcd restarting, the apiserver away) is retried alone, without a second enqueue.
//!
//! When each decided record's last attempt ended is remembered too: the leader's stall check
//! (`crate::run::decided`) reads it to tell a record waiting out a broker's backoff from one
//! nobody is acting on.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a resolution is remembered: far longer than any cache lags behind a write.
const RESOLVED_MEMORY: Duration = Duration::from_secs(15 * 60);

/// Forgetting is checked once per this many resolutions (cheap amortised pruning).
const PRUNE_EVERY: usize = 1024;

#[derive(Default)]
pub struct Claims {
    working: Arc<Mutex<HashSet<String>>>,
    resolved: Mutex<Resolved>,
    confirmed: Mutex<HashMap<String, Unwritten>>,
    /// When the last reconcile that acted on each decided record ended, by uid.
    attempts: Mutex<HashMap<String, Instant>>,
    /// When a reconcile acting on any decision last ended (kept when the records are pruned).
    latest: Mutex<Option<Instant>>,
}

/// A redrive whose job the broker confirmed and whose resolution is not written yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwritten {
    pub namespace: String,
    pub name: String,
    /// Who signed the redrive that was sent: the resolution names them even if the decision
    /// changed since (`dlq_core::decide::after_confirmation`).
    pub by: String,
}

#[derive(Default)]
struct Resolved {
    at: HashMap<String, Instant>,
    since_prune: usize,
}

/// Held for the length of one reconcile of a record; releases the claim when dropped.
pub struct Claim {
    working: Arc<Mutex<HashSet<String>>>,
    uid: String,
}

impl Drop for Claim {
    fn drop(&mut self) {
        lock(&self.working).remove(&self.uid);
    }
}

impl Claims {
    /// Claims the record `uid`, or None while another reconcile in this process holds it.
    pub fn claim(&self, uid: &str) -> Option<Claim> {
        lock(&self.working).insert(uid.to_string()).then(|| Claim {
            working: self.working.clone(),
            uid: uid.to_string(),
        })
    }

    /// Remembers that the record `uid` is resolved (by this process or a rival).
    pub fn remember_resolved(&self, uid: &str) {
        let mut resolved = lock(&self.resolved);
        resolved.at.insert(uid.to_string(), Instant::now());
        resolved.since_prune += 1;
        if resolved.since_prune >= PRUNE_EVERY {
            resolved.since_prune = 0;
            resolved.at.retain(|_, at| at.elapsed() < RESOLVED_MEMORY);
        }
    }

    /// Remembers that a broker confirmed the job of the redrive `key`.
    pub fn confirm(&self, key: &str, record: Unwritten) {
        lock(&self.confirmed).insert(key.to_string(), record);
    }

    /// The signer of the redrive `key` when a broker confirmed its job and its resolution is
    /// unwritten.
    pub fn confirmed_by(&self, key: &str) -> Option<String> {
        lock(&self.confirmed).get(key).map(|u| u.by.clone())
    }

    /// The redrive `key` is done with (resolved, lost to a rival, gone): forget its confirmation.
    pub fn forget_confirmed(&self, key: &str) {
        lock(&self.confirmed).remove(key);
    }

    /// Every confirmed redrive whose resolution is still unwritten.
    pub fn unwritten(&self) -> Vec<(String, Unwritten)> {
        lock(&self.confirmed)
            .iter()
            .map(|(k, u)| (k.clone(), u.clone()))
            .collect()
    }

    /// A reconcile acting on the decision of record `uid` ended (whatever its outcome).
    pub fn attempted(&self, uid: &str) {
        let now = Instant::now();
        lock(&self.attempts).insert(uid.to_string(), now);
        *lock(&self.latest) = Some(now);
    }

    /// When a reconcile acting on any decision last ended: a leader working through a backlog
    /// of decisions makes progress even while one waits its turn.
    pub fn latest_attempt(&self) -> Option<Instant> {
        *lock(&self.latest)
    }

    /// When a reconcile acting on the decision of record `uid` last ended.
    pub fn last_attempt(&self, uid: &str) -> Option<Instant> {
        lock(&self.attempts).get(uid).copied()
    }

    /// Forgets the attempts of records `keep` says no (resolved or gone).
    pub fn retain_attempts(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.attempts).retain(|uid, _| keep(uid));
    }

    /// Whether the record `uid` was resolved within [`RESOLVED_MEMORY`].
    pub fn resolved_here(&self, uid: &str) -> bool {
        lock(&self.resolved)
            .at
            .get(uid)
            .is_some_and(|at| at.elapsed() < RESOLVED_MEMORY)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it leaves a plain set behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_claimed_by_one_reconcile_at_a_time() {
        let claims = Claims::default();
        let first = claims.claim("uid-1");
        assert!(first.is_some());
        assert!(claims.claim("uid-1").is_none(), "held");
        assert!(claims.claim("uid-2").is_some(), "another record");
        drop(first);
        assert!(claims.claim("uid-1").is_some(), "released on drop");
    }

    #[test]
    fn resolutions_are_remembered() {
        let claims = Claims::default();
        assert!(!claims.resolved_here("uid-1"));
        claims.remember_resolved("uid-1");
        assert!(claims.resolved_here("uid-1"));
        for i in 0..PRUNE_EVERY {
            claims.remember_resolved(&format!("other-{i}"));
        }
        assert!(claims.resolved_here("uid-1"), "pruning keeps recent ones");
    }

    #[test]
    fn attempts_are_remembered_until_pruned() {
        let claims = Claims::default();
        assert_eq!(claims.last_attempt("uid-1"), None);
        claims.attempted("uid-1");
        claims.attempted("uid-2");
        assert!(claims.last_attempt("uid-1").is_some());
        claims.retain_attempts(|uid| uid == "uid-2");
        assert_eq!(claims.last_attempt("uid-1"), None);
        assert!(claims.last_attempt("uid-2").is_some());
    }

    #[test]
    fn confirmations_are_remembered_until_forgotten() {
        let claims = Claims::default();
        let record = Unwritten {
            namespace: "ns".into(),
            name: "r".into(),
            by: "alice".into(),
        };
        assert_eq!(claims.confirmed_by("u-1-1"), None);
        claims.confirm("u-1-1", record.clone());
        assert_eq!(claims.confirmed_by("u-1-1").as_deref(), Some("alice"));
        assert_eq!(
            claims.confirmed_by("u-1-2"),
            None,
            "another cycle of the job"
        );
        assert_eq!(claims.unwritten(), [("u-1-1".to_string(), record)]);
        claims.forget_confirmed("u-1-1");
        assert_eq!(claims.confirmed_by("u-1-1"), None);
        assert!(claims.unwritten().is_empty());
    }
}
