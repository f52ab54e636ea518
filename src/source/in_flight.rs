//! One park at a time per dead message in this process. A message can be in hand twice: a
//! broker that lost a consumer's channel (RabbitMQ restarting) delivers it again, flagged
//! redelivered, while the task holding the first copy is still parking it; a Redis sweep may
//! meet an element a failed run's task is still parking. Were the copies parked side by side,
//! the first copy (not flagged as a re-read) could come second, find the record the other
//! copy made already resolved by a human, and park the same death as a new cycle. Taking
//! turns, whoever waited parks as a re-read and finds the record by the message's identity.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::OwnedMutexGuard;

use dlq_client::park::ParkRequest;

type Turns = HashMap<String, Arc<tokio::sync::Mutex<()>>>;

/// Parks in flight in this process, by source message identity.
#[derive(Clone, Default)]
pub struct InFlight {
    turns: Arc<Mutex<Turns>>,
}

/// This park's turn on its message; the next copy's park starts when it is dropped.
pub struct Turn {
    guard: Option<OwnedMutexGuard<()>>,
    message: String,
    turns: Arc<Mutex<Turns>>,
}

impl InFlight {
    /// Waits for `req`'s turn on its message (at once when no other copy is being parked);
    /// a request that had to wait is marked as a re-read ([`ParkRequest::retrying`]). None
    /// for a request without a message identity (nothing to match copies by).
    pub async fn turn(&self, req: &mut ParkRequest) -> Option<Turn> {
        let message = req.message.clone()?;
        let lock = lock(&self.turns)
            .entry(message.clone())
            .or_default()
            .clone();
        let guard = match lock.clone().try_lock_owned() {
            Ok(guard) => guard,
            Err(_) => {
                req.retrying();
                lock.lock_owned().await
            }
        };
        Some(Turn {
            guard: Some(guard),
            message,
            turns: self.turns.clone(),
        })
    }

    /// Messages with a park in flight or waiting (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.turns).len()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut turns = lock(&self.turns);
        // Only the map holds it: no copy is parking or waiting.
        if turns
            .get(&self.message)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            turns.remove(&self.message);
        }
    }
}

fn lock(turns: &Mutex<Turns>) -> MutexGuard<'_, Turns> {
    // A panic while holding it leaves a plain map behind; keep using it.
    turns.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dlq_core::api::Job;

    use super::*;

    fn copy(redelivered: bool) -> ParkRequest {
        let job = Job {
            id: "a-93".into(),
            payload: Some("{}".into()),
            ..Job::default()
        };
        let mut req = ParkRequest::new("orders", job).with_message("amqp:1f2e");
        req.redelivered = redelivered;
        req
    }

    /// RabbitMQ restarted while the first copy was being parked: the redelivered copy waits
    /// for it, and the first copy, had it come second, would park as a re-read.
    #[tokio::test]
    async fn copies_of_one_message_take_turns_and_the_second_parks_as_a_re_read() {
        let in_flight = InFlight::default();
        let mut first = copy(false);
        let turn = in_flight.turn(&mut first).await.expect("a turn");
        assert!(!first.redelivered, "the only copy keeps its flag");

        let mut second = copy(false);
        let waiting = {
            let in_flight = in_flight.clone();
            tokio::spawn(async move {
                let turn = in_flight.turn(&mut second).await;
                (second, turn.is_some())
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "the second copy waits its turn");
        drop(turn);
        let (second, had_turn) = waiting.await.expect("second copy");
        assert!(had_turn);
        assert!(second.redelivered, "a copy that waited parks as a re-read");
        assert_eq!(
            in_flight.len(),
            0,
            "nothing is remembered once both are done"
        );
    }

    #[tokio::test]
    async fn other_messages_and_anonymous_requests_never_wait() {
        let in_flight = InFlight::default();
        let mut a = copy(false);
        let _a = in_flight.turn(&mut a).await;
        let mut b = copy(false).with_message("amqp:other");
        b.redelivered = false;
        let _b = in_flight.turn(&mut b).await.expect("its own turn");
        assert!(!b.redelivered);
        let mut anonymous = copy(false);
        anonymous.message = None;
        assert!(in_flight.turn(&mut anonymous).await.is_none());
    }
}
