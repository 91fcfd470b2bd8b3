//! A BGP peer's TCP-MD5 password must never leave the process by way of `Debug` (the
//! agent logs its state with `debug!(?state)`) or serialization (status, dumps): only the
//! shared-memory file carries it, and the speaker reads it from there (issue #25).

use std::net::Ipv4Addr;

use juneau_control::model::{NodeState, PeerConfig};

const PASSWORD: &str = "s3cret-md5-Password";

fn state() -> NodeState {
    let mut p = PeerConfig::new("tor-1", Ipv4Addr::new(192, 0, 2, 1), 65000, 65001);
    p.md5_password = Some(PASSWORD.into());
    NodeState {
        node: "node-a".into(),
        peers: vec![p],
        ..Default::default()
    }
}

#[test]
fn debug_of_a_state_shows_no_password() {
    let s = state();
    for text in [
        format!("{s:?}"),
        format!("{s:#?}"),
        format!("{:?}", s.peers[0]),
    ] {
        assert!(!text.contains(PASSWORD), "password in Debug output: {text}");
        assert!(text.contains("<redacted>"), "a password is set: {text}");
    }
}

#[test]
fn serializing_a_state_leaves_the_password_out() {
    let s = state();
    let json = serde_json::to_string(&s).unwrap();
    assert!(!json.contains(PASSWORD), "password in JSON: {json}");
    assert!(!json.contains("md5_password"), "{json}");
}

/// The redirect channel's MAC key: neither in `Debug` nor serialized.
#[test]
fn the_redirect_key_is_neither_printed_nor_serialized() {
    use juneau_control::model::RedirectKey;
    use juneau_control::secret::SecretKey;
    // Bytes whose hex and decimal forms are easy to spot.
    let key = [0xc3u8; 16];
    let mut s = state();
    s.redirects.keys = vec![RedirectKey::new(SecretKey::new(key))];
    let id = s.redirects.keys[0].id;
    for text in [
        format!("{s:?}"),
        format!("{s:#?}"),
        format!("{:?}", s.redirects),
    ] {
        assert!(!text.contains("195"), "key bytes in Debug output: {text}");
        assert!(!text.to_lowercase().contains("c3c3"), "{text}");
        assert!(text.contains("<redacted>"), "{text}");
        assert!(
            text.contains(&format!("id: {id}")),
            "the id is shown: {text}"
        );
    }
    let json = serde_json::to_string(&s).unwrap();
    assert!(!json.contains("keys"), "{json}");
    assert!(!json.contains("195"), "{json}");
}

/// A peer's BFD authentication key: neither in `Debug` nor serialized.
#[test]
fn the_bfd_key_is_neither_printed_nor_serialized() {
    use juneau_control::model::{BfdAuth, BfdAuthType};
    const BFD_KEY: &str = "bfd-Key-s3cret";
    let mut s = state();
    s.peers[0].bfd_auth = Some(BfdAuth {
        auth_type: BfdAuthType::KeyedSha1,
        key_id: 3,
        key: BFD_KEY.into(),
    });
    for text in [
        format!("{s:?}"),
        format!("{s:#?}"),
        format!("{:?}", s.peers[0]),
        format!("{:?}", s.peers[0].bfd_auth),
    ] {
        assert!(!text.contains(BFD_KEY), "BFD key in Debug output: {text}");
        assert!(text.contains("<redacted>"), "{text}");
    }
    let json = serde_json::to_string(&s).unwrap();
    assert!(!json.contains(BFD_KEY), "BFD key in JSON: {json}");
    assert!(!json.contains("bfd_auth"), "{json}");
}
