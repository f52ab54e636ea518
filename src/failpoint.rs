//! Test-only crash points. With the `failpoints` feature, `DLQ_FAILPOINT=<name>` makes the
//! process announce `failpoint <name> reached` on stderr and hang there, so a test can SIGKILL
//! it at exactly that point. Without the feature this compiles to nothing.

#[cfg(feature = "failpoints")]
pub async fn hit(name: &str) {
    if std::env::var("DLQ_FAILPOINT").is_ok_and(|v| v == name) {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "failpoint {name} reached");
        std::future::pending::<()>().await;
    }
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub async fn hit(_name: &str) {}
