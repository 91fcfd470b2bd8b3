//! Host-network backends: frontends whose backends are this node's own stack
//! (`NodeService::host_network`: host-network Pods on the node's address, e.g. an
//! ingress controller). AF_XDP cannot hand a packet to the local stack, so the steering
//! program passes these frontends' packets to the kernel (`FRONTEND_HOST_NETWORK`) and
//! the kernel DNATs them: one nftables table, `ip juneau_host_network`, whose map sends
//! `VIP . protocol . port` to the backend's `address . port` in the prerouting hook;
//! conntrack reverses the replies (source VIP:port again), the client's address reaches
//! the Pod. The table is replaced whole (`nft -f -`: one transaction) when it changes,
//! before the steering program is told, so a frontend is passed to the kernel only
//! once the kernel can deliver it; it is left in place when the dataplane stops (the
//! kernel's connections keep their NAT either way; the next start replaces it).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::services::ServiceTable;

/// The nftables table (family `ip`).
pub const TABLE: &str = "juneau_host_network";

/// Why the table could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum HostNetworkError {
    /// `nft` could not be run.
    #[error("running {nft}: {source}")]
    Spawn {
        /// The binary.
        nft: String,
        /// Why.
        source: std::io::Error,
    },
    /// `nft` refused the ruleset.
    #[error("{nft} refused the host-network table: {stderr}")]
    Refused {
        /// The binary.
        nft: String,
        /// What it said.
        stderr: String,
    },
}

/// `VIP . protocol number . port : backend . port` per host-network frontend, sorted: its
/// first Ready backend, else its first draining one (connections it holds are the
/// kernel's and keep their NAT; a new one reaches the draining Pod until it is gone).
pub fn elements(table: &ServiceTable) -> Vec<String> {
    let mut v: Vec<String> = table
        .services()
        .iter()
        .filter(|s| s.host_network)
        .filter_map(|s| {
            let b = s.backends.first()?;
            Some(format!(
                "{} . {} . {} : {} . {}",
                s.frontend.vip,
                // The protocol's number, not its name: nft would look a name up in
                // /etc/protocols, which the image does not have.
                s.frontend.protocol.number(),
                s.frontend.port,
                b.ip,
                b.port
            ))
        })
        .collect();
    v.sort();
    v
}

/// The whole ruleset for `elements`: the table is created (if absent) and deleted, then
/// defined again when there is an element — one `nft -f` transaction either way.
pub fn ruleset(elements: &[String]) -> String {
    let mut r = format!("table ip {TABLE}\ndelete table ip {TABLE}\n");
    if elements.is_empty() {
        return r;
    }
    r += &format!(
        "table ip {TABLE} {{\n\tmap backends {{\n\t\ttype ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service\n\t\telements = {{ {} }}\n\t}}\n\tchain prerouting {{\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t\tdnat ip to ip daddr . meta l4proto . th dport map @backends\n\t}}\n}}\n",
        elements.join(", ")
    );
    r
}

/// The table as last applied.
#[derive(Debug)]
pub struct HostNetworkRules {
    nft: PathBuf,
    /// The elements last applied; `None` before the first apply (the first one always
    /// runs: it removes a table a previous process left that no longer applies).
    applied: Option<Vec<String>>,
}

impl HostNetworkRules {
    /// Rules applied with the `nft` binary at `nft`.
    pub fn new(nft: PathBuf) -> Self {
        HostNetworkRules { nft, applied: None }
    }

    /// Applies the table `table` wants if it differs from the last one applied.
    /// Returns whether `nft` ran.
    pub fn sync(&mut self, table: &ServiceTable) -> Result<bool, HostNetworkError> {
        let want = elements(table);
        if self.applied.as_ref() == Some(&want) {
            return Ok(false);
        }
        match self.apply(&ruleset(&want)) {
            // No host-network frontend and no `nft` on this node: nothing to remove
            // (a table can only come from an `nft`), nothing to report.
            Err(HostNetworkError::Spawn { .. }) if want.is_empty() => {}
            r => r?,
        }
        self.applied = Some(want);
        Ok(true)
    }

    fn apply(&self, rules: &str) -> Result<(), HostNetworkError> {
        let nft = self.nft.display().to_string();
        let spawn = |source| HostNetworkError::Spawn {
            nft: nft.clone(),
            source,
        };
        let mut child = Command::new(&self.nft)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn)?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(rules.as_bytes()).map_err(spawn)?;
        }
        let out = child.wait_with_output().map_err(spawn)?;
        if !out.status.success() {
            return Err(HostNetworkError::Refused {
                nft,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
    use std::net::Ipv4Addr;

    fn service(
        vip: [u8; 4],
        proto: Protocol,
        port: u16,
        backend: [u8; 4],
        bport: u16,
    ) -> NodeService {
        let mut s = NodeService::new(
            Frontend {
                vip: Ipv4Addr::from(vip),
                protocol: proto,
                port,
            },
            vec![LocalBackend {
                ip: Ipv4Addr::from(backend),
                port: bport,
            }],
        );
        s.host_network = true;
        s
    }

    /// The service table of `state` (Maglev tables are no concern here: empty ones).
    fn table(state: &NodeState) -> ServiceTable {
        let maglev: Vec<Vec<u16>> = state.services.iter().map(|_| Vec::new()).collect();
        ServiceTable::new(1, state, &maglev)
    }

    #[test]
    fn host_network_frontends_become_map_elements_and_pod_ones_do_not() {
        let mut pod = service([203, 0, 113, 9], Protocol::Tcp, 80, [10, 244, 1, 5], 8080);
        pod.host_network = false;
        let state = NodeState {
            services: vec![
                service([203, 0, 113, 30], Protocol::Udp, 53, [10, 0, 0, 2], 5353),
                service([203, 0, 113, 30], Protocol::Tcp, 80, [10, 0, 0, 2], 8080),
                pod,
            ],
            ..Default::default()
        };
        let t = table(&state);
        let e = elements(&t);
        assert_eq!(
            e,
            vec![
                "203.0.113.30 . 17 . 53 : 10.0.0.2 . 5353",
                "203.0.113.30 . 6 . 80 : 10.0.0.2 . 8080"
            ]
        );
        let r = ruleset(&e);
        assert!(
            r.starts_with("table ip juneau_host_network\ndelete table ip juneau_host_network\n")
        );
        assert!(r.contains(
            "elements = { 203.0.113.30 . 17 . 53 : 10.0.0.2 . 5353, 203.0.113.30 . 6 . 80 : 10.0.0.2 . 8080 }"
        ));
        assert!(r.contains("dnat ip to ip daddr . meta l4proto . th dport map @backends"));
        // Without host-network frontends: only removed.
        assert_eq!(
            ruleset(&[]),
            "table ip juneau_host_network\ndelete table ip juneau_host_network\n"
        );
    }

    #[test]
    fn a_missing_nft_is_a_clear_error_and_applies_nothing() {
        // Without a host-network frontend, no `nft` is no error.
        let mut quiet = HostNetworkRules::new(PathBuf::from("/nonexistent/nft"));
        quiet
            .sync(&table(&NodeState::default()))
            .expect("nothing to apply");
        let state = NodeState {
            services: vec![service(
                [203, 0, 113, 30],
                Protocol::Tcp,
                80,
                [10, 0, 0, 2],
                8080,
            )],
            ..Default::default()
        };
        let mut r = HostNetworkRules::new(PathBuf::from("/nonexistent/nft"));
        let e = r.sync(&table(&state)).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/nft"), "{e}");
        assert!(r.applied.is_none(), "nothing recorded as applied");
    }
}
