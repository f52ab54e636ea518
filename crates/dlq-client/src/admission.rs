//! The parker's side of the hard `maxParked` (the rules are `dlq_core::capacity`): before a
//! record is created its name is reserved in the DeadLetterQueue's status by a
//! compare-and-swap. Parkings of one queue waiting in this process at the same moment share
//! one compare-and-swap (a batch), so a parking storm costs one queue write per batch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;

use dlq_core::api::DeadLetterQueue;
use dlq_core::capacity::{self, Admission};

/// Why a reservation was not made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AdmitError {
    #[error("queue is full: {in_use} of maxParked {limit}")]
    Full { in_use: i64, limit: i64 },
    #[error("the DeadLetterQueue is gone")]
    Gone,
    #[error("kubernetes API: {0}")]
    Kube(String),
}

type Reply = oneshot::Sender<Result<(), AdmitError>>;

/// One queue's batching point.
#[derive(Default)]
struct Gate {
    /// Names waiting for the next compare-and-swap.
    pending: Mutex<Vec<(String, Reply)>>,
    /// Held during a compare-and-swap; the queue as last read or written by it.
    last: tokio::sync::Mutex<Option<DeadLetterQueue>>,
}

/// Reserves record names under their queue's `maxParked`.
#[derive(Clone, Default)]
pub struct Admissions {
    gates: Arc<Mutex<Gates>>,
}

/// (namespace, queue) → its gate.
type Gates = HashMap<(String, String), Arc<Gate>>;

/// The process's admissions: every [`crate::Parker`] of a process batches through the same
/// gates, so a producer calling `park()` once per job from many tasks contends with other
/// processes only, never with itself.
static SHARED: std::sync::LazyLock<Admissions> = std::sync::LazyLock::new(Admissions::default);

impl Admissions {
    pub fn shared() -> Admissions {
        SHARED.clone()
    }
}

/// Most compare-and-swap attempts per batch before giving up (each 409 waits a little and
/// re-reads the queue).
const ATTEMPTS: u32 = 40;

/// A random wait before attempt `attempt + 1`: up to 5 ms × 2^attempt, at most 400 ms.
fn jitter(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let cap = 5u64.saturating_mul(1 << attempt.min(7)).min(400);
    // RandomState is seeded per instance: enough randomness to de-synchronise processes.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    Duration::from_millis(h.finish() % (cap + 1))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it leaves plain data behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Admissions {
    /// Reserves `name` in `queue` (a recent view of it: a stale one costs a 409 and a read).
    pub async fn admit(
        &self,
        client: &Client,
        queue: &DeadLetterQueue,
        name: &str,
    ) -> Result<(), AdmitError> {
        let key = (queue.namespace().unwrap_or_default(), queue.name_any());
        let gate = lock(&self.gates).entry(key).or_default().clone();
        let (tx, mut rx) = oneshot::channel();
        lock(&gate.pending).push((name.to_string(), tx));
        // Either an earlier holder of the lock takes our name into its batch and answers, or
        // we get the lock and write everything queued meanwhile ourselves. Waiting for the
        // lock after being answered would queue behind the next batch's write.
        let last = tokio::select! {
            biased;
            answered = &mut rx => return answered.unwrap_or_else(|_| Err(dropped())),
            last = gate.last.lock() => last,
        };
        let mut last = last;
        let batch = std::mem::take(&mut *lock(&gate.pending));
        if !batch.is_empty() {
            let names: Vec<String> = batch.iter().map(|(n, _)| n.clone()).collect();
            let result = reserve(client, &mut last, queue, &names).await;
            answer(batch, result);
        }
        drop(last);
        rx.await.unwrap_or_else(|_| Err(dropped()))
    }
}

fn dropped() -> AdmitError {
    AdmitError::Kube("admission dropped".into())
}

/// Sends each waiting parker its part of the batch's outcome.
fn answer(batch: Vec<(String, Reply)>, result: Result<Admission, AdmitError>) {
    for (name, reply) in batch {
        let r = match &result {
            Ok(a) if a.admitted.contains(&name) => Ok(()),
            Ok(a) => Err(AdmitError::Full {
                in_use: a.in_use,
                limit: a.limit,
            }),
            Err(e) => Err(e.clone()),
        };
        // A parker that stopped waiting (its task was aborted) needs no answer.
        let _ = reply.send(r);
    }
}

/// One compare-and-swap admitting what fits of `names`, starting from the freshest view at
/// hand; re-reads on a conflict, and once before refusing on a view that may be stale.
async fn reserve(
    client: &Client,
    last: &mut Option<DeadLetterQueue>,
    given: &DeadLetterQueue,
    names: &[String],
) -> Result<Admission, AdmitError> {
    let api: Api<DeadLetterQueue> =
        Api::namespaced(client.clone(), &given.namespace().unwrap_or_default());
    let mut current = last.take().unwrap_or_else(|| given.clone());
    let mut fresh = false;
    for attempt in 0..ATTEMPTS {
        let admission = capacity::admit(current.status.as_ref(), current.spec.max_parked(), names);
        if !admission.refused.is_empty() && !fresh {
            current = read(&api, &given.name_any()).await?;
            fresh = true;
            continue;
        }
        if admission.admitted.is_empty() {
            *last = Some(current);
            return Ok(admission);
        }
        match write(&api, &current, &admission).await {
            Ok(updated) => {
                *last = Some(updated);
                return Ok(admission);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Another process won this round: wait a random moment so contenders spread
                // out instead of colliding again.
                tokio::time::sleep(jitter(attempt)).await;
                current = read(&api, &given.name_any()).await?;
                fresh = true;
            }
            Err(e) => return Err(AdmitError::Kube(e.to_string())),
        }
    }
    Err(AdmitError::Kube(format!(
        "DeadLetterQueue {} kept changing ({ATTEMPTS} conflicts in a row)",
        given.name_any()
    )))
}

async fn read(api: &Api<DeadLetterQueue>, name: &str) -> Result<DeadLetterQueue, AdmitError> {
    api.get_opt(name)
        .await
        .map_err(|e| AdmitError::Kube(e.to_string()))?
        .ok_or(AdmitError::Gone)
}

/// The compare-and-swap: the admitted names into `status.reservations`, guarded by the
/// resourceVersion of the view they were counted against.
async fn write(
    api: &Api<DeadLetterQueue>,
    current: &DeadLetterQueue,
    admission: &Admission,
) -> Result<DeadLetterQueue, kube::Error> {
    let now = jiff::Timestamp::now().as_second();
    let reservations: serde_json::Map<String, serde_json::Value> = admission
        .admitted
        .iter()
        .map(|n| (n.clone(), json!(now)))
        .collect();
    let patch = json!({
        "metadata": {"resourceVersion": current.resource_version()},
        "status": {"reservations": reservations},
    });
    let pp = PatchParams {
        field_manager: Some(crate::park::PARKER.into()),
        ..PatchParams::default()
    };
    api.patch_status(&current.name_any(), &pp, &Patch::Merge(patch))
        .await
}
