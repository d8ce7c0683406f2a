//! The per-block checksum: XXH3-64 of the value bytes, computed by the
//! writer, stored beside the block, and checked by every reader.
//!
//! XXH3 runs faster than memory on one core (about 33 GB/s with AVX2,
//! chosen at run time), so verifying a block costs a fraction of moving it; 64 bits make an undetected random corruption
//! vanishingly unlikely.

/// Checksum of a block's bytes, as carried in puts, the index and gets.
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// Bytes hashed per step when a block is hashed as it arrives: small
/// enough to still be in the core's cache when the hash reads them.
pub const CHUNK: usize = 128 << 10;

/// A checksum computed piece by piece, equal to [`checksum`] of the
/// pieces joined: readers hash each piece right after it lands, while it
/// is still in cache, instead of reading the whole block again.
#[derive(Default)]
pub struct Running(twox_hash::XxHash3_64);

impl Running {
    pub fn update(&mut self, piece: &[u8]) {
        std::hash::Hasher::write(&mut self.0, piece);
    }

    pub fn finish(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

#[cfg(target_arch = "x86_64")]
mod fused;

/// Bytes copied then hashed per step by `copy_with_checksum` where it has
/// no fused loop: a step stays in the first-level cache.
const COPY_STEP: usize = 8 << 10;

/// Copies `src` into `dst` (same length) and returns `checksum(dst)`: of
/// the bytes stored, whatever happens to `src` meanwhile. On x86-64 with
/// AVX2 in one pass (see `fused`); elsewhere each 8 KiB step is hashed
/// just after it is copied.
///
/// # Panics
///
/// If the lengths differ.
pub fn copy_with_checksum(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_with_checksum: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= fused::MIN_LEN && fused::available() {
        // SAFETY: AVX2 is there, the lengths are equal and long enough.
        return unsafe { fused::copy_with_xxh3(dst, src) };
    }
    let mut running = Running::default();
    for (d, s) in dst.chunks_mut(COPY_STEP).zip(src.chunks(COPY_STEP)) {
        d.copy_from_slice(s);
        running.update(d);
    }
    running.finish()
}

/// Copies `src` into `dst` (same length) at memory speed whatever their
/// alignment: glibc's `memcpy` copies 8 KiB to a few MiB 5x slower on AMD
/// EPYC when the destination lies a few bytes past the source's offset in a
/// 4 KiB page (see `fused`).
///
/// # Panics
///
/// If the lengths differ.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= fused::MIN_LEN && fused::available() {
        // SAFETY: AVX2 is there and the lengths are equal.
        return unsafe { fused::copy(dst, src) };
    }
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_xxh3_64_with_seed_zero() {
        // Reference values of XXH3-64 (seed 0), as published with xxHash.
        assert_eq!(checksum(b""), 0x2d06_8005_38d3_94c2);
        assert_ne!(checksum(b"a"), checksum(b"b"));
    }

    #[test]
    fn copies_are_exact_and_checksum_what_they_stored_at_every_length_and_alignment() {
        // Lengths around each rule of XXH3 (240 and below, stripes, blocks
        // of 1 KiB, the 64-byte tail), at source and destination offsets
        // that differ in alignment.
        let src: Vec<u8> = (0..(3 << 20) as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B1) >> 13) as u8)
            .collect();
        let mut lens: Vec<usize> = (0..=300).collect();
        for base in [1024, 2048, 4096, 65536, 1 << 20] {
            lens.extend([
                base - 65,
                base - 64,
                base - 63,
                base - 1,
                base,
                base + 1,
                base + 64,
            ]);
        }
        lens.extend([1000, 1023, 1025, 1088, 3 * 1024 + 17, 2 << 20]);
        for len in lens {
            for (s, d) in [(0, 0), (0, 16), (5, 0), (33, 7)] {
                let piece = &src[s..s + len];
                let mut dst = vec![0u8; len + d];
                let sum = copy_with_checksum(&mut dst[d..], piece);
                assert_eq!(sum, checksum(piece), "len {len}, offsets {s}/{d}");
                assert!(dst[d..] == *piece, "len {len}, offsets {s}/{d}");
                dst.fill(0);
                copy(&mut dst[d..], piece);
                assert!(dst[d..] == *piece, "plain copy: len {len}, offsets {s}/{d}");
            }
        }
    }

    #[test]
    fn piecewise_checksums_equal_the_whole_one() {
        for len in [
            0,
            1,
            239,
            240,
            241,
            CHUNK - 1,
            CHUNK,
            CHUNK + 1,
            3 * CHUNK + 77,
            4 << 20,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            assert_eq!(
                copy_with_checksum(&mut dst, &src),
                checksum(&src),
                "len {len}"
            );
            assert_eq!(dst, src);
            let mut running = Running::default();
            for piece in src.chunks(1000) {
                running.update(piece);
            }
            assert_eq!(running.finish(), checksum(&src), "len {len}");
        }
    }
}
