//! The seed corpora of the BGP fuzz targets (`bgp/fuzz/seeds/`), generated from the
//! golden messages; the committed files must be exactly these
//! (`JUNEAU_WRITE_FUZZ_SEEDS=1 cargo test -p juneau-bgp --lib fuzz_seed` rewrites them).

use super::*;

/// OPENs captured from BIRD, FRR and GoBGP (the bytes of
/// `opens_captured_from_real_routers_decode`).
const ROUTER_OPENS: [(&str, &str); 3] = [
    ("open-bird", "ffffffffffffffffffffffffffffffff00390104fde800f00a0001011c021a0104000100010200400600780001010041040000fde846004700"),
    ("open-frr", "ffffffffffffffffffffffffffffffff00660104fde800b40a000101490206010400010001020280000202020002024600020641040000fde8020206000206450400010101020a490806726f757465720002084006c078000101000209470700010180000000"),
    ("open-gobgp", "ffffffffffffffffffffffffffffffff00430104fde8005a0a0001012602240200490402766d0001040001000141040000fde840060078000101000506000100010002"),
];

/// FSM fuzz input (`bgp/fuzz/src/lib.rs`, `check_fsm`): one op byte per event, `op % 10`.
mod op {
    pub const START: u8 = 0;
    pub const OUTBOUND_UP: u8 = 2;
    pub const INBOUND_UP: u8 = 3;
    pub const CLOSED: u8 = 5;
    pub const TIMER: u8 = 6;
    pub const BYTES: u8 = 7;
}

fn fsm_bytes(out: &mut Vec<u8>, conn: u8, bytes: &[u8]) {
    for chunk in bytes.chunks(255) {
        out.extend_from_slice(&[op::BYTES, conn, chunk.len() as u8]);
        out.extend_from_slice(chunk);
    }
}

fn fuzz_seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let name = |s: &str| s.replace([' ', '/'], "-");
    for (n, _, bytes) in all_golden() {
        out.push(("bgp-decode", name(n), bytes));
    }
    for (n, h) in ROUTER_OPENS {
        out.push(("bgp-decode", n.to_string(), hex(h)));
    }
    // The fuzzed FSM is AS 65000 / 10.0.0.2 expecting AS 65001: the golden OPEN's peer.
    let (_, peer_open) = golden_open();
    let keepalive = hex(&format!("{MARKER} 0013 04"));
    let (_, update) = ebgp_update();
    let (_, wd) = withdraw();
    // An outbound connection names the pending attempt (pick byte 0); an inbound one
    // takes no pick byte.
    for (n, conn_up) in [
        ("fsm-outbound", &[op::OUTBOUND_UP, 0][..]),
        ("fsm-inbound", &[op::INBOUND_UP][..]),
    ] {
        let mut s = vec![op::START];
        s.extend_from_slice(conn_up);
        for m in [&peer_open, &keepalive, &update, &wd, &keepalive] {
            fsm_bytes(&mut s, 0, m);
        }
        // Keepalive and hold timers of connection 0, then the peer closes.
        s.extend_from_slice(&[op::TIMER, 3, op::TIMER, 2, op::CLOSED, 0]);
        out.push(("bgp-fsm", n.to_string(), s));
    }
    // Everything in one segment, and an OPEN split across segments.
    let mut s = vec![op::START, op::OUTBOUND_UP, 0];
    fsm_bytes(&mut s, 0, &[&peer_open[..], &keepalive, &update].concat());
    out.push(("bgp-fsm", "fsm-one-segment".to_string(), s));
    let mut s = vec![op::START, op::OUTBOUND_UP, 0];
    fsm_bytes(&mut s, 0, &peer_open[..10]);
    fsm_bytes(&mut s, 0, &peer_open[10..]);
    fsm_bytes(&mut s, 0, &keepalive);
    out.push(("bgp-fsm", "fsm-split-open".to_string(), s));
    out
}

#[test]
fn fuzz_seed_corpora_are_generated_from_the_golden_messages() {
    // The package's directory as cargo runs the test (`CARGO_MANIFEST_DIR` at run time), else
    // the one it was compiled in: a binary reused from another checkout sharing
    // `CARGO_TARGET_DIR` has a baked-in path that may be gone (tests/src/lib.rs, `repo_root`).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
        .join("fuzz/seeds");
    let targets = ["bgp-decode", "bgp-fsm"];
    let mut want = fuzz_seeds();
    if std::env::var_os("JUNEAU_WRITE_FUZZ_SEEDS").is_some() {
        for t in targets {
            let _ = std::fs::remove_dir_all(root.join(t));
            std::fs::create_dir_all(root.join(t)).unwrap();
        }
        for (t, n, bytes) in &want {
            std::fs::write(root.join(t).join(n), bytes).unwrap();
        }
    }
    let mut have = Vec::new();
    for t in targets {
        for e in std::fs::read_dir(root.join(t)).unwrap() {
            let e = e.unwrap();
            let n = e.file_name().into_string().unwrap();
            have.push((t, n, std::fs::read(e.path()).unwrap()));
        }
    }
    want.sort();
    have.sort();
    assert!(
        want == have,
        "bgp/fuzz/seeds is stale: regenerate with JUNEAU_WRITE_FUZZ_SEEDS=1 \
         cargo test -p juneau-bgp --lib fuzz_seed"
    );
}
