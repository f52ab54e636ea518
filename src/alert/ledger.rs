//! What one Alertmanager has been told: the current alerts with when each was last accepted,
//! and the resolutions not yet delivered. Pure bookkeeping, driven by the sender.

use std::collections::{BTreeMap, HashMap};

use jiff::{SignedDuration, Timestamp};

use dlq_core::alert::{Alert, Current};

/// An alert's identity: its labels.
pub type Key = BTreeMap<String, String>;

struct Entry {
    alert: Current,
    /// When Alertmanager last accepted it; None: never, or it may have forgotten (an outage).
    sent_at: Option<Timestamp>,
}

#[derive(Default)]
pub struct Ledger {
    current: HashMap<Key, Entry>,
    /// Alerts no longer current, with when they ended; sent with that `endsAt` until accepted.
    resolving: HashMap<Key, (Current, Timestamp)>,
}

impl Ledger {
    /// Makes `desired` the current set at `now`: new or changed alerts become due, alerts no
    /// longer desired become resolutions.
    pub fn update(&mut self, desired: HashMap<Key, Current>, now: Timestamp) {
        let mut next = HashMap::with_capacity(desired.len());
        for (key, alert) in desired {
            let sent_at = self
                .current
                .remove(&key)
                .filter(|e| e.alert == alert)
                .and_then(|e| e.sent_at);
            self.resolving.remove(&key);
            next.insert(key, Entry { alert, sent_at });
        }
        // Resolved even if never accepted: a send may have been accepted without our knowing.
        for (key, gone) in std::mem::replace(&mut self.current, next) {
            self.resolving.insert(key, (gone.alert, now));
        }
    }

    /// Up to `max` alerts to send at `now`: every resolution, then current alerts never
    /// accepted or accepted longer than `resend` ago, each firing until `now + lease`.
    pub fn due(
        &self,
        now: Timestamp,
        resend: SignedDuration,
        lease: SignedDuration,
        max: usize,
    ) -> Vec<(Key, Alert)> {
        let stale = |e: &Entry| e.sent_at.is_none_or(|t| now.duration_since(t) >= resend);
        self.resolving
            .iter()
            .map(|(k, (a, ended))| (k.clone(), a.resolved(*ended)))
            .chain(
                self.current
                    .iter()
                    .filter(|(_, e)| stale(e))
                    .map(|(k, e)| (k.clone(), e.alert.firing(now, lease))),
            )
            .take(max)
            .collect()
    }

    /// Alertmanager accepted `keys` at `now`.
    pub fn accepted<'a>(&mut self, keys: impl IntoIterator<Item = &'a Key>, now: Timestamp) {
        for key in keys {
            if self.resolving.remove(key).is_none()
                && let Some(e) = self.current.get_mut(key)
            {
                e.sent_at = Some(now);
            }
        }
    }

    /// After a failed delivery Alertmanager may have restarted and forgotten everything:
    /// everything current is due again once it answers.
    pub fn forget_sent(&mut self) {
        for e in self.current.values_mut() {
            e.sent_at = None;
        }
    }

    /// Drops resolutions older than `lease`: their alert has lapsed by itself anyway.
    pub fn expire(&mut self, now: Timestamp, lease: SignedDuration) {
        self.resolving
            .retain(|_, (_, ended)| now.duration_since(*ended) < lease);
    }

    pub fn current_len(&self) -> usize {
        self.current.len()
    }

    /// The `(namespace, queue)` of every current alert.
    pub fn queues(&self) -> std::collections::BTreeSet<(String, String)> {
        self.current
            .keys()
            .map(|k| {
                let get = |n: &str| k.get(n).cloned().unwrap_or_default();
                (get("namespace"), get("queue"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn alert(job: &str) -> (Key, Current) {
        let labels: Key = [("job".to_string(), job.to_string())].into();
        let c = Current {
            labels: labels.clone(),
            annotations: BTreeMap::new(),
            starts_at: at(10),
        };
        (labels, c)
    }

    const RESEND: SignedDuration = SignedDuration::from_secs(60);
    const LEASE: SignedDuration = SignedDuration::from_secs(240);

    fn due_jobs(l: &Ledger, now: i64) -> Vec<(String, i64)> {
        let mut v: Vec<_> = l
            .due(at(now), RESEND, LEASE, 100)
            .into_iter()
            .map(|(k, a)| (k["job"].clone(), a.ends_at.as_second()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn new_alerts_are_sent_once_then_resent_before_the_lease_lapses() {
        let mut l = Ledger::default();
        l.update([alert("a"), alert("b")].into(), at(100));
        assert_eq!(
            due_jobs(&l, 100),
            vec![("a".into(), 340), ("b".into(), 340)]
        );
        let keys: Vec<Key> = l
            .due(at(100), RESEND, LEASE, 100)
            .into_iter()
            .map(|x| x.0)
            .collect();
        l.accepted(&keys, at(100));
        assert!(due_jobs(&l, 120).is_empty());
        assert_eq!(due_jobs(&l, 160).len(), 2, "resent after `resend`");
    }

    #[test]
    fn a_record_no_longer_current_is_resolved_at_that_moment_until_accepted() {
        let mut l = Ledger::default();
        l.update([alert("a"), alert("b")].into(), at(100));
        let keys: Vec<Key> = [alert("a").0, alert("b").0].into();
        l.accepted(&keys, at(100));
        l.update([alert("b")].into(), at(130));
        assert_eq!(due_jobs(&l, 131), vec![("a".into(), 130)]);
        assert_eq!(
            due_jobs(&l, 140),
            vec![("a".into(), 130)],
            "kept until accepted"
        );
        l.accepted(&[alert("a").0], at(140));
        assert!(due_jobs(&l, 141).is_empty());
    }

    #[test]
    fn after_an_outage_everything_current_is_due_and_old_resolutions_expire() {
        let mut l = Ledger::default();
        l.update([alert("a"), alert("b")].into(), at(100));
        l.accepted(&[alert("a").0, alert("b").0], at(100));
        l.update([alert("a")].into(), at(110));
        l.forget_sent();
        assert_eq!(
            due_jobs(&l, 120),
            vec![("a".into(), 360), ("b".into(), 110)]
        );
        l.expire(at(400), LEASE);
        assert_eq!(due_jobs(&l, 400), vec![("a".into(), 640)]);
    }

    #[test]
    fn at_most_max_alerts_per_round() {
        let mut l = Ledger::default();
        l.update((0..10).map(|i| alert(&i.to_string())).collect(), at(100));
        assert_eq!(l.due(at(100), RESEND, LEASE, 4).len(), 4);
    }
}
