//! The README's two commands are what CI runs, and each make target the docs name installs what
//! it needs before it needs it: a fresh machine with only Go, Rust and a C compiler runs them
//! as they are (CI ran `ensure-deps.sh` itself once, so it was green while `make test` alone
//! failed on a missing shellcheck).

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The commands `make -n target` would run, in order.
fn dry_run(target: &str) -> String {
    // Run from `make test` itself, make would say "make[1]: Entering directory" first.
    let out = Command::new("make")
        .args(["-n", "--no-print-directory", target])
        .current_dir(root())
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("MAKELEVEL")
        // A recipe line naming $(MAKE) runs even under -n: with cargo `false`, one that would
        // start a build (and the whole test run) fails this dry run instead.
        .env("CARGO", "false")
        .output()
        .expect("make runs");
    assert!(
        out.status.success(),
        "make -n {target}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The lines of a shell script that do something: no shebang, comments, blank lines, `set` or
/// `cd` to the checkout.
fn commands_of(script: &str) -> Vec<&str> {
    script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !l.starts_with("set ") && !l.starts_with("cd "))
        .collect()
}

#[test]
fn ci_runs_exactly_the_readmes_test_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let test_command = readme
        .lines()
        .find_map(|l| l.strip_prefix("make test"))
        .map(|_| "make test");
    assert_eq!(
        test_command,
        Some("make test"),
        "the README names `make test`"
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).expect(".ci/run");
    let commands = commands_of(&ci);
    assert!(
        commands == ["make test"] || commands == ["exec make test"],
        ".ci/run must do nothing but the README's `make test`; it runs {commands:?}"
    );
}

#[test]
fn make_test_installs_what_it_needs_before_anything_else() {
    let plan = dry_run("test");
    let first = plan.lines().next().unwrap_or_default();
    assert!(
        first.contains("scripts/ensure-deps.sh"),
        "make test must run scripts/ensure-deps.sh first; it starts with {first:?}"
    );
    for later in [
        "tools/build.sh",
        // The lints: make test compiles through clippy's driver, after this probe of it.
        "target/lint-probe.rs",
        "scripts/workflows-check.sh",
    ] {
        let at = plan.find(later);
        assert!(
            at.is_some_and(|at| at > plan.find("ensure-deps.sh").unwrap_or(usize::MAX)),
            "make test runs {later} after ensure-deps.sh"
        );
    }
}

#[test]
fn every_documented_target_that_needs_more_than_the_toolchains_installs_it_first() {
    for target in [
        "demo",
        "bench",
        "chaos",
        "tools",
        "chart-test",
        "cluster",
        "image-local",
        "release-local",
        "workflows-check",
        "clippy",
        "lint-probe",
    ] {
        let plan = dry_run(target);
        let first = plan.lines().next().unwrap_or_default();
        assert!(
            first.contains("scripts/ensure-deps.sh"),
            "make {target} must start with scripts/ensure-deps.sh; it starts with {first:?}"
        );
    }
}
