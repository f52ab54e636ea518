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
//!
//! Two more bounds can refuse a record, and a queue's `Full` condition names whichever holds
//! ([`Bounds`]): a ResourceQuota on [`QUOTA_RESOURCE`] in the queue's namespace, which the
//! apiserver enforces (a create refused 403 "exceeded quota", read by [`quota_refusal`]; a
//! quota's status read by [`QuotaUse::from_status`]), and the operator's own `--max-records`
//! across every queue it watches ([`CeilingUse`]; its ledger is `crate::ceiling`, the same
//! blocks as here).

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
    grant_under(in_use(status), limit, waiting, want)
}

/// [`grant`] with `used` slots in use of `limit`, wherever they are kept (a queue's status, or
/// the `--max-records` ledger of `crate::ceiling`).
pub fn grant_under(used: i64, limit: i64, waiting: i64, want: i64) -> Grant {
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

/// What a ResourceQuota names to bound a namespace's DeadLetter records.
pub const QUOTA_RESOURCE: &str = "count/deadletters.dlq.dev";

/// A ResourceQuota's bound on a namespace's DeadLetter records: from its status, or from the
/// apiserver's words when it refused a record (where it may not say the numbers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaUse {
    /// The ResourceQuota's name.
    pub name: String,
    /// Records it counts as used.
    pub used: Option<i64>,
    /// Its hard limit on records.
    pub hard: Option<i64>,
}

impl QuotaUse {
    /// From a ResourceQuota's name, scoped or not, and its `status.hard` and `status.used`
    /// (quantities as strings): None when it does not bound records, is scoped (scopes select
    /// pods; an object count quota with a scope never matches a record) or its controller has
    /// not set `status.hard` yet. Without `status.used` of records (its controller has not
    /// counted them yet) `used` is None: the apiserver refuses every record meanwhile
    /// ("status unknown for quota"), and so it is [`QuotaUse::exhausted`].
    pub fn from_status<'a>(
        name: &str,
        scoped: bool,
        hard: impl IntoIterator<Item = (&'a str, &'a str)>,
        used: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<QuotaUse> {
        if scoped {
            return None;
        }
        let hard = records_in(hard)?;
        Some(QuotaUse {
            name: name.to_string(),
            used: records_in(used),
            hard: Some(hard),
        })
    }

    /// Whether no further record fits: used has reached hard. Unknown numbers (a refusal that
    /// did not say them) count as exhausted: the apiserver said so.
    pub fn exhausted(&self) -> bool {
        match (self.used, self.hard) {
            (Some(used), Some(hard)) => used >= hard,
            _ => true,
        }
    }

    /// Records that still fit (0 when unknown or exhausted).
    pub fn room(&self) -> i64 {
        match (self.used, self.hard) {
            (Some(used), Some(hard)) => hard.saturating_sub(used).max(0),
            _ => 0,
        }
    }

    /// `ResourceQuota NAME: USED of HARD count/deadletters.dlq.dev used`, as a person reads it.
    pub fn describe(&self) -> String {
        match (self.used, self.hard) {
            (Some(used), Some(hard)) => format!(
                "ResourceQuota {}: {used} of {hard} {QUOTA_RESOURCE} used",
                self.name
            ),
            (None, Some(hard)) => format!(
                "ResourceQuota {}: {QUOTA_RESOURCE} of {hard} not counted yet by its controller, so the apiserver refuses every record",
                self.name
            ),
            _ => format!(
                "ResourceQuota {} refuses further {QUOTA_RESOURCE}",
                self.name
            ),
        }
    }
}

/// The count of [`QUOTA_RESOURCE`] in a quota's resource list.
fn records_in<'a>(list: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<i64> {
    list.into_iter()
        .find(|(k, _)| *k == QUOTA_RESOURCE)
        .and_then(|(_, v)| parse_count(v))
}

/// The tightest of a namespace's quotas on records (least room; the first on a tie): the one
/// that refuses first.
pub fn tightest(quotas: impl IntoIterator<Item = QuotaUse>) -> Option<QuotaUse> {
    quotas
        .into_iter()
        .fold(None, |best: Option<QuotaUse>, q| match best {
            Some(b) if b.room() <= q.room() => Some(b),
            _ => Some(q),
        })
}

/// The quota in the apiserver's refusal of a create, when it refused for quota (403 Forbidden):
/// `... is forbidden: exceeded quota: NAME, requested: R=1, used: R=50, limited: R=50`, with the
/// numbers of [`QUOTA_RESOURCE`] when the exceeded resources name it; or `status unknown for
/// quota: NAME, ...` before the quota's controller has counted it. None for any other refusal.
pub fn quota_refusal(code: u16, message: &str) -> Option<QuotaUse> {
    if code != 403 {
        return None;
    }
    for marker in ["exceeded quota: ", "status unknown for quota: "] {
        let Some(at) = message.find(marker) else {
            continue;
        };
        let rest = &message[at + marker.len()..];
        let name = rest.split([',', ' ']).next().unwrap_or_default().trim();
        if name.is_empty() {
            return None;
        }
        let count_in = |label: &str| {
            let from = rest.find(label)? + label.len();
            let list = &rest[from..];
            let list = list.split(", ").next().unwrap_or_default();
            list.split(',').find_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                (k.trim() == QUOTA_RESOURCE)
                    .then(|| parse_count(v.trim().trim_end_matches(':')))
                    .flatten()
            })
        };
        return Some(QuotaUse {
            name: name.to_string(),
            used: count_in("used: "),
            hard: count_in("limited: "),
        });
    }
    None
}

/// A count as a Kubernetes quantity writes it: `50`, `2k`, `1Ki`, `5e3`. None for a fraction
/// or anything else.
pub fn parse_count(text: &str) -> Option<i64> {
    let text = text.trim();
    let suffixes: [(&str, i64); 10] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("e3", 1_000),
        ("e6", 1_000_000),
    ];
    for (suffix, factor) in suffixes {
        if let Some(n) = text.strip_suffix(suffix) {
            return n.parse::<i64>().ok()?.checked_mul(factor);
        }
    }
    text.parse().ok()
}

/// The operator's `--max-records` as its ledger last said it: records held (counted, plus
/// slots granted but not yet seen) of the ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CeilingUse {
    pub held: i64,
    pub limit: i64,
}

impl CeilingUse {
    pub fn reached(&self) -> bool {
        self.held >= self.limit
    }
}

/// The bounds beside `maxParked` that a queue's `Full` condition tells.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bounds {
    /// The tightest ResourceQuota on records in the queue's namespace.
    pub quota: Option<QuotaUse>,
    /// The operator's `--max-records`, when set.
    pub ceiling: Option<CeilingUse>,
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

    #[test]
    fn a_quota_refusal_is_read_from_the_apiservers_words() {
        let exceeded = "deadletters.dlq.dev \"dead-61-f4a55f32-1\" is forbidden: exceeded quota: dead-letters, requested: count/deadletters.dlq.dev=1, used: count/deadletters.dlq.dev=50, limited: count/deadletters.dlq.dev=50";
        let q = quota_refusal(403, exceeded).expect("a quota refusal");
        assert_eq!(
            q,
            QuotaUse {
                name: "dead-letters".into(),
                used: Some(50),
                hard: Some(50)
            }
        );
        assert!(q.exhausted());
        assert_eq!(
            q.describe(),
            "ResourceQuota dead-letters: 50 of 50 count/deadletters.dlq.dev used"
        );
        // Several resources exceeded at once, ours among them.
        let several = "forbidden: exceeded quota: q2, requested: count/deadletters.dlq.dev=1,count/events=1, used: count/deadletters.dlq.dev=2k,count/events=9, limited: count/deadletters.dlq.dev=2k,count/events=9";
        let q = quota_refusal(403, several).expect("a quota refusal");
        assert_eq!((q.used, q.hard), (Some(2000), Some(2000)));
        // Before the controller counted it: refused, numbers unknown.
        let unknown = "deadletters.dlq.dev \"x\" is forbidden: status unknown for quota: fresh, resources: count/deadletters.dlq.dev";
        let q = quota_refusal(403, unknown).expect("a quota refusal");
        assert_eq!((q.name.as_str(), q.used, q.hard), ("fresh", None, None));
        assert!(q.exhausted());
        // Not a quota: RBAC, an admission policy, another code.
        let rbac = "deadletters.dlq.dev is forbidden: User \"w\" cannot create resource";
        assert_eq!(quota_refusal(403, rbac), None);
        assert_eq!(quota_refusal(422, exceeded), None);
    }

    #[test]
    fn a_quota_bounds_records_only_unscoped_and_once_counted() {
        let hard = [("pods", "10"), (QUOTA_RESOURCE, "50")];
        let used = [(QUOTA_RESOURCE, "12")];
        let q = QuotaUse::from_status("q", false, hard, used).expect("bounds records");
        assert_eq!((q.used, q.hard, q.room()), (Some(12), Some(50), 38));
        assert!(!q.exhausted());
        assert_eq!(QuotaUse::from_status("q", true, hard, used), None, "scoped");
        assert_eq!(
            QuotaUse::from_status("q", false, [("pods", "10")], []),
            None,
            "another resource"
        );
        // Not counted yet: the apiserver refuses every record until it is.
        let fresh =
            QuotaUse::from_status("q", false, [(QUOTA_RESOURCE, "5")], []).expect("bounds records");
        assert_eq!((fresh.used, fresh.exhausted()), (None, true));
        assert!(
            fresh.describe().contains("not counted yet"),
            "{}",
            fresh.describe()
        );
        let tight = tightest(
            [
                QuotaUse::from_status(
                    "wide",
                    false,
                    [(QUOTA_RESOURCE, "1k")],
                    [(QUOTA_RESOURCE, "10")],
                ),
                QuotaUse::from_status(
                    "narrow",
                    false,
                    [(QUOTA_RESOURCE, "20")],
                    [(QUOTA_RESOURCE, "15")],
                ),
            ]
            .into_iter()
            .flatten(),
        );
        assert_eq!(tight.map(|q| q.name), Some("narrow".into()));
        assert_eq!(parse_count("1Ki"), Some(1024));
        assert_eq!(parse_count("5e3"), Some(5000));
        assert_eq!(parse_count("500m"), None, "a fraction is no count");
    }

    #[test]
    fn a_grant_under_any_ledger_is_the_same_rule() {
        assert_eq!(grant_under(48, 50, 5, 5).size, 2);
        assert_eq!(grant_under(50, 50, 5, 5).size, 0);
        assert_eq!(grant_under(60, 50, 1, 1).size, 0, "over: never negative");
    }
}
