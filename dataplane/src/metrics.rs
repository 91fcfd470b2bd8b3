//! The dataplane's metrics endpoint: `/metrics` (the last [`Stats`] the forwarding loop
//! handed over, encoded by `prometheus-client` at scrape time), `/healthz` and `/readyz`
//! (from the dataplane's own status file: the heartbeat and the generation it has
//! programmed), served by `juneau_telemetry` on a thread of its own.
//!
//! Off the forwarding path: the loop only copies its plain counters into a [`Stats`] about
//! once a second (on the stats thread, which calls [`Exporter::update`]); building the
//! registry and encoding happen per scrape on the metrics thread.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use juneau_control::dataplane_status::{DataplaneStatus, DataplaneStatusReader};
use juneau_telemetry::Endpoint;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::counters::{
    GapHistogram, ServiceCounters, ServiceStats, Stats, WorkerStats, LOOP_GAP_BOUNDS_US,
};
use crate::redirect::PeerCounters;

/// Default `--metrics-addr` (the node's port 9743: the dataplane runs on the host network).
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9743";
/// `/readyz` fails when the forwarding loop's heartbeat is older than this.
pub const READY_HEARTBEAT_MAX: Duration = Duration::from_secs(2);
/// `/healthz` fails when the forwarding loop's heartbeat is older than this.
pub const LIVE_HEARTBEAT_MAX: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabels {
    vip: String,
    protocol: String,
    port: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SocketLabel {
    socket: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IfaceLabel {
    iface: String,
}

fn counter(r: &mut Registry, name: &str, help: &str, v: u64) {
    let c = Counter::<u64>::default();
    c.inc_by(v);
    r.register(name, help, c);
}

fn gauge(r: &mut Registry, name: &str, help: &str, v: u64) {
    let g = Gauge::<i64>::default();
    g.set(v.min(i64::MAX as u64) as i64);
    r.register(name, help, g);
}

/// Registers every series of `st` (names: `docs/dataplane.md`, "Counters and metrics").
pub fn register_stats(r: &mut Registry, st: &Stats) {
    register_counters(r, st);
    register_gauges(r, st);
    register_labelled(r, st);
    register_services(r, &st.services);
    register_redirects(r, st);
    register_workers(r, st);
    r.register(
        "juneau_dataplane_loop_gap_seconds",
        "Time between two iterations of a forwarding loop beyond its own idle sleep \
         (the longest a packet arriving meanwhile waited to be looked at), every worker",
        LoopGap(st.loop_gap.clone()),
    );
}

/// The node-wide counters.
fn register_counters(r: &mut Registry, st: &Stats) {
    let counters: [(&str, &str, u64); 20] = [
        (
            "juneau_dataplane_rx_packets",
            "Frames received from AF_XDP sockets",
            st.rx_packets,
        ),
        (
            "juneau_dataplane_xdp_fast_path_packets",
            "Packets of established flows the XDP program forwarded itself",
            st.xdp_fast_packets,
        ),
        (
            "juneau_dataplane_xdp_fast_path_replies",
            "Of those, backends' replies (reverse NAT in the XDP program)",
            st.xdp_fast_replies,
        ),
        (
            "juneau_dataplane_segmented_packets",
            "Packets larger than their egress takes (TSO/GSO, GRO), cut into segments or fragments",
            st.segmented,
        ),
        (
            "juneau_dataplane_segments",
            "Frames the cut packets became",
            st.segments,
        ),
        (
            "juneau_dataplane_icmp_frag_needed_sent",
            "ICMP fragmentation-needed errors sent for oversized packets with DF set (each also a too_big drop)",
            st.icmp_frag_needed_sent,
        ),
        (
            "juneau_dataplane_icmp_frag_needed_limited",
            "ICMP fragmentation-needed errors not sent: the worker's rate limit was reached",
            st.icmp_frag_needed_limited,
        ),
        (
            "juneau_dataplane_tx_packets",
            "Frames transmitted",
            st.tx_packets,
        ),
        (
            "juneau_dataplane_xsk_rx_dropped",
            "Frames the kernel dropped on AF_XDP receive",
            st.xsk_rx_dropped,
        ),
        (
            "juneau_dataplane_xsk_rx_ring_full",
            "Frames lost to a full AF_XDP RX ring",
            st.xsk_rx_ring_full,
        ),
        (
            "juneau_dataplane_xsk_fill_ring_empty",
            "Times the AF_XDP fill ring was empty",
            st.xsk_fill_ring_empty,
        ),
        (
            "juneau_dataplane_neighbour_requests",
            "Neighbour resolutions requested from the kernel",
            st.neighbour_requests,
        ),
        (
            "juneau_dataplane_tables_held",
            "Service tables held back until their new next hops were resolved",
            st.tables_held,
        ),
        (
            "juneau_dataplane_held_tables_replaced",
            "Held service tables replaced by a newer one before they went in",
            st.held_tables_replaced,
        ),
        (
            "juneau_dataplane_held_tables_timed_out",
            "Held service tables installed with a next hop still unresolved",
            st.held_tables_timed_out,
        ),
        (
            "juneau_dataplane_umem_frames_reclaimed",
            "UMEM frames taken back from closed AF_XDP sockets",
            st.umem_frames_reclaimed,
        ),
        (
            "juneau_dataplane_pod_iface_attaches",
            "Pod interfaces found through routes and attached",
            st.pod_iface_attaches,
        ),
        (
            "juneau_dataplane_pod_iface_detaches",
            "Discovered Pod interfaces detached",
            st.pod_iface_detaches,
        ),
        (
            "juneau_dataplane_half_open_evicted",
            "Half-open TCP flows evicted, oldest first, to make room for newer ones",
            st.half_open_evicted,
        ),
        (
            "juneau_dataplane_idle_evicted",
            "UDP flows and redirect records evicted, least recently seen first, to make room in a full flow table",
            st.idle_evicted,
        ),
    ];
    for (name, help, v) in counters {
        counter(r, name, help, v);
    }
}

/// The node-wide gauges.
fn register_gauges(r: &mut Registry, st: &Stats) {
    let gauges: [(&str, &str, u64); 14] = [
        (
            "juneau_dataplane_flows",
            "Flows in the flow table",
            st.flows,
        ),
        (
            "juneau_dataplane_ipv6_flows",
            "Flows in the IPv6 flow table (shared by the workers)",
            st.flows6,
        ),
        (
            "juneau_dataplane_ipv6_flow_capacity",
            "IPv6 flow table capacity",
            st.flow6_capacity,
        ),
        (
            "juneau_dataplane_flow_capacity",
            "Flow table capacity",
            st.flow_capacity,
        ),
        (
            "juneau_dataplane_flow_table_bytes",
            "Memory held by the flow table",
            st.flow_table_bytes,
        ),
        (
            "juneau_dataplane_half_open_flows",
            "Half-open TCP flows in the flow table",
            st.half_open_flows,
        ),
        (
            "juneau_dataplane_half_open_max",
            "Most half-open TCP flows held at once",
            st.half_open_max,
        ),
        (
            "juneau_dataplane_flows_restored",
            "Flows found in the pinned flow table when this process started",
            st.flows_restored,
        ),
        (
            "juneau_dataplane_neighbours",
            "Neighbour entries known",
            st.neighbours,
        ),
        (
            "juneau_dataplane_umem_frames",
            "UMEM frames in total",
            st.umem_frames,
        ),
        (
            "juneau_dataplane_umem_frames_free",
            "UMEM frames in userspace, ready for fill rings",
            st.umem_frames_free,
        ),
        (
            "juneau_dataplane_umem_frames_in_kernel",
            "UMEM frames held by the kernel through live sockets",
            st.umem_frames_in_kernel,
        ),
        (
            "juneau_dataplane_pod_ifaces",
            "Pod interfaces found through routes with sockets now",
            st.pod_ifaces.len() as u64,
        ),
        (
            "juneau_dataplane_state_generation",
            "Generation of the shared control state in force",
            st.generation,
        ),
    ];
    for (name, help, v) in gauges {
        gauge(r, name, help, v);
    }
}

/// Drops by reason, frames per AF_XDP socket, the kernel's receive drops per interface.
fn register_labelled(r: &mut Registry, st: &Stats) {
    counters_by(
        r,
        "juneau_dataplane_drops",
        "Frames dropped, by reason",
        st.drops.iter().map(|(reason, v)| {
            let reason = reason.clone();
            (ReasonLabel { reason }, *v)
        }),
    );
    counters_by(
        r,
        "juneau_dataplane_socket_rx_packets",
        "Frames received per AF_XDP socket (interface/queue)",
        st.rx_packets_per_socket.iter().map(|(socket, v)| {
            let socket = socket.clone();
            (SocketLabel { socket }, *v)
        }),
    );
    counters_by(
        r,
        "juneau_dataplane_interface_rx_dropped",
        "Frames the kernel dropped on receive on a served interface before the steering program ran (its rx_dropped)",
        st.interface_rx_dropped.iter().map(|(iface, v)| {
            let iface = iface.clone();
            (IfaceLabel { iface }, *v)
        }),
    );
}

/// Registers the counter family `name`, one series per `(labels, value)`.
fn counters_by<L>(r: &mut Registry, name: &str, help: &str, series: impl Iterator<Item = (L, u64)>)
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Counter>::default();
    for (labels, v) in series {
        family.get_or_create(&labels).inc_by(v);
    }
    r.register(name, help, family);
}

/// The loop-gap histogram, bucketed by the workers; encoded as a Prometheus histogram.
#[derive(Debug)]
struct LoopGap(GapHistogram);

impl EncodeMetric for LoopGap {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let h = &self.0;
        let buckets: Vec<(f64, u64)> = LOOP_GAP_BOUNDS_US
            .iter()
            .map(|&us| us as f64 / 1e6)
            .chain(std::iter::once(f64::MAX))
            .zip(h.buckets.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(h.sum_us as f64 / 1e6, h.count, &buckets, None)
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Per forwarding worker (`--workers`): packets, flows it owns, rates over the last
/// report; and the packets whose flow another worker holds.
fn register_workers(r: &mut Registry, st: &Stats) {
    type Get = fn(&WorkerStats) -> u64;
    let totals: [(&str, &str, Get); 2] = [
        (
            "juneau_dataplane_worker_rx_packets",
            "Frames received by this forwarding worker",
            |w| w.rx_packets,
        ),
        (
            "juneau_dataplane_worker_tx_packets",
            "Frames transmitted by this forwarding worker",
            |w| w.tx_packets,
        ),
    ];
    for (name, help, get) in totals {
        let f = Family::<WorkerLabel, Counter>::default();
        for w in &st.workers {
            f.get_or_create(&WorkerLabel { worker: w.worker })
                .inc_by(get(w));
        }
        r.register(name, help, f);
    }
    let now: [(&str, &str, Get); 3] = [
        (
            "juneau_dataplane_worker_flows",
            "Flows in this worker's table (it created them)",
            |w| w.flows,
        ),
        (
            "juneau_dataplane_worker_rx_packets_per_second",
            "Frames received per second by this worker over the last report",
            |w| w.rx_pps,
        ),
        (
            "juneau_dataplane_worker_tx_packets_per_second",
            "Frames transmitted per second by this worker over the last report",
            |w| w.tx_pps,
        ),
    ];
    for (name, help, get) in now {
        let f = Family::<WorkerLabel, Gauge>::default();
        for w in &st.workers {
            f.get_or_create(&WorkerLabel { worker: w.worker })
                .set(get(w).min(i64::MAX as u64) as i64);
        }
        r.register(name, help, f);
    }
    counter(
        r,
        "juneau_dataplane_cross_worker_lookups",
        "Packets whose flow was in another worker's table",
        st.cross_worker_lookups,
    );
}

fn register_services(r: &mut Registry, services: &[ServiceStats]) {
    let labels = |s: &ServiceStats| ServiceLabels {
        vip: s.vip.clone(),
        protocol: s.protocol.clone(),
        port: s.port,
    };
    type Field = fn(&ServiceCounters) -> u64;
    let fields: [(&str, &str, Field); 6] = [
        (
            "juneau_dataplane_service_packets_in",
            "Client to backend packets",
            |c| c.packets_in,
        ),
        (
            "juneau_dataplane_service_bytes_in",
            "Client to backend bytes",
            |c| c.bytes_in,
        ),
        (
            "juneau_dataplane_service_packets_out",
            "Backend to client packets",
            |c| c.packets_out,
        ),
        (
            "juneau_dataplane_service_bytes_out",
            "Backend to client bytes",
            |c| c.bytes_out,
        ),
        ("juneau_dataplane_service_new_flows", "Flows created", |c| {
            c.new_flows
        }),
        (
            "juneau_dataplane_service_drops",
            "Packets dropped for the service",
            |c| c.drops,
        ),
    ];
    for (name, help, get) in fields {
        let f = Family::<ServiceLabels, Counter>::default();
        for s in services {
            f.get_or_create(&labels(s)).inc_by(get(&s.counters));
        }
        r.register(name, help, f);
    }
    type Now = fn(&ServiceStats) -> usize;
    let now: [(&str, &str, Now); 2] = [
        (
            "juneau_dataplane_service_backends",
            "Local Ready backends (new flows go to these)",
            |s| s.backends,
        ),
        (
            "juneau_dataplane_service_draining_backends",
            "Local serving-but-terminating backends (existing flows only)",
            |s| s.draining_backends,
        ),
    ];
    for (name, help, get) in now {
        let f = Family::<ServiceLabels, Gauge>::default();
        for s in services {
            f.get_or_create(&labels(s)).set(get(s) as i64);
        }
        r.register(name, help, f);
    }
}

fn register_redirects(r: &mut Registry, st: &Stats) {
    type Get = fn(&PeerCounters) -> u64;
    let families: [(&str, &str, Get); 7] = [
        (
            "juneau_dataplane_redirected_to_peer_packets",
            "Packets of flows held elsewhere sent to this peer node",
            |c| c.redirected_to,
        ),
        (
            "juneau_dataplane_redirected_from_peer_packets",
            "Redirected packets received from this peer node",
            |c| c.received_from,
        ),
        (
            "juneau_dataplane_redirect_notices_sent",
            "Flow-owner notices sent to this peer node",
            |c| c.notices_sent,
        ),
        (
            "juneau_dataplane_redirect_notices_received",
            "Flow-owner notices received from this peer node",
            |c| c.notices_received,
        ),
        (
            "juneau_dataplane_redirect_probes_sent",
            "Liveness probes sent to this peer node",
            |c| c.probes_sent,
        ),
        (
            "juneau_dataplane_redirect_probes_received",
            "Liveness probes received from this peer node (each answered)",
            |c| c.probes_received,
        ),
        (
            "juneau_dataplane_redirect_probe_answers_received",
            "Answers to this node's liveness probes received from this peer node",
            |c| c.probe_answers_received,
        ),
    ];
    for (name, help, get) in families {
        let f = Family::<PeerLabel, Counter>::default();
        for p in &st.redirect_peers {
            f.get_or_create(&PeerLabel {
                peer: p.peer.clone(),
            })
            .inc_by(get(&p.counters));
        }
        r.register(name, help, f);
    }
    let reachable = Family::<PeerLabel, Gauge>::default();
    for p in &st.redirect_peers {
        if let Some(up) = p.reachable {
            reachable
                .get_or_create(&PeerLabel {
                    peer: p.peer.clone(),
                })
                .set(i64::from(up));
        }
    }
    r.register(
        "juneau_dataplane_redirect_peer_reachable",
        "1: this peer node answers liveness probes; 0: it answered, then missed 3 in a row (left out of hand-offs and questions); absent: it never answered",
        reachable,
    );
    counter(
        r,
        "juneau_dataplane_redirect_notices_dropped",
        "Owner notices and answers to liveness probes not sent (queue full)",
        st.redirect_notices_dropped,
    );
}

/// The last statistics and the way to the dataplane's own status, answering the
/// endpoint's requests.
pub struct Exporter {
    latest: Mutex<Option<Arc<Stats>>>,
    status_path: PathBuf,
    status: Mutex<Option<DataplaneStatusReader>>,
    pid: u32,
    /// Decommissioned (helm uninstall): live, never ready, no forwarding loop.
    decommissioned: std::sync::atomic::AtomicBool,
}

impl Exporter {
    /// An exporter reading this process's status at `status_path`; serves nothing yet.
    pub fn new(status_path: &Path) -> Arc<Exporter> {
        Arc::new(Exporter {
            latest: Mutex::new(None),
            status_path: status_path.to_path_buf(),
            status: Mutex::new(None),
            pid: std::process::id(),
            decommissioned: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The process is decommissioned and idle: `/healthz` answers live (the kubelet
    /// must not restart it), `/readyz` not ready.
    pub fn set_decommissioned(&self) {
        self.decommissioned
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_decommissioned(&self) -> bool {
        self.decommissioned
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Binds `given` (or [`DEFAULT_METRICS_ADDR`], only warned about when taken) and
    /// serves from a thread of its own. Returns the address served, if any.
    pub fn serve(
        self: &Arc<Self>,
        given: Option<SocketAddr>,
    ) -> Result<Option<SocketAddr>, juneau_telemetry::Error> {
        let default = DEFAULT_METRICS_ADDR
            .parse()
            .expect("the default metrics address parses");
        let Some(l) = juneau_telemetry::bind(given, default)? else {
            return Ok(None);
        };
        let addr = l.local_addr().ok();
        juneau_telemetry::spawn_thread(l, self.clone())?;
        Ok(addr)
    }

    /// Hands over the latest statistics (the stats thread, about once a second).
    pub fn update(&self, stats: Stats) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(stats));
    }

    /// This process's status, `None` while it has not written one yet (starting up).
    fn own_status(&self) -> Option<DataplaneStatus> {
        let mut g = self.status.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = DataplaneStatusReader::open(&self.status_path).ok();
        }
        let s = g.as_mut()?.read();
        match s {
            Ok(s) if s.pid == self.pid => Some(s),
            // Another process's file (an older dataplane's, before ours replaced it) or
            // unreadable: look again next time.
            _ => {
                *g = None;
                None
            }
        }
    }
}

impl Endpoint for Exporter {
    fn collect(&self, r: &mut Registry) {
        let st = self
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(st) = st {
            register_stats(r, &st);
        }
        if let Some(s) = self.own_status() {
            gauge(
                r,
                "juneau_dataplane_programmed_vips",
                "VIPs steered to this dataplane, as published for juneau-bgp",
                s.vips.len() as u64,
            );
        }
    }

    fn live(&self) -> Result<(), String> {
        if self.is_decommissioned() {
            return Ok(());
        }
        match self.own_status() {
            // Starting: attaching to the interfaces can take seconds.
            None => Ok(()),
            Some(s) if s.heartbeat_age > LIVE_HEARTBEAT_MAX => Err(format!(
                "forwarding loop stalled: heartbeat {} ms old",
                s.heartbeat_age.as_millis()
            )),
            Some(_) => Ok(()),
        }
    }

    fn ready(&self) -> Result<(), String> {
        if self.is_decommissioned() {
            return Err("not ready: decommissioned (helm uninstall); idle until stopped".into());
        }
        match self.own_status() {
            None => Err(format!(
                "not ready: starting, no heartbeat in {} yet",
                self.status_path.display()
            )),
            Some(s) if s.stopped => Err("not ready: stopping".into()),
            Some(s) if s.heartbeat_age > READY_HEARTBEAT_MAX => Err(format!(
                "not ready: forwarding loop heartbeat {} ms old",
                s.heartbeat_age.as_millis()
            )),
            Some(s) if s.state_generation == 0 => Err(
                "not ready: no node state programmed yet (is the node agent publishing?)".into(),
            ),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::{DropReason, RedirectPeerStats};
    use juneau_control::dataplane_status::DataplaneStatusWriter;

    fn stats() -> Stats {
        let mut st = Stats::default();
        for r in DropReason::ALL {
            st.drops.insert(r.name().into(), r as u64);
        }
        st.rx_packets = 11;
        st.xdp_fast_packets = 13;
        st.xdp_fast_replies = 12;
        st.flows = 3;
        st.rx_packets_per_socket.insert("eth0/0".into(), 9);
        st.interface_rx_dropped.insert("eth0".into(), 12);
        st.workers.push(WorkerStats {
            worker: 1,
            rx_packets: 7,
            tx_packets: 6,
            flows: 2,
            xdp_fast_packets: 4,
            rx_pps: 70,
            tx_pps: 60,
        });
        st.cross_worker_lookups = 5;
        st.loop_gap.observe(20);
        st.loop_gap.observe(2_000);
        st.services.push(ServiceStats {
            vip: "203.0.113.10".into(),
            protocol: "TCP".into(),
            port: 80,
            backends: 2,
            draining_backends: 1,
            counters: ServiceCounters {
                packets_in: 5,
                new_flows: 1,
                ..Default::default()
            },
        });
        st.redirect_peers.push(RedirectPeerStats {
            peer: "192.0.2.12".into(),
            counters: PeerCounters {
                redirected_to: 4,
                probes_sent: 9,
                ..Default::default()
            },
            reachable: Some(false),
        });
        st.redirect_peers.push(RedirectPeerStats {
            peer: "192.0.2.13".into(),
            counters: PeerCounters::default(),
            reachable: None,
        });
        st
    }

    fn text(st: &Stats) -> String {
        let mut r = Registry::default();
        register_stats(&mut r, st);
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
        s
    }

    #[test]
    fn every_reason_service_peer_and_socket_is_exported() {
        let t = text(&stats());
        for r in DropReason::ALL {
            let line = format!(
                "juneau_dataplane_drops_total{{reason=\"{}\"}} {}",
                r.name(),
                r as u64
            );
            assert!(t.contains(&line), "{line} missing:\n{t}");
        }
        for line in [
            "# TYPE juneau_dataplane_rx_packets counter",
            "juneau_dataplane_rx_packets_total 11",
            "# TYPE juneau_dataplane_flows gauge",
            "juneau_dataplane_flows 3",
            "juneau_dataplane_service_packets_in_total{vip=\"203.0.113.10\",protocol=\"TCP\",port=\"80\"} 5",
            "juneau_dataplane_service_draining_backends{vip=\"203.0.113.10\",protocol=\"TCP\",port=\"80\"} 1",
            "juneau_dataplane_redirected_to_peer_packets_total{peer=\"192.0.2.12\"} 4",
            "juneau_dataplane_redirect_probes_sent_total{peer=\"192.0.2.12\"} 9",
            "juneau_dataplane_redirect_peer_reachable{peer=\"192.0.2.12\"} 0",
            "juneau_dataplane_socket_rx_packets_total{socket=\"eth0/0\"} 9",
            "juneau_dataplane_interface_rx_dropped_total{iface=\"eth0\"} 12",
            "juneau_dataplane_redirect_notices_dropped_total 0",
            "juneau_dataplane_worker_rx_packets_total{worker=\"1\"} 7",
            "juneau_dataplane_worker_flows{worker=\"1\"} 2",
            "juneau_dataplane_worker_tx_packets_per_second{worker=\"1\"} 60",
            "juneau_dataplane_cross_worker_lookups_total 5",
            "# TYPE juneau_dataplane_loop_gap_seconds histogram",
            "juneau_dataplane_loop_gap_seconds_bucket{le=\"0.00001\"} 0",
            "juneau_dataplane_loop_gap_seconds_bucket{le=\"0.00005\"} 1",
            "juneau_dataplane_loop_gap_seconds_bucket{le=\"0.005\"} 2",
            "juneau_dataplane_loop_gap_seconds_count 2",
            "juneau_dataplane_loop_gap_seconds_bucket{le=\"+Inf\"} 2",
            "# EOF",
        ] {
            assert!(t.contains(line), "{line} missing:\n{t}");
        }
        // A peer that never answered a probe has no reachability to report.
        let never = "juneau_dataplane_redirect_peer_reachable{peer=\"192.0.2.13\"}";
        assert!(!t.contains(never), "{never} present:\n{t}");
    }

    #[test]
    fn probes_follow_the_own_status_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let ex = Exporter::new(&path);
        // Starting: live, not ready, and no stats yet means no dataplane series.
        assert!(ex.live().is_ok());
        assert!(ex.ready().unwrap_err().contains("starting"));
        let mut r = Registry::default();
        ex.collect(&mut r);
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
        assert_eq!(s, "# EOF\n");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        w.heartbeat();
        assert!(ex.ready().unwrap_err().contains("no node state programmed"));
        w.publish(4, ["203.0.113.10".parse::<std::net::Ipv4Addr>().unwrap()])
            .unwrap();
        w.heartbeat();
        assert_eq!(ex.ready(), Ok(()));
        assert_eq!(ex.live(), Ok(()));
        // A stalled loop: heartbeat far in the past.
        let old = juneau_control::dataplane_status::monotonic_ns()
            .saturating_sub(LIVE_HEARTBEAT_MAX.as_nanos() as u64 + 1_000_000_000);
        w.heartbeat_at(old);
        assert!(ex.ready().unwrap_err().contains("heartbeat"));
        assert!(ex.live().unwrap_err().contains("stalled"));
        w.heartbeat();
        w.mark_stopped();
        assert!(ex.ready().unwrap_err().contains("stopping"));
        ex.update(stats());
        let t = juneau_telemetry::encode(ex.as_ref()).unwrap();
        assert!(t.contains("juneau_dataplane_programmed_vips 1"), "{t}");
        assert!(t.contains("juneau_dataplane_rx_packets_total 11"), "{t}");
        assert!(
            t.contains("juneau_dataplane_xdp_fast_path_packets_total 13")
                && t.contains("juneau_dataplane_xdp_fast_path_replies_total 12"),
            "{t}"
        );
    }
}
