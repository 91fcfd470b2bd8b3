//! Passwords and keys (a BGP peer's TCP-MD5 password, the redirect channel's MAC keys;
//! BFD authentication keys later).
//!
//! A [`Secret`] wraps [`secrecy::SecretString`] (zeroed when dropped) and adds what the
//! model needs: equality (to notice a changed password) and deserialization. Its `Debug`
//! prints `<redacted>`, and it deliberately does **not** implement `Serialize`: a struct
//! that holds one must say `#[serde(skip_serializing)]`, so no status, dump or log line
//! can carry the plaintext by accident. The only place the bytes go is where they are
//! needed: the node-state file (mode 0600, [`crate::shm`]) and the kernel's
//! `TCP_MD5SIG` socket option, both through [`Secret::expose`].

use std::fmt;

use secrecy::{ExposeSecret, SecretBox, SecretString};
use serde::{Deserialize, Deserializer};

/// A password or key; see the [module documentation](self).
#[derive(Clone)]
pub struct Secret(SecretString);

impl Secret {
    /// Wraps a plaintext.
    pub fn new(plaintext: impl Into<String>) -> Self {
        Secret(SecretString::from(plaintext.into()))
    }

    /// The plaintext, for the one place that must hand it on (the shared-memory file, a
    /// socket option). Never log or serialize what this returns.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    /// Its length in bytes (a length is no secret worth keeping: the kernel limits it).
    pub fn len(&self) -> usize {
        self.expose().len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.expose().is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.expose() == other.expose()
    }
}

impl Eq for Secret {}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret::new(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret::new(s)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret::new)
    }
}

/// Bytes of a [`SecretKey`]: the 128-bit key of SipHash-2-4 (the redirect channel's MAC).
pub const KEY_BYTES: usize = 16;

/// A binary key (the redirect channel's MAC key), zeroed when dropped. Like [`Secret`]:
/// `Debug` prints `<redacted>`, no `Serialize`, equality to notice a change, and the bytes
/// only through [`SecretKey::expose`].
pub struct SecretKey(SecretBox<[u8; KEY_BYTES]>);

impl SecretKey {
    /// Wraps key bytes.
    pub fn new(bytes: [u8; KEY_BYTES]) -> Self {
        SecretKey(SecretBox::new(Box::new(bytes)))
    }

    /// The key bytes, for the one place that must hand them on (the shared-memory file)
    /// or use them (the MAC). Never log or serialize what this returns.
    pub fn expose(&self) -> &[u8; KEY_BYTES] {
        self.0.expose_secret()
    }
}

impl Clone for SecretKey {
    fn clone(&self) -> Self {
        SecretKey::new(*self.expose())
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl PartialEq for SecretKey {
    fn eq(&self, other: &Self) -> bool {
        self.expose() == other.expose()
    }
}

impl Eq for SecretKey {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_redacted_and_expose_gives_the_plaintext() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(format!("{:?}", Some(s.clone())), "Some(<redacted>)");
        assert_eq!(s.expose(), "hunter2");
        assert_eq!(s.len(), 7);
        assert_eq!(s, Secret::from("hunter2"));
        assert_ne!(s, Secret::from("hunter3"));
    }

    #[test]
    fn a_key_is_redacted_too() {
        let k = SecretKey::new([0xab; KEY_BYTES]);
        assert_eq!(format!("{k:?}"), "<redacted>");
        assert_eq!(format!("{:?}", vec![k.clone()]), "[<redacted>]");
        assert_eq!(k.expose(), &[0xab; KEY_BYTES]);
        assert_eq!(k, k.clone());
        assert_ne!(k, SecretKey::new([0xac; KEY_BYTES]));
    }
}
