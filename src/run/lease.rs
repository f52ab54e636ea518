//! Leadership: one replica acts at a time, holding a Lease. Waiting for it, giving it up on a
//! clean shutdown (a rolling update hands over at once), noticing it lost, and stepping down
//! when this leader stalled on decided records. Correctness never depends on it: every
//! resolution is a compare-and-swap, and the requeue guard ([`Leadership`]) reads the Lease
//! itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use super::shutdown::{self, Shutdown};
use crate::state::leadership::Leadership;

/// Which Lease, if any, this replica competes for.
#[derive(Clone, Debug)]
pub struct LeaseOptions {
    /// Off: this replica leads at once and never loses it.
    pub leader_election: bool,
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
}

/// Why leader election could not start or went on no more.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("setting up leader election")]
    Setup(#[source] kube_lease_manager::LeaseManagerError),
    #[error("leader election stopped")]
    Stopped(#[source] tokio::sync::watch::error::RecvError),
}

/// A leader's term: `lost` resolves when the Lease is lost (losing it ends the process, and the
/// Deployment restarts it as a standby, which is simpler than tearing down); `lease` gives it
/// up on a clean shutdown.
pub struct Lead {
    pub lost: Shutdown,
    pub lease: LeaseHandle,
}

/// Gives the Lease up once the controllers have stopped (a rolling update hands over at once
/// instead of after the Lease's 15 s).
pub struct LeaseHandle {
    release: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

/// How long a clean shutdown waits for the Lease to be released.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

impl LeaseHandle {
    fn none() -> Self {
        LeaseHandle {
            release: None,
            done: None,
        }
    }

    /// Gives the Lease up, waiting at most [`RELEASE_TIMEOUT`].
    pub async fn release(mut self) {
        if let Some(tx) = self.release.take() {
            let _ = tx.send(());
        }
        if let Some(done) = self.done.take()
            && tokio::time::timeout(RELEASE_TIMEOUT, done).await.is_err()
        {
            tracing::warn!("releasing the Lease took too long; the standby waits for it to expire");
        }
    }
}

/// Leadership: controllers run only while this replica holds the Lease. Waits until it does.
/// None when `shutdown` came first. Without leader election, leadership is never lost.
pub async fn lead(
    options: &LeaseOptions,
    client: &kube::Client,
    identity: &str,
    ready: &AtomicBool,
    shutdown: &Shutdown,
) -> Result<Option<Lead>, LeaseError> {
    if !options.leader_election {
        return Ok(Some(Lead {
            lost: shutdown::never(),
            lease: LeaseHandle::none(),
        }));
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &options.namespace);
    let (mut leader, task) = loop {
        let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &options.name)
            .with_namespace(&options.namespace)
            .with_identity(identity)
            .with_duration(15)
            .with_grace(5)
            .build()
            .await
            .map_err(LeaseError::Setup)?;
        let (mut leader, task) = manager.watch().await;
        ready.store(true, Ordering::Relaxed);
        tracing::info!(lease = %options.name, identity = %identity, "waiting for leadership");
        // The lease manager sleeps until the holder's term ends; a holder that gave the
        // Lease up (a clean shutdown) is noticed by polling, and a fresh manager takes it.
        let released = tokio::select! {
            r = leader.wait_for(|held| *held) => { r.map_err(LeaseError::Stopped)?; false }
            () = lease_released(&leases, &options.name) => true,
            _ = shutdown.clone() => return Ok(None),
        };
        if !released {
            break (leader, task);
        }
        drop(leader);
        let _ = task.await;
    };
    tracing::info!(identity = %identity, "became leader");
    let (lost_tx, lost_rx) = tokio::sync::watch::channel(false);
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        tokio::select! {
            _ = leader.wait_for(|held| !*held) => {
                tracing::error!("lost leadership; exiting so a standby takes over");
                let _ = lost_tx.send(true);
                return;
            }
            _ = released => {}
        }
        // The lease manager releases the Lease once its last receiver is gone.
        drop(leader);
        match task.await {
            Ok(Ok(_)) => tracing::info!("released the Lease"),
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the Lease failed"),
            Err(e) => tracing::warn!(error = %e, "the lease manager stopped"),
        }
    });
    let lost = async move {
        let mut lost_rx = lost_rx;
        let _ = lost_rx.wait_for(|lost| *lost).await;
    };
    Ok(Some(Lead {
        lost: lost.boxed().shared(),
        lease: LeaseHandle {
            release: Some(release),
            done: Some(done),
        },
    }))
}

/// Resolves once the Lease, after being held by another replica, has no holder (it was given
/// up). Polls once a second, as the requeue guard does.
async fn lease_released(leases: &Api<Lease>, name: &str) {
    let mut held_by_another = false;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let holder = match leases.get_opt(name).await {
            Ok(lease) => lease
                .and_then(|l| l.spec)
                .and_then(|s| s.holder_identity)
                .filter(|h| !h.is_empty()),
            Err(_) => continue,
        };
        match holder {
            Some(_) => held_by_another = true,
            None if held_by_another => return,
            None => {}
        }
    }
}

/// The requeue guard of a leader: its term as the Lease says, refreshed every second (see
/// [`Leadership`]). Without leader election it never runs out.
pub fn follow_lease(options: &LeaseOptions, client: &kube::Client, identity: &str) -> Leadership {
    if !options.leader_election {
        return Leadership::always();
    }
    let leadership = Leadership::not_yet();
    tokio::spawn(leadership.clone().follow(
        client.clone(),
        options.namespace.clone(),
        options.name.clone(),
        identity.to_string(),
        Duration::from_secs(1),
    ));
    leadership
}

/// Resolves once this leader stalled on decided records ([`super::decided`]), after turning
/// `/readyz` false.
pub fn stalled_leader(
    mut stalled: tokio::sync::watch::Receiver<Option<String>>,
    ready: Arc<AtomicBool>,
) -> Shutdown {
    async move {
        let why = stalled
            .wait_for(Option::is_some)
            .await
            .map(|why| why.clone().unwrap_or_default());
        let Ok(why) = why else {
            // The alarm is gone with its scopes: nothing will raise it.
            return std::future::pending::<()>().await;
        };
        ready.store(false, Ordering::Relaxed);
        tracing::error!(why = %why, "stepping down: not ready, giving up the Lease");
    }
    .boxed()
    .shared()
}
