//! `make demo`'s scenario as a test: the driver's output must have the reference shape.

use std::process::Command;

#[test]
fn demo_prints_the_reference_scenario() {
    // Built by `make test` (`cargo build --workspace --bins`), like the binaries it runs.
    let demo = dlq_testenv::paths::try_bin("dlq-demo").unwrap_or_else(|why| panic!("{why}"));
    let out = Command::new(&demo)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = include_str!("../examples/demo.expected");
    // Nothing in the output depends on time; compare line by line, trailing spaces aside.
    let norm = |s: &str| s.lines().map(str::trim_end).collect::<Vec<_>>().join("\n");
    assert_eq!(norm(&stdout), norm(expected));
}
