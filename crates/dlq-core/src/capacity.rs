//! `maxParked` as a hard limit, for parkers in any number of processes.
//!
//! The serialisation point is the DeadLetterQueue's status: a parker takes slots by a
//! compare-and-swap (a merge patch carrying the status's resourceVersion) that adds a **block**
//! of slots to `status.blocks`, and only creates records in it once that write won. Each
//! record of a block carries the block's id (annotation `dlq.dev/slot-block`). The operator
//! counts Parked records from its watch and, in the same status write, records how many of
//! each block's records that snapshot holds (`counted`). So at every moment
//!
//! ```text
//! Parked records in etcd  <=  status.parked + sum(size - counted)  <=  maxParked
//! ```
//!
//! because a record exists only in a block written before it, a block's uncounted slots cover
//! its records the snapshot does not hold yet, and `counted` only moves together with a count
//! that includes those records (both from one snapshot of the watch, a prefix of the
//! apiserver's history). A block is removed once all its slots are counted, or once it is too
//! old to be used ([`BLOCK_TTL_SECS`]): a parker spends a block's slots only within
//! [`BLOCK_USE_SECS`] of asking for it and creates within [`CREATE_WITHIN_SECS`] of taking a
//! slot.
//!
//! Blocks are sized by demand: the parkings waiting in a process when it asks (one for a single
//! `kubectl dlq park`), doubled while a storm keeps using them up, at most [`MAX_BLOCK`], never
//! more than what is free. Near the limit a block is exactly the parkings waiting, so the limit
//! is reached exactly; slots a process took but did not use stay counted until the block
//! expires (the safe side).
//!
//! Without a running operator nothing is counted: blocks pile up and parking stops at
//! `maxParked` (the safe side).

use std::collections::BTreeMap;

use crate::queue::{DeadLetterQueueStatus, SlotBlock};

/// How long a block the operator has not seen every record of is kept.
pub const BLOCK_TTL_SECS: i64 = 300;
/// A parker creates a record at most this long after taking its slot; later it asks again.
pub const CREATE_WITHIN_SECS: i64 = 60;
/// A parker takes slots from a block at most this long after asking for it.
pub const BLOCK_USE_SECS: i64 = 10;
/// The largest block one compare-and-swap grants.
pub const MAX_BLOCK: i64 = 256;

/// Slots in use: the operator's last count plus the block slots granted since.
pub fn in_use(status: Option<&DeadLetterQueueStatus>) -> i64 {
    status.map_or(0, |s| {
        s.parked
            .saturating_add(s.blocks.values().map(uncounted).sum())
    })
}

/// A block's slots whose records the operator has not counted yet.
pub fn uncounted(block: &SlotBlock) -> i64 {
    block.size.saturating_sub(block.counted).max(0)
}

/// What one compare-and-swap grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Slots in the new block (0: the queue is full).
    pub size: i64,
    /// Slots in use before it.
    pub in_use: i64,
    /// The queue's `maxParked`.
    pub limit: i64,
}

/// A block of `want` slots for `waiting` parkings: at most [`MAX_BLOCK`], at most what is
/// free under `limit`, and the slots beyond those waiting (taken ahead for a storm) at most
/// half of what is free, so that near the limit a block is what is needed now.
pub fn grant(status: Option<&DeadLetterQueueStatus>, limit: i64, waiting: i64, want: i64) -> Grant {
    let used = in_use(status);
    let free = limit.saturating_sub(used).max(0);
    let ahead_cap = waiting.max(free / 2);
    Grant {
        size: want.min(ahead_cap).clamp(0, MAX_BLOCK).min(free),
        in_use: used,
        limit,
    }
}

/// The size of a process's next block: the parkings waiting now, or twice the last block when
/// it was used up within a second or two (a storm), up to [`MAX_BLOCK`].
pub fn next_block_size(waiting: usize, last: Option<(i64, bool)>) -> i64 {
    let waiting = i64::try_from(waiting).unwrap_or(MAX_BLOCK).max(1);
    let ramp = match last {
        Some((size, used_up_quickly)) if used_up_quickly => size.saturating_mul(2),
        _ => 1,
    };
    waiting.max(ramp).min(MAX_BLOCK)
}

/// What the operator writes for one block: its new `counted`, or None to remove it.
pub type BlockReckoning = Option<i64>;

/// Everything one operator status write reckons, from the snapshot it counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reckoning {
    /// Blocks to update or remove.
    pub blocks: BTreeMap<String, BlockReckoning>,
}

impl Reckoning {
    /// Slots still in use after this reckoning, besides the counted records.
    pub fn left(&self, status: Option<&DeadLetterQueueStatus>) -> i64 {
        let Some(s) = status else { return 0 };
        s.blocks
            .iter()
            .map(|(id, b)| match self.blocks.get(id) {
                Some(None) => 0,
                Some(Some(counted)) => uncounted(&SlotBlock {
                    counted: *counted,
                    ..*b
                }),
                None => uncounted(b),
            })
            .sum()
    }
}

/// The operator's changes to `blocks`, given how many records of each block the snapshot it
/// counted holds (`seen`, any phase). A block is removed when every slot is seen or when it is
/// older than [`BLOCK_TTL_SECS`]; otherwise its `counted` grows to what is seen (never
/// shrinks: a record seen once was counted, even if retention deleted it since).
pub fn reckon_blocks(
    blocks: &BTreeMap<String, SlotBlock>,
    seen: impl Fn(&str) -> i64,
    now: i64,
) -> BTreeMap<String, BlockReckoning> {
    let mut out = BTreeMap::new();
    for (id, block) in blocks {
        let seen = seen(id).max(block.counted);
        if seen >= block.size || now.saturating_sub(block.at) > BLOCK_TTL_SECS {
            out.insert(id.clone(), None);
        } else if seen > block.counted {
            out.insert(id.clone(), Some(seen));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(parked: i64) -> DeadLetterQueueStatus {
        DeadLetterQueueStatus {
            parked,
            ..Default::default()
        }
    }

    fn block(size: i64, at: i64, counted: i64) -> SlotBlock {
        SlotBlock { size, at, counted }
    }

    #[test]
    fn in_use_counts_parked_and_uncounted_block_slots() {
        let mut s = status(3);
        s.blocks.insert("p-1".into(), block(10, 100, 4));
        // A block the operator counted past its size (a retry) takes nothing.
        s.blocks.insert("p-2".into(), block(2, 100, 3));
        assert_eq!(in_use(Some(&s)), 3 + 6);
    }

    #[test]
    fn a_grant_is_what_is_wanted_up_to_what_is_free() {
        let mut s = status(4);
        s.blocks.insert("p-1".into(), block(2, 100, 0));
        assert_eq!(
            grant(Some(&s), 10, 3, 3),
            Grant {
                size: 3,
                in_use: 6,
                limit: 10
            }
        );
        assert_eq!(grant(Some(&s), 10, 9, 9).size, 4);
        assert_eq!(grant(Some(&s), 6, 1, 1).size, 0);
        assert_eq!(grant(None, 1000, 500, 500).size, MAX_BLOCK);
        // An over-full queue (maxParked lowered) grants nothing, never a negative block.
        assert_eq!(grant(Some(&s), 2, 1, 1).size, 0);
        // Slots ahead of demand: at most half of what is free.
        assert_eq!(grant(None, 1000, 1, 256).size, 256);
        assert_eq!(grant(None, 100, 1, 256).size, 50);
        assert_eq!(grant(Some(&s), 10, 1, 64).size, 2);
    }

    #[test]
    fn blocks_grow_only_while_a_storm_uses_them_up() {
        assert_eq!(next_block_size(1, None), 1);
        assert_eq!(next_block_size(5, None), 5);
        assert_eq!(next_block_size(1, Some((4, true))), 8);
        assert_eq!(next_block_size(1, Some((4, false))), 1);
        assert_eq!(next_block_size(1, Some((MAX_BLOCK, true))), MAX_BLOCK);
        assert_eq!(next_block_size(500, None), MAX_BLOCK);
    }

    #[test]
    fn blocks_are_reckoned_when_every_slot_is_seen_or_they_expire() {
        let blocks: BTreeMap<String, SlotBlock> = [
            ("full", block(3, 100, 1)),
            ("part", block(5, 100, 1)),
            ("same", block(5, 100, 2)),
            ("old", block(5, 10, 0)),
            ("shrunk", block(5, 100, 4)),
        ]
        .into_iter()
        .map(|(n, b)| (n.to_string(), b))
        .collect();
        let seen = |id: &str| match id {
            "full" => 3,
            "part" => 2,
            "same" => 2,
            // Retention deleted some: counted never goes back.
            "shrunk" => 1,
            _ => 0,
        };
        let out = reckon_blocks(&blocks, seen, 400);
        let want: BTreeMap<String, BlockReckoning> =
            [("full", None), ("part", Some(2)), ("old", None)]
                .into_iter()
                .map(|(n, b)| (n.to_string(), b))
                .collect();
        assert_eq!(out, want);
    }
}
