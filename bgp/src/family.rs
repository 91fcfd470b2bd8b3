//! Address families (RFC 4760 AFI/SAFI pairs) the speaker announces, and what a session
//! negotiated.
//!
//! Only unicast: a VIP is a host route, `/32` (IPv4) or `/128` (IPv6).

use std::net::IpAddr;

/// An address family this speaker can announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum AddressFamily {
    /// AFI 1, SAFI 1.
    Ipv4Unicast,
    /// AFI 2, SAFI 1.
    Ipv6Unicast,
}

impl AddressFamily {
    /// Every family, in wire order (IPv4 first).
    pub const ALL: [AddressFamily; 2] = [AddressFamily::Ipv4Unicast, AddressFamily::Ipv6Unicast];

    /// Address Family Identifier (RFC 4760).
    pub fn afi(self) -> u16 {
        match self {
            AddressFamily::Ipv4Unicast => 1,
            AddressFamily::Ipv6Unicast => 2,
        }
    }

    /// Subsequent Address Family Identifier (1: unicast).
    pub fn safi(self) -> u8 {
        1
    }

    /// The family of an AFI/SAFI pair, if it is one of ours.
    pub fn from_afi_safi(afi: u16, safi: u8) -> Option<Self> {
        match (afi, safi) {
            (1, 1) => Some(AddressFamily::Ipv4Unicast),
            (2, 1) => Some(AddressFamily::Ipv6Unicast),
            _ => None,
        }
    }

    /// The family a host route to `ip` belongs to.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => AddressFamily::Ipv4Unicast,
            IpAddr::V6(_) => AddressFamily::Ipv6Unicast,
        }
    }

    /// Operator-facing name, as BIRD and FRR print it.
    pub fn name(self) -> &'static str {
        match self {
            AddressFamily::Ipv4Unicast => "ipv4-unicast",
            AddressFamily::Ipv6Unicast => "ipv6-unicast",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl std::fmt::Display for AddressFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of address families.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Families(u8);

impl Families {
    /// No family.
    pub const NONE: Families = Families(0);
    /// IPv4 unicast only: what a peer that sends no multiprotocol capability speaks
    /// (RFC 4760 §8).
    pub const IPV4: Families = Families(1);
    /// IPv4 and IPv6 unicast.
    pub const BOTH: Families = Families(3);

    /// This set and `af`.
    pub fn with(self, af: AddressFamily) -> Self {
        Families(self.0 | af.bit())
    }

    /// Whether `af` is in the set.
    pub fn contains(self, af: AddressFamily) -> bool {
        self.0 & af.bit() != 0
    }

    /// The families in either set.
    pub fn or(self, other: Families) -> Self {
        Families(self.0 | other.0)
    }

    /// The families in both sets.
    pub fn and(self, other: Families) -> Self {
        Families(self.0 & other.0)
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The families, IPv4 first.
    pub fn iter(self) -> impl Iterator<Item = AddressFamily> {
        AddressFamily::ALL
            .into_iter()
            .filter(move |af| self.contains(*af))
    }
}

impl FromIterator<AddressFamily> for Families {
    fn from_iter<I: IntoIterator<Item = AddressFamily>>(iter: I) -> Self {
        iter.into_iter().fold(Families::NONE, Families::with)
    }
}

impl std::fmt::Debug for Families {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl serde::Serialize for Families {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter().map(AddressFamily::name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn afi_safi_round_trip_and_sets_hold_what_was_put_in() {
        for af in AddressFamily::ALL {
            assert_eq!(AddressFamily::from_afi_safi(af.afi(), af.safi()), Some(af));
            assert!(Families::NONE.with(af).contains(af));
            assert_eq!(Families::NONE.with(af).iter().collect::<Vec<_>>(), vec![af]);
        }
        assert_eq!(AddressFamily::from_afi_safi(2, 128), None);
        assert_eq!(AddressFamily::from_afi_safi(25, 70), None);
        assert!(!Families::IPV4.contains(AddressFamily::Ipv6Unicast));
        assert_eq!(
            Families::BOTH.and(Families::NONE.with(AddressFamily::Ipv6Unicast)),
            Families::NONE.with(AddressFamily::Ipv6Unicast)
        );
        assert_eq!(
            serde_json::to_string(&Families::BOTH).unwrap(),
            r#"["ipv4-unicast","ipv6-unicast"]"#
        );
        assert_eq!(
            AddressFamily::of("2001:db8::1".parse().unwrap()),
            AddressFamily::Ipv6Unicast
        );
    }
}
