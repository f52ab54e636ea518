//! Seal-or-open, decided here only: whether a payload is sealed on its way into its queue's
//! store, opened for a redrive or a reveal, or read back from the store as it is. Park (a
//! source's [`Payloads::keep`]), redrive ([`opened`], [`Payloads::sent`]) and reveal ([`opened`],
//! [`Payloads::head`], [`Payloads::plaintext`]) call this; none of them names the seal's open or
//! a store's sealed put itself (`scripts/module-arrows.sh` fails when one does).

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;

use dlq_core::api::{BodyRef, DeadLetterQueue, Job};
use dlq_core::seal::{self, Keyring, OpenError};

use super::open::OpenFailed;
use super::{Bodies, BodyError, BodyStore, Kept};

/// Whether reading `job` back needs its queue's keys: its content is sealed, or its stored
/// body is. A reader loads them only then (a Secret read saved for every plain record).
pub fn needs_keys(job: &Job) -> bool {
    job.sealed.is_some() || job.stored_body().is_some_and(|b| b.recipient.is_some())
}

/// `job` as it was parked: its content opened with `keyring` when sealed, whole or an
/// [`OpenError`] (never half-opened); borrowed as it is when not sealed.
pub fn opened<'j>(job: &'j Job, keyring: &Keyring) -> Result<Cow<'j, Job>, OpenError> {
    if job.sealed.is_none() {
        return Ok(Cow::Borrowed(job));
    }
    seal::open_job(job, keyring).map(Cow::Owned)
}

/// One queue's payloads in its body store, as park, redrive and reveal use them.
pub struct Payloads<'a> {
    bodies: &'a dyn Bodies,
    queue: &'a DeadLetterQueue,
}

impl<'a> Payloads<'a> {
    pub fn of(bodies: &'a dyn Bodies, queue: &'a DeadLetterQueue) -> Self {
        Payloads { bodies, queue }
    }

    /// Keeps `payload` of job `job` in the queue's store: sealed to the queue's recipient when
    /// it seals (the store holds ciphertext only; a sealing queue that publishes no recipient
    /// yet keeps nothing, never plaintext), as it is when it does not.
    pub async fn keep(&self, job: &str, payload: &Bytes) -> Result<Kept, BodyError> {
        let store = self
            .bodies
            .store(self.queue)
            .await?
            .ok_or_else(|| BodyError::Config("the queue has no spec.bodies".into()))?;
        match self.recipient()? {
            Some(r) => store.put_sealed(payload.clone(), job, r).await,
            None => store.put(payload.clone(), None).await,
        }
    }

    /// The recipient a kept body is sealed to: the queue's published one, none when it does
    /// not seal, an error while it seals without one.
    fn recipient(&self) -> Result<Option<&'a str>, BodyError> {
        match self.queue.seal_recipient() {
            Some(r) => Ok(Some(r)),
            None if self.queue.seals() => Err(BodyError::Seal(
                "the queue seals but publishes no recipient yet".into(),
            )),
            None => Ok(None),
        }
    }

    /// What a redrive sends of `job` (opened) for its `body` in the store: the body's exact
    /// plaintext, checked against the record's size and digest and opened when sealed; None
    /// for an external body (read through and checked, held nowhere: the job's own pointer
    /// message is what is sent).
    pub async fn sent(
        &self,
        job: &Job,
        body: &BodyRef,
        keyring: &Keyring,
    ) -> Result<Option<Vec<u8>>, OpenFailed> {
        let store = self.store(&job.id, body).await.map_err(OpenFailed::Body)?;
        if body.external {
            store.check(&job.id, body).await.map_err(OpenFailed::Body)?;
            return Ok(None);
        }
        match &body.recipient {
            None => store
                .fetch(&job.id, body)
                .await
                .map(Some)
                .map_err(OpenFailed::Body),
            Some(recipient) => store
                .fetch_opened(&job.id, body, recipient, keyring)
                .await
                .map(Some),
        }
    }

    /// The first `keep` bytes of the plaintext of `body` and its length, after reading (and
    /// opening, when sealed) all of it.
    pub async fn head(
        &self,
        job: &str,
        body: &BodyRef,
        keyring: &Keyring,
        keep: usize,
    ) -> Result<(Vec<u8>, u64), BodyError> {
        self.store(job, body)
            .await?
            .head(job, body, keyring, keep)
            .await
    }

    /// The plaintext of `body` as it streams in, checked, and opened when sealed.
    pub async fn plaintext(
        &self,
        job: &str,
        body: &BodyRef,
        keyring: &Keyring,
    ) -> Result<BoxStream<'static, Result<Bytes, BodyError>>, BodyError> {
        self.store(job, body)
            .await?
            .plaintext(job, body, keyring)
            .await
    }

    /// The store `body` is in; [`BodyError::NoStore`] when the queue has none any more.
    async fn store(&self, job: &str, body: &BodyRef) -> Result<Arc<BodyStore>, BodyError> {
        self.bodies
            .store(self.queue)
            .await?
            .ok_or_else(|| BodyError::NoStore {
                job: job.to_string(),
                reference: body.reference.clone(),
                queue: self.queue.metadata.name.clone().unwrap_or_default(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::DeadLetterQueueSpec;
    use dlq_core::conditions::reason;

    /// A body kept for a queue that seals is sealed in the store and read back opened, by the
    /// redrive and the reveal alike; a plain queue's is kept and read as it is; a sealing queue
    /// without a published recipient keeps nothing.
    #[tokio::test]
    async fn a_body_is_sealed_when_its_queue_seals_and_read_back_opened() {
        let (bodies, spec) = crate::body::InMemory::new();
        let (keys, recipient) = crate::body::test_keys();
        let plain_queue = DeadLetterQueue::new(
            "relayer",
            DeadLetterQueueSpec {
                bodies: Some(spec.clone()),
                ..Default::default()
            },
        );
        let mut sealing = plain_queue.clone();
        sealing.spec.protection = serde_json::from_value(serde_json::json!({
            "seal": {"identitySecretRef": {"name": "relayer-seal", "key": "identity"}}
        }))
        .expect("protection");
        let payload = Bytes::from_static(b"the job's exact bytes");

        let waiting = Payloads::of(bodies.as_ref(), &sealing)
            .keep("j", &payload)
            .await;
        let waiting = waiting.err().map(|e| e.reason());
        assert_eq!(waiting, Some(reason::BODY_SEAL_BROKEN), "never plaintext");

        sealing.status = serde_json::from_value(serde_json::json!({
            "protection": {"recipient": recipient}
        }))
        .expect("status");
        for (queue, sealed) in [(&plain_queue, false), (&sealing, true)] {
            let payloads = Payloads::of(bodies.as_ref(), queue);
            let kept = payloads.keep("j", &payload).await.expect("kept");
            assert_eq!(kept.body.recipient.is_some(), sealed);
            let job = Job {
                id: "j".into(),
                body: Some(Box::new(kept.body.clone())),
                ..Job::default()
            };
            assert_eq!(needs_keys(&job), sealed);
            let sent = payloads.sent(&job, &kept.body, &keys).await.expect("sent");
            assert_eq!(sent.as_deref(), Some(&payload[..]));
            let (head, len) = payloads
                .head("j", &kept.body, &keys, 3)
                .await
                .expect("head");
            assert_eq!((&head[..], len), (&payload[..3], payload.len() as u64));
        }
    }
}
