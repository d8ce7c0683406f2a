//! The client's RDMA data path to one daemon. A lane is one TCP control
//! connection to the daemon's RDMA port plus one queue pair connected to a
//! queue pair the daemon made for it, and a registered staging buffer.
//! A get leases its blocks on the control connection (`ShmGet`: where each
//! lies in the pool, kept in place until released), reads them with
//! one-sided RDMA reads into the staging buffer, copies them into the
//! caller's buffers checking each against its checksum, and ends the
//! leases. A put reserves room (`ShmPut`), writes the bytes there with
//! RDMA writes, and has the daemon verify and store them (`ShmCommit`).
//! The daemon's CPU touches no block byte either way.
//!
//! Blocks larger than the staging buffer move in several rounds. Blocks
//! the daemon holds only on NVMe answer `Missing`: the caller reads those
//! over TCP or QUIC.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use mooncake_proto::message::{
    Body, KeyRequest, RdmaAccept, ShmCommitRequest, ShmLease, ShmPutRequest, ShmRelease, ShmSlot,
};
use mooncake_proto::transport::TransportKind;
use mooncake_proto::{BlockKey, ErrorCode, Namespace, Opcode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::transport::outbox::Outbox;
use crate::transport::{answer, push_frame, GetItem, PutItem, Read, Transport, Written};
use crate::{ClientError, ErrorSource};
use mooncake_net::rdma::nic::{MemoryRegion, Nic, Op, Queue};
use mooncake_net::rdma::regions::RemotePool;
use mooncake_net::rdma::Registered;

/// Bytes of one lane's staging buffer (registered, so pinned): at most
/// `MAX_LANES` x 16 MiB per daemon this client talks to.
pub const STAGING: usize = 16 << 20;
/// Lanes to one daemon, at most: calls beyond wait for one.
const MAX_LANES: usize = 4;
/// Work requests one queue pair keeps posted at once.
const DEPTH: u32 = 64;
/// How long a daemon whose RDMA failed is reached by the other paths
/// before RDMA is tried again.
const BACKOFF: Duration = Duration::from_secs(1);

/// Part of one block moved in one round: its bytes `skip..skip + len`,
/// staged at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub item: usize,
    pub skip: u64,
    pub len: u64,
    pub at: u64,
}

/// Splits blocks of `sizes` bytes into rounds that each fit a staging
/// buffer of `staging` bytes: whole blocks where they fit, in order; a
/// block larger than the buffer in buffer-sized pieces, one per round.
pub fn plan(sizes: &[u64], staging: u64) -> Vec<Vec<Piece>> {
    let mut rounds: Vec<Vec<Piece>> = Vec::new();
    let mut round = Vec::new();
    let mut fill = 0u64;
    for (item, &size) in sizes.iter().enumerate() {
        let mut skip = 0;
        while skip < size || (size == 0 && skip == 0) {
            let len = (size - skip).min(staging);
            if fill + len > staging && !round.is_empty() {
                rounds.push(std::mem::take(&mut round));
                fill = 0;
            }
            round.push(Piece {
                item,
                skip,
                len,
                at: fill,
            });
            fill += len;
            skip += len;
            if size == 0 {
                break;
            }
        }
    }
    if !round.is_empty() {
        rounds.push(round);
    }
    rounds
}

/// Anonymous memory for a staging buffer, registered with the NIC.
struct Staging {
    /// Deregistered (dropped) before the memory is unmapped.
    mr: Option<Arc<MemoryRegion>>,
    lkey: u32,
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is used by one lane at a time (lanes are taken whole).
unsafe impl Send for Staging {}
unsafe impl Sync for Staging {}

impl Staging {
    fn new(nic: &Nic, len: usize) -> io::Result<Staging> {
        // SAFETY: a fresh private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("a null mapping"))?;
        let mut staging = Staging {
            mr: None,
            lkey: 0,
            ptr,
            len,
        };
        // SAFETY: the mapping outlives the region (see `Drop`).
        let mr = unsafe { nic.register(ptr.as_ptr(), len, false) }.map_err(io::Error::other)?;
        staging.lkey = mr.lkey();
        staging.mr = Some(mr);
        Ok(staging)
    }

    fn addr(&self, at: u64) -> u64 {
        self.ptr.as_ptr() as u64 + at
    }

    /// `len` staged bytes at `at`.
    ///
    /// # Safety
    ///
    /// No RDMA operation may be writing them.
    unsafe fn bytes(&self, at: u64, len: u64) -> &[u8] {
        assert!(at + len <= self.len as u64);
        // SAFETY: in bounds; the caller rules out concurrent writes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at as usize), len as usize) }
    }

    /// # Safety
    ///
    /// As `bytes`, and no RDMA operation may be reading them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, at: u64, len: u64) -> &mut [u8] {
        assert!(at + len <= self.len as u64);
        // SAFETY: in bounds; the caller rules out concurrent access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(at as usize), len as usize) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: the region over these bytes is gone, and the queue pair
        // that used it was destroyed before (field order in `Lane`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One control connection, queue pair and staging buffer.
struct Lane {
    conn: TcpStream,
    /// Requests sent without waiting for their answers (releases).
    owed: Vec<(Opcode, u64)>,
    next_id: u64,
    // Destroyed before the staging buffer its work requests point into.
    queue: Queue,
    staging: Staging,
    pool: RemotePool,
}

impl Lane {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Reads the answers owed from the last call; false if one failed.
    async fn settle(&mut self) -> io::Result<bool> {
        let mut fine = true;
        for (op, id) in std::mem::take(&mut self.owed) {
            fine &= answer(&mut self.conn, op, id).await?.0 == ErrorCode::Ok;
        }
        Ok(fine)
    }

    /// Posts `ops` (at most `DEPTH` in flight) and waits for all of them.
    async fn run(&mut self, ops: &[Op]) -> io::Result<()> {
        let (mut next, mut completed, mut idle) = (0, 0, 0u32);
        let mut done = Vec::new();
        while completed < ops.len() {
            let room = (DEPTH as usize).saturating_sub(self.queue.in_flight());
            if next < ops.len() && room > 0 {
                let end = (next + room).min(ops.len());
                // SAFETY: every op's local bytes are in this lane's
                // staging buffer (registered under its key), which lives
                // as long as the queue pair, or in a caller's registered
                // buffer that the call borrows exclusively (and whose
                // region it holds); nothing else touches them until `run`
                // returns, and if the call is dropped first the queue pair
                // is destroyed before the borrow ends.
                unsafe { self.queue.post(&ops[next..end]) }.map_err(io::Error::other)?;
                next = end;
            }
            done.clear();
            self.queue.poll(&mut done).map_err(io::Error::other)?;
            completed += done.len();
            if done.is_empty() {
                // Completions come in microseconds: spin on the runtime
                // first, then sleep a little (the caller's deadline bounds
                // the whole call).
                idle += 1;
                if idle < 256 {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(Duration::from_micros(50)).await;
                }
            } else {
                idle = 0;
            }
        }
        Ok(())
    }

    /// The RDMA operations moving `pieces` between the staging buffer and
    /// the pool bytes at `offsets` (of each piece's block).
    fn ops(&self, pieces: &[Piece], offsets: &[u64], write: bool) -> io::Result<Vec<Op>> {
        let mut ops = Vec::with_capacity(pieces.len());
        for p in pieces {
            let spans = self
                .pool
                .spans(offsets[p.item] + p.skip, p.len)
                .map_err(io::Error::other)?;
            for s in spans {
                ops.push(Op {
                    id: ops.len() as u64,
                    write,
                    local: self.staging.addr(p.at + s.skip),
                    lkey: self.staging.lkey,
                    remote: s.addr,
                    rkey: s.rkey,
                    len: s.len,
                });
            }
        }
        Ok(ops)
    }
}

impl Lane {
    /// The RDMA operations moving whole blocks straight between registered
    /// caller memory and the pool: `(local address, its key, pool offset,
    /// length)` each.
    fn direct_ops(&self, blocks: &[(u64, u32, u64, u64)], write: bool) -> io::Result<Vec<Op>> {
        let mut ops = Vec::with_capacity(blocks.len());
        for &(local, lkey, offset, len) in blocks {
            for s in self.pool.spans(offset, len).map_err(io::Error::other)? {
                ops.push(Op {
                    id: ops.len() as u64,
                    write,
                    local: local + s.skip,
                    lkey,
                    remote: s.addr,
                    rkey: s.rkey,
                    len: s.len,
                });
            }
        }
        Ok(ops)
    }
}

/// The RDMA data path to one daemon.
pub struct RdmaLink {
    nic: Arc<Nic>,
    /// The daemon's RDMA control address.
    control: String,
    /// Its TCP address, which it must confirm.
    addr: String,
    connect_timeout: Duration,
    idle: parking_lot::Mutex<Vec<Lane>>,
    lanes: tokio::sync::Semaphore,
    down_until: parking_lot::Mutex<Option<Instant>>,
    /// Caller memory read into and written from directly.
    registered: Arc<Registered>,
}

impl RdmaLink {
    pub fn new(
        nic: Arc<Nic>,
        control: String,
        addr: String,
        connect_timeout: Duration,
        registered: Arc<Registered>,
    ) -> Self {
        RdmaLink {
            registered,
            nic,
            control,
            addr,
            connect_timeout,
            idle: parking_lot::Mutex::new(Vec::new()),
            lanes: tokio::sync::Semaphore::new(MAX_LANES),
            down_until: parking_lot::Mutex::new(None),
        }
    }

    /// Connects a new lane: a queue pair and staging buffer here, the
    /// daemon's queue pair and pool regions in exchange.
    async fn connect(&self) -> io::Result<Lane> {
        let conn = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.control))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        conn.set_nodelay(true)?;
        let queue = self.nic.queue(DEPTH).map_err(io::Error::other)?;
        let staging = Staging::new(&self.nic, STAGING)?;
        let mut conn = conn;
        let mut frames = Vec::new();
        push_frame(&mut frames, Opcode::RdmaConnect, 1, &queue.local.to_bytes());
        conn.write_all(&frames).await?;
        let (status, body) = answer(&mut conn, Opcode::RdmaConnect, 1).await?;
        if status != ErrorCode::Ok {
            return Err(io::Error::other(format!(
                "the daemon refused RDMA: {status:?}"
            )));
        }
        let accept = RdmaAccept::from_bytes(&body).map_err(io::Error::other)?;
        if accept.addr != self.addr {
            return Err(io::Error::other(format!(
                "{} serves the daemon at {}, not {}",
                self.control, accept.addr, self.addr
            )));
        }
        let pool = RemotePool::new(accept.regions).map_err(io::Error::other)?;
        let mut lane = Lane {
            conn,
            owed: Vec::new(),
            next_id: 1,
            queue,
            staging,
            pool,
        };
        lane.queue
            .connect(&self.nic, &accept.peer)
            .map_err(io::Error::other)?;
        Ok(lane)
    }

    /// A lane for one call: an idle one, or a new one.
    async fn lane(&self) -> io::Result<(Lane, tokio::sync::SemaphorePermit<'_>)> {
        if self.down_until.lock().is_some_and(|t| Instant::now() < t) {
            return Err(io::Error::other(
                "RDMA to this daemon failed under a second ago",
            ));
        }
        let permit = self.lanes.acquire().await.map_err(io::Error::other)?;
        let idle = self.idle.lock().pop();
        if let Some(mut lane) = idle {
            if lane.settle().await? {
                return Ok((lane, permit));
            }
        }
        match self.connect().await {
            Ok(lane) => Ok((lane, permit)),
            Err(err) => {
                *self.down_until.lock() = Some(Instant::now() + BACKOFF);
                Err(err)
            }
        }
    }

    fn put_back(&self, lane: Lane) {
        self.idle.lock().push(lane);
    }

    async fn get_blocks(
        &self,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> io::Result<Vec<Read>> {
        let (mut lane, _permit) = self.lane().await?;
        let mut outbox = Outbox::default();
        let first = lane.next_id + 1;
        for it in items.iter() {
            let body = KeyRequest {
                key: BlockKey::new(namespace.clone(), it.hash),
            }
            .to_bytes();
            let id = lane.id();
            outbox.push(Opcode::ShmGet, id, &body);
        }
        let mut out = vec![Read::Missing; items.len()];
        // The leased blocks to read: (item, lease).
        let mut leased: Vec<(usize, ShmLease)> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            outbox.before_answer(&mut lane.conn, i).await?;
            let (status, body) = answer(&mut lane.conn, Opcode::ShmGet, first + i as u64).await?;
            match status {
                ErrorCode::Ok => {
                    let lease = ShmLease::from_bytes(&body).map_err(io::Error::other)?;
                    if lease.len as usize > it.buf.len() {
                        out[i] = Read::Failed(ErrorCode::TooLarge);
                    }
                    leased.push((i, lease));
                }
                ErrorCode::NotFound => {}
                other => out[i] = Read::Failed(other),
            }
        }
        // Blocks whose buffers are registered (and in one piece) land
        // there directly; the others go through the staging buffer.
        let mut direct = Vec::new();
        let mut reading: Vec<&(usize, ShmLease)> = Vec::new();
        for entry @ (i, lease) in leased.iter().filter(|(i, _)| out[*i] == Read::Missing) {
            let len = lease.len as usize;
            let found = items[*i]
                .buf
                .contiguous(len)
                .and_then(|buf| Some((buf.as_mut_ptr() as u64, self.registered.find(buf)?)));
            match found {
                Some((local, mr)) => direct.push((entry, local, mr)),
                None => reading.push(entry),
            }
        }
        if !direct.is_empty() {
            let blocks: Vec<(u64, u32, u64, u64)> = direct
                .iter()
                .map(|((_, lease), local, mr)| (*local, mr.lkey(), lease.offset, lease.len as u64))
                .collect();
            let ops = lane.direct_ops(&blocks, false)?;
            lane.run(&ops).await?;
            for ((i, lease), _, _) in &direct {
                let sum = items[*i].buf.checksum(lease.len as usize);
                out[*i] = Read::of_lease(lease, sum, &items[*i]);
            }
        }
        let sizes: Vec<u64> = reading.iter().map(|(_, l)| l.len as u64).collect();
        let offsets: Vec<u64> = reading.iter().map(|(_, l)| l.offset).collect();
        // Bytes of each block copied so far, for blocks read in pieces.
        let mut copied = vec![0u64; reading.len()];
        for round in plan(&sizes, STAGING as u64) {
            let ops = lane.ops(&round, &offsets, false)?;
            lane.run(&ops).await?;
            for p in &round {
                let (i, lease) = reading[p.item];
                // SAFETY: every read of this round has completed.
                let src = unsafe { lane.staging.bytes(p.at, p.len) };
                if p.len == lease.len as u64 {
                    let sum = items[*i].buf.copy_with_checksum(src);
                    out[*i] = Read::of_lease(lease, sum, &items[*i]);
                } else {
                    items[*i].buf.write_at(p.skip as usize, src);
                    copied[p.item] += p.len;
                    if copied[p.item] == lease.len as u64 {
                        let sum = items[*i].buf.checksum(lease.len as usize);
                        out[*i] = Read::of_lease(lease, sum, &items[*i]);
                    }
                }
            }
        }
        if !leased.is_empty() {
            let body = ShmRelease {
                leases: leased.iter().map(|(_, l)| l.lease).collect(),
            }
            .to_bytes();
            let id = lane.id();
            outbox.push(Opcode::ShmRelease, id, &body);
            outbox.flush(&mut lane.conn).await?;
            lane.owed.push((Opcode::ShmRelease, id));
        }
        self.put_back(lane);
        Ok(out)
    }

    async fn put_blocks(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> io::Result<Vec<Written>> {
        let (mut lane, _permit) = self.lane().await?;
        let mut outbox = Outbox::default();
        let first = lane.next_id + 1;
        // The daemon checks the bytes against these at commit.
        let sums: Vec<u64> = items.iter().map(PutItem::sum).collect();
        for (it, &sum) in items.iter().zip(&sums) {
            let body = ShmPutRequest {
                key: BlockKey::new(namespace.clone(), it.hash),
                len: it.value.len() as u64,
                checksum: Some(sum),
                parent: it.parent,
                continues: it.continues,
                tag: it.tag.clone(),
            }
            .to_bytes();
            let id = lane.id();
            outbox.push(Opcode::ShmPut, id, &body);
        }
        let mut codes = vec![ErrorCode::Ok; items.len()];
        let mut reserved: Vec<(usize, ShmSlot)> = Vec::new();
        for (i, code) in codes.iter_mut().enumerate() {
            outbox.before_answer(&mut lane.conn, i).await?;
            let (status, body) = answer(&mut lane.conn, Opcode::ShmPut, first + i as u64).await?;
            match status {
                ErrorCode::Ok => {
                    reserved.push((i, ShmSlot::from_bytes(&body).map_err(io::Error::other)?))
                }
                other => *code = other,
            }
        }
        // Values in registered memory are written from there directly (the
        // region held until the writes complete); the others are staged.
        let mut direct = Vec::new();
        let mut staged = Vec::new();
        let mut held = Vec::new();
        let mut blocks = Vec::new();
        for entry @ (i, slot) in &reserved {
            let one = items[*i].value.contiguous();
            match one.and_then(|value| Some((value, self.registered.find(value)?))) {
                Some((value, mr)) => {
                    blocks.push((
                        value.as_ptr() as u64,
                        mr.lkey(),
                        slot.offset,
                        value.len() as u64,
                    ));
                    held.push(mr);
                    direct.push(entry);
                }
                None => staged.push(entry),
            }
        }
        let reserved = staged;
        let ops = lane.direct_ops(&blocks, true)?;
        lane.run(&ops).await?;
        drop(held);
        let sizes: Vec<u64> = reserved
            .iter()
            .map(|(i, _)| items[*i].value.len() as u64)
            .collect();
        let offsets: Vec<u64> = reserved.iter().map(|(_, s)| s.offset).collect();
        for round in plan(&sizes, STAGING as u64) {
            for p in &round {
                let value = items[reserved[p.item].0].value;
                // SAFETY: no operation of this lane is in flight.
                let dst = unsafe { lane.staging.bytes_mut(p.at, p.len) };
                value.copy_to(p.skip as usize, dst);
            }
            let ops = lane.ops(&round, &offsets, true)?;
            lane.run(&ops).await?;
        }
        let mut commits = Outbox::default();
        let first = lane.next_id + 1;
        let committing: Vec<(usize, ShmSlot)> =
            direct.iter().chain(&reserved).map(|e| **e).collect();
        for (_, slot) in &committing {
            let id = lane.id();
            let commit = ShmCommitRequest {
                slot: slot.slot,
                checksum: None,
            };
            commits.push(Opcode::ShmCommit, id, &commit.to_bytes());
        }
        for (k, (i, _)) in committing.iter().enumerate() {
            commits.before_answer(&mut lane.conn, k).await?;
            codes[*i] = answer(&mut lane.conn, Opcode::ShmCommit, first + k as u64)
                .await?
                .0;
        }
        self.put_back(lane);
        Ok(codes
            .into_iter()
            .zip(sums)
            .map(|(code, checksum)| Written { code, checksum })
            .collect())
    }

    fn error(&self, err: io::Error) -> ClientError {
        ClientError::Io {
            side: ErrorSource::Daemon,
            addr: self.control.clone(),
            err,
        }
    }
}

impl Transport for RdmaLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn get<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a mut [GetItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Read>, ClientError>> {
        Box::pin(async move {
            let result = self.get_blocks(namespace, items).await;
            result.map_err(|err| self.error(err))
        })
    }

    fn put<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a [PutItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Written>, ClientError>> {
        Box::pin(async move {
            let result = self.put_blocks(namespace, items).await;
            result.map_err(|err| self.error(err))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn whole_blocks_share_a_round_until_the_buffer_is_full() {
        let rounds = plan(&[4, 4, 4], 10);
        assert_eq!(
            rounds,
            vec![
                vec![
                    Piece {
                        item: 0,
                        skip: 0,
                        len: 4,
                        at: 0
                    },
                    Piece {
                        item: 1,
                        skip: 0,
                        len: 4,
                        at: 4
                    },
                ],
                vec![Piece {
                    item: 2,
                    skip: 0,
                    len: 4,
                    at: 0
                }],
            ]
        );
    }

    #[test]
    fn a_block_larger_than_the_buffer_moves_in_pieces() {
        let rounds = plan(&[25], 10);
        let pieces: Vec<(u64, u64)> = rounds.iter().flatten().map(|p| (p.skip, p.len)).collect();
        assert_eq!(pieces, vec![(0, 10), (10, 10), (20, 5)]);
        assert!(rounds.iter().all(|r| r.len() == 1 && r[0].at == 0));
    }

    proptest! {
        /// Every byte of every block is moved exactly once, in order per
        /// block, and no round overflows the buffer or overlaps itself.
        #[test]
        fn rounds_cover_every_block_once_within_the_buffer(
            sizes in proptest::collection::vec(0u64..100, 0..20),
            staging in 1u64..64,
        ) {
            let rounds = plan(&sizes, staging);
            let mut next = vec![0u64; sizes.len()];
            let mut seen = vec![false; sizes.len()];
            for round in &rounds {
                prop_assert!(!round.is_empty());
                let mut fill = 0;
                for p in round {
                    prop_assert_eq!(p.at, fill);
                    prop_assert_eq!(p.skip, next[p.item]);
                    next[p.item] += p.len;
                    seen[p.item] = true;
                    fill += p.len;
                }
                prop_assert!(fill <= staging);
            }
            prop_assert_eq!(next, sizes);
            prop_assert!(seen.iter().all(|s| *s));
        }
    }
}
