//! Blocks made of pieces (K and V, or one per layer, each in a registered
//! buffer): their address lists, checked against the registered buffers,
//! and the pieces as slices that the client reads into and writes from in
//! place.

use mooncake_proto::BlockHash;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::Registered;
use crate::keys::hashes_of;
use mooncake_client::device::Span;

/// Blocks made of pieces: for each key, address ranges of registered
/// buffers that make its bytes in order (K and V, or one per layer).
pub(crate) struct Pieces {
    ptrs: Vec<Vec<usize>>,
    sizes: Vec<Vec<usize>>,
}

impl Pieces {
    /// The keys' hashes and their blocks' pieces.
    pub(crate) fn of(
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> PyResult<(Vec<BlockHash>, Pieces)> {
        let hashes = hashes_of(keys)?;
        let pieces = Pieces::new(hashes.len(), ptrs, sizes)?;
        Ok((hashes, pieces))
    }

    pub(crate) fn new(
        keys: usize,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> PyResult<Pieces> {
        let shapes_match = ptrs.len() == keys
            && sizes.len() == keys
            && ptrs.iter().zip(&sizes).all(|(p, s)| p.len() == s.len());
        if !shapes_match {
            return Err(PyValueError::new_err(format!(
                "{keys} keys, but address and size lists of other shapes"
            )));
        }
        Ok(Pieces { ptrs, sizes })
    }

    /// Whether every piece of block `i` lies inside a registered buffer
    /// (and it has at least one).
    pub(crate) fn registered(&self, i: usize, registered: &Registered) -> bool {
        !self.ptrs[i].is_empty()
            && self.ptrs[i]
                .iter()
                .zip(&self.sizes[i])
                .all(|(&p, &n)| registered.covers(p, n))
    }

    /// For each block, whether reading into it must be refused: a piece
    /// overlaps another piece (of any block), or lies outside registered
    /// memory.
    pub(crate) fn unfit_to_write(&self, registered: &Registered) -> Vec<bool> {
        let spans: Vec<(usize, usize)> = self
            .ptrs
            .iter()
            .zip(&self.sizes)
            .flat_map(|(p, s)| p.iter().copied().zip(s.iter().copied()))
            .collect();
        let mut clash = mooncake_client::bindings::overlapping(&spans).into_iter();
        (0..self.ptrs.len())
            .map(|i| {
                let overlaps = self.ptrs[i]
                    .iter()
                    .fold(false, |any, _| clash.next().unwrap_or(true) | any);
                overlaps || !self.registered(i, registered)
            })
            .collect()
    }

    /// Block `i`'s length: its pieces' sizes added up.
    pub(crate) fn total(&self, i: usize) -> usize {
        self.sizes[i].iter().sum()
    }

    /// For each block, whether a piece of it overlaps one of the sources
    /// (`lens[j]` bytes at `ptrs[j]`), which are read while the pieces are
    /// written.
    pub(crate) fn overlapping_sources(&self, ptrs: &[usize], lens: &[usize]) -> Vec<bool> {
        let mut sources: Vec<(usize, usize)> = ptrs
            .iter()
            .zip(lens)
            .map(|(&p, &n)| (p, p.saturating_add(n)))
            .filter(|(start, end)| end > start)
            .collect();
        sources.sort_unstable();
        // Merged into ranges apart from each other, in order.
        let mut merged: Vec<(usize, usize)> = Vec::new();
        for (start, end) in sources {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        let hits = |p: usize, n: usize| {
            let end = p.saturating_add(n);
            // The last merged range starting before the piece ends reaches
            // furthest of those that could meet it.
            let k = merged.partition_point(|&(start, _)| start < end);
            n > 0 && k > 0 && merged[k - 1].1 > p
        };
        (0..self.ptrs.len())
            .map(|i| {
                self.ptrs[i]
                    .iter()
                    .zip(&self.sizes[i])
                    .any(|(&p, &n)| hits(p, n))
            })
            .collect()
    }

    /// Block `i`'s pieces, in order, as spans of memory.
    pub(crate) fn spans(&self, i: usize) -> Vec<Span> {
        self.ptrs[i]
            .iter()
            .zip(&self.sizes[i])
            .map(|(&p, &n)| Span::new(p, n))
            .collect()
    }
}
