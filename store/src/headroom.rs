//! Room for the NVMe index on its filesystem. A drive's data space is
//! reserved when the daemon starts, but its RocksDB index grows and writes
//! a log beside it; RocksDB cannot survive a write that fails for want of
//! space (the process aborts). So a drive takes no new blocks while the
//! index's filesystem is nearly full, and a ballast file held beside the
//! index is let go at that moment, giving RocksDB room to finish its
//! flushes and the tier room to delete entries. Once there is room for
//! the ballast again, the ballast is taken back and the drive takes blocks.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// Free space the index's filesystem keeps; below it, no new blocks.
pub const HEADROOM: u64 = 16 << 20;
/// Size of the ballast file, let go when the headroom is gone.
pub const BALLAST: u64 = 16 << 20;

pub struct Headroom {
    /// The index directory, open for `fstatvfs`.
    dir: File,
    dir_path: PathBuf,
    ballast: PathBuf,
    full: AtomicBool,
    change: Mutex<()>,
}

impl Headroom {
    /// Watches the filesystem of `dir` (the index directory), holding a
    /// ballast file at `ballast`.
    pub fn new(dir: &Path, ballast: PathBuf) -> io::Result<Self> {
        let room = Headroom {
            dir: File::open(dir)?,
            dir_path: dir.to_path_buf(),
            ballast,
            full: AtomicBool::new(false),
            change: Mutex::new(()),
        };
        if let Err(err) = room.take_ballast() {
            tracing::warn!(%err, dir = %dir.display(), "no room for the index's ballast; the drive takes no new blocks until there is");
            room.full.store(true, Ordering::Relaxed);
        }
        Ok(room)
    }

    /// Whether the drive may take a new block now.
    pub fn admits_writes(&self) -> bool {
        let free = match crate::io::free_space(&self.dir) {
            Ok(f) => f,
            Err(err) => {
                tracing::warn!(%err, "cannot read the index filesystem's free space");
                return !self.full.load(Ordering::Relaxed);
            }
        };
        if self.full.load(Ordering::Relaxed) {
            if free < HEADROOM + BALLAST {
                return false;
            }
            let _change = self.change.lock();
            if self.full.load(Ordering::Relaxed) && self.take_ballast().is_ok() {
                self.full.store(false, Ordering::Relaxed);
                tracing::info!(dir = %self.dir_path.display(), "index filesystem has room again; the drive takes new blocks");
            }
            return !self.full.load(Ordering::Relaxed);
        }
        if free >= HEADROOM {
            return true;
        }
        let _change = self.change.lock();
        if !self.full.swap(true, Ordering::Relaxed) {
            let _ = std::fs::remove_file(&self.ballast);
            tracing::warn!(
                dir = %self.dir_path.display(),
                free,
                "index filesystem nearly full: ballast released, the drive takes no new blocks (it still serves what it has)"
            );
        }
        false
    }

    /// Whether the drive refuses new blocks for want of space.
    pub fn is_full(&self) -> bool {
        self.full.load(Ordering::Relaxed)
    }

    fn take_ballast(&self) -> io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.ballast)?;
        crate::io::reserve(&file, BALLAST).inspect_err(|_| {
            let _ = std::fs::remove_file(&self.ballast);
        })
    }
}
