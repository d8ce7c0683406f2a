//! Blocks between GPU memory and the same-host daemon's pool with no
//! staging copy (`transport::shm::device`): the pool is registered with
//! the GPU, whose copy engines then copy blocks straight out of it (gets)
//! and into room reserved there (puts). Blocks the pool does not hold, or
//! that the meta service places elsewhere, go through staging (`device`).

use super::device::{total, Gets, Staged};
use super::*;
use crate::device::{Span, Stage, COPY_FAILED};
use crate::transport::shm::{Direct, FromDevice, ShmLink};
use mooncake_proto::message::Tier;

impl Client {
    /// Of the blocks `idx`, those the same-host daemon holds in DRAM, read
    /// straight from its pool into GPU memory (`transport::shm::device`):
    /// an outcome for each block read (or failed) so, `None` for the rest.
    /// `None` without a same-host link whose pool the GPU reaches.
    pub(super) async unsafe fn get_from_pool(
        &self,
        gets: Gets<'_>,
    ) -> Option<Vec<Option<GetOutcome>>> {
        let Gets {
            namespace,
            ordinal,
            idx,
            hashes,
            blocks,
        } = gets;
        let device = self.device()?;
        let link = self.shm_connect(None)?;
        if !link.on_device(device.as_ref()) {
            return None;
        }
        // Only blocks whose copy this daemon holds in DRAM are asked of it
        // (it counts what it does not hold as a miss of its own).
        let all: Vec<BlockHash> = idx.iter().map(|&i| hashes[i]).collect();
        let mut locations: Vec<Option<Location>> = all
            .iter()
            .map(|h| self.locations.get(&BlockKey::new(namespace.clone(), *h)))
            .collect();
        let unknown: Vec<usize> = (0..all.len()).filter(|&j| locations[j].is_none()).collect();
        self.locate(namespace, &all, &unknown, &mut locations)
            .await
            .ok()?;
        let here: Vec<usize> = (0..all.len())
            .filter(|&j| locations[j].is_some_and(|l| self.in_pool_of(&l, &link.addr)))
            .collect();
        let mut out = vec![None; idx.len()];
        if here.is_empty() {
            return Some(out);
        }
        let mut slot = None;
        let stage = self
            .stage(&mut slot, ordinal, 1)
            .inspect_err(|err| tracing::warn!(%err, "no GPU lane"))
            .ok()?;
        let hs: Vec<BlockHash> = here.iter().map(|&j| all[j]).collect();
        let spans: Vec<&[Span]> = here.iter().map(|&j| &blocks[idx[j]][..]).collect();
        // SAFETY: the caller's promise, passed on. Bounded as every call
        // is: a daemon that stops answering is left for staging.
        let asked = unsafe { link.get_to_device(namespace, &hs, &spans, stage) };
        let answer = tokio::time::timeout(self.cfg.timeout, asked)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
        let (direct, copied) = match answer {
            Ok(answer) => answer,
            Err(err) => {
                tracing::debug!(%err, "same-host pool unreachable; reading through staging");
                // Dropping the stage waits for what it queued, before any
                // other copy into the same memory.
                drop(slot);
                return None;
            }
        };
        if let Err(err) = &copied {
            tracing::warn!(%err, "blocks could not be copied to the GPU from the same-host pool");
            slot = None;
        }
        let mut hits = 0;
        for (&j, d) in here.iter().zip(direct) {
            out[j] = match d {
                Direct::Hit(n) if copied.is_ok() => {
                    hits += 1;
                    Some(GetOutcome::Hit(n))
                }
                Direct::Hit(_) => Some(GetOutcome::Failed(COPY_FAILED)),
                Direct::TooLarge => Some(GetOutcome::Failed(ErrorCode::TooLarge)),
                Direct::Elsewhere => None,
            };
        }
        self.transports.read(TransportKind::Shm, hits);
        if let Some(stage) = slot {
            self.stages.give(stage);
        }
        Some(out)
    }

    /// Of the device blocks `staged.idx`, those the meta service places
    /// in the same-host daemon's pool alone, put straight from GPU memory
    /// into their rooms there (`transport::shm::device`), their outcomes
    /// into `out` (indexed as `staged.blocks`). Returns the rest (placed
    /// elsewhere, or with more than one copy), for staging: all of them
    /// without a same-host link whose pool the GPU reaches.
    pub(super) async unsafe fn put_to_pool(
        &self,
        namespace: &Namespace,
        staged: Staged<'_>,
        opts: PutOptions,
        out: &mut [PutOutcome],
    ) -> Result<Vec<usize>, ClientError> {
        let replicas = self.copies_of(opts)?;
        let link = match (replicas, self.device(), self.shm_connect(None)) {
            (0 | 1, Some(device), Some(link)) if link.on_device(device.as_ref()) => link,
            _ => return Ok(staged.idx.to_vec()),
        };
        let started = std::time::Instant::now();
        let tags: Vec<_> = staged.idx.iter().map(|&i| (staged.tags)(i)).collect();
        let parents: Vec<_> = staged.idx.iter().map(|&i| staged.parents[i]).collect();
        let mut lanes = [None, None];
        // Blocks put here, and those left for staging.
        let (mut done, mut rest) = (Vec::new(), Vec::new());
        let mut start = 0;
        while start < staged.idx.len() {
            let end = put::chunk_end(&tags, start);
            let chunk = ToPool {
                link: &link,
                idx: &staged.idx[start..end],
                named: (&parents[start..end], &tags[start..end]),
            };
            // SAFETY: the caller's promise, passed on.
            let put =
                unsafe { self.put_chunk_to_pool(namespace, staged, chunk, replicas, &mut lanes) };
            let (outcomes, elsewhere) = self.deadline("put", put).await?;
            let mut left = vec![false; outcomes.len()];
            for j in elsewhere {
                left[j] = true;
                rest.push(staged.idx[start + j]);
            }
            for (j, outcome) in outcomes.into_iter().enumerate() {
                if !left[j] {
                    out[staged.idx[start + j]] = outcome;
                    done.push(staged.idx[start + j]);
                }
            }
            start = end;
        }
        for stage in lanes.into_iter().flatten() {
            self.stages.give(stage);
        }
        if let Some(m) = &self.cfg.metrics {
            let outcomes: Vec<PutOutcome> = done.iter().map(|&i| out[i]).collect();
            let sizes = done.iter().map(|&i| total(&staged.blocks[i].1));
            m.puts(started.elapsed().as_secs_f64(), &outcomes, sizes);
        }
        Ok(rest)
    }

    /// `put_to_pool` of one chunk of blocks (one meta reservation and
    /// commit): an outcome per block of `chunk.idx`, and the positions in
    /// it of the blocks left for staging (their places given up).
    async unsafe fn put_chunk_to_pool(
        &self,
        namespace: &Namespace,
        staged: Staged<'_>,
        chunk: ToPool<'_>,
        replicas: u8,
        lanes: &mut [Option<Stage>; 2],
    ) -> Result<(Vec<PutOutcome>, Vec<usize>), ClientError> {
        let ToPool { link, idx, named } = chunk;
        let blocks = staged.blocks;
        let sizes = put::sizes_of(idx.iter().map(|&i| (blocks[i].0, total(&blocks[i].1))))?;
        let slots = self.place(namespace, &sizes, named.0, replicas).await?;
        let mut wrote = put::Wrote::new(idx.len());
        let (mut here, mut elsewhere) = (Vec::new(), Vec::new());
        let mut daemon = None;
        for (j, slot) in slots.iter().enumerate() {
            let Slot::Place { copies, .. } = slot else {
                continue;
            };
            let only = copies.iter().next().filter(|_| copies.len() == 1);
            // One daemon: the first placed in the link's pool (another id
            // at the same address would be a stale one).
            let ours = |d: u32| match daemon {
                Some(first) => d == first,
                None => self.peer(d).is_ok_and(|p| p.addr == link.addr),
            };
            match only.filter(|&d| ours(d)) {
                Some(d) => {
                    daemon = Some(d);
                    here.push(j);
                }
                None => {
                    wrote.not_written(j, ErrorCode::Unavailable);
                    elsewhere.push(j);
                }
            }
        }
        if let Some(daemon) = daemon {
            let puts: Vec<FromDevice<'_>> = here
                .iter()
                .map(|&j| FromDevice {
                    hash: blocks[idx[j]].0,
                    spans: &blocks[idx[j]].1,
                    parent: named.0[j],
                    continues: matches!(
                        slots[j],
                        Slot::Place {
                            continues: true,
                            ..
                        }
                    ),
                    tag: named.1[j].clone(),
                })
                .collect();
            let [one, other] = lanes;
            let stages = [
                self.stage(one, staged.ordinal, 1)?,
                self.stage(other, staged.ordinal, 1)?,
            ];
            let group = self.cfg.device_staging;
            // SAFETY: the caller's promise, passed on; the pool is
            // registered with this GPU (`put_to_pool`).
            match unsafe { link.put_from_device(namespace, &puts, group, stages) }.await {
                Ok((written, copied)) => {
                    if let Err(err) = copied {
                        tracing::warn!(%err, "blocks could not be copied from the GPU into the same-host pool");
                        // A failed lane is not used again.
                        *lanes = [None, None];
                    }
                    self.transports.wrote(TransportKind::Shm, stored(&written));
                    // The blocks after a failed copy go through staging.
                    for &j in &here[written.len()..] {
                        wrote.not_written(j, ErrorCode::Unavailable);
                        elsewhere.push(j);
                    }
                    let given: Vec<_> = here.iter().map(|&j| (j, None)).collect();
                    wrote.record(daemon, &given[..written.len()], Ok(written));
                }
                Err(err) => {
                    tracing::debug!(%err, "same-host pool unreachable; putting through staging");
                    for &j in &here {
                        wrote.not_written(j, ErrorCode::Unavailable);
                    }
                    elsewhere.extend(here);
                }
            }
        }
        let outcomes = self
            .settle(namespace, &sizes, &slots, wrote, named, replicas)
            .await?;
        Ok((outcomes, elsewhere))
    }

    /// Whether a copy of the block at `location` lies in the DRAM of the
    /// daemon at `addr`.
    fn in_pool_of(&self, location: &Location, addr: &str) -> bool {
        location
            .daemons
            .with_tiers()
            .any(|(d, tier)| tier == Tier::Dram && self.peer(d).is_ok_and(|p| p.addr == addr))
    }
}

/// One chunk of `put_to_pool`: the blocks `idx`, their parents and tags,
/// and the same-host link they go through.
struct ToPool<'a> {
    link: &'a ShmLink,
    idx: &'a [usize],
    named: (&'a [Option<BlockHash>], &'a [Option<Arc<EngineTag>>]),
}
