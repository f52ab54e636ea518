//! Redis target: LPUSH onto a list (a BRPOP/BLMOVE consumer sees FIFO order) or XADD onto a
//! stream.
//!
//! Headers: a list element is only the payload bytes, so a job with headers is refused for a
//! list target (condition + Event) rather than redriven without them. A stream entry carries
//! the payload in field `payload` and each header `k` in field `header:k`.

use std::time::Duration;

use futures::future::BoxFuture;
use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;
use tokio::sync::Mutex;

use super::{JobMessage, Target, TargetError};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Stream field holding the payload.
pub const STREAM_PAYLOAD_FIELD: &str = "payload";
/// Prefix of stream fields holding headers.
pub const STREAM_HEADER_PREFIX: &str = "header:";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisKey {
    List(String),
    Stream(String),
}

/// A Redis connection that reconnects lazily after an error.
pub struct RedisConn {
    client: redis::Client,
    conn: Mutex<Option<MultiplexedConnection>>,
}

impl RedisConn {
    pub fn new(url: &str) -> Result<Self, TargetError> {
        let client = redis::Client::open(url).map_err(|_| {
            TargetError::Config(
                "the redis URL in the secret is not a valid redis:// or rediss:// URL".into(),
            )
        })?;
        Ok(RedisConn {
            client,
            conn: Mutex::new(None),
        })
    }

    /// A live connection, opening one if the last one failed.
    pub async fn get(&self) -> Result<MultiplexedConnection, TargetError> {
        let mut slot = self.conn.lock().await;
        if let Some(conn) = slot.as_ref() {
            return Ok(conn.clone());
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(unreachable)?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Forget the connection after an I/O error so the next call reconnects.
    pub async fn reset(&self) {
        *self.conn.lock().await = None;
    }

    /// Runs `cmd`, dropping the connection when the error says it is broken.
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, TargetError> {
        let mut conn = self.get().await?;
        let answer = cmd.query_async::<T>(&mut conn).await;
        self.answered(answer).await
    }

    /// Runs `pipe` (a MULTI when atomic), as [`RedisConn::query`] runs one command.
    pub async fn query_pipe<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<T, TargetError> {
        let mut conn = self.get().await?;
        let answer = pipe.query_async::<T>(&mut conn).await;
        self.answered(answer).await
    }

    async fn answered<T>(&self, answer: redis::RedisResult<T>) -> Result<T, TargetError> {
        match answer {
            Ok(v) => Ok(v),
            Err(e) => {
                if e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                {
                    self.reset().await;
                    Err(unreachable(e))
                } else {
                    Err(TargetError::Refused(e.to_string()))
                }
            }
        }
    }
}

fn unreachable(e: redis::RedisError) -> TargetError {
    TargetError::Unreachable(e.to_string())
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

/// The command that puts `job` on `key`, or why it cannot carry it untouched.
pub fn requeue_command(key: &RedisKey, job: &JobMessage) -> Result<redis::Cmd, TargetError> {
    match key {
        RedisKey::List(list) => {
            if !job.headers.is_empty() {
                return Err(TargetError::Unsupported(format!(
                    "redis list target cannot carry headers ({}); use a stream target, or a backend with headers",
                    job.headers.keys().cloned().collect::<Vec<_>>().join(", ")
                )));
            }
            let mut cmd = redis::cmd("LPUSH");
            cmd.arg(list).arg(&job.payload[..]);
            Ok(cmd)
        }
        RedisKey::Stream(stream) => {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(stream)
                .arg("*")
                .arg(STREAM_PAYLOAD_FIELD)
                .arg(&job.payload[..]);
            for (k, v) in job.headers_with_key().iter() {
                cmd.arg(format!("{STREAM_HEADER_PREFIX}{k}")).arg(v);
            }
            Ok(cmd)
        }
    }
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
            payload: b"\x00bytes\xff".to_vec(),
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

    #[test]
    fn list_refuses_headers_rather_than_dropping_them() {
        let err = requeue_command(&RedisKey::List("q".into()), &job(&[("x-trace", "abc")]))
            .expect_err("headers must not be dropped silently");
        assert!(matches!(err, TargetError::Unsupported(m) if m.contains("x-trace")));
        assert!(requeue_command(&RedisKey::List("q".into()), &job(&[])).is_ok());
    }

    #[test]
    fn stream_carries_payload_and_headers() {
        let cmd = requeue_command(&RedisKey::Stream("s".into()), &job(&[("x-trace", "abc")]))
            .expect("stream carries headers");
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(args[0], b"XADD");
        assert_eq!(args[3], b"payload");
        assert_eq!(args[4], b"\x00bytes\xff");
        assert_eq!(args[5], b"header:x-trace");
        assert_eq!(args[6], b"abc");
    }
}
