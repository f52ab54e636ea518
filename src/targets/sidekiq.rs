//! Sidekiq target: pushes the job's JSON, untouched, onto `queue:<its queue>` (the job's own
//! `queue` field) and adds the queue to `queues`, atomically, as Sidekiq's client enqueues, so
//! an unmodified Sidekiq process runs it. Under a redis-namespace both keys carry its prefix.
//!
//! Deduplicated in Redis itself, as the Redis target is: with the redrive's idempotency key the
//! push is one script ([`PUSH_ONCE`]) that also sets a marker
//! `queue:<queue>:dlq-redriven:<key>` (kept [`MARKER_TTL`]) and pushes nothing when the marker
//! is there, so an enqueue whose answer was lost and is retried, or repeated by the next
//! leader, adds no second job. Without a key it is a MULTI of SADD and LPUSH.
//!
//! A Sidekiq queue element is the job JSON alone: there is nowhere to put headers, so a job with
//! headers is refused (as by a Redis list target) and the idempotency key never reaches the
//! worker. The job's `jid` is the same on every redrive; a worker that must not run twice
//! keys on it.

use futures::future::BoxFuture;

use super::redis::{MARKER_TTL, marker};
use super::{JobMessage, Target, TargetError};
use crate::broker::redis::RedisConn;

/// Adds the queue to `queues` and pushes the job unless the redrive's marker exists, then sets
/// the marker; the push first, so that a push Redis refuses leaves no marker. KEYS: queues,
/// `queue:<queue>`, the marker. ARGV: the queue, the marker's lifetime (s), the job. Returns 1
/// when pushed, 0 when the marker said it was already.
const PUSH_ONCE: &str = r"
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], '1', 'EX', ARGV[2])
return 1
";

/// How a job goes onto its queue: one script or one MULTI.
pub enum Enqueue {
    Once(redis::Cmd),
    Multi(redis::Pipeline),
}

pub struct SidekiqTarget {
    conn: RedisConn,
    /// `<namespace>:` or nothing.
    prefix: String,
}

impl SidekiqTarget {
    pub fn new(url: &str, namespace: Option<&str>) -> Result<Self, TargetError> {
        Ok(SidekiqTarget {
            conn: RedisConn::new(url)?,
            prefix: namespace.map_or_else(String::new, |n| format!("{n}:")),
        })
    }

    /// What enqueues `job` as Sidekiq's client does (see the module doc), or why it cannot go
    /// untouched.
    pub fn enqueue(&self, job: &JobMessage) -> Result<Enqueue, TargetError> {
        if !job.headers.is_empty() {
            return Err(TargetError::Unsupported(format!(
                "a Sidekiq queue cannot carry headers ({}); redrive it to a backend with headers",
                job.headers.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        let queue = dlq_core::sidekiq::job_queue(&job.payload).map_err(TargetError::Invalid)?;
        let queues = format!("{}queues", self.prefix);
        let list = format!("{}queue:{queue}", self.prefix);
        if let Some(key) = &job.idempotency_key {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(PUSH_ONCE)
                .arg(3)
                .arg(&queues)
                .arg(&list)
                .arg(marker(&list, key))
                .arg(&queue)
                .arg(MARKER_TTL.as_secs())
                .arg(&job.payload[..]);
            return Ok(Enqueue::Once(cmd));
        }
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("SADD")
            .arg(&queues)
            .arg(&queue)
            .ignore()
            .cmd("LPUSH")
            .arg(&list)
            .arg(&job.payload[..]);
        Ok(Enqueue::Multi(pipe))
    }
}

impl Target for SidekiqTarget {
    fn describe(&self) -> String {
        format!("sidekiq {}queue:<the job's queue>", self.prefix)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            // The answer (pushed, already pushed, or EXEC's new length) is Redis's
            // confirmation that it holds the job.
            let _: redis::Value = match self.enqueue(job)? {
                Enqueue::Once(cmd) => self.conn.query(&cmd).await?,
                Enqueue::Multi(pipe) => self.conn.query_pipe(&pipe).await?,
            };
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
    use std::collections::BTreeMap;

    use super::*;

    fn job(payload: &[u8], headers: &[(&str, &str)]) -> JobMessage {
        JobMessage {
            id: "b4a5".into(),
            payload: payload.to_vec().into(),
            null_payload: false,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            origin: None,
            idempotency_key: Some("u-1".into()),
            key_header: Some("Idempotency-Key".into()),
        }
    }

    fn words(cmd: &redis::Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    const RAW: &[u8] = br#"{"queue":"payments","jid":"b4a5","class":"SettleJob","args":[1]}"#;

    #[test]
    fn the_job_goes_untouched_onto_its_own_queue_once_per_redrive() {
        let t = SidekiqTarget::new("redis://127.0.0.1:1/", Some("myapp")).expect("target");
        let Enqueue::Once(cmd) = t.enqueue(&job(RAW, &[])).expect("enqueued") else {
            panic!("a job with a key is pushed once");
        };
        let w = words(&cmd);
        assert_eq!(w[0], b"EVAL");
        assert_eq!(
            &w[2..6],
            &[
                b"3".to_vec(),
                b"myapp:queues".to_vec(),
                b"myapp:queue:payments".to_vec(),
                b"myapp:queue:payments:dlq-redriven:u-1".to_vec()
            ]
        );
        assert_eq!(w[6], b"payments");
        assert_eq!(
            w[8], RAW,
            "byte-identical, the key only in the marker's name"
        );
    }

    #[test]
    fn without_a_key_it_is_a_multi_of_sadd_and_lpush() {
        let t = SidekiqTarget::new("redis://127.0.0.1:1/", None).expect("target");
        let mut keyless = job(RAW, &[]);
        keyless.idempotency_key = None;
        let Enqueue::Multi(pipe) = t.enqueue(&keyless).expect("enqueued") else {
            panic!("no key, no marker");
        };
        let cmds: Vec<Vec<Vec<u8>>> = pipe.cmd_iter().map(words).collect();
        assert_eq!(
            cmds[0],
            vec![b"SADD".to_vec(), b"queues".to_vec(), b"payments".to_vec()]
        );
        assert_eq!(
            cmds[1],
            vec![b"LPUSH".to_vec(), b"queue:payments".to_vec(), RAW.to_vec()]
        );
    }

    #[test]
    fn headers_and_jobs_without_a_queue_are_refused() {
        let t = SidekiqTarget::new("redis://127.0.0.1:1/", None).expect("target");
        let err = t
            .enqueue(&job(br#"{"queue":"q"}"#, &[("x-trace", "t")]))
            .err()
            .expect("headers");
        assert_eq!(err.reason(), "HeadersNotCarried");
        let err = t.enqueue(&job(b"not json", &[])).err().expect("no queue");
        assert_eq!(err.reason(), "InvalidJob");
    }
}
