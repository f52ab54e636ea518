//! Who may park over HTTP: a bearer token the apiserver vouches for (a TokenReview with the
//! queue's audience), whose user may `create deadletters` in the queue's namespace (a
//! SubjectAccessReview). Both answers are kept for [`TTL`], so a sender posting a storm costs
//! two reviews, not two per event. Tokens are never logged and kept only as their hash.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
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
            AuthError::NoToken | AuthError::Unauthenticated(_) => 401,
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

/// The reviews and their answers.
pub struct Auth {
    client: Client,
    /// sha256(audience, token) → the user, or None when the token was refused.
    tokens: Cache<[u8; 32], Option<UserInfo>>,
    /// (user, groups, namespace) → allowed.
    access: Cache<(String, Vec<String>, String), bool>,
}

impl Auth {
    pub fn new(client: Client) -> Self {
        Auth {
            client,
            tokens: Cache::new(),
            access: Cache::new(),
        }
    }

    /// The caller's name when it may park into `namespace`: `token` (a bearer token, if any)
    /// checked for `audience`; without one, "system:anonymous" only when `allow_anonymous`.
    pub async fn check(
        &self,
        token: Option<&str>,
        audience: &str,
        namespace: &str,
        allow_anonymous: bool,
    ) -> Result<String, AuthError> {
        let Some(token) = token else {
            return if allow_anonymous {
                Ok("system:anonymous".into())
            } else {
                Err(AuthError::NoToken)
            };
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
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(name),
                groups: Some(groups),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    verb: Some("create".into()),
                    group: Some("dlq.dev".into()),
                    resource: Some("deadletters".into()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(format!("SubjectAccessReview: {e}")))?;
        let allowed = answer.status.is_some_and(|s| s.allowed);
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
}
