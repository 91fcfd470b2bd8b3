//! Shared VIPs (pure decisions): Services of one namespace that carry the same
//! `juneau.loutres.me/allow-shared-ip` key hold one VIP together, as long as no two of
//! them use the same port and protocol (TCP and UDP on port 53 is the classic pair).
//!
//! The controller's VIP book keys the group's claim by [`vip_owner`], so the group holds
//! the address, not one of its Services: it is allocated by the first member, kept while
//! one is left and released with the last. Who of a group may serve is decided by age
//! ([`admitted`]): oldest first, each Service admitted unless one of its ports is already
//! taken by an admitted one — every reconcile reaches the same answer whatever order they
//! run in, and a Service that collides gets no VIP at all (nothing half-served).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;

use crate::reconcile::{created_secs, key_of};

/// The annotation whose value names the group of Services that share a VIP.
pub const SHARED_IP_ANNOTATION: &str = "juneau.loutres.me/allow-shared-ip";

/// What separates the namespace from the key in a group's book owner (a Service name,
/// a DNS label, cannot contain `=`, so an owner never mistakes one for the other).
const GROUP_MARK: &str = "/allow-shared-ip=";

/// The Service's sharing key (the annotation's value, trimmed), if it has a non-empty one.
pub fn sharing_key(svc: &Service) -> Option<&str> {
    svc.metadata
        .annotations
        .as_ref()?
        .get(SHARED_IP_ANNOTATION)
        .map(|k| k.trim())
        .filter(|k| !k.is_empty())
}

/// Who holds the Service's VIP in the controller's book: the Service itself
/// (`namespace/name`), or its group (`namespace/allow-shared-ip=KEY`).
pub fn vip_owner(svc: &Service) -> String {
    match sharing_key(svc) {
        Some(k) => format!(
            "{}{GROUP_MARK}{k}",
            svc.metadata.namespace.as_deref().unwrap_or("default")
        ),
        None => key_of(svc),
    }
}

/// The namespace and key of a group's book owner; `None` for a single Service's.
pub fn group_of(owner: &str) -> Option<(&str, &str)> {
    owner.split_once(GROUP_MARK)
}

/// A book owner in words, for conditions and Events.
pub fn describe_owner(owner: &str) -> String {
    match group_of(owner) {
        Some((ns, key)) => format!("the Services of namespace {ns} sharing {key:?}"),
        None => format!("Service {owner}"),
    }
}

/// The (protocol, port) pairs the Service listens on.
fn ports(svc: &Service) -> BTreeSet<(String, i32)> {
    svc.spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
        .map(|p| (p.protocol.clone().unwrap_or_else(|| "TCP".into()), p.port))
        .collect()
}

/// Why a Service may not join its group: an older admitted member uses one of its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortConflict {
    /// `namespace/name` of the member that holds the port.
    pub holder: String,
    /// The protocol of the port both use.
    pub protocol: String,
    /// The port both use.
    pub port: i32,
}

/// Whether `svc` may serve on its group's VIP, given the group's other members
/// (`others`: the managed, not deleted Services of its namespace; only those with the
/// same key count). Members are admitted oldest first (creation time, then name), each
/// unless a port of it is taken by one admitted before; `Err` names the member and
/// port that keep `svc` out.
pub fn admitted(svc: &Service, others: &[&Service]) -> Result<(), PortConflict> {
    let Some(key) = sharing_key(svc) else {
        return Ok(());
    };
    let me = key_of(svc);
    let mut members: Vec<(i64, String, &Service)> = others
        .iter()
        .copied()
        .filter(|o| sharing_key(o) == Some(key) && o.metadata.namespace == svc.metadata.namespace)
        .map(|o| (created_secs(o), key_of(o), o))
        .filter(|(_, k, _)| *k != me)
        .collect();
    members.push((created_secs(svc), me.clone(), svc));
    members.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    // Each admitted member's ports, and who holds them.
    let mut taken: BTreeMap<(String, i32), &str> = BTreeMap::new();
    for (_, k, s) in &members {
        let mine = ports(s);
        let clash = mine.iter().find_map(|p| taken.get_key_value(p));
        if *k == me {
            return match clash {
                None => Ok(()),
                Some(((protocol, port), holder)) => Err(PortConflict {
                    holder: holder.to_string(),
                    protocol: protocol.clone(),
                    port: *port,
                }),
            };
        }
        if clash.is_none() {
            taken.extend(mine.into_iter().map(|p| (p, k.as_str())));
        }
    }
    Ok(())
}

/// Service ports of the given (protocol, port) pairs, for tests.
#[cfg(test)]
pub(crate) fn test_ports(ports: &[(&str, i32)]) -> Vec<k8s_openapi::api::core::v1::ServicePort> {
    ports
        .iter()
        .map(|(proto, port)| k8s_openapi::api::core::v1::ServicePort {
            protocol: Some(proto.to_string()),
            port: *port,
            ..Default::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ServiceSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn svc(
        ns: &str,
        name: &str,
        key: Option<&str>,
        created: i64,
        ports: &[(&str, i32)],
    ) -> Service {
        Service {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                annotations: key
                    .map(|k| [(SHARED_IP_ANNOTATION.to_string(), k.to_string())].into()),
                creation_timestamp: Some(Time(
                    k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
                )),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                ports: Some(test_ports(ports)),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_group_not_the_service_owns_a_shared_vip() {
        let dns_tcp = svc("kube-system", "dns-tcp", Some(" dns "), 1, &[("TCP", 53)]);
        let plain = svc("kube-system", "web", None, 1, &[("TCP", 80)]);
        let empty = svc("kube-system", "web", Some("  "), 1, &[("TCP", 80)]);
        assert_eq!(vip_owner(&dns_tcp), "kube-system/allow-shared-ip=dns");
        assert_eq!(vip_owner(&plain), "kube-system/web");
        assert_eq!(
            vip_owner(&empty),
            "kube-system/web",
            "an empty key shares nothing"
        );
        assert_eq!(
            describe_owner(&vip_owner(&dns_tcp)),
            "the Services of namespace kube-system sharing \"dns\""
        );
        assert_eq!(describe_owner("kube-system/web"), "Service kube-system/web");
    }

    #[test]
    fn tcp_and_udp_on_one_port_share_and_a_colliding_newcomer_is_kept_out() {
        let tcp = svc("ns", "dns-tcp", Some("dns"), 1, &[("TCP", 53)]);
        let udp = svc("ns", "dns-udp", Some("dns"), 2, &[("UDP", 53)]);
        let late = svc("ns", "late", Some("dns"), 3, &[("TCP", 53), ("TCP", 853)]);
        assert_eq!(admitted(&tcp, &[&udp, &late]), Ok(()));
        assert_eq!(admitted(&udp, &[&tcp, &late]), Ok(()));
        assert_eq!(
            admitted(&late, &[&tcp, &udp]),
            Err(PortConflict {
                holder: "ns/dns-tcp".into(),
                protocol: "TCP".into(),
                port: 53
            })
        );
        // The older one leaves: the newcomer is admitted.
        assert_eq!(admitted(&late, &[&udp]), Ok(()));
    }

    #[test]
    fn a_member_kept_out_takes_no_port_from_the_younger_ones() {
        let a = svc("ns", "a", Some("k"), 1, &[("TCP", 80)]);
        let b = svc("ns", "b", Some("k"), 2, &[("TCP", 80), ("TCP", 443)]);
        let c = svc("ns", "c", Some("k"), 3, &[("TCP", 443)]);
        assert!(admitted(&b, &[&a, &c]).is_err());
        assert_eq!(
            admitted(&c, &[&a, &b]),
            Ok(()),
            "b serves nothing, so 443 is free"
        );
        // Same creation second: the name decides, the same way for every member.
        let x = svc("ns", "x", Some("k"), 5, &[("TCP", 1)]);
        let y = svc("ns", "y", Some("k"), 5, &[("TCP", 1)]);
        assert_eq!(admitted(&x, &[&y]), Ok(()));
        assert!(admitted(&y, &[&x]).is_err());
    }

    #[test]
    fn other_keys_other_namespaces_and_unshared_services_never_collide() {
        let a = svc("ns", "a", Some("k"), 1, &[("TCP", 80)]);
        let other_key = svc("ns", "b", Some("j"), 0, &[("TCP", 80)]);
        let other_ns = svc("other", "c", Some("k"), 0, &[("TCP", 80)]);
        let unshared = svc("ns", "d", None, 0, &[("TCP", 80)]);
        assert_eq!(admitted(&a, &[&other_key, &other_ns, &unshared]), Ok(()));
        assert_eq!(admitted(&unshared, &[&a]), Ok(()));
    }
}
