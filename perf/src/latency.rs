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

/// Round-trip statistics of one probe run, in microseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Requests sent.
    pub sent: u64,
    /// Replies received in time.
    pub received: u64,
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

/// Sends `rate` requests per second (one outstanding at a time) to `target` for
/// `duration`; a reply later than `timeout` counts as lost.
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
    let start = Instant::now();
    let mut next = start;
    let (mut sent, mut received) = (0u64, 0u64);
    let mut buf = [0u8; 64];
    while start.elapsed() < duration && !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += interval;
        sent += 1;
        let mut req = [0u8; 32];
        req[..8].copy_from_slice(&sent.to_be_bytes());
        let t0 = Instant::now();
        if sock.send(&req).is_err() {
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
                    hist.record(rtt.max(1))?;
                    received += 1;
                    break;
                }
                Ok(_) => continue, // a late reply to an earlier request
                Err(_) => break,
            }
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
        p50_us: us(0.5),
        p90_us: us(0.9),
        p99_us: us(0.99),
        p999_us: us(0.999),
        max_us: hist.max() as f64 / 1000.0,
        curve,
    })
}
