//! Where things are: the workspace checkout (chart, CRDs, `tools/build.sh`) and the workspace's
//! built binaries.
//!
//! `env!("CARGO_BIN_EXE_<name>")` only names binaries of the package that runs the test, and
//! the workspace's binaries live in several packages (`deadletter-operator`, `kubectl-dlq`,
//! `dlq-testenv`). They all land in one directory, `target/<profile>/`, which is also where the
//! running test (`target/<profile>/deps/<test>-<hash>`), example
//! (`target/<profile>/examples/<name>`) or bench executable sits: [`bin`] looks there.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Overrides the directory [`bin`] looks in (e.g. binaries built elsewhere).
pub const BIN_DIR_ENV: &str = "DLQ_BIN_DIR";

/// The workspace checkout, or `None` when it cannot be found.
///
/// Resolved at run time: the first ancestor of this crate's manifest dir (compiled in) that
/// holds `tools/build.sh` and a `Cargo.toml`, else the first such ancestor of the running
/// executable (a checkout moved after the build).
pub fn find_workspace_root() -> Option<PathBuf> {
    static ROOT: OnceLock<Option<PathBuf>> = OnceLock::new();
    ROOT.get_or_init(|| {
        let is_root =
            |d: &Path| d.join("tools/build.sh").is_file() && d.join("Cargo.toml").is_file();
        let compiled = Path::new(env!("CARGO_MANIFEST_DIR"));
        if let Some(root) = compiled.ancestors().find(|d| is_root(d)) {
            return Some(root.to_path_buf());
        }
        let exe = std::env::current_exe().ok()?;
        exe.ancestors().find(|d| is_root(d)).map(Path::to_path_buf)
    })
    .clone()
}

/// The workspace checkout (holds `Cargo.toml`, `tools/`, `crds/`, `charts/`).
pub fn workspace_root() -> PathBuf {
    find_workspace_root().unwrap_or_else(|| {
        panic!(
            "cannot find the deadletter-operator checkout (a directory with tools/build.sh) \
             above {} or the running executable",
            env!("CARGO_MANIFEST_DIR")
        )
    })
}

/// `target/<profile>/` of the running test, example or bench executable.
pub fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("deps" | "examples") => dir.parent().map(Path::to_path_buf),
        _ => Some(dir.to_path_buf()),
    }
}

/// A scratch directory under `target/` (what `CARGO_TARGET_TMPDIR` is to integration tests),
/// or the system temp dir when the executable is not in a cargo target dir.
pub fn target_tmp_dir() -> PathBuf {
    profile_dir()
        .and_then(|p| p.parent().map(|t| t.join("tmp")))
        .unwrap_or_else(std::env::temp_dir)
}

fn bin_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        return Ok(PathBuf::from(dir));
    }
    profile_dir().ok_or_else(|| "cannot locate the running executable's target dir".to_string())
}

/// A workspace binary (`deadletter-operator`, `kubectl-dlq`, `dlq-testenv`), or why it is not
/// there.
pub fn try_bin(name: &str) -> Result<PathBuf, String> {
    let dir = bin_dir()?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{name} not found in {}: run `cargo build --workspace --bins` first (with the same \
             profile as this run; `make test` does), or point {BIN_DIR_ENV} at the binaries",
            dir.display()
        ))
    }
}

/// A workspace binary; panics with what to do when it is not built.
pub fn bin(name: &str) -> PathBuf {
    try_bin(name).unwrap_or_else(|why| panic!("{why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_root_is_the_checkout() {
        let root = workspace_root();
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
        assert!(manifest.contains("[workspace]"), "{}", root.display());
        assert!(root.join("crds/dlq.dev.yaml").is_file());
    }

    #[test]
    fn the_profile_dir_holds_this_test_in_deps() {
        let dir = profile_dir().expect("profile dir");
        let exe = std::env::current_exe().expect("current exe");
        assert_eq!(exe.parent(), Some(dir.join("deps").as_path()));
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let why = try_bin("no-such-binary").expect_err("not built");
        assert!(why.contains("cargo build --workspace --bins"), "{why}");
    }
}

/// The temp-dir prefixes this crate names `dlq-<kind>-<pid>-…`.
const SCRATCH_KINDS: &[&str] = &[
    "alertmanager",
    "chart",
    "elasticmq",
    "kafka",
    "nats",
    "operator",
    "pstest",
    "rabbit",
    "redis",
    "reveal",
    "s3",
    "testenv",
];

/// Removes, once per process, the temp dirs and logs of test processes that are gone. Brokers
/// shared through a static are never dropped and a killed bench cleans nothing, so their dirs
/// would otherwise pile up run after run; the next run tidies them instead.
pub fn sweep_stale_scratch() {
    static SWEPT: OnceLock<()> = OnceLock::new();
    SWEPT.get_or_init(|| {
        let tmp = std::env::temp_dir();
        let Ok(entries) = std::fs::read_dir(&tmp) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(scratch_owner) else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let path = entry.path();
                let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
            }
        }
    });
}

/// The pid in a scratch name `dlq-<kind>-<pid>-…`, for the kinds this crate makes.
fn scratch_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("dlq-")?;
    let (kind, rest) = rest.split_once('-')?;
    if !SCRATCH_KINDS.contains(&kind) {
        return None;
    }
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok()
}

#[cfg(test)]
mod scratch_tests {
    use super::scratch_owner;

    #[test]
    fn only_this_crates_scratch_names_have_an_owner() {
        assert_eq!(scratch_owner("dlq-kafka-31135-36395"), Some(31135));
        assert_eq!(
            scratch_owner("dlq-chart-2187-gitops-operator-1"),
            Some(2187)
        );
        assert_eq!(scratch_owner("dlq-operator-77-ns-1.log"), Some(77));
        assert_eq!(
            scratch_owner("dlq-testenv-12990-1796093557232646958"),
            Some(12990)
        );
        assert_eq!(
            scratch_owner("dlq-reveal-14437-reveal-14437-0"),
            Some(14437),
            "tests/seal's reveal API certificates"
        );
        assert_eq!(
            scratch_owner("dlq-cli-park-12-3"),
            None,
            "the park test's own dirs"
        );
        assert_eq!(scratch_owner("dlq-kafka-x-1"), None);
        assert_eq!(scratch_owner("other-kafka-1-2"), None);
    }
}
