//! Staging: pinned host buffers, each with its own lane (CUDA stream),
//! kept between calls (allocating pinned memory costs milliseconds).

use parking_lot::Mutex;

use super::{Device, DeviceError, Lane, Pinned};

/// A pinned buffer and the lane whose copies read or fill it. Copies
/// queued on it may still run: dropping a stage waits for them first, so
/// that no copy reads freed memory or writes into it.
pub(crate) struct Stage {
    pub(crate) buf: Pinned,
    pub(crate) lane: Box<dyn Lane>,
    ordinal: i32,
    /// Copies were queued since the last wait.
    queued: bool,
}

impl Stage {
    /// # Safety
    /// As `Lane::upload`; `src` lies in `self.buf`, or in host memory
    /// registered with the device that stays mapped until the stage is
    /// waited on.
    pub(crate) unsafe fn upload(
        &mut self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.queued = true;
        // SAFETY: the caller's promise; `buf` lives as long as the stage,
        // and dropping the stage waits.
        unsafe { self.lane.upload(dst, src, len) }
    }

    /// # Safety
    /// As `Lane::download`; `dst` lies in `self.buf`, or in host memory
    /// registered with the device that stays mapped until the stage is
    /// waited on.
    pub(crate) unsafe fn download(
        &mut self,
        dst: *mut u8,
        src: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.queued = true;
        // SAFETY: as in `upload`.
        unsafe { self.lane.download(dst, src, len) }
    }

    /// Waits for the copies queued so far; blocks the thread (on a
    /// multi-threaded runtime, telling it so, so that its other tasks
    /// move to other workers).
    pub(crate) fn wait(&mut self) -> Result<(), DeviceError> {
        if !std::mem::take(&mut self.queued) {
            return Ok(());
        }
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        match multi {
            true => tokio::task::block_in_place(|| self.lane.wait()),
            false => self.lane.wait(),
        }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if self.queued {
            if let Err(err) = self.lane.wait() {
                tracing::warn!(%err, "a device copy of a call that was dropped failed");
            }
        }
    }
}

/// Queues copying the first `n` bytes at `src` (pinned, in `stage`) into
/// the spans, in order.
///
/// # Safety
/// As `Stage::upload`.
pub(crate) unsafe fn up(
    stage: &mut Stage,
    src: *const u8,
    mut n: usize,
    spans: &[super::Span],
) -> Result<(), DeviceError> {
    let mut at = 0;
    for span in spans.iter().filter(|s| s.len > 0) {
        let len = span.len.min(n);
        if len == 0 {
            break;
        }
        // SAFETY: the caller's promise.
        unsafe { stage.upload(span.addr, src.add(at), len)? };
        at += len;
        n -= len;
    }
    Ok(())
}

/// Queues copying the spans, in order, to `dst` (pinned: in `stage`, or
/// registered).
///
/// # Safety
/// As `Stage::download`, for the spans' total length at `dst`.
pub(crate) unsafe fn down(
    stage: &mut Stage,
    dst: *mut u8,
    spans: &[super::Span],
) -> Result<(), DeviceError> {
    let mut at = 0;
    for span in spans.iter().filter(|s| s.len > 0) {
        // SAFETY: the caller's promise.
        unsafe { stage.download(dst.add(at), span.addr, span.len)? };
        at += span.len;
    }
    Ok(())
}

/// Stages not in use, for the next calls.
#[derive(Default)]
pub(crate) struct Stages {
    idle: Mutex<Vec<Stage>>,
}

/// Stages kept idle at most: a call uses two at a time.
const KEPT: usize = 8;

impl Stages {
    /// A stage of at least `len` bytes for GPU `ordinal`: the smallest
    /// kept one that fits, or a new one.
    pub(crate) fn take(
        &self,
        device: &dyn Device,
        ordinal: i32,
        len: usize,
    ) -> Result<Stage, DeviceError> {
        {
            let mut idle = self.idle.lock();
            let fits = (0..idle.len())
                .filter(|&i| idle[i].ordinal == ordinal && idle[i].buf.len() >= len)
                .min_by_key(|&i| idle[i].buf.len());
            if let Some(i) = fits {
                return Ok(idle.swap_remove(i));
            }
        }
        Ok(Stage {
            buf: device.pinned(len)?,
            lane: device.lane(ordinal)?,
            ordinal,
            queued: false,
        })
    }

    /// Keeps `stage` for later calls, if it is done with its copies (a
    /// failed lane is dropped: a CUDA stream's errors can stick to it).
    pub(crate) fn give(&self, mut stage: Stage) {
        if stage.wait().is_err() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() >= KEPT {
            // The smallest goes: calls ask the size of their blocks.
            let smallest = (0..idle.len())
                .min_by_key(|&i| idle[i].buf.len())
                .expect("not empty");
            if idle[smallest].buf.len() >= stage.buf.len() {
                return;
            }
            idle.swap_remove(smallest);
        }
        idle.push(stage);
    }
}
