//! API keys in two tiers: **inference** keys (generate, chat, list models) and **admin** keys
//! (deploy, undeploy, plan, remove a replica — and inference). Keys are kept as SHA-256 digests
//! and a presented key is compared, hashed, with every key of both tiers in constant time, so
//! neither a key's length nor its position in the list shows in the time taken.
//!
//! With no admin key configured, inference keys carry both tiers (one tier, as before admin keys
//! existed); with no inference key configured but admin keys, inference needs no key.

use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Inference,
    Admin,
}

/// Why a request's key was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("an API key is required")]
    Missing,
    #[error("invalid API key")]
    Invalid,
}

/// The keys of one server.
#[derive(Clone, Default)]
pub struct ApiKeys {
    inference: Vec<[u8; 32]>,
    admin: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} inference, {} admin)", self.inference.len(), self.admin.len())
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn any_of(keys: &[[u8; 32]], given: &[u8; 32]) -> bool {
    bool::from(keys.iter().fold(Choice::from(0), |seen, k| seen | k.ct_eq(given)))
}

impl ApiKeys {
    /// Empty keys are dropped.
    pub fn new<S: AsRef<str>>(inference: &[S], admin: &[S]) -> Self {
        let keep = |keys: &[S]| keys.iter().map(AsRef::as_ref).filter(|k| !k.is_empty()).map(digest).collect();
        Self { inference: keep(inference), admin: keep(admin) }
    }

    /// True when no key of either tier is configured: everything is open.
    pub fn is_open(&self) -> bool {
        self.inference.is_empty() && self.admin.is_empty()
    }

    /// The tier of a request presenting `given` (the bearer token, if any).
    pub fn check(&self, given: Option<&str>) -> Result<Tier, KeyError> {
        if self.is_open() {
            return Ok(Tier::Admin);
        }
        let Some(given) = given else {
            return if self.inference.is_empty() { Ok(Tier::Inference) } else { Err(KeyError::Missing) };
        };
        let given = digest(given);
        let (admin, inference) = (any_of(&self.admin, &given), any_of(&self.inference, &given));
        match (admin, inference) {
            (true, _) => Ok(Tier::Admin),
            (false, true) if self.admin.is_empty() => Ok(Tier::Admin),
            (false, true) => Ok(Tier::Inference),
            (false, false) => Err(KeyError::Invalid),
        }
    }

    /// The bearer token of an `Authorization` header value.
    pub fn bearer(header: Option<&str>) -> Option<&str> {
        header.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers() {
        let open = ApiKeys::new::<&str>(&[], &[]);
        assert_eq!(open.check(None), Ok(Tier::Admin));
        let one_tier = ApiKeys::new(&["infer-key"], &[]);
        assert_eq!(one_tier.check(Some("infer-key")), Ok(Tier::Admin));
        assert_eq!(one_tier.check(Some("infer-ke")), Err(KeyError::Invalid));
        assert_eq!(one_tier.check(Some("infer-key2")), Err(KeyError::Invalid));
        assert_eq!(one_tier.check(None), Err(KeyError::Missing));
        let two = ApiKeys::new(&["infer-key", ""], &["admin-key"]);
        assert_eq!(two.check(Some("infer-key")), Ok(Tier::Inference));
        assert_eq!(two.check(Some("admin-key")), Ok(Tier::Admin));
        assert_eq!(two.check(Some("")), Err(KeyError::Invalid));
        assert_eq!(two.check(None), Err(KeyError::Missing));
        let public_inference = ApiKeys::new(&[], &["admin-key"]);
        assert_eq!(public_inference.check(None), Ok(Tier::Inference));
        assert_eq!(public_inference.check(Some("admin-key")), Ok(Tier::Admin));
        assert_eq!(public_inference.check(Some("guess")), Err(KeyError::Invalid));
        assert!(!format!("{two:?}").contains("key"));
    }
}
