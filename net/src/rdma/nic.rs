//! One RDMA NIC opened for use: its protection domain, the port and GID
//! this process uses on it, memory registration, and reliable-connected
//! queue pairs with the few verbs the data path needs (one-sided reads and
//! writes, completions polled).

use std::sync::Arc;

use mooncake_proto::message::RdmaPeer;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
pub use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

/// RDMA reads one queue pair keeps in flight towards a daemon, at most
/// (the NIC may allow fewer).
const READ_DEPTH: u8 = 16;

/// Which NIC, port and GID to use; `None` picks the first active one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicChoice {
    pub device: Option<String>,
    pub gid_index: Option<u32>,
}

/// An opened NIC and the port this process uses on it.
pub struct Nic {
    pub name: String,
    /// Largest memory region the NIC registers.
    pub max_region: u64,
    /// RDMA reads in flight per queue pair, as initiator and as target.
    read_depth: u8,
    port: u8,
    gid_index: u8,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid", &self.gid.to_string())
            .finish()
    }
}

impl Nic {
    /// Opens the NIC `choice` names (or the first with an active port); an
    /// error in one line says why none could be used.
    pub fn open(choice: &NicChoice) -> Result<Arc<Nic>, String> {
        let found = super::devices()?;
        let list = DeviceList::new().map_err(|e| format!("no RDMA: {e}"))?;
        let mut why = Vec::new();
        for device in list.iter() {
            let name = device.name();
            if choice.device.as_ref().is_some_and(|want| *want != name) {
                continue;
            }
            match device
                .open()
                .map_err(|e| e.to_string())
                .and_then(|ctx| Nic::on(name.clone(), ctx, choice.gid_index))
            {
                Ok(nic) => return Ok(Arc::new(nic)),
                Err(err) => why.push(format!("{name}: {err}")),
            }
        }
        Err(match (&choice.device, why.is_empty()) {
            (Some(want), true) => format!(
                "no RDMA device {want} (this host has {})",
                found
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => format!("no usable RDMA port: {}", why.join("; ")),
        })
    }

    fn on(name: String, ctx: Arc<DeviceContext>, gid_index: Option<u32>) -> Result<Nic, String> {
        let attr = ctx.query_device().map_err(|e| e.to_string())?;
        let port = (1..=attr.phys_port_cnt())
            .find(|p| {
                ctx.query_port(*p)
                    .is_ok_and(|a| a.port_state() == PortState::Active)
            })
            .ok_or("no active port")?;
        let port_attr = ctx.query_port(port).map_err(|e| e.to_string())?;
        let ethernet = port_attr.link_layer() == LinkLayer::Ethernet;
        let gid_index = match gid_index {
            Some(i) => i,
            None => pick_gid(&ctx, port, ethernet)?,
        };
        let gid = ctx
            .query_gid(port, gid_index)
            .map_err(|e| format!("GID {gid_index} of port {port}: {e}"))?;
        let depth = |v: i32| u8::try_from(v.clamp(1, READ_DEPTH as i32)).unwrap_or(1);
        let read_depth = depth(attr.max_qp_rd_atom()).min(depth(attr.max_qp_init_rd_atom()));
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        Ok(Nic {
            name,
            max_region: attr.max_mr_size(),
            read_depth,
            port,
            gid_index: u8::try_from(gid_index).map_err(|_| "GID index above 255")?,
            gid,
            lid: port_attr.lid(),
            mtu: port_attr.active_mtu(),
            pd,
            ctx,
        })
    }

    /// Registers `len` bytes at `ptr` with the NIC; with `remote`, peers
    /// holding the region's key may read and write them.
    ///
    /// # Safety
    ///
    /// The bytes must stay allocated while the region (or any queue pair
    /// with work on it) lives.
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        remote: bool,
    ) -> Result<Arc<MemoryRegion>, String> {
        let mut access = AccessFlags::LocalWrite;
        if remote {
            access = access | AccessFlags::RemoteRead | AccessFlags::RemoteWrite;
        }
        // SAFETY: the caller keeps the bytes alive as long as the region.
        unsafe { self.pd.reg_mr(ptr as usize, len, access) }
            .map_err(|e| format!("registering {len} bytes on {}: {e}", self.name))
    }

    /// A new reliable-connected queue pair, ready to be connected, for up to
    /// `depth` work requests in flight.
    pub fn queue(&self, depth: u32) -> Result<Queue, String> {
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth.max(1))
            .build()
            .map_err(|e| format!("completion queue: {e}"))?;
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_max_send_wr(depth.max(1))
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| format!("queue pair: {e}"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite,
            );
        qp.modify(&attr)
            .map_err(|e| format!("queue pair to INIT: {e}"))?;
        let local = RdmaPeer {
            lid: self.lid,
            gid: self.gid.raw,
            qpn: qp.qp_number(),
            psn: rand_psn(),
            mtu: self.mtu as u32 as u8,
        };
        Ok(Queue {
            qp,
            cq,
            local,
            in_flight: 0,
        })
    }
}

/// The GID to use on `port`: on Ethernet (RoCE) a RoCE v2 one that is not
/// link-local (routable between hosts), else any that is set; on
/// InfiniBand the port's first.
fn pick_gid(ctx: &DeviceContext, port: u8, ethernet: bool) -> Result<u32, String> {
    if !ethernet {
        return Ok(0);
    }
    let table = ctx.query_gid_table().map_err(|e| e.to_string())?;
    let on_port: Vec<_> = table
        .iter()
        .filter(|g| g.port_num() == port as u32 && !g.gid().is_zero())
        .collect();
    on_port
        .iter()
        .find(|g| g.gid_type() == GidType::RoceV2 && !g.gid().is_unicast_link_local())
        .or_else(|| on_port.first())
        .map(|g| g.gid_index())
        .ok_or_else(|| format!("no GID set on port {port} (is an IP address configured?)"))
}

fn rand_psn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (nanos ^ std::process::id().rotate_left(12)) & 0xFF_FFFF
}

/// One RDMA operation: `len` bytes between local memory (registered, `lkey`)
/// and a peer's (`rkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub id: u64,
    pub write: bool,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u32,
}

/// A reliable-connected queue pair and its completion queue.
pub struct Queue {
    // Destroyed before the completion queue it reports to.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    /// What the peer needs to connect to this queue pair.
    pub local: RdmaPeer,
    in_flight: usize,
}

impl Queue {
    /// Connects to the peer's queue pair: ready to receive, then to send.
    pub fn connect(&mut self, nic: &Nic, peer: &RdmaPeer) -> Result<(), String> {
        let mtu = Mtu::from(u32::from(peer.mtu.min(self.local.mtu)));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(nic.read_depth)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid)
            .setup_port(nic.port)
            .setup_service_level(0);
        let gid = Gid { raw: peer.gid };
        if !gid.is_zero() {
            ah.setup_grh_src_gid_index(nic.gid_index)
                .setup_grh_dest_gid(&gid)
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| format!("queue pair to RTR: {e}"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(nic.read_depth);
        self.qp
            .modify(&attr)
            .map_err(|e| format!("queue pair to RTS: {e}"))
    }

    /// Posts `ops`, each signaled.
    ///
    /// # Safety
    ///
    /// Each op's local bytes must be registered under its `lkey` and stay
    /// allocated (and, for reads, untouched) until its completion is polled
    /// or the queue pair is dropped.
    pub unsafe fn post(&mut self, ops: &[Op]) -> Result<(), String> {
        let mut guard = self.qp.start_post_send();
        for op in ops {
            let wr = guard.construct_wr(op.id, WorkRequestFlags::Signaled);
            let wr = if op.write {
                wr.setup_write(op.rkey, op.remote)
            } else {
                wr.setup_read(op.rkey, op.remote)
            };
            // SAFETY: the caller's promise above.
            unsafe { wr.setup_sge(op.lkey, op.local, op.len) };
        }
        guard
            .post()
            .map_err(|e| format!("posting {} ops: {e}", ops.len()))?;
        self.in_flight += ops.len();
        Ok(())
    }

    /// Work requests posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Completions ready now: the ids of those that succeeded; an error
    /// for the first that failed (the queue pair is then unusable).
    pub fn poll(&mut self, done: &mut Vec<u64>) -> Result<(), String> {
        let poller = match self.cq.start_poll() {
            Ok(poller) => poller,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
            Err(err) => return Err(format!("polling completions: {err}")),
        };
        for wc in poller {
            self.in_flight = self.in_flight.saturating_sub(1);
            if wc.status() != 0 {
                return Err(format!(
                    "RDMA op {} failed: status {} (vendor error {:#x})",
                    wc.wr_id(),
                    wc.status(),
                    wc.vendor_err()
                ));
            }
            done.push(wc.wr_id());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a NIC (these build machines) opening one fails with one
    /// line saying why. With one (MOONCAKE_EXPECT_RDMA=1), two queue pairs
    /// connected to each other move bytes with one-sided writes and reads.
    #[test]
    fn two_queue_pairs_write_and_read_each_others_memory_where_a_nic_exists() {
        let expect = std::env::var("MOONCAKE_EXPECT_RDMA").is_ok_and(|v| v == "1");
        let nic = match Nic::open(&NicChoice::default()) {
            Ok(nic) => nic,
            Err(why) => {
                assert!(!expect, "{why}");
                assert!(why.starts_with("no RDMA"), "{why}");
                assert!(!why.contains('\n'), "{why}");
                return;
            }
        };
        assert!(expect, "a NIC was found: set MOONCAKE_EXPECT_RDMA=1 here");
        let mut a = nic.queue(8).unwrap();
        let mut b = nic.queue(8).unwrap();
        let (la, lb) = (a.local, b.local);
        a.connect(&nic, &lb).unwrap();
        b.connect(&nic, &la).unwrap();
        let mut mine: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let mut theirs = vec![0u8; 8192];
        // SAFETY: both buffers outlive the regions and the queue pairs
        // (dropped at the end of the test, after every completion).
        let mr_mine = unsafe { nic.register(mine.as_mut_ptr(), mine.len(), false) }.unwrap();
        let mr_theirs = unsafe { nic.register(theirs.as_mut_ptr(), theirs.len(), true) }.unwrap();
        let remote = theirs.as_ptr() as u64;
        let op = |id, write, local: u64, remote: u64| Op {
            id,
            write,
            local,
            lkey: mr_mine.lkey(),
            remote,
            rkey: mr_theirs.rkey(),
            len: 4096,
        };
        // Write my bytes into the second half of theirs, then read them
        // back over my own.
        unsafe { a.post(&[op(1, true, mine.as_ptr() as u64, remote + 4096)]) }.unwrap();
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while done.is_empty() && std::time::Instant::now() < deadline {
            a.poll(&mut done).unwrap();
        }
        assert_eq!(done, vec![1]);
        assert_eq!(&theirs[4096..], &mine[..]);
        let expected = mine.clone();
        mine.fill(0);
        unsafe { a.post(&[op(2, false, mine.as_ptr() as u64, remote + 4096)]) }.unwrap();
        done.clear();
        while done.is_empty() && std::time::Instant::now() < deadline {
            a.poll(&mut done).unwrap();
        }
        assert_eq!(done, vec![2]);
        assert_eq!(mine, expected);
    }
}
