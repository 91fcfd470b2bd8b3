//! The redirect channel's MAC keys, as a pure decision: from the Secret
//! [`SECRET_NAME`] of Juneau's namespace, the keys the agent publishes in
//! [`juneau_control::model::Redirects::keys`].
//!
//! The Secret holds `current` (the key every node sends with) and optionally `next` (a
//! key being rotated in, accepted by every node but not yet sent with). Each value is a
//! 16-byte key written in base64 (`head -c 16 /dev/urandom | base64`), surrounding
//! whitespace ignored. No Secret: no key, the channel runs unauthenticated. A Secret that is wrong in any way — no `current`, a value that is not
//! base64 or not 16 bytes — is reported in plain words (never with its bytes) and
//! **changes nothing**: the keys in force stay published, so a bad edit cannot cut the
//! nodes off from each other.
//!
//! Must not touch: the API (the agent's watch feeds it), the bytes of a key in any message.

use juneau_control::model::{RedirectKey, MAX_REDIRECT_KEYS};
use juneau_control::secret::{SecretKey, KEY_BYTES};
use k8s_openapi::api::core::v1::Secret;

/// Name of the Secret with the redirect channel's keys, in Juneau's namespace.
pub const SECRET_NAME: &str = "juneau-redirect-key";
/// The key every node sends with.
pub const CURRENT: &str = "current";
/// A key being rotated in: accepted, not sent with.
pub const NEXT: &str = "next";

/// What is wrong with the Secret (never its contents).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The Secret has no `current`.
    #[error(
        "Secret {ns}/{SECRET_NAME} has no key `{CURRENT}`; the redirect keys in force are kept"
    )]
    NoCurrent {
        /// The Secret's namespace.
        ns: String,
    },
    /// A value is not base64.
    #[error("Secret {ns}/{SECRET_NAME}: `{field}` is not base64 (a {KEY_BYTES}-byte key written with `head -c {KEY_BYTES} /dev/urandom | base64`); the redirect keys in force are kept")]
    NotBase64 {
        /// The Secret's namespace.
        ns: String,
        /// `current` or `next`.
        field: &'static str,
    },
    /// A value decodes to the wrong number of bytes.
    #[error("Secret {ns}/{SECRET_NAME}: `{field}` is {len} bytes once decoded, a redirect key is {KEY_BYTES}; the redirect keys in force are kept")]
    Length {
        /// The Secret's namespace.
        ns: String,
        /// `current` or `next`.
        field: &'static str,
        /// Bytes it decodes to.
        len: usize,
    },
}

/// The raw value of `field` (from `data`, or `stringData` on an object not yet stored).
fn raw<'a>(s: &'a Secret, field: &str) -> Option<&'a [u8]> {
    if let Some(v) = s.data.as_ref().and_then(|d| d.get(field)) {
        return Some(&v.0);
    }
    s.string_data
        .as_ref()
        .and_then(|d| d.get(field))
        .map(|v| v.as_bytes())
}

fn decode(ns: &str, field: &'static str, value: &[u8]) -> Result<SecretKey, KeyError> {
    use base64::Engine as _;
    let text = value.trim_ascii();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| KeyError::NotBase64 {
            ns: ns.to_string(),
            field,
        })?;
    let key: [u8; KEY_BYTES] = bytes.as_slice().try_into().map_err(|_| KeyError::Length {
        ns: ns.to_string(),
        field,
        len: bytes.len(),
    })?;
    Ok(SecretKey::new(key))
}

/// The keys the Secret holds, `current` first (no Secret: none). `next` equal to
/// `current` is the same key once.
pub fn keys_of(secret: Option<&Secret>, ns: &str) -> Result<Vec<RedirectKey>, KeyError> {
    let Some(s) = secret else {
        return Ok(Vec::new());
    };
    let current = raw(s, CURRENT).ok_or_else(|| KeyError::NoCurrent { ns: ns.to_string() })?;
    let mut keys = vec![RedirectKey::new(decode(ns, CURRENT, current)?)];
    if let Some(next) = raw(s, NEXT) {
        let next = RedirectKey::new(decode(ns, NEXT, next)?);
        if next != keys[0] {
            keys.push(next);
        }
    }
    debug_assert!(keys.len() <= MAX_REDIRECT_KEYS);
    Ok(keys)
}

/// The keys to publish: the Secret's when it is valid; else the ones in force
/// (`in_force`, the last published), unchanged, with the error to report.
pub fn keys_to_publish(
    secret: Option<&Secret>,
    ns: &str,
    in_force: &[RedirectKey],
) -> (Vec<RedirectKey>, Option<KeyError>) {
    match keys_of(secret, ns) {
        Ok(keys) => (keys, None),
        Err(e) => (in_force.to_vec(), Some(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    const NS: &str = "juneau-system";
    /// base64 of 16 bytes 0x01..=0x10, and of 16 × 0xaa.
    const K1: &str = "AQIDBAUGBwgJCgsMDQ4PEA==";
    const K2: &str = "qqqqqqqqqqqqqqqqqqqqqg==";

    fn secret(data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }

    fn bytes(k: &RedirectKey) -> [u8; 16] {
        *k.key.expose()
    }

    #[test]
    fn current_then_next_and_no_secret_no_key() {
        assert!(keys_of(None, NS).unwrap().is_empty());
        let k = keys_of(Some(&secret(&[(CURRENT, K1)])), NS).unwrap();
        assert_eq!(k.len(), 1);
        assert_eq!(bytes(&k[0]), std::array::from_fn(|i| i as u8 + 1));
        // With `next` (and a trailing newline, as `base64` prints it): current first.
        let k = keys_of(
            Some(&secret(&[
                (NEXT, format!("{K2}\n").as_str()),
                (CURRENT, K1),
            ])),
            NS,
        )
        .unwrap();
        assert_eq!(k.len(), 2);
        assert_eq!(bytes(&k[1]), [0xaa; 16]);
        assert_eq!(k[1], RedirectKey::new(SecretKey::new([0xaa; 16])));
        // A key keeps its id when it moves from `next` to `current`.
        let after = keys_of(Some(&secret(&[(CURRENT, K2)])), NS).unwrap();
        assert_eq!(after[0].id, k[1].id);
        // `next` equal to `current`: one key.
        let same = keys_of(Some(&secret(&[(CURRENT, K1), (NEXT, K1)])), NS).unwrap();
        assert_eq!(same.len(), 1);
    }

    #[test]
    fn a_bad_secret_is_reported_plainly_and_keeps_the_keys_in_force() {
        let in_force = keys_of(Some(&secret(&[(CURRENT, K1), (NEXT, K2)])), NS).unwrap();
        let bad = [
            (secret(&[(NEXT, K2)]), "has no key `current`"),
            (
                secret(&[(CURRENT, "not base64!")]),
                "`current` is not base64",
            ),
            (
                secret(&[(CURRENT, K1), (NEXT, "AAAA")]),
                "`next` is 3 bytes once decoded, a redirect key is 16",
            ),
            // Unpadded base64 is not what `base64` prints: refused, not guessed at.
            (
                secret(&[(CURRENT, "A".repeat(43).as_str())]),
                "`current` is not base64",
            ),
            (
                // 32 bytes (the design's first sketch; a BLAKE3 key): not this key.
                secret(&[(CURRENT, format!("{}=", "A".repeat(43)).as_str())]),
                "`current` is 32 bytes once decoded",
            ),
            (secret(&[]), "has no key `current`"),
        ];
        for (s, says) in bad {
            let (keys, err) = keys_to_publish(Some(&s), NS, &in_force);
            let err = err.expect("an error").to_string();
            assert!(err.contains(says), "{err}");
            assert!(err.contains("juneau-system/juneau-redirect-key"), "{err}");
            assert!(err.contains("kept"), "{err}");
            assert_eq!(keys, in_force, "nothing lost: {err}");
            // Never the Secret's bytes in the message.
            for v in [K1, K2] {
                assert!(!err.contains(v), "{err}");
            }
        }
        // Before any key was in force, a bad Secret publishes none (and says why).
        let (keys, err) = keys_to_publish(Some(&secret(&[(CURRENT, "x")])), NS, &[]);
        assert!(keys.is_empty() && err.is_some());
        // A good Secret replaces the keys; deleting it is deliberate: no key.
        let (keys, err) = keys_to_publish(Some(&secret(&[(CURRENT, K2)])), NS, &in_force);
        assert_eq!((keys.len(), err), (1, None));
        assert_eq!(keys_to_publish(None, NS, &in_force), (vec![], None));
    }
}
