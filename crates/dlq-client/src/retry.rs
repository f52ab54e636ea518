//! What the compare-and-swap loops share (the queue's slot blocks in `admission`, the
//! operator's ledger in `ceiling`): a random wait between attempts.

use std::time::Duration;

/// A random wait before attempt `attempt + 1`: up to 5 ms × 2^attempt, at most 400 ms.
pub fn jitter(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let cap = 5u64.saturating_mul(1 << attempt.min(7)).min(400);
    // RandomState is seeded per instance: enough randomness to de-synchronise processes.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    Duration::from_millis(h.finish() % (cap + 1))
}
