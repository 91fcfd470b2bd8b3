//! The steering program's IPv6 rules under `BPF_PROG_TEST_RUN`, and the maps' Rust
//! handles. Loads BPF: needs root. A test run redirects nowhere: a packet for userspace
//! meets the empty AF_XDP slot and is counted as `no_socket`.

use super::*;
use crate::admission::Limit;
use crate::steering::{SteerDrops, SteeredIface};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const ICMPV6: u8 = 58;

const VIP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);
const OTHER_VIP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x11);
const CLIENT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 7);
const BACKEND: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 5);
const NODE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x2);

/// What the program did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Pass,
    /// To the AF_XDP socket (counted as `no_socket`: there is none in a test run).
    Userspace,
    /// Dropped in the program under this reason.
    Dropped(&'static str),
}

/// The one counter that grew between `a` and `b`, by name.
fn grown(a: SteerDrops, b: SteerDrops) -> Vec<&'static str> {
    let pairs = [
        ("port_not_exposed", a.port_not_exposed, b.port_not_exposed),
        (
            "unsupported_protocol",
            a.unsupported_protocol,
            b.unsupported_protocol,
        ),
        (
            "new_flow_prefix_rate",
            a.new_flow_prefix_rate,
            b.new_flow_prefix_rate,
        ),
        ("no_socket", a.no_socket, b.no_socket),
        (
            "redirect_not_from_peer",
            a.redirect_not_from_peer,
            b.redirect_not_from_peer,
        ),
        (
            "source_range_denied",
            a.source_range_denied,
            b.source_range_denied,
        ),
    ];
    pairs
        .iter()
        .filter(|(_, x, y)| y != x)
        .map(|(n, ..)| *n)
        .collect()
}

fn run(st: &Steering, frame: &[u8]) -> Seen {
    let before = st.drops();
    let (verdict, _) = st.test_run(frame, 1).expect("test run");
    let grew = grown(before, st.drops());
    match (verdict, grew.as_slice()) {
        (XDP_PASS, []) => Seen::Pass,
        (XDP_DROP, ["no_socket"]) => Seen::Userspace,
        (XDP_DROP, [reason]) => Seen::Dropped(reason),
        other => panic!("verdict and counters {other:?}"),
    }
}

/// An Ethernet + IPv6 frame carrying `payload` after a header with next header `nh`.
fn frame(src: Ipv6Addr, dst: Ipv6Addr, hop_limit: u8, nh: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![2, 0, 0, 0, 0, 1, 4, 0, 0, 0, 0, 2, 0x86, 0xdd];
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[nh, hop_limit]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(payload);
    f
}

/// A TCP SYN (checksum not filled: the program does not read it).
fn tcp(sport: u16, dport: u16) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x02;
    t
}

fn udp(sport: u16, dport: u16) -> Vec<u8> {
    let mut u = vec![0u8; 16];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&16u16.to_be_bytes());
    u
}

fn syn(src: Ipv6Addr, dst: Ipv6Addr, sport: u16, dport: u16) -> Vec<u8> {
    frame(src, dst, 64, IPPROTO_TCP, &tcp(sport, dport))
}

/// An ICMPv6 message: type, code, 4 bytes of rest (0) and `body`.
fn icmp6(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, 0, 0, 0, 0, 0, 5, 0xdc];
    m.extend_from_slice(body);
    m
}

/// An ICMPv6 error of `kind` from `from` to `to`, quoting `quoted` (a frame: its IPv6
/// packet is quoted).
fn icmp6_error(from: Ipv6Addr, to: Ipv6Addr, kind: u8, quoted: &[u8]) -> Vec<u8> {
    frame(from, to, 64, ICMPV6, &icmp6(kind, &quoted[14..]))
}

/// A fragment of a datagram `id` with `inner` as next header, at `offset` (8-byte units).
fn fragment(src: Ipv6Addr, dst: Ipv6Addr, inner: u8, id: u32, offset: u16, more: bool) -> Vec<u8> {
    let mut p = vec![inner, 0];
    p.extend_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    if offset == 0 {
        p.extend_from_slice(&udp(53, 40000));
    } else {
        p.extend_from_slice(&[0xab; 24]);
    }
    frame(src, dst, 64, 44, &p)
}

fn loaded() -> (tempfile::TempDir, Steering) {
    let dir = tempfile::tempdir().unwrap();
    let (st, _, _) = Steering::load(dir.path(), 1024, 1, false)
        .expect("loading the steering program (run as root)");
    (dir, st)
}

/// Loopback (ifindex 1) as the uplink, or as a Pod interface.
fn role(st: &mut Steering, uplink: bool) {
    st.configure_iface(&SteeredIface {
        name: "lo".into(),
        ifindex: 1,
        uplink,
        slot_base: 0,
        queues: 1,
    })
    .unwrap();
}

#[test]
fn frontends_must_be_tcp_or_udp_and_a_refused_sync_changes_nothing() {
    let (_d, mut st) = loaded();
    st.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    let e = st
        .sync6(&[(VIP, IPPROTO_TCP, 443), (OTHER_VIP, 1, 0)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[2001:db8:ffff::11]:0") && e.contains("protocol 1"),
        "{e}"
    );
    let many: Vec<Frontend6> = (0..=MAX_FRONTENDS6 as u32)
        .map(|i| (VIP, IPPROTO_UDP, (i % 65_536) as u16))
        .chain(std::iter::once((OTHER_VIP, IPPROTO_UDP, 1)))
        .collect();
    let e = st.sync6(&many).unwrap_err().to_string();
    assert!(e.contains("at most 65536"), "{e}");
    assert_eq!(frontends_in(&st), vec![(VIP, IPPROTO_TCP, 443)]);
    assert_eq!(vips_in(&st), vec![VIP]);
}

fn frontends_in(st: &Steering) -> Vec<Frontend6> {
    let mut v: Vec<Frontend6> = st
        .frontends6
        .keys()
        .map(|k| k.unwrap().frontend())
        .collect();
    v.sort();
    v
}

fn vips_in(st: &Steering) -> Vec<Ipv6Addr> {
    let mut v: Vec<Ipv6Addr> = st.vips6.keys().map(|k| k.unwrap().into()).collect();
    v.sort();
    v
}

#[test]
fn sync6_adds_removes_and_adds_again_and_the_program_follows() {
    let (_d, mut st) = loaded();
    role(&mut st, true);
    let web = (VIP, IPPROTO_TCP, 443);
    let dns = (OTHER_VIP, IPPROTO_UDP, 53);
    st.sync6(&[web, dns, web]).unwrap();
    assert_eq!(frontends_in(&st), vec![web, dns]);
    assert_eq!(vips_in(&st), vec![VIP, OTHER_VIP]);
    let to_web = syn(CLIENT, VIP, 40000, 443);
    assert_eq!(run(&st, &to_web), Seen::Userspace);
    st.sync6(&[dns]).unwrap();
    assert_eq!(frontends_in(&st), vec![dns]);
    assert_eq!(vips_in(&st), vec![OTHER_VIP]);
    assert_eq!(run(&st, &to_web), Seen::Pass, "no longer a VIP");
    let to_dns = frame(CLIENT, OTHER_VIP, 64, IPPROTO_UDP, &udp(40000, 53));
    assert_eq!(run(&st, &to_dns), Seen::Userspace);
    st.sync6(&[web, dns]).unwrap();
    assert_eq!(run(&st, &to_web), Seen::Userspace);
    st.sync6(&[]).unwrap();
    assert_eq!(frontends_in(&st), Vec::<Frontend6>::new());
    assert_eq!(vips_in(&st), Vec::<Ipv6Addr>::new());
    assert_eq!(run(&st, &to_dns), Seen::Pass);
}

#[test]
fn the_uplink_takes_what_is_juneaus_and_drops_the_rest_to_a_vip() {
    let (_d, mut st) = loaded();
    role(&mut st, true);
    st.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    assert_eq!(run(&st, &syn(CLIENT, VIP, 40000, 443)), Seen::Userspace);
    assert_eq!(
        run(&st, &syn(CLIENT, VIP, 40000, 80)),
        Seen::Dropped("port_not_exposed")
    );
    let udp443 = frame(CLIENT, VIP, 64, IPPROTO_UDP, &udp(40000, 443));
    assert_eq!(run(&st, &udp443), Seen::Dropped("port_not_exposed"));
    let echo = frame(CLIENT, VIP, 64, ICMPV6, &icmp6(128, &[0; 8]));
    assert_eq!(run(&st, &echo), Seen::Dropped("unsupported_protocol"));
    // Not a VIP: the node's own traffic.
    assert_eq!(run(&st, &syn(CLIENT, NODE, 40000, 22)), Seen::Pass);
    let echo_node = frame(CLIENT, NODE, 64, ICMPV6, &icmp6(128, &[0; 8]));
    assert_eq!(run(&st, &echo_node), Seen::Pass);
    // Neighbour discovery, even about the VIP, and an expiring hop limit are the
    // kernel's.
    for nd in 133..=137 {
        let m = frame(CLIENT, VIP, 255, ICMPV6, &icmp6(nd, &VIP.octets()));
        assert_eq!(run(&st, &m), Seen::Pass, "ND type {nd}");
    }
    assert_eq!(
        run(&st, &frame(CLIENT, VIP, 1, IPPROTO_TCP, &tcp(40000, 443))),
        Seen::Pass
    );
    // An extension header to a VIP: userspace walks it; to the node it passes.
    let mut hbh = vec![IPPROTO_TCP, 0, 1, 4, 0, 0, 0, 0];
    hbh.extend_from_slice(&tcp(40000, 443));
    assert_eq!(run(&st, &frame(CLIENT, VIP, 64, 0, &hbh)), Seen::Userspace);
    assert_eq!(run(&st, &frame(CLIENT, NODE, 64, 0, &hbh)), Seen::Pass);
    // A TCP header cut before its ports, to a VIP: userspace counts it as malformed.
    let cut = frame(CLIENT, VIP, 64, IPPROTO_TCP, &[0x9c]);
    assert_eq!(run(&st, &cut), Seen::Userspace);
    // Not IPv6 inside: a truncated IPv6 header passes.
    let short = &syn(CLIENT, VIP, 40000, 443)[..40];
    assert_eq!(run(&st, short), Seen::Pass);
}

#[test]
fn an_icmp6_error_about_a_vips_reply_reaches_userspace() {
    let (_d, mut st) = loaded();
    role(&mut st, true);
    st.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    let router = Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, 0, 1);
    // Our reply VIP:443 -> client, too big for a router on the way.
    let reply = syn(VIP, CLIENT, 443, 40000);
    for kind in [1, 2, 3] {
        let e = icmp6_error(router, VIP, kind, &reply);
        assert_eq!(run(&st, &e), Seen::Userspace, "type {kind}");
    }
    let e = icmp6_error(router, VIP, 4, &reply);
    assert_eq!(
        run(&st, &e),
        Seen::Dropped("unsupported_protocol"),
        "parameter problem"
    );
    let other_port = syn(VIP, CLIENT, 80, 40000);
    let e = icmp6_error(router, VIP, 2, &other_port);
    assert_eq!(run(&st, &e), Seen::Dropped("port_not_exposed"));
    let cut = icmp6_error(router, VIP, 2, &reply[..14 + 40 + 2]);
    assert_eq!(run(&st, &cut), Seen::Dropped("unsupported_protocol"));
}

#[test]
fn a_held_flow_reaches_userspace_after_its_frontend_is_gone() {
    let (_d, mut st) = loaded();
    role(&mut st, true);
    st.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    let flows = st.flows6().clone();
    let fwd = Flow6MapKey::new(CLIENT, VIP, 40000, 443, IPPROTO_TCP);
    flows.insert(&fwd, 0).unwrap();
    st.sync6(&[]).unwrap();
    let packet = syn(CLIENT, VIP, 40000, 443);
    assert_eq!(run(&st, &packet), Seen::Userspace);
    // Another client's packet to the same, now unserved, address passes.
    assert_eq!(run(&st, &syn(NODE, VIP, 40000, 443)), Seen::Pass);
    flows.remove(&fwd).unwrap();
    assert_eq!(run(&st, &packet), Seen::Pass);
}

#[test]
fn new_flows_are_admitted_per_source_slash_64_and_held_flows_never_wait() {
    let (_d, mut st) = loaded();
    role(&mut st, true);
    st.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    let admission = st
        .set_new_flow_admission(Limit { rate: 1, burst: 1 })
        .unwrap();
    let same_64 = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0xa, 0xb, 0xc, 0xd);
    let other_64 = Ipv6Addr::new(0x2001, 0xdb8, 1, 1, 0, 0, 0, 7);
    assert_eq!(run(&st, &syn(CLIENT, VIP, 40000, 443)), Seen::Userspace);
    // Userspace debits the bucket for the packet it received (the program only reads).
    assert_eq!(run(&st, &syn(same_64, VIP, 40001, 443)), Seen::Userspace);
    let now = crate::region::monotonic_ns();
    assert!(admission.admit(crate::admission::key_v6(&CLIENT.octets()), now));
    assert!(!admission.admit(crate::admission::key_v6(&same_64.octets()), now));
    assert_eq!(
        run(&st, &syn(same_64, VIP, 40001, 443)),
        Seen::Dropped("new_flow_prefix_rate")
    );
    assert_eq!(run(&st, &syn(other_64, VIP, 40000, 443)), Seen::Userspace);
    st.flows6()
        .insert(&Flow6MapKey::new(same_64, VIP, 40001, 443, IPPROTO_TCP), 0)
        .unwrap();
    assert_eq!(run(&st, &syn(same_64, VIP, 40001, 443)), Seen::Userspace);
}

#[test]
fn a_pod_interface_takes_replies_and_errors_of_held_flows_only() {
    let (_d, mut st) = loaded();
    role(&mut st, false);
    let flows = st.flows6().clone();
    // The flow client -> VIP:443, DNATed to the backend's 8443.
    flows
        .insert(&Flow6MapKey::new(CLIENT, VIP, 40000, 443, IPPROTO_TCP), 0)
        .unwrap();
    flows
        .insert(
            &Flow6MapKey::new(BACKEND, CLIENT, 8443, 40000, IPPROTO_TCP),
            0,
        )
        .unwrap();
    let reply = syn(BACKEND, CLIENT, 8443, 40000);
    assert_eq!(run(&st, &reply), Seen::Userspace);
    assert_eq!(run(&st, &syn(BACKEND, CLIENT, 8443, 40001)), Seen::Pass);
    assert_eq!(run(&st, &syn(BACKEND, NODE, 40000, 53)), Seen::Pass);
    // The backend's error about a packet it received (client -> backend).
    let received = syn(CLIENT, BACKEND, 40000, 8443);
    let ptb = icmp6_error(BACKEND, CLIENT, 2, &received);
    assert_eq!(run(&st, &ptb), Seen::Userspace);
    let unreachable = icmp6_error(BACKEND, CLIENT, 1, &received);
    assert_eq!(run(&st, &unreachable), Seen::Userspace);
    let other = icmp6_error(BACKEND, CLIENT, 2, &syn(CLIENT, BACKEND, 40001, 8443));
    assert_eq!(run(&st, &other), Seen::Pass);
    let echo = frame(BACKEND, CLIENT, 64, ICMPV6, &icmp6(129, &[0; 8]));
    assert_eq!(run(&st, &echo), Seen::Pass);
    let na = frame(BACKEND, CLIENT, 255, ICMPV6, &icmp6(136, &CLIENT.octets()));
    assert_eq!(run(&st, &na), Seen::Pass);
    assert_eq!(
        run(
            &st,
            &frame(BACKEND, CLIENT, 1, IPPROTO_TCP, &tcp(8443, 40000))
        ),
        Seen::Pass
    );
}

#[test]
fn a_fragmented_reply_of_a_held_flow_reaches_userspace_whole() {
    let (_d, mut st) = loaded();
    role(&mut st, false);
    st.flows6()
        .insert(
            &Flow6MapKey::new(BACKEND, CLIENT, 53, 40000, IPPROTO_UDP),
            0,
        )
        .unwrap();
    let first = fragment(BACKEND, CLIENT, IPPROTO_UDP, 77, 0, true);
    let later = fragment(BACKEND, CLIENT, IPPROTO_UDP, 77, 185, false);
    // A later fragment before its first: nothing remembered yet.
    assert_eq!(run(&st, &later), Seen::Pass);
    assert_eq!(run(&st, &first), Seen::Userspace);
    assert_eq!(run(&st, &later), Seen::Userspace);
    // Another datagram's later fragment, and fragments of a flow no one holds.
    let stranger = fragment(BACKEND, CLIENT, IPPROTO_UDP, 78, 185, false);
    assert_eq!(run(&st, &stranger), Seen::Pass);
    let own = fragment(BACKEND, NODE, IPPROTO_UDP, 79, 0, true);
    assert_eq!(run(&st, &own), Seen::Pass);
    let own_later = fragment(BACKEND, NODE, IPPROTO_UDP, 79, 185, false);
    assert_eq!(run(&st, &own_later), Seen::Pass);
}

#[test]
fn flows6_round_trips_from_worker_threads() {
    let (_d, st) = loaded();
    let flows = st.flows6().clone();
    let a = Flow6MapKey::new(CLIENT, VIP, 40000, 443, IPPROTO_TCP);
    let b = Flow6MapKey::new(BACKEND, CLIENT, 8443, 40000, IPPROTO_TCP);
    assert_eq!(a.sport, [0x9c, 0x40]);
    assert_eq!(a.src, CLIENT.octets());
    std::thread::scope(|s| {
        let (fa, fb) = (flows.clone(), flows.clone());
        s.spawn(move || fa.insert(&a, 3).unwrap());
        s.spawn(move || fb.insert(&b, 3).unwrap());
    });
    let mut got = flows.entries().unwrap();
    got.sort_by_key(|(k, _)| k.src);
    assert_eq!(got, vec![(a, 3), (b, 3)]);
    flows.insert(&a, 5).unwrap();
    flows.remove(&b).unwrap();
    flows.remove(&b).expect("a missing key is no error");
    assert_eq!(flows.entries().unwrap(), vec![(a, 5)]);
    assert_eq!(flows.capacity(), 2 * 1024);
}

#[test]
fn a_full_flows6_says_so() {
    let (_d, st) = loaded();
    let flows = st.flows6();
    for port in 0..2048u16 {
        flows
            .insert(&Flow6MapKey::new(CLIENT, VIP, port, 443, IPPROTO_TCP), 0)
            .unwrap();
    }
    let e = flows
        .insert(&Flow6MapKey::new(CLIENT, VIP, 9999, 443, IPPROTO_TCP), 0)
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("flows6 is full (2048 keys") && e.contains("[2001:db8:1::7]:9999"),
        "{e}"
    );
}

/// The IPv6 maps are pinned: a restarted dataplane finds its flows' keys, and its first
/// sync6 removes the frontends the previous run installed and no longer wants.
#[test]
fn a_restart_keeps_the_ipv6_flows_and_frontends() {
    let fs = crate::steering::tests::Bpffs::new();
    let pin = fs.0.path().join("node");
    let key = Flow6MapKey::new(CLIENT, VIP, 40000, 443, IPPROTO_TCP);
    let (mut first, _, _) = Steering::load(&pin, 1024, 1, false).unwrap();
    first
        .sync6(&[(VIP, IPPROTO_TCP, 443), (OTHER_VIP, IPPROTO_UDP, 53)])
        .unwrap();
    first.flows6().insert(&key, 0).unwrap();
    drop(first);
    let (mut again, _, replaced) = Steering::load(&pin, 1024, 1, false).unwrap();
    assert!(replaced.is_none());
    assert_eq!(again.flows6().entries().unwrap(), vec![(key, 0)]);
    assert_eq!(
        frontends_in(&again),
        vec![(VIP, IPPROTO_TCP, 443), (OTHER_VIP, IPPROTO_UDP, 53)]
    );
    again.sync6(&[(VIP, IPPROTO_TCP, 443)]).unwrap();
    assert_eq!(frontends_in(&again), vec![(VIP, IPPROTO_TCP, 443)]);
    assert_eq!(vips_in(&again), vec![VIP]);
    drop(again);
    // Another flow capacity replaces the flow maps, flows6 with them.
    let (other, _, replaced) = Steering::load(&pin, 4096, 1, false).unwrap();
    assert!(replaced.is_some());
    assert!(other.flows6().entries().unwrap().is_empty());
    assert_eq!(other.flows6().capacity(), 2 * 4096);
}
