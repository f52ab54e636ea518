//! The record watch's backoff: kube's default, except that a watch the apiserver expired
//! re-lists at once.
//!
//! After every apiserver restart the record watch's resourceVersion is older than the new
//! apiserver's cache, so its first watch is answered 410 Gone ("too old resource version"):
//! the apiserver is up and only asks for a re-list. kube's default backoff treated that like
//! any failure and waited 1 to 5 s (more when restarts came in a row) before re-listing, and
//! every record decided meanwhile waited too: in `make chaos` with apiserver restarts the
//! watch was away 3 to 15 s per restart, and the periodic re-list of decided records
//! ([`super::decided`]) found up to 65 decisions at once that the watch had not brought yet
//! (issue 44). An expiry right after another one (no event between) backs off as usual, so
//! an apiserver that keeps expiring the watch is not hammered.
//!
//! The backoff itself is short ([`Pauses`]: 0.5 s doubling to 2 s, not kube's 0.8 s to 30 s):
//! a starting apiserver answers 503 ("before all known HTTP paths have been installed") for a
//! second or two, and kube's growing pauses kept the watch away up to 4 s after it served again
//! (22:48:34.2 to 38.4 in one run). One watch request every 2 s is nothing to an apiserver.

use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher;

/// The pauses after failures in a row: 0.5 s, 1 s, then 2 s; an event starts over.
#[derive(Debug, Default)]
pub struct Pauses {
    failures: u32,
}

impl Pauses {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(2);
}

impl Iterator for Pauses {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let pause = Self::FIRST
            .saturating_mul(1 << self.failures.min(8))
            .min(Self::MAX);
        self.failures = self.failures.saturating_add(1);
        Some(pause)
    }
}

impl Backoff for Pauses {
    fn reset(&mut self) {
        self.failures = 0;
    }
}

/// Whether `e` is the apiserver expiring the watch (410 Gone: re-list).
fn expired(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(status) if status.code == 410)
}

/// Applies [`backoff_unless_expired`]'s policy: the pause before the next poll after `item`.
struct Policy<B> {
    backoff: B,
    /// The last item was an expiry (the next one backs off).
    after_expiry: bool,
}

impl<B: Backoff> Policy<B> {
    fn pause_after<T>(&mut self, item: &Result<T, watcher::Error>) -> Option<Duration> {
        match item {
            Ok(_) => {
                self.backoff.reset();
                self.after_expiry = false;
                None
            }
            Err(e) if expired(e) && !self.after_expiry => {
                self.after_expiry = true;
                None
            }
            Err(e) => {
                self.after_expiry = expired(e);
                self.backoff.next()
            }
        }
    }
}

/// `events` with [`Pauses`] after an error, except a first expiry (410), which re-lists at
/// once. A stream that ends (only in tests) ends this one.
pub fn backoff_unless_expired<S, T>(events: S) -> impl Stream<Item = Result<T, watcher::Error>>
where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
{
    with_backoff(events, Pauses::default())
}

fn with_backoff<S, T, B>(events: S, backoff: B) -> impl Stream<Item = Result<T, watcher::Error>>
where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    B: Backoff,
{
    let policy = Policy {
        backoff,
        after_expiry: false,
    };
    futures::stream::unfold(
        (events.boxed(), policy, None::<Duration>),
        |(mut events, mut policy, pause)| async move {
            if let Some(pause) = pause {
                tokio::time::sleep(pause).await;
            }
            let item = events.next().await?;
            let pause = policy.pause_after(&item);
            Some((item, (events, policy, pause)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;
    use tokio::time::Instant;

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(Box::new(Status {
            code: 410,
            message: "too old resource version: 680 (773)".into(),
            ..Status::default()
        }))
    }

    fn unavailable() -> watcher::Error {
        watcher::Error::WatchError(Box::new(Status {
            code: 503,
            ..Status::default()
        }))
    }

    /// The virtual time at which each item of `items` is taken, given a fixed 2 s backoff.
    async fn taken_at(items: Vec<Result<u32, watcher::Error>>) -> Vec<u64> {
        let start = Instant::now();
        // A fixed backoff: what matters is whether it is taken, not its growth.
        struct Fixed;
        impl Iterator for Fixed {
            type Item = Duration;
            fn next(&mut self) -> Option<Duration> {
                Some(Duration::from_secs(2))
            }
        }
        impl Backoff for Fixed {
            fn reset(&mut self) {}
        }
        let stream = with_backoff(futures::stream::iter(items), Fixed);
        stream
            .map(|_| start.elapsed().as_secs())
            .collect::<Vec<_>>()
            .await
    }

    #[test]
    fn pauses_double_to_two_seconds_and_start_over_after_an_event() {
        let mut pauses = Pauses::default();
        let ms = |p: &mut Pauses| p.next().map(|d| d.as_millis());
        assert_eq!(
            [
                ms(&mut pauses),
                ms(&mut pauses),
                ms(&mut pauses),
                ms(&mut pauses)
            ],
            [Some(500), Some(1000), Some(2000), Some(2000)]
        );
        for _ in 0..100 {
            pauses.next();
        }
        assert_eq!(ms(&mut pauses), Some(2000));
        pauses.reset();
        assert_eq!(ms(&mut pauses), Some(500));
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_watch_relists_at_once() {
        // An expiry, then the re-list's events: no pause.
        assert_eq!(taken_at(vec![Err(gone()), Ok(1), Ok(2)]).await, [0, 0, 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn other_failures_back_off() {
        assert_eq!(taken_at(vec![Err(unavailable()), Ok(1)]).await, [0, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expiry_after_an_expiry_backs_off() {
        // Two in a row (nothing listed between): the second waits, and so does a failure after
        // it; an event resets it.
        let items = vec![
            Err(gone()),
            Err(gone()),
            Err(unavailable()),
            Ok(1),
            Err(gone()),
            Ok(2),
        ];
        assert_eq!(taken_at(items).await, [0, 0, 2, 4, 4, 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expiry_after_a_failure_relists_at_once() {
        // The apiserver was down (connection refused), then back with a newer cache.
        let items = vec![Err(unavailable()), Err(gone()), Ok(1)];
        assert_eq!(taken_at(items).await, [0, 2, 2]);
    }
}
