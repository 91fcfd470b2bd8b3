//! Request/response latency through the VIP: a UDP echo server in the backend namespace
//! and a prober in the client namespace that sends one request at a time at a fixed rate
//! and records round-trip times in an HDR histogram.

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Echoes every datagram on `port` back to its sender until `duration` passes.
pub fn echo(port: u16, duration: Duration, stop: &AtomicBool) -> Result<u64> {
    let sock = UdpSocket::bind(("0.0.0.0", port)).with_context(|| format!("binding UDP {port}"))?;
    sock.set_read_timeout(Some(Duration::from_millis(100)))?;
    let start = Instant::now();
    let mut buf = [0u8; 2048];
    let mut n = 0u64;
    while start.elapsed() < duration && !stop.load(Ordering::Relaxed) {
        if let Ok((len, from)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(&buf[..len], from);
            n += 1;
        }
    }
    Ok(n)
}

/// How much longer than its nominal duration a probe run may take (see [`probe`]).
pub const PROBE_TIME_BUDGET: f64 = 1.2;

/// Round-trip statistics of one probe run, in microseconds. A lost probe (no reply within
/// the timeout) is in the percentiles as the timeout itself, slower than any answered
/// one: a path that loses 1 % of its probes has the timeout as its p99.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Requests sent.
    pub sent: u64,
    /// Replies received in time.
    pub received: u64,
    /// What a lost probe counts as in the percentiles (the timeout), microseconds; 0 in
    /// older reports, whose percentiles left lost probes out.
    #[serde(default)]
    pub lost_counts_as_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
    /// (percentile, microseconds) points for a percentile curve.
    pub curve: Vec<(f64, f64)>,
}

/// Sends `rate` x `duration` requests (one outstanding at a time, paced at `rate`) to
/// `target`; a reply later than `timeout` counts as lost, and as `timeout` in the
/// percentiles. Lost probes' waits slow the pace: the run stops at [`PROBE_TIME_BUDGET`]
/// x `duration`, and the probes it had no time for count as lost too (the number of
/// probes is fixed, whatever the path does).
pub fn probe(
    target: SocketAddr,
    rate: u32,
    duration: Duration,
    timeout: Duration,
    stop: &AtomicBool,
) -> Result<ProbeResult> {
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.connect(target)
        .with_context(|| format!("connecting to {target}"))?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3)?;
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let probes = (f64::from(rate.max(1)) * duration.as_secs_f64())
        .round()
        .max(1.0) as u64;
    let lost_ns = (timeout.as_nanos() as u64).max(1);
    let start = Instant::now();
    let budget = duration.mul_f64(PROBE_TIME_BUDGET);
    let mut next = start;
    let (mut sent, mut received) = (0u64, 0u64);
    let mut buf = [0u8; 64];
    while sent < probes && !stop.load(Ordering::Relaxed) {
        if start.elapsed() > budget {
            // Out of time: the rest are lost.
            hist.record_n(lost_ns, probes - sent)?;
            sent = probes;
            break;
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += interval;
        sent += 1;
        let mut req = [0u8; 32];
        req[..8].copy_from_slice(&sent.to_be_bytes());
        let t0 = Instant::now();
        let mut answered = false;
        if sock.send(&req).is_err() {
            hist.record(lost_ns)?;
            continue;
        }
        loop {
            let left = timeout.saturating_sub(t0.elapsed());
            if left.is_zero() {
                break;
            }
            sock.set_read_timeout(Some(left))?;
            match sock.recv(&mut buf) {
                Ok(n) if n >= 8 && buf[..8] == sent.to_be_bytes() => {
                    let rtt = t0.elapsed().as_nanos() as u64;
                    hist.record(rtt.clamp(1, lost_ns))?;
                    received += 1;
                    answered = true;
                    break;
                }
                Ok(_) => continue, // a late reply to an earlier request
                Err(_) => break,
            }
        }
        if !answered {
            hist.record(lost_ns)?;
        }
        if next < Instant::now() {
            // Fell behind (a lost reply waited out its timeout): do not burst to catch up.
            next = Instant::now();
        }
    }
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let curve = [
        0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9995, 0.9999, 1.0,
    ]
    .iter()
    .map(|&q| (q * 100.0, us(q)))
    .collect();
    Ok(ProbeResult {
        sent,
        received,
        lost_counts_as_us: lost_ns as f64 / 1000.0,
        p50_us: us(0.5),
        p90_us: us(0.9),
        p99_us: us(0.99),
        p999_us: us(0.999),
        max_us: hist.max() as f64 / 1000.0,
        curve,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lost probe is in the percentiles as the timeout, and the number of probes is
    /// fixed: an echo answering every other request loses half of them.
    #[test]
    fn lost_probes_count_as_the_timeout() {
        let server = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = server.local_addr().expect("addr");
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let echo = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                server
                    .set_read_timeout(Some(Duration::from_millis(20)))
                    .expect("timeout");
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = server.recv_from(&mut buf) {
                        if buf[7] % 2 == 1 {
                            let _ = server.send_to(&buf[..n], from);
                        }
                    }
                }
            })
        };
        let never = AtomicBool::new(false);
        let timeout = Duration::from_millis(5);
        let r = probe(addr, 200, Duration::from_millis(100), timeout, &never).expect("probe");
        stop.store(true, Ordering::Relaxed);
        echo.join().expect("echo");
        assert_eq!(r.sent, 20, "a fixed number of probes");
        assert!(r.received <= 10, "{r:?}");
        assert_eq!(r.lost_counts_as_us, 5000.0);
        assert!((r.p99_us - 5000.0).abs() < 10.0, "{r:?}");
        assert!((r.max_us - 5000.0).abs() < 10.0, "{r:?}");
    }
}
