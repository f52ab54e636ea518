//! The sweep: deletes the objects of a queue's body store that no live record references and
//! that are older than `spec.bodies.orphansAfter` (default 1 h), without finalizers. An object
//! outlives its record (retention deleted it, or a human deleted a resolved one) by at most
//! one sweep period plus that age; an upload whose record was never created (a crash between
//! the two) goes the same way. The leader runs it (`crate::run::bodies`), after the record
//! index's first list.

use std::collections::HashSet;
use std::time::Duration;

use super::{BodyError, BodyStore};

/// How often each store is swept by default (`--body-sweep-seconds`).
pub const SWEEP_EVERY: Duration = Duration::from_secs(300);

/// One sweep of a store: deletes what `dlq_core::body::sweep` picks; how many. `referenced`
/// reads the digests every live record names (of every queue, whatever place it spells), after
/// the store was listed: an object uploaded after the list cannot be taken, and one whose record
/// appears meanwhile is young. The parks in progress are every store's of this process. Without
/// those digests (None) nothing is deleted.
pub async fn sweep<F>(store: &BodyStore, referenced: F) -> Result<usize, BodyError>
where
    F: FnOnce() -> Option<Vec<Box<str>>>,
{
    let stored = store.list().await?;
    let Some(named) = referenced() else {
        tracing::warn!(store = ?store, "the record index cannot be read; nothing swept");
        return Ok(0);
    };
    let pending = store.pending();
    let referenced: HashSet<&str> = named
        .iter()
        .map(|d| &**d)
        .chain(pending.iter().map(String::as_str))
        .collect();
    let spec = store.spec();
    let doomed = dlq_core::body::sweep(
        &spec.prefix(),
        &stored,
        &referenced,
        spec.orphans_after_secs(),
    );
    for key in &doomed {
        store.delete(key).await?;
    }
    Ok(doomed.len())
}
