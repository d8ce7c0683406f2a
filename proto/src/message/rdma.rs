//! Bodies of the RDMA path's control connection: queue pair exchange and
//! the pool regions a client may read and write.

use super::*;

/// One end of an RDMA reliable connection (`RdmaConnect`): what the other
/// end needs to address its queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaPeer {
    /// The port's local identifier (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// The port's global identifier (RoCE, or InfiniBand across subnets).
    pub gid: [u8; 16],
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number this end sends (24 bits).
    pub psn: u32,
    /// Path MTU this end can use, as libibverbs numbers it (1 = 256 bytes
    /// to 5 = 4096).
    pub mtu: u8,
}

impl Body for RdmaPeer {
    fn encode(&self, w: &mut Writer) {
        w.u16(self.lid);
        w.buf.extend_from_slice(&self.gid);
        w.u32(self.qpn);
        w.u32(self.psn);
        w.u8(self.mtu);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let lid = r.u16()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(r.take(16)?);
        let (qpn, psn, mtu) = (r.u32()?, r.u32()?, r.u8()?);
        if psn >= 1 << 24 {
            return Err(ProtoError::Invalid {
                field: "psn",
                why: format!("{psn} does not fit 24 bits"),
            });
        }
        if !(1..=5).contains(&mtu) {
            return Err(ProtoError::Invalid {
                field: "mtu",
                why: format!("{mtu} is not an MTU code (1 to 5)"),
            });
        }
        Ok(RdmaPeer {
            lid,
            gid,
            qpn,
            psn,
            mtu,
        })
    }
}

/// A registered piece of a daemon's pool: its bytes `offset..offset + len`
/// lie at `addr` in the daemon's memory, readable and writable with `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaRegion {
    pub offset: u64,
    pub len: u64,
    pub addr: u64,
    pub rkey: u32,
}

/// Regions one daemon may describe, at most (a pool split where a NIC
/// limits a region's size).
pub const MAX_RDMA_REGIONS: usize = 4096;

/// The daemon's answer to `RdmaConnect`: its queue pair, the regions that
/// cover its pool in order, and its TCP address (which locations name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaAccept {
    pub peer: RdmaPeer,
    pub regions: Vec<RdmaRegion>,
    pub addr: String,
}

impl Body for RdmaAccept {
    fn encode(&self, w: &mut Writer) {
        self.peer.encode(w);
        w.count(self.regions.len());
        for region in &self.regions {
            w.u64(region.offset);
            w.u64(region.len);
            w.u64(region.addr);
            w.u32(region.rkey);
        }
        w.str(&self.addr);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let peer = RdmaPeer::decode(r)?;
        let n = r.count(28)?;
        if n > MAX_RDMA_REGIONS {
            return Err(ProtoError::Invalid {
                field: "regions",
                why: format!("{n} regions (at most {MAX_RDMA_REGIONS})"),
            });
        }
        let regions = (0..n)
            .map(|_| {
                Ok(RdmaRegion {
                    offset: r.u64()?,
                    len: r.u64()?,
                    addr: r.u64()?,
                    rkey: r.u32()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let addr = r.str()?.to_string();
        Ok(RdmaAccept {
            peer,
            regions,
            addr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> RdmaPeer {
        RdmaPeer {
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x11_2233,
            psn: 0xab_cdef,
            mtu: 5,
        }
    }

    #[test]
    fn rdma_handshake_round_trips() {
        assert_eq!(RdmaPeer::from_bytes(&peer().to_bytes()).unwrap(), peer());
        let accept = RdmaAccept {
            peer: peer(),
            regions: vec![
                RdmaRegion {
                    offset: 0,
                    len: 1 << 30,
                    addr: 0x7f00_0000_0000,
                    rkey: 9,
                },
                RdmaRegion {
                    offset: 1 << 30,
                    len: 1 << 20,
                    addr: 0x7f00_4000_0000,
                    rkey: 10,
                },
            ],
            addr: "10.0.0.5:7801".into(),
        };
        assert_eq!(RdmaAccept::from_bytes(&accept.to_bytes()).unwrap(), accept);
    }

    #[test]
    fn rdma_peer_refuses_what_no_nic_sends() {
        let mut bad = peer();
        bad.psn = 1 << 24;
        assert!(RdmaPeer::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = peer();
        bad.mtu = 6;
        assert!(RdmaPeer::from_bytes(&bad.to_bytes()).is_err());
        let bytes = peer().to_bytes();
        assert!(RdmaPeer::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    }
}
