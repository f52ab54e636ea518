//! Jobs sent ahead of their decisions: a redrive of one failure group
//! (`DeadLetterReplaySpec::sends_ahead`, standing or not) is itself the signed decision, so the
//! replay puts its records' jobs on the target at the broker's pace (or its `rate`) first and
//! signs the records after, at the apiserver's.
//!
//! Each record is read whole (a page of the group's undecided records at a time; one by one
//! for a few, or those not labelled with their group yet), checked still Parked, undecided and
//! selected, claimed from the records controllers for the length of its send, shown decided to
//! the sources' job view (`crate::state::jobs`: a new death of its job parks as the next cycle),
//! and enqueued by the redrive's own path (`super::record::send_ahead`: its key
//! `dlq_core::decide::redrive_key`, its confirmation remembered in `super::claims`). Once the
//! replay signs it, its reconcile writes only the resolution. A crash before the signature
//! leaves it Parked and undecided: selected again, its job goes again with the same key, as a
//! redrive's does after a crash before its resolution.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::ResourceExt;

use dlq_core::api::DeadLetter;
use dlq_core::decide;
use dlq_core::replay::ReplaySelector;

use super::context::Context;
use super::record;
use crate::state::apiserver::GroupPage;

/// Jobs in flight at once (one connection's pipeline on most targets).
const SEND_CONCURRENCY: usize = 64;
/// Records read one by one below this many (a paced replay's step); a page at a time above.
const LIST_ABOVE: usize = 64;
/// Records a page holds (each whole, its inline payload up to 256 KiB).
const PAGE: u32 = 250;

/// What a send round is about: the replay's queue, group, signer and selection.
pub struct Round<'a> {
    pub ns: &'a str,
    pub queue: &'a str,
    pub group: &'a str,
    pub by: &'a str,
    pub selector: &'a ReplaySelector,
}

/// What a round did, by record name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Confirmed by the broker (now, or earlier in this process): to be signed.
    pub confirmed: Vec<String>,
    /// Not confirmed: to be signed all the same, so the record path retries it with backoff
    /// and its failure counts toward the replay's `failureRatio`.
    pub failed: Vec<String>,
}

/// A record read fresh: gone (None), or the apiserver's error.
type Read = Result<Option<DeadLetter>, kube::Error>;

/// How one record's send went.
enum Outcome {
    Confirmed,
    Failed,
    /// Not sent now (changed, held by a reconcile, or after a failure): selected again later.
    Skipped,
}

/// Sends the jobs of records `names` (the step's share of the selection), stopping at the first
/// failure (what is in flight finishes). Never fails itself: a read that fails ends the round,
/// and what it did not send is selected again at the next step.
pub async fn send(ctx: &Context, round: &Round<'_>, names: &[String]) -> Sent {
    let mut sent = Sent::default();
    if names.is_empty() || !ctx.settings.leadership.holds() {
        return sent;
    }
    let failed = AtomicBool::new(false);
    let mut wanted: HashSet<&str> = names.iter().map(String::as_str).collect();
    if names.len() >= LIST_ABOVE {
        by_pages(ctx, round, &mut wanted, &failed, &mut sent).await;
    }
    let rest: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| wanted.contains(n))
        .collect();
    if !rest.is_empty() && !failed.load(Ordering::SeqCst) {
        let records = one_by_one(ctx, round.ns, &rest).await;
        send_all(ctx, round, records, &failed, &mut sent).await;
    }
    sent
}

/// Reads the group's undecided records a page at a time, sending those in `wanted` (taken out
/// of it) before reading the next page: a page of records is held at most.
async fn by_pages(
    ctx: &Context,
    round: &Round<'_>,
    wanted: &mut HashSet<&str>,
    failed: &AtomicBool,
    sent: &mut Sent,
) {
    let mut page = GroupPage {
        namespace: round.ns.to_string(),
        queue: round.queue.to_string(),
        group: round.group.to_string(),
        limit: PAGE,
        continue_token: None,
    };
    loop {
        let (items, next) = match ctx.apiserver.list_undecided(&page).await {
            Ok(listed) => listed,
            Err(error) => {
                tracing::warn!(namespace = round.ns, group = round.group, %error, "listing a group's records to send ahead failed; reading them one by one");
                return;
            }
        };
        let mine: Vec<DeadLetter> = items
            .into_iter()
            .filter(|r| wanted.remove(r.name_any().as_str()))
            .collect();
        send_all(ctx, round, mine, failed, sent).await;
        match next {
            Some(token) if !wanted.is_empty() && !failed.load(Ordering::SeqCst) => {
                page.continue_token = Some(token);
            }
            _ => return,
        }
    }
}

/// Records `names` read one by one (those gone or unreadable left out: selected again later).
async fn one_by_one(ctx: &Context, ns: &str, names: &[&str]) -> Vec<DeadLetter> {
    // Boxed before they are streamed: the futures' lifetimes stay provably Send.
    let reading: Vec<BoxFuture<'_, (&str, Read)>> = names
        .iter()
        .map(|name| async move { (*name, ctx.apiserver.get_record(ns, name).await) }.boxed())
        .collect();
    let reads: Vec<(&str, Read)> = futures::stream::iter(reading)
        .buffer_unordered(SEND_CONCURRENCY)
        .collect()
        .await;
    let mut records = Vec::with_capacity(reads.len());
    for (name, read) in reads {
        match read {
            Ok(Some(record)) => records.push(record),
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(namespace = ns, name, %error, "reading a record to send ahead failed")
            }
        }
    }
    records
}

/// Sends `records` concurrently, adding each outcome to `sent`.
async fn send_all(
    ctx: &Context,
    round: &Round<'_>,
    records: Vec<DeadLetter>,
    failed: &AtomicBool,
    sent: &mut Sent,
) {
    let sending: Vec<BoxFuture<'_, (String, Outcome)>> = records
        .iter()
        .map(|r| async move { (r.name_any(), send_one(ctx, round, r, failed).await) }.boxed())
        .collect();
    let outcomes: Vec<(String, Outcome)> = futures::stream::iter(sending)
        .buffer_unordered(SEND_CONCURRENCY)
        .collect()
        .await;
    for (name, outcome) in outcomes {
        match outcome {
            Outcome::Confirmed => sent.confirmed.push(name),
            Outcome::Failed => sent.failed.push(name),
            Outcome::Skipped => {}
        }
    }
}

/// Sends one record's job, unless it changed since it was selected, a reconcile holds it, or
/// this process sent it already (its confirmation is remembered: nothing is sent twice).
async fn send_one(
    ctx: &Context,
    round: &Round<'_>,
    record: &DeadLetter,
    failed: &AtomicBool,
) -> Outcome {
    let uid = record.uid().unwrap_or_default();
    if !round.selector.matches(record) || ctx.claims.resolved_here(&uid) {
        return Outcome::Skipped;
    }
    // Held while sending: a reconcile of the record then sees the confirmation.
    let Some(_claim) = ctx.claims.claim(&uid) else {
        return Outcome::Skipped;
    };
    if ctx
        .claims
        .confirmed_by(&decide::redrive_key(record))
        .is_some()
    {
        return Outcome::Confirmed;
    }
    if failed.load(Ordering::SeqCst) {
        return Outcome::Skipped;
    }
    let name = record.name_any();
    ctx.jobs.redriving(round.ns, &name);
    match record::send_ahead(ctx, round.ns, record, round.by).await {
        Ok(()) => {
            tracing::debug!(namespace = round.ns, name, job = %record.spec.job.id, "job sent ahead of its decision");
            Outcome::Confirmed
        }
        Err(failure) => {
            failed.store(true, Ordering::SeqCst);
            tracing::warn!(namespace = round.ns, name, job = %record.spec.job.id, reason = failure.reason, message = %failure.message, "sending a job ahead failed; the record is signed for its own redrive");
            Outcome::Failed
        }
    }
}
