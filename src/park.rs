//! Parking: turning a job a consumer gave up on into a `DeadLetter` record, once.
//!
//! A record is created with a plain create (POST) under the field manager `dlq-parker`: the
//! create is the atomic step that makes racing parkers safe (the loser gets AlreadyExists,
//! re-reads, and answers AlreadyParked). The parker only ever owns the parked facts, never
//! `action`/`by`/`note`, so a GitOps server-side apply of a decision does not conflict with it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use crate::api::{
    self, DeadLetter, DeadLetterQueue, DeadLetterSpec, FailureKind, IntentSnapshot, Job, Phase,
};

/// Field manager of every record the parker creates.
pub const PARKER: &str = "dlq-parker";

/// Everything known about a given-up job.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkRequest {
    /// The DeadLetterQueue (same namespace) the job came from.
    pub queue: String,
    /// The untouched job.
    pub job: Job,
    pub intent: Option<IntentSnapshot>,
    /// Deliveries in this cycle.
    pub deliveries: i32,
    pub reason: String,
    pub failure_kind: FailureKind,
    pub service_version: Option<String>,
    /// When the consumer gave up; now when None.
    pub failed_at: Option<jiff::Timestamp>,
}

impl ParkRequest {
    /// A request with only the required parts; set the rest as fields.
    pub fn new(queue: impl Into<String>, job: Job) -> Self {
        ParkRequest {
            queue: queue.into(),
            job,
            intent: None,
            deliveries: 0,
            reason: String::new(),
            failure_kind: FailureKind::Transient,
            service_version: None,
            failed_at: None,
        }
    }
}

/// What parking did.
#[derive(Debug, Clone)]
pub enum ParkOutcome {
    /// A new record (a new cycle when earlier ones were resolved).
    Parked(Box<DeadLetter>),
    /// The job already has a Parked record; nothing changed.
    AlreadyParked(Box<DeadLetter>),
}

impl ParkOutcome {
    pub fn record(&self) -> &DeadLetter {
        match self {
            ParkOutcome::Parked(r) | ParkOutcome::AlreadyParked(r) => r,
        }
    }

    pub fn is_new(&self) -> bool {
        matches!(self, ParkOutcome::Parked(_))
    }
}

/// Why a park was refused. Each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error("missing job id")]
    MissingJobId,
    #[error("job id is {len} bytes; at most {max}")]
    JobIdTooLong { len: usize, max: usize },
    #[error("missing queue")]
    MissingQueue,
    #[error("queue name {0:?} is not a valid Kubernetes name (lower-case letters, digits, '-')")]
    BadQueueName(String),
    #[error("unknown queue: no DeadLetterQueue {queue} in namespace {namespace}")]
    UnknownQueue { namespace: String, queue: String },
    #[error("job has both payload and payloadBase64; give exactly one")]
    BothPayloadForms,
    #[error("job has no payload; give payload (UTF-8) or payloadBase64 (bytes)")]
    NoPayload,
    #[error("payloadBase64 is not valid base64: {0}")]
    BadBase64(String),
    #[error("payload is {size} bytes; the limit is {limit} bytes")]
    PayloadTooLarge { size: usize, limit: usize },
    #[error("invalid header name {0:?}: use RFC 7230 token characters, at most 256")]
    InvalidHeaderName(String),
    #[error("header {name:?} value is invalid: {why}")]
    InvalidHeaderValue { name: String, why: String },
    #[error("{count} headers; at most {max}")]
    TooManyHeaders { count: usize, max: usize },
    #[error("deliveries must be >= 0, got {0}")]
    NegativeDeliveries(i32),
    #[error("{field} is {len} characters; at most {max}")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "queue {queue} has {parked} parked records, at its maxParked of {limit}: resolve some, or raise spec.maxParked"
    )]
    MaxParked {
        queue: String,
        parked: i64,
        limit: i64,
    },
    #[error("job {0} kept changing while parking (parked and resolved concurrently); try again")]
    Busy(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

impl ParkError {
    /// Whether trying again later can succeed (the apiserver, the queue's capacity or its
    /// existence may change); the rest are properties of the message itself.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ParkError::Kube(_)
                | ParkError::MaxParked { .. }
                | ParkError::UnknownQueue { .. }
                | ParkError::Busy(_)
        )
    }
}

const MAX_REASON: usize = 1024;

/// Checks a request without any I/O.
pub fn validate(req: &ParkRequest) -> Result<(), ParkError> {
    if req.queue.trim().is_empty() {
        return Err(ParkError::MissingQueue);
    }
    if !is_dns_label(&req.queue) {
        return Err(ParkError::BadQueueName(req.queue.clone()));
    }
    if req.job.id.trim().is_empty() {
        return Err(ParkError::MissingJobId);
    }
    if req.job.id.len() > api::MAX_JOB_ID_LEN {
        return Err(ParkError::JobIdTooLong {
            len: req.job.id.len(),
            max: api::MAX_JOB_ID_LEN,
        });
    }
    let size = match (&req.job.payload, &req.job.payload_base64) {
        (Some(_), Some(_)) => return Err(ParkError::BothPayloadForms),
        (None, None) => return Err(ParkError::NoPayload),
        (Some(text), None) => text.len(),
        (None, Some(_)) => req
            .job
            .payload_bytes()
            .map_err(|e| ParkError::BadBase64(e.to_string()))?
            .len(),
    };
    if size > api::MAX_PAYLOAD_BYTES {
        return Err(ParkError::PayloadTooLarge {
            size,
            limit: api::MAX_PAYLOAD_BYTES,
        });
    }
    if req.job.headers.len() > api::MAX_HEADERS {
        return Err(ParkError::TooManyHeaders {
            count: req.job.headers.len(),
            max: api::MAX_HEADERS,
        });
    }
    for (name, value) in &req.job.headers {
        if name.is_empty() || name.len() > 256 || !name.bytes().all(is_tchar) {
            return Err(ParkError::InvalidHeaderName(name.clone()));
        }
        if value.len() > api::MAX_HEADER_VALUE_LEN {
            return Err(ParkError::InvalidHeaderValue {
                name: name.clone(),
                why: format!(
                    "{} bytes, at most {}",
                    value.len(),
                    api::MAX_HEADER_VALUE_LEN
                ),
            });
        }
        if value.contains(['\r', '\n', '\0']) {
            return Err(ParkError::InvalidHeaderValue {
                name: name.clone(),
                why: "contains CR, LF or NUL".into(),
            });
        }
    }
    if req.deliveries < 0 {
        return Err(ParkError::NegativeDeliveries(req.deliveries));
    }
    let bounded = [
        (
            "serviceVersion",
            req.service_version.as_deref().unwrap_or(""),
            128,
        ),
        (
            "intent.id",
            req.intent.as_ref().map_or("", |i| i.id.as_str()),
            253,
        ),
        (
            "intent.state",
            req.intent.as_ref().map_or("", |i| i.state.as_str()),
            253,
        ),
    ];
    for (field, value, max) in bounded {
        if value.chars().count() > max {
            return Err(ParkError::TooLong {
                field,
                len: value.chars().count(),
                max,
            });
        }
    }
    Ok(())
}

/// RFC 7230 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// 16 hex of sha256(`queue/jobId`): the `dlq.dev/job-key` label shared by every cycle of a job.
pub fn job_key(queue: &str, job_id: &str) -> String {
    let digest = Sha256::digest(format!("{queue}/{job_id}").as_bytes());
    hex::encode(&digest[..8])
}

/// `<slug of job id>-<8 hex of sha256(queue/jobId)>-<cycle>`, a valid DNS subdomain.
pub fn record_name(queue: &str, job_id: &str, cycle: i32) -> String {
    let mut slug = String::new();
    for c in job_id.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            slug.push(c);
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
        if slug.len() >= 40 {
            break;
        }
    }
    let slug = slug.trim_matches('-');
    let slug = if slug.is_empty() { "job" } else { slug };
    format!("{slug}-{}-{cycle}", &job_key(queue, job_id)[..8])
}

/// Cuts free text to `max` characters with a marker; the job itself is never cut.
fn bounded_reason(reason: &str) -> String {
    if reason.chars().count() <= MAX_REASON {
        return reason.to_string();
    }
    let mut s: String = reason.chars().take(MAX_REASON - 3).collect();
    s.push_str("...");
    s
}

/// Parks jobs and publishes the `Parked` Warning Event. (`dlq_parked_total` is counted by the
/// operator when it first marks a record Parked, so parkings from any process are counted.)
#[derive(Clone)]
pub struct Parker {
    client: Client,
    queues: Arc<Mutex<QueueCache>>,
}

/// (namespace, name) → when read, and what.
type QueueCache = HashMap<(String, String), (std::time::Instant, DeadLetterQueue)>;

/// How long a parker trusts a DeadLetterQueue it read (its existence and `status.parked`).
const QUEUE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

impl Parker {
    pub fn new(client: Client) -> Self {
        Parker {
            client,
            queues: Arc::default(),
        }
    }

    /// Validates, looks up the DeadLetterQueue, and parks.
    pub async fn park(&self, namespace: &str, req: ParkRequest) -> Result<ParkOutcome, ParkError> {
        validate(&req)?;
        let queue = self.queue(namespace, &req.queue).await?;
        self.park_into(&queue, req).await
    }

    /// The DeadLetterQueue, read at most once per [`QUEUE_TTL`]: in a parking storm every
    /// record would otherwise cost one more apiserver read.
    async fn queue(&self, namespace: &str, name: &str) -> Result<DeadLetterQueue, ParkError> {
        let key = (namespace.to_string(), name.to_string());
        if let Some((at, q)) = self.queues.lock().await.get(&key)
            && at.elapsed() < QUEUE_TTL
        {
            return Ok(q.clone());
        }
        let api: Api<DeadLetterQueue> = Api::namespaced(self.client.clone(), namespace);
        let queue = api
            .get_opt(name)
            .await?
            .ok_or_else(|| ParkError::UnknownQueue {
                namespace: namespace.into(),
                queue: name.into(),
            })?;
        self.queues
            .lock()
            .await
            .insert(key, (std::time::Instant::now(), queue.clone()));
        Ok(queue)
    }

    /// Parks into a queue the caller already read (the bridges do, once per batch).
    pub async fn park_into(
        &self,
        queue: &DeadLetterQueue,
        req: ParkRequest,
    ) -> Result<ParkOutcome, ParkError> {
        validate(&req)?;
        let namespace = queue.namespace().unwrap_or_default();
        let records: Api<DeadLetter> = Api::namespaced(self.client.clone(), &namespace);
        let key = job_key(&req.queue, &req.job.id);
        let selector = format!("{}={key}", api::LABEL_JOB_KEY);
        let pp = PostParams {
            field_manager: Some(PARKER.into()),
            ..PostParams::default()
        };

        // First from the apiserver's watch cache (resourceVersion 0: cheap, possibly a moment
        // stale), then, whenever that view proves stale, from etcd. The deterministic name
        // makes the create the guard: two parkers of one job cannot both create a cycle.
        for consistent in [false, true, true] {
            let mut lp = ListParams::default().labels(&selector);
            if !consistent {
                lp = lp.match_any();
            }
            // A job collides on key only with itself in practice (64 bits of sha256); the job
            // id is compared too so a collision can never merge two jobs.
            let existing: Vec<DeadLetter> = records
                .list(&lp)
                .await?
                .items
                .into_iter()
                .filter(|r| r.spec.job.id == req.job.id && r.spec.queue == req.queue)
                .collect();
            if let Some(parked) = existing.iter().find(|r| r.phase() == Phase::Parked) {
                // Confirm a cached Parked: answering AlreadyParked for a record that was just
                // resolved would lose this new death of the job.
                let current = records.get_opt(&parked.name_any()).await?;
                match current {
                    Some(r) if r.phase() == Phase::Parked => {
                        return Ok(ParkOutcome::AlreadyParked(Box::new(r)));
                    }
                    _ => continue,
                }
            }
            let parked_now = queue.status.as_ref().map_or(0, |s| s.parked);
            let limit = queue.spec.max_parked();
            if parked_now >= limit {
                return Err(ParkError::MaxParked {
                    queue: req.queue.clone(),
                    parked: parked_now,
                    limit,
                });
            }
            let cycle = existing.iter().map(|r| r.spec.cycle).max().unwrap_or(0) + 1;
            let record = self.new_record(&req, &key, cycle);
            let name = record.name_any();
            match records.create(&pp, &record).await {
                Ok(created) => {
                    tracing::info!(namespace = %namespace, name = %created.name_any(), job = %created.spec.job.id, cycle, "parked");
                    return Ok(ParkOutcome::Parked(Box::new(created)));
                }
                // This cycle exists: a racing parker created it (then it is ours too), or the
                // list was stale (then look again, consistently).
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    if let Some(r) = records.get_opt(&name).await?
                        && r.phase() == Phase::Parked
                    {
                        return Ok(ParkOutcome::AlreadyParked(Box::new(r)));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ParkError::Busy(req.job.id.clone()))
    }

    fn new_record(&self, req: &ParkRequest, key: &str, cycle: i32) -> DeadLetter {
        let mut record = DeadLetter::new(
            &record_name(&req.queue, &req.job.id, cycle),
            DeadLetterSpec {
                queue: req.queue.clone(),
                cycle,
                job: req.job.clone(),
                intent: req.intent.clone(),
                deliveries: req.deliveries,
                reason: bounded_reason(&req.reason),
                failure_kind: req.failure_kind,
                service_version: req.service_version.clone(),
                failed_at: Time(req.failed_at.unwrap_or_else(jiff::Timestamp::now)),
                action: None,
                by: None,
                note: None,
            },
        );
        record.metadata.labels = Some(BTreeMap::from([
            (api::LABEL_QUEUE.to_string(), req.queue.clone()),
            (
                api::LABEL_FAILURE_KIND.to_string(),
                req.failure_kind.label().to_string(),
            ),
            (api::LABEL_JOB_KEY.to_string(), key.to_string()),
        ]));
        record
    }
}

/// Parks one job: see [`Parker::park`].
pub async fn park(
    client: Client,
    namespace: &str,
    req: ParkRequest,
) -> Result<ParkOutcome, ParkError> {
    Parker::new(client).park(namespace, req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ParkRequest {
        ParkRequest::new(
            "relayer",
            Job {
                id: "pi_0003/settle".into(),
                payload: Some("{}".into()),
                ..Job::default()
            },
        )
    }

    #[test]
    fn names_follow_the_spec() {
        let name = record_name("relayer", "pi_0003/settle", 1);
        assert!(name.starts_with("pi-0003-settle-"), "{name}");
        assert!(name.ends_with("-1"));
        assert_eq!(name.len(), "pi-0003-settle-".len() + 8 + 2);
        assert_eq!(&job_key("relayer", "pi_0003/settle")[..8], &name[15..23]);
        assert_eq!(job_key("relayer", "pi_0003/settle").len(), 16);
        assert_ne!(job_key("relayer", "a"), job_key("other", "a"));
        assert!(record_name("q", "///", 2).starts_with("job-"));
        let long = record_name("q", &"Ab".repeat(200), 12);
        assert!(long.len() <= 63, "{long}");
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let check = |f: &dyn Fn(&mut ParkRequest), want: &str| {
            let mut r = req();
            f(&mut r);
            let err = validate(&r).expect_err(want).to_string();
            assert!(err.contains(want), "{err} should mention {want}");
        };
        check(&|r| r.job.id.clear(), "missing job id");
        check(&|r| r.queue.clear(), "missing queue");
        check(
            &|r| r.queue = "Bad_Queue".into(),
            "not a valid Kubernetes name",
        );
        check(
            &|r| r.job.payload_base64 = Some("YQ==".into()),
            "both payload and payloadBase64",
        );
        check(&|r| r.job.payload = None, "no payload");
        check(
            &|r| r.job.payload = Some("x".repeat(api::MAX_PAYLOAD_BYTES + 1)),
            "the limit is 262144 bytes",
        );
        check(
            &|r| {
                r.job.payload = None;
                r.job.payload_base64 = Some("!!".into());
            },
            "not valid base64",
        );
        check(
            &|r| {
                r.job.headers.insert("bad header".into(), "v".into());
            },
            "invalid header name",
        );
        check(
            &|r| {
                r.job.headers.insert("x".into(), "a\nb".into());
            },
            "CR, LF or NUL",
        );
        check(&|r| r.deliveries = -1, "deliveries must be >= 0");
        assert!(validate(&req()).is_ok());
    }

    #[test]
    fn long_reasons_are_cut_not_refused() {
        let r = bounded_reason(&"é".repeat(5000));
        assert_eq!(r.chars().count(), MAX_REASON);
        assert!(r.ends_with("..."));
    }
}
