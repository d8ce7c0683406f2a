//! Limits a server applies per client, so that one client cannot take all
//! of a server's connections (and with them its request slots: each
//! connection has at most one request in flight, bounded by its opcode's
//! body limit).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// Open connections per client address, at most `max` each.
#[derive(Debug)]
pub struct PerClient {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection counted against its client; released when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    owner: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    pub fn new(max: usize) -> Arc<PerClient> {
        Arc::new(PerClient {
            max,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `ip`, or `None` at the limit.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<ClientSlot> {
        let mut open = self.open.lock();
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            owner: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.owner.open.lock();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_gets_its_own_allowance_back_when_it_closes() {
        let limits = PerClient::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let s1 = limits.admit(a).unwrap();
        let _s2 = limits.admit(a).unwrap();
        assert!(limits.admit(a).is_none(), "a third connection from a");
        assert!(limits.admit(b).is_some(), "b is not held back by a");
        drop(s1);
        assert!(limits.admit(a).is_some());
    }
}
