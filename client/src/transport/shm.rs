//! Same-host reads: the daemon on this host shares its DRAM pool (a memfd
//! received over its Unix socket, mapped read-only here); a block is read
//! by leasing it (`ShmGet`: where its bytes are, kept in place until the
//! lease ends), copying it into the caller's buffer and checking it against
//! its checksum, then ending the leases (`ShmRelease`). No byte crosses a
//! socket. See `store/src/shm.rs` for the daemon's side.
//!
//! Faster still, with no message at all: the daemon publishes where each
//! block lies in a shared index (`mooncake_proto::shm_index`). A block
//! found there is copied at once and checked against the checksum the
//! meta service gave for it; a copy that does not match (the block moved
//! under it) is leased and copied again. Reads through the index are told
//! to the daemon afterwards, in batches (`ShmTouch`), for its LRU.
//!
//! Puts: a small block (16 KiB or less) goes with its bytes over the
//! socket (`Put`); a larger one is written into the pool, in room the
//! client holds ahead (`ShmRoom`, `ShmStore`: one round trip) or else
//! reserved for it (`ShmPut`, `ShmCommit`: two). See `put`.

use std::io::{self, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::ptr::NonNull;

use mooncake_proto::message::{
    Body, KeyRequest, PutHead, ShmCommitRequest, ShmHello, ShmLease, ShmPutRequest, ShmRelease,
    ShmSlot, ShmTouch,
};
use mooncake_proto::shm_index::{Digest, IndexTable};
use mooncake_proto::{BlockKey, ErrorCode, Header, Namespace, Opcode};
use tokio::net::UnixStream;

use futures::future::BoxFuture;
use mooncake_proto::transport::TransportKind;

use super::outbox::{Outbox, WINDOW};
use super::{answer, GetItem, PutItem, Read, Transport, Written};
use crate::{ClientError, ErrorSource};

mod device;
mod put;
pub(crate) use device::{Direct, FromDevice};

/// A mapping of a daemon's pool (read for gets, written only into room
/// the daemon reserved for a put), or of its index (read only).
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: what may be read or written when is decided by the daemon's
// leases and reservations.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `connect` mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl Mapping {
    /// Maps `len` bytes of `fd`, shared; writable if `write`.
    fn new(fd: &OwnedFd, len: usize, write: bool) -> io::Result<Mapping> {
        let prot = libc::PROT_READ | if write { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping of a memfd we were given.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(fd),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("null mapping"))?;
        Ok(Mapping { ptr, len })
    }

    /// `len` bytes at `offset`.
    ///
    /// # Safety
    /// In bounds, and not written while the slice lives (leased, or
    /// reserved for a block whose bytes are in place).
    unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }
}

/// The daemon's block index, mapped read-only.
struct Index {
    table: IndexTable,
    /// Keeps the table's memory mapped; dropped after it.
    _map: Mapping,
}

/// Idle socket connections kept to the daemon.
const MAX_IDLE: usize = 64;
/// Reads through the index told to the daemon in one message, at most.
const TOUCH_BATCH: usize = 64;
/// Bytes of a batch from which its copies out of the index are spread over
/// `copy_threads` threads (a thread costs tens of microseconds to start;
/// 8 MiB take about a millisecond to copy).
const PARALLEL_BYTES: usize = 8 << 20;
/// Longest a read through the index waits to be told to the daemon, when
/// reads keep coming.
const TOUCH_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// An idle connection, and the requests whose answers it still owes.
struct Idle {
    stream: UnixStream,
    owed: Vec<(Opcode, u64)>,
}

/// Keys read through the index and not yet told to the daemon.
struct Touches {
    keys: Vec<BlockKey>,
    since: std::time::Instant,
}

/// What a client's same-host links did, beyond the blocks each moved.
#[derive(Debug, Default)]
pub(crate) struct ShmCounts {
    /// Blocks read through the daemon's index, without a lease.
    pub index_reads: std::sync::atomic::AtomicU64,
    /// Blocks written into room held ahead (`ShmStore`, `ShmAdmit`).
    pub room_writes: std::sync::atomic::AtomicU64,
    /// Of those, blocks the daemon made visible itself (`ShmAdmit`): a put
    /// of one round trip.
    pub admitted: std::sync::atomic::AtomicU64,
}

/// The link to the daemon on this host: its pool, mapped once, and a few
/// socket connections for leases (one call at a time on each).
pub(crate) struct ShmLink {
    /// The daemon's TCP address, as block locations name it.
    pub addr: String,
    /// The pool registered with the GPU, once a get into GPU memory asked
    /// (`None`: the device refused). Declared before `map`: a registration
    /// ends before the mapping goes.
    on_device: std::sync::OnceLock<Option<crate::device::Registration>>,
    map: std::sync::Arc<Mapping>,
    /// The pool's memfd (its inode): a new connection handing another
    /// one means the daemon restarted, and this link is stale.
    pool_inode: u64,
    /// The pool's page size (2 MiB for reserved huge pages).
    page_size: u64,
    index: Option<Index>,
    /// Set once the mapping's page tables are filled (see `populate`).
    populated: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The client's counts, shared by its links over time.
    counts: std::sync::Arc<ShmCounts>,
    /// Threads copying one large batch.
    copy_threads: usize,
    /// Whether the daemon takes small puts with their bytes (`Put`), and
    /// holds room ahead for larger ones (`ShmRoom`); it does unless it
    /// refused one (a daemon of an older version).
    inline_puts: std::sync::atomic::AtomicBool,
    rooms: std::sync::atomic::AtomicBool,
    /// Whether the daemon makes blocks visible itself (`ShmAdmit`); it
    /// does unless it answered that it does not.
    admits: std::sync::atomic::AtomicBool,
    touches: parking_lot::Mutex<Touches>,
    path: std::path::PathBuf,
    /// Connections whose last call finished cleanly; one cut short (a
    /// deadline) is dropped with its call, never reused.
    idle: parking_lot::Mutex<Vec<Idle>>,
    /// Idle connections holding room in the pool for puts (`put::Writer`).
    writers: parking_lot::Mutex<Vec<put::Writer>>,
}

impl ShmLink {
    /// Connects to the daemon's socket at `path` and maps its pool and its
    /// index; what it does is counted in `counts`.
    pub fn connect(
        path: &Path,
        counts: std::sync::Arc<ShmCounts>,
        copy_threads: usize,
    ) -> io::Result<ShmLink> {
        let (stream, hello, fds) = open(path)?;
        let len = usize::try_from(hello.len).map_err(io::Error::other)?;
        let map = std::sync::Arc::new(Mapping::new(&fds[0], len, true)?);
        let (pool_inode, page_size) = inode(&fds[0])?;
        let index = match fds.get(1) {
            Some(fd) if hello.index_len > 0 => {
                let map = Mapping::new(fd, hello.index_len as usize, false)?;
                // SAFETY: a page-aligned mapping of `len` bytes, kept
                // alive with the table (`Index`).
                unsafe { IndexTable::attach(map.ptr, map.len) }
                    .map(|table| Index { table, _map: map })
            }
            _ => None,
        };
        drop(fds);
        let populated = populate(&map);
        Ok(ShmLink {
            addr: hello.addr,
            on_device: std::sync::OnceLock::new(),
            map,
            pool_inode,
            page_size,
            index,
            populated,
            counts,
            copy_threads: copy_threads.max(1),
            inline_puts: std::sync::atomic::AtomicBool::new(true),
            rooms: std::sync::atomic::AtomicBool::new(true),
            admits: std::sync::atomic::AtomicBool::new(true),
            touches: parking_lot::Mutex::new(Touches {
                keys: Vec::new(),
                since: std::time::Instant::now(),
            }),
            path: path.to_path_buf(),
            idle: parking_lot::Mutex::new(vec![Idle {
                stream,
                owed: Vec::new(),
            }]),
            writers: parking_lot::Mutex::new(Vec::new()),
        })
    }

    /// An idle connection, or a new one (its copy of the pool's descriptor
    /// is closed: the mapping is already there).
    async fn conn(&self) -> io::Result<UnixStream> {
        let idle = self.idle.lock().pop();
        if let Some(Idle { mut stream, owed }) = idle {
            // The answers to what its last call sent without waiting
            // (releases, touches): the daemon acted on them when it read
            // them; only the answers waited for the next call.
            let mut fine = true;
            for (op, id) in owed {
                fine &= answer(&mut stream, op, id).await?.0 == ErrorCode::Ok;
            }
            if fine {
                return Ok(stream);
            }
            // A release refused: closing this connection ends its leases.
        }
        let (stream, hello, fds) = open(&self.path)?;
        if hello.addr != self.addr
            || hello.len as usize != self.map.len
            || inode(&fds[0])?.0 != self.pool_inode
        {
            return Err(io::Error::other("another daemon now serves this socket"));
        }
        Ok(stream)
    }

    /// What pages this process's view of the pool has, in words.
    pub fn pages(&self) -> String {
        if self.page_size >= 2 << 20 {
            return format!("{}MiB (reserved huge pages)", self.page_size >> 20);
        }
        let small = format!("{}KiB", self.page_size >> 10);
        match huge_mapped(self.map.ptr.as_ptr() as usize) {
            Some(huge) if huge > 0 => format!(
                "{small}, {}% mapped as 2MiB transparent huge pages",
                huge * 100 / self.map.len as u64
            ),
            _ => small,
        }
    }

    /// Whether this process's view of the pool is fully set up.
    pub fn populated(&self) -> bool {
        self.populated.load(std::sync::atomic::Ordering::Acquire)
    }

    fn put_back(&self, stream: UnixStream, owed: Vec<(Opcode, u64)>) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { stream, owed });
        }
    }

    /// Reads `items` from the shared pool. Each block the index shows is
    /// copied at once; the rest, and copies that did not check out, are
    /// leased (all asked at once), copied and checked, then all leases
    /// ended. `Missing` for blocks the daemon does not hold in DRAM.
    async fn get_blocks(
        &self,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> io::Result<Vec<Read>> {
        let mut out = vec![Read::Missing; items.len()];
        let mut leased = Vec::new();
        let mut touched = Vec::new();
        let copied = self.copy_all_indexed(namespace, items);
        for (i, (item, copied)) in items.iter().zip(copied).enumerate() {
            let key = BlockKey::new(namespace.clone(), item.hash);
            match copied {
                Some(len) => {
                    out[i] = Read::Hit(len);
                    touched.push(key);
                }
                None => leased.push((i, key)),
            }
        }
        self.counts
            .index_reads
            .fetch_add(touched.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let touches = self.note_touches(touched);
        if leased.is_empty() && touches.is_empty() {
            return Ok(out);
        }
        let mut conn = self.conn().await?;
        let mut outbox = Outbox::default();
        let mut next_id = 0u64;
        let mut id = || {
            next_id += 1;
            next_id
        };
        for (_, key) in &leased {
            let body = KeyRequest { key: key.clone() }.to_bytes();
            outbox.push(Opcode::ShmGet, id(), &body);
        }
        let mut owed = Vec::new();
        for keys in touches.chunks(TOUCH_BATCH) {
            let body = ShmTouch {
                keys: keys.to_vec(),
            }
            .to_bytes();
            let id = id();
            outbox.push(Opcode::ShmTouch, id, &body);
            owed.push((Opcode::ShmTouch, id));
        }
        let mut leases = Vec::new();
        for (k, (i, _)) in leased.iter().enumerate() {
            outbox.before_answer(&mut conn, k).await?;
            let (status, body) = answer(&mut conn, Opcode::ShmGet, k as u64 + 1).await?;
            out[*i] = match status {
                ErrorCode::Ok => {
                    let lease = ShmLease::from_bytes(&body).map_err(io::Error::other)?;
                    leases.push(lease.lease);
                    self.copy(&lease, &mut items[*i])?
                }
                ErrorCode::NotFound => Read::Missing,
                other => Read::Failed(other),
            };
        }
        // The touches' answers come after the gets', before the release's.
        if !leases.is_empty() {
            let body = ShmRelease { leases }.to_bytes();
            let id = id();
            outbox.push(Opcode::ShmRelease, id, &body);
            owed.push((Opcode::ShmRelease, id));
        }
        outbox.flush(&mut conn).await?;
        self.put_back(conn, owed);
        Ok(out)
    }

    /// `copy_indexed` for each item; a large batch on several threads.
    fn copy_all_indexed(
        &self,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> Vec<Option<usize>> {
        let copy = |group: &mut [GetItem<'_>]| -> Vec<Option<usize>> {
            group
                .iter_mut()
                .map(|it| self.copy_indexed(&BlockKey::new(namespace.clone(), it.hash), it))
                .collect()
        };
        let bytes: usize = items.iter().map(|it| it.location.size as usize).sum();
        let threads = self.copy_threads.min(items.len());
        if self.index.is_none() || threads <= 1 || bytes < PARALLEL_BYTES {
            return copy(items);
        }
        let per = items.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let mut groups = items.chunks_mut(per);
            // This thread copies the first group while the others copy theirs.
            let first = groups.next().unwrap_or_default();
            let spawned: Vec<_> = groups
                .map(|group| {
                    let len = group.len();
                    let builder = std::thread::Builder::new().name("mooncake-shm-copy".into());
                    (len, builder.spawn_scoped(scope, move || copy(group)))
                })
                .collect();
            let mut out = copy(first);
            for (len, handle) in spawned {
                match handle {
                    Ok(handle) => out.extend(
                        handle
                            .join()
                            .unwrap_or_else(|e| std::panic::resume_unwind(e)),
                    ),
                    // No thread: that group is leased and copied instead.
                    Err(_) => out.extend(std::iter::repeat_n(None, len)),
                }
            }
            out
        })
    }

    /// Copies a block the index shows into its buffer: its length if the
    /// copy is the block the meta service described (same size, and bytes
    /// that hash to its checksum).
    fn copy_indexed(&self, key: &BlockKey, item: &mut GetItem<'_>) -> Option<usize> {
        let index = self.index.as_ref()?;
        let entry = index.table.lookup(Digest::of(key))?;
        let (len, want) = (item.location.size as usize, item.location.checksum);
        if entry.len != len as u64 || entry.checksum != want || len > item.buf.len() {
            return None;
        }
        let offset = usize::try_from(entry.offset).ok()?;
        if offset.checked_add(len).is_none_or(|end| end > self.map.len) {
            return None;
        }
        // SAFETY: in bounds (checked above). No lease holds these bytes:
        // the daemon may reuse them while they are copied, which is why
        // the copy counts only if it hashes to the block's checksum.
        let src = unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr().add(offset), len) };
        (item.buf.copy_with_checksum(src) == want).then_some(len)
    }

    /// Adds reads through the index to those the daemon has yet to hear
    /// of; returns the ones to tell it now (a full batch, or reads that
    /// waited long enough), else nothing.
    fn note_touches(&self, keys: Vec<BlockKey>) -> Vec<BlockKey> {
        let mut touches = self.touches.lock();
        if touches.keys.is_empty() {
            touches.since = std::time::Instant::now();
        }
        touches.keys.extend(keys);
        let due = touches.keys.len() >= TOUCH_BATCH
            || (!touches.keys.is_empty() && touches.since.elapsed() >= TOUCH_DELAY);
        if due {
            std::mem::take(&mut touches.keys)
        } else {
            Vec::new()
        }
    }

    /// Copies one leased block into its buffer and checks it.
    fn copy(&self, lease: &ShmLease, item: &mut GetItem<'_>) -> io::Result<Read> {
        let (offset, len) = (lease.offset as usize, lease.len as usize);
        if offset.checked_add(len).is_none_or(|end| end > self.map.len) {
            return Err(io::Error::other("a lease outside the shared pool"));
        }
        if len > item.buf.len() {
            return Ok(Read::Failed(ErrorCode::TooLarge));
        }
        // SAFETY: in bounds (checked above), and the lease keeps these
        // bytes in place, unwritten, until it is released.
        let src = unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr().add(offset), len) };
        let sum = item.buf.copy_with_checksum(src);
        Ok(Read::of_lease(lease, sum, item))
    }
}

impl Transport for ShmLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
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

impl ShmLink {
    fn error(&self, err: io::Error) -> ClientError {
        ClientError::Io {
            side: ErrorSource::Daemon,
            addr: self.path.display().to_string(),
            err,
        }
    }
}

/// Fills the mapping's page tables in the background, so that a block's
/// first read does not pay a page fault per 4 KiB (the pool's pages are
/// already in memory, the daemon's; only this process's view of them is
/// missing). Stops early if the link goes. The flag returned is set when
/// it is done (or has given up: then pages fault in on first use).
fn populate(map: &std::sync::Arc<Mapping>) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    const STEP: usize = 64 << 20;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let map = std::sync::Arc::downgrade(map);
    let flag = done.clone();
    let spawned = std::thread::Builder::new()
        .name("mooncake-shm-populate".into())
        .spawn(move || {
            let _done = SetOnDrop(flag);
            let mut offset = 0;
            while let Some(map) = map.upgrade() {
                if offset >= map.len {
                    break;
                }
                let len = STEP.min(map.len - offset);
                // SAFETY: a range inside a mapping this thread keeps alive
                // (the Arc) for the call; populating changes no byte.
                let rc = unsafe {
                    libc::madvise(
                        map.ptr.as_ptr().add(offset).cast(),
                        len,
                        libc::MADV_POPULATE_WRITE,
                    )
                };
                if rc != 0 {
                    // Kernels before 5.14: pages fault in on first use.
                    break;
                }
                offset += len;
            }
        });
    if let Err(err) = spawned {
        tracing::debug!(%err, "no thread to populate the shared mapping");
        done.store(true, std::sync::atomic::Ordering::Release);
    }
    done
}

/// Sets its flag when dropped: however a thread ends, it says it ended.
struct SetOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Connects to the daemon's socket: the stream (non-blocking, for tokio),
/// its hello and the descriptors of the pool (first) and of its index.
fn open(path: &Path) -> io::Result<(UnixStream, ShmHello, Vec<OwnedFd>)> {
    let stream = StdUnixStream::connect(path)?;
    // The daemon answers at once; a socket that does not is not one, and
    // this runs on a runtime thread: wait briefly.
    stream.set_read_timeout(Some(std::time::Duration::from_millis(250)))?;
    let (hello, fds) = recv_with_fds(&stream)?;
    let hello = ShmHello::from_bytes(&hello).map_err(io::Error::other)?;
    stream.set_read_timeout(None)?;
    stream.set_nonblocking(true)?;
    Ok((UnixStream::from_std(stream)?, hello, fds))
}

/// The inode of a descriptor (which memfd it is) and its page size.
fn inode(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    // SAFETY: `stat` is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a stat buffer.
    if unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(fd), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.st_ino, st.st_blksize as u64))
}

/// Bytes of the mapping at `start` that this process maps with 2 MiB
/// transparent huge pages, from `/proc/self/smaps`; `None` if unreadable.
fn huge_mapped(start: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    // smaps pads addresses to at least 8 hex digits.
    let head = format!("{start:08x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
    lines.next()?;
    let mut kib = 0;
    // Its fields, up to the next mapping's line (which has no colon-named
    // field: it starts with an address range).
    for line in lines.take_while(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|f| f.ends_with(':'))
    }) {
        let mut fields = line.split_whitespace();
        if let (Some("FilePmdMapped:" | "ShmemPmdMapped:"), Some(n)) =
            (fields.next(), fields.next())
        {
            kib += n.parse::<u64>().unwrap_or(0);
        }
    }
    Some(kib << 10)
}

/// Descriptors one hello may carry: the pool's and its index's.
const MAX_FDS: usize = 2;

/// Receives one message with file descriptors attached (SCM_RIGHTS); at
/// least one must come.
fn recv_with_fds(stream: &StdUnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut bytes = vec![0u8; 4096];
    let fds_len = (MAX_FDS * std::mem::size_of::<libc::c_int>()) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fds_len) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = [IoSliceMut::new(&mut bytes)];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr().cast();
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: a connected socket and buffers that outlive the call.
    let n = unsafe {
        libc::recvmsg(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control`; we read the first header, and
    // as many descriptors as its length says.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if !cmsg.is_null()
            && (*cmsg).cmsg_level == libc::SOL_SOCKET
            && (*cmsg).cmsg_type == libc::SCM_RIGHTS
        {
            let data = libc::CMSG_DATA(cmsg);
            let count = ((*cmsg).cmsg_len as usize - (data as usize - cmsg as usize))
                / std::mem::size_of::<libc::c_int>();
            for i in 0..count.min(MAX_FDS) {
                let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                // The kernel installed this descriptor for us.
                fds.push(OwnedFd::from_raw_fd(fd));
            }
        }
    }
    if fds.is_empty() {
        return Err(io::Error::other("no descriptor came with the hello"));
    }
    bytes.truncate(n as usize);
    Ok((bytes, fds))
}
