//! Socket buffers for the data paths. A block travels in one response, and
//! a batch's responses follow each other on one connection: when the
//! sender's and the receiver's buffers together hold less than a block,
//! each block boundary drains the pipe (the sender finishes writing one
//! block only once the receiver has read most of it, and is woken again to
//! start the next), and a batch of 256 KiB blocks on loopback moved at
//! 2.3-2.5 GB/s against 3.6-4.2 GB/s with 4 MiB buffers on both ends
//! (`docs/benchmarks.md`, "Socket buffers").
//!
//! Buffers are set only where they can be large: with CAP_NET_ADMIN (the
//! `*FORCE` options), or where `net.core.rmem_max` / `wmem_max` allow the
//! size asked for. Elsewhere the kernel's own tuning is left alone, since
//! setting a buffer fixes it and a small fixed buffer is worse than tuning.

use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// What a TCP data connection asks for on each end.
pub const TCP_BUFFER: usize = 4 << 20;

/// Sets the socket's send and receive buffers to `size` bytes where that
/// size can be had (see the module docs); what it could not set is left
/// to the kernel. Never fails: a buffer is an optimization.
pub fn enlarge(socket: &impl AsRawFd, size: usize) {
    for (force, plain, max) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, &RMEM_MAX),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, &WMEM_MAX),
    ] {
        if set(socket, force, size).is_ok() {
            continue;
        }
        if system_max(max) >= size {
            let _ = set(socket, plain, size);
        }
    }
}

static RMEM_MAX: (OnceLock<usize>, &str) = (OnceLock::new(), "/proc/sys/net/core/rmem_max");
static WMEM_MAX: (OnceLock<usize>, &str) = (OnceLock::new(), "/proc/sys/net/core/wmem_max");

/// The most an unprivileged process may set a buffer to (0 when unknown).
fn system_max((value, path): &(OnceLock<usize>, &str)) -> usize {
    *value.get_or_init(|| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// Sets one buffer option to `size` bytes.
pub(crate) fn set(socket: &impl AsRawFd, option: libc::c_int, size: usize) -> std::io::Result<()> {
    let size = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid socket and a c_int option value that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buffer the kernel reports (twice what was set, for its own
    /// bookkeeping).
    fn get(socket: &impl AsRawFd, option: libc::c_int) -> usize {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket, and value/len outlive the call.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        value as usize
    }

    #[test]
    fn buffers_are_set_where_they_can_be_large_and_left_to_the_kernel_elsewhere() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let before = get(&socket, libc::SO_RCVBUF);
        let size = 1 << 20;
        enlarge(&socket, size);
        let privileged = set(&socket, libc::SO_RCVBUFFORCE, size).is_ok();
        if privileged || system_max(&RMEM_MAX) >= size {
            assert_eq!(get(&socket, libc::SO_RCVBUF), 2 * size);
            assert_eq!(get(&socket, libc::SO_SNDBUF), 2 * size);
        } else {
            assert_eq!(
                get(&socket, libc::SO_RCVBUF),
                before,
                "a small fixed buffer was set"
            );
        }
    }
}
