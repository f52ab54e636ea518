//! One dead message a source read, decided once: where its payload goes (the record, the
//! queue's body store, or nowhere: too large), what it parks as (the job it claims to be, or
//! an Invalid record of its exact bytes), the facts a standing replay matches it by, and what
//! it parks as after the apiserver refused it for good. The operator carries the plan out (the
//! store's put, the parker's create, the pass-through) and asks the core nothing else on the
//! way; the rules themselves are [`crate::body`]'s and [`crate::park`]'s.

use bytes::Bytes;

use crate::body::{Placement, placement, request_size};
use crate::dead_letter::{BodyRef, DeadLetter, Job};
use crate::park::{self, Disposition, ParkInvalid, ParkRequest};
use crate::queue::{BodiesSpec, DeadLetterQueue};

/// What of a queue decides the park of one of its dead messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueSettings<'q> {
    /// `spec.bodies`: the store's threshold and `maxBytes`.
    pub bodies: Option<&'q BodiesSpec>,
    /// Whether its records are sealed (a standing replay matches a sealed reason).
    pub seals: bool,
}

impl<'q> QueueSettings<'q> {
    /// The settings of `queue`; a queue gone from the operator's store has none.
    pub fn of(queue: Option<&'q DeadLetterQueue>) -> Self {
        queue.map_or_else(QueueSettings::default, |q| QueueSettings {
            bodies: q.spec.bodies.as_ref(),
            seals: q.seals(),
        })
    }
}

/// The plan of one dead message.
#[derive(Debug)]
pub enum SourcePlan {
    /// Keep its payload in the queue's store first; [`Keeping::kept`] then gives the park.
    Keep(Keeping),
    /// Park it as it is planned.
    Park(Parking),
    /// It can never be a record (over the store's `maxBytes`, or over a record's limit even as
    /// an Invalid record): the source keeps it where rejected messages go.
    Reject(ParkInvalid),
}

/// A payload to keep in the store before the park.
#[derive(Debug)]
pub struct Keeping {
    req: ParkRequest,
    raw: Option<Bytes>,
    seals: bool,
    /// The payload to keep: the message's own buffer (shared, not copied), or the job's
    /// payload moved out of it (base64 decoded in its own buffer).
    pub payload: Bytes,
    /// What the payload weighs with the headers (what the placement weighed).
    pub size: u64,
    /// Whether the payload is the message's exact bytes: then an invalid request is parked as
    /// an Invalid record of it by reference ([`park::dispose_kept`]).
    pub of_message: bool,
}

/// A request to park, and what follows from it.
#[derive(Debug)]
pub struct Parking {
    req: ParkRequest,
    raw: Option<Bytes>,
    seals: bool,
    /// The facts a standing replay's selector matches: only when it may pass (its exact bytes
    /// held and no body kept in the store, which the record's redrive sends).
    arriving: Option<Box<DeadLetter>>,
    /// Fallbacks parked so far after final refusals.
    tried: usize,
}

/// The plan of the request `req` a source read from a message of exact bytes `raw` (None when
/// they are no longer held: a Redis envelope taken apart) for a queue with `queue`'s settings.
pub fn plan(mut req: ParkRequest, raw: Option<Bytes>, queue: QueueSettings<'_>) -> SourcePlan {
    let message = raw.clone().unwrap_or_default();
    let size = request_size(&req, &message);
    match placement(queue.bodies, size) {
        Placement::Store if queue.bodies.is_some() => {
            let of_message = req.payload_in_message;
            match payload_of(&mut req, &message) {
                Some(payload) => SourcePlan::Keep(Keeping {
                    req,
                    raw,
                    seals: queue.seals,
                    payload,
                    size,
                    of_message,
                }),
                // Not base64 after all: disposed of as an Invalid record of its bytes.
                None => dispose(req, raw, Kept::Nothing, queue.seals).into(),
            }
        }
        Placement::TooLarge { limit } if queue.bodies.is_some() => {
            SourcePlan::Reject(ParkInvalid::PayloadTooLarge {
                size: usize::try_from(size).unwrap_or(usize::MAX),
                limit: usize::try_from(limit).unwrap_or(usize::MAX),
            })
        }
        // Stays in the record, or is refused there with the record's own limit.
        _ => {
            req.fill_payload(&message);
            dispose(req, raw, Kept::Nothing, queue.seals).into()
        }
    }
}

impl Keeping {
    /// The job whose payload is kept (it names the object in errors and staging).
    pub fn job(&self) -> &str {
        &self.req.job.id
    }

    /// The park once the store kept the payload as `body`, or why it can never be a record.
    pub fn kept(self, body: BodyRef) -> Result<Parking, ParkInvalid> {
        let Keeping {
            mut req,
            raw,
            seals,
            of_message,
            ..
        } = self;
        let kept = match of_message {
            true => Kept::Message(body.clone()),
            false => Kept::Payload,
        };
        req.job.body = Some(Box::new(body));
        dispose(req, raw, kept, seals)
    }
}

impl Parking {
    /// The request to park now.
    pub fn request(&self) -> &ParkRequest {
        &self.req
    }

    /// The facts a standing replay matches, when the message may pass through.
    pub fn arriving(&self) -> Option<&DeadLetter> {
        self.arriving.as_deref()
    }

    /// The message's exact bytes, when it may pass through (a pass carries them as they are).
    pub fn passable(&self) -> Option<&Bytes> {
        self.raw.as_ref().filter(|_| self.arriving.is_some())
    }

    /// What to park after the apiserver refused [`Parking::request`] for good with `refusal`
    /// (its words): an Invalid record of the exact bytes ([`park::after_refusal`]), or None
    /// when nothing is left to try (or the bytes are not held) and the message is set aside.
    pub fn after_refusal(self, refusal: &str) -> Option<Parking> {
        let raw = self.raw.as_ref()?;
        let next = park::after_refusal(&self.req, raw, refusal, self.tried)?;
        let passable = self.arriving.is_some();
        Some(Parking {
            arriving: passable.then(|| Box::new(park::arriving(&next, self.seals))),
            req: next,
            raw: self.raw,
            seals: self.seals,
            tried: self.tried + 1,
        })
    }

    /// How many fallbacks were parked before this one.
    pub fn fallbacks(&self) -> usize {
        self.tried
    }
}

/// What this plan kept in the store before the park.
enum Kept {
    Nothing,
    /// The payload read out of the message (an envelope's).
    Payload,
    /// The message's exact bytes themselves, as this body.
    Message(BodyRef),
}

/// `req` disposed of (`park::dispose`; `dispose_kept` when the message's bytes themselves were
/// kept; plain validation when the bytes are no longer held): the park, or why never.
fn dispose(
    req: ParkRequest,
    raw: Option<Bytes>,
    kept: Kept,
    seals: bool,
) -> Result<Parking, ParkInvalid> {
    let disposed = match (&raw, &kept) {
        (Some(raw), Kept::Message(body)) => park::dispose_kept(req, raw, body),
        (Some(raw), _) => park::dispose(req, raw),
        (None, _) => match park::validate(&req) {
            Ok(()) => Disposition::Park(Box::new(req)),
            Err(why) => Disposition::Reject(why),
        },
    };
    let req = match disposed {
        Disposition::Park(req) => *req,
        Disposition::Reject(why) => return Err(why),
    };
    // Passed through only with its bytes in hand: a stored body is the record's to send.
    let passable = raw.is_some() && matches!(kept, Kept::Nothing);
    let arriving = passable.then(|| Box::new(park::arriving(&req, seals)));
    Ok(Parking {
        req,
        raw,
        seals,
        arriving,
        tried: 0,
    })
}

impl From<Result<Parking, ParkInvalid>> for SourcePlan {
    fn from(disposed: Result<Parking, ParkInvalid>) -> Self {
        match disposed {
            Ok(parking) => SourcePlan::Park(parking),
            Err(why) => SourcePlan::Reject(why),
        }
    }
}

/// The payload to keep in the store: the message's own buffer when the payload was left in it
/// (shared, not copied), else moved out of the job. None: a payload that is not base64 after all.
fn payload_of(req: &mut ParkRequest, message: &Bytes) -> Option<Bytes> {
    if std::mem::take(&mut req.payload_in_message) {
        return Some(message.clone());
    }
    take_payload(&mut req.job)
}

/// Moves the job's payload out of it, as bytes (text without a copy).
fn take_payload(job: &mut Job) -> Option<Bytes> {
    if let Some(text) = job.payload.take() {
        return Some(Bytes::from(text.into_bytes()));
    }
    let Some(b64) = job.payload_base64.take() else {
        return Some(Bytes::new());
    };
    // Decoded in the base64's own buffer: a binary body is not held twice beside its text.
    match crate::body::decode_base64_in_place(b64) {
        Ok(bytes) => Some(Bytes::from(bytes)),
        Err(b64) => {
            job.payload_base64 = Some(b64);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::FailureKind;
    use crate::facts::Facts;

    /// A store keeping bodies over 16 bytes, up to 64.
    fn bodies() -> BodiesSpec {
        BodiesSpec {
            threshold_bytes: Some(16),
            max_bytes: Some(64),
            ..BodiesSpec::default()
        }
    }

    fn with_store(bodies: &BodiesSpec, seals: bool) -> QueueSettings<'_> {
        QueueSettings {
            bodies: Some(bodies),
            seals,
        }
    }

    /// A broker's message whose exact bytes are the job's payload.
    fn read(id: &str, raw: &'static [u8]) -> (ParkRequest, Bytes) {
        let job = Job {
            id: id.into(),
            ..Job::default()
        };
        let mut req = ParkRequest::of_message("relayer", job, raw);
        req.reason = "card 4242424242424242 declined".into();
        req.sealed_reason = Some("declined".into());
        req.message = Some("relayer:dead#1".into());
        (req, Bytes::from_static(raw))
    }

    fn parked(plan: SourcePlan) -> Parking {
        match plan {
            SourcePlan::Park(parking) => parking,
            other => panic!("a park, not {other:?}"),
        }
    }

    /// A small valid message parks as itself, its payload in the record, and may pass: its
    /// facts are the record it would be (the reason as a sealing queue keeps it when it seals).
    #[test]
    fn a_small_message_parks_inline_and_may_pass() {
        for seals in [false, true] {
            let (req, raw) = read("pi_1/settle", b"{\"n\":1}");
            let queue = QueueSettings {
                bodies: None,
                seals,
            };
            let parking = parked(plan(req.clone(), Some(raw.clone()), queue));
            assert_eq!(parking.request().job.payload.as_deref(), Some("{\"n\":1}"));
            assert!(!parking.request().payload_in_message);
            assert_eq!(parking.passable(), Some(&raw));
            let facts = parking.arriving().expect("facts to match");
            let expected = park::arriving(parking.request(), seals);
            assert_eq!(facts.group(), expected.group());
            let reason = if seals {
                "declined"
            } else {
                "card 4242424242424242 declined"
            };
            assert_eq!(facts.spec.reason, reason);
        }
    }

    /// Over the store's threshold the message's own buffer is kept (shared, not copied); once
    /// kept, the record holds the reference, and it never passes (its redrive sends the body).
    #[test]
    fn a_large_message_is_kept_from_its_own_buffer_and_parks_by_reference() {
        let spec = bodies();
        let (mut req, raw) = read("pi_2/settle", b"a payload of some thirty-two b..");
        // As `ParkRequest::of_message` leaves a payload too large for a record: in the message.
        req.job.payload = None;
        req.payload_in_message = true;
        let SourcePlan::Keep(keeping) = plan(req, Some(raw.clone()), with_store(&spec, false))
        else {
            panic!("kept in the store");
        };
        assert_eq!(
            keeping.payload.as_ptr(),
            raw.as_ptr(),
            "the message's buffer"
        );
        assert_eq!((keeping.size, keeping.of_message), (32, true));
        assert_eq!(keeping.job(), "pi_2/settle");
        let body = crate::body::body_ref(&spec, &crate::body::sha256_hex(&raw), 32, None);
        let parking = keeping.kept(body.clone()).expect("parks");
        assert_eq!(parking.request().job.body.as_deref(), Some(&body));
        assert_eq!(parking.request().job.payload, None);
        assert!(parking.arriving().is_none() && parking.passable().is_none());
    }

    /// A payload read out of an envelope (base64 in the job) is decoded for the store; one
    /// that is not base64 after all parks as an Invalid record of the message's bytes.
    #[test]
    fn an_envelope_payload_is_decoded_for_the_store_or_parked_invalid() {
        let spec = bodies();
        let raw = Bytes::from_static(b"{\"the\":\"envelope\"}");
        let job = |b64: &str| Job {
            id: "pi_3/settle".into(),
            payload_base64: Some(b64.into()),
            ..Job::default()
        };
        let decoded = vec![7u8; 24];
        let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &decoded);
        let req = ParkRequest::new("relayer", job(&b64));
        let SourcePlan::Keep(keeping) = plan(req, Some(raw.clone()), with_store(&spec, false))
        else {
            panic!("kept in the store");
        };
        assert_eq!(
            (&keeping.payload[..], keeping.of_message),
            (&decoded[..], false)
        );

        let req = ParkRequest::new("relayer", job(&"!".repeat(40)));
        let parking = parked(plan(req, Some(raw.clone()), with_store(&spec, false)));
        assert_eq!(parking.request().failure_kind, FailureKind::Invalid);
        assert_eq!(
            parking.request().job.payload.as_deref(),
            Some("{\"the\":\"envelope\"}")
        );
    }

    /// Over `maxBytes` nothing is kept: refused before any I/O. A message whose bytes are no
    /// longer held parks as itself or not at all.
    #[test]
    fn what_can_never_be_a_record_is_refused_before_any_io() {
        let spec = bodies();
        let (req, raw) = read("pi_4/settle", &[b'x'; 65]);
        let refused = plan(req, Some(raw), with_store(&spec, false));
        assert!(matches!(
            refused,
            SourcePlan::Reject(ParkInvalid::PayloadTooLarge {
                size: 65,
                limit: 64
            })
        ));
        let nameless = ParkRequest::new("relayer", Job::default());
        let refused = plan(nameless, None, QueueSettings::default());
        assert!(matches!(
            refused,
            SourcePlan::Reject(ParkInvalid::MissingJobId)
        ));
    }

    /// A message that is not what it claims parks as an Invalid record of its exact bytes; after
    /// the apiserver's final refusals it parks as less and less of itself, its facts following,
    /// until nothing is left to try.
    #[test]
    fn refusals_fall_back_to_invalid_records_of_the_exact_bytes() {
        let (mut req, raw) = read("pi_5/settle", b"{\"n\":5}");
        req.job.id.clear();
        let parking = parked(plan(req, Some(raw.clone()), QueueSettings::default()));
        assert_eq!(parking.request().failure_kind, FailureKind::Invalid);
        assert_eq!(parking.request().job.payload.as_deref(), Some("{\"n\":5}"));

        let (req, raw) = read("pi_5/settle", b"{\"n\":5}");
        let parking = parked(plan(req, Some(raw.clone()), QueueSettings::default()));
        let first = parking
            .after_refusal("spec.intent: too long")
            .expect("a fallback");
        assert_eq!(first.fallbacks(), 1);
        assert_eq!(first.request().job.id, "pi_5/settle");
        assert_eq!(first.request().failure_kind, FailureKind::Invalid);
        let facts = first.arriving().expect("still passable");
        assert_eq!(facts.failure_kind(), FailureKind::Invalid);
        assert!(facts.spec.reason.contains("spec.intent: too long"));
        let second = first.after_refusal("no").expect("the bytes alone");
        assert_ne!(second.request().job.id, "pi_5/settle");
        assert!(second.after_refusal("no").is_none(), "nothing left to try");

        let (req, _) = read("pi_5/settle", b"{\"n\":5}");
        let taken_apart = parked(plan(req, None, QueueSettings::default()));
        assert!(taken_apart.arriving().is_none() && taken_apart.passable().is_none());
        assert!(
            taken_apart.after_refusal("no").is_none(),
            "no bytes to fall back to"
        );
    }
}
