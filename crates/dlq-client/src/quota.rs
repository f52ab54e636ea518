//! A namespace whose ResourceQuota on records is used up (`dlq_core::capacity::quota_refusal`:
//! the apiserver refused a create 403 "exceeded quota"). Until a record fits again, this
//! process's parkers in that namespace create nothing but one **probe** at a time, the probes
//! spaced by a backoff from [`PROBE_FIRST`] up to [`PROBE_EVERY`]: a storm waiting for room
//! costs the apiserver one refused create per interval, not one per dead message, and parking
//! resumes within [`PROBE_EVERY`] of records being deleted. The other parkings are refused at
//! once with the quota the last refusal named (their sources leave the messages in the broker
//! and look again soon). Process-wide, like the slot blocks: every parker of a process shares
//! one hold per namespace.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dlq_core::capacity::QuotaUse;

/// The first probe's wait after a refusal.
pub const PROBE_FIRST: Duration = Duration::from_millis(250);
/// The longest wait between probes.
pub const PROBE_EVERY: Duration = Duration::from_secs(2);

/// The process's holds, by namespace.
pub static HOLDS: LazyLock<QuotaHolds> = LazyLock::new(QuotaHolds::default);

/// Namespaces whose quota on records refused a create, and what it said.
#[derive(Default)]
pub struct QuotaHolds {
    held: Mutex<HashMap<String, Hold>>,
}

struct Hold {
    quota: QuotaUse,
    /// The next create may go out at this moment.
    next_probe: Instant,
    /// A probe is out: no other create until it is answered.
    probing: bool,
    /// Refusals in a row (the backoff's exponent).
    refusals: u32,
}

/// The one create allowed while a namespace is held; dropped unanswered (the park failed
/// otherwise), it lets the next parking probe.
pub struct Probe {
    holds: &'static QuotaHolds,
    namespace: String,
}

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(h) = self.holds.lock().get_mut(&self.namespace) {
            h.probing = false;
        }
    }
}

impl QuotaHolds {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Hold>> {
        // A panic while holding it leaves plain data behind; keep using it.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a park in `namespace` may create now: `Ok(None)` when nothing holds it,
    /// `Ok(Some(probe))` when this one is the probe, `Err(quota)` while held.
    pub fn enter(&'static self, namespace: &str) -> Result<Option<Probe>, QuotaUse> {
        self.enter_at(namespace, Instant::now())
    }

    fn enter_at(&'static self, namespace: &str, now: Instant) -> Result<Option<Probe>, QuotaUse> {
        let mut held = self.lock();
        let Some(h) = held.get_mut(namespace) else {
            return Ok(None);
        };
        if h.probing || now < h.next_probe {
            return Err(h.quota.clone());
        }
        h.probing = true;
        Ok(Some(Probe {
            holds: self,
            namespace: namespace.to_string(),
        }))
    }

    /// The apiserver refused a create in `namespace` for `quota`: held (again), the next
    /// probe after the backoff.
    pub fn refused(&self, namespace: &str, quota: QuotaUse) {
        self.refused_at(namespace, quota, Instant::now());
    }

    fn refused_at(&self, namespace: &str, quota: QuotaUse, now: Instant) {
        let mut held = self.lock();
        let h = held.entry(namespace.to_string()).or_insert(Hold {
            quota: quota.clone(),
            next_probe: now,
            probing: false,
            refusals: 0,
        });
        h.refusals = h.refusals.saturating_add(1);
        h.quota = quota;
        h.next_probe = now + backoff(h.refusals);
        tracing::debug!(namespace, quota = %h.quota.name, refusals = h.refusals, "quota on records used up; parking holds");
    }

    /// A record was created in `namespace`: whatever held it has room again.
    pub fn fits(&self, namespace: &str) {
        if self.lock().remove(namespace).is_some() {
            tracing::debug!(namespace, "room under the quota on records again");
        }
    }
}

/// The wait before the probe after `refusals` refusals in a row.
fn backoff(refusals: u32) -> Duration {
    let exp = refusals.saturating_sub(1).min(8);
    PROBE_FIRST.saturating_mul(1 << exp).min(PROBE_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota() -> QuotaUse {
        QuotaUse {
            name: "dead-letters".into(),
            used: Some(50),
            hard: Some(50),
        }
    }

    fn holds() -> &'static QuotaHolds {
        Box::leak(Box::default())
    }

    #[test]
    fn a_used_up_quota_lets_one_probe_at_a_time_through() {
        let holds = holds();
        let t0 = Instant::now();
        assert!(
            matches!(holds.enter_at("ns", t0), Ok(None)),
            "nothing holds"
        );
        holds.refused_at("ns", quota(), t0);
        assert_eq!(holds.enter_at("ns", t0).err(), Some(quota()), "held");
        assert!(holds.enter_at("other", t0).is_ok(), "per namespace");
        let later = t0 + PROBE_FIRST;
        let probe = holds.enter_at("ns", later).expect("the probe");
        assert!(probe.is_some());
        assert!(holds.enter_at("ns", later).is_err(), "one probe at a time");
        // Refused again: the next probe waits twice as long.
        holds.refused_at("ns", quota(), later);
        drop(probe);
        assert!(holds.enter_at("ns", later + PROBE_FIRST).is_err());
        let probe = holds
            .enter_at("ns", later + PROBE_FIRST * 2)
            .expect("the probe");
        assert!(probe.is_some());
        // A probe that ends otherwise (another error) lets the next one go.
        drop(probe);
        assert!(matches!(
            holds.enter_at("ns", later + PROBE_FIRST * 2),
            Ok(Some(_))
        ));
        holds.fits("ns");
        assert!(matches!(holds.enter_at("ns", later), Ok(None)), "lifted");
    }

    #[test]
    fn probes_are_spaced_by_a_capped_backoff() {
        assert_eq!(backoff(1), PROBE_FIRST);
        assert_eq!(backoff(2), PROBE_FIRST * 2);
        assert_eq!(backoff(4), PROBE_EVERY);
        assert_eq!(backoff(40), PROBE_EVERY);
    }
}
