//! One park, decided before any I/O. A parker asks once ([`plan`]) and carries the plan out
//! against the apiserver: the request as its record will hold it (validated, sealed when the
//! queue seals), the record names to read and the record to create. What the apiserver then
//! shows (the job's records listed after a create met a taken name, the record in the way of a
//! create) is answered by the plan itself ([`ParkPlan::after_list`], [`ParkPlan::answered_by`]),
//! so the parker never takes the rules of `crate::park` in its own hands step by step.

use crate::dead_letter::DeadLetter;
use crate::park::{
    Cycle, FirstTry, KnownCycle, ParkInvalid, ParkRequest, answers_for_its_job, first_try, job_key,
    new_record, next_cycle, source_message, validate,
};
use crate::queue::DeadLetterQueue;
use crate::seal::{SealError, seal_request};

/// Why a request cannot be parked into its queue, found before any I/O.
#[derive(Debug, thiserror::Error)]
pub enum Unplannable {
    #[error(transparent)]
    Invalid(#[from] ParkInvalid),
    /// The queue seals but publishes no recipient yet: parking plaintext would defeat the seal.
    #[error("queue {queue} seals payloads but publishes no recipient")]
    NoRecipient { queue: String },
    #[error(transparent)]
    Seal(#[from] SealError),
}

/// The first apiserver call of a park, or of its retry after a list.
#[derive(Debug, Clone)]
pub enum Step {
    /// Read this record: it is this very message's record (a re-read after a crash), whatever
    /// its phase; if it is gone, list.
    SameMessage(String),
    /// Read this record: the job's Parked record as the caller's view shows it; it answers
    /// only if still Parked (a record resolved a moment ago must not swallow a new death).
    Confirm(String),
    /// Take a slot under `maxParked` and create this record (the create is the guard: a 409
    /// means the view was behind).
    Create(Box<DeadLetter>),
}

/// What a list of the job's records leaves to do.
#[derive(Debug, Clone)]
pub enum AfterList<'a> {
    /// The listed record of this very message answers for it.
    SameMessage(&'a DeadLetter),
    /// Read this Parked record again, consistently, before answering with it.
    Confirm(String),
    /// Create this record, the next cycle.
    Create(Box<DeadLetter>),
}

/// Everything a parker needs to park one request but its first step (see the module doc).
#[derive(Debug, Clone)]
pub struct ParkPlan {
    request: ParkRequest,
    namespace: String,
}

/// Plans parking `req` into `queue`, with `known`, the job's records as the caller's watch
/// shows them (None: no view; see [`first_try`]): validation, sealing to the queue's published
/// recipient, and the first step with its record (apart, so that the parker moves the record
/// into its create instead of copying it).
pub fn plan(
    queue: &DeadLetterQueue,
    req: ParkRequest,
    known: Option<&[KnownCycle]>,
) -> Result<(ParkPlan, Step), Unplannable> {
    validate(&req)?;
    let request = sealed_for(queue, req)?;
    let first = match first_try(&request, known) {
        FirstTry::SameMessage(name) => Step::SameMessage(name),
        FirstTry::Confirm(name) => Step::Confirm(name),
        FirstTry::Create(cycle) => Step::Create(Box::new(new_record(&request, cycle))),
    };
    let plan = ParkPlan {
        namespace: queue.metadata.namespace.clone().unwrap_or_default(),
        request,
    };
    Ok((plan, first))
}

/// `req` with its job sealed to the queue's current recipient when the queue seals (its reason
/// then quotes nothing of the message), untouched otherwise; a queue that seals but publishes
/// no recipient refuses, never plaintext.
fn sealed_for(queue: &DeadLetterQueue, req: ParkRequest) -> Result<ParkRequest, Unplannable> {
    if req.job.sealed.is_some() {
        return Ok(req);
    }
    match queue.seal_recipient() {
        Some(recipient) => Ok(seal_request(req, recipient)?),
        None if queue.seals() => Err(Unplannable::NoRecipient {
            queue: queue.metadata.name.clone().unwrap_or_default(),
        }),
        None => Ok(req),
    }
}

impl ParkPlan {
    /// The request as its record holds it (sealed when the queue seals).
    pub fn request(&self) -> &ParkRequest {
        &self.request
    }

    /// The namespace of the queue, and so of the record.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The label selector of every record of the job (all its cycles), for the list a park
    /// falls back to when its view proved behind.
    pub fn selector(&self) -> String {
        format!(
            "{}={}",
            crate::dead_letter::LABEL_JOB_KEY,
            job_key(&self.request.queue, &self.request.job.id)
        )
    }

    /// What the job's records, as a list showed them, leave to do (the cycle rule,
    /// [`next_cycle`]).
    pub fn after_list<'a>(&self, existing: &'a [DeadLetter]) -> AfterList<'a> {
        match next_cycle(&self.request, existing) {
            Cycle::SameMessage(record) => AfterList::SameMessage(record),
            Cycle::AlreadyParked(parked) => {
                AfterList::Confirm(parked.metadata.name.clone().unwrap_or_default())
            }
            Cycle::Next(cycle) => AfterList::Create(Box::new(new_record(&self.request, cycle))),
        }
    }

    /// Whether `found`, the record holding the name a create was refused (409), answers for
    /// this request: a Parked record of this very job, and for an own death of this very
    /// message. A name holds 32 bits of its job's key: another job's record of the same name
    /// never takes this one's place.
    pub fn answered_by(&self, found: &DeadLetter) -> bool {
        answers_for_its_job(found.phase(), found.spec.action)
            && found.spec.job.id == self.request.job.id
            && found.spec.queue == self.request.queue
            && self.request.answered_by(source_message(found))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::{Job, Phase};
    use crate::park::record_name;
    use crate::testing::RecordBuilder;

    /// Job `pi_0003/settle` of queue `relayer`, as the records of [`RecordBuilder`].
    fn req() -> ParkRequest {
        let job = Job::from_bytes("pi_0003/settle", b"card 4111 1111 1111 1111");
        ParkRequest::new("relayer", job)
    }

    /// A record of the job, as the apiserver would show it.
    fn record() -> RecordBuilder {
        RecordBuilder::job("pi_0003/settle")
    }

    fn name(cycle: i32) -> String {
        record_name("relayer", "pi_0003/settle", cycle)
    }

    /// Queue `relayer` in `payments`; `seal`: whether it seals, and the recipient it
    /// publishes.
    fn queue(seal: Option<Option<&str>>) -> DeadLetterQueue {
        let mut q = serde_json::json!({
            "apiVersion": "dlq.dev/v1alpha1", "kind": "DeadLetterQueue",
            "metadata": {"name": "relayer", "namespace": "payments"},
            "spec": {"target": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}, "list": "l"}}},
        });
        if let Some(recipient) = seal {
            q["spec"]["protection"] =
                serde_json::json!({"seal": {"identitySecretRef": {"name": "k"}}});
            if let Some(r) = recipient {
                q["status"] = serde_json::json!({"protection": {"recipient": r}});
            }
        }
        serde_json::from_value(q).expect("a DeadLetterQueue")
    }

    fn known(cycle: i32, phase: Phase) -> KnownCycle {
        KnownCycle {
            name: name(cycle),
            queue: "relayer".into(),
            job_id: "pi_0003/settle".into(),
            cycle,
            phase,
            action: None,
            message: None,
        }
    }

    /// The record the plan creates first, as JSON (records have no `PartialEq`).
    fn created(first: &Step) -> serde_json::Value {
        match first {
            Step::Create(record) => serde_json::to_value(record).expect("JSON"),
            other => panic!("a create first: {other:?}"),
        }
    }

    fn json(record: &DeadLetter) -> serde_json::Value {
        serde_json::to_value(record).expect("JSON")
    }

    #[test]
    fn a_new_job_is_planned_as_one_create_of_the_record_the_rules_make() {
        let mut expected = json(&new_record(&req(), 1));
        let (planned, first) = plan(&queue(None), req(), Some(&[])).expect("a plan");
        let mut got = created(&first);
        // Both are stamped "now": the request has no failedAt.
        for v in [&mut expected, &mut got] {
            v["spec"]["failedAt"] = serde_json::Value::Null;
        }
        assert_eq!(got, expected);
        assert_eq!(planned.namespace(), "payments");
        assert_eq!(planned.request().job, req().job, "not sealed: untouched");
        let (_, without_view) = plan(&queue(None), req(), None).expect("a plan");
        assert_eq!(created(&without_view)["spec"]["cycle"], 1, "cycle 1 first");
    }

    #[test]
    fn the_view_chooses_the_first_step() {
        let view = [known(1, Phase::Redriven), known(2, Phase::Dropped)];
        let (_, next) = plan(&queue(None), req(), Some(&view)).expect("a plan");
        assert_eq!(created(&next)["spec"]["cycle"], 3);
        assert_eq!(created(&next)["metadata"]["name"], name(3));
        let view = [known(1, Phase::Redriven), known(2, Phase::Parked)];
        let (_, parked) = plan(&queue(None), req(), Some(&view)).expect("a plan");
        assert!(matches!(parked, Step::Confirm(n) if n == name(2)));
        let reread = req().with_message("relayer:dead/7f3a");
        let mut mine = known(1, Phase::Dropped);
        mine.message = Some("relayer:dead/7f3a".into());
        let (_, same) = plan(&queue(None), reread, Some(&[mine])).expect("a plan");
        assert!(matches!(same, Step::SameMessage(n) if n == name(1)));
    }

    #[test]
    fn an_invalid_request_is_refused_before_any_io() {
        let mut bad = req();
        bad.job.id = String::new();
        assert!(matches!(
            plan(&queue(None), bad, None),
            Err(Unplannable::Invalid(ParkInvalid::MissingJobId))
        ));
    }

    #[test]
    fn a_sealing_queue_plans_the_sealed_record_and_refuses_without_a_recipient() {
        let (_, recipient) = crate::seal::generate_identity();
        let (sealing, first) = plan(&queue(Some(Some(&recipient))), req(), None).expect("a plan");
        let Step::Create(record) = first else {
            panic!("a create first");
        };
        let sealed = record.spec.job.sealed.as_ref().expect("sealed");
        assert_eq!(sealed.recipient, recipient);
        assert!(record.spec.job.payload.is_none(), "no plaintext beside it");
        assert_eq!(sealing.request().job, record.spec.job);
        assert!(
            !record.spec.reason.contains("4111"),
            "{}",
            record.spec.reason
        );
        assert!(
            matches!(
                plan(&queue(Some(None)), req(), None),
                Err(Unplannable::NoRecipient { queue }) if queue == "relayer"
            ),
            "never plaintext into a sealing queue"
        );
    }

    #[test]
    fn a_list_after_a_taken_name_gives_the_next_cycle_or_the_record_that_answers() {
        let (plan, _) = plan(&queue(None), req().with_message("m-2"), None).expect("a plan");
        let first = record().message("m-1").phase(Phase::Redriven).build();
        assert!(matches!(
            plan.after_list(std::slice::from_ref(&first)),
            AfterList::Create(r) if r.spec.cycle == 2
        ));
        let parked = record().message("m-1").build();
        assert!(matches!(
            plan.after_list(std::slice::from_ref(&parked)),
            AfterList::Confirm(n) if n == name(1)
        ));
        let mine = record().message("m-2").phase(Phase::Dropped).build();
        assert!(matches!(
            plan.after_list(std::slice::from_ref(&mine)),
            AfterList::SameMessage(r) if r.spec.cycle == 1
        ));
        assert_eq!(
            plan.selector(),
            format!("dlq.dev/job-key={}", job_key("relayer", "pi_0003/settle"))
        );
    }

    #[test]
    fn only_a_parked_record_of_this_job_answers_for_a_taken_name() {
        let (planned, _) = plan(&queue(None), req(), None).expect("a plan");
        assert!(planned.answered_by(&record().build()));
        let mut found = record().build();
        found.spec.job.id = "another job of the same name".into();
        assert!(!planned.answered_by(&found), "another job");
        let resolved = record().phase(Phase::Dropped).build();
        assert!(!planned.answered_by(&resolved), "no longer Parked");
        let mut own = req().with_message("sidekiq#2");
        own.own_death = true;
        let (own, _) = plan(&queue(None), own, None).expect("a plan");
        assert!(
            !own.answered_by(&record().message("sidekiq#1").build()),
            "another death of the job"
        );
    }
}
