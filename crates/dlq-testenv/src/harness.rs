//! What every module of the environment shares with the tests: waiting for a condition, a
//! line past the test harness's capture, a plain HTTP POST to a local server. It names no
//! other module, so any of them may use it.

use std::io::Write;
use std::time::Duration;

/// The body of a plain-HTTP `POST {base}{path}` with a JSON `body` (HTTP/1.0: no chunked
/// answer, the server closes): for local servers without a client crate here (etcd's gateway).
pub async fn http_post(base: &str, path: &str, body: &str) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes())
        .await
        .expect("sending the request");
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer)
        .await
        .expect("reading the answer");
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {}", String::from_utf8_lossy(&answer)));
    answer.split_off(split + 4)
}

/// A line straight to the process's stderr, past the test harness's capture, so CI logs show
/// it (measurements, skipped checks, kept logs).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Polls `check` every 100 ms until it returns Some, or panics after `secs` with `what`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
