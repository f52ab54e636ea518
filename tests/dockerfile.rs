//! Production packaging (issue 7), the Dockerfile: hadolint-clean with the checked-in
//! configuration, a locked multi-stage release build, and a final image that runs as non-root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dlq_testenv::chart::{run, show};
use dlq_testenv::workspace_root;

fn hadolint() -> PathBuf {
    let cache = std::env::var_os("DLQ_TOOLS_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(|c| Path::new(&c).join("deadletter-operator/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/deadletter-operator/tools"))
        });
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("hadolint"))
                .collect()
        })
        .unwrap_or_default();
    candidates.extend(cache.map(|c| c.join("hadolint/bin/hadolint")));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("hadolint not found on PATH nor in the tools cache: run `bash scripts/ensure-deps.sh`")
        })
}

/// hadolint with the checked-in configuration, on the Dockerfile (`None`) or on `input`.
fn lint(input: Option<&str>) -> Output {
    let mut cmd = Command::new(hadolint());
    cmd.args(["--no-color", "--config", ".hadolint.yaml"])
        .arg(if input.is_some() { "-" } else { "Dockerfile" })
        .current_dir(workspace_root());
    run(&mut cmd, input)
}

/// The binaries the image ships.
const BINARIES: [&str; 2] = ["deadletter-operator", "kubectl-dlq"];

/// A multi-stage build whose build stage is a locked release build of both binaries, without
/// test-only features.
fn assert_locked_multi_stage_release_build(text: &str) {
    let froms: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert!(froms.len() >= 2, "multi-stage build expected: {froms:?}");
    let build = text
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("the image builds with cargo build");
    assert!(
        build.contains("cargo build --release --locked"),
        "a locked release build: {build}"
    );
    for bin in BINARIES {
        assert!(
            build.contains(&format!("-p {bin}")) || build.contains(&format!("--bin {bin}")),
            "the image build does not build {bin}: {build}"
        );
    }
    assert!(
        !text.contains("--features") && !text.contains("--all-features"),
        "test-only features (failpoints) in the image"
    );
}

/// The final stage runs as a non-root USER and has both binaries in /usr/local/bin.
fn assert_final_stage_is_non_root(text: &str) {
    let final_stage = text
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .expect("final stage");
    let user = final_stage
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("the final stage sets USER");
    assert!(
        !["root", "0", "0:0", "root:root"].contains(&user.trim()),
        "runs as root: USER {user}"
    );
    for bin in BINARIES {
        assert!(
            final_stage.contains(bin) && final_stage.contains("/usr/local/bin/"),
            "{bin} not copied into /usr/local/bin of the final image"
        );
    }
}

#[test]
fn dockerfile_is_hadolint_clean_and_builds_a_non_root_image() {
    let out = lint(None);
    assert!(out.status.success(), "hadolint: {}", show(&out));

    // The linter really lints with this configuration: a sloppy Dockerfile fails.
    let out = lint(Some(
        "FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nCMD [\"curl\"]\n",
    ));
    assert!(
        !out.status.success() && show(&out).contains("DL3007"),
        "hadolint must flag a :latest base image: {}",
        show(&out)
    );

    let text = std::fs::read_to_string(workspace_root().join("Dockerfile")).expect("Dockerfile");
    assert_locked_multi_stage_release_build(&text);
    assert_final_stage_is_non_root(&text);
    assert!(
        text.contains("org.opencontainers.image.licenses=\"Apache-2.0\"")
            && text.contains("COPY LICENSE /usr/share/doc/deadletter-operator/LICENSE")
            && text.contains("dev.dlq.license.file=\"/usr/share/doc/deadletter-operator/LICENSE\""),
        "the image carries its LICENSE and labels point at it"
    );
    let ignore =
        std::fs::read_to_string(workspace_root().join(".dockerignore")).expect(".dockerignore");
    assert!(
        !ignore.lines().any(|l| l.trim() == "LICENSE"),
        "the LICENSE must reach the build context"
    );
    for entry in ["target", ".git"] {
        assert!(
            ignore.lines().any(|l| l.trim() == entry),
            ".dockerignore must exclude {entry}"
        );
    }
}
