//! Test-only crash points. With the `failpoints` feature, `DLQ_FAILPOINT=<name>` makes the
//! process announce `failpoint <name> reached` on stderr and hang there, so a test can SIGKILL
//! it at exactly that point. `DLQ_FAILPOINT=<name>@<ms>` holds there for that many milliseconds
//! and goes on (a test breaks something meanwhile). Without the feature this compiles to nothing.

#[cfg(feature = "failpoints")]
pub async fn hit(name: &str) {
    let Ok(value) = std::env::var("DLQ_FAILPOINT") else {
        return;
    };
    let (point, hold) = match value.split_once('@') {
        Some((point, ms)) => (point, ms.parse::<u64>().ok()),
        None => (value.as_str(), None),
    };
    if point != name {
        return;
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "failpoint {name} reached");
    match hold {
        Some(ms) => tokio::time::sleep(std::time::Duration::from_millis(ms)).await,
        None => std::future::pending::<()>().await,
    }
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub async fn hit(_name: &str) {}
