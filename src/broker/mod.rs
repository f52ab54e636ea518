//! The brokers, one module per backend: its connection, its codec (how a message's headers and
//! properties read and write) and how its refusals are classified. A backend's source and its
//! target both use its module here; neither names the other (`scripts/module-arrows.sh`).
//! Each backend's module is also the one place its connection is read from a queue's spec and
//! Secrets, for its source, its target and the backlog probe alike; [`backend`] says which
//! backend a spec names.

pub mod amqp;
pub mod backend;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nats;
#[cfg(feature = "pubsub")]
pub mod pubsub;
pub mod redis;
#[cfg(feature = "sqs")]
pub mod sqs;

/// What a broker did with a request: the part of a target's error a connection can cause,
/// turned into `crate::targets::TargetError` by the same words (`From`), so a condition, an
/// Event or a log reads as before.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BrokerError {
    /// Could not reach the broker, or it did not answer in time. Retried with backoff.
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// The broker answered but did not accept the request.
    #[error("broker refused the job: {0}")]
    Refused(String),
    /// What was to be sent cannot be written in the broker's terms (a name over AMQP's 255
    /// bytes, a header that does not parse).
    #[error("invalid job: {0}")]
    Invalid(String),
    /// The connection's settings are unusable (bad URL, missing secret).
    #[error("target misconfigured: {0}")]
    Config(String),
}

/// Why a queue naming `backend` (`kafka`, `sqs`, `pubsub`) cannot be served: this operator was
/// built without that cargo feature.
pub fn not_built(backend: &str) -> String {
    format!(
        "this operator was built without the {backend} backend (cargo feature `{backend}`, on by \
         default); run a build with it"
    )
}

/// `scheme://host[:port]/path` of a URL: no user, password, query or fragment, so it can go
/// into status, Events and logs.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (s, r),
        None => ("", url),
    };
    let end = rest.find(['?', '#']).unwrap_or(rest.len());
    let rest = &rest[..end];
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if scheme.is_empty() {
        format!("{host}{path}")
    } else {
        format!("{scheme}://{host}{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacted_urls_keep_no_secrets() {
        assert_eq!(
            redact_url("amqps://user:pa%40ss@rabbit:5671/vhost?heartbeat=5"),
            "amqps://rabbit:5671/vhost"
        );
        assert_eq!(
            redact_url("https://h.example/hook?token=abc#x"),
            "https://h.example/hook"
        );
        assert_eq!(redact_url("nats://tok@n1:4222"), "nats://n1:4222");
        assert_eq!(redact_url("host:1"), "host:1");
    }
}
