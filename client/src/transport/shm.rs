//! Same-host reads: the daemon on this host shares its DRAM pool (a memfd
//! received over its Unix socket, mapped read-only here); a block is read
//! by leasing it (`ShmGet`: where its bytes are, kept in place until the
//! lease ends), copying it into the caller's buffer and checking it against
//! its checksum, then ending the leases (`ShmRelease`). No byte crosses a
//! socket. See `store/src/shm.rs` for the daemon's side.

use std::io::{self, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::ptr::NonNull;

use mooncake_proto::checksum::copy_with_checksum;
use mooncake_proto::message::{
    Body, KeyRequest, ShmHello, ShmLease, ShmPutRequest, ShmRelease, ShmSlot,
};
use mooncake_proto::{BlockKey, ErrorCode, Header, Namespace, Opcode, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use futures::future::BoxFuture;
use mooncake_proto::transport::TransportKind;

use super::{GetItem, PutItem, Read, Transport};
use crate::error::{ClientError, ErrorSource};

/// A mapping of a daemon's pool: read for gets, written only into room
/// the daemon reserved for a put.
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

/// Idle socket connections kept to the daemon.
const MAX_IDLE: usize = 64;

/// An idle connection, and the id of a release whose answer it still owes.
struct Idle {
    stream: UnixStream,
    owed: Option<u64>,
}

/// The link to the daemon on this host: its pool, mapped once, and a few
/// socket connections for leases (one call at a time on each).
pub(crate) struct ShmLink {
    /// The daemon's TCP address, as block locations name it.
    pub addr: String,
    map: std::sync::Arc<Mapping>,
    path: std::path::PathBuf,
    /// Connections whose last call finished cleanly; one cut short (a
    /// deadline) is dropped with its call, never reused.
    idle: parking_lot::Mutex<Vec<Idle>>,
}

impl ShmLink {
    /// Connects to the daemon's socket at `path` and maps its pool.
    pub fn connect(path: &Path) -> io::Result<ShmLink> {
        let (stream, hello, fd) = open(path)?;
        let len = usize::try_from(hello.len).map_err(io::Error::other)?;
        // SAFETY: a read-only shared mapping of the memfd we were given.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = std::sync::Arc::new(Mapping {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("null mapping"))?,
            len,
        });
        drop(fd);
        populate(&map);
        Ok(ShmLink {
            addr: hello.addr,
            map,
            path: path.to_path_buf(),
            idle: parking_lot::Mutex::new(vec![Idle { stream, owed: None }]),
        })
    }

    /// An idle connection, or a new one (its copy of the pool's descriptor
    /// is closed: the mapping is already there).
    async fn conn(&self) -> io::Result<UnixStream> {
        let idle = self.idle.lock().pop();
        if let Some(Idle { mut stream, owed }) = idle {
            // The answer to the release its last get sent: leases are
            // freed as soon as the daemon reads the release; only the
            // answer waited for the next call.
            let released = match owed {
                None => true,
                Some(id) => answer(&mut stream, Opcode::ShmRelease, id).await?.0 == ErrorCode::Ok,
            };
            if released {
                return Ok(stream);
            }
            // A release refused: closing this connection ends its leases.
        }
        let (stream, hello, _fd) = open(&self.path)?;
        if hello.addr != self.addr || hello.len as usize != self.map.len {
            return Err(io::Error::other("another daemon now serves this socket"));
        }
        Ok(stream)
    }

    fn put_back(&self, stream: UnixStream, owed: Option<u64>) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { stream, owed });
        }
    }

    /// Reads `items` from the shared pool: one lease per block, all asked
    /// at once, the bytes copied and checked, then all leases ended.
    /// `Missing` for blocks the daemon does not hold in DRAM.
    async fn get_blocks(
        &self,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> io::Result<Vec<Read>> {
        let mut conn = self.conn().await?;
        let mut out = Vec::with_capacity(items.len());
        let mut frames = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let body = KeyRequest {
                key: BlockKey::new(namespace.clone(), it.hash),
            }
            .to_bytes();
            frames.extend_from_slice(
                &Header::request(Opcode::ShmGet, i as u64 + 1, body.len() as u32).encode(),
            );
            frames.extend_from_slice(&body);
        }
        conn.write_all(&frames).await?;
        let mut leases = Vec::new();
        for (i, item) in items.iter_mut().enumerate() {
            let (status, body) = answer(&mut conn, Opcode::ShmGet, i as u64 + 1).await?;
            out.push(match status {
                ErrorCode::Ok => {
                    let lease = ShmLease::from_bytes(&body).map_err(io::Error::other)?;
                    leases.push(lease.lease);
                    self.copy(&lease, item)?
                }
                ErrorCode::NotFound => Read::Missing,
                other => Read::Failed(other),
            });
        }
        let mut owed = None;
        if !leases.is_empty() {
            let body = ShmRelease { leases }.to_bytes();
            let id = items.len() as u64 + 1;
            let mut frame = Header::request(Opcode::ShmRelease, id, body.len() as u32)
                .encode()
                .to_vec();
            frame.extend_from_slice(&body);
            conn.write_all(&frame).await?;
            owed = Some(id);
        }
        self.put_back(conn, owed);
        Ok(out)
    }

    /// Stores `items` through the shared pool: room reserved for each at
    /// once (`ShmPut`), the bytes written there, then each verified and
    /// stored by the daemon (`ShmCommit`). A status per item.
    async fn put_blocks(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> io::Result<Vec<ErrorCode>> {
        let mut conn = self.conn().await?;
        let mut frames = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let body = ShmPutRequest {
                key: BlockKey::new(namespace.clone(), it.hash),
                len: it.value.len() as u64,
                checksum: it.checksum,
                parent: it.parent,
            }
            .to_bytes();
            frames.extend_from_slice(
                &Header::request(Opcode::ShmPut, i as u64 + 1, body.len() as u32).encode(),
            );
            frames.extend_from_slice(&body);
        }
        conn.write_all(&frames).await?;
        let mut codes = vec![ErrorCode::Ok; items.len()];
        let mut reserved = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let (status, body) = answer(&mut conn, Opcode::ShmPut, i as u64 + 1).await?;
            if status != ErrorCode::Ok {
                codes[i] = status;
                continue;
            }
            let slot = ShmSlot::from_bytes(&body).map_err(io::Error::other)?;
            let (offset, len) = (slot.offset as usize, it.value.len());
            if offset.checked_add(len).is_none_or(|end| end > self.map.len) {
                return Err(io::Error::other("a reservation outside the shared pool"));
            }
            // SAFETY: in bounds (checked above), and reserved for this
            // block alone until it is committed.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    it.value.as_ptr(),
                    self.map.ptr.as_ptr().add(offset),
                    len,
                )
            };
            reserved.push((i, slot));
        }
        frames.clear();
        let base = items.len() as u64 + 1;
        for (k, (_, slot)) in reserved.iter().enumerate() {
            let body = slot.to_bytes();
            frames.extend_from_slice(
                &Header::request(Opcode::ShmCommit, base + k as u64, body.len() as u32).encode(),
            );
            frames.extend_from_slice(&body);
        }
        conn.write_all(&frames).await?;
        for (k, (i, _)) in reserved.iter().enumerate() {
            let (status, _) = answer(&mut conn, Opcode::ShmCommit, base + k as u64).await?;
            codes[*i] = status;
        }
        self.put_back(conn, None);
        Ok(codes)
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
        let dst = &mut item.buf[..len];
        if copy_with_checksum(dst, src) != lease.checksum {
            return Ok(Read::Corrupt);
        }
        if lease.checksum != item.location.checksum || len != item.location.size as usize {
            return Ok(Read::Stale);
        }
        Ok(Read::Hit(len))
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
    ) -> BoxFuture<'a, Result<Vec<ErrorCode>, ClientError>> {
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
/// missing). Stops early if the link goes.
fn populate(map: &std::sync::Arc<Mapping>) {
    const STEP: usize = 64 << 20;
    let map = std::sync::Arc::downgrade(map);
    let spawned = std::thread::Builder::new()
        .name("mooncake-shm-populate".into())
        .spawn(move || {
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
    }
}

/// Connects to the daemon's socket: the stream (non-blocking, for tokio),
/// its hello and the pool's descriptor.
fn open(path: &Path) -> io::Result<(UnixStream, ShmHello, OwnedFd)> {
    let stream = StdUnixStream::connect(path)?;
    // The daemon answers at once; a socket that does not is not one, and
    // this runs on a runtime thread: wait briefly.
    stream.set_read_timeout(Some(std::time::Duration::from_millis(250)))?;
    let (hello, fd) = recv_with_fd(&stream)?;
    let hello = ShmHello::from_bytes(&hello).map_err(io::Error::other)?;
    stream.set_read_timeout(None)?;
    stream.set_nonblocking(true)?;
    Ok((UnixStream::from_std(stream)?, hello, fd))
}

/// The next answer on the link, which must be to request `id` of `op`.
async fn answer(conn: &mut UnixStream, op: Opcode, id: u64) -> io::Result<(ErrorCode, Vec<u8>)> {
    let mut raw = [0u8; HEADER_LEN];
    conn.read_exact(&mut raw).await?;
    let header = Header::parse(&raw)
        .map_err(io::Error::other)?
        .ok_or_else(|| io::Error::other("short header"))?;
    if !header.response || header.opcode != op || header.request_id != id {
        return Err(io::Error::other(
            "answers out of order on the shared-memory link",
        ));
    }
    let mut body = vec![0u8; header.body_len as usize];
    conn.read_exact(&mut body).await?;
    let status = ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal);
    Ok((status, body))
}

/// Receives one message with a file descriptor attached (SCM_RIGHTS).
fn recv_with_fd(stream: &StdUnixStream) -> io::Result<(Vec<u8>, OwnedFd)> {
    let mut bytes = vec![0u8; 4096];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
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
    // SAFETY: the kernel filled `control`; we read the first header only.
    let fd = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(io::Error::other("no descriptor came with the hello"));
        }
        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>())
    };
    // SAFETY: the kernel installed this descriptor for us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    bytes.truncate(n as usize);
    Ok((bytes, fd))
}
