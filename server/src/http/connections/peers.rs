//! Client addresses as connections are counted under
//! `--http-max-connections-per-peer` ([`PeerGroup`]: an IPv4 address, an
//! IPv6 /64) and the open connections of each, capped at its share.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, PoisonError};

/// The client address a connection is counted under for
/// `--http-max-connections-per-peer`, and what `sse` groups callers without
/// a token by. Found in every request's extensions.
///
/// IPv6 clients are grouped by their /64 network: a single host or site is
/// normally given a whole /64 (SLAAC and privacy addresses pick any address
/// in it), so counting single addresses would give one client 2^64 shares.
/// Clients behind one /64 share one share, as clients behind one IPv4 NAT
/// share their address. IPv4-mapped IPv6 addresses (a dual-stack listener)
/// count as their IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerGroup {
    V4(Ipv4Addr),
    /// The upper 64 bits of the address.
    V6Network(u64),
}

impl PeerGroup {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => PeerGroup::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerGroup::V4(v4),
                None => {
                    let [network @ .., _, _, _, _, _, _, _, _] = v6.octets();
                    PeerGroup::V6Network(u64::from_be_bytes(network))
                }
            },
        }
    }
}

impl fmt::Display for PeerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerGroup::V4(v4) => write!(f, "{v4}"),
            PeerGroup::V6Network(network) => {
                let address = std::net::Ipv6Addr::from(u128::from(*network) << 64);
                write!(f, "{address}/64")
            }
        }
    }
}

/// Open connections per [`PeerGroup`], capped at a share of the connection
/// cap. Entries exist only while their address has a connection open, so
/// the table never holds more entries than there are open connections.
pub(super) struct PeerConnections {
    max_per_peer: usize,
    /// Locked only for a lookup and an increment or decrement; never across
    /// an await.
    pub(super) open: Mutex<HashMap<PeerGroup, usize>>,
}

impl PeerConnections {
    pub(super) fn new(max_per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            max_per_peer,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `group`, or `None` when it has
    /// its share open.
    pub(super) fn try_admit(self: &Arc<Self>, group: PeerGroup) -> Option<PeerSlot> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(group).or_insert(0);
        if *count >= self.max_per_peer {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            group,
        })
    }
}

/// One connection of a [`PeerGroup`]'s share; released on drop.
pub(super) struct PeerSlot {
    peers: Arc<PeerConnections>,
    group: PeerGroup,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self
            .peers
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Entry::Occupied(mut entry) = open.entry(self.group) {
            let count = entry.get_mut();
            *count = count.saturating_sub(1);
            if *count == 0 {
                entry.remove();
            }
        }
    }
}
