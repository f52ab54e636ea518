//! The parker's side of the hard `maxParked` (the rules are `dlq_core::capacity`): before a
//! record is created, a slot for it is taken from a block of slots granted in the
//! DeadLetterQueue's status by a compare-and-swap. Parkings of one queue waiting in this
//! process at the same moment share one compare-and-swap, and a storm's blocks grow so that
//! most parkings take a slot without writing the queue at all. While a storm spends a block,
//! the next one is asked for in the background, so parkings do not wait for that write either.
//! A parker told the operator's `--max-records` ([`crate::ceiling`]) takes each block in the
//! operator's ledger first, with the same id, and the queue grants at most that.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;

use dlq_core::api::DeadLetterQueue;
use dlq_core::capacity::{self, Grant};

use crate::ceiling::{LedgerError, LedgerGate};

/// Field manager of every write a parker makes: its records (`park`) and its queue's slot
/// blocks (here).
pub const PARKER: &str = "dlq-parker";

/// Why no slot was granted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AdmitError {
    #[error("queue is full: {in_use} of maxParked {limit}")]
    Full { in_use: i64, limit: i64 },
    #[error("the operator's --max-records is reached: {in_use} records of {limit}")]
    MaxRecords { in_use: i64, limit: i64 },
    /// The operator has not counted its records yet: nothing is granted under its ceiling.
    #[error("{0}")]
    Uncounted(String),
    #[error("the DeadLetterQueue is gone")]
    Gone,
    #[error("kubernetes API: {0}")]
    Kube(String),
}

/// A slot under `maxParked`: the id of the block it belongs to, which the record carries in
/// its `dlq.dev/slot-block` annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub block: String,
}

type Reply = oneshot::Sender<Result<Slot, AdmitError>>;

/// One block of slots granted to this process for a queue, being spent.
struct Block {
    id: String,
    size: i64,
    left: i64,
    /// Slots taken but handed back unused after the block's use window (a create that found
    /// the name taken).
    returned: i64,
    /// The unused slots were given back: nothing more can change.
    closed: bool,
    /// Asked for at (before the compare-and-swap was sent).
    asked: Instant,
}

impl Block {
    /// Block `id` of `size` slots granted at `asked`, `taken` of them already handed out.
    fn granted(id: &str, size: i64, taken: i64, asked: Instant) -> Block {
        Block {
            id: id.to_string(),
            size,
            left: size - taken,
            returned: 0,
            closed: false,
            asked,
        }
    }

    fn usable(&self) -> bool {
        self.left > 0 && self.asked.elapsed() < BLOCK_USE
    }

    /// Slots whose records exist or may exist.
    fn used(&self) -> i64 {
        self.size - self.left - self.returned
    }

    /// Unused slots to give back now, and the block closed for good.
    fn close(&mut self) -> Option<i64> {
        if self.closed || (self.left == 0 && self.returned == 0) {
            return None;
        }
        let used = self.used();
        self.left = 0;
        self.returned = 0;
        self.closed = true;
        Some(used)
    }

    fn take(&mut self) -> Option<Slot> {
        if !self.usable() {
            return None;
        }
        self.left -= 1;
        Some(Slot {
            block: self.id.clone(),
        })
    }
}

/// The blocks this process was granted for one queue.
#[derive(Default)]
struct Blocks {
    /// The block being spent.
    current: Option<Block>,
    /// The block asked for ahead while a storm spends `current`; spent once that one is.
    next: Option<Block>,
    /// A background compare-and-swap for `next` is under way.
    refilling: bool,
}

/// A block taken out of use before its use window ended, with the slots it hands back.
struct Retired {
    id: String,
    used: i64,
}

impl Blocks {
    /// A slot from the current block, or from the next one once the current is spent; also
    /// the current block when it was replaced with unused slots to give back.
    fn take(&mut self) -> (Option<Slot>, Option<Retired>) {
        if let Some(slot) = self.current.as_mut().and_then(Block::take) {
            return (Some(slot), None);
        }
        let Some(next) = self.next.take() else {
            return (None, None);
        };
        let retired = self.replace_current(next);
        (self.current.as_mut().and_then(Block::take), retired)
    }

    /// Makes `block` the one being spent; the one it replaces, closed, when it had unused
    /// slots to give back (it expired before its give-back ran, or was not spent).
    fn replace_current(&mut self, block: Block) -> Option<Retired> {
        self.current.replace(block).and_then(|mut old| {
            let id = old.id.clone();
            old.close().map(|used| Retired { id, used })
        })
    }

    /// The block with id `id`, current or next, while it is still open.
    fn open(&mut self, id: &str) -> Option<&mut Block> {
        [self.current.as_mut(), self.next.as_mut()]
            .into_iter()
            .flatten()
            .find(|h| h.id == id && !h.closed)
    }

    /// The size of the block to ask for ahead, when one should be: the current block is half
    /// spent within [`QUICKLY`] of asking (a storm), no next block is granted or being asked for.
    fn refill_due(&self) -> Option<i64> {
        let current = self.current.as_ref()?;
        let due = !self.refilling
            && self.next.is_none()
            && current.size >= REFILL_FROM
            && current.left.saturating_mul(2) <= current.size
            && current.asked.elapsed() < QUICKLY;
        due.then(|| capacity::next_block_size(1, Some((current.size, true))))
    }
}

/// One queue's batching point.
#[derive(Default)]
struct Gate {
    /// Parkings waiting for the next compare-and-swap.
    pending: Mutex<Vec<Reply>>,
    /// The blocks being spent.
    blocks: Mutex<Blocks>,
    /// Locked during a compare-and-swap; the queue as last read or written by it.
    last: tokio::sync::Mutex<Option<DeadLetterQueue>>,
}

/// Grants slots under their queue's `maxParked` (and the operator's `--max-records`, for a
/// handle told it).
#[derive(Clone)]
pub struct Admissions {
    gates: Arc<Mutex<Gates>>,
    /// Whether this handle asks for the next block ahead while a storm spends the current one.
    ask_ahead: bool,
    /// The operator's ceiling across queues, when this handle parks for the operator.
    ceiling: Option<Arc<LedgerGate>>,
}

impl Default for Admissions {
    fn default() -> Self {
        Admissions {
            gates: Arc::default(),
            ask_ahead: true,
            ceiling: None,
        }
    }
}

/// (namespace, queue) → its gate.
type Gates = HashMap<(String, String), Arc<Gate>>;

/// The process's admissions: every [`crate::Parker`] of a process shares the same gates and
/// blocks, so a producer calling `park()` once per job from many tasks contends with other
/// processes only, never with itself.
static SHARED: std::sync::LazyLock<Admissions> = std::sync::LazyLock::new(Admissions::default);

impl Admissions {
    pub fn shared() -> Admissions {
        SHARED.clone()
    }

    /// The same gates, asking ahead or not (`ParkOptions::ask_ahead`).
    pub fn asking_ahead(mut self, ask_ahead: bool) -> Admissions {
        self.ask_ahead = ask_ahead;
        self
    }

    /// The same gates, every block also taken under the ceiling of `ledger`.
    pub fn under(mut self, ledger: Arc<LedgerGate>) -> Admissions {
        self.ceiling = Some(ledger);
        self
    }

    /// What the helpers below need of this handle for `queue`.
    fn asker<'a>(&'a self, client: &'a Client, queue: &'a DeadLetterQueue) -> Asker<'a> {
        Asker {
            client,
            queue,
            ask_ahead: self.ask_ahead,
            ceiling: self.ceiling.as_ref(),
        }
    }
}

/// One admission's context: whose slots, for which queue, and how.
#[derive(Clone, Copy)]
struct Asker<'a> {
    client: &'a Client,
    queue: &'a DeadLetterQueue,
    ask_ahead: bool,
    ceiling: Option<&'a Arc<LedgerGate>>,
}

impl Asker<'_> {
    fn give_back(&self) -> GiveBack {
        GiveBack::of(self.client, self.queue, self.ceiling.cloned())
    }
}

/// Most compare-and-swap attempts per batch before giving up (each 409 waits a little and
/// re-reads the queue).
const ATTEMPTS: u32 = 40;

/// How long after asking a block's slots are spent (`capacity::BLOCK_USE_SECS`).
const BLOCK_USE: Duration = Duration::from_secs(capacity::BLOCK_USE_SECS.unsigned_abs());

/// A block used up within this long after it was asked for makes the next one twice as big.
const QUICKLY: Duration = Duration::from_secs(2);

/// The smallest block whose successor is asked for ahead: a single `kubectl dlq park` or a
/// trickle never takes slots it may not use.
const REFILL_FROM: i64 = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it leaves plain data behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A block id unique across processes: this process's random part and a counter.
fn block_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static PROCESS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:012x}-{}",
        *PROCESS & 0xffff_ffff_ffff,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

impl Admissions {
    /// Takes a slot in `queue` (a recent view of it: a stale one costs a 409 and a read): from
    /// the block this process is spending, or from a new block granted by one compare-and-swap
    /// for every parking waiting at that moment.
    pub async fn admit(
        &self,
        client: &Client,
        queue: &DeadLetterQueue,
    ) -> Result<Slot, AdmitError> {
        let key = (queue.namespace().unwrap_or_default(), queue.name_any());
        let gate = lock(&self.gates).entry(key).or_default().clone();
        let asker = self.asker(client, queue);
        if let Some(slot) = take(asker, &gate) {
            return Ok(slot);
        }
        let (tx, mut rx) = oneshot::channel();
        lock(&gate.pending).push(tx);
        // Either an earlier holder of the lock answers us, or we get the lock and serve
        // everything queued meanwhile ourselves. Waiting for the lock after being answered
        // would queue behind the next batch's write.
        let last = tokio::select! {
            biased;
            answered = &mut rx => return answered.unwrap_or_else(|_| Err(dropped())),
            last = gate.last.lock() => last,
        };
        let mut last = last;
        let batch = std::mem::take(&mut *lock(&gate.pending));
        let mut batch = serve_from_blocks(asker, &gate, batch);
        // One block per round; more rounds when the parkings waiting outnumber the largest
        // block, until they are served or the queue is full.
        while !batch.is_empty() {
            let want = {
                let blocks = lock(&gate.blocks);
                let before = blocks
                    .current
                    .as_ref()
                    .map(|h| (h.size, h.asked.elapsed() < QUICKLY));
                capacity::next_block_size(batch.len(), before)
            };
            let asked = Instant::now();
            let id = block_id();
            let waiting = i64::try_from(batch.len()).unwrap_or(i64::MAX);
            let reserved = reserve(asker, &mut last, &id, waiting, want).await;
            tracing::debug!(queue = %queue.name_any(), block = %id, waiting, want, granted = ?reserved.as_ref().map(|r| r.grant.size), ms = asked.elapsed().as_millis(), "block of slots");
            match reserved {
                Ok(Reserved { grant, short }) => {
                    batch = hand_out(asker, &gate, batch, &id, grant, asked);
                    // Fewer slots than parkings waiting: the queue (or the ceiling) is full.
                    if grant.size < want.min(waiting) {
                        answer_all(batch, Err(short));
                        break;
                    }
                }
                Err(e) => {
                    answer_all(batch, Err(e));
                    break;
                }
            }
        }
        drop(last);
        rx.await.unwrap_or_else(|_| Err(dropped()))
    }
}

impl Admissions {
    /// Hands back a slot whose record was certainly not created (the name was taken): the next
    /// parking takes it, or it is given back with the block's unused slots. A slot of a block
    /// already given back stays counted until the block expires.
    pub fn unuse(&self, queue: &DeadLetterQueue, slot: &Slot) {
        let key = (queue.namespace().unwrap_or_default(), queue.name_any());
        let Some(gate) = lock(&self.gates).get(&key).cloned() else {
            return;
        };
        let mut blocks = lock(&gate.blocks);
        if let Some(h) = blocks.open(&slot.block) {
            if h.asked.elapsed() < BLOCK_USE {
                h.left += 1;
            } else {
                h.returned += 1;
            }
        }
    }
}

/// A slot from this process's blocks, if any: gives back what a replaced block did not use, and
/// asks for the next block ahead when a storm is spending the current one.
fn take(asker: Asker<'_>, gate: &Arc<Gate>) -> Option<Slot> {
    let (slot, retired, refill) = {
        let mut blocks = lock(&gate.blocks);
        let (slot, retired) = blocks.take();
        let refill = blocks.refill_due().filter(|_| asker.ask_ahead);
        if refill.is_some() {
            blocks.refilling = true;
        }
        (slot, retired, refill)
    };
    if let Some(Retired { id, used }) = retired {
        tokio::spawn(asker.give_back().send(id, used));
    }
    if let Some(want) = refill {
        tokio::spawn(refill_ahead(
            asker.client.clone(),
            asker.queue.clone(),
            asker.ceiling.cloned(),
            gate.clone(),
            want,
        ));
    }
    slot
}

/// Answers what this process's blocks still cover; returns the rest.
fn serve_from_blocks(asker: Asker<'_>, gate: &Arc<Gate>, batch: Vec<Reply>) -> Vec<Reply> {
    let mut rest = Vec::new();
    for reply in batch {
        match take(asker, gate) {
            Some(slot) => {
                let _ = reply.send(Ok(slot));
            }
            None => rest.push(reply),
        }
    }
    rest
}

/// Asks for the block after the current one while parkings still take slots from it: one
/// compare-and-swap in the background (it waits behind a batch's, sharing `gate.last`), so
/// a storm does not stall every time a block is spent. A full queue or a failure grants
/// nothing; the parkings then ask for themselves when the current block is spent.
async fn refill_ahead(
    client: Client,
    queue: DeadLetterQueue,
    ceiling: Option<Arc<LedgerGate>>,
    gate: Arc<Gate>,
    want: i64,
) {
    let asker = Asker {
        client: &client,
        queue: &queue,
        ask_ahead: true,
        ceiling: ceiling.as_ref(),
    };
    let mut last = gate.last.lock().await;
    // A batch may have been served meanwhile, with a block of its own.
    let still_due = {
        let blocks = lock(&gate.blocks);
        blocks.next.is_none() && blocks.current.as_ref().is_some_and(|b| b.left > 0)
    };
    if still_due {
        let (id, asked) = (block_id(), Instant::now());
        let reserved = reserve(asker, &mut last, &id, 0, want).await;
        tracing::debug!(queue = %queue.name_any(), block = %id, want, granted = ?reserved.as_ref().map(|r| r.grant.size), ms = asked.elapsed().as_millis(), "block of slots, asked ahead");
        if let Ok(Reserved { grant, .. }) = reserved
            && grant.size > 0
        {
            lock(&gate.blocks).next = Some(Block::granted(&id, grant.size, 0, asked));
            asker.give_back().after_use(gate.clone(), id, asked);
        }
    }
    lock(&gate.blocks).refilling = false;
}

/// Gives waiting parkings their slots of a new block and keeps what is left of it for the
/// next ones; returns the parkings it did not cover.
fn hand_out(
    asker: Asker<'_>,
    gate: &Arc<Gate>,
    mut batch: Vec<Reply>,
    id: &str,
    granted: Grant,
    asked: Instant,
) -> Vec<Reply> {
    let covered = usize::try_from(granted.size).unwrap_or(0).min(batch.len());
    let rest = batch.split_off(covered);
    for reply in batch {
        // A parker that stopped waiting (its task was aborted) needs no answer.
        let _ = reply.send(Ok(Slot {
            block: id.to_string(),
        }));
    }
    if granted.size > 0 {
        let taken = i64::try_from(covered).unwrap_or(0);
        let block = Block::granted(id, granted.size, taken, asked);
        let retired = lock(&gate.blocks).replace_current(block);
        let back = asker.give_back();
        if let Some(Retired { id, used }) = retired {
            tokio::spawn(back.clone().send(id, used));
        }
        back.after_use(gate.clone(), id.to_string(), asked);
    }
    rest
}

/// Returns the slots of a block this process did not take, so they do not stay counted until
/// the block expires (a burst that ends mid-block, or a block larger than its storm).
#[derive(Clone)]
struct GiveBack {
    client: Client,
    namespace: String,
    queue: String,
    /// The ledger whose block of the same id shrinks with it.
    ceiling: Option<Arc<LedgerGate>>,
}

impl GiveBack {
    fn of(client: &Client, queue: &DeadLetterQueue, ceiling: Option<Arc<LedgerGate>>) -> Self {
        GiveBack {
            client: client.clone(),
            namespace: queue.namespace().unwrap_or_default(),
            queue: queue.name_any(),
            ceiling,
        }
    }

    /// Once block `id` can no longer be used, shrinks it to the slots taken from it.
    fn after_use(self, gate: Arc<Gate>, id: String, asked: Instant) {
        tokio::spawn(async move {
            tokio::time::sleep(BLOCK_USE.saturating_sub(asked.elapsed())).await;
            let used = {
                let mut blocks = lock(&gate.blocks);
                // No slot is taken from it after this.
                match blocks.open(&id).and_then(Block::close) {
                    Some(used) => used,
                    None => return,
                }
            };
            self.send(id, used).await;
        });
    }

    /// The block's size becomes `used` (a merge patch: shrinking a block is safe whatever
    /// else changed meanwhile), in the queue and in the ledger. A failure leaves the slots to
    /// the block's expiry.
    async fn send(self, id: String, used: i64) {
        if let Some(ledger) = &self.ceiling {
            ledger.shrink(&self.client, &id, used).await;
        }
        let api: Api<DeadLetterQueue> = Api::namespaced(self.client, &self.namespace);
        let patch = json!({"status": {"blocks": {id.as_str(): {"size": used}}}});
        let pp = PatchParams {
            field_manager: Some(PARKER.into()),
            ..PatchParams::default()
        };
        if let Err(e) = api
            .patch_status(&self.queue, &pp, &Patch::Merge(patch))
            .await
        {
            tracing::debug!(queue = %self.queue, block = %id, error = %e, "giving back unused slots failed; they expire with the block");
        }
    }
}

fn answer_all(batch: Vec<Reply>, result: Result<Slot, AdmitError>) {
    for reply in batch {
        let _ = reply.send(result.clone());
    }
}

fn dropped() -> AdmitError {
    AdmitError::Kube("admission dropped".into())
}

/// What one reservation granted, and what the parkings it did not cover are told: the queue
/// is full, or the operator's ceiling is reached.
struct Reserved {
    grant: Grant,
    short: AdmitError,
}

impl From<LedgerError> for AdmitError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Uncounted { .. } => AdmitError::Uncounted(e.to_string()),
            other => AdmitError::Kube(other.to_string()),
        }
    }
}

/// One compare-and-swap adding block `id` with what fits of `want` slots, starting from the
/// freshest view at hand; re-reads on a conflict, and once before refusing on a view that may
/// be stale. Under a ceiling, the block is first taken in its ledger (once, with the same id)
/// and the queue grants at most that; the ledger's block shrinks to what the queue granted.
async fn reserve(
    asker: Asker<'_>,
    last: &mut Option<DeadLetterQueue>,
    id: &str,
    waiting: i64,
    want: i64,
) -> Result<Reserved, AdmitError> {
    let given = asker.queue;
    let api: Api<DeadLetterQueue> =
        Api::namespaced(asker.client.clone(), &given.namespace().unwrap_or_default());
    let mut current = last.take().unwrap_or_else(|| given.clone());
    let mut fresh = false;
    // The ledger's grant for block `id`, once taken.
    let mut ledger: Option<Grant> = None;
    for attempt in 0..ATTEMPTS {
        let limit = current.spec.max_parked();
        let mut granted = capacity::grant(current.status.as_ref(), limit, waiting, want);
        if granted.size < want.min(waiting) && !fresh {
            current = read(&api, &given.name_any()).await?;
            fresh = true;
            continue;
        }
        let mut short = AdmitError::Full {
            in_use: granted.in_use,
            limit: granted.limit,
        };
        if let Some(gate) = asker.ceiling
            && granted.size > 0
        {
            let under = match ledger {
                Some(g) => g,
                None => {
                    let g = gate
                        .reserve(asker.client, id, waiting.min(granted.size), granted.size)
                        .await?;
                    ledger = Some(g);
                    g
                }
            };
            if under.size < granted.size {
                short = AdmitError::MaxRecords {
                    in_use: under.in_use,
                    limit: under.limit,
                };
                granted.size = under.size;
            }
        }
        if granted.size == 0 {
            release(asker, ledger, id, 0).await;
            *last = Some(current);
            return Ok(Reserved {
                grant: granted,
                short,
            });
        }
        match write(&api, &current, id, granted.size).await {
            Ok(updated) => {
                release(asker, ledger, id, granted.size).await;
                *last = Some(updated);
                return Ok(Reserved {
                    grant: granted,
                    short,
                });
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                tracing::debug!(queue = %given.name_any(), block = %id, attempt, "block of slots: conflict");
                // Another process won this round: wait a random moment so contenders spread
                // out instead of colliding again.
                tokio::time::sleep(crate::retry::jitter(attempt)).await;
                current = read(&api, &given.name_any()).await?;
                fresh = true;
            }
            Err(e) => {
                release(asker, ledger, id, 0).await;
                return Err(AdmitError::Kube(e.to_string()));
            }
        }
    }
    release(asker, ledger, id, 0).await;
    Err(AdmitError::Kube(format!(
        "DeadLetterQueue {} kept changing ({ATTEMPTS} conflicts in a row)",
        given.name_any()
    )))
}

/// Shrinks the ledger's block `id` to `kept` slots when it granted more.
async fn release(asker: Asker<'_>, ledger: Option<Grant>, id: &str, kept: i64) {
    if let (Some(gate), Some(granted)) = (asker.ceiling, ledger)
        && granted.size > kept
    {
        gate.shrink(asker.client, id, kept).await;
    }
}

async fn read(api: &Api<DeadLetterQueue>, name: &str) -> Result<DeadLetterQueue, AdmitError> {
    api.get_opt(name)
        .await
        .map_err(|e| AdmitError::Kube(e.to_string()))?
        .ok_or(AdmitError::Gone)
}

/// The compare-and-swap: block `id` of `size` slots into `status.blocks`, guarded by the
/// resourceVersion of the view it was counted against.
async fn write(
    api: &Api<DeadLetterQueue>,
    current: &DeadLetterQueue,
    id: &str,
    size: i64,
) -> Result<DeadLetterQueue, kube::Error> {
    let now = jiff::Timestamp::now().as_second();
    let patch = json!({
        "metadata": {"resourceVersion": current.resource_version()},
        "status": {"blocks": {id: {"size": size, "at": now}}},
    });
    let pp = PatchParams {
        field_manager: Some(PARKER.into()),
        ..PatchParams::default()
    };
    api.patch_status(&current.name_any(), &pp, &Patch::Merge(patch))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(id: &str, size: i64, left: i64, asked: Instant) -> Block {
        Block::granted(id, size, size - left, asked)
    }

    #[test]
    fn the_next_block_is_spent_once_the_current_one_is() {
        let now = Instant::now();
        let mut blocks = Blocks {
            current: Some(block("a", 2, 1, now)),
            next: Some(block("b", 4, 4, now)),
            refilling: false,
        };
        let taken: Vec<String> = (0..5)
            .map(|_| blocks.take().0.expect("a slot").block)
            .collect();
        assert_eq!(taken, ["a", "b", "b", "b", "b"]);
        assert_eq!(blocks.take().0, None, "both spent");
    }

    #[test]
    fn a_current_block_past_its_use_window_gives_back_what_it_did_not_use() {
        let long_ago = Instant::now() - BLOCK_USE - Duration::from_secs(1);
        let mut blocks = Blocks {
            current: Some(block("old", 10, 6, long_ago)),
            next: Some(block("new", 4, 4, Instant::now())),
            refilling: false,
        };
        let (slot, retired) = blocks.take();
        assert_eq!(slot.map(|s| s.block).as_deref(), Some("new"));
        let retired = retired.expect("the old block retires");
        assert_eq!((retired.id.as_str(), retired.used), ("old", 4));
        assert!(
            blocks.open("old").is_none(),
            "nothing more is taken from it"
        );
    }

    #[test]
    fn the_next_block_is_asked_for_when_a_storm_has_spent_half_the_current_one() {
        let now = Instant::now();
        let mut blocks = Blocks {
            current: Some(block("a", 64, 33, now)),
            ..Blocks::default()
        };
        assert_eq!(blocks.refill_due(), None, "more than half left");
        blocks.current = Some(block("a", 64, 32, now));
        assert_eq!(blocks.refill_due(), Some(128), "twice the current block");
        blocks.refilling = true;
        assert_eq!(blocks.refill_due(), None, "one refill at a time");
        blocks.refilling = false;
        blocks.next = Some(block("b", 128, 128, now));
        assert_eq!(blocks.refill_due(), None, "one block ahead at most");
    }

    #[test]
    fn a_trickle_or_a_single_park_never_takes_slots_ahead() {
        let slow = Instant::now() - QUICKLY - Duration::from_millis(1);
        let trickle = Blocks {
            current: Some(block("a", 64, 1, slow)),
            ..Blocks::default()
        };
        assert_eq!(trickle.refill_due(), None, "spent slowly");
        let single = Blocks {
            current: Some(block("a", 1, 0, Instant::now())),
            ..Blocks::default()
        };
        assert_eq!(single.refill_due(), None, "too small to ask ahead");
    }
}
