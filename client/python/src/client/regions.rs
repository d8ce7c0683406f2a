//! Between Python memory and the store: the regions of a batch, checked
//! and handed to the client.

use std::sync::Arc;

use mooncake_client::bindings::except;
use mooncake_client::device::{Memory, Span};
use mooncake_client::PutOptions;
use mooncake_proto::message::EngineTag;
use mooncake_proto::BlockHash;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::Client;
use crate::buffers::{overlapping, Region};
use crate::codes;
use crate::keys::{hash_of, hashes_of};
use crate::pieces::Pieces;

impl Client {
    pub(super) fn get_regions(
        &self,
        py: Python<'_>,
        hashes: Vec<BlockHash>,
        regions: Vec<Region>,
    ) -> Vec<i64> {
        let clash = overlapping(&regions);
        let items: Vec<(BlockHash, Region)> = hashes.into_iter().zip(regions).collect();
        except(items, &clash, codes::INVALID_PARAMS, |items| {
            let n = items.len();
            let (client, ns) = (&self.inner, &self.namespace);
            let result = py.detach(|| {
                let hashes: Vec<BlockHash> = items.iter().map(|(h, _)| *h).collect();
                let blocks: Vec<Vec<Span>> = items.iter().map(|(_, r)| vec![r.span()]).collect();
                // SAFETY: every region is writable memory (host, or a
                // GPU's as the client's driver tells) that stays valid for
                // the call (a held Python object, or a registered range),
                // and none of these overlaps another.
                self.run(unsafe { client.get_into_spans(ns, &hashes, &blocks) })
            });
            match result {
                Ok(outcomes) => outcomes.into_iter().map(codes::of_get).collect(),
                Err(err) => vec![codes::of_error(&err); n],
            }
        })
    }

    /// Stores `regions` under `hashes`; with `chain`, as consecutive
    /// blocks of one chain extending the given parent (or starting one);
    /// `tags`: the engine's names of the blocks, or empty.
    pub(super) fn put_regions(
        &self,
        py: Python<'_>,
        (hashes, regions): (Vec<BlockHash>, Vec<Region>),
        chain: Option<Option<BlockHash>>,
        tags: &[Option<Arc<EngineTag>>],
        opts: PutOptions,
    ) -> Vec<i64> {
        let n = regions.len();
        let (client, ns) = (&self.inner, &self.namespace);
        let result = py.detach(|| {
            let blocks: Vec<(BlockHash, Vec<Span>)> = hashes
                .iter()
                .zip(&regions)
                .map(|(h, r)| (*h, vec![r.span()]))
                .collect();
            // SAFETY: every region is readable memory (host, or a GPU's)
            // that stays valid for the call.
            self.run(unsafe { client.put_spans(ns, &blocks, chain, tags, opts) })
        });
        match result {
            Ok(outcomes) => outcomes.into_iter().map(codes::of_put).collect(),
            Err(err) => vec![codes::of_error(&err); n],
        }
    }

    /// Runs the batch `f` on the keys whose registered range is valid;
    /// the others answer `INVALID_PARAMS` (nothing is read or written
    /// outside a registered buffer).
    pub(super) fn on_registered(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        f: impl FnOnce(&Self, Python<'_>, Vec<BlockHash>, Vec<Region>) -> Vec<i64>,
    ) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        if hashes.len() != ptrs.len() || ptrs.len() != sizes.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys, {} addresses and {} sizes",
                hashes.len(),
                ptrs.len(),
                sizes.len()
            )));
        }
        let outside: Vec<bool> = ptrs
            .iter()
            .zip(&sizes)
            .map(|(&p, &n)| !self.registered.covers(p, n))
            .collect();
        let items: Vec<(BlockHash, Region)> = hashes
            .into_iter()
            .zip(
                ptrs.iter()
                    .zip(&sizes)
                    .map(|(&p, &n)| Region::registered(p, n)),
            )
            .collect();
        Ok(except(items, &outside, codes::INVALID_PARAMS, |items| {
            let (hashes, regions) = items.into_iter().unzip();
            f(self, py, hashes, regions)
        }))
    }
}

impl Client {
    /// `copy_into_ptr_lists` of the sources (addresses, lengths) into
    /// `pieces`: those refused answer `INVALID_PARAMS`.
    pub(super) fn copy_into_pieces(
        &self,
        py: Python<'_>,
        (ptrs, lens): (&[usize], &[usize]),
        pieces: &Pieces,
    ) -> Vec<i64> {
        let unfit = pieces.unfit_to_write(&self.registered);
        let reads_over = pieces.overlapping_sources(ptrs, lens);
        let refused: Vec<bool> = (0..ptrs.len())
            .map(|i| {
                unfit[i]
                    || reads_over[i]
                    || pieces.total(i) != lens[i]
                    || !self.registered.covers(ptrs[i], lens[i])
                    || self.inner.memory_of(ptrs[i]) != Memory::Host
            })
            .collect();
        except(
            (0..ptrs.len()).collect(),
            &refused,
            codes::INVALID_PARAMS,
            |items: Vec<usize>| {
                let copies: Vec<(&[u8], Vec<Span>)> = items
                    .iter()
                    .map(|&i| {
                        // SAFETY: the source lies in registered host memory,
                        // which stays mapped while registered (checked above).
                        let src =
                            unsafe { std::slice::from_raw_parts(ptrs[i] as *const u8, lens[i]) };
                        (src, pieces.spans(i))
                    })
                    .collect();
                // SAFETY: every piece lies in a registered buffer (host or
                // GPU memory), apart from every other piece and every source
                // (checked above).
                let done = py.detach(|| unsafe { self.inner.copy_into_spans(&copies) });
                items
                    .iter()
                    .zip(done)
                    .map(|(&i, r)| r.map_or_else(codes::of_code, |()| lens[i] as i64))
                    .collect()
            },
        )
    }
}

/// What `put_regions` takes for a put that is (`chain`) or is not part of a
/// chain: the chain's parent, if it extends one.
pub(super) fn chain_of(
    chain: bool,
    parent: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Option<BlockHash>>> {
    match (chain, parent) {
        (true, parent) => Ok(Some(parent.map(hash_of).transpose()?)),
        (false, None) => Ok(None),
        (false, Some(_)) => Err(PyValueError::new_err("parent needs chain=True")),
    }
}

/// The memory of each object of an iterable with the buffer protocol (or
/// CUDA tensors).
pub(super) fn regions_of(
    objects: &Bound<'_, PyAny>,
    writable: bool,
    client: &mooncake_client::Client,
) -> PyResult<Vec<Region>> {
    objects
        .try_iter()?
        .map(|o| Region::of_object(&o?, writable, client))
        .collect()
}

pub(super) fn check_lengths(keys: usize, other: usize, what: &str) -> PyResult<()> {
    if keys != other {
        return Err(PyValueError::new_err(format!(
            "{keys} keys but {other} {what}"
        )));
    }
    Ok(())
}
