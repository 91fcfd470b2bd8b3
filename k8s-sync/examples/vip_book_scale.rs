//! What giving N Services a new VIP each costs in the controller's VIP book:
//! `VipBook::allocate` for N owners in a row from one AddressPool, against the same
//! allocations made by replaying the book into a fresh `Ipam` every time (what
//! `allocate` did before it kept the replay). Prints both totals and the cost of the last
//! 1 000 allocations of each (where an O(N) replay is dearest).
//!
//! `cargo run --release -p juneau-k8s-sync --example vip_book_scale -- [N]` (default 10 000).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use juneau_control::ipam::{AddressPool, Family, Ipam};
use juneau_k8s_sync::crd::{AddressPoolSpec, AdvertiseMode};
use juneau_k8s_sync::vips::{parse_pool, VipBook};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("N"))
        .unwrap_or(10_000);
    let pools: Vec<AddressPool> = vec![parse_pool(
        "scale",
        &AddressPoolSpec {
            advertise_mode: AdvertiseMode::bgp(),
            addresses: vec!["10.64.0.0/16".into()],
            allow_network_and_broadcast: None,
            auto_assign: None,
            service_allocation: None,
        },
    )
    .expect("pool")];
    let owners: Vec<String> = (0..n).map(|i| format!("default/s{i:05}")).collect();

    // The book as the controller uses it.
    let mut book = VipBook::default();
    let (mut total, mut tail) = (Duration::ZERO, Duration::ZERO);
    let mut kept = Vec::with_capacity(n);
    for (i, o) in owners.iter().enumerate() {
        let t = Instant::now();
        let a = book
            .allocate(o, &pools, Family::V4, None)
            .expect("allocate");
        let d = t.elapsed();
        total += d;
        if i + 1000 >= n {
            tail += d;
        }
        kept.push(a.ip);
    }

    // A fresh replay per allocation, as before.
    let mut claims: Vec<(String, IpAddr)> = Vec::with_capacity(n);
    let (mut rtotal, mut rtail) = (Duration::ZERO, Duration::ZERO);
    for (i, o) in owners.iter().enumerate() {
        let t = Instant::now();
        let (mut ipam, _) = Ipam::rebuild(pools.iter().cloned(), claims.iter().cloned());
        let a = ipam
            .allocate(o, &["scale"], Family::V4, None)
            .expect("allocate");
        claims.push((o.clone(), a.ip));
        drop(ipam);
        let d = t.elapsed();
        rtotal += d;
        if i + 1000 >= n {
            rtail += d;
        }
        assert_eq!(
            a.ip, kept[i],
            "the kept replay and a fresh one disagree at {i}"
        );
    }
    let last = 1000.min(n);
    println!(
        "{n} allocations: kept replay {:.1} ms in all ({:.1} us each over the last {last}); \
         fresh replay each time {:.1} ms in all ({:.1} us each over the last {last})",
        total.as_secs_f64() * 1e3,
        tail.as_secs_f64() * 1e6 / last as f64,
        rtotal.as_secs_f64() * 1e3,
        rtail.as_secs_f64() * 1e6 / last as f64,
    );
}
