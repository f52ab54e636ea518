//! Finding records by job id or record name.

use kube::api::ListParams;
use kube::{Api, Client};

use dlq_core::api::{DeadLetter, DeadLetterQueue, LABEL_JOB_KEY, Phase};
use dlq_core::park::job_key;

use crate::session::CliError;

/// Every cycle of JOB (a record name or a job id) in `ns`, oldest cycle first.
pub async fn cycles(client: &Client, ns: &str, job: &str) -> Result<Vec<DeadLetter>, CliError> {
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    // Only a valid object name can be a record name (a job id may hold '/').
    let is_name = !job.is_empty()
        && job.len() <= 253
        && job
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if is_name && let Some(r) = records.get_opt(job).await? {
        return Ok(vec![r]);
    }
    // A job id: its records carry job-key = hash(queue/jobId), so ask once per queue.
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    let mut found = Vec::new();
    for q in queues.list(&ListParams::default()).await?.items {
        let queue = q.metadata.name.unwrap_or_default();
        let lp = ListParams::default().labels(&format!("{LABEL_JOB_KEY}={}", job_key(&queue, job)));
        found.extend(
            records
                .list(&lp)
                .await?
                .items
                .into_iter()
                .filter(|r| r.spec.job.id == job),
        );
    }
    found.sort_by_key(|r| r.spec.cycle);
    Ok(found)
}

/// The record to act on: the Parked cycle, else the latest one (to explain the refusal).
pub fn actionable(cycles: &[DeadLetter]) -> Option<&DeadLetter> {
    cycles
        .iter()
        .find(|r| r.phase() == Phase::Parked)
        .or_else(|| cycles.last())
}
