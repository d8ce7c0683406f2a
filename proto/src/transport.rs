//! The ways block data can travel between a client and a daemon. A daemon
//! advertises the endpoints it serves when it registers; clients pick the
//! best one both sides have (see `docs/protocol.md`, "Transports").

use crate::codec::{Reader, Writer};
use crate::ProtoError;

/// A data path, best first when both sides offer several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum TransportKind {
    /// The daemon's pool mapped into the client (same host only).
    Shm = 3,
    /// One-sided reads and writes into the daemon's registered pool.
    Rdma = 2,
    /// Framed requests on QUIC streams, with TLS (optionally mutual).
    Quic = 1,
    /// Framed requests on TCP connections: every daemon serves it.
    Tcp = 0,
}

impl TransportKind {
    pub const ALL: [TransportKind; 4] = [
        TransportKind::Tcp,
        TransportKind::Quic,
        TransportKind::Rdma,
        TransportKind::Shm,
    ];

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| *k as u8 == v)
    }

    /// The label used in metrics, configs and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Quic => "quic",
            TransportKind::Rdma => "rdma",
            TransportKind::Shm => "shm",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown transport {s:?} (expected tcp, quic, rdma or shm)"))
    }
}

/// Where a daemon serves one transport besides its TCP address: a
/// `host:port` for QUIC, a device and queue-pair address for RDMA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub kind: TransportKind,
    pub addr: String,
}

/// Smallest encoded endpoint: kind and an empty address.
const MIN_ENDPOINT: usize = 1 + 2;

pub(crate) fn encode_endpoints(w: &mut Writer, endpoints: &[Endpoint]) {
    w.count(endpoints.len());
    for e in endpoints {
        w.u8(e.kind as u8);
        w.str(&e.addr);
    }
}

/// Decodes a list of endpoints; kinds this build does not know are
/// skipped, so a newer daemon can advertise more without breaking clients.
pub(crate) fn decode_endpoints(r: &mut Reader<'_>) -> Result<Vec<Endpoint>, ProtoError> {
    let n = r.count(MIN_ENDPOINT)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let kind = r.u8()?;
        let addr = r.str()?;
        if let Some(kind) = TransportKind::from_u8(kind) {
            out.push(Endpoint {
                kind,
                addr: addr.to_string(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_kinds_are_skipped() {
        for k in TransportKind::ALL {
            assert_eq!(k.name().parse::<TransportKind>().unwrap(), k);
            assert_eq!(TransportKind::from_u8(k as u8), Some(k));
        }
        assert!("udp".parse::<TransportKind>().is_err());
        let mut w = Writer::default();
        w.count(2);
        w.u8(9);
        w.str("future");
        w.u8(TransportKind::Quic as u8);
        w.str("127.0.0.1:7171");
        let got = decode_endpoints(&mut Reader::new(&w.buf)).unwrap();
        assert_eq!(
            got,
            vec![Endpoint {
                kind: TransportKind::Quic,
                addr: "127.0.0.1:7171".into()
            }]
        );
    }
}
