//! Block keys: a namespace (tenant and model) and a 32-byte chained prefix
//! hash. The hash is specified in `docs/block-keys.md`, with test vectors, so
//! that a worker in any language computes the same keys bit for bit.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::ProtoError;

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 128;

/// Domain separators of the prefix hash (see `docs/block-keys.md`).
const SEED_DOMAIN: &[u8] = b"mooncake-store/prefix-hash/v1/seed";
const BLOCK_DOMAIN: &[u8] = b"mooncake-store/prefix-hash/v1/block";
const OPAQUE_DOMAIN: &[u8] = b"mooncake-store/opaque-key/v1";

/// Who a block belongs to: a tenant and a model fingerprint, written as one
/// string such as `acme/llama-3-70b@a1b2c3`. Blocks of different namespaces
/// never match each other, even with equal hashes. Cloning is a reference
/// count, so keys move through the hot path without allocating.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(Arc<str>);

impl Namespace {
    /// Validates a namespace: 1 to 128 bytes of ASCII letters, digits and
    /// `. _ - : / @ + =`.
    pub fn new(name: impl Into<String>) -> Result<Self, ProtoError> {
        let name = name.into();
        let invalid = |why: &str| ProtoError::Invalid {
            field: "namespace",
            why: why.to_string(),
        };
        if name.is_empty() {
            return Err(invalid("empty"));
        }
        if name.len() > MAX_NAMESPACE_LEN {
            return Err(invalid(&format!(
                "{} bytes, at most {MAX_NAMESPACE_LEN}",
                name.len()
            )));
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "._-:/@+=".contains(*c)))
        {
            return Err(invalid(&format!("character {c:?} is not allowed")));
        }
        Ok(Namespace(name.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", self.0)
    }
}

impl std::str::FromStr for Namespace {
    type Err = ProtoError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Namespace::new(s)
    }
}

/// The 32-byte identity of a block within its namespace.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    pub const LEN: usize = 32;

    /// Maps a key from another system (a vLLM block hash, an SGLang page
    /// hash, a Mooncake string key) into the same key space. Any byte string
    /// is accepted; equal inputs give equal hashes.
    pub fn from_opaque(key: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(OPAQUE_DOMAIN);
        h.update((key.len() as u64).to_le_bytes());
        h.update(key);
        BlockHash(h.finalize().into())
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Result<Self, ProtoError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| ProtoError::Invalid {
            field: "hash",
            why: format!("expected 64 hex digits: {e}"),
        })?;
        Ok(BlockHash(out))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first eight bytes, used as the hash-table hash and shard index
    /// (the bytes are already uniformly distributed).
    pub fn prefix_u64(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("32 >= 8"))
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({}..)", &self.to_hex()[..12])
    }
}

/// A block's full key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockKey {
    pub namespace: Namespace,
    pub hash: BlockHash,
}

impl BlockKey {
    pub fn new(namespace: Namespace, hash: BlockHash) -> Self {
        BlockKey { namespace, hash }
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.hash)
    }
}

/// Computes the chained prefix hash of token blocks:
/// `h_i = SHA-256(BLOCK_DOMAIN || h_{i-1} || n || tokens || m || extra)`,
/// starting from `h_{-1} = SHA-256(SEED_DOMAIN || len(seed) || seed)`.
/// Lengths are u64 little-endian, tokens u32 little-endian.
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    prev: [u8; 32],
}

impl PrefixHasher {
    /// Starts a chain. The seed is explicit and documented (empty by
    /// default): never random, or no two processes would ever share a key.
    pub fn new(seed: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(SEED_DOMAIN);
        h.update((seed.len() as u64).to_le_bytes());
        h.update(seed);
        PrefixHasher {
            prev: h.finalize().into(),
        }
    }

    /// Hashes the next block of the chain and returns its key hash.
    pub fn next_block(&mut self, tokens: &[u32], extra: &[u8]) -> BlockHash {
        let mut h = Sha256::new();
        h.update(BLOCK_DOMAIN);
        h.update(self.prev);
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        h.update((extra.len() as u64).to_le_bytes());
        h.update(extra);
        self.prev = h.finalize().into();
        BlockHash(self.prev)
    }

    /// The hashes of every full block of `tokens`; a trailing partial block
    /// has no key (it is not cacheable until it is full).
    pub fn chain(seed: &[u8], tokens: &[u32], block_tokens: usize, extra: &[u8]) -> Vec<BlockHash> {
        assert!(block_tokens > 0, "block_tokens must be positive");
        let mut hasher = PrefixHasher::new(seed);
        tokens
            .chunks_exact(block_tokens)
            .map(|block| hasher.next_block(block, extra))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_rejects_empty_long_and_odd_characters() {
        assert!(Namespace::new("acme/llama-3-70b@a1b2").is_ok());
        assert!(Namespace::new("").is_err());
        assert!(Namespace::new("a".repeat(129)).is_err());
        assert!(Namespace::new("has space").is_err());
        assert!(Namespace::new("nul\0").is_err());
    }

    #[test]
    fn chain_depends_on_every_earlier_block() {
        let a = PrefixHasher::chain(b"", &[1, 2, 3, 4], 2, b"");
        let b = PrefixHasher::chain(b"", &[9, 2, 3, 4], 2, b"");
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "second block must change with the first");
    }

    #[test]
    fn partial_trailing_block_has_no_key() {
        assert_eq!(PrefixHasher::chain(b"", &[1, 2, 3], 2, b"").len(), 1);
    }

    #[test]
    fn seed_and_extra_change_the_keys() {
        let base = PrefixHasher::chain(b"", &[1, 2], 2, b"");
        assert_ne!(base, PrefixHasher::chain(b"model-a", &[1, 2], 2, b""));
        assert_ne!(base, PrefixHasher::chain(b"", &[1, 2], 2, b"lora-7"));
    }

    /// Fixed vectors, also listed in docs/block-keys.md and checked there
    /// against Python's hashlib; they must never change.
    #[test]
    fn test_vectors_are_stable() {
        let tokens: Vec<u32> = (0..8).collect();
        let keys = PrefixHasher::chain(b"", &tokens, 4, b"");
        assert_eq!(keys[0].to_hex(), VECTOR_EMPTY_SEED[0]);
        assert_eq!(keys[1].to_hex(), VECTOR_EMPTY_SEED[1]);
        assert_eq!(
            BlockHash::from_opaque(b"vllm-block-42").to_hex(),
            VECTOR_OPAQUE
        );
    }

    const VECTOR_EMPTY_SEED: [&str; 2] = [
        "bdf2fd341809efae94ae22d1233ca3ac4b0492bd8005a073b8c0cb47db1f741c",
        "01f8357aa6686646a99da02ac8c1c213946adbc69efcf6d9d796f0fb9a96dd01",
    ];
    const VECTOR_OPAQUE: &str = "afa690cd3257f3991b5b85a995552f0fed3b013c8877209c32ccccf2b2c8b5d6";

    #[test]
    fn hex_round_trips() {
        let h = BlockHash::from_opaque(b"x");
        assert_eq!(BlockHash::from_hex(&h.to_hex()).unwrap(), h);
        assert!(BlockHash::from_hex("zz").is_err());
    }
}
