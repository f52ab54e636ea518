//! Who may park over HTTP: a bearer token the apiserver vouches for (a TokenReview with the
//! queue's audience), whose user may `create deadletters` in the queue's namespace (a
//! SubjectAccessReview). Both answers are kept for [`TTL`], so a sender posting a storm costs
//! two reviews, not two per event. Tokens are never logged and kept only as their hash.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::ResourceAttributes;
use kube::api::PostParams;
use kube::{Api, Client};
use sha2::{Digest, Sha256};

/// How long a review's answer is trusted: a revoked token or RoleBinding takes this long to
/// bite (the apiserver's own webhook token cache keeps answers 2 minutes).
pub const TTL: Duration = Duration::from_secs(30);
/// A refusal is kept shorter: a RoleBinding just created works soon.
const TTL_REFUSED: Duration = Duration::from_secs(5);
/// Most answers kept per cache; beyond, the expired go and then all.
const MAX_ENTRIES: usize = 4096;

/// Why a caller may not park; the message is the answer's body (no token in it).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("a bearer token is required (this queue does not allow anonymous parking)")]
    NoToken,
    #[error(
        "a bearer token is required: anonymous parking is taken only from the in-cluster \
         addresses this operator was given (--park-anonymous-from), and {0} is not among them"
    )]
    NotInCluster(IpAddr),
    #[error("the token was not accepted for audience {0:?}")]
    Unauthenticated(String),
    #[error("{user} may not create deadletters in namespace {namespace}")]
    Forbidden { user: String, namespace: String },
    #[error("cannot check the caller with the apiserver: {0}")]
    Unavailable(String),
}

impl AuthError {
    pub fn status(&self) -> u16 {
        match self {
            AuthError::NoToken | AuthError::NotInCluster(_) | AuthError::Unauthenticated(_) => 401,
            AuthError::Forbidden { .. } => 403,
            AuthError::Unavailable(_) => 503,
        }
    }
}

/// Answers kept until their deadline.
struct Cache<K, V> {
    entries: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: std::hash::Hash + Eq, V: Clone> Cache<K, V> {
    fn new() -> Self {
        Cache {
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries.lock().ok()?;
        entries
            .get(key)
            .filter(|(until, _)| *until > Instant::now())
            .map(|(_, v)| v.clone())
    }

    fn put(&self, key: K, value: V, ttl: Duration) {
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if entries.len() >= MAX_ENTRIES {
            let now = Instant::now();
            entries.retain(|_, (until, _)| *until > now);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(key, (Instant::now() + ttl, value));
    }
}

/// A caller without a token: "system:anonymous" when the queue allows it and `peer` is one of
/// `from`.
fn anonymous(allowed: bool, peer: IpAddr, from: &[IpNet]) -> Result<String, AuthError> {
    if !allowed {
        return Err(AuthError::NoToken);
    }
    // An IPv4 client of a dual-stack socket shows as ::ffff:a.b.c.d.
    let peer = match peer {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
        v4 => v4,
    };
    if from.iter().any(|net| net.contains(&peer)) {
        Ok("system:anonymous".into())
    } else {
        Err(AuthError::NotInCluster(peer))
    }
}

/// The reviews and their answers.
pub struct Auth {
    client: Client,
    /// sha256(audience, token) → the user, or None when the token was refused.
    tokens: Cache<[u8; 32], Option<UserInfo>>,
    /// (user, groups, namespace) → allowed.
    access: Cache<(String, Vec<String>, String), bool>,
    /// Where anonymous parkers may connect from (the cluster's pod network): a queue's
    /// `allowAnonymous` means callers inside the cluster, and only the operator's deployer
    /// knows which addresses those are.
    anonymous_from: Vec<IpNet>,
}

impl Auth {
    pub fn new(client: Client, anonymous_from: Vec<IpNet>) -> Self {
        Auth {
            client,
            tokens: Cache::new(),
            access: Cache::new(),
            anonymous_from,
        }
    }

    /// The caller's name when it may park into `namespace`: `token` (a bearer token, if any)
    /// checked for `audience`; without one, "system:anonymous" only when `allow_anonymous`
    /// and the caller connected from `peer` inside the cluster.
    pub async fn check(
        &self,
        token: Option<&str>,
        audience: &str,
        namespace: &str,
        allow_anonymous: bool,
        peer: IpAddr,
    ) -> Result<String, AuthError> {
        let Some(token) = token else {
            return anonymous(allow_anonymous, peer, &self.anonymous_from);
        };
        let user = self
            .authenticate(token, audience)
            .await?
            .ok_or_else(|| AuthError::Unauthenticated(audience.to_string()))?;
        let name = user.username.clone().unwrap_or_default();
        if self.authorize(&user, namespace).await? {
            Ok(name)
        } else {
            Err(AuthError::Forbidden {
                user: name,
                namespace: namespace.to_string(),
            })
        }
    }

    /// The token's user for `audience`, None when the apiserver does not vouch for it.
    async fn authenticate(
        &self,
        token: &str,
        audience: &str,
    ) -> Result<Option<UserInfo>, AuthError> {
        let mut hash = Sha256::new();
        hash.update(audience.as_bytes());
        hash.update([0]);
        hash.update(token.as_bytes());
        let key: [u8; 32] = hash.finalize().into();
        if let Some(user) = self.tokens.get(&key) {
            return Ok(user);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![audience.to_string()]),
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(format!("TokenReview: {e}")))?;
        let status = answer.status.unwrap_or_default();
        let audience_ok = status
            .audiences
            .as_ref()
            .is_none_or(|a| a.iter().any(|x| x == audience));
        let user = status
            .user
            .filter(|_| status.authenticated == Some(true) && audience_ok);
        let ttl = if user.is_some() { TTL } else { TTL_REFUSED };
        self.tokens.put(key, user.clone(), ttl);
        Ok(user)
    }

    /// Whether `user` may create deadletters in `namespace`.
    async fn authorize(&self, user: &UserInfo, namespace: &str) -> Result<bool, AuthError> {
        let name = user.username.clone().unwrap_or_default();
        let groups = user.groups.clone().unwrap_or_default();
        let key = (name.clone(), groups.clone(), namespace.to_string());
        if let Some(allowed) = self.access.get(&key) {
            return Ok(allowed);
        }
        let attributes = ResourceAttributes {
            namespace: Some(namespace.to_string()),
            verb: Some("create".into()),
            group: Some("dlq.dev".into()),
            resource: Some("deadletters".into()),
            ..ResourceAttributes::default()
        };
        let allowed = crate::access::allowed(&self.client, user, attributes)
            .await
            .map_err(|e| AuthError::Unavailable(format!("SubjectAccessReview: {e}")))?;
        let ttl = if allowed { TTL } else { TTL_REFUSED };
        self.access.put(key, allowed, ttl);
        Ok(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_expire_and_the_cache_stays_bounded() {
        let cache: Cache<u32, bool> = Cache::new();
        cache.put(1, true, Duration::from_secs(60));
        cache.put(2, true, Duration::ZERO);
        assert_eq!(cache.get(&1), Some(true));
        assert_eq!(cache.get(&2), None, "expired");
        for i in 0..(MAX_ENTRIES as u32 * 2) {
            cache.put(i, false, Duration::from_secs(60));
        }
        assert!(cache.entries.lock().expect("lock").len() <= MAX_ENTRIES);
    }

    #[test]
    fn anonymous_parkers_are_taken_only_from_the_given_networks() {
        let pods: Vec<ipnet::IpNet> = vec!["198.18.0.0/16".parse().unwrap()];
        let inside = "198.18.3.4".parse().unwrap();
        assert_eq!(anonymous(true, inside, &pods).unwrap(), "system:anonymous");
        let mapped = "::ffff:198.18.3.4".parse().unwrap();
        assert!(anonymous(true, mapped, &pods).is_ok(), "dual-stack socket");
        let outside = "198.19.0.1".parse().unwrap();
        assert!(matches!(
            anonymous(true, outside, &pods),
            Err(AuthError::NotInCluster(_))
        ));
        assert!(matches!(
            anonymous(true, inside, &[]),
            Err(AuthError::NotInCluster(_))
        ));
        assert!(matches!(
            anonymous(false, inside, &pods),
            Err(AuthError::NoToken)
        ));
    }
}
