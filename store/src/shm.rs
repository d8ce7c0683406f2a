//! Same-host reads through shared memory. The daemon's DRAM pool lives in a
//! memfd; a client on the same host connects to the daemon's Unix socket,
//! receives the memfd (SCM_RIGHTS), maps it read-only, and for each block
//! asks for a lease (`ShmGet`): the daemon answers where the bytes are and
//! keeps them in place (no eviction, no reuse) until the client ends the
//! lease (`ShmRelease`) or goes away. The client copies the bytes and
//! checks them against the block's checksum, so a copy is either right or
//! a miss. Blocks only on NVMe answer `NotFound` here; the client reads
//! those over TCP.
//!
//! Most reads need no message at all: the pool publishes where each block
//! lies in a shared index (a second memfd, see `mooncake_proto::shm_index`);
//! a client copies the block straight away and checks it, leasing only
//! what the index does not show or what changed under its copy. It reports
//! such reads afterwards, in batches (`ShmTouch`), for LRU and hit counts.

use crate::admit::Admitter;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use mooncake_proto::message::{Body, ShmHello};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::server::DataService;

/// The same-host socket, bound: it accepts from then on (a daemon binds it
/// before it registers, so that a client that sees the daemon can
/// connect). The socket file goes when it is dropped.
pub struct Socket {
    listener: UnixListener,
    _cleanup: RemoveOnDrop,
}

/// Binds the same-host socket at `path` (a stale file there replaced).
pub fn bind(path: PathBuf) -> io::Result<Socket> {
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    Ok(Socket {
        listener,
        _cleanup: RemoveOnDrop(path),
    })
}

/// Serves same-host clients on `socket` until `shutdown`, at most
/// `max_sessions` at once (more are closed at once, and logged).
pub async fn run(
    socket: Socket,
    (service, admitter): (Arc<DataService>, Option<Arc<Admitter>>),
    advertise: String,
    (sessions, max_sessions): (prometheus::IntGauge, usize),
    (tasks, shutdown): (&TaskTracker, CancellationToken),
) -> io::Result<()> {
    // The socket file stays until this returns.
    let Socket {
        listener,
        _cleanup: file,
    } = socket;
    tracing::info!(path = %file.0.display(), "same-host clients served over shared memory");
    // Clients read the index and never write it: they get it read-only.
    let index = match service.tiers.dram.shared_index() {
        Some((fd, len)) => Some((Arc::new(read_only(fd)?), len)),
        None => None,
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(max_sessions));
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(err) => {
                    tracing::warn!(%err, "shm accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return Ok(()),
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!("shm client refused: max_connections sessions open");
            continue;
        };
        let (service, advertise, shutdown) = (service.clone(), advertise.clone(), shutdown.clone());
        let (sessions, index, admitter) = (sessions.clone(), index.clone(), admitter.clone());
        tasks.spawn(async move {
            let index = index.as_ref().map(|(fd, len)| (fd.as_fd(), *len));
            let service = (&*service, admitter.as_deref());
            if let Err(err) = serve(stream, service, index, &advertise, &sessions, &shutdown).await
            {
                tracing::debug!(%err, "shm client gone");
            }
            drop(permit);
        });
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn serve(
    mut stream: UnixStream,
    (service, admitter): (&DataService, Option<&Admitter>),
    index: Option<(BorrowedFd<'_>, u64)>,
    advertise: &str,
    sessions: &prometheus::IntGauge,
    shutdown: &CancellationToken,
) -> io::Result<()> {
    let pool = &service.tiers.dram;
    let (fd, len) = pool
        .shared_region()
        .ok_or_else(|| io::Error::other("the pool is not shared"))?;
    let hello = ShmHello {
        len,
        addr: advertise.to_string(),
        index_len: index.map_or(0, |(_, len)| len),
    }
    .to_bytes();
    let mut fds = vec![fd];
    fds.extend(index.map(|(fd, _)| fd));
    stream.writable().await?;
    send_with_fds(&stream, &hello, &fds)?;
    let tiers = &service.tiers;
    let paths = (Some(service), admitter);
    crate::leases::serve(&mut stream, tiers, paths, sessions, shutdown).await
}

/// A new descriptor of `fd`'s file that only reads: a mapping of it can
/// never be written, whatever its holder asks.
fn read_only(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    Ok(file.into())
}

/// Sends `bytes` with file descriptors attached (SCM_RIGHTS).
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<libc::c_int> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let fds_len = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fds_len) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one header and the fds.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fds_len) as _;
        std::ptr::copy_nonoverlapping(
            raw.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            fds_len as usize,
        );
    }
    // SAFETY: a connected socket and a well-formed message.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != bytes.len() {
        return Err(io::Error::other("hello sent in part"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_goes_out_read_only_and_cannot_be_mapped_for_writing() {
        let pool = crate::DramPool::new(crate::pool::PoolConfig {
            shared: true,
            ..crate::pool::PoolConfig::with_capacity(1 << 20)
        })
        .unwrap();
        let (fd, len) = pool.shared_index().expect("a shared pool has an index");
        let ro = read_only(fd).unwrap();
        let map = |prot| {
            // SAFETY: a fresh shared mapping, unmapped below if made.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len as usize,
                    prot,
                    libc::MAP_SHARED,
                    ro.as_raw_fd(),
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: what was just mapped.
            unsafe { libc::munmap(ptr, len as usize) };
            Ok(())
        };
        assert!(map(libc::PROT_READ).is_ok(), "readers map it");
        let err = map(libc::PROT_READ | libc::PROT_WRITE).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    }
}
