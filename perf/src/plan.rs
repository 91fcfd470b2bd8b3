//! What a run measures and for how long ([`Plan`], [`Scenario`]), its estimated duration,
//! its progress output, and Ctrl-C ([`INTERRUPTED`], [`sleep`]): what every measuring
//! module shares, below all of them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// Set by the Ctrl-C handler; every wait checks it, so the run unwinds and cleans up.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The benchmark scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Plain IPv4 forwarding in the node namespace.
    KernelForward,
    /// nftables DNAT of the VIP to the backend, structured like kube-proxy's nftables mode.
    NftDnat,
    /// In-kernel XDP DNAT + XDP_REDIRECT (perf/bpf/xdp_dnat.c).
    XdpDnat,
    /// Raw AF_XDP forwarder without NAT (MAC rewrite only): the userspace ceiling.
    AfxdpL2fwd,
    /// The real juneau-dataplane binary with its defaults, fed by a real
    /// NodeStateWriter: every packet through the AF_XDP sockets and userspace, the path
    /// every Pod of a bridge CNI gets. The headline.
    Juneau,
    /// The same with the opt-in accelerator `--xdp-fast-path`: the steering program
    /// forwards established flows itself where the egress takes XDP frames (here: the
    /// backend veth, whose peer runs an XDP program).
    JuneauXdpFast,
    /// The same with AF_XDP busy polling (`--xsk-busy-poll-budget`, and the node's veths
    /// deferring their NAPI to the busy poller: `napi_defer_hard_irqs`,
    /// `gro_flush_timeout`).
    JuneauBusyPoll,
    /// The TCP bulk download through the VIP (the `bulk` module): `juneau` and `nft-dnat` at
    /// each stream count of the plan, rows `tcp-bulk-<streams>`.
    TcpBulk,
    /// New TCP connections per second through the VIP (the `connect` module): `juneau`
    /// and `nft-dnat`, a short request and answer per connection.
    TcpConnect,
    /// Plain IPv6 forwarding in the node namespace (traffic addressed to the backend's
    /// IPv6 address).
    #[value(name = "kernel-forward6")]
    KernelForward6,
    /// nftables DNAT of the IPv6 VIP to the backend's IPv6 address, structured like
    /// kube-proxy's nftables mode for ip6.
    #[value(name = "nft-dnat6")]
    NftDnat6,
    /// The real juneau-dataplane binary with its defaults, its NodeStateWriter given an
    /// IPv6 Service (`NodeService6`): IPv6 DNAT without SNAT through the AF_XDP sockets
    /// and userspace.
    #[value(name = "juneau6")]
    Juneau6,
}

impl Scenario {
    /// Whether the path forwards XDP frames into the backend's veth (XDP_REDIRECT), which
    /// then needs an XDP program on the backend's end to take them.
    pub fn redirects_xdp_frames(self) -> bool {
        matches!(self, Scenario::XdpDnat | Scenario::JuneauXdpFast)
    }

    /// Whether the load is IPv6 (the generator sends Ethernet + IPv6 + UDP frames to the
    /// IPv6 VIP or backend; the node forwards IPv6).
    pub fn ipv6(self) -> bool {
        matches!(
            self,
            Scenario::KernelForward6 | Scenario::NftDnat6 | Scenario::Juneau6
        )
    }

    /// The scenario whose report name is `name` (a row of a report).
    pub fn by_name(name: &str) -> Option<Scenario> {
        use clap::ValueEnum;
        Scenario::value_variants()
            .iter()
            .copied()
            .find(|s| s.name() == name)
    }

    /// Whether the path is the real juneau-dataplane (its stats file is read after a run).
    pub fn is_juneau(self) -> bool {
        matches!(
            self,
            Scenario::Juneau
                | Scenario::JuneauXdpFast
                | Scenario::JuneauBusyPoll
                | Scenario::Juneau6
        )
    }

    /// Every scenario, in report order.
    /// (`juneau-busy-poll` is not among them: on Linux >= 6.13 an AF_XDP socket gets a
    /// NAPI id to busy-poll only when bound in zero-copy mode, which veth lacks — measured:
    /// `BusyPollRxPackets` stays 0 — so on this topology it measures the same loop as
    /// `juneau`; run it with `--scenarios` on a kernel or NIC where it can work.)
    /// The IPv6 rows come after the IPv4 ones (throughput only: latency, profile and flow
    /// scale stay IPv4). `kernel-forward6` is not among them (only with `--scenarios`):
    /// measured, the three IPv6 rows added ~22 s to `smoke` (what CI runs), nft-dnat6
    /// and juneau6 ~15 s; the ratio is juneau6 / nft-dnat6.
    pub const ALL: [Scenario; 10] = [
        Scenario::KernelForward,
        Scenario::NftDnat,
        Scenario::XdpDnat,
        Scenario::AfxdpL2fwd,
        Scenario::Juneau,
        Scenario::JuneauXdpFast,
        Scenario::TcpBulk,
        Scenario::TcpConnect,
        Scenario::NftDnat6,
        Scenario::Juneau6,
    ];

    /// The report name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::KernelForward => "kernel-forward",
            Scenario::NftDnat => "nft-dnat",
            Scenario::XdpDnat => "xdp-dnat",
            Scenario::AfxdpL2fwd => "afxdp-l2fwd",
            Scenario::Juneau => "juneau",
            Scenario::JuneauXdpFast => "juneau-xdp-fast",
            Scenario::JuneauBusyPoll => "juneau-busy-poll",
            Scenario::TcpBulk => "tcp-bulk",
            Scenario::TcpConnect => "tcp-connect",
            Scenario::KernelForward6 => "kernel-forward6",
            Scenario::NftDnat6 => "nft-dnat6",
            Scenario::Juneau6 => "juneau6",
        }
    }

    /// Whether traffic goes to the IPv4 VIP (and so latency through the VIP can be
    /// measured: the prober and the echo server are IPv4).
    pub fn uses_vip(self) -> bool {
        matches!(
            self,
            Scenario::NftDnat
                | Scenario::XdpDnat
                | Scenario::Juneau
                | Scenario::JuneauXdpFast
                | Scenario::JuneauBusyPoll
        )
    }
}

/// What to run and for how long.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Scenarios to run.
    pub scenarios: Vec<Scenario>,
    /// Runs per scenario.
    pub runs: u32,
    /// Traffic before the measurement window of each run.
    pub warmup: Duration,
    /// The measurement window of each run.
    pub duration: Duration,
    /// Flows of the throughput scenarios.
    pub flows: u32,
    /// Flow counts for the `juneau` flow-scale measurement (empty: skip).
    pub flow_scale: Vec<u32>,
    /// Profile the path core of juneau, afxdp-l2fwd and nft-dnat after the rounds (one
    /// extra window each; needs `perf`).
    pub profile: bool,
    /// Offered loads for latency, as fractions of each scenario's median throughput.
    pub latency_loads: Vec<f64>,
    /// Offered background rates for latency, packets/s, the same for every path (a
    /// fraction of each path's own capacity is more background for a faster path).
    pub latency_background_pps: Vec<u64>,
    /// Probe duration per latency point.
    pub latency_duration: Duration,
    /// Latency rounds: each measures every scenario at every load, scenarios in turn.
    pub latency_rounds: u32,
    /// Probe requests per second.
    pub probe_rate: u32,
    /// Length of each calibration window (the offered rate's search, before the
    /// measured window).
    pub calibrate_window: Duration,
    /// Most rate steps of the calibration.
    pub calibrate_steps: u32,
    /// The juneau-dataplane binary.
    pub dataplane: PathBuf,
    /// Run the dataplane under this command (e.g. valgrind; empty: directly).
    pub dataplane_wrapper: Vec<String>,
    /// Extra dataplane arguments.
    pub dataplane_args: Vec<String>,
    /// Where logs go.
    pub out_dir: PathBuf,
    /// The TCP bulk download (`tcp-bulk`).
    pub bulk: BulkPlan,
}

/// Fixed overhead of one topology (build, program loads, readiness check), estimated.
const SETUP_S: f64 = 1.5;

impl Plan {
    /// Estimated wall time of the whole plan.
    pub fn expected(&self) -> Duration {
        // A flood and ~5 rate steps (each with a third of a window of warm-up, and a
        // generator start), then the measured window.
        let cw = self.calibrate_window.as_secs_f64();
        let steps = f64::from(self.calibrate_steps.min(5));
        let calib = (cw + 0.3) + steps * (cw * 4.0 / 3.0 + 0.3);
        let per_run =
            SETUP_S + calib + self.warmup.as_secs_f64() + self.duration.as_secs_f64() + 0.5;
        let mut s = 0.0;
        for sc in &self.scenarios {
            if *sc == Scenario::TcpBulk {
                s += bulk_expected(self).as_secs_f64();
                continue;
            }
            if *sc == Scenario::TcpConnect {
                s += f64::from(self.runs)
                    * BULK_PATHS.len() as f64
                    * (5.0 + self.duration.as_secs_f64());
                continue;
            }
            s += f64::from(self.runs) * per_run;
            if self.profile
                && matches!(
                    sc,
                    Scenario::Juneau | Scenario::AfxdpL2fwd | Scenario::NftDnat
                )
            {
                s += SETUP_S + self.warmup.as_secs_f64() + self.duration.as_secs_f64() + 2.0;
            }
            if sc.uses_vip() && !self.latency_loads.is_empty() {
                s += f64::from(self.latency_rounds)
                    * (SETUP_S
                        + (self.latency_loads.len() + self.latency_background_pps.len()) as f64
                            * (self.latency_duration.as_secs_f64() + 1.2));
            }
            if *sc == Scenario::Juneau {
                for f in &self.flow_scale {
                    s += f64::from(self.runs) * (per_run + fill_duration(*f).as_secs_f64());
                }
            }
            if *sc == Scenario::XdpDnat && self.scenarios.contains(&Scenario::Juneau) {
                if let Some(f) = self.flow_scale.iter().max() {
                    s += f64::from(self.runs) * (per_run + fill_duration(*f).as_secs_f64());
                }
            }
        }
        Duration::from_secs_f64(s)
    }
}

/// How long the paced fill before a flow-scale run takes: every flow's first packet
/// [`FILL_PASSES`] times over at [`FILL_RATE`] (see `fill_flows` in the suite).
pub(crate) fn fill_duration(flows: u32) -> Duration {
    Duration::from_secs_f64(FILL_PASSES * f64::from(flows) / FILL_RATE as f64)
}

/// Packets per second of the fill that creates a flow-scale run's flows: a new flow
/// takes the userspace path, which carries ~300 000 packets a second of established flows
/// here (`juneau-afxdp`) and fewer new ones (a new flow costs about three times the
/// instructions), and far fewer under a flood, where the path's NAPI work takes its core
/// (once measured: after a 6.7 s flood at 1 M flows only 430 000 flows existed, and the window
/// measured the drops of the others' first packets, not forwarding); 100 000 pps created
/// every flow of every run.
pub(crate) const FILL_RATE: u64 = 100_000;
/// Passes over the flows the fill makes (a first packet lost in one pass is sent again).
pub(crate) const FILL_PASSES: f64 = 2.0;

/// Progress output (stderr), with elapsed time against the estimate.
pub struct Progress {
    start: Instant,
    expected: Duration,
}

impl Progress {
    /// Starts the clock.
    pub fn new(expected: Duration) -> Progress {
        Progress {
            start: Instant::now(),
            expected,
        }
    }

    /// Prints one line.
    pub fn say(&self, msg: impl AsRef<str>) {
        let e = self.start.elapsed().as_secs();
        eprintln!(
            "[{:>3}s / ~{}s] {}",
            e,
            self.expected.as_secs(),
            msg.as_ref()
        );
    }
}

pub(crate) fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C): cleaning up");
    }
    Ok(())
}

/// Sleeps in small steps, failing early on Ctrl-C.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupt()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
}

/// The bulk part of a plan.
#[derive(Debug, Clone)]
pub struct BulkPlan {
    /// Bytes per connection.
    pub bytes: u64,
    /// Stream counts, one row each per path.
    pub streams: Vec<u32>,
    /// Longest time one round of downloads may take.
    pub timeout: Duration,
}

/// The paths the download is measured through, in the order of the first round (later
/// rounds alternate, so that neither always runs first).
pub const BULK_PATHS: [Scenario; 2] = [Scenario::Juneau, Scenario::NftDnat];

/// Estimated wall time of the bulk part of `plan`.
pub fn bulk_expected(plan: &Plan) -> Duration {
    let per_run = 4.0 + plan.duration.as_secs_f64();
    Duration::from_secs_f64(
        f64::from(plan.runs) * plan.bulk.streams.len() as f64 * BULK_PATHS.len() as f64 * per_run,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn every_scenario_parses_from_its_report_name() {
        for sc in Scenario::value_variants() {
            assert_eq!(
                Scenario::from_str(sc.name(), false),
                Ok(*sc),
                "{}",
                sc.name()
            );
        }
        for (name, sc) in [
            ("kernel-forward6", Scenario::KernelForward6),
            ("nft-dnat6", Scenario::NftDnat6),
            ("juneau6", Scenario::Juneau6),
        ] {
            assert_eq!(Scenario::from_str(name, false), Ok(sc));
            assert_eq!(Scenario::by_name(name), Some(sc));
            assert!(sc.ipv6(), "{name} is an IPv6 row");
            assert!(!sc.uses_vip(), "{name}: latency is IPv4 only");
        }
        assert_eq!(Scenario::by_name("juneau6-nope"), None);
        assert!(Scenario::Juneau6.is_juneau());
        assert!(!Scenario::NftDnat6.is_juneau());
    }

    #[test]
    fn the_ipv6_rows_are_in_every_run_after_the_ipv4_ones() {
        let first6 = Scenario::ALL
            .iter()
            .position(|s| s.ipv6())
            .expect("IPv6 rows");
        assert!(Scenario::ALL[first6..].iter().all(|s| s.ipv6()));
        for sc in [Scenario::NftDnat6, Scenario::Juneau6] {
            assert!(Scenario::ALL.contains(&sc), "{}", sc.name());
        }
        assert!(!Scenario::ALL.contains(&Scenario::KernelForward6), "opt-in");
        assert!(Scenario::ALL[..first6].iter().all(|s| !s.ipv6()));
    }
}
