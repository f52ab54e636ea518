//! `kubectl dlq pause` and `resume`: a running replay held without ending it (`spec.paused`),
//! and let go again. Unlike a stop, nothing it decided is withdrawn.

use clap::Args;
use dlq_core::replay::DeadLetterReplay;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::session::{CliError, Global, connect};

#[derive(Args, Debug)]
pub struct PauseArgs {
    /// The replay (DeadLetterReplay) name.
    pub name: String,
}

/// Sets the replay's `spec.paused` to `paused`, and says what that means for it.
pub async fn run(g: &Global, args: PauseArgs, paused: bool) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<DeadLetterReplay> = Api::namespaced(client, &ns);
    let name = &args.name;
    let replay = api.get_opt(name).await?.ok_or_else(|| {
        CliError::Usage(format!(
            "no replay {name} in namespace {ns} (kubectl get dlr)"
        ))
    })?;
    if replay.phase().is_final() {
        return Err(CliError::Refused(format!(
            "replay {name} has ended ({}): nothing to {}",
            replay.phase().as_str(),
            if paused { "pause" } else { "resume" }
        )));
    }
    let patch = Patch::Merge(json!({"spec": {"paused": paused}}));
    api.patch(name, &PatchParams::default(), &patch).await?;
    println!("{}", said(name, &ns, paused));
    Ok(())
}

/// What the command says once the replay is patched.
fn said(name: &str, ns: &str, paused: bool) -> String {
    if paused {
        format!(
            "replay {name} paused: it decides and passes nothing more; what it decided is carried out.\nResume it: kubectl dlq resume -n {ns} {name}"
        )
    } else {
        format!("replay {name} resumed. Follow it: kubectl get dlr -n {ns} {name} -w")
    }
}

#[cfg(test)]
mod tests {
    use super::said;

    #[test]
    fn a_pause_says_how_to_resume() {
        assert!(said("inc-1", "payments", true).contains("kubectl dlq resume -n payments inc-1"));
        assert!(said("inc-1", "payments", false).starts_with("replay inc-1 resumed"));
    }
}
