//! The operator's `--max-records`: a ceiling on the records it keeps across every queue it
//! watches, as hard as `maxParked` and by the same means (`crate::capacity`), kept in one
//! ConfigMap in the operator's namespace (the **ledger**, [`ledger_name`]) instead of a queue's
//! status.
//!
//! Before a parker of the operator takes a block of slots in a queue, it takes the same block
//! (the same id, which its records carry in `dlq.dev/slot-block`) in the ledger, by a
//! compare-and-swap of the ledger's resourceVersion; a queue that grants fewer shrinks it. The
//! operator's leader counts every record it watches, any phase, and in one write sets
//! [`RECORDS`] and each block's `counted` from that one snapshot ([`reckon`]). So, as for a
//! queue,
//!
//! ```text
//! records in etcd  <=  records + sum(size - counted)  <=  --max-records
//! ```
//!
//! for the records of the operator's own parkings (its sources and its park endpoint). A
//! program that parks with its own credentials (`dlq_client::park`, `kubectl dlq park`) does
//! not know the ceiling: its records are counted and take room, but are not refused by it
//! (`maxParked` and a ResourceQuota bound those).
//!
//! A ConfigMap holds only strings, and a merge patch replaces a key's value whole, so each
//! block is three keys (`block.<id>.size`, `.at`, `.counted`), written apart as the queue's
//! status fields are: a parker shrinking a block and the leader counting it never undo each
//! other. Before the leader's first count the ledger has no [`RECORDS`] and nothing is granted.

use std::collections::BTreeMap;

use crate::capacity::{self, BlockReckoning};
use crate::queue::SlotBlock;

/// The ledger's key holding the records the leader counted.
pub const RECORDS: &str = "records";
/// The ledger's key holding the ceiling it is kept for (for people; parkers use their own).
pub const LIMIT: &str = "limit";
/// Prefix of a block's keys.
const BLOCK: &str = "block.";

/// The ledger of an operator whose Lease is `lease_name` (one ledger per release).
pub fn ledger_name(lease_name: &str) -> String {
    format!("{lease_name}-records")
}

/// A ledger as read from its ConfigMap's data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Records counted by the leader; None before its first count.
    pub records: Option<i64>,
    /// Blocks of slots granted, by id.
    pub blocks: BTreeMap<String, SlotBlock>,
}

impl Ledger {
    /// The ledger in `data`; keys it does not know are ignored, a block's missing fields are 0
    /// (a block without `at` is expired and removed at the next count).
    pub fn read<'a>(data: impl IntoIterator<Item = (&'a String, &'a String)>) -> Ledger {
        let mut ledger = Ledger::default();
        for (key, value) in data {
            if key == RECORDS {
                ledger.records = value.trim().parse().ok();
                continue;
            }
            let Some((id, field)) = key
                .strip_prefix(BLOCK)
                .and_then(|rest| rest.rsplit_once('.'))
            else {
                continue;
            };
            let n = value.trim().parse().unwrap_or(0);
            let block = ledger.blocks.entry(id.to_string()).or_default();
            match field {
                "size" => block.size = n,
                "at" => block.at = n,
                "counted" => block.counted = n,
                _ => {}
            }
        }
        ledger
    }

    /// Records held: counted, plus block slots whose records are not counted yet. None before
    /// the leader's first count.
    pub fn held(&self) -> Option<i64> {
        let counted = self.records?;
        Some(
            counted.saturating_add(
                self.blocks
                    .values()
                    .map(capacity::uncounted)
                    .fold(0i64, i64::saturating_add),
            ),
        )
    }
}

/// A ledger write: key → value, None to remove the key (a merge patch of `data`).
pub type Write = BTreeMap<String, Option<String>>;

fn key(id: &str, field: &str) -> String {
    format!("{BLOCK}{id}.{field}")
}

/// A new block `id` of `size` slots granted at `at` (Unix seconds).
pub fn grant_write(id: &str, size: i64, at: i64) -> Write {
    [
        (key(id, "size"), Some(size.to_string())),
        (key(id, "at"), Some(at.to_string())),
        (key(id, "counted"), Some("0".to_string())),
    ]
    .into_iter()
    .collect()
}

/// Block `id` shrunk to `size` slots (those taken): only its size, so a count written
/// meanwhile stays.
pub fn shrink_write(id: &str, size: i64) -> Write {
    [(key(id, "size"), Some(size.to_string()))]
        .into_iter()
        .collect()
}

/// The leader's write from one snapshot of every record it watches: `records` of them, `seen`
/// of block `id`'s. Blocks are reckoned as a queue's are (`capacity::reckon_blocks`: removed
/// once every slot is seen or after `capacity::BLOCK_TTL_SECS`, else `counted` grows); `limit` is
/// noted for people. Empty when nothing changes.
pub fn reckon(
    ledger: &Ledger,
    records: i64,
    limit: i64,
    seen: impl Fn(&str) -> i64,
    now: i64,
) -> Write {
    let mut write = Write::new();
    for (id, change) in capacity::reckon_blocks(&ledger.blocks, seen, now) {
        let change: BlockReckoning = change;
        match change {
            None => {
                for field in ["size", "at", "counted"] {
                    write.insert(key(&id, field), None);
                }
            }
            Some(counted) => {
                write.insert(key(&id, "counted"), Some(counted.to_string()));
            }
        }
    }
    if ledger.records != Some(records) {
        write.insert(RECORDS.to_string(), Some(records.to_string()));
    }
    write
        .entry(LIMIT.to_string())
        .or_insert_with(|| Some(limit.to_string()));
    write
}

/// Whether `write` (from [`reckon`]) changes the ledger's current `data`.
pub fn changes<'a>(
    write: &Write,
    data: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> bool {
    let data: BTreeMap<&String, &String> = data.into_iter().collect();
    write
        .iter()
        .any(|(k, v)| data.get(k).map(|s| s.as_str()) != v.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::BLOCK_TTL_SECS;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_ledger_holds_counted_records_and_uncounted_slots() {
        let d = data(&[
            ("records", "40"),
            ("limit", "50"),
            ("block.p-1.size", "8"),
            ("block.p-1.at", "100"),
            ("block.p-1.counted", "3"),
            ("block.p-2.size", "2"),
            ("stray", "x"),
        ]);
        let ledger = Ledger::read(&d);
        assert_eq!(ledger.records, Some(40));
        assert_eq!(ledger.held(), Some(40 + 5 + 2));
        assert_eq!(ledger.blocks["p-2"].at, 0, "a dangling size: expired");
        assert_eq!(Ledger::read(&data(&[])).held(), None, "not counted yet");
        assert_eq!(
            capacity::grant_under(ledger.held().unwrap_or(0), 50, 5, 5).size,
            3,
            "the ceiling grants what is left of it"
        );
    }

    #[test]
    fn a_count_reckons_blocks_and_records_in_one_write() {
        let d = data(&[
            ("records", "10"),
            ("limit", "50"),
            ("block.done.size", "3"),
            ("block.done.at", "100"),
            ("block.done.counted", "0"),
            ("block.part.size", "5"),
            ("block.part.at", "100"),
            ("block.part.counted", "1"),
            ("block.old.size", "5"),
            ("block.old.at", "1"),
            ("block.old.counted", "0"),
        ]);
        let ledger = Ledger::read(&d);
        let seen = |id: &str| match id {
            "done" => 3,
            "part" => 2,
            _ => 0,
        };
        let w = reckon(&ledger, 13, 50, seen, 400);
        let want: Write = [
            ("block.done.size", None),
            ("block.done.at", None),
            ("block.done.counted", None),
            ("block.old.size", None),
            ("block.old.at", None),
            ("block.old.counted", None),
            ("block.part.counted", Some("2")),
            ("records", Some("13")),
            ("limit", Some("50")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
        .collect();
        assert_eq!(w, want);
        assert!(changes(&w, &d));
        // Nothing new: only the limit, already noted.
        let settled = data(&[("records", "13"), ("limit", "50")]);
        let w = reckon(&Ledger::read(&settled), 13, 50, |_| 0, 300);
        assert!(!changes(&w, &settled));
        const { assert!(400 - 1 > BLOCK_TTL_SECS, "the old block is past its TTL") };
    }

    #[test]
    fn a_grant_and_a_shrink_touch_only_their_keys() {
        let g = grant_write("p-7", 16, 123);
        assert_eq!(g.len(), 3);
        assert_eq!(g["block.p-7.size"].as_deref(), Some("16"));
        let s = shrink_write("p-7", 4);
        assert_eq!(s.keys().collect::<Vec<_>>(), ["block.p-7.size"]);
        assert_eq!(
            ledger_name("deadletter-operator"),
            "deadletter-operator-records"
        );
    }
}
