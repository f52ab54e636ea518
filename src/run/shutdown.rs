//! The process's stop signals as one cloneable future: SIGTERM or Ctrl-C, a lost Lease, a
//! stalled leader. Every server and scope waits on a clone, so one signal stops them all.

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};

/// A stop signal every task may wait on (cloned).
pub type Shutdown = Shared<BoxFuture<'static, ()>>;

/// Resolves on SIGTERM or Ctrl-C.
pub fn termination() -> Shutdown {
    async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutting down");
    }
    .boxed()
    .shared()
}

/// Never resolves: a signal that does not apply (no leader election, nothing to lose).
pub fn never() -> Shutdown {
    std::future::pending::<()>().boxed().shared()
}

/// Resolves when either does.
pub fn either(a: Shutdown, b: Shutdown) -> Shutdown {
    async move {
        tokio::select! {
            _ = a => {}
            _ = b => {}
        }
    }
    .boxed()
    .shared()
}
