//! The per-block checksum: XXH3-64 of the value bytes, computed by the
//! writer, stored beside the block, and checked by every reader.
//!
//! XXH3 runs at memory speed on one core, so verifying a block costs a few
//! percent of moving it; 64 bits make an undetected random corruption
//! vanishingly unlikely.

/// Checksum of a block's bytes, as carried in puts, the index and gets.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
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
}
