//! Whether this replica may still act on its Lease. A leader that was paused (SIGSTOP, a long
//! GC or VM pause) wakes up believing it leads until its lease manager notices otherwise; by
//! then a standby may already hold the Lease and have redriven the same records. So every
//! requeue first checks that the Lease, as last seen renewed by this replica, has not run
//! out; a replica that cannot renew stops enqueueing before a standby can take over.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;

/// The end of this replica's current term, shared by the renewal watcher and the reconcilers.
/// Without leader election (`always`) it never ends.
#[derive(Clone, Debug)]
pub struct Leadership {
    /// Unix milliseconds until which the Lease is ours; i64::MAX for `always`.
    valid_until_ms: Arc<AtomicI64>,
}

/// How much earlier than the Lease's expiry this replica stops acting: covers a requeue that
/// starts just before the expiry and the clock read in between.
pub const MARGIN: Duration = Duration::from_secs(3);

fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

impl Leadership {
    /// A replica that always may act (leader election off, tests).
    pub fn always() -> Self {
        Leadership {
            valid_until_ms: Arc::new(AtomicI64::new(i64::MAX)),
        }
    }

    /// A replica that may not act until [`Leadership::renewed`] says so.
    pub fn not_yet() -> Self {
        Leadership {
            valid_until_ms: Arc::new(AtomicI64::new(i64::MIN)),
        }
    }

    /// The Lease was renewed at `renew_ms` for `duration`: this replica may act until then,
    /// less [`MARGIN`].
    pub fn renewed(&self, renew_ms: i64, duration: Duration) {
        let until = renew_ms
            .saturating_add(i64::try_from(duration.as_millis()).unwrap_or(i64::MAX))
            .saturating_sub(i64::try_from(MARGIN.as_millis()).unwrap_or(0));
        self.valid_until_ms.store(until, Ordering::SeqCst);
    }

    /// Leadership is gone (lost, or shutting down): act no more.
    pub fn revoke(&self) {
        self.valid_until_ms.store(i64::MIN, Ordering::SeqCst);
    }

    /// True while the term has not run out, by the wall clock now (which a paused process
    /// reads fresh when it wakes up).
    pub fn holds(&self) -> bool {
        now_ms() < self.valid_until_ms.load(Ordering::SeqCst)
    }

    /// Follows the Lease `name` in `namespace`: every `every`, when `identity` holds it, the
    /// term is extended to its renewTime + leaseDurationSeconds; any other holder revokes it.
    /// A failed read changes nothing, so the term runs out by itself while the apiserver is
    /// unreachable. Runs until the task is dropped.
    pub async fn follow(
        self,
        client: Client,
        namespace: String,
        name: String,
        identity: String,
        every: Duration,
    ) {
        let leases: Api<Lease> = Api::namespaced(client, &namespace);
        loop {
            if let Ok(lease) = leases.get(&name).await {
                let spec = lease.spec.unwrap_or_default();
                let ours = spec.holder_identity.as_deref() == Some(identity.as_str());
                match (ours, spec.renew_time, spec.lease_duration_seconds) {
                    (true, Some(at), Some(secs)) => self.renewed(
                        at.0.as_millisecond(),
                        Duration::from_secs(u64::try_from(secs).unwrap_or(0)),
                    ),
                    _ => self.revoke(),
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}

impl Default for Leadership {
    fn default() -> Self {
        Self::always()
    }
}
