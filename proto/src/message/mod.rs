//! Request and response bodies. Each type encodes itself with `Writer` and
//! is validated once on receive by `decode`, into fields that are valid by
//! construction (namespaces checked, batch sizes bounded). By who sends
//! them: `data` (client to daemon), `placement` (client to meta service),
//! `membership` (daemon to meta service), `admin` (operators), `engine`
//! (what an engine calls a block, for store events), `route`
//! (a router's question), `shm` and
//! `rdma` (the control messages of those data paths).

use crate::codec::{Reader, Writer};
use crate::error::{ErrorCode, ProtoError};
use crate::key::{BlockHash, BlockKey, Namespace, MAX_NAMESPACE_LEN};
use crate::transport::{decode_endpoints, encode_endpoints, Endpoint};

mod admin;
mod copies;
mod data;
mod engine;
mod membership;
mod placement;
mod rdma;
mod route;
mod shm;
#[cfg(test)]
mod tests;

pub use admin::*;
pub use copies::*;
pub use data::*;
use engine::{decode_sized_tag, decode_tag, encode_sized_tag, encode_tag};
pub use engine::{
    EngineHash, EngineTag, MAX_ENGINE_HASH_LEN, MAX_OBJECT_KEY_LEN, MAX_TAG_LEN, MAX_TAG_TOKENS,
};
pub use membership::*;
pub use placement::*;
pub use rdma::*;
pub use route::*;
pub use shm::*;
use std::sync::Arc;

/// A message body: encoded into a frame, decoded from exactly its bytes.
pub trait Body: Sized {
    fn encode(&self, w: &mut Writer);
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError>;

    /// About how many bytes `encode` writes, so that a large body is
    /// allocated once instead of grown by doubling.
    fn size_hint(&self) -> usize {
        64
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer {
            buf: Vec::with_capacity(self.size_hint()),
        };
        self.encode(&mut w);
        w.buf
    }

    /// Decodes a whole body; leftover bytes are an error.
    fn from_bytes(bytes: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(bytes);
        let v = Self::decode(&mut r)?;
        r.finish()?;
        Ok(v)
    }
}

/// The empty body of acknowledgements and argument-less requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Empty;

impl Body for Empty {
    fn encode(&self, _: &mut Writer) {}
    fn decode(_: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(Empty)
    }
}

fn encode_key(w: &mut Writer, key: &BlockKey) {
    w.namespace(&key.namespace);
    w.hash(&key.hash);
}

fn decode_key(r: &mut Reader<'_>) -> Result<BlockKey, ProtoError> {
    let namespace = r.namespace()?;
    let hash = r.hash()?;
    Ok(BlockKey { namespace, hash })
}

/// A parent on the wire: 32 bytes, all zero for none (no SHA-256 chain
/// hash is all zeros).
fn encode_parent(w: &mut Writer, parent: &Option<BlockHash>) {
    w.hash(&parent.unwrap_or(BlockHash([0; BlockHash::LEN])));
}

fn decode_parent(r: &mut Reader<'_>) -> Result<Option<BlockHash>, ProtoError> {
    let h = r.hash()?;
    Ok((h.0 != [0; BlockHash::LEN]).then_some(h))
}

fn decode_code(r: &mut Reader<'_>) -> Result<ErrorCode, ProtoError> {
    let raw = r.u16()?;
    ErrorCode::from_u16(raw).ok_or(ProtoError::Invalid {
        field: "error code",
        why: format!("unknown code {raw}"),
    })
}
