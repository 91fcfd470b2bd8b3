//! Golden bytes both ways, every error class, and random input that must not panic.

use super::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const MARKER: &str = "ffffffffffffffffffffffffffffffff";

fn golden_open() -> (Message, Vec<u8>) {
    let msg = Message::Open(Open {
        asn: 65001,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 0, 1),
        capabilities: Capabilities {
            four_octet_as: Some(65001),
            multiprotocol: Families::IPV4,
            extended_next_hop: false,
            route_refresh: true,
            graceful_restart: Some(GracefulRestart {
                restarted: false,
                restart_time: 120,
                families: vec![(AddressFamily::Ipv4Unicast, true)],
            }),
            any: true,
        },
    });
    let bytes = hex(&format!(
        "{MARKER} 0035 01  04 fde9 005a 0a000001 18
         02 16  010400010001  0200  4006 0078 00010180  4104 0000fde9"
    ));
    (msg, bytes)
}

fn ebgp_update() -> (Message, Vec<u8>) {
    let msg = Message::Update(Update {
        withdrawn: vec![],
        attributes: Some(PathAttributes {
            origin: Origin::Igp,
            as_path: vec![65001],
            next_hop: Ipv4Addr::new(10, 0, 0, 1),
            local_pref: None,
            communities: vec![(65001 << 16) | 100],
            large_communities: vec![[65001, 1, 2]],
            link_bandwidth: None,
        }),
        announced: vec!["192.0.2.10/32".parse().unwrap()],
        ..Update::default()
    });
    let bytes = hex(&format!(
        "{MARKER} 0046 02  0000 002a
         40010100  4002060201 0000fde9  4003040a000001
         c00804fde90064  c0200c 0000fde9 00000001 00000002
         20c000020a"
    ));
    (msg, bytes)
}

fn ibgp_update_4byte_as() -> (Message, Vec<u8>) {
    // iBGP: empty AS_PATH, LOCAL_PREF.
    let msg = Message::Update(Update {
        withdrawn: vec![],
        attributes: Some(PathAttributes {
            origin: Origin::Igp,
            as_path: vec![],
            next_hop: Ipv4Addr::new(10, 0, 0, 1),
            local_pref: Some(200),
            communities: vec![],
            large_communities: vec![],
            link_bandwidth: None,
        }),
        announced: vec![
            "198.51.100.1/32".parse().unwrap(),
            "198.51.100.2/32".parse().unwrap(),
        ],
        ..Update::default()
    });
    let bytes = hex(&format!(
        "{MARKER} 0036 02  0000 0015
         40010100  400200  4003040a000001  400504000000c8
         20c6336401 20c6336402"
    ));
    (msg, bytes)
}

fn as_path_4byte_update() -> (Message, Vec<u8>) {
    // A 4-byte ASN (4200000001) must go on the wire as 4 bytes (bgp-rs got this wrong).
    let msg = Message::Update(Update {
        withdrawn: vec![],
        attributes: Some(PathAttributes {
            origin: Origin::Igp,
            as_path: vec![4_200_000_001],
            next_hop: Ipv4Addr::new(10, 0, 0, 1),
            local_pref: None,
            communities: vec![],
            large_communities: vec![],
            link_bandwidth: None,
        }),
        announced: vec!["192.0.2.10/32".parse().unwrap()],
        ..Update::default()
    });
    let bytes = hex(&format!(
        "{MARKER} 0030 02  0000 0014
         40010100  4002060201 fa56ea01  4003040a000001
         20c000020a"
    ));
    (msg, bytes)
}

fn withdraw() -> (Message, Vec<u8>) {
    let msg = Message::Update(Update {
        withdrawn: vec!["192.0.2.10/32".parse().unwrap()],
        attributes: None,
        announced: vec![],
        ..Update::default()
    });
    (msg, hex(&format!("{MARKER} 001c 02  0005 20c000020a 0000")))
}

fn all_golden() -> Vec<(&'static str, Message, Vec<u8>)> {
    let mut v = Vec::new();
    let (m, b) = golden_open();
    v.push(("open", m, b));
    let (m, b) = ebgp_update();
    v.push(("ebgp update", m, b));
    let (m, b) = ibgp_update_4byte_as();
    v.push(("ibgp update", m, b));
    let (m, b) = as_path_4byte_update();
    v.push(("4-byte as path", m, b));
    let (m, b) = withdraw();
    v.push(("withdraw", m, b));
    v.push((
        "end-of-rib",
        Message::Update(Update::end_of_rib()),
        hex(&format!("{MARKER} 0017 02 0000 0000")),
    ));
    v.push((
        "keepalive",
        Message::Keepalive,
        hex(&format!("{MARKER} 0013 04")),
    ));
    v.push((
        "notification",
        Message::Notification(Notification::cease(cease::ADMINISTRATIVE_SHUTDOWN)),
        hex(&format!("{MARKER} 0015 03 0602")),
    ));
    v.push((
        "notification with data",
        Message::Notification(Notification {
            code: 1,
            subcode: 2,
            data: vec![0, 18],
        }),
        hex(&format!("{MARKER} 0017 03 0102 0012")),
    ));
    v.push((
        "route refresh",
        Message::RouteRefresh { afi: 1, safi: 1 },
        hex(&format!("{MARKER} 0017 05 0001 00 01")),
    ));
    v.extend(ipv6::golden());
    v
}

#[test]
fn golden_messages_encode_to_the_expected_bytes() {
    for (name, msg, bytes) in all_golden() {
        assert_eq!(encode(&msg).unwrap(), bytes, "{name}");
    }
}

#[test]
fn golden_bytes_decode_to_the_expected_messages() {
    for (name, msg, bytes) in all_golden() {
        assert_eq!(frame(&bytes), Ok(Some(bytes.len())), "{name}");
        assert_eq!(decode(&bytes, DecodeContext::default()), Ok(msg), "{name}");
    }
}

#[test]
fn end_of_rib_is_recognised() {
    let eor = encode(&Message::Update(Update::end_of_rib())).unwrap();
    assert!(inspect_update(&eor).unwrap().end_of_rib);
    let (_, upd) = ebgp_update();
    let s = inspect_update(&upd).unwrap();
    assert_eq!((s.announced, s.withdrawn, s.end_of_rib), (1, 0, false));
}

#[test]
fn open_with_large_asn_uses_as_trans() {
    let open = Message::Open(Open {
        asn: 4_200_000_001,
        hold_time: 9,
        router_id: Ipv4Addr::new(10, 0, 0, 2),
        capabilities: Capabilities {
            four_octet_as: Some(4_200_000_001),
            any: true,
            ..Default::default()
        },
    });
    let b = encode(&open).unwrap();
    assert_eq!(&b[20..22], &AS_TRANS.to_be_bytes());
    assert_eq!(decode(&b, DecodeContext::default()), Ok(open));
}

/// An OPEN carrying capabilities this speaker ignores, as BIRD and FRR send them
/// (enhanced route refresh, ADD-PATH, FQDN, extended messages).
#[test]
fn open_with_unknown_capabilities_decodes() {
    let b = hex(&format!(
        "{MARKER} 0041 01 04 fdea 00f0 0a000002 24
         02 22 010400010001 0200 4600 4104 0000fdea 4504 0001 0101 4908 06 726f75746572 00 0600"
    ));
    let Ok(Message::Open(o)) = decode(&b, DecodeContext::default()) else {
        panic!("{:?}", decode(&b, DecodeContext::default()))
    };
    assert_eq!(o.asn, 65002);
    assert_eq!(o.hold_time, 240);
    assert!(o.capabilities.families() == Families::IPV4 && o.capabilities.route_refresh);
}

#[test]
fn header_errors_name_the_notification() {
    let mut bad_marker = encode(&Message::Keepalive).unwrap();
    bad_marker[3] = 0;
    assert_eq!(
        frame(&bad_marker).unwrap_err().notification(),
        Some(Notification::new(
            code::MESSAGE_HEADER,
            HeaderError::ConnectionNotSynchronized as u8
        ))
    );

    let short = hex(&format!("{MARKER} 0012 04"));
    assert_eq!(
        frame(&short).unwrap_err().notification(),
        Some(Notification {
            code: 1,
            subcode: 2,
            data: vec![0, 0x12]
        })
    );

    let long_keepalive = hex(&format!("{MARKER} 0014 04 00"));
    assert_eq!(
        frame(&long_keepalive)
            .unwrap_err()
            .notification()
            .map(|n| n.subcode),
        Some(2)
    );

    let bad_type = hex(&format!("{MARKER} 0013 09"));
    assert_eq!(
        frame(&bad_type).unwrap_err().notification(),
        Some(Notification {
            code: 1,
            subcode: 3,
            data: vec![9]
        })
    );

    let too_long = hex(&format!("{MARKER} 1001 02"));
    assert_eq!(
        frame(&too_long)
            .unwrap_err()
            .notification()
            .map(|n| (n.code, n.subcode)),
        Some((1, 2))
    );

    // Incomplete but so far valid: read more.
    assert_eq!(frame(&hex(MARKER)[..10]), Ok(None));
    assert_eq!(frame(&golden_open().1[..30]), Ok(None));
}

#[test]
fn open_errors_name_the_notification() {
    let (_, mut b) = golden_open();
    b[19] = 3; // version 3
    let e = decode(&b, DecodeContext::default()).unwrap_err();
    assert_eq!(
        e.notification().map(|n| (n.code, n.subcode, n.data)),
        Some((2, 1, vec![0, 4]))
    );

    let (_, mut b) = golden_open();
    b[22..24].copy_from_slice(&2u16.to_be_bytes()); // hold time 2
    let e = decode(&b, DecodeContext::default()).unwrap_err();
    assert_eq!(e.notification().map(|n| (n.code, n.subcode)), Some((2, 6)));
}

#[test]
fn update_framing_errors_reset_the_session() {
    // Withdrawn routes length larger than the message.
    let b = hex(&format!("{MARKER} 0017 02 00ff 0000"));
    let e = decode(&b, DecodeContext::default()).unwrap_err();
    assert!(e.resets_session());
    assert_eq!(e.notification().map(|n| (n.code, n.subcode)), Some((3, 1)));

    // Total path attribute length larger than the message.
    let b = hex(&format!("{MARKER} 0017 02 0000 0010"));
    assert_eq!(
        decode(&b, DecodeContext::default())
            .unwrap_err()
            .notification()
            .map(|n| n.subcode),
        Some(1)
    );

    // NLRI with a prefix length of 33.
    let b = hex(&format!("{MARKER} 001c 02 0000 0000 21c000020a"));
    let e = inspect_update(&b).unwrap_err();
    assert_eq!(e.notification().map(|n| (n.code, n.subcode)), Some((3, 10)));

    // NLRI truncated: /32 with 3 address bytes.
    let b = hex(&format!("{MARKER} 001b 02 0000 0000 20c00002"));
    assert_eq!(
        inspect_update(&b)
            .unwrap_err()
            .notification()
            .map(|n| n.subcode),
        Some(10)
    );

    // Two MP_UNREACH_NLRI attributes.
    let b = hex(&format!(
        "{MARKER} 0025 02 0000 000a 800f03000101 800f03000101"
    ));
    assert!(inspect_update(&b).unwrap_err().resets_session());
}

#[test]
fn attribute_errors_are_treat_as_withdraw() {
    // An attribute whose length overruns the attribute list: the NLRI can still be found.
    let b = hex(&format!(
        "{MARKER} 0021 02 0000 0005 40010500 00 20c000020a"
    ));
    let e = decode(&b, DecodeContext::default()).unwrap_err();
    assert!(
        matches!(
            e,
            DecodeError::Update {
                action: Rfc7606Action::TreatAsWithdraw,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.notification(), None);
    assert!(!e.resets_session());

    // ORIGIN with the undefined value 7.
    let (_, mut b) = ebgp_update();
    b[26] = 7;
    let e = decode(&b, DecodeContext::default()).unwrap_err();
    assert!(
        matches!(
            e,
            DecodeError::Update {
                action: Rfc7606Action::TreatAsWithdraw,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.notification(), None);
    // The cheap path the session uses does not even look at it.
    assert_eq!(inspect_update(&b).map(|s| s.announced), Ok(1));
}

#[test]
fn malformed_notification_closes_without_answer() {
    let b = hex(&format!("{MARKER} 0015 03 0602"));
    assert!(decode(&b, DecodeContext::default()).is_ok());
    // A notification needs 2 bytes of body: frame() rejects 20.
    let b = hex(&format!("{MARKER} 0014 03 06"));
    assert!(frame(&b).is_err());
}

#[test]
fn oversized_update_is_refused() {
    let many: Vec<Ipv4Net> = (0..900u32)
        .map(|i| Ipv4Net::new(Ipv4Addr::from(0x0a00_0000 + i), 32).unwrap())
        .collect();
    let upd = Message::Update(Update {
        withdrawn: many,
        attributes: None,
        announced: vec![],
        ..Update::default()
    });
    assert!(matches!(encode(&upd), Err(EncodeError::TooLong(_))));
}

fn check_no_panic(bytes: &[u8]) {
    let ctx = DecodeContext::default();
    if let Ok(Some(len)) = frame(bytes) {
        let msg = &bytes[..len];
        let _ = decode(msg, ctx);
        let _ = decode(
            msg,
            DecodeContext {
                four_octet_as: false,
            },
        );
        if message_type(msg) == msg_type::UPDATE {
            let _ = inspect_update(msg);
        }
    }
    let _ = decode(bytes, ctx);
    let _ = inspect_update(bytes);
}

#[test]
fn truncations_and_bit_flips_of_golden_messages_do_not_panic() {
    for (_, _, bytes) in all_golden() {
        for cut in 0..bytes.len() {
            check_no_panic(&bytes[..cut]);
            // Keep the header's length but cut the body: decode must refuse, not panic.
            let mut b = bytes[..cut.max(HEADER_LEN)].to_vec();
            b.truncate(cut.max(HEADER_LEN));
            check_no_panic(&b);
        }
        for i in 16..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                check_no_panic(&b);
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]

    #[test]
    fn random_bytes_do_not_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
                                 ty in 1u8..=5) {
        let mut b = header_bytes(ty, body.len());
        b.extend_from_slice(&body);
        check_no_panic(&b);
        check_no_panic(&body);
    }
}

/// OPENs captured from the real daemons on this machine (BIRD 2.0.12, FRR 8.4.4,
/// GoBGP 3.10, each with graceful restart enabled), as they open towards a node.
#[test]
fn opens_captured_from_real_routers_decode() {
    let cases = [
        (
            "bird",
            "ffffffffffffffffffffffffffffffff00390104fde800f00a0001011c021a0104000100010200400600780001010041040000fde846004700",
            240,
            false,
        ),
        (
            "frr",
            "ffffffffffffffffffffffffffffffff00660104fde800b40a000101490206010400010001020280000202020002024600020641040000fde8020206000206450400010101020a490806726f757465720002084006c078000101000209470700010180000000",
            180,
            true,
        ),
        (
            "gobgp",
            "ffffffffffffffffffffffffffffffff00430104fde8005a0a0001012602240200490402766d0001040001000141040000fde840060078000101000506000100010002",
            90,
            false,
        ),
    ];
    for (name, h, hold, restarted) in cases {
        let b = hex(h);
        let Ok(Message::Open(o)) = decode(&b, DecodeContext::default()) else {
            panic!("{name}: {:?}", decode(&b, DecodeContext::default()))
        };
        assert_eq!(o.asn, 65000, "{name}");
        assert_eq!(o.router_id, Ipv4Addr::new(10, 0, 1, 1), "{name}");
        assert_eq!(o.hold_time, hold, "{name}");
        assert_eq!(o.capabilities.four_octet_as, Some(65000), "{name}");
        assert!(
            o.capabilities.families() == Families::IPV4 && o.capabilities.route_refresh,
            "{name}"
        );
        let gr = o.capabilities.graceful_restart.expect(name);
        assert_eq!(
            (gr.restarted, gr.restart_time, gr.families),
            (restarted, 120, vec![(AddressFamily::Ipv4Unicast, false)]),
            "{name}"
        );
    }
}

#[test]
fn link_bandwidth_round_trips_as_a_non_transitive_extended_community() {
    let u = Update {
        withdrawn: vec![],
        attributes: Some(PathAttributes {
            origin: Origin::Igp,
            as_path: vec![65001],
            next_hop: Ipv4Addr::new(10, 0, 0, 1),
            local_pref: None,
            communities: vec![],
            large_communities: vec![],
            link_bandwidth: Some((65001, 250_000_000)),
        }),
        announced: vec!["192.0.2.10/32".parse().unwrap()],
        ..Update::default()
    };
    let bytes = encode(&Message::Update(u.clone())).unwrap();
    // Attribute 16 (EXTENDED COMMUNITIES), optional transitive; type 0x40 (non-transitive
    // two-octet AS), subtype 0x04 (link bandwidth), AS 65001, 2.5e8 as an IEEE float.
    let mut want = vec![0xc0, 16, 8, 0x40, 0x04, 0xfd, 0xe9];
    want.extend_from_slice(&250_000_000f32.to_bits().to_be_bytes());
    assert!(
        bytes.windows(want.len()).any(|w| w == want.as_slice()),
        "{bytes:02x?}"
    );
    let ctx = DecodeContext::default();
    assert_eq!(decode(&bytes, ctx).unwrap(), Message::Update(u));
}

mod fuzz_seeds;
mod ipv6;
