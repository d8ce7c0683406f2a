//! Puts in progress counted per client, so that no one client can hold the
//! cluster's whole room for reservations (`max_pending_puts`) and turn
//! every other client's puts away as `busy`.
//!
//! A client is told apart by its address: by the last 16 bits of an IPv4
//! address (so every host of one /16 network is a client of its own), by a
//! fold of the whole address for IPv6. Processes on one host count as one
//! client, as their connections do for `max_connections_per_client`. Two
//! IPv6 hosts may fold to the same client; they then share its cap.
//! The counts are a fixed table, so they cost the same however many
//! addresses a client makes up.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};

/// A client, as the meta service counts its reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client(u16);

impl Client {
    pub fn of(ip: IpAddr) -> Client {
        match ip.to_canonical() {
            IpAddr::V4(v4) => {
                let [_, _, c, d] = v4.octets();
                Client(u16::from_be_bytes([c, d]))
            }
            IpAddr::V6(v6) => Client(v6.segments().iter().fold(0, |acc, s| acc ^ s)),
        }
    }
}

/// Reservations not yet committed, per client.
pub struct PendingByClient {
    counts: Box<[AtomicU32]>,
}

impl Default for PendingByClient {
    fn default() -> Self {
        PendingByClient {
            counts: (0..=u16::MAX).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

impl PendingByClient {
    pub fn of(&self, client: Client) -> u32 {
        self.counts[usize::from(client.0)].load(Ordering::Relaxed)
    }

    pub(crate) fn add(&self, client: Client) {
        self.counts[usize::from(client.0)].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, client: Client) {
        self.counts[usize::from(client.0)].fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_one_slash_16_are_clients_of_their_own() {
        let a = Client::of("10.1.2.3".parse().unwrap());
        let b = Client::of("10.1.2.4".parse().unwrap());
        let c = Client::of("10.1.3.3".parse().unwrap());
        assert!(a != b && a != c && b != c);
        assert_eq!(a, Client::of("::ffff:10.1.2.3".parse().unwrap()));
        let v6 = Client::of("fd00::1".parse().unwrap());
        assert_ne!(v6, Client::of("fd00::2".parse().unwrap()));
    }

    #[test]
    fn counts_follow_adds_and_subs_per_client() {
        let p = PendingByClient::default();
        let (a, b) = (Client(1), Client(2));
        p.add(a);
        p.add(a);
        p.add(b);
        p.sub(a);
        assert_eq!((p.of(a), p.of(b), p.of(Client(3))), (1, 1, 0));
    }
}
