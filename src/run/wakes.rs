//! A queue's wakes, coalesced. Every change of a record wakes its queue, and a storm changes
//! records hundreds of times a second, its marks for seconds after its last park. kube's
//! `Config::debounce` re-arms an object's delay at each wake, so wakes closer together than
//! the delay held the queue's reconcile (its counters and failure groups) back until they
//! stopped: a 10,000-record storm's groups were exact 12 s after its last park (#57). Here an
//! object's first wake sets when it is passed on, [`COALESCE`] later, and the wakes until then
//! fold into it.

use std::hash::Hash;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::reflector::{Lookup, ObjectRef};
use kube::runtime::scheduler::{ScheduleRequest, scheduler};

/// How long a queue's first wake waits for the wakes that follow it.
pub const COALESCE: Duration = Duration::from_millis(500);

/// `wakes`, each object passed on `after` its first wake since it was last passed on, however
/// many wakes follow.
pub fn coalesced<K>(
    wakes: impl Stream<Item = ObjectRef<K>>,
    after: Duration,
) -> impl Stream<Item = ObjectRef<K>>
where
    K: Lookup,
    K::DynamicType: Eq + Hash + Clone,
{
    // kube's scheduler without a debounce keeps an object's earliest time: a later wake never
    // moves it.
    scheduler(wakes.map(move |message| ScheduleRequest {
        message,
        run_at: tokio::time::Instant::now() + after,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::DeadLetterQueue;
    use tokio::time::Instant;

    fn queue(name: &str) -> ObjectRef<DeadLetterQueue> {
        ObjectRef::new(name).within("payments")
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_woken_without_pause_is_passed_on_every_period_not_held_back() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut out = Box::pin(coalesced(rx, COALESCE));
        let start = Instant::now();
        // A wake every 100 ms for 3 s, as a storm's record changes come.
        tokio::spawn(async move {
            for _ in 0..30 {
                let _ = tx.unbounded_send(queue("relayer"));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            std::future::pending::<()>().await
        });
        let mut passed = Vec::new();
        while let Ok(Some(q)) =
            tokio::time::timeout_at(start + Duration::from_secs(2), out.next()).await
        {
            assert_eq!(q, queue("relayer"));
            passed.push(start.elapsed());
        }
        assert_eq!(
            passed.first().copied(),
            Some(COALESCE),
            "the first wake waits {COALESCE:?}, not for the wakes to stop"
        );
        assert!(passed.len() >= 3, "passed on at {passed:?}");
        for pair in passed.windows(2) {
            assert!(
                pair[1] - pair[0] <= COALESCE + Duration::from_millis(100),
                "{passed:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_queue_is_coalesced_on_its_own() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut out = Box::pin(coalesced(rx, COALESCE));
        for name in ["a", "b", "a", "b", "a"] {
            let _ = tx.unbounded_send(queue(name));
        }
        let mut passed = Vec::new();
        while let Ok(Some(q)) = tokio::time::timeout(COALESCE * 3, out.next()).await {
            passed.push(q.name);
        }
        passed.sort();
        assert_eq!(passed, ["a", "b"]);
    }
}
