//! Redis, for its source (the dead list, Sidekiq's dead set) and its target: a connection that
//! reconnects lazily, and which of its errors mean "unreachable" (retried) or "refused".

use std::time::Duration;

use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;
use tokio::sync::Mutex;

use dlq_core::api::{RedisTargetSpec, SidekiqTargetSpec};

use super::BrokerError;
use super::backend::{ConnectError, SharedSecret, Sides};
use crate::secret::SecretReads;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A Redis connection that reconnects lazily after an error.
pub struct RedisConn {
    client: redis::Client,
    conn: Mutex<Option<MultiplexedConnection>>,
}

impl RedisConn {
    pub fn new(url: &str) -> Result<Self, BrokerError> {
        let client = redis::Client::open(url).map_err(|_| {
            BrokerError::Config(
                "the redis URL in the secret is not a valid redis:// or rediss:// URL".into(),
            )
        })?;
        Ok(RedisConn {
            client,
            conn: Mutex::new(None),
        })
    }

    /// A live connection, opening one if the last one failed.
    pub async fn get(&self) -> Result<MultiplexedConnection, BrokerError> {
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
    ) -> Result<T, BrokerError> {
        let mut conn = self.get().await?;
        let answer = cmd.query_async::<T>(&mut conn).await;
        self.answered(answer).await
    }

    /// Runs `pipe` (a MULTI when atomic), as [`RedisConn::query`] runs one command.
    pub async fn query_pipe<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<T, BrokerError> {
        let mut conn = self.get().await?;
        let answer = pipe.query_async::<T>(&mut conn).await;
        self.answered(answer).await
    }

    async fn answered<T>(&self, answer: redis::RedisResult<T>) -> Result<T, BrokerError> {
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
                    Err(BrokerError::Refused(e.to_string()))
                }
            }
        }
    }
}

/// A key whose size counts toward a source's backlog, by its Redis type.
#[derive(Clone, Copy, Debug)]
pub enum Counted<'a> {
    List(&'a str),
    Hash(&'a str),
    SortedSet(&'a str),
}

impl RedisConn {
    /// The summed sizes of `keys` (`LLEN`, `HLEN`, `ZCARD`; a missing key is 0), read in one
    /// round trip: how many dead messages wait there.
    pub async fn depth(&self, keys: &[Counted<'_>]) -> Result<i64, BrokerError> {
        let mut pipe = redis::pipe();
        for key in keys {
            match key {
                Counted::List(k) => pipe.llen(k),
                Counted::Hash(k) => pipe.hlen(k),
                Counted::SortedSet(k) => pipe.zcard(k),
            };
        }
        let sizes: Vec<i64> = self.query_pipe(&pipe).await?;
        Ok(sizes.iter().sum())
    }
}

fn unreachable(e: redis::RedisError) -> BrokerError {
    BrokerError::Unreachable(e.to_string())
}

/// A Redis target's URL, always from its own Secret.
pub async fn target_url(
    secrets: &mut SecretReads<'_>,
    target: &RedisTargetSpec,
) -> Result<String, ConnectError> {
    Ok(secrets.value(&target.url_secret_ref).await?)
}

/// Sidekiq's Redis URL as its target reads it: its own Secret, else the Sidekiq source's.
pub async fn sidekiq_target_url(
    secrets: &mut SecretReads<'_>,
    sides: Sides<'_, SidekiqTargetSpec>,
) -> Result<String, ConnectError> {
    let Some(url) = sides.either(|t| t.secret_ref(), |s| s.secret_ref()) else {
        let why = "sidekiq target needs urlSecretRef (or a sidekiq source with one)";
        return Err(ConnectError::Unnamed(why.into()));
    };
    Ok(secrets.value(url).await?)
}
