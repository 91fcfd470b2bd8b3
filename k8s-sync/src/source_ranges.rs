//! The client ranges a Service admits: `spec.loadBalancerSourceRanges`, or when that is
//! empty the `service.beta.kubernetes.io/load-balancer-source-ranges` annotation
//! (comma-separated), as Kubernetes' cloud providers read them. Pure; used by the
//! controller (a condition when the ranges cannot be honoured) and the agent (the
//! ranges each frontend carries to the dataplane), so both read them alike.
//!
//! Decisions (docs/k8s-sync.md, "Source ranges"): IPv6 ranges match no IPv4 client and
//! are left out; a list of IPv6 ranges only admits no IPv4 client at all, which the
//! Service is refused for (kube-proxy would then admit every client: a filter that
//! fails open) — as it is for an entry that is not a CIDR. A refused Service keeps its
//! VIP and is served by no node until it is fixed (fail closed, nothing lost).
//!
//! IPv6 (issue 28, [`of_service6`]): the IPv6 entries filter the clients of the
//! Service's IPv6 VIP, the IPv4 ones those of its IPv4 VIP; a list with no IPv6 entry
//! admits no IPv6 client, and the IPv6 VIP is then served by no node (the same fail
//! closed, per family: the IPv4 VIP is served as its ranges say).

use juneau_control::model::{BadSourceRange, SourceRange};
use k8s_openapi::api::core::v1::Service;

/// The annotation read when `spec.loadBalancerSourceRanges` is empty.
pub const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// Why a Service's source ranges cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceRangesError {
    /// An entry is not a CIDR.
    #[error("{field}: {source}")]
    NotACidr {
        /// Where the entry is (the field or the annotation).
        field: &'static str,
        /// The entry.
        source: BadSourceRange,
    },
    /// Every entry is an IPv4 range: no client of the IPv6 VIP would be admitted.
    #[error("{field} lists only IPv4 ranges ({ranges}); they admit no client of the Service's IPv6 VIP, which is therefore not served: add the IPv6 ranges to admit")]
    OnlyIpv4 {
        /// Where the entries are.
        field: &'static str,
        /// The entries, comma-separated.
        ranges: String,
    },
    /// Every entry is an IPv6 range: no IPv4 client would be admitted.
    #[error("{field} lists only IPv6 ranges ({ranges}); Juneau serves IPv4 clients, none of which they admit: add the IPv4 ranges to admit")]
    OnlyIpv6 {
        /// Where the entries are.
        field: &'static str,
        /// The entries, comma-separated.
        ranges: String,
    },
}

/// Where the Service's ranges are written, and its entries.
fn entries(svc: &Service) -> (&'static str, Vec<String>) {
    match svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.as_ref())
        .filter(|r| !r.is_empty())
    {
        Some(r) => ("spec.loadBalancerSourceRanges", r.clone()),
        None => (
            "annotation service.beta.kubernetes.io/load-balancer-source-ranges",
            svc.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SOURCE_RANGES_ANNOTATION))
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|e| !e.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
        ),
    }
}

/// The ranges the Service admits, sorted and without duplicates; empty: every client.
pub fn of_service(svc: &Service) -> Result<Vec<SourceRange>, SourceRangesError> {
    let (field, entries) = entries(svc);
    let mut ranges = Vec::new();
    for e in &entries {
        match e.parse::<SourceRange>() {
            Ok(r) => ranges.push(r),
            Err(BadSourceRange::Ipv6(_)) => {}
            Err(source) => return Err(SourceRangesError::NotACidr { field, source }),
        }
    }
    if ranges.is_empty() && !entries.is_empty() {
        return Err(SourceRangesError::OnlyIpv6 {
            field,
            ranges: entries.join(", "),
        });
    }
    ranges.sort();
    ranges.dedup();
    Ok(ranges)
}

/// The IPv6 ranges the Service admits on its IPv6 VIP (host bits cleared, as for
/// IPv4; a bare address is a /128), sorted and without duplicates; empty: every client.
/// An entry that is not a CIDR is refused as [`of_service`] refuses it.
pub fn of_service6(svc: &Service) -> Result<Vec<ipnet::Ipv6Net>, SourceRangesError> {
    let (field, entries) = entries(svc);
    let mut ranges = Vec::new();
    for e in &entries {
        match e.parse::<SourceRange>() {
            Ok(_) => {}
            Err(BadSourceRange::Ipv6(_)) => {
                let t = e.trim();
                let net = t
                    .parse::<ipnet::Ipv6Net>()
                    .or_else(|_| t.parse::<std::net::Ipv6Addr>().map(ipnet::Ipv6Net::from))
                    .map_err(|_| SourceRangesError::NotACidr {
                        field,
                        source: BadSourceRange::NotACidr(e.clone()),
                    })?;
                ranges.push(net.trunc());
            }
            Err(source) => return Err(SourceRangesError::NotACidr { field, source }),
        }
    }
    if ranges.is_empty() && !entries.is_empty() {
        return Err(SourceRangesError::OnlyIpv4 {
            field,
            ranges: entries.join(", "),
        });
    }
    ranges.sort();
    ranges.dedup();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ServiceSpec;

    fn svc(spec: Option<&[&str]>, annotation: Option<&str>) -> Service {
        let mut s = Service {
            spec: Some(ServiceSpec {
                load_balancer_source_ranges: spec
                    .map(|r| r.iter().map(|e| e.to_string()).collect()),
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Some(a) = annotation {
            s.metadata.annotations = Some(
                [(SOURCE_RANGES_ANNOTATION.to_string(), a.to_string())]
                    .into_iter()
                    .collect(),
            );
        }
        s
    }

    fn shown(r: &[SourceRange]) -> Vec<String> {
        r.iter().map(|r| r.to_string()).collect()
    }

    #[test]
    fn no_ranges_admit_every_client() {
        assert_eq!(of_service(&svc(None, None)), Ok(vec![]));
        assert_eq!(of_service(&svc(Some(&[]), Some(" , "))), Ok(vec![]));
    }

    #[test]
    fn the_field_wins_over_the_annotation_which_counts_when_it_is_empty() {
        let both = svc(Some(&["198.51.100.0/24"]), Some("192.0.2.0/24"));
        assert_eq!(shown(&of_service(&both).unwrap()), ["198.51.100.0/24"]);
        let annotation = svc(Some(&[]), Some("192.0.2.9, 10.1.2.3/8,192.0.2.9/32"));
        assert_eq!(
            shown(&of_service(&annotation).unwrap()),
            ["10.0.0.0/8", "192.0.2.9/32"]
        );
    }

    #[test]
    fn ipv6_ranges_are_left_out_but_ipv6_alone_is_refused() {
        let mixed = svc(Some(&["2001:db8::/32", "198.51.100.0/24"]), None);
        assert_eq!(shown(&of_service(&mixed).unwrap()), ["198.51.100.0/24"]);
        let only = svc(Some(&["2001:db8::/32"]), None);
        let e = of_service(&only).unwrap_err();
        assert!(matches!(e, SourceRangesError::OnlyIpv6 { .. }), "{e}");
        assert!(e.to_string().contains("2001:db8::/32"), "{e}");
    }

    #[test]
    fn ipv6_ranges_filter_the_ipv6_vip_and_ipv4_alone_admits_no_ipv6_client() {
        let shown6 = |r: Vec<ipnet::Ipv6Net>| r.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        assert_eq!(of_service6(&svc(None, None)), Ok(vec![]));
        let mixed = svc(
            Some(&[
                "2001:db8:1::5/48",
                "198.51.100.0/24",
                "2001:db8:ff::1",
                "2001:db8:1::/48",
            ]),
            None,
        );
        assert_eq!(
            shown6(of_service6(&mixed).unwrap()),
            ["2001:db8:1::/48", "2001:db8:ff::1/128"]
        );
        // The IPv4 side of the same list is unchanged.
        assert_eq!(shown(&of_service(&mixed).unwrap()), ["198.51.100.0/24"]);
        let only4 = svc(Some(&["198.51.100.0/24"]), None);
        let e = of_service6(&only4).unwrap_err();
        assert!(matches!(e, SourceRangesError::OnlyIpv4 { .. }), "{e}");
        assert!(e.to_string().contains("198.51.100.0/24"), "{e}");
        assert!(e.to_string().contains("IPv6 VIP"), "{e}");
        for bad in ["2001:db8::/129", "office", "2001:db8::/x"] {
            let e = of_service6(&svc(Some(&["2001:db8::/32", bad]), None)).unwrap_err();
            assert!(
                matches!(e, SourceRangesError::NotACidr { .. }),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn an_entry_that_is_not_a_cidr_is_named() {
        let e = of_service(&svc(None, Some("192.0.2.0/24, office"))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "annotation service.beta.kubernetes.io/load-balancer-source-ranges: \"office\" is not a CIDR (like 192.0.2.0/24)"
        );
    }
}
