//! What a serving engine calls a block: its own block hash and the tokens
//! the block holds, attached by the writer at put time so that store
//! events name the block as the engine's own events do (a router that
//! hashes tokens its own way then matches what the store holds).

use std::sync::Arc;

use super::*;

/// Longest engine hash in bytes (vLLM's are 32, SGLang's page hashes 64
/// hex characters).
pub const MAX_ENGINE_HASH_LEN: usize = 64;
/// Most tokens one block's tag carries (4 KiB on the wire). vLLM blocks
/// hold 16 tokens, SGLang pages up to 64, LMCache chunks 256.
pub const MAX_TAG_TOKENS: usize = 1024;

/// Longest object key a tag carries, in bytes (vLLM's connector keys, a
/// model name, ranks and a 64-character hash, take about 150).
pub const MAX_OBJECT_KEY_LEN: usize = 512;

/// Most bytes of one tag on the wire (`encode_tag`).
pub const MAX_TAG_LEN: usize =
    1 + 1 + MAX_ENGINE_HASH_LEN + 4 + 4 * MAX_TAG_TOKENS + 2 + MAX_OBJECT_KEY_LEN;

/// An engine's block hash, as vLLM's `ExternalBlockHash` allows: an
/// integer or bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(u64),
    Bytes(Box<[u8]>),
}

/// The engine's name of one block and, optionally, its tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineTag {
    /// `None`: events keep the store's hash and carry only the tokens.
    pub hash: Option<EngineHash>,
    /// The tokens the block holds (vLLM's `token_ids` of `BlockStored`).
    pub token_ids: Vec<u32>,
    /// The key its writer stored it under, when that was a string (a
    /// Mooncake object key such as vLLM's connector builds): Mooncake's
    /// event format names blocks by it.
    pub key: Option<Box<str>>,
}

impl EngineTag {
    /// A tag, refused if its hash or tokens are past the limits.
    pub fn new(hash: Option<EngineHash>, token_ids: Vec<u32>) -> Result<Self, ProtoError> {
        if let Some(EngineHash::Bytes(b)) = &hash {
            if b.is_empty() || b.len() > MAX_ENGINE_HASH_LEN {
                return Err(ProtoError::Invalid {
                    field: "engine hash",
                    why: format!("{} bytes, 1 to {MAX_ENGINE_HASH_LEN}", b.len()),
                });
            }
        }
        if token_ids.len() > MAX_TAG_TOKENS {
            return Err(ProtoError::Invalid {
                field: "token ids",
                why: format!("{} in one block, at most {MAX_TAG_TOKENS}", token_ids.len()),
            });
        }
        Ok(EngineTag {
            hash,
            token_ids,
            key: None,
        })
    }

    /// The same tag, naming the key its block was stored under; refused
    /// past `MAX_OBJECT_KEY_LEN` bytes.
    pub fn with_key(mut self, key: &str) -> Result<Self, ProtoError> {
        if key.len() > MAX_OBJECT_KEY_LEN {
            return Err(ProtoError::Invalid {
                field: "object key",
                why: format!("{} bytes, at most {MAX_OBJECT_KEY_LEN}", key.len()),
            });
        }
        self.key = (!key.is_empty()).then(|| key.into());
        Ok(self)
    }

    /// The tag without its object key; none if the key was all it held.
    pub fn without_key(tag: Arc<EngineTag>) -> Option<Arc<EngineTag>> {
        if tag.key.is_none() {
            return Some(tag);
        }
        if tag.hash.is_none() && tag.token_ids.is_empty() {
            return None;
        }
        let mut bare = EngineTag::clone(&tag);
        bare.key = None;
        Some(Arc::new(bare))
    }

    /// Bytes it takes on the wire, at most.
    pub fn encoded_len(&self) -> usize {
        1 + 8 + MAX_ENGINE_HASH_LEN + 4 + 4 * self.token_ids.len() + 2 + self.key_len()
    }

    fn key_len(&self) -> usize {
        self.key.as_ref().map_or(0, |k| k.len())
    }

    /// Its bytes on the wire (`encode_tag`).
    pub fn to_wire(tag: &Option<Arc<EngineTag>>) -> Vec<u8> {
        let mut w = Writer::new();
        encode_tag(&mut w, tag);
        w.buf
    }

    /// A tag read back from `to_wire`'s bytes, all of them.
    pub fn from_wire(bytes: &[u8]) -> Result<Option<Arc<EngineTag>>, ProtoError> {
        let mut r = Reader::new(bytes);
        let tag = decode_tag(&mut r)?;
        r.finish()?;
        Ok(tag)
    }
}

/// An optional tag on the wire: `u8` 0 (none), 1 (no hash), 2 (an integer
/// hash, `u64`) or 3 (a bytes hash, `u8` length and bytes); then, unless
/// none, `u32` token count and the tokens, and the object key (`u16`
/// length, 0 for none, and its UTF-8 bytes).
pub(crate) fn encode_tag(w: &mut Writer, tag: &Option<Arc<EngineTag>>) {
    let Some(tag) = tag else {
        w.u8(0);
        return;
    };
    match &tag.hash {
        None => w.u8(1),
        Some(EngineHash::Int(n)) => {
            w.u8(2);
            w.u64(*n);
        }
        Some(EngineHash::Bytes(b)) => {
            w.u8(3);
            w.u8(b.len() as u8);
            w.buf.extend_from_slice(b);
        }
    }
    w.u32(tag.token_ids.len() as u32);
    for t in &tag.token_ids {
        w.u32(*t);
    }
    let key = tag.key.as_deref().unwrap_or("");
    w.u16(key.len() as u16);
    w.buf.extend_from_slice(key.as_bytes());
}

pub(crate) fn decode_tag(r: &mut Reader<'_>) -> Result<Option<Arc<EngineTag>>, ProtoError> {
    let hash = match r.u8()? {
        0 => return Ok(None),
        1 => None,
        2 => Some(EngineHash::Int(r.u64()?)),
        3 => {
            let len = r.u8()? as usize;
            Some(EngineHash::Bytes(r.take(len)?.into()))
        }
        other => {
            return Err(ProtoError::Invalid {
                field: "engine tag",
                why: format!("unknown kind {other}"),
            })
        }
    };
    let n = r.u32()? as usize;
    if n > MAX_TAG_TOKENS {
        return Err(ProtoError::TooLarge {
            len: n as u64,
            limit: MAX_TAG_TOKENS as u64,
        });
    }
    let tokens = r.take(4 * n)?;
    let token_ids = tokens
        .chunks_exact(4)
        .map(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")))
        .collect();
    let len = r.u16()? as usize;
    if len > MAX_OBJECT_KEY_LEN {
        return Err(ProtoError::TooLarge {
            len: len as u64,
            limit: MAX_OBJECT_KEY_LEN as u64,
        });
    }
    let key = std::str::from_utf8(r.take(len)?).map_err(|_| ProtoError::Invalid {
        field: "object key",
        why: "not UTF-8".into(),
    })?;
    Ok(Some(Arc::new(
        EngineTag::new(hash, token_ids)?.with_key(key)?,
    )))
}

/// A tag after its length (`u32`), 0 for none: in a put's head, whose
/// reader must know the head's length before the value that follows.
pub(crate) fn encode_sized_tag(w: &mut Writer, tag: &Option<Arc<EngineTag>>) {
    if tag.is_none() {
        w.u32(0);
        return;
    }
    let at = w.buf.len();
    w.u32(0);
    encode_tag(w, tag);
    let len = (w.buf.len() - at - 4) as u32;
    w.buf[at..at + 4].copy_from_slice(&len.to_le_bytes());
}

pub(crate) fn decode_sized_tag(r: &mut Reader<'_>) -> Result<Option<Arc<EngineTag>>, ProtoError> {
    let len = r.u32()? as usize;
    if len == 0 {
        return Ok(None);
    }
    if len > MAX_TAG_LEN {
        return Err(ProtoError::TooLarge {
            len: len as u64,
            limit: MAX_TAG_LEN as u64,
        });
    }
    let mut inner = Reader::new(r.take(len)?);
    let tag = decode_tag(&mut inner)?;
    inner.finish()?;
    Ok(tag)
}
