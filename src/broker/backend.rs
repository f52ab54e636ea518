//! Which backend a queue's spec names, as one value each side can `match` on: adding a backend
//! to the API fails to compile every place that must learn it (no `_ =>`). And what reading a
//! backend's connection from the spec and its Secrets can run into ([`ConnectError`]), the
//! same for a source, a target and a backlog probe.

use dlq_core::api::{
    AmqpSourceSpec, AmqpTargetSpec, DeadLetterQueueSpec, HttpTargetSpec, KafkaSourceSpec,
    KafkaTargetSpec, NatsSourceSpec, NatsTargetSpec, PubsubSourceSpec, PubsubTargetSpec,
    RedisSourceSpec, RedisTargetSpec, SecretKeyRef, SidekiqSourceSpec, SidekiqTargetSpec,
    SourceSpec, SqsSourceSpec, SqsTargetSpec, TargetSpec,
};

use crate::secret::{SecretError, SecretReads};

/// An enum of the backends a spec may name, each holding its part of the spec, and `of`, which
/// says which one it names: exactly one, as the API admits; one this build left out is
/// [`Unserved::NotBuilt`] rather than a variant, so no `match` needs an arm for it.
macro_rules! view {
    ($(#[$doc:meta])* $view:ident of $spec:ty {
        $($variant:ident($field:ident: $part:ty) $(if $feature:literal)?),* $(,)?
    }) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub enum $view<'a> {
            $($(#[cfg(feature = $feature)])? $variant(&'a $part),)*
        }

        impl<'a> $view<'a> {
            pub fn of(spec: &'a $spec) -> Result<Self, Unserved> {
                $(if let Some(_part) = spec.$field.as_ref() {
                    $(#[cfg(not(feature = $feature))]
                    return Err(Unserved::NotBuilt($feature));)?
                    $(#[cfg(feature = $feature)])?
                    return Ok(Self::$variant(_part));
                })*
                Err(Unserved::Unnamed)
            }
        }
    };
}

view! {
    /// The one backend `spec.target` names.
    TargetBackend of TargetSpec {
        Redis(redis: RedisTargetSpec),
        Amqp(amqp: AmqpTargetSpec),
        Sidekiq(sidekiq: SidekiqTargetSpec),
        Nats(nats: NatsTargetSpec),
        Sqs(sqs: SqsTargetSpec) if "sqs",
        Kafka(kafka: KafkaTargetSpec) if "kafka",
        Pubsub(pubsub: PubsubTargetSpec) if "pubsub",
        Http(http: HttpTargetSpec),
    }
}

view! {
    /// The one broker `spec.source` collects from.
    SourceBackend of SourceSpec {
        Redis(redis: RedisSourceSpec),
        Amqp(amqp: AmqpSourceSpec),
        Nats(nats: NatsSourceSpec),
        Sqs(sqs: SqsSourceSpec) if "sqs",
        Sidekiq(sidekiq: SidekiqSourceSpec),
        Kafka(kafka: KafkaSourceSpec) if "kafka",
        Pubsub(pubsub: PubsubSourceSpec) if "pubsub",
    }
}

/// Why a spec's backend is not served here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unserved {
    /// The spec names none (the API refuses such a spec).
    Unnamed,
    /// This build left the backend out (its cargo feature).
    NotBuilt(&'static str),
}

/// A side of a backend in a queue's spec that may fall back on the queue's other side of the
/// same backend: a source reads its target's Secret when it names none (and a Sidekiq or
/// Pub/Sub target its source's), both reaching the one broker.
pub trait Sided {
    /// The other side's part of the spec for this backend.
    type Other;
    /// That part in `spec`, when the queue's other side is this backend too.
    fn other_in(spec: &DeadLetterQueueSpec) -> Option<&Self::Other>;
}

/// Which part of the other side each side falls back on: the one table of these rules.
macro_rules! sided {
    ($($own:ty => $other:ty: |$spec:ident| $part:expr;)*) => {$(
        impl Sided for $own {
            type Other = $other;
            fn other_in($spec: &DeadLetterQueueSpec) -> Option<&$other> {
                $part
            }
        }
    )*};
}

sided! {
    RedisSourceSpec => RedisTargetSpec: |q| q.target.redis.as_ref();
    AmqpSourceSpec => AmqpTargetSpec: |q| q.target.amqp.as_ref();
    NatsSourceSpec => NatsTargetSpec: |q| q.target.nats.as_ref();
    SqsSourceSpec => SqsTargetSpec: |q| q.target.sqs.as_ref();
    KafkaSourceSpec => KafkaTargetSpec: |q| q.target.kafka.as_ref();
    SidekiqSourceSpec => SidekiqTargetSpec: |q| q.target.sidekiq.as_ref();
    PubsubSourceSpec => PubsubTargetSpec: |q| q.target.pubsub.as_ref();
    SidekiqTargetSpec => SidekiqSourceSpec: |q| q.source.as_ref()?.sidekiq.as_ref();
    PubsubTargetSpec => PubsubSourceSpec: |q| q.source.as_ref()?.pubsub.as_ref();
}

/// The side that connects and the queue's other side of the same backend, if any.
pub struct Sides<'a, Own: Sided> {
    pub own: &'a Own,
    pub other: Option<&'a Own::Other>,
}

impl<'a, Own: Sided> Sides<'a, Own> {
    /// `own` and its other side in `spec`, the queue `own` is part of.
    pub fn of(own: &'a Own, spec: &'a DeadLetterQueueSpec) -> Self {
        let other = Own::other_in(spec);
        Sides { own, other }
    }

    /// The connecting side's setting, else the other side's.
    pub fn either<R: ?Sized>(
        &self,
        own: impl FnOnce(&'a Own) -> Option<&'a R>,
        other: impl FnOnce(&'a Own::Other) -> Option<&'a R>,
    ) -> Option<&'a R> {
        own(self.own).or_else(|| self.other.and_then(other))
    }
}

/// A side whose one Secret both sides of its backend may share: the broker URL of Redis,
/// RabbitMQ and Sidekiq, Pub/Sub's service-account key.
pub trait SharedSecret {
    /// The backend's name in the spec (`source.<KIND>`).
    const KIND: &str;
    fn secret_ref(&self) -> Option<&SecretKeyRef>;
}

macro_rules! shared_secret {
    ($($spec:ty as $kind:literal: |$s:ident| $r:expr;)*) => {$(
        impl SharedSecret for $spec {
            const KIND: &str = $kind;
            fn secret_ref(&self) -> Option<&SecretKeyRef> {
                let $s = self;
                $r
            }
        }
    )*};
}

shared_secret! {
    RedisSourceSpec as "redis": |s| s.url_secret_ref.as_ref();
    RedisTargetSpec as "redis": |t| Some(&t.url_secret_ref);
    AmqpSourceSpec as "amqp": |s| s.url_secret_ref.as_ref();
    AmqpTargetSpec as "amqp": |t| Some(&t.url_secret_ref);
    SidekiqSourceSpec as "sidekiq": |s| s.url_secret_ref.as_ref();
    SidekiqTargetSpec as "sidekiq": |t| t.url_secret_ref.as_ref();
    PubsubSourceSpec as "pubsub": |s| s.credentials_secret_ref.as_ref();
    PubsubTargetSpec as "pubsub": |t| t.credentials_secret_ref.as_ref();
}

/// A side sharing its Secret with the queue's other side of the same backend.
pub trait SharedSide: Sided<Other: SharedSecret> + SharedSecret {}

impl<T: Sided<Other: SharedSecret> + SharedSecret> SharedSide for T {}

/// The value of the Secret a side names, else of the one the queue's other side of the same
/// backend names; None when neither names one.
pub async fn shared_secret<Own: SharedSide>(
    secrets: &mut SecretReads<'_>,
    sides: Sides<'_, Own>,
) -> Result<Option<String>, SecretError> {
    match sides.either(Own::secret_ref, Own::Other::secret_ref) {
        Some(r) => Ok(Some(secrets.value(r).await?)),
        None => Ok(None),
    }
}

/// The URL a Redis, RabbitMQ or Sidekiq source connects with: its own Secret, else its queue's
/// target's of the same backend.
pub async fn source_url<Own: SharedSide>(
    secrets: &mut SecretReads<'_>,
    sides: Sides<'_, Own>,
) -> Result<String, ConnectError> {
    let kind = Own::KIND;
    let unnamed = || format!("source.{kind} needs urlSecretRef (the target has none of {kind})");
    let url = shared_secret(secrets, sides).await?;
    url.ok_or_else(|| ConnectError::Unnamed(unnamed()))
}

/// Why a backend's connection could not be read from its queue's spec and Secrets.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The spec names no way to connect (no URL, no Secret on either side).
    #[error("{0}")]
    Unnamed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> DeadLetterQueueSpec {
        serde_json::from_value(json).expect("a queue spec")
    }

    fn secret(name: &str) -> serde_json::Value {
        serde_json::json!({"name": name, "key": "url"})
    }

    /// The view names the one backend a spec names, and none for a spec naming none.
    #[test]
    fn the_view_names_the_backend_a_spec_names() {
        let q = spec(serde_json::json!({
            "target": {"sidekiq": {}},
            "source": {"redis": {"list": "dead"}},
        }));
        assert!(matches!(
            TargetBackend::of(&q.target),
            Ok(TargetBackend::Sidekiq(_))
        ));
        let source = q.source.as_ref().expect("a source");
        assert!(matches!(
            SourceBackend::of(source),
            Ok(SourceBackend::Redis(_))
        ));
        let none = spec(serde_json::json!({"target": {}}));
        assert_eq!(
            TargetBackend::of(&none.target).err(),
            Some(Unserved::Unnamed)
        );
    }

    /// A side's own Secret wins; without one, the queue's other side of the same backend's.
    #[test]
    fn a_side_falls_back_on_the_other_side_of_its_backend() {
        let q = spec(serde_json::json!({
            "target": {"sidekiq": {"urlSecretRef": secret("target")}},
            "source": {"sidekiq": {}},
        }));
        let source = q.source.as_ref().and_then(|s| s.sidekiq.as_ref());
        let sides = Sides::of(source.expect("a sidekiq source"), &q);
        let picked = sides.either(|s| s.secret_ref(), |t| t.secret_ref());
        assert_eq!(picked.map(|r| r.name.as_str()), Some("target"));

        let q = spec(serde_json::json!({
            "target": {"sidekiq": {}},
            "source": {"sidekiq": {"urlSecretRef": secret("source")}},
        }));
        let target = q.target.sidekiq.as_ref().expect("a sidekiq target");
        let sides = Sides::of(target, &q);
        let picked = sides.either(|t| t.secret_ref(), |s| s.secret_ref());
        assert_eq!(picked.map(|r| r.name.as_str()), Some("source"));

        // A Redis target does not lend its Secret to a Sidekiq source.
        let q = spec(serde_json::json!({
            "target": {"redis": {"urlSecretRef": secret("redis"), "list": "jobs"}},
            "source": {"sidekiq": {}},
        }));
        let source = q.source.as_ref().and_then(|s| s.sidekiq.as_ref());
        let sides = Sides::of(source.expect("a sidekiq source"), &q);
        assert!(
            sides
                .either(|s| s.secret_ref(), |t| t.secret_ref())
                .is_none()
        );
    }
}
