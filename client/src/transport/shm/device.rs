//! Same-host gets into GPU memory with no staging copy: the pool's mapping
//! is registered with the GPU once (page-locked, so its copy engines reach
//! it), each block is leased and copied up straight from the pool, and
//! this CPU checks the pool's bytes against the block's checksum while the
//! copies run. The leases end only once the copies are done, so the bytes
//! copied are the bytes checked. A block that does not check out is read
//! again the usual way (staged, where a corrupt copy is reported).

use mooncake_proto::checksum::checksum;
use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::BlockHash;

use super::*;
use crate::device::{up, Device, DeviceError, Span, Stage};

/// What became of one block read straight into GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// Its bytes fill the first `n` bytes of its spans, once the stage's
    /// copies are done.
    Hit(usize),
    /// Larger than its spans.
    TooLarge,
    /// Not in the pool, or its bytes did not check out: read it another
    /// way.
    Elsewhere,
}

impl ShmLink {
    /// Registers the pool with `device`, the first time; whether it is.
    pub(crate) fn on_device(&self, device: &dyn Device) -> bool {
        self.on_device
            .get_or_init(|| {
                // SAFETY: the mapping outlives the registration (the
                // field's order in `ShmLink`).
                match unsafe { device.register_host(self.map.ptr.as_ptr(), self.map.len) } {
                    Ok(registration) => {
                        tracing::info!(bytes = self.map.len, "same-host pool registered with the GPU: gets into GPU memory copy straight from it");
                        Some(registration)
                    }
                    Err(err) => {
                        tracing::warn!(%err, "the same-host pool could not be registered with the GPU; gets into GPU memory go through staging");
                        None
                    }
                }
            })
            .is_some()
    }

    /// Reads blocks straight from the pool into device memory (see the
    /// module's comment), the copies on `stage`'s lane, waited for before
    /// the leases end. An outcome per block, and how the copies went (a
    /// failed copy fails every hit).
    ///
    /// # Safety
    /// The spans must be device memory of the stage's GPU, writable until
    /// the call returns, apart from each other.
    pub(crate) async unsafe fn get_to_device(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        blocks: &[&[Span]],
        stage: &mut Stage,
    ) -> io::Result<(Vec<Direct>, Result<(), DeviceError>)> {
        let mut out = Vec::with_capacity(hashes.len());
        let mut copied = Ok(());
        for (hs, bs) in hashes.chunks(MAX_BATCH).zip(blocks.chunks(MAX_BATCH)) {
            // SAFETY: the caller's promise, passed on.
            let (got, went) = unsafe { self.get_batch_to_device(namespace, hs, bs, stage) }.await?;
            out.extend(got);
            copied = copied.and(went);
        }
        Ok((out, copied))
    }

    async unsafe fn get_batch_to_device(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        blocks: &[&[Span]],
        stage: &mut Stage,
    ) -> io::Result<(Vec<Direct>, Result<(), DeviceError>)> {
        let mut conn = self.conn().await?;
        let mut outbox = Outbox::default();
        for (i, hash) in hashes.iter().enumerate() {
            let body = KeyRequest {
                key: BlockKey::new(namespace.clone(), *hash),
            }
            .to_bytes();
            outbox.push(Opcode::ShmGet, i as u64 + 1, &body);
        }
        let mut out = vec![Direct::Elsewhere; hashes.len()];
        let mut leases = Vec::new();
        // Blocks copied up: (index, where in the pool, length, checksum).
        let mut checks = Vec::new();
        let mut queued = Ok(());
        for (i, spans) in blocks.iter().enumerate() {
            outbox.before_answer(&mut conn, i).await?;
            let (status, body) = answer(&mut conn, Opcode::ShmGet, i as u64 + 1).await?;
            if status != ErrorCode::Ok {
                continue;
            }
            let lease = ShmLease::from_bytes(&body).map_err(io::Error::other)?;
            leases.push(lease.lease);
            let (offset, len) = (lease.offset as usize, lease.len as usize);
            if offset.checked_add(len).is_none_or(|end| end > self.map.len) {
                return Err(io::Error::other("a lease outside the shared pool"));
            }
            if len > spans.iter().map(|s| s.len).sum() {
                out[i] = Direct::TooLarge;
                continue;
            }
            if queued.is_err() {
                // The device refused a copy: the rest go another way.
                continue;
            }
            // SAFETY: in bounds (checked above); the lease keeps the bytes
            // in place until released, after the wait below; the mapping
            // is registered with the device; the spans are the caller's.
            let src = unsafe { self.map.ptr.as_ptr().add(offset) };
            match unsafe { up(stage, src, len, spans) } {
                Ok(()) => checks.push((i, offset, len, lease.checksum)),
                Err(err) => queued = Err(err),
            }
        }
        // This CPU checks the pool's bytes while the GPU copies them.
        for (i, checked) in self.verify(&checks) {
            if let Some(len) = checked {
                out[i] = Direct::Hit(len);
            }
        }
        let waited = stage.wait();
        if !leases.is_empty() {
            let id = hashes.len() as u64 + 1;
            outbox.push(Opcode::ShmRelease, id, &ShmRelease { leases }.to_bytes());
            outbox.flush(&mut conn).await?;
            self.put_back(conn, vec![(Opcode::ShmRelease, id)]);
        } else {
            self.put_back(conn, Vec::new());
        }
        Ok((out, queued.and(waited)))
    }

    /// For each `(index, offset, length, checksum)`: the length if the
    /// pool's bytes there match; a large batch on several threads.
    fn verify(&self, checks: &[(usize, usize, usize, u64)]) -> Vec<(usize, Option<usize>)> {
        let check = |group: &[(usize, usize, usize, u64)]| -> Vec<(usize, Option<usize>)> {
            group
                .iter()
                .map(|&(i, offset, len, sum)| {
                    // SAFETY: in bounds (checked when leased), and leased:
                    // in place, unwritten, until released.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(self.map.ptr.as_ptr().add(offset), len)
                    };
                    (i, (checksum(bytes) == sum).then_some(len))
                })
                .collect()
        };
        let bytes: usize = checks.iter().map(|c| c.2).sum();
        if bytes < PARALLEL_BYTES || self.copy_threads < 2 || checks.len() < 2 {
            return check(checks);
        }
        let per = checks.len().div_ceil(self.copy_threads);
        std::thread::scope(|s| {
            let threads: Vec<_> = checks
                .chunks(per)
                .map(|g| s.spawn(move || check(g)))
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().expect("a checksum thread panicked"))
                .collect()
        })
    }
}
