//! The I/O half of redirect peers' liveness ([`crate::peer_liveness`] decides): the node
//! thread's probes, sent through a kernel UDP socket bound to this node's redirect
//! address (the peer's steering program takes them like any redirect frame and its
//! worker answers through its uplink socket); the answers the workers receive, handed
//! over a bounded channel; and the unreachable set published back to the workers, who
//! leave those peers out of hand-offs and questions.
//!
//! Must not touch: the packet path (the workers only load a version number per
//! iteration), peer choice (that is [`crate::redirect::Redirector`]).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use arc_swap::ArcSwap;

use crate::peer_liveness::{PeerLiveness, PeerReach, Reach};
use crate::redirect::Redirector;
use crate::redirect_wire::{build_liveness, KIND_PROBE, OUTER};

/// Answers the workers received (peer, nonce), for the node thread.
pub type AnswerSender = mpsc::SyncSender<(u32, u64)>;

/// The peers the probes found unreachable, as the node thread publishes them.
#[derive(Debug, Default)]
pub struct Unreachable {
    version: AtomicU64,
    peers: ArcSwap<Vec<u32>>,
}

impl Unreachable {
    /// Bumped at every change (0: nothing published yet).
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// The set in force (sorted).
    pub fn get(&self) -> Arc<Vec<u32>> {
        self.peers.load_full()
    }

    fn publish(&self, peers: Vec<u32>) {
        self.peers.store(Arc::new(peers));
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}

/// The node thread's prober.
pub struct Prober {
    liveness: PeerLiveness,
    answers: mpsc::Receiver<(u32, u64)>,
    /// The socket, bound to the address it was opened for.
    socket: Option<(u32, UdpSocket)>,
    /// The address a socket could not be bound to, said once.
    unbindable: Option<u32>,
    buf: Vec<u8>,
}

impl Prober {
    /// A prober and the sender the workers hand answers to.
    pub fn new() -> (Self, AnswerSender) {
        let (tx, rx) = mpsc::sync_channel(1024);
        let base = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            std::time::SystemTime::now(),
        );
        let p = Prober {
            liveness: PeerLiveness::new(base),
            answers: rx,
            socket: None,
            unbindable: None,
            buf: vec![0; 256],
        };
        (p, tx)
    }

    /// Takes the answers received, probes the peers that are due, and publishes the
    /// unreachable set when it changed. `r`: the node thread's redirector (none, or not
    /// active yet: no peers to probe); `peers`: the ones to probe, sorted
    /// (`Control::probed_peers`).
    pub fn tick(&mut self, r: Option<&Redirector>, peers: &[u32], now_ms: u64, out: &Unreachable) {
        while let Ok((peer, nonce)) = self.answers.try_recv() {
            self.liveness.answered(peer, nonce);
        }
        let active = r.filter(|r| r.active());
        self.liveness
            .set_peers(if active.is_some() { peers } else { &[] });
        if let Some(r) = active {
            self.send_due(r, now_ms);
        }
        let now = self.liveness.unreachable();
        let before = out.get();
        if now != *before {
            for p in now.iter().filter(|p| !before.contains(p)) {
                tracing::warn!(peer = %Ipv4Addr::from(*p), "redirect peer unreachable: it missed 3 probes in a row; left out of hand-offs and questions until it answers");
            }
            for p in before.iter().filter(|p| !now.contains(p)) {
                if self.liveness.is_listed(*p) {
                    tracing::info!(peer = %Ipv4Addr::from(*p), "redirect peer answers again");
                } else {
                    tracing::info!(peer = %Ipv4Addr::from(*p), "unreachable redirect peer no longer listed");
                }
            }
            out.publish(now);
        }
    }

    /// Sends the probes that are due — none while no socket can be bound (probes not
    /// sent are not counted as missed).
    fn send_due(&mut self, r: &Redirector, now_ms: u64) {
        let node = r.node();
        if !self.bind(node) {
            return;
        }
        let due = self.liveness.due(now_ms);
        let Some((_, socket)) = self.socket.as_ref() else {
            return;
        };
        for (peer, nonce) in due {
            let Some(len) = build_liveness(
                &mut self.buf,
                &[0; 12],
                node,
                peer,
                r.port(),
                KIND_PROBE,
                nonce,
                r.send_key(),
            ) else {
                continue;
            };
            // The kernel writes the Ethernet, IPv4 and UDP headers: the payload only.
            let payload = &self.buf[14 + OUTER..len];
            let to = SocketAddrV4::new(Ipv4Addr::from(peer), r.port());
            if let Err(e) = socket.send_to(payload, to) {
                tracing::debug!(peer = %to, error = %e, "sending a liveness probe failed");
            }
        }
    }

    /// Whether a socket is bound to `node` (opened, or re-opened when the address
    /// changed); a failure is logged once per address.
    fn bind(&mut self, node: u32) -> bool {
        if self.socket.as_ref().is_some_and(|(a, _)| *a != node) {
            self.socket = None;
        }
        if self.socket.is_none() {
            let bound = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::from(node), 0))
                .and_then(|s| s.set_nonblocking(true).map(|()| s));
            match bound {
                Ok(s) => self.socket = Some((node, s)),
                Err(e) => {
                    if self.unbindable != Some(node) {
                        self.unbindable = Some(node);
                        tracing::warn!(address = %Ipv4Addr::from(node), error = %e, "cannot send redirect liveness probes from this address (retried); peers that answered stay as they were");
                    }
                    return false;
                }
            }
        }
        true
    }

    /// Every probed peer's liveness.
    pub fn peers(&self) -> impl Iterator<Item = PeerReach> + '_ {
        self.liveness.peers()
    }
}

/// Whether a [`Reach`] reports the peer reachable (`None`: it never answered).
pub fn reachable(r: Reach) -> Option<bool> {
    match r {
        Reach::Unknown => None,
        Reach::Reachable => Some(true),
        Reach::Unreachable => Some(false),
    }
}
