//! Parking first: while this process's sources are parking dead messages, the records
//! controller marks new records Parked one at a time instead of 32 at once.
//!
//! A parked record costs the apiserver three writes: the source's create, the operator's mark
//! (`phase: Parked` and its condition) and the `Parked` Warning Event. In a storm all three
//! compete for the same apiserver, so a source drained its broker at a third of the create
//! ceiling. Of the three only the create gets the message out of the broker (which may be
//! bounded or expiring); an unmarked record is already counted against `maxParked`, listed by
//! `kubectl dlq ls` and alerted on (readers take a record without a phase as Parked). So marks
//! yield to parking while it lasts and catch up after it; one mark at a time keeps them
//! moving through a storm that never ends. Signed decisions (redrive, drop) never wait here.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Marks allowed at once while sources park.
const MARKS_WHILE_PARKING: usize = 1;

/// Shared by the sources (which hold a [`Parking`] per park) and the records controller (which
/// takes a [`ParkingFirst::mark_turn`] before each mark).
#[derive(Clone)]
pub struct ParkingFirst {
    inner: Arc<Inner>,
}

struct Inner {
    /// Parks in flight in this process.
    parking: AtomicUsize,
    /// Woken when the last park in flight ends.
    idle: Notify,
    marks: Arc<Semaphore>,
}

impl Default for ParkingFirst {
    fn default() -> Self {
        ParkingFirst {
            inner: Arc::new(Inner {
                parking: AtomicUsize::new(0),
                idle: Notify::new(),
                marks: Arc::new(Semaphore::new(MARKS_WHILE_PARKING)),
            }),
        }
    }
}

/// One park in flight; dropping it ends it.
pub struct Parking {
    inner: Arc<Inner>,
}

impl Drop for Parking {
    fn drop(&mut self) {
        if self.inner.parking.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.inner.idle.notify_waiters();
        }
    }
}

/// A mark's turn. `Some` holds one of the few permits of a storm; `None` when nothing parks.
pub type MarkTurn = Option<OwnedSemaphorePermit>;

impl ParkingFirst {
    /// Notes one park in flight until the returned guard is dropped.
    pub fn parking(&self) -> Parking {
        self.inner.parking.fetch_add(1, Ordering::SeqCst);
        Parking {
            inner: self.inner.clone(),
        }
    }

    /// Whether some source is parking right now.
    pub fn is_parking(&self) -> bool {
        self.inner.parking.load(Ordering::SeqCst) > 0
    }

    /// Waits until a mark may go: at once when nothing parks, else for one of the few permits
    /// or for parking to end, whichever comes first. Hold the turn for the whole mark (its
    /// status write and Event).
    pub async fn mark_turn(&self) -> MarkTurn {
        loop {
            let idle = self.inner.idle.notified();
            let mut idle = std::pin::pin!(idle);
            // Registered before the check, so an end of parking between the two still wakes us.
            idle.as_mut().enable();
            if !self.is_parking() {
                return None;
            }
            tokio::select! {
                permit = self.inner.marks.clone().acquire_owned() => return permit.ok(),
                _ = idle => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    #[tokio::test]
    async fn marks_go_at_once_when_nothing_parks() {
        let first = ParkingFirst::default();
        let turns: Vec<MarkTurn> = (0..40)
            .map(|_| first.mark_turn().now_or_never())
            .map(|t| t.expect("at once"))
            .collect();
        assert!(turns.iter().all(Option::is_none), "no permit is taken");
    }

    #[tokio::test]
    async fn while_a_source_parks_marks_take_turns() {
        let first = ParkingFirst::default();
        let parking = first.parking();
        let turn = first
            .mark_turn()
            .now_or_never()
            .expect("the first mark goes");
        assert!(turn.is_some(), "it holds the permit");
        let mut second = Box::pin(first.mark_turn());
        assert!((&mut second).now_or_never().is_none(), "the second waits");
        drop(turn);
        assert!(second.await.is_some(), "and goes when the first is done");
        drop(parking);
    }

    #[tokio::test]
    async fn marks_waiting_go_together_when_parking_ends() {
        let first = ParkingFirst::default();
        let parking = first.parking();
        let held = first.mark_turn().await;
        let waiting: Vec<_> = (0..5)
            .map(|_| {
                tokio::spawn({
                    let first = first.clone();
                    async move { first.mark_turn().await.is_none() }
                })
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(
            waiting.iter().all(|w| !w.is_finished()),
            "they wait while it parks"
        );
        drop(parking);
        for w in waiting {
            assert!(w.await.expect("task"), "each goes without a permit");
        }
        drop(held);
        assert!(!first.is_parking());
    }
}
