//! Parking first: while this process's sources are busy parking dead messages (a backlog, not
//! a trickle), the records controller marks new records Parked one at a time instead of 32 at
//! once.
//!
//! A parked record costs the apiserver three writes: the source's create, the operator's mark
//! (`phase: Parked` and its condition) and the `Parked` Warning Event. In a storm all three
//! compete for the same apiserver, so a source drained its broker at a third of the create
//! ceiling. Of the three only the create gets the message out of the broker (which may be
//! bounded or expiring); an unmarked record is already counted against `maxParked`, listed by
//! `kubectl dlq ls` and alerted on (readers take a record without a phase as Parked). So marks
//! yield to busy sources and catch up after; one mark at a time keeps them
//! moving through a storm that never ends. Signed decisions (redrive, drop) never wait here.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Marks allowed at once while sources are busy.
const MARKS_WHILE_PARKING: usize = 1;

/// Parks in flight from which sources count as busy: a source draining a backlog keeps 16 or
/// 32 in flight; a steady trickle, even of hundreds a second, a few. Gating marks on any park
/// in flight would let marks fall behind a moderate, endless stream.
pub const BUSY: usize = 8;

/// Shared by the sources (which hold a [`Parking`] per park) and the records controller (which
/// takes a [`ParkingFirst::mark_turn`] before each mark).
#[derive(Clone)]
pub struct ParkingFirst {
    inner: Arc<Inner>,
}

struct Inner {
    /// Parks in flight in this process.
    parking: AtomicUsize,
    /// Woken when the parks in flight drop below [`BUSY`].
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
        if self.inner.parking.fetch_sub(1, Ordering::SeqCst) == BUSY {
            self.inner.idle.notify_waiters();
        }
    }
}

/// A mark's turn. `Some` holds one of the few permits of a storm; `None` when sources are not
/// busy.
pub type MarkTurn = Option<OwnedSemaphorePermit>;

impl ParkingFirst {
    /// Notes one park in flight until the returned guard is dropped.
    pub fn parking(&self) -> Parking {
        self.inner.parking.fetch_add(1, Ordering::SeqCst);
        Parking {
            inner: self.inner.clone(),
        }
    }

    /// Whether sources are busy parking right now ([`BUSY`] or more parks in flight).
    pub fn is_busy(&self) -> bool {
        self.inner.parking.load(Ordering::SeqCst) >= BUSY
    }

    /// Waits until a mark may go: at once unless sources are busy, else for one of the few
    /// permits or for them to be busy no more, whichever comes first. Hold the turn for the
    /// whole mark (its status write and Event).
    pub async fn mark_turn(&self) -> MarkTurn {
        loop {
            let idle = self.inner.idle.notified();
            let mut idle = std::pin::pin!(idle);
            // Registered before the check, so the sources ceasing to be busy between the two
            // still wakes us.
            idle.as_mut().enable();
            if !self.is_busy() {
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

    /// Enough parks in flight to count as busy.
    fn busy(first: &ParkingFirst) -> Vec<Parking> {
        (0..BUSY).map(|_| first.parking()).collect()
    }

    /// `n` marks asked for at once: each must go without waiting.
    fn at_once(first: &ParkingFirst, n: usize) -> Vec<MarkTurn> {
        (0..n)
            .map(|_| first.mark_turn().now_or_never().expect("at once"))
            .collect()
    }

    #[tokio::test]
    async fn marks_go_at_once_when_nothing_parks() {
        let first = ParkingFirst::default();
        assert!(
            at_once(&first, 40).iter().all(Option::is_none),
            "no permit is taken"
        );
    }

    #[tokio::test]
    async fn a_trickle_of_parks_does_not_hold_marks_back() {
        let first = ParkingFirst::default();
        let few: Vec<Parking> = (0..BUSY - 1).map(|_| first.parking()).collect();
        assert!(at_once(&first, 40).iter().all(Option::is_none));
        drop(few);
    }

    #[tokio::test]
    async fn while_sources_are_busy_marks_take_turns() {
        let first = ParkingFirst::default();
        let parking = busy(&first);
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
    async fn marks_waiting_go_together_when_sources_are_busy_no_more() {
        let first = ParkingFirst::default();
        let mut parking = busy(&first);
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
            "they wait while sources are busy"
        );
        parking.pop();
        for w in waiting {
            assert!(w.await.expect("task"), "each goes without a permit");
        }
        drop(held);
        assert!(!first.is_busy());
        drop(parking);
    }
}
