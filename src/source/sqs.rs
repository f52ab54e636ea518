//! SQS source bridge: long-polls a dead-letter queue (one a RedrivePolicy feeds) and parks each
//! message, deleting it from SQS only once its record exists.
//!
//! A received message is invisible to other receivers for [`VISIBILITY`]; while parking is
//! retried (apiserver down, queue full) the bridge extends that before each wait. A crash at
//! any point leaves the message in the queue: it becomes visible again and is parked again
//! under the same job id (its `MessageId`, which SQS keeps when it moves a message to the
//! dead-letter queue), which parking deduplicates while the record is Parked.
//!
//! Each record carries: the body untouched, the message attributes as job headers
//! (`dlq_core::headers::sqs`), `deliveries` from `ApproximateReceiveCount` (less the bridge's
//! own receive), the origin queue
//! from `DeadLetterQueueSourceArn`, and a reason from a `dlq-reason` String attribute when the
//! producer set one.
//!
//! An SQS Extended Client pointer (`dlq_core::body::extended_pointer`: the body offloaded to
//! S3 by its producer) on a queue with an S3 body store is parked as it came, the pointer
//! inline, with `spec.job.body` naming the producer's object (`external`: size and digest read
//! through the store's endpoint and credentials); a redrive checks the object and sends the
//! pointer message untouched. The object is the producer's: never written or deleted here.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use kube::Client;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use dlq_client::park::ParkRequest;
use dlq_core::api::{self, DeadLetterQueue, FailureKind, Job, Origin, SqsSourceSpec};
use dlq_core::headers::sqs::{Attribute, to_headers};

use super::park_into::{ParkInto, SourceError, keep_running};
use crate::broker::backend::Sides;
use crate::broker::redact_url;
use crate::broker::sqs::SqsConn;
use crate::secret::SecretReads;

/// Messages parked at once per long poll.
const CONCURRENCY: usize = 16;
/// Long polls at once (one with the bench's `--disable=sqs_receivers`). One poll at a time
/// received at most 10 messages per round trip and then waited for 10 slots to free, so a
/// standing redrive passed SQS messages at ~870/s while ElasticMQ's own copy loop with 16
/// pollers moved 5,700/s.
pub const RECEIVERS: usize = 4;
/// How long a received message stays invisible; extended while its parking is retried.
const VISIBILITY: i32 = 30;
/// Visibility set before each retry wait (the park backoff is capped at 30 s).
const VISIBILITY_WHILE_RETRYING: i32 = 60;
/// SQS's longest long poll: an HTTP timeout beyond it.
const MAX_WAIT_SECONDS: u64 = 20;
/// The String attribute a producer may set to say why a job died.
pub const REASON_ATTRIBUTE: &str = "dlq-reason";

/// One dead message, as read from SQS.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dead {
    pub message_id: Option<String>,
    pub body: String,
    pub attributes: BTreeMap<String, Attribute>,
    /// System attributes by name (`ApproximateReceiveCount`, `DeadLetterQueueSourceArn`, ...).
    pub system: BTreeMap<String, String>,
}

impl Dead {
    /// The message's parts, its body moved out of the SDK's message (not copied).
    pub fn from_message(mut m: Message) -> Dead {
        let attributes = m
            .message_attributes()
            .map(|attrs| {
                attrs
                    .iter()
                    .map(|(name, v)| {
                        let attr = Attribute {
                            data_type: v.data_type().to_string(),
                            string_value: v.string_value().map(str::to_string),
                            binary_value: v.binary_value().map(|b| b.as_ref().to_vec()),
                        };
                        (name.clone(), attr)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let system = m
            .attributes()
            .map(|attrs| {
                attrs
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        Dead {
            message_id: m.message_id().map(str::to_string),
            body: m.body.take().unwrap_or_default(),
            attributes,
            system,
        }
    }
}

/// Turns one dead message into a park request.
pub fn request_for(queue: &str, dead: &Dead) -> ParkRequest {
    let group = dead.system.get("MessageGroupId").map(String::as_str);
    let (headers, lost) = to_headers(&dead.attributes, group);
    let id = dead
        .message_id
        .clone()
        .filter(|id| !id.is_empty() && id.len() <= api::MAX_JOB_ID_LEN)
        .unwrap_or_else(|| {
            format!(
                "sqs-{}",
                &hex::encode(Sha256::digest(dead.body.as_bytes()))[..16]
            )
        });
    let source_arn = dead.system.get("DeadLetterQueueSourceArn").cloned();
    // The count goes on in the dead-letter queue; the bridge's own receive is not a delivery
    // to the consumer.
    let deliveries: i32 = dead
        .system
        .get("ApproximateReceiveCount")
        .and_then(|n| n.parse::<i32>().ok())
        .map_or(0, |n| n.saturating_sub(1).max(0));
    let mut req = ParkRequest::of_message(
        queue,
        Job {
            id,
            headers,
            origin: source_arn.clone().map(|arn| {
                Box::new(Origin {
                    queue_arn: Some(arn),
                    ..Origin::default()
                })
            }),
            ..Job::default()
        },
        dead.body.as_bytes(),
    );
    // SQS keeps a message's id while it sits in the dead-letter queue; a redriven job that
    // dies again is sent anew and gets a new one.
    if let Some(message_id) = dead.message_id.as_deref().filter(|m| !m.is_empty()) {
        req = req.with_message(format!("sqs:{message_id}"));
    }
    req.deliveries = deliveries;
    let from = source_arn
        .as_deref()
        .and_then(|arn| arn.rsplit(':').next())
        .map_or_else(|| "its queue".to_string(), |name| format!("queue {name}"));
    req.reason = match dead.attributes.get(REASON_ATTRIBUTE) {
        Some(Attribute {
            string_value: Some(reason),
            ..
        }) => reason.clone(),
        _ => format!(
            "moved to the SQS dead-letter queue from {from} (maxReceiveCount reached after {deliveries} receives)"
        ),
    };
    if !lost.is_empty() {
        req.failure_kind = FailureKind::Invalid;
        req.reason = format!(
            "attributes beyond what a record holds were left out ({}): {}",
            lost.join(", "),
            req.reason
        );
    }
    req
}

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: SqsSourceSpec) {
    keep_running("sqs", &into, || run_once(&client, &into, &queue, &source)).await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &SqsSourceSpec,
) -> Result<(), SourceError> {
    let mut secrets = SecretReads::new(client, into.namespace());
    let conn = SqsConn::for_source(&mut secrets, Sides::of(source, &queue.spec)).await?;
    let sqs = conn
        .client(Duration::from_secs(MAX_WAIT_SECONDS + 10))
        .await;
    let bridge = Arc::new(Bridge {
        into: into.clone(),
        sqs,
        url: source.queue_url.clone(),
    });
    // Without the mechanism (the bench's A/B): one long poll and the slots of one.
    let receivers = if into.tuning().sqs_receivers {
        RECEIVERS
    } else {
        1
    };
    let slots = Arc::new(Semaphore::new(CONCURRENCY * receivers));
    let polls = (0..receivers).map(|_| receive(&bridge, &slots));
    futures::future::try_join_all(polls).await.map(|_| ())
}

/// The long poll's seconds (`--sqs-long-poll-seconds`), within SQS's 1-20.
fn long_poll_seconds(into: &ParkInto) -> i32 {
    into.tuning()
        .sqs_long_poll
        .as_secs()
        .clamp(1, MAX_WAIT_SECONDS) as i32
}

/// One long poll after another, each for as many messages as there are free slots (at most
/// 10, SQS's most), each message parked in its own task holding a slot.
async fn receive(bridge: &Arc<Bridge>, slots: &Arc<Semaphore>) -> Result<(), SourceError> {
    loop {
        // Receive only what can be parked right away: a message waiting for a slot would
        // only use up its visibility.
        let room = slots
            .clone()
            .acquire_many_owned(10)
            .await
            .map_err(SourceError::broker("waiting for parking slots"))?;
        drop(room);
        let answer = bridge
            .sqs
            .receive_message()
            .queue_url(&bridge.url)
            .max_number_of_messages(10)
            .wait_time_seconds(long_poll_seconds(&bridge.into))
            .visibility_timeout(VISIBILITY)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .map_err(|e| SourceError::Broker {
                context: format!("receiving from {}", redact_url(&bridge.url)),
                // The SDK error's own Display is only its outermost layer.
                source: Box::new(std::io::Error::other(
                    aws_sdk_sqs::error::DisplayErrorContext(e).to_string(),
                )),
            })?;
        for m in answer.messages.unwrap_or_default() {
            let permit = slots
                .clone()
                .acquire_owned()
                .await
                .map_err(SourceError::broker("waiting for a parking slot"))?;
            let bridge = bridge.clone();
            tokio::spawn(async move {
                bridge.handle(m).await;
                drop(permit);
            });
        }
    }
}

struct Bridge {
    into: ParkInto,
    sqs: aws_sdk_sqs::Client,
    url: String,
}

impl Bridge {
    /// Parks one message (retrying until it is a record, or provably never can be), then
    /// deletes it from the queue.
    async fn handle(&self, m: Message) {
        let Some(receipt) = m.receipt_handle().map(str::to_string) else {
            tracing::warn!(queue = %self.into.queue(), message_id = m.message_id().unwrap_or_default(), "SQS returned a message without a receipt handle; left for the next receive");
            return;
        };
        let mut dead = Dead::from_message(m);
        let mut req = request_for(self.into.queue(), &dead);
        let job = req.job.id.clone();
        if let Some(pointer) = dlq_core::body::extended_pointer(&dead.body, &dead.attributes) {
            self.reference_external(&mut req, &pointer, &receipt).await;
        }
        // Moved out, not copied: a large body goes to the store from this one buffer.
        let raw = bytes::Bytes::from(std::mem::take(&mut dead.body));
        let parked = self
            .into
            .park_message(
                req,
                &raw,
                "in the SQS queue (kept invisible meanwhile)",
                || self.extend(&receipt, VISIBILITY_WHILE_RETRYING),
            )
            .await;
        if let Err(e) = parked {
            // Can never be a record (over the payload limit, or refused by the apiserver even as
            // Invalid): leave it in SQS, hidden for as long as SQS allows, rather than delete
            // it; counted and announced.
            self.extend(&receipt, 12 * 3600).await;
            let kept_in = format!("SQS queue {} (message {job})", self.url);
            self.into.rejected(&e, raw.len(), &kept_in).await;
            return;
        }
        crate::failpoint::hit("sqs-before-delete").await;
        self.delete(&receipt, &job).await;
    }

    /// Sets `req.job.body` to the Extended Client object `pointer` names, read through the
    /// queue's S3 body store (its endpoint and credentials, the pointer's bucket). While the
    /// store cannot be read the message stays in SQS, kept invisible, with a
    /// `BodyStoreUnavailable` Event; an object that is gone is parked as an Invalid record of
    /// the pointer saying so. A queue without an S3 store, or whose store does not declare the
    /// pointer's bucket and prefix, parks the pointer as any message.
    async fn reference_external(
        &self,
        req: &mut ParkRequest,
        pointer: &dlq_core::body::ExtendedPointer,
        receipt: &str,
    ) {
        let reference = pointer.reference();
        let mut attempt = 0u32;
        loop {
            let Some(queue) = self.into.queue_now() else {
                return;
            };
            if queue.spec.bodies.as_ref().is_none_or(|b| b.s3.is_none()) {
                tracing::debug!(queue = %self.into.queue(), job = %req.job.id, %reference, "an SQS Extended Client pointer on a queue without an S3 body store: parked as it is");
                return;
            }
            let described = match self.into.bodies().store(&queue).await {
                Ok(Some(store)) => store.describe_external(&req.job.id, &reference).await,
                Ok(None) => return,
                Err(e) => Err(e),
            };
            let e = match described {
                Ok(body) => {
                    req.job.body = Some(Box::new(body));
                    return;
                }
                Err(e @ crate::body::BodyError::Missing { .. }) => {
                    req.failure_kind = FailureKind::Invalid;
                    req.reason = format!("{e} (an SQS Extended Client pointer): {}", req.reason);
                    return;
                }
                Err(e @ crate::body::BodyError::Outside { .. }) => {
                    // Parked as the pointer it is, its object unread and unchecked.
                    tracing::warn!(queue = %self.into.queue(), job = %req.job.id, %reference, "an SQS Extended Client pointer to an object the queue does not declare in spec.bodies.s3.externalBuckets: parked as it is");
                    req.reason = format!("{e}: {}", req.reason);
                    return;
                }
                Err(e) => e,
            };
            attempt = attempt.saturating_add(1);
            let wait = dlq_core::decide::backoff(attempt, Duration::from_secs(30));
            tracing::warn!(queue = %self.into.queue(), job = %req.job.id, %reference, error = %e, retry_in = ?wait, "reading an SQS Extended Client object failed; the dead message stays in SQS");
            if attempt == 1 || attempt.is_power_of_two() {
                let note = format!(
                    "an SQS Extended Client message (its body {reference}) waits in SQS queue {}: {e} ({})",
                    self.url,
                    e.reason()
                );
                self.into
                    .warn(dlq_core::events::reason::BODY_STORE_UNAVAILABLE, note)
                    .await;
            }
            self.extend(receipt, VISIBILITY_WHILE_RETRYING).await;
            tokio::time::sleep(wait).await;
        }
    }

    async fn extend(&self, receipt: &str, seconds: i32) {
        let answer = self
            .sqs
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .visibility_timeout(seconds)
            .send()
            .await;
        if let Err(e) = answer {
            tracing::warn!(queue = %self.into.queue(), error = %aws_sdk_sqs::error::DisplayErrorContext(e), "extending a dead message's visibility failed");
        }
    }

    /// Deletes a parked message, retrying: the record exists, so giving up only leaves a
    /// duplicate for the next receive (deduplicated), never a loss.
    async fn delete(&self, receipt: &str, job: &str) {
        for attempt in 0..10u32 {
            let answer = self
                .sqs
                .delete_message()
                .queue_url(&self.url)
                .receipt_handle(receipt)
                .send()
                .await;
            match answer {
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(queue = %self.into.queue(), job, error = %aws_sdk_sqs::error::DisplayErrorContext(e), "deleting a parked message from SQS failed; retrying");
                    tokio::time::sleep(dlq_core::decide::backoff(attempt, Duration::from_secs(5)))
                        .await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_messages_become_records_with_their_origin_and_receive_count() {
        let dead = Dead {
            message_id: Some("5fea7756-0ea4-451a-a703-a558b933e274".into()),
            body: r#"{"intent":"pi_1"}"#.into(),
            attributes: [("trace".to_string(), Attribute::string("abc"))].into(),
            system: [
                ("ApproximateReceiveCount".to_string(), "4".to_string()),
                (
                    "DeadLetterQueueSourceArn".to_string(),
                    "arn:aws:sqs:eu-west-1:123:jobs".to_string(),
                ),
            ]
            .into(),
        };
        let req = request_for("relayer", &dead);
        assert_eq!(req.job.id, "5fea7756-0ea4-451a-a703-a558b933e274");
        assert_eq!(req.job.payload.as_deref(), Some(r#"{"intent":"pi_1"}"#));
        assert_eq!(
            req.job.headers.get("trace").map(String::as_str),
            Some("abc")
        );
        assert_eq!(req.deliveries, 3);
        assert_eq!(
            req.job.origin.and_then(|o| o.queue_arn).as_deref(),
            Some("arn:aws:sqs:eu-west-1:123:jobs")
        );
        assert!(req.reason.contains("queue jobs"), "{}", req.reason);
        let mut said = dead.clone();
        said.attributes
            .insert(REASON_ATTRIBUTE.into(), Attribute::string("bad schema"));
        assert_eq!(request_for("relayer", &said).reason, "bad schema");
    }
}
