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
//! yield to busy sources and catch up after; one mark at a time, at most one every
//! [`MARK_EVERY`], keeps them moving through a storm that never ends (a storm ends at the
//! queue's `maxParked` anyway, and then marks go at full concurrency). Signed decisions
//! (redrive, drop) never wait here.
//!
//! The pace comes from a profile of the bench's storm: one mark at a time still made about
//! 40 marks a second, each a status patch, a Warning Event and their watch events, about a
//! tenth of the apiserver's CPU per parked record. And sources count as busy until they have
//! been below [`BUSY`] for [`QUIET`]: on a starved machine a storm's parks in flight dip for a
//! moment now and then (many answers arriving at once before the source takes more), and
//! every dip used to release all the waiting marks at once, 64 of them in a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Marks allowed at once while sources are busy.
const MARKS_WHILE_PARKING: usize = 1;

/// While sources are busy, a mark starts at most this often.
pub const MARK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// How long sources stay busy after their parks in flight fell below [`BUSY`].
pub const QUIET: std::time::Duration = std::time::Duration::from_millis(500);

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
    /// Off (the bench's A/B), marks never wait.
    enabled: bool,
    /// Parks in flight in this process.
    parking: AtomicUsize,
    /// Woken when the parks in flight drop below [`BUSY`].
    idle: Notify,
    marks: Arc<Semaphore>,
    /// When the next mark may start while sources are busy.
    next_mark: std::sync::Mutex<tokio::time::Instant>,
    /// When the parks in flight last fell below [`BUSY`].
    quiet_since: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Default for ParkingFirst {
    fn default() -> Self {
        ParkingFirst::new(true)
    }
}

impl ParkingFirst {
    /// Marks yield to busy sources when `enabled`; otherwise they never wait.
    pub fn new(enabled: bool) -> Self {
        ParkingFirst {
            inner: Arc::new(Inner {
                enabled,
                parking: AtomicUsize::new(0),
                idle: Notify::new(),
                marks: Arc::new(Semaphore::new(MARKS_WHILE_PARKING)),
                next_mark: std::sync::Mutex::new(tokio::time::Instant::now()),
                quiet_since: std::sync::Mutex::new(None),
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
            *lock(&self.inner.quiet_since) = Some(tokio::time::Instant::now());
            self.inner.idle.notify_waiters();
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding it leaves a plain value behind; keep using it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether marks must wait for sources.
enum Busy {
    /// Parks in flight are [`BUSY`] or more: until woken by them falling below.
    Parking,
    /// Below [`BUSY`] since less than [`QUIET`]: until this moment.
    Until(tokio::time::Instant),
    No,
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
        self.inner.enabled && self.inner.parking.load(Ordering::SeqCst) >= BUSY
    }

    fn busy(&self) -> Busy {
        if !self.inner.enabled {
            return Busy::No;
        }
        if self.is_busy() {
            return Busy::Parking;
        }
        match *lock(&self.inner.quiet_since) {
            Some(since) if since.elapsed() < QUIET => Busy::Until(since + QUIET),
            _ => Busy::No,
        }
    }

    /// Waits until a mark may go: at once unless sources are busy, else for one of the few
    /// permits and its start at the storm's pace ([`MARK_EVERY`]), or for the sources to be
    /// busy no more, whichever comes first. Hold the turn for the whole mark (its status
    /// write and Event).
    pub async fn mark_turn(&self) -> MarkTurn {
        loop {
            let idle = self.inner.idle.notified();
            let mut idle = std::pin::pin!(idle);
            // Registered before the check, so the sources ceasing to be busy between the two
            // still wakes us.
            idle.as_mut().enable();
            let until = match self.busy() {
                Busy::No => return None,
                Busy::Parking => None,
                Busy::Until(at) => Some(at),
            };
            let quiet = async {
                match until {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let paced = async {
                let permit = self.inner.marks.clone().acquire_owned().await.ok()?;
                let at = *lock(&self.inner.next_mark);
                if at > tokio::time::Instant::now() {
                    tokio::time::sleep_until(at).await;
                }
                *lock(&self.inner.next_mark) = tokio::time::Instant::now() + MARK_EVERY;
                Some(permit)
            };
            tokio::select! {
                turn = paced => return turn,
                _ = idle => {}
                _ = quiet => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
    async fn switched_off_marks_never_wait() {
        let first = ParkingFirst::new(false);
        let parking = busy(&first);
        assert!(!first.is_busy());
        assert!(at_once(&first, 40).iter().all(Option::is_none));
        drop(parking);
        assert!(at_once(&first, 1).iter().all(Option::is_none), "nor after");
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

    #[tokio::test(start_paused = true)]
    async fn while_sources_are_busy_marks_start_at_most_every_mark_every() {
        let first = ParkingFirst::default();
        let parking = busy(&first);
        let start = tokio::time::Instant::now();
        let mut started = Vec::new();
        for _ in 0..4 {
            let turn = first.mark_turn().await;
            assert!(turn.is_some());
            started.push(start.elapsed());
        }
        assert_eq!(
            started,
            [0, 1, 2, 3].map(|i| MARK_EVERY * i),
            "one mark per MARK_EVERY"
        );
        drop(parking);
        tokio::time::sleep(QUIET).await;
        let before = tokio::time::Instant::now();
        assert!(first.mark_turn().await.is_none(), "no pace once not busy");
        assert_eq!(before.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dip_in_parks_does_not_release_the_waiting_marks() {
        let first = ParkingFirst::default();
        let mut parking = busy(&first);
        let held = first.mark_turn().await;
        let waiting = tokio::spawn({
            let first = first.clone();
            async move {
                let start = tokio::time::Instant::now();
                let turn = first.mark_turn().await;
                (turn.is_none(), start.elapsed())
            }
        });
        // A dip below BUSY for a moment, then busy again.
        tokio::time::sleep(Duration::from_millis(10)).await;
        parking.pop();
        tokio::time::sleep(QUIET / 2).await;
        parking.push(first.parking());
        tokio::time::sleep(QUIET).await;
        assert!(!waiting.is_finished(), "the dip did not release it");
        // Sources stop for good: after QUIET the mark goes, without a permit.
        drop(parking);
        let (free, waited) = waiting.await.expect("task");
        assert!(free, "it goes without a permit");
        assert!(waited >= QUIET * 2 + QUIET / 2, "waited {waited:?}");
        drop(held);
    }

    #[tokio::test(start_paused = true)]
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
