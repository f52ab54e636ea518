//! The CRDs of every kind together. Above the kinds' modules, so that no kind names another
//! to list it.

use kube_core::CustomResourceExt;

use crate::dead_letter::dead_letter_crd;
use crate::groups::DeadLetterGroup;
use crate::queue::queue_crd;
use crate::replay::DeadLetterReplay;

/// The CRDs as YAML documents, as `deadletter-operator crds` prints them and `crds/` holds them.
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    Ok(format!(
        "---\n{}---\n{}---\n{}---\n{}",
        serde_yaml::to_string(&dead_letter_crd())?,
        serde_yaml::to_string(&queue_crd())?,
        serde_yaml::to_string(&DeadLetterReplay::crd())?,
        serde_yaml::to_string(&DeadLetterGroup::crd())?
    ))
}
