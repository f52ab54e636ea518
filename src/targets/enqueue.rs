//! The one way a job is put on its queue's target, for a redrive (a record's job, keyed by the
//! record: `dlq_core::decide::redrive_key`) and a pass-through (a dead message a standing replay
//! covers, keyed by the message: `dlq_core::park::message_key`) alike: the job untouched, its
//! idempotency key in the queue's key header, refused before the broker when the target cannot
//! carry it as it is, answered once the broker confirmed it. Why not is an [`EnqueueError`],
//! which keeps the target's own error as its source.

use std::sync::Arc;

use dlq_core::api::{DeadLetterQueue, Job};

use super::{JobMessage, Target, TargetError, Targets};

/// Why a job did not go onto its queue's target. Each step keeps the target's words
/// ([`EnqueueError::cause`]) and their short reason ([`EnqueueError::reason`]), which
/// conditions, Events and the metrics' `reason` label use (a bounded set).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    /// The queue's target could not be had: misconfigured, its Secret unreadable, a backend
    /// this build lacks.
    #[error("no target for the queue: {source}")]
    NoTarget {
        #[source]
        source: TargetError,
    },
    /// The job cannot go as it is: no payload in hand, a body not fetched, or a value the
    /// target would alter (a Kafka tombstone, a whole Pub/Sub message).
    #[error("the job cannot go to {target} as it is: {source}")]
    Unsendable {
        target: String,
        #[source]
        source: TargetError,
    },
    /// The broker did not confirm it: unreachable, refused, a duplicate window, an HTTP status.
    #[error("{target} did not confirm the job: {source}")]
    NotConfirmed {
        target: String,
        #[source]
        source: TargetError,
    },
}

impl EnqueueError {
    /// The target's own error, whichever step it came from (what a record's `Requeued=False`
    /// condition says).
    pub fn cause(&self) -> &TargetError {
        match self {
            EnqueueError::NoTarget { source }
            | EnqueueError::Unsendable { source, .. }
            | EnqueueError::NotConfirmed { source, .. } => source,
        }
    }

    /// The target's own error, owned.
    pub fn into_cause(self) -> TargetError {
        match self {
            EnqueueError::NoTarget { source }
            | EnqueueError::Unsendable { source, .. }
            | EnqueueError::NotConfirmed { source, .. } => source,
        }
    }

    /// Short reason for conditions, Events and metric labels (one of
    /// [`TargetError::reason`]'s, so a bounded set).
    pub fn reason(&self) -> &'static str {
        self.cause().reason()
    }
}

/// A queue's target, with what every enqueue onto it carries: the queue's idempotency key
/// header. Had once per enqueue, before the job's bytes are gathered (a redrive fetching a
/// stored body does so only for a target that exists).
pub struct Destination {
    target: Arc<dyn Target>,
    key_header: Option<String>,
}

impl Destination {
    /// `queue`'s target from `targets`.
    pub async fn of(targets: &dyn Targets, queue: &DeadLetterQueue) -> Result<Self, EnqueueError> {
        let target = targets
            .target(queue)
            .await
            .map_err(|source| EnqueueError::NoTarget { source })?;
        Ok(Destination {
            target,
            key_header: queue
                .spec
                .target
                .idempotency_key_header()
                .map(str::to_string),
        })
    }

    /// Enqueues `message` untouched with idempotency key `key` (in the queue's key header when
    /// it has one), answering once the broker confirmed it.
    pub async fn enqueue(&self, mut message: JobMessage, key: String) -> Result<(), EnqueueError> {
        message.idempotency_key = Some(key);
        message.key_header.clone_from(&self.key_header);
        message
            .check_carried_by(self.target.as_ref())
            .map_err(|source| self.unsendable(source))?;
        self.target
            .requeue(&message)
            .await
            .map_err(|source| EnqueueError::NotConfirmed {
                target: self.target.describe(),
                source,
            })
    }

    fn unsendable(&self, source: TargetError) -> EnqueueError {
        EnqueueError::Unsendable {
            target: self.target.describe(),
            source,
        }
    }
}

/// Enqueues `job` (its bytes in hand) on `queue`'s target with idempotency key `key`: what a
/// pass-through sends.
pub async fn enqueue_job(
    targets: &dyn Targets,
    queue: &DeadLetterQueue,
    job: &Job,
    key: String,
) -> Result<(), EnqueueError> {
    let destination = Destination::of(targets, queue).await?;
    let message = JobMessage::from_job(job).map_err(|source| destination.unsendable(source))?;
    destination.enqueue(message, key).await
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::future::BoxFuture;

    use super::*;
    use dlq_core::api::DeadLetterQueueSpec;

    /// A target that keeps what it is given, or answers `refuse`.
    #[derive(Default)]
    struct Keep {
        got: Mutex<Vec<JobMessage>>,
        refuse: Option<TargetError>,
    }

    impl Target for Keep {
        fn describe(&self) -> String {
            "keep".into()
        }
        fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
            Box::pin(async move {
                if let Some(e) = &self.refuse {
                    return Err(e.clone());
                }
                self.got
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(job.clone());
                Ok(())
            })
        }
        fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// Gives one target to every queue, or none.
    struct One(Option<Arc<Keep>>);

    impl Targets for One {
        fn target<'a>(
            &'a self,
            _: &'a DeadLetterQueue,
        ) -> BoxFuture<'a, Result<Arc<dyn Target>, TargetError>> {
            Box::pin(async move {
                match &self.0 {
                    Some(t) => Ok(t.clone() as Arc<dyn Target>),
                    None => Err(TargetError::Config("no secret".into())),
                }
            })
        }
    }

    fn queue(key_header: Option<&str>) -> DeadLetterQueue {
        let mut queue = DeadLetterQueue::new("relayer", DeadLetterQueueSpec::default());
        queue.spec.target.idempotency_key_header = key_header.map(str::to_string);
        queue
    }

    #[tokio::test]
    async fn a_job_goes_untouched_with_its_key_in_the_queues_header() {
        let keep = Arc::new(Keep::default());
        let job = Job::from_bytes("j1", b"{}");
        enqueue_job(
            &One(Some(keep.clone())),
            &queue(Some("Idem")),
            &job,
            "k".into(),
        )
        .await
        .expect("enqueued");
        let got = keep.got.lock().expect("lock").clone();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].payload.as_ref(), b"{}");
        assert_eq!(got[0].idempotency_key.as_deref(), Some("k"));
        assert_eq!(got[0].key_header.as_deref(), Some("Idem"));
    }

    #[tokio::test]
    async fn each_step_says_why_with_the_targets_own_error_as_its_source() {
        use std::error::Error;

        let job = Job::from_bytes("j1", b"{}");
        let none = enqueue_job(&One(None), &queue(None), &job, "k".into())
            .await
            .expect_err("no target");
        assert!(matches!(none, EnqueueError::NoTarget { .. }), "{none:?}");
        assert_eq!(none.reason(), "TargetMisconfigured");

        let down = Arc::new(Keep {
            refuse: Some(TargetError::Unreachable("connection refused".into())),
            ..Keep::default()
        });
        let refused = enqueue_job(&One(Some(down)), &queue(None), &job, "k".into())
            .await
            .expect_err("refused");
        assert_eq!(refused.reason(), "BrokerUnreachable");
        assert_eq!(
            refused.to_string(),
            "keep did not confirm the job: broker unreachable: connection refused"
        );
        assert_eq!(
            refused.source().map(ToString::to_string).as_deref(),
            Some("broker unreachable: connection refused")
        );

        let keep = Arc::new(Keep::default());
        let tombstone = Job::null_value("tomb");
        let unsendable = enqueue_job(
            &One(Some(keep.clone())),
            &queue(None),
            &tombstone,
            "k".into(),
        )
        .await
        .expect_err("a null value to a target that sends an empty one");
        assert_eq!(unsendable.reason(), "NullNotCarried");
        assert!(keep.got.lock().expect("lock").is_empty());
    }
}
