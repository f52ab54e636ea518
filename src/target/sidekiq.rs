//! Sidekiq target: pushes the job's JSON, untouched, onto `queue:<its queue>` (the job's own
//! `queue` field) and adds the queue to `queues`, in one MULTI, as Sidekiq's client enqueues,
//! so an unmodified Sidekiq process runs it. Under a redis-namespace both keys carry its prefix.
//!
//! A Sidekiq queue element is the job JSON alone: there is nowhere to put headers, so a job with
//! headers is refused (as by a Redis list target) and the redrive's idempotency key is never
//! carried. The job's `jid` is the same on every redrive; a worker that must not run twice
//! keys on it.

use futures::future::BoxFuture;

use super::redis::RedisConn;
use super::{JobMessage, Target, TargetError};

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

    /// The MULTI that enqueues `job` as Sidekiq's client does, or why it cannot go untouched.
    pub fn enqueue(&self, job: &JobMessage) -> Result<redis::Pipeline, TargetError> {
        if !job.headers.is_empty() {
            return Err(TargetError::Unsupported(format!(
                "a Sidekiq queue cannot carry headers ({}); redrive it to a backend with headers",
                job.headers.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        let queue = dlq_core::sidekiq::job_queue(&job.payload).map_err(TargetError::Invalid)?;
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("SADD")
            .arg(format!("{}queues", self.prefix))
            .arg(&queue)
            .ignore()
            .cmd("LPUSH")
            .arg(format!("{}queue:{queue}", self.prefix))
            .arg(&job.payload[..]);
        Ok(pipe)
    }
}

impl Target for SidekiqTarget {
    fn describe(&self) -> String {
        format!("sidekiq {}queue:<the job's queue>", self.prefix)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let pipe = self.enqueue(job)?;
            // EXEC's answer (the list's new length) is Redis's confirmation that it holds the job.
            let _: redis::Value = self.conn.query_pipe(&pipe).await?;
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
            payload: payload.to_vec(),
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

    fn args(pipe: &redis::Pipeline) -> Vec<Vec<Vec<u8>>> {
        pipe.cmd_iter()
            .map(|c| {
                c.args_iter()
                    .map(|a| match a {
                        redis::Arg::Simple(b) => b.to_vec(),
                        _ => Vec::new(),
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_job_goes_untouched_onto_its_own_queue_without_the_key() {
        let t = SidekiqTarget::new("redis://127.0.0.1:1/", Some("myapp")).expect("target");
        let raw = br#"{"queue":"payments","jid":"b4a5","class":"SettleJob","args":[1]}"#;
        let cmds = args(&t.enqueue(&job(raw, &[])).expect("enqueued"));
        assert_eq!(
            cmds[0],
            vec![
                b"SADD".to_vec(),
                b"myapp:queues".to_vec(),
                b"payments".to_vec()
            ]
        );
        assert_eq!(
            cmds[1],
            vec![
                b"LPUSH".to_vec(),
                b"myapp:queue:payments".to_vec(),
                raw.to_vec()
            ],
            "byte-identical, and no idempotency key anywhere"
        );
    }

    #[test]
    fn headers_and_jobs_without_a_queue_are_refused() {
        let t = SidekiqTarget::new("redis://127.0.0.1:1/", None).expect("target");
        let err = t
            .enqueue(&job(br#"{"queue":"q"}"#, &[("x-trace", "t")]))
            .expect_err("headers");
        assert_eq!(err.reason(), "HeadersNotCarried");
        let err = t.enqueue(&job(b"not json", &[])).expect_err("no queue");
        assert_eq!(err.reason(), "InvalidJob");
    }
}
