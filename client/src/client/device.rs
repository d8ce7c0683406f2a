//! Blocks to and from device (GPU) memory, through pinned staging with
//! the GPU's copy engines (see `crate::device`). Gets: a chunk of blocks
//! is read into one stage, each block checked against its checksum as it
//! lands there (the usual get path), then copied up on that stage's lane
//! while the next chunk is read into the other stage. Puts: a chunk is
//! copied down into one stage while the chunk before it is put from the
//! other. A block is reported done only once its copy finished; one whose
//! copy failed is reported failed, so no partial block is ever a hit, and
//! a put whose copy down failed stores nothing. Where the same-host
//! daemon's pool is registered with the GPU, blocks skip staging
//! (`direct`).

use super::*;
use crate::device::cuda::Cuda;
use crate::device::{down, up, Device, DeviceChoice, Memory, Span, Stage, COPY_FAILED};

/// Per-block outcome of a block with pieces in host and GPU memory, or on
/// two GPUs: refused (the compatible API's `INVALID_PARAMS`).
const MIXED: ErrorCode = ErrorCode::Malformed;

impl Client {
    /// The GPU support this client uses (`ClientConfig::device`), loaded on
    /// first use; `None` where there is none.
    pub fn device(&self) -> Option<&Arc<dyn Device>> {
        self.device
            .get_or_init(|| match &self.cfg.device {
                DeviceChoice::Off => None,
                DeviceChoice::Given(device) => Some(device.clone()),
                DeviceChoice::Cuda => match Cuda::load() {
                    Ok(cuda) => {
                        tracing::info!(device = %cuda.name(), "GPU memory goes through pinned staging");
                        Some(Arc::new(cuda) as Arc<dyn Device>)
                    }
                    Err(why) => {
                        tracing::debug!(%why, "no GPU: every address is host memory");
                        None
                    }
                },
            })
            .as_ref()
    }

    /// Which memory `addr` lies in: as registered (`register_memory`),
    /// else as this client's GPU support tells (host memory where it has
    /// none).
    pub fn memory_of(&self, addr: usize) -> Memory {
        let registered = self
            .memory_ranges
            .read()
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(len, _))| addr < start + len)
            .map(|(_, &(_, memory))| memory);
        registered.unwrap_or_else(|| self.device().map_or(Memory::Host, |d| d.classify(addr)))
    }

    /// Reads blocks into memory given by address, host or device (GPU):
    /// `blocks[i]` are the pieces block `hashes[i]` lands in, in order.
    /// Host blocks are read straight into place; device blocks through
    /// pinned staging (see the module's comment). A hit's bytes fill the
    /// first `n` bytes of the pieces.
    ///
    /// # Safety
    /// Every span must be memory this process may write (host memory, or
    /// device memory of the GPU that `memory_of` names) until the call
    /// returns; no two spans may overlap.
    pub async unsafe fn get_into_spans(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        blocks: &[Vec<Span>],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        if hashes.len() != blocks.len() {
            return Err(ClientError::Invalid(format!(
                "{} hashes but {} blocks",
                hashes.len(),
                blocks.len()
            )));
        }
        let mut out = vec![GetOutcome::Miss; hashes.len()];
        for (memory, idx) in self.by_memory(blocks.iter().map(Vec::as_slice)) {
            let got = match memory {
                None => vec![GetOutcome::Failed(MIXED); idx.len()],
                Some(Memory::Host) => {
                    // SAFETY: host spans the caller vouches for, apart.
                    let mut dests: Vec<Dest<'_>> = idx
                        .iter()
                        .map(|&i| Dest::Pieces(unsafe { host_slices(&blocks[i]) }))
                        .collect();
                    let hs: Vec<BlockHash> = idx.iter().map(|&i| hashes[i]).collect();
                    self.get_into_pieces(namespace, &hs, &mut dests).await?
                }
                // SAFETY: the caller's promise, passed on.
                Some(Memory::Device(ordinal)) => unsafe {
                    self.get_staged(Gets {
                        namespace,
                        ordinal,
                        idx: &idx,
                        hashes,
                        blocks,
                    })
                    .await?
                },
            };
            for (i, outcome) in idx.into_iter().zip(got) {
                out[i] = outcome;
            }
        }
        Ok(out)
    }

    /// Stores blocks from memory given by address, host or device (GPU):
    /// `blocks[i].1` are block `i`'s pieces, in order. With `chain`, as
    /// in `put_tagged`; `tags` as there.
    ///
    /// # Safety
    /// Every span must be memory this process may read (host memory, or
    /// device memory of the GPU that `memory_of` names) until the call
    /// returns.
    pub async unsafe fn put_spans(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Vec<Span>)],
        chain: Option<Option<BlockHash>>,
        tags: &[Option<Arc<EngineTag>>],
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let parents = put::parents_of(chain, blocks.iter().map(|(h, _)| *h), tags.len())?;
        let tag = |i: usize| tags.get(i).cloned().flatten();
        let mut out = vec![PutOutcome::Failed(ErrorCode::Internal); blocks.len()];
        for (memory, idx) in self.by_memory(blocks.iter().map(|(_, s)| s.as_slice())) {
            match memory {
                None => {
                    for &i in &idx {
                        out[i] = PutOutcome::Failed(MIXED);
                    }
                }
                Some(Memory::Host) => {
                    // SAFETY: host spans the caller vouches for.
                    let pieces: Vec<Vec<&[u8]>> = idx
                        .iter()
                        .map(|&i| unsafe { host_pieces(&blocks[i].1) })
                        .collect();
                    let values: Vec<(BlockHash, Value<'_>)> = idx
                        .iter()
                        .zip(&pieces)
                        .map(|(&i, p)| (blocks[i].0, Value::Pieces(p)))
                        .collect();
                    let ps: Vec<_> = idx.iter().map(|&i| parents[i]).collect();
                    let ts: Vec<_> = idx.iter().map(|&i| tag(i)).collect();
                    let put = self
                        .put_values(namespace, &values, (&ps, &ts), opts)
                        .await?;
                    for (&i, outcome) in idx.iter().zip(put) {
                        out[i] = outcome;
                    }
                }
                Some(Memory::Device(ordinal)) => {
                    let staged = Staged {
                        ordinal,
                        idx: &idx,
                        blocks,
                        parents: &parents,
                        tags: &tag,
                    };
                    // SAFETY: the caller's promise, passed on.
                    let rest =
                        unsafe { self.put_to_pool(namespace, staged, opts, &mut out) }.await?;
                    if !rest.is_empty() {
                        let staged = Staged {
                            idx: &rest,
                            ..staged
                        };
                        // SAFETY: as above.
                        unsafe { self.put_staged(namespace, staged, opts, &mut out).await? };
                    }
                }
            }
        }
        Ok(out)
    }

    /// The blocks' indexes grouped by the memory they lie in, in order
    /// within each group; `None`: blocks whose pieces lie in different
    /// memories (host and GPU, or two GPUs), which are refused.
    fn by_memory<'s>(
        &self,
        blocks: impl Iterator<Item = &'s [Span]>,
    ) -> Vec<(Option<Memory>, Vec<usize>)> {
        let mut groups: Vec<(Option<Memory>, Vec<usize>)> = Vec::new();
        for (i, spans) in blocks.enumerate() {
            let memory = match self.device() {
                None => Some(Memory::Host),
                Some(_) => {
                    let mut kinds = spans
                        .iter()
                        .filter(|s| s.len > 0)
                        .map(|s| self.memory_of(s.addr));
                    let first = kinds.next().unwrap_or(Memory::Host);
                    kinds.all(|m| m == first).then_some(first)
                }
            };
            match groups.iter_mut().find(|(m, _)| *m == memory) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((memory, vec![i])),
            }
        }
        groups
    }

    /// Waits for the copies up queued on `stage` (if any) and settles the
    /// hits they carry: read, or failed together (and the lane dropped:
    /// a failed lane is not used again).
    fn settle_stage(
        &self,
        stage: &mut Option<Stage>,
        pending: &mut Vec<(usize, usize)>,
        out: &mut [GetOutcome],
    ) {
        let Some(waited) = stage.as_mut().map(Stage::wait) else {
            return;
        };
        if let Err(err) = &waited {
            tracing::warn!(%err, blocks = pending.len(), "blocks could not be copied to the GPU");
            *stage = None;
        }
        for (j, n) in pending.drain(..) {
            out[j] = match waited {
                Ok(()) => GetOutcome::Hit(n),
                Err(_) => GetOutcome::Failed(COPY_FAILED),
            };
        }
    }

    /// The stage in `slot`, made (or swapped for a larger one) to hold
    /// `len` bytes for GPU `ordinal`.
    pub(super) fn stage<'s>(
        &self,
        slot: &'s mut Option<Stage>,
        ordinal: i32,
        len: usize,
    ) -> Result<&'s mut Stage, ClientError> {
        if slot.as_ref().is_none_or(|st| st.buf.len() < len) {
            if let Some(old) = slot.take() {
                self.stages.give(old);
            }
            let device = self
                .device()
                .ok_or_else(|| ClientError::Invalid("no GPU support".into()))?;
            let stage = self
                .stages
                .take(device.as_ref(), ordinal, len)
                .map_err(|e| ClientError::Invalid(format!("GPU staging: {e}")))?;
            *slot = Some(stage);
        }
        Ok(slot.as_mut().expect("made above"))
    }

    /// `get_into_spans` of the blocks `idx`, all on GPU `ordinal`: those
    /// the same-host daemon holds straight from its pool, the rest
    /// through staging.
    async unsafe fn get_staged(&self, gets: Gets<'_>) -> Result<Vec<GetOutcome>, ClientError> {
        // SAFETY: the caller's promise, passed on.
        let mut out = unsafe { self.get_from_pool(gets) }
            .await
            .unwrap_or_else(|| vec![None; gets.idx.len()]);
        let rest: Vec<usize> = (0..out.len()).filter(|&j| out[j].is_none()).collect();
        if !rest.is_empty() {
            let idx: Vec<usize> = rest.iter().map(|&j| gets.idx[j]).collect();
            let rest_gets = Gets { idx: &idx, ..gets };
            // SAFETY: as above.
            let got = unsafe { self.get_through_staging(rest_gets) }.await?;
            for (j, outcome) in rest.into_iter().zip(got) {
                out[j] = Some(outcome);
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every block answered"))
            .collect())
    }

    /// `get_into_spans` of the blocks `idx`, all on GPU `ordinal`, through
    /// pinned staging.
    async unsafe fn get_through_staging(
        &self,
        gets: Gets<'_>,
    ) -> Result<Vec<GetOutcome>, ClientError> {
        let Gets {
            namespace,
            ordinal,
            idx,
            hashes,
            blocks,
        } = gets;
        let sizes: Vec<usize> = idx.iter().map(|&i| total(&blocks[i])).collect();
        let mut out = vec![GetOutcome::Miss; idx.len()];
        let mut stages: [Option<Stage>; 2] = [None, None];
        // Hits copied up on each stage's lane, not yet waited for.
        let mut pending: [Vec<(usize, usize)>; 2] = [Vec::new(), Vec::new()];
        let chunks = chunks(&sizes, self.cfg.device_staging);
        for (k, chunk) in chunks.iter().cloned().enumerate() {
            let s = k % 2;
            self.settle_stage(&mut stages[s], &mut pending[s], &mut out);
            let need: usize = sizes[chunk.clone()].iter().sum();
            let stage = self.stage(&mut stages[s], ordinal, need)?;
            let got = {
                let mut rest = stage.buf.as_mut_slice();
                let mut dests = Vec::with_capacity(chunk.len());
                for &n in &sizes[chunk.clone()] {
                    let (dest, tail) = rest.split_at_mut(n);
                    dests.push(Dest::One(dest));
                    rest = tail;
                }
                let hs: Vec<BlockHash> = chunk.clone().map(|j| hashes[idx[j]]).collect();
                self.get_into_pieces(namespace, &hs, &mut dests).await?
            };
            let mut at = 0;
            for (j, outcome) in chunk.clone().zip(got) {
                let base = stage.buf.as_ptr().wrapping_add(at);
                at += sizes[j];
                let GetOutcome::Hit(n) = outcome else {
                    out[j] = outcome;
                    continue;
                };
                // SAFETY: the block's first `n` bytes lie in the stage;
                // the spans are the caller's; the stage is waited for
                // before it is reused or dropped.
                match unsafe { up(stage, base, n, &blocks[idx[j]]) } {
                    Ok(()) => pending[s].push((j, n)),
                    Err(err) => {
                        tracing::warn!(%err, "a block could not be copied to the GPU");
                        out[j] = GetOutcome::Failed(COPY_FAILED);
                    }
                }
            }
        }
        // The older chunk's copies first: a lane's copies run in order.
        for s in [chunks.len() % 2, (chunks.len() + 1) % 2] {
            self.settle_stage(&mut stages[s], &mut pending[s], &mut out);
        }
        for stage in stages.into_iter().flatten() {
            self.stages.give(stage);
        }
        Ok(out)
    }

    /// `put_spans` of the blocks `staged.idx`, all on one GPU: outcomes
    /// into `out` (indexed as `blocks`).
    async unsafe fn put_staged(
        &self,
        namespace: &Namespace,
        staged: Staged<'_>,
        opts: PutOptions,
        out: &mut [PutOutcome],
    ) -> Result<(), ClientError> {
        let Staged {
            ordinal,
            idx,
            blocks,
            parents,
            tags,
        } = staged;
        let sizes: Vec<usize> = idx.iter().map(|&i| total(&blocks[i].1)).collect();
        let chunks = chunks(&sizes, self.cfg.device_staging);
        let mut stages: [Option<Stage>; 2] = [None, None];
        // Blocks of the chunk in each stage whose copy down was queued.
        let mut queued: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
        // Copies down the chunk `k` into stage `k % 2`.
        let issue = |k: usize,
                     stages: &mut [Option<Stage>; 2],
                     queued: &mut [Vec<usize>; 2],
                     out: &mut [PutOutcome]|
         -> Result<(), ClientError> {
            let s = k % 2;
            let chunk = chunks[k].clone();
            let need: usize = sizes[chunk.clone()].iter().sum();
            let stage = self.stage(&mut stages[s], ordinal, need)?;
            let mut at = 0;
            for j in chunk {
                let base = stage.buf.as_ptr().wrapping_add(at);
                at += sizes[j];
                // SAFETY: the block's bytes fit the stage at `base`; the
                // spans are the caller's; the stage is waited for before
                // it is read, reused or dropped.
                match unsafe { down(stage, base, &blocks[idx[j]].1) } {
                    Ok(()) => queued[s].push(j),
                    Err(err) => {
                        tracing::warn!(%err, "a block could not be copied from the GPU");
                        out[idx[j]] = PutOutcome::Failed(COPY_FAILED);
                    }
                }
            }
            Ok(())
        };
        if !chunks.is_empty() {
            issue(0, &mut stages, &mut queued, out)?;
        }
        for k in 0..chunks.len() {
            let s = k % 2;
            let ready = std::mem::take(&mut queued[s]);
            let waited = stages[s].as_mut().expect("issued").wait();
            // The next chunk comes down while this one goes out.
            if k + 1 < chunks.len() {
                issue(k + 1, &mut stages, &mut queued, out)?;
            }
            if let Err(err) = waited {
                tracing::warn!(%err, blocks = ready.len(), "blocks could not be copied from the GPU");
                for &j in &ready {
                    out[idx[j]] = PutOutcome::Failed(COPY_FAILED);
                }
                // A failed lane is not used again.
                stages[s] = None;
                continue;
            }
            let stage = stages[s].as_ref().expect("issued");
            let offsets: Vec<usize> = chunks[k]
                .clone()
                .scan(0, |at, j| {
                    let o = *at;
                    *at += sizes[j];
                    Some(o)
                })
                .collect();
            let first = chunks[k].start;
            let values: Vec<(BlockHash, Value<'_>)> = ready
                .iter()
                .map(|&j| {
                    let o = offsets[j - first];
                    (
                        blocks[idx[j]].0,
                        Value::One(&stage.buf.as_slice()[o..o + sizes[j]]),
                    )
                })
                .collect();
            let ps: Vec<_> = ready.iter().map(|&j| parents[idx[j]]).collect();
            let ts: Vec<_> = ready.iter().map(|&j| tags(idx[j])).collect();
            let put = self
                .put_values(namespace, &values, (&ps, &ts), opts)
                .await?;
            for (&j, outcome) in ready.iter().zip(put) {
                out[idx[j]] = outcome;
            }
        }
        for stage in stages.into_iter().flatten() {
            self.stages.give(stage);
        }
        Ok(())
    }
}

impl Client {
    /// Copies bytes already in host memory into memory given by address,
    /// host or device (GPU): `pieces[i]` is a source and the spans its
    /// bytes fill in order (as many as it has). For parts of blocks read
    /// and checked before, such as a layer's slice of each block of a
    /// read session. Device spans are reached through pinned staging.
    /// Per piece: done, or why not (`MIXED`: spans in two memories;
    /// `COPY_FAILED`).
    ///
    /// # Safety
    /// Every span must be memory this process may write (host memory, or
    /// device memory of the GPU that `memory_of` names) until the call
    /// returns, apart from every other span and from every source.
    pub unsafe fn copy_into_spans(
        &self,
        pieces: &[(&[u8], Vec<Span>)],
    ) -> Vec<Result<(), ErrorCode>> {
        let mut out = vec![Ok(()); pieces.len()];
        for (memory, idx) in self.by_memory(pieces.iter().map(|(_, spans)| spans.as_slice())) {
            match memory {
                None => idx.into_iter().for_each(|i| out[i] = Err(MIXED)),
                Some(Memory::Host) => {
                    for i in idx {
                        let (mut src, spans) = (pieces[i].0, &pieces[i].1);
                        // SAFETY: host spans the caller vouches for, apart.
                        for dst in unsafe { host_slices(spans) } {
                            let n = dst.len().min(src.len());
                            mooncake_proto::checksum::copy(&mut dst[..n], &src[..n]);
                            src = &src[n..];
                        }
                    }
                }
                // SAFETY: the caller's promise, passed on.
                Some(Memory::Device(ordinal)) => unsafe {
                    self.copy_up(ordinal, pieces, &idx, &mut out)
                },
            }
        }
        out
    }

    /// `copy_into_spans` of the pieces `idx`, all on GPU `ordinal`: a
    /// stage's worth at a time, copied into the stage and up from it.
    unsafe fn copy_up(
        &self,
        ordinal: i32,
        pieces: &[(&[u8], Vec<Span>)],
        idx: &[usize],
        out: &mut [Result<(), ErrorCode>],
    ) {
        let sizes: Vec<usize> = idx.iter().map(|&i| pieces[i].0.len()).collect();
        let mut slot = None;
        for chunk in chunks(&sizes, self.cfg.device_staging) {
            let need = sizes[chunk.clone()].iter().sum();
            let stage = match self.stage(&mut slot, ordinal, need) {
                Ok(stage) => stage,
                Err(err) => {
                    tracing::warn!(%err, "no staging to copy to the GPU");
                    chunk.for_each(|j| out[idx[j]] = Err(COPY_FAILED));
                    continue;
                }
            };
            let mut at = 0;
            for j in chunk.clone() {
                let (src, spans) = (pieces[idx[j]].0, &pieces[idx[j]].1);
                stage.buf.as_mut_slice()[at..at + src.len()].copy_from_slice(src);
                let base = stage.buf.as_ptr().wrapping_add(at);
                at += src.len();
                // SAFETY: the source's bytes lie in the stage at `base`;
                // the spans are the caller's; the stage is waited for
                // below, before it is reused or given back.
                if let Err(err) = unsafe { up(stage, base, src.len(), spans) } {
                    tracing::warn!(%err, "bytes could not be copied to the GPU");
                    out[idx[j]] = Err(COPY_FAILED);
                }
            }
            if let Err(err) = stage.wait() {
                tracing::warn!(%err, "bytes could not be copied to the GPU");
                chunk.for_each(|j| out[idx[j]] = Err(COPY_FAILED));
                // A failed lane is not used again.
                slot = None;
            }
        }
        if let Some(stage) = slot {
            self.stages.give(stage);
        }
    }
}

/// What `get_staged` reads: the blocks `idx` of `blocks` (their hashes in
/// `hashes`), all on GPU `ordinal`.
#[derive(Clone, Copy)]
pub(super) struct Gets<'a> {
    pub(super) namespace: &'a Namespace,
    pub(super) ordinal: i32,
    pub(super) idx: &'a [usize],
    pub(super) hashes: &'a [BlockHash],
    pub(super) blocks: &'a [Vec<Span>],
}

/// What `put_staged` puts: the blocks `idx` of `blocks`, on GPU `ordinal`.
#[derive(Clone, Copy)]
pub(super) struct Staged<'a> {
    pub(super) ordinal: i32,
    pub(super) idx: &'a [usize],
    pub(super) blocks: &'a [(BlockHash, Vec<Span>)],
    pub(super) parents: &'a [Option<BlockHash>],
    pub(super) tags: &'a (dyn Fn(usize) -> Option<Arc<EngineTag>> + Sync),
}

/// Consecutive runs of blocks whose sizes add up to at most `limit` (a
/// block larger than that alone).
fn chunks(sizes: &[usize], limit: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && sum + n > limit {
            out.push(start..i);
            (start, sum) = (i, 0);
        }
        sum += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

pub(super) fn total(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.len).sum()
}

/// The spans as slices (host memory).
///
/// # Safety
/// Each span must be host memory, writable while the slices live, and
/// apart from every other.
unsafe fn host_slices<'a>(spans: &[Span]) -> Vec<&'a mut [u8]> {
    spans
        .iter()
        .filter(|s| s.len > 0)
        // SAFETY: the caller's promise.
        .map(|s| unsafe { std::slice::from_raw_parts_mut(s.addr as *mut u8, s.len) })
        .collect()
}

/// The spans as slices (host memory), to read.
///
/// # Safety
/// Each span must be host memory, readable while the slices live.
unsafe fn host_pieces<'a>(spans: &[Span]) -> Vec<&'a [u8]> {
    spans
        .iter()
        .filter(|s| s.len > 0)
        // SAFETY: the caller's promise.
        .map(|s| unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len) })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_fill_up_to_the_limit_and_a_large_block_goes_alone() {
        assert_eq!(chunks(&[], 10), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(chunks(&[4, 4, 4], 10), vec![0..2, 2..3]);
        assert_eq!(chunks(&[4, 20, 4], 10), vec![0..1, 1..2, 2..3]);
        assert_eq!(chunks(&[5, 5, 5, 5], 10), vec![0..2, 2..4]);
        assert_eq!(chunks(&[0, 0], 10), vec![0..2]);
    }
}
