//! Redis source bridge: consumers LPUSH dead jobs onto a list; the bridge moves each one into
//! the hash `<list>:inflight` under an id Redis gives it (server time + a counter), parks it
//! with that id as its source message identity, and only then HDELs it. While the list has a
//! backlog one atomic script moves as many elements as there are free parking slots and room in
//! the source's byte budget ([`TAKE_BATCH`], [`super::taken::BYTES_IN_FLIGHT`]);
//! when it is empty the bridge blocks in BLMOVE onto `<list>:processing` and then takes that
//! element into the hash ([`TAKE_ONE`]). On start it first re-parks whatever a crash left in
//! `<list>:processing` and `<list>:inflight`. The id is what makes that safe: a re-parked
//! element whose record exists, even one a human resolved meanwhile, is recognised as the same
//! dead message, not a new death of the job.
//!
//! While a standing replay runs on the queue and every slot holds a message waiting for room
//! (the queue Full), the bridge also reaches past them ([`super::reach`]): it reads the dead
//! list from its oldest end and takes the elements the replay passes, leaving the others where
//! they are, in their order; a storm's group is rarely alone.
//!
//! While running it also sweeps both places every [`SWEEP`]: what another process left there
//! after this one started (a replica that lost its Lease while parking, a puller of a run that
//! failed) and is still there one sweep later, unhandled here, is re-parked the same way.
//!
//! Elements are JSON envelopes (see docs/backends.md, "Source: the dead-list envelope"). Anything else, and any
//! envelope that fails validation, is parked as an Invalid record holding the exact bytes. An
//! element that cannot be a record at all (over the payload limit) is moved to
//! `<list>:rejected`, never deleted, and counted and announced.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio::sync::Semaphore;

use dlq_core::api::{DeadLetterQueue, RedisSourceSpec};

use super::park_into::{ParkInto, SourceError, keep_running};
use super::reach::{
    REACH_BYTES, REACH_LARGEST, REACH_PAGE, Reachable, into_inflight_lua, large_lua,
};
use super::taken::{BYTES_IN_FLIGHT, Element, Failpoints, Taken, free_slots, pairs, spawn_handle};
use crate::broker::backend::{Sides, source_url};
use crate::broker::redis::RedisConn;
use crate::secret::SecretReads;
use crate::state::bytes::ByteBudget;

/// Parks in flight at once per bridge: parkings waiting together share one reservation under
/// maxParked, so more in flight means fewer queue writes per record. 32 rather than the 16 of
/// NATS and SQS: a Redis backlog is drained in batches as fast as parks finish, and with 16 a
/// storm went at the pace of each park's round trips (71% of the create ceiling instead of
/// 62%) while the apiserver still had room.
pub const CONCURRENCY: usize = 32;

/// How often a running bridge looks for elements nobody is parking (see the module doc).
const SWEEP: Duration = Duration::from_secs(10);

/// Moves one element (the one nearest the oldest end) from a list into the inflight hash under
/// a fresh id; nil when the element is no longer in the list. KEYS: the list (processing, or
/// the dead list when reaching), inflight, counter.
const TAKE_ONE: &str = concat!(
    "if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then return false end",
    into_inflight_lua!()
);

/// Elements ARGV[1]..ARGV[2] of the dead list (negative: from its oldest end), oldest first;
/// an element over ARGV[3] bytes as its facts (the envelope without its payload, see
/// [`large_lua`]), at most ARGV[4] bytes of them. KEYS: dead.
const REACH_READ: &str = concat!(
    r"
local function facts(job)
  job.payload, job.payloadBase64, job.intent = '', nil, nil
  return job
end
",
    large_lua!(),
    r"
local out = {}
local page = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
for i = #page, 1, -1 do
  if #page[i] > tonumber(ARGV[3]) then
    out[#out + 1] = large(page[i], tonumber(ARGV[4]))
  else
    out[#out + 1] = page[i]
  end
end
return out
"
);

/// Moves up to ARGV[1] elements from the dead list straight into the inflight hash, each under
/// a fresh id, in one atomic step; returns id, element, id, element, ... (empty when the list
/// is). At most ARGV[2] bytes of elements, but always the first (see
/// [`super::taken::BYTES_IN_FLIGHT`]). KEYS: dead, inflight, counter. One round trip per batch instead of two per element:
/// a storm was drained at the pace of those round trips.
const TAKE_BATCH: &str = r"
local out = {}
local room = tonumber(ARGV[2])
local total = 0
for i = 1, tonumber(ARGV[1]) do
  local raw = redis.call('LINDEX', KEYS[1], -1)
  if not raw then break end
  if i > 1 and total + #raw > room then break end
  redis.call('LTRIM', KEYS[1], 0, -2)
  total = total + #raw
  local t = redis.call('TIME')
  local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[2], id, raw)
  out[#out + 1] = id
  out[#out + 1] = raw
end
return out
";

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: RedisSourceSpec) {
    keep_running("redis", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &RedisSourceSpec,
) -> Result<(), SourceError> {
    let (ns, name) = (into.namespace(), into.queue());
    let mut secrets = SecretReads::new(client, ns);
    let url = source_url(&mut secrets, Sides::of(source, &queue.spec)).await?;
    // One connection blocks in BLMOVE; the other takes elements and acknowledges them.
    let puller = RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?;
    let acker = Arc::new(RedisConn::new(&url).map_err(SourceError::broker("connecting to redis"))?);
    let dead = source.list.clone();
    let taken = Taken::new(
        into.clone(),
        acker,
        format!("{dead}:inflight"),
        format!("{dead}:rejected"),
        dead.clone(),
        read,
        Failpoints {
            after_take: "redis-after-take",
            before_ack: "redis-before-ack",
        },
    );
    let ctx = Arc::new(Bridge {
        taken: Arc::new(taken),
        counter: format!("{dead}:inflight:seq"),
        processing: format!("{dead}:processing"),
        dead: dead.clone(),
    });
    ctx.recover().await?;
    tracing::debug!(namespace = %ns, queue = %name, list = %dead, "redis source draining");
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    tokio::select! {
        pulled = pull(&ctx, &puller, &slots) => pulled,
        swept = ctx.sweep() => swept,
        reached = super::reach::reach(ctx.as_ref(), &slots, CONCURRENCY) => reached,
    }
}

/// Takes dead elements as parking slots free up: a batch at once while the list has a
/// backlog, else one at a time through a blocking BLMOVE.
async fn pull(
    ctx: &Arc<Bridge>,
    puller: &RedisConn,
    slots: &Arc<Semaphore>,
) -> Result<(), SourceError> {
    let budget = ByteBudget::new(BYTES_IN_FLIGHT);
    loop {
        let mut permits = free_slots(slots).await?;
        let room = budget.free().await?;
        let taken = ctx.take(permits.len(), room).await?;
        if taken.is_empty() {
            // The slot is taken before the element (free_slots holds at least one), so a
            // taken element always has one.
            if let Some(permit) = permits.pop()
                && let Some((id, raw)) = ctx.wait_for_one(puller).await?
            {
                let bytes = budget.hold(raw.len() as u64).await?;
                spawn_handle(&ctx.taken, id, raw, (permit, bytes));
            }
            continue;
        }
        // Slots left over (fewer elements than free slots) are dropped, so freed. The batch
        // fits the room it was taken for, but its first element, which may wait here for
        // elements in flight to give their bytes back.
        for ((id, raw), permit) in taken.into_iter().zip(permits) {
            let bytes = budget.hold(raw.len() as u64).await?;
            spawn_handle(&ctx.taken, id, raw, (permit, bytes));
        }
    }
}

/// A dead-list element: taken apart in its own buffer when its payload is too large for a
/// record (`dlq_core::envelope::take_apart`), so it is never held twice on its way to the body
/// store; else read as it is.
fn read(queue: &str, raw: Vec<u8>) -> Element {
    match dlq_core::envelope::take_apart(queue, raw) {
        Ok(req) => Element::Apart(req),
        Err(raw) => Element::Whole(dlq_core::envelope::request_for(queue, &raw), raw),
    }
}

struct Bridge {
    /// The inflight hash and how its elements are parked and acknowledged.
    taken: Arc<Taken>,
    /// The dead list: the source message identities start with its name.
    dead: String,
    processing: String,
    counter: String,
}

impl Bridge {
    /// Re-parks what a previous run left: elements moved but never taken, then taken but
    /// never acknowledged (those keep their ids, so records made before the crash are found).
    async fn recover(&self) -> Result<(), SourceError> {
        for raw in &self.untaken().await? {
            self.take_from(&self.processing, raw).await?;
        }
        self.taken.recover().await
    }

    /// The elements BLMOVE put in the processing list that no one took into the hash yet.
    async fn untaken(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        self.taken
            .conn
            .query(redis::cmd("LRANGE").arg(&self.processing).arg(0).arg(-1))
            .await
            .map_err(SourceError::broker(format!("reading {}", self.processing)))
    }

    /// Re-parks, every [`SWEEP`], what was left by others since the start: elements in the
    /// processing list or the inflight hash at two sweeps in a row and not being parked here
    /// (an element moved a moment ago is taken and parked within one sweep).
    async fn sweep(&self) -> Result<(), SourceError> {
        let mut untaken_suspects: HashSet<String> = HashSet::new();
        let mut taken_suspects: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep(SWEEP).await;
            let mut seen: HashSet<String> = HashSet::new();
            for raw in &self.untaken().await? {
                let digest = fingerprint(raw);
                if untaken_suspects.contains(&digest) {
                    self.take_from(&self.processing, raw).await?;
                }
                seen.insert(digest);
            }
            untaken_suspects = seen;
            taken_suspects = self.taken.sweep_once(&taken_suspects).await?;
        }
    }

    /// Up to `n` elements moved from the dead list into the inflight hash, with their ids
    /// (see [`TAKE_BATCH`]).
    async fn take(&self, n: usize, room: usize) -> Result<Vec<(String, Vec<u8>)>, SourceError> {
        let flat: Vec<Vec<u8>> = self
            .taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE_BATCH)
                    .arg(3)
                    .arg(&self.dead)
                    .arg(&self.taken.hash)
                    .arg(&self.counter)
                    .arg(n)
                    .arg(room),
            )
            .await
            .map_err(SourceError::broker(format!(
                "taking elements of {}",
                self.dead
            )))?;
        pairs(flat)
    }

    /// Blocks (one second at most) until an element arrives on the empty dead list, moves it
    /// to the processing list and takes it. None when nothing came, or the element was
    /// taken by someone else.
    async fn wait_for_one(
        &self,
        puller: &RedisConn,
    ) -> Result<Option<(String, Vec<u8>)>, SourceError> {
        let raw: Option<Vec<u8>> = puller
            .query(
                redis::cmd("BLMOVE")
                    .arg(&self.dead)
                    .arg(&self.processing)
                    .arg("RIGHT")
                    .arg("LEFT")
                    .arg(1),
            )
            .await
            .map_err(SourceError::broker(format!("BLMOVE from {}", self.dead)))?;
        let Some(raw) = raw else { return Ok(None) };
        // Until taken the element waits in the processing list for the next start.
        Ok(self
            .take_from(&self.processing, &raw)
            .await?
            .map(|id| (id, raw)))
    }

    /// Takes an element of `list` into the hash under its id (see [`TAKE_ONE`]).
    async fn take_from(&self, list: &str, raw: &[u8]) -> Result<Option<String>, SourceError> {
        self.taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(TAKE_ONE)
                    .arg(3)
                    .arg(list)
                    .arg(&self.taken.hash)
                    .arg(&self.counter)
                    .arg(raw),
            )
            .await
            .map_err(SourceError::broker(format!(
                "claiming an element of {list}"
            )))
    }
}

/// The dead list, read from its oldest end; an element is taken by [`TAKE_ONE`].
impl Reachable for Bridge {
    fn taken(&self) -> &Arc<Taken> {
        &self.taken
    }

    /// [`REACH_PAGE`] elements of the dead list from `at` past its oldest end (see
    /// [`REACH_READ`]).
    async fn page(&self, at: isize) -> Result<Vec<Vec<u8>>, SourceError> {
        self.taken
            .conn
            .query(
                redis::cmd("EVAL")
                    .arg(REACH_READ)
                    .arg(1)
                    .arg(&self.dead)
                    .arg(-(at + REACH_PAGE))
                    .arg(-(at + 1))
                    .arg(REACH_LARGEST)
                    .arg(REACH_BYTES),
            )
            .await
            .map_err(SourceError::broker(format!("reading {}", self.dead)))
    }

    async fn take_one(&self, raw: &[u8]) -> Result<Option<String>, SourceError> {
        self.take_from(&self.dead, raw).await
    }
}

/// A processing-list element, by its bytes' digest (elements may be large).
fn fingerprint(raw: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(raw))
}

#[cfg(test)]
mod tests {
    use super::{Element, TAKE_BATCH, pairs, read};

    /// [`TAKE_BATCH`] against a real redis-server: oldest first, at most its room of bytes,
    /// but always one element however large.
    #[tokio::test]
    async fn a_batch_take_moves_at_most_its_room_but_always_one() {
        let redis = dlq_testenv::brokers::Redis::start();
        let mut conn = redis.conn().await;
        for i in 0..4u8 {
            let _: () = redis::cmd("LPUSH")
                .arg("dead")
                .arg(vec![i; 1 << 20])
                .query_async(&mut conn)
                .await
                .expect("LPUSH");
        }
        let mut take = async |n: usize, room: usize| -> Vec<u8> {
            let flat: Vec<Vec<u8>> = redis::cmd("EVAL")
                .arg(TAKE_BATCH)
                .arg(3)
                .arg(&["dead", "dead:inflight", "dead:seq"])
                .arg(n)
                .arg(room)
                .query_async(&mut conn)
                .await
                .expect("EVAL");
            let taken = pairs(flat).expect("pairs");
            taken.iter().map(|(_, raw)| raw[0]).collect()
        };
        assert_eq!(take(32, (1 << 20) + 10).await, [0], "one fits");
        assert_eq!(take(32, 0).await, [1], "one however large");
        assert_eq!(take(1, 10 << 20).await, [2], "at most n");
        assert_eq!(take(32, 10 << 20).await, [3]);
        assert!(take(32, 10 << 20).await.is_empty());
        assert_eq!(redis.hash_len("dead:inflight").await, 4);
    }

    /// A dead element is read for the members a record takes, never whole into JSON values: an
    /// element of 4 MiB whose other member is an array of small numbers (67 MB as values) holds
    /// no more than its own size beside it as an envelope (an Invalid record of its bytes), and
    /// as a Sidekiq job, whose `args` may be that large, next to nothing (its JSON is left in the
    /// member for the body store).
    #[test]
    fn a_dead_element_is_never_read_whole_into_json_values() {
        let numbers = |head: &str| {
            let mut text = String::from(head);
            while text.len() < 4 << 20 {
                text.push_str("0,");
            }
            text.push_str("0]}");
            text.into_bytes()
        };
        let envelope = numbers(r#"{"id":"j","payload":"p","junk":["#);
        let before = dlq_testenv::alloc::thread::start_peak();
        let req = dlq_core::envelope::request_for("relayer", &envelope);
        let peak = dlq_testenv::alloc::thread::peak_above(before);
        assert_eq!(req.failure_kind, dlq_core::api::FailureKind::Invalid);
        assert!(
            peak < (envelope.len() + (1 << 20)) as isize,
            "an envelope read with {peak} bytes beside {}",
            envelope.len()
        );
        let job = numbers(r#"{"jid":"j1","class":"C","queue":"q","args":["#);
        let before = dlq_testenv::alloc::thread::start_peak();
        let req = dlq_core::sidekiq::request_for("relayer", &job);
        let peak = dlq_testenv::alloc::thread::peak_above(before);
        assert_eq!(req.job.id, "j1");
        assert!(req.payload_in_message);
        assert!(
            peak < (job.len() / 8) as isize,
            "a job read with {peak} bytes beside {}",
            job.len()
        );
        assert_eq!(dlq_core::sidekiq::job_queue(&job).as_deref(), Ok("q"));
    }

    /// An element whose payload is too large for a record is read in its own buffer: 4 MiB of
    /// an order's JSON as the payload string (escaped quotes and all) holds next to nothing
    /// beside the element, where reading it out (as before, measured in the same run) holds
    /// the payload a second time; both read the same request.
    #[test]
    fn a_large_payload_is_read_in_the_elements_own_buffer() {
        let order = r#"{\"order\":\"o-1\",\"amount\":1999,\"note\":\"caf\u00e9\"},"#;
        let payload = order.repeat((4 << 20) / order.len());
        let raw = format!(r#"{{"id":"o-1","payload":"[{payload}0]","reason":"gave up"}}"#);
        let raw = raw.into_bytes();
        let before = dlq_testenv::alloc::thread::start_peak();
        let whole = dlq_core::envelope::request_for("relayer", &raw);
        let read_out = dlq_testenv::alloc::thread::peak_above(before);
        let element = raw.clone();
        let before = dlq_testenv::alloc::thread::start_peak();
        let Element::Apart(apart) = read("relayer", element) else {
            panic!("taken apart");
        };
        let in_place = dlq_testenv::alloc::thread::peak_above(before);
        assert!(apart == whole, "the request request_for reads");
        println!(
            "a payload of {} bytes read out held {read_out} bytes beside its element, in place {in_place}",
            whole.job.payload.as_deref().map_or(0, str::len)
        );
        assert!(read_out > (3 << 20), "the baseline holds the payload again");
        assert!(
            in_place < (64 << 10),
            "read in place with {in_place} bytes beside {}",
            raw.len()
        );
        let small = br#"{"id":"s","payload":"x"}"#.to_vec();
        assert!(
            matches!(read("relayer", small), Element::Whole(_, raw) if raw == br#"{"id":"s","payload":"x"}"#)
        );
    }
}
