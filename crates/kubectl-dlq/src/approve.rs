//! `kubectl dlq approve`: the second pair of eyes on a replay whose queue requires approvals
//! (dual control). Appends `{by: you, at: now, note}` to the replay's `spec.approvals`, `by`
//! being who the apiserver says you are: the admission policy refuses any other name.

use clap::Args;
use dlq_core::replay::{Approval, DeadLetterReplay};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::decision::whoami;
use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct ApproveArgs {
    /// The replay (DeadLetterReplay) name.
    pub name: String,
    /// Why (ticket, what you reviewed); kept with the approval.
    #[arg(long)]
    pub note: Option<String>,
}

/// Approves the replay in the caller's name, once.
pub async fn run(g: &Global, args: ApproveArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let by = whoami(&client).await?;
    let api: Api<DeadLetterReplay> = Api::namespaced(client, &ns);
    let name = &args.name;
    let replay = api.get_opt(name).await?.ok_or_else(|| {
        CliError::Usage(format!(
            "no replay {name} in namespace {ns} (kubectl get dlr)"
        ))
    })?;
    let approvals = approved(&replay, &by, args.note, Timestamp::now())?;
    // The list as read, guarded by its resourceVersion: a concurrent approval is not lost.
    let patch = Patch::Merge(json!({
        "metadata": {"resourceVersion": replay.resource_version()},
        "spec": {"approvals": approvals},
    }));
    api.patch(name, &PatchParams::default(), &patch).await?;
    println!("{}", said(name, &ns, &by));
    Ok(())
}

/// The replay's approvals with the caller's appended, or why the caller may not approve it
/// (the admission policy would refuse the same, in the apiserver's words).
pub(crate) fn approved(
    replay: &DeadLetterReplay,
    by: &str,
    note: Option<String>,
    now: Timestamp,
) -> Result<Vec<Approval>, CliError> {
    let name = replay.name_any();
    if replay.phase().is_final() {
        return Err(CliError::Refused(format!(
            "replay {name} has ended ({}): nothing to approve",
            replay.phase().as_str()
        )));
    }
    if replay.spec.by.trim() == by {
        return Err(CliError::Refused(format!(
            "you ({by}) wrote replay {name}: an approval must come from someone else"
        )));
    }
    if replay.spec.approvals.iter().any(|a| a.by.trim() == by) {
        return Err(CliError::Refused(format!(
            "you ({by}) already approved replay {name}"
        )));
    }
    let mut approvals = replay.spec.approvals.clone();
    approvals.push(Approval {
        by: by.to_string(),
        at: Time(now),
        note: note.filter(|n| !n.trim().is_empty()),
    });
    Ok(approvals)
}

/// What the command says once the approval is stored.
fn said(name: &str, ns: &str, by: &str) -> String {
    format!(
        "replay {name} approved by {by}. It runs once it has the approvals its queue requires: kubectl get dlr -n {ns} {name} -w"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::replay::DeadLetterReplaySpec;

    fn replay(approvals: &[&str]) -> DeadLetterReplay {
        let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
            "queue": "relayer", "by": "alice",
            "approvals": approvals.iter().map(|b| json!({"by": b, "at": "2026-12-08T10:00:00Z"})).collect::<Vec<_>>(),
        }))
        .expect("spec");
        DeadLetterReplay::new("inc-1", spec)
    }

    #[test]
    fn an_approval_is_appended_once_and_never_the_authors() {
        let now = Timestamp::UNIX_EPOCH;
        let got = approved(&replay(&["carol"]), "bob", Some("INC-1".into()), now)
            .expect("bob may approve");
        let by: Vec<&str> = got.iter().map(|a| a.by.as_str()).collect();
        assert_eq!(by, ["carol", "bob"]);
        assert_eq!(got[1].note.as_deref(), Some("INC-1"));
        let own = approved(&replay(&[]), "alice", None, now)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            own.as_deref(),
            Some("you (alice) wrote replay inc-1: an approval must come from someone else")
        );
        let twice = approved(&replay(&["bob"]), "bob", None, now)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            twice.as_deref(),
            Some("you (bob) already approved replay inc-1")
        );
        assert!(said("inc-1", "payments", "bob").contains("kubectl get dlr -n payments inc-1 -w"));
    }
}
