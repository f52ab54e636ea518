//! Amazon SQS target: `SendMessage` to the queue, confirmed by SQS's answer (it stores the
//! message before it answers).
//!
//! The body goes back byte for byte; SQS bodies are text, so a binary job (`payloadBase64`) is
//! refused rather than re-encoded. Job headers become message attributes again
//! (`dlq_core::headers::sqs`, the same codec the source parks with). On a FIFO queue the job
//! keeps its `MessageGroupId`, and the deduplication id is derived from the record, so a redrive
//! retried after a lost answer is dropped by SQS inside its 5-minute window instead of doubled.
//!
//! [`SqsConn`] (region, endpoint, credentials) is shared with the source bridge.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use futures::FutureExt;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use dlq_core::api::{Route, SqsTargetSpec};
use dlq_core::headers::sqs::{self as codec, Attribute};

use super::{JobMessage, Target, TargetError};
use crate::broker::redact_url;
use crate::broker::sqs::{AwsKeys, SqsConn};

/// Sends redriven jobs to one SQS queue (or the queue each record came from).
pub struct SqsTarget {
    queue_url: String,
    route: Route,
    conn: SqsConn,
    client: OnceCell<Arc<aws_sdk_sqs::Client>>,
}

/// A redrive answered within this, or it is `BrokerUnreachable`.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

impl SqsTarget {
    pub fn new(spec: &SqsTargetSpec, keys: Option<AwsKeys>) -> SqsTarget {
        SqsTarget {
            queue_url: spec.queue_url.clone(),
            route: spec.route.unwrap_or_default(),
            conn: SqsConn {
                region: spec
                    .region
                    .clone()
                    .or_else(|| SqsConn::region_of(&spec.queue_url)),
                endpoint: spec.endpoint.clone(),
                keys,
            },
            client: OnceCell::new(),
        }
    }

    async fn client(&self) -> Arc<aws_sdk_sqs::Client> {
        self.client
            .get_or_init(|| async { Arc::new(self.conn.client(SEND_TIMEOUT).await) })
            .await
            .clone()
    }

    /// The queue `job` goes to: its origin's (from `DeadLetterQueueSourceArn`) unless the
    /// route is `target` or it has none.
    pub fn queue_for(&self, job: &JobMessage) -> Result<String, TargetError> {
        let arn = match (
            &self.route,
            job.origin.as_ref().and_then(|o| o.queue_arn.as_ref()),
        ) {
            (Route::Origin, Some(arn)) => arn,
            _ => return Ok(self.queue_url.clone()),
        };
        let parts: Vec<&str> = arn.split(':').collect();
        let [_, _, "sqs", region, account, name] = parts.as_slice() else {
            return Err(TargetError::Invalid(format!(
                "origin queueArn {arn:?} is not an SQS queue ARN"
            )));
        };
        let base = match &self.conn.endpoint {
            Some(endpoint) => endpoint.trim_end_matches('/').to_string(),
            None if self.conn.region.as_deref() == Some(region) => {
                let host = self
                    .queue_url
                    .split_once("://")
                    .and_then(|(s, rest)| rest.split('/').next().map(|h| format!("{s}://{h}")));
                host.unwrap_or_else(|| format!("https://sqs.{region}.amazonaws.com"))
            }
            None => {
                return Err(TargetError::Refused(format!(
                    "the record came from {name} in region {region}, not this target's region; \
                     use route: target to send it to {}",
                    redact_url(&self.queue_url)
                )));
            }
        };
        Ok(format!("{base}/{account}/{name}"))
    }
}

/// The FIFO deduplication id of a redrive: the same for every enqueue of one redrive (its
/// idempotency key: record uid and cycle), different for the next cycle of the same job.
pub fn dedup_id(job: &JobMessage) -> String {
    let key = match &job.idempotency_key {
        Some(key) => format!("redrive/{key}"),
        None => format!(
            "job/{}/{}",
            job.id,
            hex::encode(Sha256::digest(&job.payload))
        ),
    };
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// The body of `job`, or why SQS cannot carry it untouched.
fn body_of(job: &JobMessage) -> Result<String, TargetError> {
    let body = String::from_utf8(job.payload.to_vec()).map_err(|_| {
        TargetError::Invalid(
            "SQS message bodies are text and this job's payload is binary (payloadBase64); \
             it is not re-encoded"
                .into(),
        )
    })?;
    if !codec::valid_body(&body) {
        return Err(TargetError::Invalid(
            "the payload holds characters SQS does not accept in a message body".into(),
        ));
    }
    Ok(body)
}

fn attribute_value(a: Attribute) -> Result<MessageAttributeValue, TargetError> {
    MessageAttributeValue::builder()
        .data_type(a.data_type)
        .set_string_value(a.string_value)
        .set_binary_value(a.binary_value.map(Blob::new))
        .build()
        .map_err(|e| TargetError::Invalid(format!("message attribute: {e}")))
}

/// An SDK error as a target failure: a service answer is a refusal (throttling and server
/// errors aside), anything else means SQS was not reached.
fn failure<E, R>(e: SdkError<E, R>) -> TargetError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match &e {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("Unknown").to_string();
            let message = se.err().message().unwrap_or_default();
            let busy = code.contains("Throttl")
                || code.contains("RequestThrottled")
                || code.contains("ServiceUnavailable")
                || code.contains("InternalError");
            if busy {
                TargetError::Unreachable(format!("SQS answered {code}: {message}"))
            } else {
                TargetError::Refused(format!("SQS answered {code}: {message}"))
            }
        }
        SdkError::ConstructionFailure(_) => {
            TargetError::Config(DisplayErrorContext(&e).to_string())
        }
        _ => TargetError::Unreachable(DisplayErrorContext(&e).to_string()),
    }
}

impl Target for SqsTarget {
    fn describe(&self) -> String {
        match self.route {
            Route::Origin => format!(
                "sqs queue {} (or the record's origin)",
                redact_url(&self.queue_url)
            ),
            Route::Target => format!("sqs queue {}", redact_url(&self.queue_url)),
        }
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        async move {
            let body = body_of(job)?;
            let (attributes, group) = codec::from_headers(&job.headers)
                .map_err(|e| TargetError::Unsupported(format!("cannot carry the headers: {e}")))?;
            let url = self.queue_for(job)?;
            let client = self.client().await;
            let mut send = client.send_message().queue_url(&url).message_body(body);
            for (name, attr) in attributes {
                send = send.message_attributes(name, attribute_value(attr)?);
            }
            if url.ends_with(".fifo") {
                send = send
                    .message_group_id(group.unwrap_or_else(|| job.id.clone()))
                    .message_deduplication_id(dedup_id(job));
            }
            let sent = send.send().await.map_err(failure)?;
            tracing::debug!(job = %job.id, queue = %redact_url(&url), message_id = sent.message_id().unwrap_or_default(), "sqs accepted the redrive");
            Ok(())
        }
        .boxed()
    }

    /// Any answer from SQS: AccessDenied counts as reachable, since redrive needs only
    /// `sqs:SendMessage`.
    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        async move {
            let client = self.client().await;
            let answer = client
                .get_queue_attributes()
                .queue_url(&self.queue_url)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await;
            match answer.map_err(failure) {
                Ok(_) => Ok(()),
                Err(TargetError::Refused(m)) if m.contains("AccessDenied") => Ok(()),
                Err(e) => Err(e),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Origin;

    fn job(arn: Option<&str>) -> JobMessage {
        JobMessage {
            id: "m-1".into(),
            payload: b"hi".to_vec().into(),
            null_payload: false,
            headers: Default::default(),
            origin: arn.map(|a| Origin {
                queue_arn: Some(a.into()),
                ..Origin::default()
            }),
            idempotency_key: Some("u-1".into()),
            key_header: None,
        }
    }

    fn target(endpoint: Option<&str>, route: Option<Route>) -> SqsTarget {
        SqsTarget::new(
            &SqsTargetSpec {
                queue_url: "https://sqs.eu-west-1.amazonaws.com/123/jobs".into(),
                endpoint: endpoint.map(Into::into),
                route,
                ..SqsTargetSpec::default()
            },
            None,
        )
    }

    #[test]
    fn records_go_back_to_the_queue_they_were_moved_from() {
        let arn = "arn:aws:sqs:eu-west-1:123:orders";
        let t = target(None, None);
        assert_eq!(
            t.queue_for(&job(Some(arn))).ok().as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123/orders")
        );
        assert_eq!(
            t.queue_for(&job(None)).ok().as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123/jobs")
        );
        let local = target(Some("http://127.0.0.1:9324/"), None);
        assert_eq!(
            local.queue_for(&job(Some(arn))).ok().as_deref(),
            Some("http://127.0.0.1:9324/123/orders")
        );
        let fixed = target(None, Some(Route::Target));
        assert_eq!(
            fixed.queue_for(&job(Some(arn))).ok().as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123/jobs")
        );
        assert!(matches!(
            t.queue_for(&job(Some("arn:aws:sqs:us-east-1:123:x"))),
            Err(TargetError::Refused(_))
        ));
    }

    #[test]
    fn binary_jobs_are_refused_and_dedup_ids_follow_the_record() {
        let mut bin = job(None);
        bin.payload = vec![0xff, 0xfe].into();
        assert!(matches!(body_of(&bin), Err(TargetError::Invalid(_))));
        let a = job(None);
        let mut next_cycle = job(None);
        next_cycle.idempotency_key = Some("u-1-2".into());
        assert_eq!(dedup_id(&a), dedup_id(&a.clone()));
        assert_ne!(dedup_id(&a), dedup_id(&next_cycle));
        assert_eq!(dedup_id(&a).len(), 64);
        assert_eq!(
            SqsConn::region_of("https://sqs.eu-west-1.amazonaws.com/1/q").as_deref(),
            Some("eu-west-1")
        );
        assert_eq!(SqsConn::region_of("http://127.0.0.1:9324/1/q"), None);
    }
}
