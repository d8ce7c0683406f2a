//! Bodies of the data plane (client to daemon): a block key, a put's
//! head (its value follows the body), a get's answer head, and the
//! daemon's own stats and evictions.

use super::*;

/// One key: the body of daemon `Get`, `Remove`, `Pin` and `Unpin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRequest {
    pub key: BlockKey,
}

impl Body for KeyRequest {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(KeyRequest {
            key: decode_key(r)?,
        })
    }
}

/// The meta service's request that a daemon copy a block from another
/// daemon (`from`, the address to call it at), whose size and checksum the
/// index holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    pub key: BlockKey,
    pub from: String,
    pub size: u32,
    pub checksum: u64,
}

impl Body for FetchRequest {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
        w.str(&self.from);
        w.u32(self.size);
        w.u64(self.checksum);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(FetchRequest {
            key: decode_key(r)?,
            from: r.str()?.to_string(),
            size: r.u32()?,
            checksum: r.u64()?,
        })
    }
}

/// The head of a daemon `Put` body; the value bytes follow it to the end of
/// the frame, so that a server can read them straight into their place.
///
/// Layout: `u16 namespace length, namespace, 32-byte hash, u64 checksum,
/// 32-byte parent, u8 continues, u32 tag length, tag` (`engine`: none when
/// 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutHead {
    pub key: BlockKey,
    pub checksum: u64,
    /// The block whose prefix this one extends (same namespace), so that
    /// the daemon evicts chain tails before the blocks they need.
    pub parent: Option<BlockHash>,
    /// The meta service judged that the block continues a branch readers
    /// come back to (`Slot::Place`): where the daemon does not hold the
    /// parent, it takes the block into its main queue.
    pub continues: bool,
    /// What the engine calls the block, kept by the daemon with it so that
    /// a new meta leader learns it from the daemon's inventory.
    pub tag: Option<Arc<EngineTag>>,
}

impl PutHead {
    /// The longest head on the wire: the namespace's length, the longest
    /// namespace, the hash, the checksum, the parent, `continues` and the
    /// longest tag.
    pub const MAX_LEN: usize =
        2 + MAX_NAMESPACE_LEN + BlockHash::LEN + 8 + BlockHash::LEN + 1 + 4 + MAX_TAG_LEN;

    /// Bytes of the head after its leading u16 up to its tag (the tag's
    /// length included: the head's last 4 bytes), given that u16's value;
    /// refused if the namespace would be too long.
    pub fn rest_len(ns_len: u16) -> Result<usize, ProtoError> {
        if ns_len as usize > MAX_NAMESPACE_LEN {
            return Err(ProtoError::Invalid {
                field: "namespace",
                why: format!("{ns_len} bytes, at most {MAX_NAMESPACE_LEN}"),
            });
        }
        Ok(ns_len as usize + BlockHash::LEN + 8 + BlockHash::LEN + 1 + 4)
    }

    /// The tag's length, from the 4 bytes `rest_len` ends with; refused
    /// past `MAX_TAG_LEN`.
    pub fn tag_len(len: [u8; 4]) -> Result<usize, ProtoError> {
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_TAG_LEN {
            return Err(ProtoError::TooLarge {
                len: len as u64,
                limit: MAX_TAG_LEN as u64,
            });
        }
        Ok(len)
    }
}

impl Body for PutHead {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
        w.u64(self.checksum);
        encode_parent(w, &self.parent);
        w.u8(u8::from(self.continues));
        encode_sized_tag(w, &self.tag);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(PutHead {
            key: decode_key(r)?,
            checksum: r.u64()?,
            parent: decode_parent(r)?,
            continues: r.bool("continues")?,
            tag: decode_sized_tag(r)?,
        })
    }
}

/// Length of the head of a `Get` response: the block's checksum (u64);
/// the value follows to the end of the frame.
pub const GET_HEAD_LEN: usize = 8;

/// One daemon's pool, as reported by `DaemonStats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub capacity: u64,
    pub used: u64,
    pub blocks: u64,
    pub pinned: u64,
    pub evictions: u64,
    /// Gets answered with the block, and gets that missed, since start.
    pub hits: u64,
    pub misses: u64,
}

impl Body for PoolStats {
    fn encode(&self, w: &mut Writer) {
        for v in [
            self.capacity,
            self.used,
            self.blocks,
            self.pinned,
            self.evictions,
            self.hits,
            self.misses,
        ] {
            w.u64(v);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(PoolStats {
            capacity: r.u64()?,
            used: r.u64()?,
            blocks: r.u64()?,
            pinned: r.u64()?,
            evictions: r.u64()?,
            hits: r.u64()?,
            misses: r.u64()?,
        })
    }
}

/// A daemon evicts its coldest blocks now (an operator freeing memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictRequest {
    pub bytes: u64,
}

impl Body for EvictRequest {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.bytes);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(EvictRequest { bytes: r.u64()? })
    }
}

/// What an eviction freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictResponse {
    pub bytes: u64,
    pub blocks: u64,
}

impl Body for EvictResponse {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.bytes);
        w.u64(self.blocks);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(EvictResponse {
            bytes: r.u64()?,
            blocks: r.u64()?,
        })
    }
}
