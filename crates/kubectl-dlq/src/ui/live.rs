//! One watch of the records, made with the user's client: the record pages read this cache, so
//! a page polled every two seconds shows new parkings and resolutions without a list per poll.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use dlq_core::api::DeadLetter;

/// The watched records and the watch's last error (RBAC refusals, a lost apiserver).
#[derive(Clone)]
pub struct Records {
    store: Store<DeadLetter>,
    error: Arc<Mutex<Option<String>>>,
}

impl Records {
    /// Starts the watch in the background; it reconnects with backoff.
    pub fn watch(client: Client, namespace: Option<&str>) -> Self {
        let api: Api<DeadLetter> = match namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        };
        let (store, writer) = reflector::store();
        let error = Arc::new(Mutex::new(None));
        let last = error.clone();
        let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff();
        tokio::spawn(stream.for_each(move |event| {
            let message = event.err().map(|e| e.to_string());
            if let Ok(mut slot) = last.lock() {
                *slot = message;
            }
            futures::future::ready(())
        }));
        Records { store, error }
    }

    /// Every record in scope, once the first list arrived (or what there is after 5 s, with
    /// the reason the watch is not ready).
    pub async fn all(&self) -> (Vec<Arc<DeadLetter>>, Option<String>) {
        let ready = tokio::time::timeout(Duration::from_secs(5), self.store.wait_until_ready())
            .await
            .is_ok_and(|r| r.is_ok());
        let error = self.error.lock().ok().and_then(|e| e.clone());
        let error = match (ready, error) {
            (_, Some(e)) => Some(e),
            (false, None) => Some("the watch of records has not synced yet".into()),
            (true, None) => None,
        };
        (self.store.state(), error)
    }

    /// One record from the cache.
    pub fn get(&self, ns: &str, name: &str) -> Option<Arc<DeadLetter>> {
        self.store.get(&reflector::ObjectRef::new(name).within(ns))
    }
}
