//! The records a command reads, a page at a time from a task of their own: the next page is
//! asked for as soon as one is handed over, so the apiserver prepares it while this one is
//! used. `ls --grep/--where` and `export` read this way; memory holds three pages at most (one
//! used, one waiting, one arriving).

use kube::Api;
use kube::api::ListParams;
use tokio::sync::mpsc;

use dlq_core::api::DeadLetter;

/// The first page is small, so the first lines print soon; later pages grow to this many
/// records (fewer round trips over a large scan).
const FIRST_PAGE: u32 = 500;
const LARGEST_PAGE: u32 = 4000;

/// A page of records, or the apiserver's refusal.
pub type Page = Result<Vec<DeadLetter>, kube::Error>;

/// The list's pages from a task of their own: the next page is asked for as soon as one is
/// handed over, so the apiserver prepares it while this one is used. At most one page waits.
pub fn pages(api: Api<DeadLetter>, mut lp: ListParams) -> mpsc::Receiver<Page> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let mut size = FIRST_PAGE;
        loop {
            let (items, next) = match api.list(&lp.clone().limit(size)).await {
                Ok(list) => (list.items, list.metadata.continue_),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let next = next.filter(|c| !c.is_empty());
            // A closed receiver (the limit was reached) ends the task.
            if tx.send(Ok(items)).await.is_err() || next.is_none() {
                return;
            }
            lp.continue_token = next;
            size = (size * 2).min(LARGEST_PAGE);
        }
    });
    rx
}
