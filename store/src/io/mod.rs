//! The I/O engine of the NVMe tier: direct (O_DIRECT) reads and writes of
//! aligned buffers at aligned offsets of one file or device, submitted in
//! batches. Two engines behind one trait, chosen by config: io_uring (one
//! ring on a dedicated thread) and plain pread/pwrite on a few threads for
//! kernels without io_uring. The same tests run against both.
//!
//! Buffers are passed by ownership and handed back with each result, which
//! is what makes handing memory to the kernel safe: nobody else can touch a
//! buffer while it is in flight.

mod aligned;
#[cfg(test)]
pub mod gated;
mod psync;
mod timed;
mod uring;

use std::fs::{File, OpenOptions};
use std::io::{self, Seek};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use futures::future::BoxFuture;

pub use aligned::{AlignedBuf, ALIGN};
pub use psync::PsyncEngine;
pub use timed::{IoTimes, Timed};
pub use uring::UringEngine;

/// One direct transfer: `buf.len()` bytes at `offset`, both aligned.
#[derive(Debug)]
pub struct IoRequest {
    pub offset: u64,
    pub buf: AlignedBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// The buffer back, with the bytes moved or the error.
pub type IoResult = (AlignedBuf, io::Result<usize>);

/// Submits batches of direct reads or writes; results come back in the
/// order of the requests.
pub trait IoEngine: Send + Sync {
    fn submit(&self, kind: IoKind, batch: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>>;
    fn name(&self) -> &'static str;
}

/// Which engine a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Uring,
    Psync,
}

/// Opens (creating if needed) a file for direct I/O.
pub fn open_direct(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// Makes sure `capacity` bytes of `file` exist on the device before the
/// tier counts on them: a regular file gets its blocks allocated now
/// (`fallocate`), so that a full filesystem is one clear error at start
/// rather than failed writes later; a block device must be large enough.
pub fn reserve(file: &File, capacity: u64) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::io::AsRawFd;
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() {
        let size = (&*file).seek(io::SeekFrom::End(0))?;
        if size < capacity {
            return Err(io::Error::other(format!(
                "the device holds {size} bytes, fewer than the {capacity} asked for"
            )));
        }
        return Ok(());
    }
    let len = i64::try_from(capacity).map_err(|_| io::Error::other("size too large"))?;
    // SAFETY: a valid descriptor, plain integer arguments.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // A filesystem without fallocate: a sparse file, checked as written.
        Some(libc::EOPNOTSUPP) => {
            if meta.len() < capacity {
                file.set_len(capacity)?;
            }
            Ok(())
        }
        Some(libc::ENOSPC) => {
            let free = free_space(file).map_or(String::new(), |f| format!(" ({f} bytes free)"));
            Err(io::Error::new(
                err.kind(),
                format!("no space for {capacity} bytes on its filesystem{free}"),
            ))
        }
        _ => Err(err),
    }
}

/// Bytes an unprivileged writer may still use on the filesystem of `file`
/// (a file or a directory).
pub fn free_space(file: &File) -> io::Result<u64> {
    use std::os::unix::io::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `st` is written by the call before it is read.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the call succeeded.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail * st.f_frsize)
}

/// An engine of `kind` over `file`, with at most `depth` transfers in flight.
pub fn engine(kind: EngineKind, file: File, depth: u32) -> io::Result<Box<dyn IoEngine>> {
    Ok(match kind {
        EngineKind::Uring => Box::new(UringEngine::new(file, depth)?),
        EngineKind::Psync => Box::new(PsyncEngine::new(file, depth)?),
    })
}

fn check_aligned(req: &IoRequest) -> io::Result<()> {
    if req.offset % ALIGN as u64 != 0 || req.buf.len() % ALIGN != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "direct I/O needs {ALIGN}-byte alignment: offset {} length {}",
                req.offset,
                req.buf.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engines(depth: u32) -> Vec<(Box<dyn IoEngine>, tempdir::Dir)> {
        [EngineKind::Uring, EngineKind::Psync]
            .into_iter()
            .map(|kind| {
                let dir = tempdir::Dir::new();
                let file = open_direct(&dir.path.join("tier")).unwrap();
                (engine(kind, file, depth).unwrap(), dir)
            })
            .collect()
    }

    fn pattern(seed: u8, len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(len);
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = seed.wrapping_add((i / 7) as u8);
        }
        b
    }

    #[tokio::test]
    async fn batches_of_writes_then_reads_round_trip_on_both_engines() {
        for (engine, _dir) in engines(8) {
            let writes: Vec<IoRequest> = (0..32u64)
                .map(|i| IoRequest {
                    offset: i * 64 * 1024,
                    buf: pattern(i as u8, 16 * 1024 * (1 + i as usize % 4)),
                })
                .collect();
            let results = engine.submit(IoKind::Write, writes).await;
            assert!(
                results.iter().all(|(b, r)| *r.as_ref().unwrap() == b.len()),
                "{}",
                engine.name()
            );
            let reads: Vec<IoRequest> = (0..32u64)
                .map(|i| IoRequest {
                    offset: i * 64 * 1024,
                    buf: AlignedBuf::zeroed(16 * 1024 * (1 + i as usize % 4)),
                })
                .collect();
            for (i, (buf, r)) in engine
                .submit(IoKind::Read, reads)
                .await
                .into_iter()
                .enumerate()
            {
                assert_eq!(r.unwrap(), buf.len());
                let expect = pattern(i as u8, buf.len());
                assert!(
                    buf.as_slice() == expect.as_slice(),
                    "{}: block {i} differs",
                    engine.name()
                );
            }
        }
    }

    #[tokio::test]
    async fn misaligned_requests_are_refused_and_reads_past_the_end_are_short() {
        for (engine, _dir) in engines(4) {
            let bad = vec![IoRequest {
                offset: 100,
                buf: AlignedBuf::zeroed(4096),
            }];
            let (_, r) = engine.submit(IoKind::Read, bad).await.pop().unwrap();
            assert_eq!(
                r.unwrap_err().kind(),
                io::ErrorKind::InvalidInput,
                "{}",
                engine.name()
            );
            let past = vec![IoRequest {
                offset: 1 << 30,
                buf: AlignedBuf::zeroed(4096),
            }];
            let (_, r) = engine.submit(IoKind::Read, past).await.pop().unwrap();
            assert_eq!(r.unwrap(), 0, "{}: nothing there", engine.name());
        }
    }

    #[tokio::test]
    async fn a_write_to_a_read_only_file_is_a_clean_error() {
        for kind in [EngineKind::Uring, EngineKind::Psync] {
            let dir = tempdir::Dir::new();
            let path = dir.path.join("ro");
            drop(open_direct(&path).unwrap());
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .unwrap();
            let engine = engine(kind, file, 2).unwrap();
            let w = vec![IoRequest {
                offset: 0,
                buf: pattern(1, 4096),
            }];
            let (_, r) = engine.submit(IoKind::Write, w).await.pop().unwrap();
            assert!(r.is_err(), "{kind:?}");
        }
    }

    /// A scratch directory removed on drop (on the same filesystem as the
    /// target dir's tmp, which supports O_DIRECT here).
    mod tempdir {
        pub struct Dir {
            pub path: std::path::PathBuf,
        }
        impl Dir {
            pub fn new() -> Self {
                let path = std::env::temp_dir().join(format!(
                    "mooncake-io-{}-{}",
                    std::process::id(),
                    rand::random::<u64>()
                ));
                std::fs::create_dir_all(&path).unwrap();
                Dir { path }
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }
}
