//! What every handler of the page shares: the user's client, who they are, the run's secrets,
//! the live records and the replay this page started. Its own module, so that the pages, the
//! decisions, the replays and the guard name it without naming their parent (a cycle).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kube::Client;

use super::live;
use crate::runbook::Control;

/// What every handler shares: the user's client, who they are, the run's secrets.
pub struct Ui {
    pub client: Client,
    /// None with -A: every namespace the user may list.
    pub namespace: Option<String>,
    pub user: String,
    pub token: String,
    pub csrf: String,
    /// `127.0.0.1:PORT`: the only Host and Origin accepted (DNS rebinding, cross-site posts).
    pub authority: String,
    pub records: live::Records,
    pub replays: Replays,
    /// SelfSubjectAccessReview answers per namespace, with when they were asked.
    pub access: Mutex<HashMap<String, (Instant, bool)>>,
}

/// The replay this page started, if any (one at a time).
#[derive(Default)]
pub struct Replays {
    pub(super) current: Mutex<Option<Running>>,
}

#[derive(Clone)]
pub(super) struct Running {
    pub(super) control: Control,
    pub(super) describe: String,
    /// The summary line once it ended (or the error that ended it).
    pub(super) done: Arc<Mutex<Option<String>>>,
}

impl Replays {
    pub(super) fn get(&self) -> Option<Running> {
        self.current.lock().ok().and_then(|c| c.clone())
    }
}
