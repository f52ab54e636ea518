//! Reaching past waiting parks, for the Redis-backed sources (`super::redis`,
//! `super::sidekiq`): a park waiting for room under `maxParked` keeps its slot, so once every
//! slot holds one (the queue Full during another group's storm) a source takes nothing more,
//! and a standing replay's group behind them would stay in the broker for as long as the queue
//! is Full. While a standing replay runs on the queue and every slot is so held, [`reach`]
//! reads the broker's waiting messages from the oldest every [`REACH_EVERY`] and takes those the
//! replay passes from behind the others, which stay where they are, in their order; each one
//! read that the replay covers counts as its group seen in the broker, so the replay does not
//! complete while it waits there.
//!
//! What differs per source, where its messages wait and how one is taken by its bytes, is a
//! [`Reachable`]; the pace, the bounds and the handling are here once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::park_into::SourceError;
use super::taken::{Element, Taken, spawn_handle};

/// How often a source whose slots all hold messages waiting for room looks past them for a
/// standing replay's messages.
pub const REACH_EVERY: Duration = Duration::from_secs(1);
/// Elements read per round trip while reaching.
pub const REACH_PAGE: isize = 64;
/// Most elements one reach reads (the next goes on from there).
pub const REACH_DEPTH: isize = 4096;
/// Most bytes one reach reads: a look down a backlog of large elements stops sooner.
pub const REACH_BYTES: usize = 16 << 20;
/// Elements larger than this are never taken by a reach (a message large enough for the body
/// store is not passed through): a page holds only their facts ([`large_lua`]), so that a
/// standing replay still sees its group waiting there.
pub const REACH_LARGEST: usize = 256 << 10;

/// The Lua `large(raw, budget)`: what a page holds for an element over [`REACH_LARGEST`].
/// While the page's decode budget (bytes) lasts: a NUL, the element's size, a NUL, and the JSON
/// of its facts (`facts(job)`, each source's own, defined before); else an empty element.
macro_rules! large_lua {
    () => {
        r"
local decoded = 0
local function large(raw, budget)
  if decoded + #raw > budget then return '' end
  decoded = decoded + #raw
  local ok, job = pcall(cjson.decode, raw)
  if not ok or type(job) ~= 'table' then return '' end
  local encoded, small = pcall(cjson.encode, facts(job))
  if not encoded then return '' end
  return '\0' .. #raw .. '\0' .. small
end
"
    };
}
pub(crate) use large_lua;

/// The Lua that ends a script taking one element, `ARGV[1]`, once it is out of where it waited:
/// it goes into the inflight hash `KEYS[2]` under a fresh id (server time + the counter
/// `KEYS[3]`), which the script returns. One spelling for every source's take of one element.
macro_rules! into_inflight_lua {
    () => {
        r"
local t = redis.call('TIME')
local id = t[1] .. '.' .. t[2] .. '-' .. redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[2], id, ARGV[1])
return id
"
    };
}
pub(crate) use into_inflight_lua;

/// Where a source's dead messages wait, as a reach reads them.
pub trait Reachable: Send + Sync {
    /// The source's taken elements and how they are parked.
    fn taken(&self) -> &Arc<Taken>;

    /// Up to [`REACH_PAGE`] waiting elements from `at` past the oldest, oldest first; one the
    /// reach must leave (one this queue does not take) as an empty element, so that positions
    /// still count it, and one over [`REACH_LARGEST`] as its facts ([`large_lua`]), at most
    /// [`REACH_BYTES`] of them decoded per page.
    fn page(&self, at: isize) -> impl Future<Output = Result<Vec<Vec<u8>>, SourceError>> + Send;

    /// Moves element `raw` from where it waits into the inflight hash under a fresh id, in one
    /// script; None when it is no longer there (taken meanwhile).
    fn take_one(
        &self,
        raw: &[u8],
    ) -> impl Future<Output = Result<Option<String>, SourceError>> + Send;
}

/// Every [`REACH_EVERY`], while a standing replay runs on the queue and no permit of `slots`
/// is free (every slot holds a message waiting for room): takes the waiting elements that the
/// replay passes from behind the others. What it takes is handled as any taken element
/// (passed, or parked if its requeue fails), at most `concurrency` at once beside the slots.
pub async fn reach(
    source: &impl Reachable,
    slots: &Semaphore,
    concurrency: usize,
) -> Result<(), SourceError> {
    let reaching = Arc::new(Semaphore::new(concurrency));
    let mut from = 0;
    loop {
        tokio::time::sleep(REACH_EVERY).await;
        if slots.available_permits() > 0 || !source.taken().into.covered() {
            from = 0;
            continue;
        }
        from = reach_once(source, from, &reaching).await?;
    }
}

/// One look down the waiting elements, `from` past the oldest, [`REACH_DEPTH`] elements and
/// [`REACH_BYTES`] at most; where the next look goes on (0: from the oldest again).
async fn reach_once(
    source: &impl Reachable,
    from: isize,
    reaching: &Arc<Semaphore>,
) -> Result<isize, SourceError> {
    let taken = source.taken();
    let (mut at, mut bytes) = (from, 0);
    while at - from < REACH_DEPTH && bytes < REACH_BYTES {
        let page = source.page(at).await?;
        let read = page.len();
        let mut took = 0;
        for looked in page.into_iter().map(Looked::from) {
            bytes += looked.size();
            let raw = match looked {
                Looked::Left => continue,
                Looked::Large { facts, .. } => {
                    // Seen, never taken: it stays for a slot, and its replay waits for it.
                    if let Element::Whole(req, _) = (taken.read)(taken.into.queue(), facts) {
                        taken.into.would_pass(&req);
                    }
                    continue;
                }
                Looked::Whole(raw) => raw,
            };
            let Element::Whole(req, raw) = (taken.read)(taken.into.queue(), raw) else {
                continue;
            };
            if !taken.into.would_pass(&req) {
                continue;
            }
            let Ok(turn) = reaching.clone().try_acquire_owned() else {
                return Ok(at);
            };
            if let Some(id) = source.take_one(&raw).await? {
                took += 1;
                spawn_handle(taken, id, raw, turn);
            }
        }
        if read < REACH_PAGE as usize {
            return Ok(0);
        }
        // What was taken is out of the backlog: the next page starts that much nearer.
        at += REACH_PAGE - took;
    }
    Ok(at)
}

/// An element of a page as the reach reads it.
#[derive(Debug, PartialEq)]
enum Looked {
    /// One the queue does not take (or too large to look into now).
    Left,
    /// One over [`REACH_LARGEST`]: its size and the JSON of its facts.
    Large { size: usize, facts: Vec<u8> },
    /// One the reach may take, whole.
    Whole(Vec<u8>),
}

impl Looked {
    /// The bytes it stands for in the look's budget.
    fn size(&self) -> usize {
        match self {
            Looked::Left => 0,
            Looked::Large { size, .. } => *size,
            Looked::Whole(raw) => raw.len(),
        }
    }
}

impl From<Vec<u8>> for Looked {
    /// Reads what [`Reachable::page`] returned for one element (see [`large_lua`]).
    fn from(raw: Vec<u8>) -> Self {
        match raw.first() {
            None => Looked::Left,
            Some(0) => {
                let rest = &raw[1..];
                let Some(end) = rest.iter().position(|b| *b == 0) else {
                    return Looked::Left;
                };
                let size = std::str::from_utf8(&rest[..end])
                    .ok()
                    .and_then(|n| n.parse().ok());
                match size {
                    Some(size) => Looked::Large {
                        size,
                        facts: rest[end + 1..].to_vec(),
                    },
                    None => Looked::Left,
                }
            }
            Some(_) => Looked::Whole(raw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Looked;

    #[test]
    fn a_page_element_is_left_large_or_whole() {
        assert_eq!(Looked::from(vec![]), Looked::Left);
        assert_eq!(
            Looked::from(b"\x00300000\x00{\"id\":\"g\"}".to_vec()),
            Looked::Large {
                size: 300_000,
                facts: br#"{"id":"g"}"#.to_vec()
            }
        );
        assert_eq!(Looked::from(b"\x00junk".to_vec()), Looked::Left);
        assert_eq!(Looked::from(b"\x00x\x00{}".to_vec()), Looked::Left);
        assert_eq!(Looked::from(b"{}".to_vec()), Looked::Whole(b"{}".to_vec()));
    }
}
