//! Google Cloud Pub/Sub target: publishes a redriven job to the topic of the subscription that
//! gave up on it (or the configured topic), and answers once the server returned its message id.
//!
//! The data goes back byte for byte with the original attributes and ordering key. The
//! `CloudPubSubDeadLetter*` attributes Pub/Sub added when it dead-lettered the message stay on
//! the record but are not sent: the next dead-lettering adds them again. The redrive's
//! idempotency key rides as one more attribute (`spec.target.idempotencyKeyHeader`). A record
//! of a message parked whole (more attributes than a record holds, `dlq_core::headers::pubsub`)
//! is published as the message its payload holds, not as its payload.
//!
//! [`PubsubConn`] (emulator or Google, credentials) is shared with the source.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use google_cloud_gax::error::rpc::Code;
use google_cloud_gax::retry_policy::RetryPolicyExt;
use google_cloud_pubsub::client::{BasePublisher, Publisher, TopicAdmin};
use google_cloud_pubsub::error::PublishError;
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::retry_policy::RetryableErrors;
use tokio::sync::{Mutex, OnceCell};

use dlq_core::api::{PubsubTargetSpec, Route};
use dlq_core::headers::pubsub;

use super::{JobMessage, Target, TargetError};
use crate::broker::pubsub::{DEAD_LETTER_PREFIX, PubsubConn, resource_name};

/// A redrive answered within this, or it is `BrokerUnreachable`.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the client itself retries a publish (its default is 10 minutes). It must give up
/// before [`PUBLISH_TIMEOUT`]: a publish still retried in the background after the redrive was
/// reported failed would arrive beside the reconcile's next one, twice.
const CLIENT_RETRY_LIMIT: Duration = Duration::from_secs(20);
/// The Ready probe answered within this, or the target is unreachable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Publishes redriven jobs; one connection, one batching publisher per topic.
pub struct PubsubTarget {
    topic: Option<String>,
    route: Route,
    conn: PubsubConn,
    base: OnceCell<BasePublisher>,
    admin: OnceCell<TopicAdmin>,
    publishers: Mutex<HashMap<String, Publisher>>,
}

impl PubsubTarget {
    pub fn new(spec: &PubsubTargetSpec, key: Option<String>) -> PubsubTarget {
        PubsubTarget {
            topic: spec
                .topic
                .as_deref()
                .map(|t| resource_name(&spec.project, "topics", t)),
            route: spec.route.unwrap_or_default(),
            conn: PubsubConn { key },
            base: OnceCell::new(),
            admin: OnceCell::new(),
            publishers: Mutex::new(HashMap::new()),
        }
    }

    /// The topic `job` goes to: its origin's unless the route is `target` or it has none.
    pub fn topic_for(&self, job: &JobMessage) -> Result<String, TargetError> {
        let origin = job.origin.as_ref().and_then(|o| o.topic.as_deref());
        match (self.route, origin, &self.topic) {
            (Route::Origin, Some(topic), _) if topic.starts_with("projects/") => {
                Ok(topic.to_string())
            }
            (_, _, Some(topic)) => Ok(topic.clone()),
            _ => Err(TargetError::Config(
                "the record names no origin topic and the pubsub target has no topic".into(),
            )),
        }
    }

    async fn base(&self) -> Result<&BasePublisher, TargetError> {
        self.base
            .get_or_try_init(|| async {
                let (endpoint, creds) = self.conn.settings().map_err(TargetError::Config)?;
                let mut builder = BasePublisher::builder()
                    .with_credentials(creds)
                    .with_retry_policy(RetryableErrors.with_time_limit(CLIENT_RETRY_LIMIT));
                if let Some(endpoint) = endpoint {
                    builder = builder.with_endpoint(endpoint);
                }
                builder
                    .build()
                    .await
                    .map_err(|e| TargetError::Unreachable(format!("connecting to Pub/Sub: {e}")))
            })
            .await
    }

    async fn admin(&self) -> Result<&TopicAdmin, TargetError> {
        self.admin
            .get_or_try_init(|| async {
                let (endpoint, creds) = self.conn.settings().map_err(TargetError::Config)?;
                let mut builder = TopicAdmin::builder().with_credentials(creds);
                if let Some(endpoint) = endpoint {
                    builder = builder.with_endpoint(endpoint);
                }
                builder
                    .build()
                    .await
                    .map_err(|e| TargetError::Unreachable(format!("connecting to Pub/Sub: {e}")))
            })
            .await
    }

    async fn publisher(&self, topic: &str) -> Result<Publisher, TargetError> {
        let base = self.base().await?;
        let mut publishers = self.publishers.lock().await;
        let publisher = publishers.entry(topic.to_string()).or_insert_with(|| {
            // A redrive is one message a human waits for: no batching delay.
            base.publisher(topic.to_string())
                .set_delay_threshold(Duration::ZERO)
                .build()
        });
        Ok(publisher.clone())
    }
}

/// The message a redrive publishes: the job's data, its attributes but Pub/Sub's dead-letter
/// ones, the idempotency key's attribute, and its ordering key; for a message parked whole,
/// those of the message its payload holds. Refused when that payload is not one.
pub fn message_for(job: &JobMessage) -> Result<Message, TargetError> {
    if job.headers.contains_key(pubsub::WHOLE_HEADER) {
        return whole_message_for(job);
    }
    let ordering_key = job.origin.as_ref().and_then(|o| o.ordering_key.as_deref());
    Ok(message(
        job.payload.clone(),
        &job.headers_with_key(),
        ordering_key.unwrap_or_default(),
    ))
}

/// The message a record of a message parked whole holds, with the redrive's idempotency key.
fn whole_message_for(job: &JobMessage) -> Result<Message, TargetError> {
    let refused = |why: String| {
        TargetError::Invalid(format!(
            "job {} says its payload is a whole Pub/Sub message ({}), but it is not one: {why}",
            job.id,
            pubsub::WHOLE_HEADER
        ))
    };
    let whole = pubsub::Whole::from_payload(&job.payload).map_err(refused)?;
    let data = whole.data_bytes().map_err(refused)?;
    let with_key = JobMessage {
        id: job.id.clone(),
        payload: bytes::Bytes::new(),
        null_payload: false,
        headers: whole.attributes,
        origin: None,
        idempotency_key: job.idempotency_key.clone(),
        key_header: job.key_header.clone(),
    };
    Ok(message(
        data.into(),
        &with_key.headers_with_key(),
        &whole.ordering_key,
    ))
}

/// A message of `data`, `attributes` but Pub/Sub's dead-letter ones, and `ordering_key`.
fn message(
    data: bytes::Bytes,
    attributes: &BTreeMap<String, String>,
    ordering_key: &str,
) -> Message {
    let attributes: Vec<(String, String)> = attributes
        .iter()
        .filter(|(k, _)| !k.starts_with(DEAD_LETTER_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let msg = Message::new().set_data(data).set_attributes(attributes);
    match ordering_key {
        "" => msg,
        key => msg.set_ordering_key(key),
    }
}

/// Refused (the server will not take it as it is) or unreachable (retrying may help).
fn failure(topic: &str, e: &PublishError) -> TargetError {
    let text = format!("publishing to {topic}: {e}");
    let code = match e {
        PublishError::Rpc(e) => e.status().map(|s| s.code),
        _ => None,
    };
    match code {
        Some(
            Code::NotFound
            | Code::PermissionDenied
            | Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::Unauthenticated,
        ) => TargetError::Refused(text),
        _ => TargetError::Unreachable(text),
    }
}

impl Target for PubsubTarget {
    fn describe(&self) -> String {
        match (&self.topic, self.route) {
            (Some(t), Route::Origin) => format!("pubsub topic {t} (or the record's origin)"),
            (Some(t), Route::Target) => format!("pubsub topic {t}"),
            (None, _) => "pubsub (the record's origin topic)".to_string(),
        }
    }

    fn publishes_whole_pubsub_messages(&self) -> bool {
        true
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        async move {
            let topic = self.topic_for(job)?;
            let msg = message_for(job)?;
            let ordering_key = msg.ordering_key.clone();
            let publisher = self.publisher(&topic).await?;
            let answer = tokio::time::timeout(PUBLISH_TIMEOUT, publisher.publish(msg)).await;
            match answer {
                Ok(Ok(message_id)) => {
                    tracing::debug!(job = %job.id, topic = %topic, message_id = %message_id, "pubsub accepted the redrive");
                    Ok(())
                }
                Ok(Err(e)) => {
                    // A failed publish pauses its ordering key; the next redrive tries again.
                    if !ordering_key.is_empty() {
                        publisher.resume_publish(ordering_key);
                    }
                    Err(failure(&topic, &e))
                }
                Err(_) => Err(TargetError::Unreachable(format!(
                    "publishing to {topic}: no answer within {}s",
                    PUBLISH_TIMEOUT.as_secs()
                ))),
            }
        }
        .boxed()
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        async move {
            self.base().await?;
            let Some(topic) = &self.topic else {
                // Only origin topics, which records name: nothing to ask about.
                return Ok(());
            };
            let admin = self.admin().await?;
            let ask = admin.get_topic().set_topic(topic.clone()).send();
            match tokio::time::timeout(PROBE_TIMEOUT, ask).await {
                Err(_) => Err(TargetError::Unreachable(format!(
                    "reading topic {topic}: no answer within {}s",
                    PROBE_TIMEOUT.as_secs()
                ))),
                Ok(Ok(_)) => Ok(()),
                // Publishing needs only `pubsub.topics.publish`: a denied read still says the
                // service is there and knows the operator.
                Ok(Err(e)) => match e.status().map(|s| s.code) {
                    Some(Code::PermissionDenied) => Ok(()),
                    Some(Code::NotFound) => Err(TargetError::Refused(format!(
                        "topic {topic} does not exist"
                    ))),
                    _ => Err(TargetError::Unreachable(format!(
                        "reading topic {topic}: {e}"
                    ))),
                },
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Origin;
    use std::collections::BTreeMap;

    fn job(topic: Option<&str>) -> JobMessage {
        JobMessage {
            id: "m-1".into(),
            payload: vec![0, 159, 146, 150].into(),
            null_payload: false,
            headers: BTreeMap::from([
                ("trace".to_string(), "abc".to_string()),
                (
                    "CloudPubSubDeadLetterSourceDeliveryCount".to_string(),
                    "5".to_string(),
                ),
            ]),
            origin: Some(Origin {
                topic: topic.map(Into::into),
                ordering_key: Some("customer-7".into()),
                ..Origin::default()
            }),
            idempotency_key: Some("uid-1".into()),
            key_header: Some("Idempotency-Key".into()),
        }
    }

    fn target(topic: Option<&str>, route: Option<Route>) -> PubsubTarget {
        PubsubTarget::new(
            &PubsubTargetSpec {
                project: "p".into(),
                topic: topic.map(Into::into),
                route,
                ..PubsubTargetSpec::default()
            },
            None,
        )
    }

    #[test]
    fn records_go_back_to_their_origin_topic_unless_routed_to_the_target() {
        let origin = job(Some("projects/o/topics/orders"));
        assert_eq!(
            target(Some("jobs"), None).topic_for(&origin),
            Ok("projects/o/topics/orders".into())
        );
        assert_eq!(
            target(Some("jobs"), Some(Route::Target)).topic_for(&origin),
            Ok("projects/p/topics/jobs".into())
        );
        assert_eq!(
            target(Some("jobs"), None).topic_for(&job(None)),
            Ok("projects/p/topics/jobs".into())
        );
        let err = target(None, None)
            .topic_for(&job(None))
            .expect_err("nowhere");
        assert_eq!(err.reason(), "TargetMisconfigured");
    }

    #[test]
    fn a_message_parked_whole_is_published_as_the_message_it_holds() {
        let mut attributes: BTreeMap<String, String> = (0..100)
            .map(|i| (format!("a{i:03}"), format!("v{i}")))
            .collect();
        attributes.insert(
            "CloudPubSubDeadLetterSourceDeliveryCount".into(),
            "5".into(),
        );
        let data = [0u8, 159, 146, 150];
        let mut parked = job(None);
        parked.payload = pubsub::Whole::new(&data, &attributes, "k-9")
            .to_payload()
            .into();
        parked.headers = pubsub::held_headers(&attributes);
        let msg = message_for(&parked).expect("the message it holds");
        assert_eq!(msg.data.as_ref(), &data);
        assert_eq!(msg.ordering_key, "k-9");
        attributes.remove("CloudPubSubDeadLetterSourceDeliveryCount");
        attributes.insert("Idempotency-Key".into(), "uid-1".into());
        let sent: BTreeMap<String, String> = msg.attributes.into_iter().collect();
        assert_eq!(sent, attributes);
        parked.payload = bytes::Bytes::from_static(b"{\"data\":\"x\"}");
        let refused = message_for(&parked).expect_err("not a whole message");
        assert_eq!(
            refused.reason(),
            TargetError::Invalid(String::new()).reason()
        );
    }

    #[test]
    fn the_message_is_untouched_but_for_pubsubs_dead_letter_attributes() {
        let msg = message_for(&job(None)).expect("a message");
        assert_eq!(msg.data.as_ref(), &[0, 159, 146, 150]);
        assert_eq!(msg.ordering_key, "customer-7");
        assert_eq!(msg.attributes.get("trace").map(String::as_str), Some("abc"));
        assert_eq!(
            msg.attributes.get("Idempotency-Key").map(String::as_str),
            Some("uid-1")
        );
        assert_eq!(msg.attributes.len(), 2, "{:?}", msg.attributes);
    }
}
