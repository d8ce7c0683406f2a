//! RDMA for the daemon (feature `rdma`). The DRAM pool is registered with
//! the NIC once (one region, or several where the NIC limits a region's
//! size). On the RDMA control port each client connection brings a queue
//! pair (`RdmaConnect`): the daemon makes one of its own for it, connects
//! the two, and answers with the pool's regions; the connection then
//! carries the client's leases and reservations (`leases`) while the
//! client moves block bytes itself, with one-sided reads and writes that
//! the daemon's CPU never touches. The queue pair lives as long as the
//! connection.
//!
//! Where this host has no RDMA NIC the daemon says why, in one line, and
//! serves TCP (and QUIC) only: clients then use those.

use std::io;
use std::sync::Arc;

use mooncake_net::rdma::regions::split;
use mooncake_net::rdma::{MemoryRegion, Nic, NicChoice};
use mooncake_proto::message::{Body, RdmaAccept, RdmaPeer, RdmaRegion, MAX_RDMA_REGIONS};
use mooncake_proto::{ErrorCode, Header, Opcode, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::tiers::Tiers;

/// Work requests a daemon's queue pair has room for: it posts none itself
/// (clients read and write its memory), so one each way.
const QUEUE_DEPTH: u32 = 1;
/// Longest a client may take to send its queue pair once connected.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(5);

/// The pool registered with this host's NIC.
pub(crate) struct RdmaPool {
    nic: Arc<Nic>,
    regions: Vec<RdmaRegion>,
    // Deregistered before `tiers` (and with it the pool's memory) can go.
    _registered: Vec<Arc<MemoryRegion>>,
    tiers: Arc<Tiers>,
}

impl RdmaPool {
    /// Registers the DRAM pool of `tiers` with the NIC `choice` names; an
    /// error in one line if there is no usable NIC.
    pub fn register(tiers: &Arc<Tiers>, choice: &NicChoice) -> Result<RdmaPool, String> {
        let nic = Nic::open(choice)?;
        let (base, len) = tiers.dram.memory();
        let pieces = split(len as u64, nic.max_region);
        if pieces.len() > MAX_RDMA_REGIONS {
            return Err(format!(
                "{} registers at most {} bytes a region: a pool of {len} bytes needs {} regions (at most {MAX_RDMA_REGIONS})",
                nic.name,
                nic.max_region,
                pieces.len()
            ));
        }
        let mut regions = Vec::new();
        let mut registered = Vec::new();
        for (offset, piece) in pieces {
            // SAFETY: the piece lies in the pool's memory, which `tiers`
            // (held below, dropped after the regions) keeps mapped.
            let ptr = unsafe { base.as_ptr().add(offset as usize) };
            let mr = unsafe { nic.register(ptr, piece as usize, true) }?;
            regions.push(RdmaRegion {
                offset,
                len: piece,
                addr: mr.get_ptr() as u64,
                rkey: mr.rkey(),
            });
            registered.push(mr);
        }
        Ok(RdmaPool {
            nic,
            regions,
            _registered: registered,
            tiers: tiers.clone(),
        })
    }

    /// The NIC's name, for logs.
    pub fn nic(&self) -> &str {
        &self.nic.name
    }
}

/// Serves RDMA clients on `listener` until `shutdown`.
pub(crate) async fn run(
    listener: TcpListener,
    pool: Arc<RdmaPool>,
    advertise: String,
    max_connections: usize,
    sessions: prometheus::IntGauge,
    (tasks, shutdown): (TaskTracker, CancellationToken),
) {
    // Each connection holds a queue pair on the NIC: bounded.
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(err) => {
                    tracing::warn!(%err, "RDMA control accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(max_connections, "RDMA connection refused: at the limit");
            continue;
        };
        let (pool, advertise, shutdown) = (pool.clone(), advertise.clone(), shutdown.clone());
        let sessions = sessions.clone();
        tasks.spawn(async move {
            let _slot = slot;
            if let Err(err) = serve(stream, &pool, &advertise, &sessions, &shutdown).await {
                tracing::debug!(%err, "RDMA client gone");
            }
        });
    }
}

async fn serve(
    mut stream: TcpStream,
    pool: &RdmaPool,
    advertise: &str,
    sessions: &prometheus::IntGauge,
    shutdown: &CancellationToken,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (header, peer) = match tokio::time::timeout(HANDSHAKE, hello(&mut stream)).await {
        Ok(Ok(hello)) => hello,
        Ok(Err((raw, code, err))) => {
            stream
                .write_all(&Header::error_reply(&raw, code as u16))
                .await?;
            return Err(err);
        }
        Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "no RdmaConnect")),
    };
    // This connection's queue pair: dropped (destroyed) when it ends.
    let mut queue = pool.nic.queue(QUEUE_DEPTH).map_err(io::Error::other)?;
    let answer = match queue.connect(&pool.nic, &peer) {
        Ok(()) => Ok(RdmaAccept {
            peer: queue.local,
            regions: pool.regions.clone(),
            addr: advertise.to_string(),
        }
        .to_bytes()),
        Err(why) => Err(why),
    };
    let (code, body) = match &answer {
        Ok(body) => (ErrorCode::Ok, body.as_slice()),
        Err(_) => (ErrorCode::Internal, &[][..]),
    };
    let h = Header::response(
        Opcode::RdmaConnect,
        header.request_id,
        code as u16,
        body.len() as u32,
    );
    stream.write_all(&h.encode()).await?;
    stream.write_all(body).await?;
    if let Err(why) = answer {
        return Err(io::Error::other(why));
    }
    crate::leases::serve(&mut stream, &pool.tiers, (None, None), sessions, shutdown).await
}

/// Reads the client's `RdmaConnect`; on a bad one, the header to answer
/// and why.
async fn hello(
    stream: &mut TcpStream,
) -> Result<(Header, RdmaPeer), ([u8; HEADER_LEN], ErrorCode, io::Error)> {
    let mut raw = [0u8; HEADER_LEN];
    let io_err = |raw, err: io::Error| (raw, ErrorCode::Internal, err);
    stream
        .read_exact(&mut raw)
        .await
        .map_err(|e| io_err(raw, e))?;
    let header = match Header::parse(&raw) {
        Ok(Some(h)) if !h.response && h.opcode == Opcode::RdmaConnect => h,
        Ok(_) => {
            return Err((
                raw,
                ErrorCode::UnknownOpcode,
                io::Error::other("the first request was not RdmaConnect"),
            ))
        }
        Err(err) => return Err((raw, err.code(), io::Error::other(err))),
    };
    let mut body = vec![0u8; header.body_len as usize];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| io_err(raw, e))?;
    match RdmaPeer::from_bytes(&body) {
        Ok(peer) => Ok((header, peer)),
        Err(err) => Err((raw, err.code(), io::Error::other(err))),
    }
}

#[cfg(test)]
mod tests {
    use mooncake_client::transport::rdma::RdmaLink;
    use mooncake_client::transport::{GetItem, PutItem, Read, Transport, Written};
    use mooncake_net::rdma::Registered;
    use mooncake_proto::checksum::checksum;
    use mooncake_proto::message::Location;
    use mooncake_proto::transport::TransportKind;
    use mooncake_proto::units::ByteSize;
    use mooncake_proto::{BlockHash, ErrorCode, Namespace};

    use super::*;
    use crate::DaemonConfig;

    /// On a host without an RDMA NIC (these build machines: the kernel has
    /// no RDMA support) a daemon asked to serve RDMA starts, serves TCP,
    /// and advertises no RDMA endpoint. On a host with one (run with
    /// MOONCAKE_EXPECT_RDMA=1) it advertises its control port, and a
    /// client's one-sided writes and reads move blocks byte for byte,
    /// including one larger than the client's staging buffer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_serves_blocks_where_a_nic_exists_and_tcp_only_where_none() {
        let cfg = DaemonConfig {
            dram: ByteSize(128 << 20),
            max_block: ByteSize(64 << 20),
            hugepages: false,
            prefault: false,
            rdma_listen: Some("127.0.0.1:0".into()),
            ..DaemonConfig::default()
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stop = CancellationToken::new();
        let registry = prometheus::Registry::new();
        let daemon = crate::start(cfg, listener, None, &registry, stop.clone())
            .await
            .unwrap();
        let expect = std::env::var("MOONCAKE_EXPECT_RDMA").is_ok_and(|v| v == "1");
        let endpoint = daemon
            .endpoints
            .iter()
            .find(|e| e.kind == TransportKind::Rdma);
        assert_eq!(endpoint.is_some(), expect, "{:?}", daemon.endpoints);
        // TCP serves either way.
        assert!(TcpStream::connect(daemon.addr).await.is_ok());
        let Some(endpoint) = endpoint else {
            stop.cancel();
            return;
        };
        let nic = Nic::open(&NicChoice::default()).unwrap();
        let link = RdmaLink::new(
            nic.clone(),
            endpoint.addr.clone(),
            daemon.addr.to_string(),
            std::time::Duration::from_secs(1),
            Default::default(),
        );
        let ns = Namespace::new("rdma").unwrap();
        let sizes = [1000usize, 256 << 10, 40 << 20];
        let values: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, n)| (0..*n).map(|i| (i * 31 + k) as u8).collect())
            .collect();
        let puts: Vec<PutItem<'_>> = values
            .iter()
            .enumerate()
            .map(|(k, v)| PutItem {
                index: k,
                hash: BlockHash([k as u8 + 1; 32]),
                value: v.as_slice().into(),
                // The first one's is computed by the transport.
                checksum: (k > 0).then(|| checksum(v)),
                parent: None,
                continues: false,
                tag: None,
            })
            .collect();
        let written = link.put(&ns, &puts).await.unwrap();
        let stored: Vec<_> = values
            .iter()
            .map(|v| Written {
                code: ErrorCode::Ok,
                checksum: checksum(v),
            })
            .collect();
        assert_eq!(written, stored);
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0u8; *n]).collect();
        let mut gets: Vec<GetItem<'_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(k, buf)| GetItem {
                index: k,
                hash: BlockHash([k as u8 + 1; 32]),
                location: Location::on(0, values[k].len() as u32, checksum(&values[k])),
                buf: buf.as_mut_slice().into(),
            })
            .collect();
        let reads = link.get(&ns, &mut gets).await.unwrap();
        drop(gets);
        for (k, read) in reads.iter().enumerate() {
            assert_eq!(*read, Read::Hit(sizes[k]));
            assert!(bufs[k] == values[k], "block {k} differs");
        }

        // Registered memory: written from and read into with no staging.
        let registered = Arc::new(Registered::default());
        let mut memory: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        // SAFETY: `memory` outlives the registration and every call below.
        unsafe { registered.add(&nic, memory.as_mut_ptr(), memory.len()) }.unwrap();
        let direct = RdmaLink::new(
            nic,
            endpoint.addr.clone(),
            daemon.addr.to_string(),
            std::time::Duration::from_secs(1),
            registered.clone(),
        );
        let (value, _) = memory.split_at(1 << 20);
        let sum = checksum(value);
        let put = [PutItem {
            index: 0,
            hash: BlockHash([9; 32]),
            value: value.into(),
            checksum: Some(sum),
            parent: None,
            continues: false,
            tag: None,
        }];
        let stored = Written {
            code: ErrorCode::Ok,
            checksum: sum,
        };
        assert_eq!(direct.put(&ns, &put).await.unwrap(), vec![stored]);
        let expected = memory[..1 << 20].to_vec();
        let (_, into) = memory.split_at_mut(2 << 20);
        let mut get = [GetItem {
            index: 0,
            hash: BlockHash([9; 32]),
            location: Location::on(0, 1 << 20, sum),
            buf: (&mut into[..1 << 20]).into(),
        }];
        assert_eq!(
            direct.get(&ns, &mut get).await.unwrap(),
            vec![Read::Hit(1 << 20)]
        );
        assert!(memory[2 << 20..3 << 20] == expected[..]);
        assert!(registered.remove(memory.as_ptr()));
        stop.cancel();
    }
}
