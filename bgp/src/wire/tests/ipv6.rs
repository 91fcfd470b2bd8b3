//! MP-BGP: IPv6 unicast (RFC 4760, RFC 2545), RFC 8950 extended next hop, End-of-RIB per
//! family (RFC 4724), and the cheap walk over MP_REACH/MP_UNREACH.

use super::*;

const GLOBAL: &str = "20010db8000000000000000000000001";
const LINK_LOCAL: &str = "fe800000000000000000000000000001";
const VIP: &str = "20010db8ffff00000000000000000010";

fn attrs(as_path: Vec<u32>) -> PathAttributes {
    PathAttributes {
        origin: Origin::Igp,
        as_path,
        next_hop: Ipv4Addr::UNSPECIFIED,
        local_pref: None,
        communities: vec![],
        large_communities: vec![],
        link_bandwidth: None,
    }
}

fn ipv6_update() -> Message {
    Message::Update(Update {
        attributes: Some(attrs(vec![65001])),
        mp_reach: Some(MpReach {
            family: AddressFamily::Ipv6Unicast,
            next_hop: "2001:db8::1".parse().unwrap(),
            link_local: Some("fe80::1".parse().unwrap()),
            announced: vec!["2001:db8:ffff::10/128".parse().unwrap()],
        }),
        ..Update::default()
    })
}

fn dual_stack_open() -> Message {
    Message::Open(Open {
        asn: 65001,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 0, 1),
        capabilities: Capabilities {
            four_octet_as: Some(65001),
            multiprotocol: Families::BOTH,
            extended_next_hop: true,
            route_refresh: true,
            graceful_restart: Some(GracefulRestart {
                restarted: false,
                restart_time: 120,
                families: vec![
                    (AddressFamily::Ipv4Unicast, true),
                    (AddressFamily::Ipv6Unicast, true),
                ],
            }),
            any: true,
        },
    })
}

/// The IPv6 golden messages, bytes written by hand from the RFCs.
pub(super) fn golden() -> Vec<(&'static str, Message, Vec<u8>)> {
    vec![
        (
            // No NEXT_HOP attribute; MP_REACH_NLRI optional non-transitive, AFI 2 SAFI 1,
            // a 32-byte next hop (global + link-local), reserved octet, one /128.
            "ipv6 update",
            ipv6_update(),
            hex(&format!(
                "{MARKER} 005d 02 0000 0046
                 40010100  4002060201 0000fde9
                 800e36 0002 01 20 {GLOBAL} {LINK_LOCAL} 00 80 {VIP}"
            )),
        ),
        (
            "ipv6 withdraw",
            Message::Update(Update {
                mp_unreach: Some(MpUnreach {
                    family: AddressFamily::Ipv6Unicast,
                    withdrawn: vec!["2001:db8:ffff::10/128".parse().unwrap()],
                }),
                ..Update::default()
            }),
            hex(&format!(
                "{MARKER} 002e 02 0000 0017 800f14 0002 01 80 {VIP}"
            )),
        ),
        (
            // RFC 4724 §2: the End-of-RIB of a family other than IPv4 unicast is an
            // UPDATE holding only an empty MP_UNREACH_NLRI of that family.
            "ipv6 end-of-rib",
            Message::Update(Update::end_of_rib_for(AddressFamily::Ipv6Unicast)),
            hex(&format!("{MARKER} 001d 02 0000 0006 800f03 0002 01")),
        ),
        (
            // Multiprotocol IPv4 and IPv6 unicast, extended next hop (code 5: AFI 1
            // SAFI 1 next-hop AFI 2), route refresh, graceful restart listing both
            // families with forwarding preserved, 4-octet AS.
            "dual-stack open",
            dual_stack_open(),
            hex(&format!(
                "{MARKER} 0047 01  04 fde9 005a 0a000001 2a
                 02 28  010400010001 010400020001 0506000100010002 0200
                 400a 0078 00010180 00020180  4104 0000fde9"
            )),
        ),
    ]
}

#[test]
fn end_of_rib_is_per_family() {
    let v4 = Update::end_of_rib_for(AddressFamily::Ipv4Unicast);
    let v6 = Update::end_of_rib_for(AddressFamily::Ipv6Unicast);
    assert_eq!(v4, Update::end_of_rib());
    assert_eq!(v4.end_of_rib_family(), Some(AddressFamily::Ipv4Unicast));
    assert_eq!(v6.end_of_rib_family(), Some(AddressFamily::Ipv6Unicast));
    assert!(!v6.is_end_of_rib(), "not the IPv4 marker");
    let Ok(Message::Update(u)) = decode(&ipv6_golden("ipv6 end-of-rib"), Default::default()) else {
        panic!("decodes")
    };
    assert_eq!(u.end_of_rib_family(), Some(AddressFamily::Ipv6Unicast));
    // A withdrawal is not an End-of-RIB.
    let Ok(Message::Update(w)) = decode(&ipv6_golden("ipv6 withdraw"), Default::default()) else {
        panic!("decodes")
    };
    assert_eq!(w.end_of_rib_family(), None);
    let s = inspect_update(&encode(&Message::Update(v6)).unwrap()).unwrap();
    assert_eq!(
        (s.end_of_rib, s.mp_withdrawn, s.mp_announced),
        (false, 0, 0)
    );
}

fn ipv6_golden(name: &str) -> Vec<u8> {
    golden()
        .into_iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, b)| b)
        .unwrap()
}

#[test]
fn inspect_counts_ipv6_prefixes_from_peers() {
    let s = inspect_update(&ipv6_golden("ipv6 update")).unwrap();
    assert_eq!((s.announced, s.mp_announced, s.end_of_rib), (0, 1, false));
    let s = inspect_update(&ipv6_golden("ipv6 withdraw")).unwrap();
    assert_eq!((s.withdrawn, s.mp_withdrawn), (0, 1));
    // As FRR sends it: a 16-byte next hop, three prefixes of different lengths.
    let frr = hex(&format!(
        "{MARKER} 005d 02 0000 0046
         40010100  40020602010000fde8
         800e36 0002 01 10 {GLOBAL} 00  30 20010db80001  40 20010db800020000  80 {VIP}"
    ));
    assert_eq!(frame(&frr), Ok(Some(frr.len())));
    assert_eq!(inspect_update(&frr).unwrap().mp_announced, 3);
    let Ok(Message::Update(u)) = decode(&frr, DecodeContext::default()) else {
        panic!("{:?}", decode(&frr, DecodeContext::default()))
    };
    let r = u.mp_reach.unwrap();
    assert_eq!(
        (r.family, r.link_local, r.announced.len()),
        (AddressFamily::Ipv6Unicast, None, 3)
    );
}

#[test]
fn malformed_mp_nlri_resets_the_session() {
    let mut bad_len = ipv6_golden("ipv6 update");
    // The /128 announced as /129.
    let at = bad_len.len() - 17;
    assert_eq!(bad_len[at], 128);
    bad_len[at] = 129;
    // The next-hop length pointing past the attribute.
    let mut bad_nh = ipv6_golden("ipv6 update");
    let at = bad_nh.iter().position(|&b| b == 0x20).unwrap();
    bad_nh[at] = 0x40;
    for bytes in [bad_len, bad_nh] {
        let e = inspect_update(&bytes).unwrap_err();
        assert!(e.resets_session(), "{e}");
        assert_eq!(
            e.notification().map(|n| (n.code, n.subcode)),
            Some((
                code::UPDATE_MESSAGE,
                UpdateError::OptionalAttributeError as u8
            ))
        );
    }
}

#[test]
fn ipv4_routes_with_an_ipv6_next_hop_round_trip() {
    // RFC 8950: IPv4 NLRI in MP_REACH_NLRI (AFI 1 SAFI 1) with a 16-byte next hop.
    let u = Update {
        attributes: Some(attrs(vec![65001])),
        mp_reach: Some(MpReach {
            family: AddressFamily::Ipv4Unicast,
            next_hop: "2001:db8::1".parse().unwrap(),
            link_local: None,
            announced: vec!["192.0.2.10/32".parse().unwrap()],
        }),
        ..Update::default()
    };
    let bytes = encode(&Message::Update(u.clone())).unwrap();
    let want = hex(&format!("0001 01 10 {GLOBAL} 00 20 c000020a"));
    assert!(bytes.windows(want.len()).any(|w| w == want), "{bytes:02x?}");
    assert_eq!(
        decode(&bytes, DecodeContext::default()),
        Ok(Message::Update(u))
    );
    assert_eq!(inspect_update(&bytes).unwrap().mp_announced, 1);
}

#[test]
fn prefixes_of_the_wrong_family_and_mp_reach_without_attributes_are_refused() {
    let Message::Update(good) = ipv6_update() else {
        unreachable!()
    };
    let mut v4_in_v6 = good.clone();
    v4_in_v6.mp_reach.as_mut().unwrap().announced = vec!["192.0.2.1/32".parse().unwrap()];
    assert!(matches!(
        encode(&Message::Update(v4_in_v6)),
        Err(EncodeError::InvalidPrefix(_))
    ));
    let bare = Update {
        attributes: None,
        ..good
    };
    assert!(matches!(
        encode(&Message::Update(bare)),
        Err(EncodeError::Codec(_))
    ));
}

#[test]
fn capabilities_offer_families_and_no_mp_capability_means_ipv4() {
    let Ok(Message::Open(o)) = decode(&ipv6_golden("dual-stack open"), Default::default()) else {
        panic!("decodes")
    };
    assert_eq!(o.capabilities.families(), Families::BOTH);
    assert!(o.capabilities.extended_next_hop);
    // RFC 4760 §8: capabilities without a multiprotocol one, or none at all: IPv4 only.
    let plain = Capabilities {
        four_octet_as: Some(65001),
        any: true,
        ..Capabilities::default()
    };
    assert_eq!(plain.families(), Families::IPV4);
    assert_eq!(Capabilities::default().families(), Families::IPV4);
    let v6_only = Capabilities {
        multiprotocol: Families::NONE.with(AddressFamily::Ipv6Unicast),
        ..plain
    };
    assert_eq!(
        v6_only.families(),
        Families::NONE.with(AddressFamily::Ipv6Unicast)
    );
}

/// Found by the bgp-decode fuzz target: an UPDATE holding only an MP_UNREACH_NLRI of a
/// family we do not speak (AFI 1, SAFI 252) is not the IPv4 End-of-RIB.
#[test]
fn mp_unreach_of_another_family_is_not_an_end_of_rib() {
    let b = hex(&format!(
        "{MARKER} 002e 02 0000 0017 800f14 0001 fc 80 20010db8ffff00000000000000000010"
    ));
    let s = inspect_update(&b).unwrap();
    let Ok(Message::Update(u)) = decode(&b, DecodeContext::default()) else {
        panic!("{:?}", decode(&b, DecodeContext::default()))
    };
    assert_eq!((s.end_of_rib, u.is_end_of_rib()), (false, false));
    assert_eq!(u.end_of_rib_family(), None);
}

/// Found by the bgp-decode fuzz target: an IPv6 MP_REACH_NLRI whose next hop is 0 bytes
/// long. netgauze reads 16 bytes of next hop whatever the length says (and so other
/// prefixes); the walk refuses lengths RFC 2545 does not allow, which resets the
/// session, and `decode` with it.
#[test]
fn ipv6_next_hop_lengths_other_than_16_and_32_reset_the_session() {
    for len in [0u8, 4, 15, 17, 31, 33] {
        // MP_REACH_NLRI AFI 2 SAFI 1, `len` bytes of next hop, reserved, no NLRI.
        let mut attr = vec![0x80, 0x0e, 5 + len, 0, 2, 1, len];
        attr.extend(std::iter::repeat_n(0x20, usize::from(len)));
        attr.push(0);
        let mut b = hex(&format!("{MARKER} 0000 02 0000"));
        b.extend_from_slice(&(attr.len() as u16).to_be_bytes());
        b.extend_from_slice(&attr);
        let total = b.len() as u16;
        b[16..18].copy_from_slice(&total.to_be_bytes());
        let e = inspect_update(&b).unwrap_err();
        assert!(e.resets_session(), "length {len}: {e}");
        assert!(
            decode(&b, DecodeContext::default()).is_err(),
            "length {len}"
        );
    }
    // 16 and 32 are fine.
    for b in [ipv6_golden("ipv6 update"), ipv6_golden("ipv6 withdraw")] {
        assert!(inspect_update(&b).is_ok());
    }
}

/// Found by the bgp-decode fuzz target: an UPDATE with only an empty MP_UNREACH_NLRI of
/// IPv4 unicast. RFC 4724 makes IPv4's End-of-RIB the empty UPDATE, so this is not one
/// (the walk, which looks at no attribute, agrees).
#[test]
fn empty_mp_unreach_of_ipv4_is_not_an_end_of_rib() {
    let b = hex(&format!("{MARKER} 001d 02 0000 0006 800f03 0001 01"));
    let s = inspect_update(&b).unwrap();
    let Ok(Message::Update(u)) = decode(&b, DecodeContext::default()) else {
        panic!("{:?}", decode(&b, DecodeContext::default()))
    };
    assert_eq!((s.end_of_rib, u.is_end_of_rib()), (false, false));
    assert_eq!(u.end_of_rib_family(), None);
}
