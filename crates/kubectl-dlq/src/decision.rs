//! A signed decision per record, what `redrive JOB...` and `drop JOB...` come to: who signs
//! ([`Sign`], [`signer`]) and the decision written to each record. The commands themselves,
//! which may also start a replay over a selection, are `runbook`'s.

use std::time::Duration;

use clap::Args;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use dlq_core::api::{Action, DeadLetter, Phase};

use crate::lookup;
use crate::session::{CliError, Global, connect};

/// Who decides and why.
#[derive(Args, Debug, Clone)]
pub struct Sign {
    /// Who decides (default: your authenticated user name, from a SelfSubjectReview).
    #[arg(long)]
    pub by: Option<String>,
    /// Why (ticket, incident); kept on the record.
    #[arg(long)]
    pub note: Option<String>,
    /// Wait for the operator to carry the decision out, and print the outcome.
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits, in seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

/// The authenticated user's name, as the apiserver sees it.
pub async fn whoami(client: &Client) -> Result<String, CliError> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review: SelfSubjectReview = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"
    }))
    .map_err(|e| CliError::Usage(e.to_string()))?;
    let answer = api.create(&PostParams::default(), &review).await?;
    answer
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .filter(|u| !u.is_empty())
        .ok_or_else(|| CliError::Usage("cannot tell who you are; pass --by NAME".into()))
}

/// The name a decision is signed with: `--by`, else who the apiserver says you are.
pub async fn signer(client: &Client, sign: &Sign) -> Result<String, CliError> {
    match sign.by.as_deref().map(str::trim) {
        Some(by) if !by.is_empty() => Ok(by.to_string()),
        Some(_) => Err(CliError::Usage("--by must not be empty".into())),
        None => whoami(client).await,
    }
}

/// The verb in front of each output line.
fn verb(action: Action) -> &'static str {
    match action {
        Action::Redrive => "redrive",
        Action::Drop => "drop",
    }
}

/// What happened to one job's decision.
pub enum Decided {
    /// Accepted; carries the record as patched.
    Signed(Box<DeadLetter>),
    /// Refused, with the words to show.
    Refused(String),
}

/// Sets action/by/note on the parked record of `job`, guarded by its resourceVersion.
pub async fn decide_one(
    client: &Client,
    ns: &str,
    job: &str,
    action: Action,
    by: &str,
    note: Option<&str>,
) -> Result<Decided, CliError> {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    for _ in 0..3 {
        let cycles = lookup::cycles(client, ns, job).await?;
        let Some(record) = lookup::actionable(&cycles) else {
            return Ok(Decided::Refused(format!(
                "no record of {job} in namespace {ns}"
            )));
        };
        if record.phase() != Phase::Parked {
            return Ok(Decided::Refused(format!(
                "record is not parked: {} is {}",
                record.spec.job.id,
                record.phase().as_str().to_lowercase()
            )));
        }
        let version = record.resource_version().unwrap_or_default();
        match sign_at(&api, &record.name_any(), &version, action, by, note).await {
            Ok(r) => return Ok(Decided::Signed(Box::new(r))),
            // Changed under us (the operator wrote status): look again.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            // The apiserver's words: CEL rules, admission policy, RBAC.
            Err(kube::Error::Api(s)) => return Ok(Decided::Refused(s.message)),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Decided::Refused(format!("{job} kept changing; try again")))
}

/// Sets action/by/note on record `name` only while it is still at `resource_version`: the
/// version the person looked at is the one decided on, or the apiserver refuses (409).
pub async fn sign_at(
    api: &Api<DeadLetter>,
    name: &str,
    resource_version: &str,
    action: Action,
    by: &str,
    note: Option<&str>,
) -> Result<DeadLetter, kube::Error> {
    let patch = json!({
        "metadata": {"resourceVersion": resource_version},
        "spec": {"action": action, "by": by, "note": note},
    });
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
}

/// Waits until the operator carried the decision out or reports a requeue failure.
pub async fn outcome(
    client: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> Result<String, CliError> {
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let r = api.get(name).await?;
        match r.phase() {
            Phase::Redriven => return Ok("redriven".into()),
            Phase::Dropped => return Ok("dropped".into()),
            Phase::Parked => {
                let failing = r.status.as_ref().and_then(|s| {
                    s.conditions.iter().find(|c| {
                        c.type_ == "Requeued"
                            && c.status == "False"
                            && c.observed_generation >= r.metadata.generation
                    })
                });
                if let Some(c) = failing {
                    return Err(CliError::Refused(format!(
                        "requeue failing: {} (the operator keeps retrying)",
                        c.message
                    )));
                }
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(CliError::Refused(format!(
                "still parked after {}s: is the operator running?",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Signs `action` on each job's parked record and prints a line per job; refusals do not stop
/// the rest, but make the command fail once all were tried.
pub async fn decide_jobs(
    g: &Global,
    jobs: &[String],
    action: Action,
    sign: &Sign,
) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let by = signer(&client, sign).await?;
    let width = jobs.iter().map(|j| j.chars().count()).max().unwrap_or(0) + 1;
    let mut refused = 0;
    for job in jobs {
        let prefix = format!("{:<8}{job:<width$}", verb(action));
        match decide_one(&client, &ns, job, action, &by, sign.note.as_deref()).await? {
            Decided::Refused(why) => {
                println!("{prefix}  refused ({why})");
                refused += 1;
            }
            Decided::Signed(r) => {
                println!("{prefix}  by {by}");
                if sign.wait {
                    match outcome(
                        &client,
                        &ns,
                        &r.name_any(),
                        Duration::from_secs(sign.timeout),
                    )
                    .await
                    {
                        Ok(done) => println!("{prefix}  {done}"),
                        Err(e) => {
                            println!("{prefix}  {e}");
                            refused += 1;
                        }
                    }
                }
            }
        }
    }
    if refused > 0 {
        return Err(CliError::Refused(String::new()));
    }
    Ok(())
}
