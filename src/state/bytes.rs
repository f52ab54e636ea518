//! A byte budget: how many bytes of dead messages a part of the operator holds at once (a
//! source taking from Redis or a Sidekiq dead set, the redrives of stored bodies). Each holds
//! its size of it while it works; one larger than the whole budget holds all of it, so it runs
//! alone, and nothing waits forever.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget was closed (it never is while its owner lives).
#[derive(Debug, thiserror::Error)]
#[error("the byte budget is closed")]
pub struct Closed;

/// Bytes of a budget of `total`, held by permits.
pub struct ByteBudget {
    bytes: Arc<Semaphore>,
    total: u32,
}

impl ByteBudget {
    pub fn new(total: u32) -> Self {
        ByteBudget {
            bytes: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// Waits until some of the budget is free, then says how much (what a take may move).
    pub async fn free(&self) -> Result<usize, Closed> {
        if self.bytes.available_permits() == 0 {
            drop(self.bytes.acquire().await.map_err(|_| Closed)?);
        }
        Ok(self.bytes.available_permits())
    }

    /// Holds `len` bytes of the budget (all of it for a larger one, at least one byte) until
    /// the permit is dropped, waiting while others hold them.
    pub async fn hold(&self, len: u64) -> Result<OwnedSemaphorePermit, Closed> {
        let bytes = u32::try_from(len).unwrap_or(u32::MAX).clamp(1, self.total);
        self.bytes
            .clone()
            .acquire_many_owned(bytes)
            .await
            .map_err(|_| Closed)
    }
}

#[cfg(test)]
mod tests {
    use super::ByteBudget;
    use futures::FutureExt;

    /// Holders keep their bytes until dropped; a larger one holds the whole budget, so it waits
    /// for the others and the next waits for it.
    #[tokio::test]
    async fn the_byte_budget_holds_what_elements_take_and_a_large_one_alone() {
        let all = 32 << 20;
        let budget = ByteBudget::new(all as u32);
        assert_eq!(budget.free().await.expect("free"), all);
        let small = budget.hold(10 << 20).await.expect("hold");
        assert_eq!(budget.free().await.expect("free"), all - (10 << 20));
        let mut large = Box::pin(budget.hold(100 << 20));
        assert!(
            (&mut large).now_or_never().is_none(),
            "waits for the small one"
        );
        drop(small);
        let large = large.await.expect("the whole budget");
        assert!(
            budget.free().now_or_never().is_none(),
            "nothing free while it is held"
        );
        drop(large);
        assert_eq!(
            budget.hold(0).await.expect("at least a byte").num_permits(),
            1
        );
    }
}
