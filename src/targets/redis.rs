//! Redis target: LPUSH onto a list (a BRPOP/BLMOVE consumer sees FIFO order) or XADD onto a
//! stream.
//!
//! Headers: a list element is only the payload bytes, so a job with headers is refused for a
//! list target (condition + Event) rather than redriven without them. A stream entry carries
//! the payload in field `payload` and each header `k` in field `header:k`.
//!
//! Deduplicated in Redis itself: the push and a marker key named after the redrive's
//! idempotency key (`<list or stream>:dlq-redriven:<key>`, kept [`MARKER_TTL`]) are one
//! script, which pushes nothing when the marker exists. An enqueue whose answer was lost (a
//! cut link, a timeout) and is retried, or repeated by the next leader, adds no second job.

use std::time::Duration;

use futures::future::BoxFuture;

use super::{JobMessage, Target, TargetError};
use crate::broker::redis::RedisConn;

/// How long Redis remembers a redrive's marker: far longer than any retry or leader change
/// repeats an enqueue, short enough that markers do not pile up (one small key per redrive).
pub const MARKER_TTL: Duration = Duration::from_secs(24 * 3600);

/// Pushes unless the redrive's marker exists, then sets it; the push first, so that a push
/// Redis refuses (a key of another type) leaves no marker. KEYS: the list or stream, the
/// marker. ARGV: `list` or `stream`, the marker's lifetime (s), then the LPUSH value or the
/// XADD fields. Returns 1 when pushed, 0 when the marker said it was already.
const PUSH_ONCE: &str = r"
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if ARGV[1] == 'list' then
  redis.call('LPUSH', KEYS[1], ARGV[3])
else
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
return 1
";

/// Stream field holding the payload.
pub const STREAM_PAYLOAD_FIELD: &str = "payload";
/// Prefix of stream fields holding headers.
pub const STREAM_HEADER_PREFIX: &str = "header:";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisKey {
    List(String),
    Stream(String),
}

pub struct RedisTarget {
    conn: RedisConn,
    key: RedisKey,
}

impl RedisTarget {
    pub fn new(url: &str, key: RedisKey) -> Result<Self, TargetError> {
        Ok(RedisTarget {
            conn: RedisConn::new(url)?,
            key,
        })
    }
}

/// The command that puts `job` on `key`, or why it cannot carry it untouched: the
/// [`PUSH_ONCE`] script when the job has an idempotency key, else a plain LPUSH / XADD. The
/// payload is copied once, into the command (a large body is not held a third time).
pub fn requeue_command(key: &RedisKey, job: &JobMessage) -> Result<redis::Cmd, TargetError> {
    let (name, kind) = match key {
        RedisKey::List(list) => {
            refuse_headers(job)?;
            (list, "list")
        }
        RedisKey::Stream(stream) => (stream, "stream"),
    };
    let mut cmd = match &job.idempotency_key {
        None if kind == "list" => redis::cmd("LPUSH"),
        None => redis::cmd("XADD"),
        Some(_) => redis::cmd("EVAL"),
    };
    match &job.idempotency_key {
        None if kind == "list" => cmd.arg(name),
        None => cmd.arg(name).arg("*"),
        Some(idempotency_key) => cmd
            .arg(PUSH_ONCE)
            .arg(2)
            .arg(name)
            .arg(marker(name, idempotency_key))
            .arg(kind)
            .arg(MARKER_TTL.as_secs()),
    };
    match key {
        RedisKey::List(_) => cmd.arg(&job.payload[..]),
        RedisKey::Stream(_) => stream_fields(&mut cmd, job),
    };
    Ok(cmd)
}

/// The marker of the redrive `idempotency_key` on the list or stream `name`.
pub fn marker(name: &str, idempotency_key: &str) -> String {
    format!("{name}:dlq-redriven:{idempotency_key}")
}

/// A list element is the payload alone: a job with headers is refused, not stripped.
fn refuse_headers(job: &JobMessage) -> Result<(), TargetError> {
    if job.headers.is_empty() {
        return Ok(());
    }
    Err(TargetError::Unsupported(format!(
        "redis list target cannot carry headers ({}); use a stream target, or a backend with headers",
        job.headers.keys().cloned().collect::<Vec<_>>().join(", ")
    )))
}

/// A stream entry's fields: the payload, then each header (the idempotency key among them).
fn stream_fields<'c>(cmd: &'c mut redis::Cmd, job: &JobMessage) -> &'c mut redis::Cmd {
    cmd.arg(STREAM_PAYLOAD_FIELD).arg(&job.payload[..]);
    for (k, v) in job.headers_with_key().iter() {
        cmd.arg(format!("{STREAM_HEADER_PREFIX}{k}"))
            .arg(v.as_str());
    }
    cmd
}

impl Target for RedisTarget {
    fn describe(&self) -> String {
        match &self.key {
            RedisKey::List(l) => format!("redis list {l}"),
            RedisKey::Stream(s) => format!("redis stream {s}"),
        }
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let cmd = requeue_command(&self.key, job)?;
            // The reply (new length / entry id) is Redis's confirmation that it holds the job.
            let _: redis::Value = self.conn.query(&cmd).await?;
            Ok(())
        })
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        Box::pin(async move {
            let _: String = self.conn.query(&redis::cmd("PING")).await?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(headers: &[(&str, &str)]) -> JobMessage {
        JobMessage {
            id: "j1".into(),
            payload: b"\x00bytes\xff".to_vec().into(),
            null_payload: false,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            origin: None,
            idempotency_key: None,
            key_header: None,
        }
    }

    /// The arguments of `cmd`, as Redis receives them.
    fn args(cmd: &redis::Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn list_refuses_headers_rather_than_dropping_them() {
        let err = requeue_command(&RedisKey::List("q".into()), &job(&[("x-trace", "abc")]))
            .expect_err("headers must not be dropped silently");
        assert!(matches!(err, TargetError::Unsupported(m) if m.contains("x-trace")));
        assert!(requeue_command(&RedisKey::List("q".into()), &job(&[])).is_ok());
    }

    #[test]
    fn a_keyed_job_is_pushed_by_the_script_beside_its_marker() {
        let mut keyed = job(&[]);
        keyed.idempotency_key = Some("u-1-1".into());
        let cmd = requeue_command(&RedisKey::List("q".into()), &keyed).expect("a list job");
        let args = args(&cmd);
        assert_eq!(args[0], b"EVAL");
        assert_eq!(
            &args[2..],
            [
                b"2".to_vec(),
                b"q".to_vec(),
                b"q:dlq-redriven:u-1-1".to_vec(),
                b"list".to_vec(),
                b"86400".to_vec(),
                b"\x00bytes\xff".to_vec(),
            ]
        );
    }

    #[test]
    fn stream_carries_payload_and_headers() {
        let cmd = requeue_command(&RedisKey::Stream("s".into()), &job(&[("x-trace", "abc")]))
            .expect("stream carries headers");
        let args = args(&cmd);
        assert_eq!(args[0], b"XADD");
        assert_eq!(args[3], b"payload");
        assert_eq!(args[4], b"\x00bytes\xff");
        assert_eq!(args[5], b"header:x-trace");
        assert_eq!(args[6], b"abc");
    }

    /// A large job is copied once, into the command: 8 MiB holds about 8 MiB beside the job
    /// while its command is built, for a list and a stream alike.
    #[test]
    fn a_large_job_is_copied_once_into_its_command() {
        let mut large = job(&[]);
        large.payload = vec![7u8; 8 << 20].into();
        large.idempotency_key = Some("u-1-1".into());
        for key in [RedisKey::List("q".into()), RedisKey::Stream("s".into())] {
            let before = dlq_testenv::alloc::thread::start_peak();
            let cmd = requeue_command(&key, &large).expect("a command");
            let peak = dlq_testenv::alloc::thread::peak_above(before);
            assert!(
                peak < (large.payload.len() + (large.payload.len() >> 3)) as isize,
                "{key:?}: {peak} bytes beside a job of {}",
                large.payload.len()
            );
            drop(cmd);
        }
    }
}
