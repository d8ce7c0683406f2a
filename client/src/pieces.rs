//! A block's bytes in the caller's memory: one buffer, or several pieces
//! that make the block when joined in order (a page's K and V, or one
//! piece per layer, each in its own place of a KV pool). Every data path
//! reads into and writes from the pieces in place: no staging copy, and
//! the checksum is computed over the pieces as if they were one buffer.

use mooncake_proto::checksum::{self, Running, CHUNK};

/// Where a block that is read lands.
#[derive(Debug)]
pub enum Dest<'b> {
    One(&'b mut [u8]),
    /// The block's bytes spread over these, in order.
    Pieces(Vec<&'b mut [u8]>),
}

impl<'b> From<&'b mut [u8]> for Dest<'b> {
    fn from(buf: &'b mut [u8]) -> Self {
        Dest::One(buf)
    }
}

impl<'b> Dest<'b> {
    /// Bytes it holds.
    pub fn len(&self) -> usize {
        match self {
            Dest::One(buf) => buf.len(),
            Dest::Pieces(pieces) => pieces.iter().map(|p| p.len()).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same memory, borrowed for a shorter while (one read attempt).
    pub fn reborrow(&mut self) -> Dest<'_> {
        match self {
            Dest::One(buf) => Dest::One(buf),
            Dest::Pieces(pieces) => Dest::Pieces(pieces.iter_mut().map(|p| &mut **p).collect()),
        }
    }

    /// Its first `len` bytes as one slice, where they lie in one piece.
    pub fn contiguous(&mut self, len: usize) -> Option<&mut [u8]> {
        let first = match self {
            Dest::One(buf) => buf,
            Dest::Pieces(pieces) => pieces.iter_mut().find(|p| !p.is_empty())?,
        };
        first.get_mut(..len)
    }

    /// Its first `len` bytes, piece by piece, in order (empty pieces left
    /// out), with no allocation: the get path walks them for every block.
    pub fn pieces_mut(&mut self, mut len: usize) -> impl Iterator<Item = &mut [u8]> + use<'_, 'b> {
        let (one, many): (Option<&mut [u8]>, &mut [&mut [u8]]) = match self {
            Dest::One(buf) => (Some(&mut **buf), &mut []),
            Dest::Pieces(pieces) => (None, &mut pieces[..]),
        };
        one.into_iter()
            .chain(many.iter_mut().map(|p| &mut **p))
            .map_while(move |piece| {
                (len > 0).then(|| {
                    let take = piece.len().min(len);
                    len -= take;
                    &mut piece[..take]
                })
            })
            .filter(|piece| !piece.is_empty())
    }

    /// Copies `src` into its first `src.len()` bytes and returns their
    /// checksum: of the bytes stored, hashed while they are in cache (one
    /// fused pass into a single buffer).
    ///
    /// # Panics
    ///
    /// If `src` is longer than the destination.
    pub fn copy_with_checksum(&mut self, src: &[u8]) -> u64 {
        assert!(
            src.len() <= self.len(),
            "copy_with_checksum: the block does not fit"
        );
        if let Some(buf) = self.contiguous(src.len()) {
            return checksum::copy_with_checksum(buf, src);
        }
        let mut running = Running::default();
        let mut at = 0;
        for piece in self.pieces_mut(src.len()) {
            for step in piece.chunks_mut(CHUNK) {
                checksum::copy(step, &src[at..at + step.len()]);
                running.update(step);
                at += step.len();
            }
        }
        running.finish()
    }

    /// Copies `src` to its bytes from `at` on (a part of a block that
    /// arrives in several parts).
    ///
    /// # Panics
    ///
    /// If the part does not fit.
    pub fn write_at(&mut self, mut at: usize, mut src: &[u8]) {
        assert!(
            at + src.len() <= self.len(),
            "write_at: the part does not fit"
        );
        for piece in self.pieces_mut(at + src.len()) {
            if at >= piece.len() {
                at -= piece.len();
                continue;
            }
            let n = (piece.len() - at).min(src.len());
            checksum::copy(&mut piece[at..at + n], &src[..n]);
            src = &src[n..];
            at = 0;
        }
    }

    /// The checksum of its first `len` bytes.
    pub fn checksum(&mut self, len: usize) -> u64 {
        let mut running = Running::default();
        for piece in self.pieces_mut(len) {
            running.update(piece);
        }
        running.finish()
    }
}

/// Where a block that is written comes from.
#[derive(Debug, Clone, Copy)]
pub enum Value<'v> {
    One(&'v [u8]),
    /// The block is these, joined in order.
    Pieces(&'v [&'v [u8]]),
}

impl<'v> From<&'v [u8]> for Value<'v> {
    fn from(bytes: &'v [u8]) -> Self {
        Value::One(bytes)
    }
}

impl<'v> Value<'v> {
    pub fn len(&self) -> usize {
        match self {
            Value::One(bytes) => bytes.len(),
            Value::Pieces(pieces) => pieces.iter().map(|p| p.len()).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its pieces, in order (one for a single buffer).
    pub fn pieces(&self) -> &[&'v [u8]] {
        match self {
            Value::One(bytes) => std::slice::from_ref(bytes),
            Value::Pieces(pieces) => pieces,
        }
    }

    /// All of it as one slice, where it lies in one piece.
    pub fn contiguous(&self) -> Option<&'v [u8]> {
        match self {
            Value::One(bytes) => Some(bytes),
            Value::Pieces(pieces) => {
                let mut full = pieces.iter().filter(|p| !p.is_empty());
                match (full.next(), full.next()) {
                    (Some(only), None) => Some(only),
                    (None, _) => Some(&[]),
                    _ => None,
                }
            }
        }
    }

    /// The checksum of the block, as the reader computes it.
    pub fn checksum(&self) -> u64 {
        if let Some(bytes) = self.contiguous() {
            return checksum::checksum(bytes);
        }
        let mut running = Running::default();
        for piece in self.pieces() {
            running.update(piece);
        }
        running.finish()
    }

    /// Copies its bytes from `at` on into `dst` (which they must fill).
    ///
    /// # Panics
    ///
    /// If the block holds fewer than `at + dst.len()` bytes.
    pub fn copy_to(&self, mut at: usize, mut dst: &mut [u8]) {
        assert!(
            at + dst.len() <= self.len(),
            "copy_to: past the block's end"
        );
        for piece in self.pieces() {
            if dst.is_empty() {
                break;
            }
            if at >= piece.len() {
                at -= piece.len();
                continue;
            }
            let n = (piece.len() - at).min(dst.len());
            let (now, rest) = std::mem::take(&mut dst).split_at_mut(n);
            checksum::copy(now, &piece[at..at + n]);
            dst = rest;
            at = 0;
        }
    }

    /// Copies all its bytes into `dst` (which they must fill) and returns
    /// their checksum: of the bytes stored, hashed while they are in cache
    /// (one fused pass from a single piece).
    ///
    /// # Panics
    ///
    /// If `dst` is not the block's length.
    pub fn copy_with_checksum(&self, dst: &mut [u8]) -> u64 {
        assert_eq!(
            dst.len(),
            self.len(),
            "copy_with_checksum: not the block's length"
        );
        if let Some(bytes) = self.contiguous() {
            return checksum::copy_with_checksum(dst, bytes);
        }
        let mut running = Running::default();
        let mut at = 0;
        for piece in self.pieces() {
            for step in piece.chunks(CHUNK) {
                let into = &mut dst[at..at + step.len()];
                checksum::copy(into, step);
                running.update(into);
                at += step.len();
            }
        }
        running.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Ways to cut `n` bytes into pieces: whole, halves, uneven with empty
    /// pieces, many small.
    fn cuts(n: usize) -> Vec<Vec<usize>> {
        let mut out = vec![
            vec![n],
            vec![n / 2, n - n / 2],
            vec![0, n / 3, 0, n - n / 3, 0],
        ];
        if n >= 100 {
            let mut small = vec![97; n / 97];
            small.push(n % 97);
            out.push(small);
        }
        out
    }

    fn split<'a>(mut buf: &'a mut [u8], cut: &[usize]) -> Vec<&'a mut [u8]> {
        let mut out = Vec::new();
        for &n in cut {
            let (piece, rest) = std::mem::take(&mut buf).split_at_mut(n);
            out.push(piece);
            buf = rest;
        }
        out
    }

    fn split_ref<'a>(buf: &'a [u8], cut: &[usize]) -> Vec<&'a [u8]> {
        let mut at = 0;
        cut.iter()
            .map(|&n| {
                at += n;
                &buf[at - n..at]
            })
            .collect()
    }

    #[test]
    fn a_block_in_pieces_has_the_checksum_and_bytes_of_the_block_joined() {
        for n in [0, 1, 63, 64, 1000, 300_000] {
            let src = bytes(n);
            for cut in cuts(n) {
                let mut out = vec![0u8; n];
                let mut dest = Dest::Pieces(split(&mut out, &cut));
                assert_eq!(dest.len(), n);
                let sum = dest.copy_with_checksum(&src);
                assert_eq!(sum, checksum::checksum(&src), "n={n} cut={cut:?}");
                assert_eq!(dest.checksum(n), sum);
                drop(dest);
                assert_eq!(out, src);

                let pieces = split_ref(&src, &cut);
                let value = Value::Pieces(&pieces);
                assert_eq!(value.len(), n);
                assert_eq!(value.checksum(), checksum::checksum(&src));
                let mut gathered = vec![0u8; n];
                value.copy_to(0, &mut gathered);
                assert_eq!(gathered, src);
                let mut hashed = vec![0u8; n];
                assert_eq!(
                    value.copy_with_checksum(&mut hashed),
                    checksum::checksum(&src)
                );
                assert_eq!(hashed, src);
            }
        }
    }

    #[test]
    fn parts_land_at_their_offsets_across_pieces() {
        let n = 10_000;
        let src = bytes(n);
        for cut in cuts(n) {
            let mut out = vec![0u8; n];
            let mut dest = Dest::Pieces(split(&mut out, &cut));
            // Parts of 3,001 bytes, written in reverse order.
            let parts: Vec<usize> = (0..n).step_by(3001).collect();
            for &at in parts.iter().rev() {
                let end = (at + 3001).min(n);
                dest.write_at(at, &src[at..end]);
            }
            drop(dest);
            assert_eq!(out, src, "cut={cut:?}");

            let pieces = split_ref(&src, &cut);
            let value = Value::Pieces(&pieces);
            for &at in &parts {
                let end = (at + 3001).min(n);
                let mut part = vec![0u8; end - at];
                value.copy_to(at, &mut part);
                assert_eq!(part, src[at..end]);
            }
        }
    }

    #[test]
    fn a_shorter_block_fills_the_leading_pieces_and_leaves_the_rest() {
        let src = bytes(700);
        let mut out = vec![0xAAu8; 1000];
        let mut dest = Dest::Pieces(split(&mut out, &[400, 600]));
        assert_eq!(dest.copy_with_checksum(&src), checksum::checksum(&src));
        drop(dest);
        assert_eq!(&out[..700], &src[..]);
        assert!(out[700..].iter().all(|&b| b == 0xAA));
    }

    #[test]
    fn only_a_block_within_one_piece_is_contiguous() {
        let mut out = vec![0u8; 100];
        let mut dest = Dest::Pieces(split(&mut out, &[0, 60, 40]));
        assert_eq!(dest.contiguous(60).map(|s| s.len()), Some(60));
        assert!(dest.contiguous(61).is_none());
        let (a, b) = ([1u8; 4], [2u8; 4]);
        assert!(Value::Pieces(&[&a, &b]).contiguous().is_none());
        assert_eq!(Value::Pieces(&[&[], &a, &[]]).contiguous(), Some(&a[..]));
    }
}
