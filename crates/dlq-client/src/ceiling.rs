//! The parker's side of the operator's `--max-records` (the rules are `dlq_core::ceiling`):
//! before a block of slots is taken in a queue, the same block is taken in the operator's
//! ledger (a ConfigMap in its namespace) by a compare-and-swap of the ledger's
//! resourceVersion, and shrunk when the queue grants fewer or the block is not spent. Only
//! parkers told the ceiling ([`crate::Parker::with_ceiling`]: the operator's own) take part.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use dlq_core::capacity::{Grant, grant_under};
use dlq_core::ceiling::{Ledger, grant_write, shrink_write};

/// Where the ceiling's ledger is and how high it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ceiling {
    /// The operator's namespace.
    pub namespace: String,
    /// The ledger ConfigMap (`dlq_core::ceiling::ledger_name`).
    pub name: String,
    /// `--max-records`.
    pub limit: i64,
}

/// Why the ledger granted nothing.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(
        "the operator has not counted its records yet (ConfigMap {namespace}/{name} holds no count); parking waits for it"
    )]
    Uncounted { namespace: String, name: String },
    #[error("the records ledger {namespace}/{name} kept changing ({ATTEMPTS} conflicts in a row)")]
    Busy { namespace: String, name: String },
    #[error("the records ledger {namespace}/{name}: {source}")]
    Kube {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// Most compare-and-swap attempts per reservation.
const ATTEMPTS: u32 = 40;

/// One ledger's compare-and-swap point in this process.
pub struct LedgerGate {
    ceiling: Ceiling,
    /// Field manager of the ledger writes (the parker's).
    manager: &'static str,
    /// Locked during a compare-and-swap; the ledger as last read or written by it.
    last: tokio::sync::Mutex<Option<ConfigMap>>,
}

/// (namespace, name) → the process's gate of that ledger.
type Gates = HashMap<(String, String), Arc<LedgerGate>>;

static GATES: LazyLock<Mutex<Gates>> = LazyLock::new(Mutex::default);

impl LedgerGate {
    /// The process's gate of `ceiling`'s ledger: every parker of a process reserves through
    /// one, so they contend with other processes only.
    pub fn shared(ceiling: Ceiling, manager: &'static str) -> Arc<LedgerGate> {
        let key = (ceiling.namespace.clone(), ceiling.name.clone());
        let mut gates = GATES.lock().unwrap_or_else(|e| e.into_inner());
        let gate = gates.entry(key).or_insert_with(|| {
            Arc::new(LedgerGate {
                ceiling: ceiling.clone(),
                manager,
                last: tokio::sync::Mutex::new(None),
            })
        });
        // A changed limit (another Parker told another one) wins from now on.
        if gate.ceiling.limit != ceiling.limit {
            *gate = Arc::new(LedgerGate {
                ceiling,
                manager,
                last: tokio::sync::Mutex::new(None),
            });
        }
        gate.clone()
    }

    pub fn ceiling(&self) -> &Ceiling {
        &self.ceiling
    }

    fn api(&self, client: &Client) -> Api<ConfigMap> {
        Api::namespaced(client.clone(), &self.ceiling.namespace)
    }

    fn kube(&self, source: kube::Error) -> LedgerError {
        LedgerError::Kube {
            namespace: self.ceiling.namespace.clone(),
            name: self.ceiling.name.clone(),
            source,
        }
    }

    fn uncounted(&self) -> LedgerError {
        LedgerError::Uncounted {
            namespace: self.ceiling.namespace.clone(),
            name: self.ceiling.name.clone(),
        }
    }

    async fn read(&self, api: &Api<ConfigMap>) -> Result<ConfigMap, LedgerError> {
        api.get_opt(&self.ceiling.name)
            .await
            .map_err(|e| self.kube(e))?
            .ok_or_else(|| self.uncounted())
    }

    /// Block `id` with what fits under the ceiling of `want` slots for `waiting` parkings
    /// (`dlq_core::capacity::grant_under`: the same sizing as a queue's), by one
    /// compare-and-swap; a grant of 0 when the ceiling is reached. Re-reads on a conflict, and
    /// once before refusing on a view that may be stale.
    pub async fn reserve(
        &self,
        client: &Client,
        id: &str,
        waiting: i64,
        want: i64,
    ) -> Result<Grant, LedgerError> {
        let api = self.api(client);
        let mut last = self.last.lock().await;
        let (mut current, mut fresh) = match last.take() {
            Some(c) => (c, false),
            None => (self.read(&api).await?, true),
        };
        for attempt in 0..ATTEMPTS {
            let ledger = Ledger::read(current.data.iter().flatten());
            let Some(held) = ledger.held() else {
                if !fresh {
                    current = self.read(&api).await?;
                    fresh = true;
                    continue;
                }
                return Err(self.uncounted());
            };
            let granted = grant_under(held, self.ceiling.limit, waiting, want);
            if granted.size < want.min(waiting) && !fresh {
                current = self.read(&api).await?;
                fresh = true;
                continue;
            }
            if granted.size == 0 {
                *last = Some(current);
                return Ok(granted);
            }
            let now = jiff::Timestamp::now().as_second();
            let patch = json!({
                "metadata": {"resourceVersion": current.resource_version()},
                "data": grant_write(id, granted.size, now),
            });
            match api
                .patch(&self.ceiling.name, &self.params(), &Patch::Merge(patch))
                .await
            {
                Ok(updated) => {
                    *last = Some(updated);
                    return Ok(granted);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    tracing::debug!(block = %id, attempt, "records ledger: conflict");
                    tokio::time::sleep(crate::retry::jitter(attempt)).await;
                    current = self.read(&api).await?;
                    fresh = true;
                }
                Err(e) => return Err(self.kube(e)),
            }
        }
        Err(LedgerError::Busy {
            namespace: self.ceiling.namespace.clone(),
            name: self.ceiling.name.clone(),
        })
    }

    /// Block `id` becomes `size` slots (those taken; 0 when its queue granted none): a merge
    /// patch of its size only (shrinking is safe whatever else changed). A failure leaves the
    /// slots to the block's expiry.
    pub async fn shrink(&self, client: &Client, id: &str, size: i64) {
        let patch = json!({"data": shrink_write(id, size)});
        if let Err(e) = self
            .api(client)
            .patch(&self.ceiling.name, &self.params(), &Patch::Merge(patch))
            .await
        {
            tracing::debug!(block = %id, error = %e, "shrinking a block of the records ledger failed; it expires");
        }
    }

    fn params(&self) -> PatchParams {
        PatchParams {
            field_manager: Some(self.manager.into()),
            ..PatchParams::default()
        }
    }
}
