//! How many connections (or handshakes) a listener holds at once, overall and per peer address:
//! the one table every server of brigade admits through — QUIC handshakes, the gRPC ports, the
//! HTTP APIs. Admission is a counter, not a queue: a connection over either cap is refused at
//! once (closed), so a stranger holding connections open can fill at most its share and never
//! the process's file descriptors.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The caps of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Connections open at once, from everyone.
    pub total: usize,
    /// Connections open at once from one IP address.
    pub per_ip: usize,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// [`Caps::total`] is reached: the connections open now.
    #[error("{0} connections are open, the most this listener holds")]
    Total(usize),
    /// [`Caps::per_ip`] is reached for the peer's address: the connections open from it now.
    #[error("{0} connections are open from this address, the most one address may hold")]
    PerIp(usize),
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_ip: HashMap<IpAddr, usize>,
}

/// The open connections of one listener. Cloning shares the table.
#[derive(Debug, Clone)]
pub struct Admission {
    caps: Caps,
    open: Arc<Mutex<Open>>,
}

/// One admitted connection's place in the table; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket {
    open: Arc<Mutex<Open>>,
    ip: IpAddr,
}

impl Admission {
    /// An empty table with these caps.
    pub fn new(caps: Caps) -> Self {
        Self { caps, open: Arc::default() }
    }

    /// A ticket for one more connection from `ip`, or why there is none.
    pub fn admit(&self, ip: IpAddr) -> Result<Ticket, Refused> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.total >= self.caps.total {
            return Err(Refused::Total(open.total));
        }
        let from_ip = open.by_ip.entry(ip).or_default();
        if *from_ip >= self.caps.per_ip {
            return Err(Refused::PerIp(*from_ip));
        }
        *from_ip += 1;
        open.total += 1;
        Ok(Ticket { open: self.open.clone(), ip })
    }

    /// Connections open now: everyone's, and `ip`'s.
    pub fn open(&self, ip: IpAddr) -> (usize, usize) {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        (open.total, open.by_ip.get(&ip).copied().unwrap_or(0))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.by_ip.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_caps_hold_and_a_dropped_ticket_frees_its_place() {
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let table = Admission::new(Caps { total: 3, per_ip: 2 });
        let a1 = table.admit(a).unwrap();
        let _a2 = table.admit(a).unwrap();
        assert_eq!(table.admit(a).unwrap_err(), Refused::PerIp(2));
        let _b1 = table.admit(b).unwrap();
        assert_eq!(table.admit(b).unwrap_err(), Refused::Total(3));
        assert_eq!(table.open(a), (3, 2));
        drop(a1);
        assert_eq!(table.open(a), (2, 1));
        let _a3 = table.admit(a).unwrap();
        assert!(table.admit(b).is_err());
    }
}
