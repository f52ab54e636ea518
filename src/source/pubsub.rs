//! Google Cloud Pub/Sub source bridge: streaming pull on a subscription of a dead-letter topic
//! (one a subscription's dead-letter policy feeds), each message parked and acknowledged only
//! once its record exists.
//!
//! While a message is being parked (apiserver down, queue full) the client's lease management
//! keeps extending its ack deadline, for up to [`MAX_LEASE`]. A crash at any point leaves the
//! message unacknowledged: Pub/Sub redelivers it, and its identity (subscription and message
//! id) finds the record already made.
//!
//! A message whose attributes a record cannot all hold (more than 64, Pub/Sub allows 100; a
//! name that is not a token) is parked whole as an Invalid record and acknowledged: its payload
//! is the message as JSON, every attribute in it (`dlq_core::headers::pubsub`), its headers
//! what a record can hold, and a redrive publishes the very same message again. Left in the
//! subscription instead, it was redelivered for as long as the subscription kept it.
//!
//! Each record carries: the data untouched, every attribute as a job header (the
//! `CloudPubSubDeadLetter*` ones too; the target does not send those back), the job id from
//! `jobIdAttribute` or the message id, `deliveries` from
//! `CloudPubSubDeadLetterSourceDeliveryCount`, and as origin the subscription that gave up
//! (`CloudPubSubDeadLetterSourceSubscription` and its project), that subscription's topic
//! (looked up once per subscription) and the ordering key.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use google_cloud_pubsub::client::{Subscriber, SubscriptionAdmin};
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::subscriber::handler::Handler;
use kube::Client;
use tokio::sync::{Mutex, Semaphore};

use dlq_client::park::{ParkInvalid, ParkRequest};
use dlq_core::api::{self, DeadLetterQueue, FailureKind, Job, Origin, PubsubSourceSpec};
use dlq_core::headers::pubsub::{Whole, held_headers, unholdable};

use super::park_into::{ParkInto, SourceError, keep_running};
use crate::broker::backend::Sides;
use crate::broker::pubsub::{PubsubConn, resource_name};
use crate::secret::SecretReads;

/// Messages parked at once.
const CONCURRENCY: usize = 16;
/// Messages the server hands this bridge before it acknowledges some.
const MAX_OUTSTANDING: i64 = 64;
/// How long the client keeps extending a message's lease while it is being parked.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
/// The deadline each lease extension asks for: what a crashed operator's messages wait before
/// the server hands them out again (the client's default, 60 s, outlasted a standing replay's
/// quiet and left them to be parked after it ended).
const LEASE_EXTENSION: Duration = Duration::from_secs(10);
/// How long a message that can never be a record is held (then released for redelivery), so it
/// does not come straight back.
const REJECTED_HOLD: Duration = Duration::from_secs(3600);
/// How long the topic of a subscription is asked for before the message parks without it.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);
/// The attribute a producer may set to say why a job died.
pub const REASON_ATTRIBUTE: &str = "dlq-reason";
/// Attributes Pub/Sub adds when it dead-letters a message.
pub const DELIVERY_COUNT: &str = "CloudPubSubDeadLetterSourceDeliveryCount";
pub const SOURCE_SUBSCRIPTION: &str = "CloudPubSubDeadLetterSourceSubscription";
pub const SOURCE_PROJECT: &str = "CloudPubSubDeadLetterSourceSubscriptionProject";

/// One dead message, as read from the subscription.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dead {
    pub message_id: String,
    /// The message's bytes, shared with the client's message (not copied).
    pub data: bytes::Bytes,
    pub attributes: BTreeMap<String, String>,
    pub ordering_key: String,
}

impl Dead {
    pub fn from_message(m: &Message) -> Dead {
        Dead {
            message_id: m.message_id.clone(),
            data: m.data.clone(),
            attributes: m
                .attributes
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            ordering_key: m.ordering_key.clone(),
        }
    }

    /// The subscription that gave up on it, as a resource name (`project` when Pub/Sub did not
    /// name one).
    pub fn source_subscription(&self, project: &str) -> Option<String> {
        let sub = self.attributes.get(SOURCE_SUBSCRIPTION)?;
        let project = self
            .attributes
            .get(SOURCE_PROJECT)
            .map_or(project, String::as_str);
        Some(resource_name(project, "subscriptions", sub))
    }
}

/// Turns one dead message into a park request and the exact bytes it parks: the message's data,
/// or the whole message as JSON when its attributes cannot all be headers ([`whole`]);
/// `subscription` is the dead-letter subscription it was pulled from, `origin_topic` the topic
/// of the subscription that gave up on it.
pub fn request_for(
    queue: &str,
    subscription: &str,
    spec: &PubsubSourceSpec,
    dead: &Dead,
    origin_topic: Option<String>,
) -> (ParkRequest, bytes::Bytes) {
    let own_id = spec
        .job_id_attribute
        .as_ref()
        .and_then(|a| dead.attributes.get(a))
        .filter(|id| !id.is_empty() && id.len() <= api::MAX_JOB_ID_LEN);
    let id = own_id.unwrap_or(&dead.message_id).clone();
    let counted = dead
        .attributes
        .get(DELIVERY_COUNT)
        .and_then(|n| n.parse::<i32>().ok())
        .map(|n| n.max(0));
    let deliveries = counted.unwrap_or(0);
    let source = dead.source_subscription(&spec.project);
    let origin = Origin {
        subscription: source.clone(),
        topic: origin_topic,
        ordering_key: Some(dead.ordering_key.clone()).filter(|k| !k.is_empty()),
        ..Origin::default()
    };
    let unheld = unholdable(&dead.attributes);
    let (headers, raw) = match &unheld {
        None => (dead.attributes.clone(), dead.data.clone()),
        Some(_) => (held_headers(&dead.attributes), whole_bytes(dead)),
    };
    let mut req = ParkRequest::of_message(
        queue,
        Job {
            id,
            headers,
            origin: (origin != Origin::default()).then(|| Box::new(origin)),
            ..Job::default()
        },
        &raw,
    );
    // The message id is the message's identity in its dead-letter subscription: a redelivery
    // after a crash carries the same one, a redriven job that dies again a new one.
    if !dead.message_id.is_empty() {
        req = req.with_message(format!("pubsub:{subscription}/{}", dead.message_id));
    }
    req.deliveries = deliveries;
    let from = source.map_or_else(
        || "its subscription".to_string(),
        |s| format!("subscription {s}"),
    );
    req.reason = match dead.attributes.get(REASON_ATTRIBUTE) {
        Some(reason) if !reason.is_empty() => reason.clone(),
        _ => match counted {
            Some(n) => format!(
                "dead-lettered by Pub/Sub from {from} (maxDeliveryAttempts reached after {n} deliveries)"
            ),
            None => format!("dead-lettered by Pub/Sub from {from} (maxDeliveryAttempts reached)"),
        },
    };
    if let Some(why) = unheld {
        whole(&mut req, dead, &why);
    }
    (req, raw)
}

/// The whole message as its record's payload (canonical JSON of `dlq_core::headers::pubsub::Whole`).
fn whole_bytes(dead: &Dead) -> bytes::Bytes {
    let whole = Whole::new(&dead.data, &dead.attributes, &dead.ordering_key);
    bytes::Bytes::from(whole.to_payload())
}

/// Makes `req` the Invalid record of a message parked whole, its reason saying why and what a
/// redrive does.
fn whole(req: &mut ParkRequest, dead: &Dead, why: &ParkInvalid) {
    let said = |why: String| {
        format!(
            "its {} attributes cannot all be a record's headers ({why}): parked whole, the payload is the message as JSON (its data, every attribute, its ordering key) and a redrive publishes that very message; {}",
            dead.attributes.len(),
            req.reason
        )
    };
    let (reason, sealed) = (said(why.to_string()), said(why.without_values()));
    req.failure_kind = FailureKind::Invalid;
    req.reason = reason;
    req.sealed_reason = Some(sealed);
}

/// Runs one bridge until aborted.
pub async fn run(client: Client, into: ParkInto, queue: DeadLetterQueue, source: PubsubSourceSpec) {
    keep_running("pubsub", &into, || {
        run_once(&client, &into, &queue, &source)
    })
    .await
}

async fn run_once(
    client: &Client,
    into: &ParkInto,
    queue: &DeadLetterQueue,
    source: &PubsubSourceSpec,
) -> Result<(), SourceError> {
    let mut secrets = SecretReads::new(client, into.namespace());
    let conn = PubsubConn::read(&mut secrets, Sides::of(source, &queue.spec)).await?;
    let (endpoint, creds) = conn.settings().map_err(SourceError::Config)?;
    let mut subscriber = Subscriber::builder().with_credentials(creds.clone());
    let mut admin = SubscriptionAdmin::builder().with_credentials(creds);
    if let Some(endpoint) = endpoint {
        subscriber = subscriber.with_endpoint(endpoint.clone());
        admin = admin.with_endpoint(endpoint);
    }
    let subscriber = subscriber
        .build()
        .await
        .map_err(SourceError::broker("connecting to Pub/Sub"))?;
    let admin = admin
        .build()
        .await
        .map_err(SourceError::broker("connecting to Pub/Sub"))?;
    let subscription = resource_name(&source.project, "subscriptions", &source.subscription);
    let mut stream = subscriber
        .subscribe(subscription.clone())
        .set_max_lease(MAX_LEASE)
        .set_max_lease_extension(LEASE_EXTENSION)
        .set_max_outstanding_messages(MAX_OUTSTANDING)
        .build();
    let bridge = Arc::new(Bridge {
        into: into.clone(),
        admin,
        spec: source.clone(),
        subscription,
        topics: Mutex::new(HashMap::new()),
    });
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    while let Some(next) = stream.next().await {
        let (m, handler) = next.map_err(|e| SourceError::Broker {
            context: format!("pulling from {}", bridge.subscription),
            source: Box::new(e),
        })?;
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .map_err(SourceError::broker("waiting for a parking slot"))?;
        let bridge = bridge.clone();
        tokio::spawn(async move {
            bridge.handle(m, handler, permit).await;
        });
    }
    Ok(())
}

struct Bridge {
    into: ParkInto,
    admin: SubscriptionAdmin,
    spec: PubsubSourceSpec,
    /// The dead-letter subscription pulled, as a resource name.
    subscription: String,
    /// Origin subscription → its topic, looked up once each.
    topics: Mutex<HashMap<String, String>>,
}

impl Bridge {
    /// Parks one message (retrying until it is a record, or provably never can be), then
    /// acknowledges it.
    async fn handle(
        &self,
        m: Message,
        handler: Handler,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let dead = Dead::from_message(&m);
        let origin_topic = match dead.source_subscription(&self.spec.project) {
            Some(sub) => self.topic_of(&sub).await,
            None => None,
        };
        let (req, raw) = request_for(
            self.into.queue(),
            &self.subscription,
            &self.spec,
            &dead,
            origin_topic,
        );
        let job = req.job.id.clone();
        // The client extends the message's lease by itself while the handler is held: nothing
        // to tell the server while parking waits.
        let parked = self
            .into
            .park_message(
                req,
                &raw,
                "in the Pub/Sub subscription (its lease extended meanwhile)",
                || async {},
            )
            .await;
        if let Err(e) = parked {
            // Can never be a record (over the payload limit, or refused by the apiserver even
            // as Invalid): left unacknowledged in Pub/Sub, held a while so it does not come
            // straight back; counted and announced.
            drop(permit);
            let kept_in = format!(
                "Pub/Sub subscription {} (message {})",
                self.subscription, dead.message_id
            );
            self.into.rejected(&e, dead.data.len(), &kept_in).await;
            tokio::time::sleep(REJECTED_HOLD).await;
            handler.nack();
            return;
        }
        crate::failpoint::hit("pubsub-before-ack").await;
        // Best effort, as every ack: a lost one only redelivers the message, whose identity
        // finds its record.
        handler.ack();
        tracing::debug!(queue = %self.into.queue(), job, message_id = %dead.message_id, "parked Pub/Sub message acknowledged");
        drop(permit);
    }

    /// The topic subscription `sub` reads, asked once; None (the record then has no origin
    /// topic and goes to the target's) when the server does not say.
    async fn topic_of(&self, sub: &str) -> Option<String> {
        if let Some(topic) = self.topics.lock().await.get(sub) {
            return Some(topic.clone());
        }
        let ask = self.admin.get_subscription().set_subscription(sub).send();
        let answer = tokio::time::timeout(LOOKUP_TIMEOUT, ask).await;
        match answer {
            Err(_) => {
                tracing::warn!(queue = %self.into.queue(), subscription = sub, "no answer about the topic of the subscription that dead-lettered a message; its record goes to the target's topic");
                None
            }
            Ok(Ok(s)) if !s.topic.is_empty() && s.topic != "_deleted-topic_" => {
                self.topics
                    .lock()
                    .await
                    .insert(sub.to_string(), s.topic.clone());
                Some(s.topic)
            }
            Ok(Ok(_)) => None,
            Ok(Err(e)) => {
                tracing::warn!(queue = %self.into.queue(), subscription = sub, error = %e, "cannot read the topic of the subscription that dead-lettered a message (roles/pubsub.viewer on it?); its record goes to the target's topic");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(job_id_attribute: Option<&str>) -> PubsubSourceSpec {
        PubsubSourceSpec {
            project: "shop".into(),
            subscription: "relayer-dead".into(),
            job_id_attribute: job_id_attribute.map(Into::into),
            ..PubsubSourceSpec::default()
        }
    }

    fn dead() -> Dead {
        Dead {
            message_id: "1234567".into(),
            data: bytes::Bytes::from_static(&[0xff, 0x00, b'x']),
            attributes: [
                ("trace", "abc"),
                ("job", "pi_0003/settle"),
                (DELIVERY_COUNT, "5"),
                (SOURCE_SUBSCRIPTION, "relayer"),
                (SOURCE_PROJECT, "payments"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ordering_key: "customer-7".into(),
        }
    }

    #[test]
    fn dead_messages_become_records_with_their_origin_and_delivery_count() {
        let sub = "projects/shop/subscriptions/relayer-dead";
        let (req, raw) = request_for(
            "relayer",
            sub,
            &spec(None),
            &dead(),
            Some("projects/payments/topics/relayer".into()),
        );
        assert_eq!(raw, dead().data, "the message's data");
        assert_eq!(req.job.id, "1234567");
        assert_eq!(
            req.job.payload, None,
            "binary data is kept as payloadBase64"
        );
        assert_eq!(
            req.job.payload_bytes().expect("bytes"),
            vec![0xff, 0x00, b'x']
        );
        assert_eq!(req.job.headers, dead().attributes);
        assert_eq!(req.deliveries, 5);
        let origin = req.job.origin.as_deref().cloned().expect("origin");
        assert_eq!(
            origin.subscription.as_deref(),
            Some("projects/payments/subscriptions/relayer")
        );
        assert_eq!(
            origin.topic.as_deref(),
            Some("projects/payments/topics/relayer")
        );
        assert_eq!(origin.ordering_key.as_deref(), Some("customer-7"));
        assert!(
            req.reason
                .contains("projects/payments/subscriptions/relayer"),
            "{}",
            req.reason
        );
        let (own, _) = request_for("relayer", sub, &spec(Some("job")), &dead(), None);
        assert_eq!(own.job.id, "pi_0003/settle");
    }

    #[test]
    fn attributes_a_record_cannot_hold_park_the_message_whole() {
        let sub = "projects/shop/subscriptions/relayer-dead";
        let mut many = dead();
        many.attributes
            .extend((0..96).map(|i| (format!("a{i:02}"), "v".to_string())));
        let (req, raw) = request_for("relayer", sub, &spec(None), &many, None);
        assert_eq!(req.failure_kind, FailureKind::Invalid);
        assert_eq!(req.job.id, "1234567", "the job keeps its id");
        assert_eq!(req.deliveries, 5);
        assert_eq!(req.job.payload_bytes().expect("bytes"), raw.to_vec());
        let whole = Whole::from_payload(&raw).expect("the whole message");
        assert_eq!(whole.attributes, many.attributes, "every attribute");
        assert_eq!(whole.data_bytes().expect("data"), many.data.to_vec());
        assert_eq!(whole.ordering_key, "customer-7");
        assert_eq!(req.job.headers.len(), api::MAX_HEADERS);
        assert!(dlq_core::park::validate(&req).is_ok(), "a record holds it");
        assert!(
            req.reason.starts_with("its 101 attributes cannot all be a record's headers (101 headers; at most 64)")
                && req
                    .reason
                    .ends_with("dead-lettered by Pub/Sub from subscription projects/payments/subscriptions/relayer (maxDeliveryAttempts reached after 5 deliveries)"),
            "{}",
            req.reason
        );
        let mut spaced = dead();
        spaced.attributes.insert("not a token".into(), "v".into());
        let (req, _) = request_for("relayer", sub, &spec(None), &spaced, None);
        assert_eq!(req.failure_kind, FailureKind::Invalid);
        assert!(req.reason.contains("\"not a token\""), "{}", req.reason);
        let sealed = req.sealed_reason.expect("a sealed reason");
        assert!(!sealed.contains("not a token"), "{sealed}");
    }

    #[test]
    fn a_message_without_pubsubs_attributes_still_parks() {
        let bare = Dead {
            message_id: "m0".into(),
            data: bytes::Bytes::from_static(b"{}"),
            ..Dead::default()
        };
        let (req, _) = request_for(
            "relayer",
            "projects/shop/subscriptions/d",
            &spec(None),
            &bare,
            None,
        );
        assert_eq!(req.job.id, "m0");
        assert_eq!(req.deliveries, 0);
        assert!(req.job.origin.is_none());
        assert!(
            req.reason
                .ends_with("from its subscription (maxDeliveryAttempts reached)"),
            "{}",
            req.reason
        );
    }
}
