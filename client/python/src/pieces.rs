//! Blocks made of pieces (K and V, or one per layer, each in a registered
//! buffer): their address lists, and the staging buffer a block is gathered
//! into before a put and lands in before it is spread over its pieces.

use mooncake_proto::BlockHash;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::{Region, Registered};
use crate::keys::hashes_of;

/// Most bytes kept between calls for blocks made of pieces.
const MAX_STAGING: usize = 1 << 30;

/// A buffer reused by the calls on blocks made of pieces: a block is
/// gathered there before a put and lands there before it is spread over
/// its pieces. Reused, so that each call copies through memory already
/// faulted in: fresh pages for every call cost more than the copy itself
/// (page faults and zeroing, measured with perf). A call that finds it in
/// use by another thread takes a buffer of its own.
#[derive(Default)]
pub(crate) struct Staging(parking_lot::Mutex<Vec<u8>>);

impl Staging {
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = std::mem::take(&mut *self.0.lock());
        if buf.len() < len {
            buf.resize(len, 0);
        }
        buf
    }

    pub(crate) fn give_back(&self, buf: Vec<u8>) {
        let mut kept = self.0.lock();
        if buf.len() <= MAX_STAGING && buf.len() > kept.len() {
            *kept = buf;
        }
    }
}

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

    pub(crate) fn len(&self, i: usize) -> usize {
        self.sizes[i].iter().sum()
    }

    /// Where each of `items`' blocks starts in a staging buffer holding
    /// them one after another, and the buffer's length.
    pub(crate) fn staged<T>(&self, items: &[(T, usize)]) -> (Vec<usize>, usize) {
        let mut at = 0;
        let starts = items
            .iter()
            .map(|(_, i)| {
                let start = at;
                at += self.len(*i);
                start
            })
            .collect();
        (starts, at)
    }

    /// Each of `items`' blocks in `staging`, as a region to read or write.
    pub(crate) fn regions<T>(
        &self,
        items: &[(T, usize)],
        starts: &[usize],
        staging: &mut [u8],
    ) -> Vec<Region> {
        items
            .iter()
            .zip(starts)
            .map(|((_, i), &at)| {
                Region::registered(staging[at..].as_mut_ptr() as usize, self.len(*i))
            })
            .collect()
    }

    /// Block `i`'s pieces, gathered into `out` (its length).
    ///
    /// # Safety
    /// Every piece must be readable for the call.
    pub(crate) unsafe fn gather(&self, i: usize, out: &mut [u8]) {
        let mut at = 0;
        for (&p, &n) in self.ptrs[i].iter().zip(&self.sizes[i]) {
            // SAFETY: the caller's promise.
            out[at..at + n].copy_from_slice(unsafe { Region::registered(p, n).as_slice() });
            at += n;
        }
    }

    /// Spreads `bytes` over block `i`'s pieces, in order.
    ///
    /// # Safety
    /// Every piece must be writable for the call, and no piece of any
    /// block may overlap another.
    pub(crate) unsafe fn scatter(&self, i: usize, mut bytes: &[u8]) {
        for (&p, &n) in self.ptrs[i].iter().zip(&self.sizes[i]) {
            let take = n.min(bytes.len());
            // SAFETY: the caller's promise.
            unsafe { Region::registered(p, take).as_mut_slice() }.copy_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
    }
}
