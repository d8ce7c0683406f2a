//! The bytes of a batch, in vLLM's KV-event schema (`vllm/distributed/
//! kv_events.py`, as of vLLM 0.33): a `KVEventBatch` is a msgpack array
//! `[ts, events]` (its optional `data_parallel_rank` left out, as msgspec
//! leaves out a default), and each event a msgpack map tagged by its
//! `type`, holding every field that has no default:
//!
//! - `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`,
//!   `block_size`, `lora_id`, `medium`, `lora_name`;
//! - `BlockRemoved`: `block_hashes`, `medium`;
//! - `AllBlocksCleared`: nothing else.
//!
//! A block hash is vLLM's `ExternalBlockHash` (bytes or int): ours are the
//! 32 bytes of the block key's hash, as msgpack bin, or (`HashForm::Int`)
//! its last 8 bytes as a big-endian integer, which is what vLLM publishes
//! by default (`maybe_convert_block_hash`). The medium is the tier
//! a daemon holds the blocks in, by vLLM's names for its offloading tiers
//! (`vllm/v1/kv_offload/base.py`, `Medium`): `CPU` for DRAM, `STORAGE` for
//! NVMe.

use mooncake_proto::message::Tier;
use mooncake_proto::BlockHash;
use rmp::encode::{
    write_array_len, write_bin, write_f64, write_map_len, write_nil, write_str, write_uint,
};

/// vLLM's name of the medium of a tier.
pub fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Dram => "CPU",
        Tier::Nvme => "STORAGE",
    }
}

fn tier_of_medium(medium: &str) -> Option<Tier> {
    [Tier::Dram, Tier::Nvme]
        .into_iter()
        .find(|t| self::medium(*t) == medium)
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashForm {
    /// The 32 bytes, as msgpack bin.
    #[default]
    Bytes,
    /// The last 8 bytes as a big-endian unsigned integer, as vLLM turns its
    /// block hashes into integers (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
    Int,
}

impl HashForm {
    fn write(self, out: &mut Vec<u8>, hash: &BlockHash) {
        match self {
            HashForm::Bytes => {
                let _ = write_bin(out, &hash.0);
            }
            HashForm::Int => {
                let low = u64::from_be_bytes(hash.0[24..].try_into().expect("8 bytes"));
                let _ = write_uint(out, low);
            }
        }
    }
}

/// A hash as events carry it: 32 bytes, or an integer (its last 8 bytes;
/// the others zero).
fn hash_of(value: &rmpv::Value) -> Option<BlockHash> {
    if let Some(n) = value.as_u64() {
        let mut hash = [0u8; 32];
        hash[24..].copy_from_slice(&n.to_be_bytes());
        return Some(BlockHash(hash));
    }
    value
        .as_slice()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .map(BlockHash)
}

/// One event of a batch: blocks stored in, or removed from, a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks of one chain in order, each extending the one before, and
    /// the block the first extends (`parent_block_hash`; `None`: it starts
    /// a chain, or its writer named no parent), as vLLM lays out a
    /// `BlockStored`.
    Stored(Vec<BlockHash>, Tier, Option<BlockHash>),
    Removed(Vec<BlockHash>, Tier),
    AllCleared,
}

impl Event {
    pub fn blocks(&self) -> usize {
        match self {
            Event::Stored(h, _, _) | Event::Removed(h, _) => h.len(),
            Event::AllCleared => 0,
        }
    }
}

/// Decodes a batch this store published: `(ts, events)`. Anything else
/// (another schema, hashes that are not 32 bytes) is an error naming what
/// did not fit.
pub fn decode_batch(payload: &[u8]) -> Result<(f64, Vec<Event>), String> {
    let value = rmpv::decode::read_value(&mut &payload[..]).map_err(|e| format!("msgpack: {e}"))?;
    let batch = value.as_array().ok_or("a batch is not an array")?;
    let ts = batch
        .first()
        .and_then(rmpv::Value::as_f64)
        .ok_or("a batch's first field is not its time")?;
    let events = batch
        .get(1)
        .and_then(rmpv::Value::as_array)
        .ok_or("a batch's second field is not its events")?;
    let events = events
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, String>>()?;
    Ok((ts, events))
}

fn decode_event(event: &rmpv::Value) -> Result<Event, String> {
    let map = event.as_map().ok_or("an event is not a map")?;
    let field = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
    };
    let hashes = || -> Result<Vec<BlockHash>, String> {
        field("block_hashes")
            .and_then(rmpv::Value::as_array)
            .ok_or("an event without block_hashes")?
            .iter()
            .map(|h| {
                hash_of(h)
                    .ok_or_else(|| format!("block hash {h} is neither 32 bytes nor an integer"))
            })
            .collect()
    };
    let parent = || -> Result<Option<BlockHash>, String> {
        match field("parent_block_hash") {
            None => Ok(None),
            Some(v) if v.is_nil() => Ok(None),
            Some(v) => hash_of(v)
                .map(Some)
                .ok_or_else(|| format!("parent block hash {v} is neither 32 bytes nor an integer")),
        }
    };
    let tier = || -> Result<Tier, String> {
        let medium = field("medium").and_then(rmpv::Value::as_str);
        medium
            .and_then(tier_of_medium)
            .ok_or_else(|| format!("unknown medium {medium:?}"))
    };
    match field("type").and_then(rmpv::Value::as_str) {
        Some("BlockStored") => Ok(Event::Stored(hashes()?, tier()?, parent()?)),
        Some("BlockRemoved") => Ok(Event::Removed(hashes()?, tier()?)),
        Some("AllBlocksCleared") => Ok(Event::AllCleared),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// Encodes a batch stamped `ts` (seconds since the Unix epoch), its block
/// hashes in `form`.
pub fn encode_batch(ts: f64, events: &[Event], form: HashForm) -> Vec<u8> {
    let blocks: usize = events.iter().map(Event::blocks).sum();
    let mut out = Vec::with_capacity(16 + events.len() * 96 + blocks * 35);
    // Writing to a Vec cannot fail: the results are ignored below.
    let _ = write_array_len(&mut out, 2);
    let _ = write_f64(&mut out, ts);
    let _ = write_array_len(&mut out, events.len() as u32);
    for event in events {
        encode_event(&mut out, event, form);
    }
    out
}

fn encode_event(out: &mut Vec<u8>, event: &Event, form: HashForm) {
    match event {
        Event::Stored(hashes, tier, parent) => {
            let _ = write_map_len(out, 8);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockStored");
            hashes_field(out, hashes, form);
            let _ = write_str(out, "parent_block_hash");
            if let Some(p) = parent {
                form.write(out, p);
            } else {
                let _ = write_nil(out);
            }
            let _ = write_str(out, "token_ids");
            let _ = write_array_len(out, 0);
            let _ = write_str(out, "block_size");
            let _ = write_uint(out, 0);
            let _ = write_str(out, "lora_id");
            let _ = write_nil(out);
            medium_field(out, *tier);
            let _ = write_str(out, "lora_name");
            let _ = write_nil(out);
        }
        Event::Removed(hashes, tier) => {
            let _ = write_map_len(out, 3);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockRemoved");
            hashes_field(out, hashes, form);
            medium_field(out, *tier);
        }
        Event::AllCleared => {
            let _ = write_map_len(out, 1);
            let _ = write_str(out, "type");
            let _ = write_str(out, "AllBlocksCleared");
        }
    }
}

fn hashes_field(out: &mut Vec<u8>, hashes: &[BlockHash], form: HashForm) {
    let _ = write_str(out, "block_hashes");
    let _ = write_array_len(out, hashes.len() as u32);
    for h in hashes {
        form.write(out, h);
    }
}

fn medium_field(out: &mut Vec<u8>, tier: Tier) {
    let _ = write_str(out, "medium");
    let _ = write_str(out, medium(tier));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn field<'a>(map: &'a Value, name: &str) -> &'a Value {
        map.as_map()
            .unwrap()
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no field {name}"))
    }

    #[test]
    fn a_batch_decodes_as_vllms_schema_lays_it_out() {
        let a = BlockHash::from_opaque(b"a");
        let b = BlockHash::from_opaque(b"b");
        let c = BlockHash::from_opaque(b"c");
        let bytes = encode_batch(
            1.5,
            &[
                Event::AllCleared,
                Event::Stored(vec![a, b], Tier::Dram, None),
                Event::Removed(vec![b], Tier::Nvme),
                Event::Stored(vec![c], Tier::Dram, Some(b)),
            ],
            HashForm::Bytes,
        );
        let batch = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let batch = batch.as_array().unwrap();
        assert_eq!(batch.len(), 2, "[ts, events]");
        assert_eq!(batch[0].as_f64(), Some(1.5));
        let events = batch[1].as_array().unwrap();
        assert_eq!(field(&events[0], "type").as_str(), Some("AllBlocksCleared"));
        let stored = &events[1];
        assert_eq!(field(stored, "type").as_str(), Some("BlockStored"));
        let hashes: Vec<&[u8]> = field(stored, "block_hashes")
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_slice().unwrap())
            .collect();
        assert_eq!(hashes, [&a.0[..], &b.0[..]]);
        assert!(field(stored, "parent_block_hash").is_nil());
        assert_eq!(field(stored, "token_ids").as_array().unwrap().len(), 0);
        assert_eq!(field(stored, "medium").as_str(), Some("CPU"));
        for name in ["block_size", "lora_id", "lora_name"] {
            field(stored, name);
        }
        assert_eq!(field(&events[2], "type").as_str(), Some("BlockRemoved"));
        assert_eq!(
            field(&events[2], "block_hashes").as_array().unwrap().len(),
            1
        );
        assert_eq!(field(&events[2], "medium").as_str(), Some("STORAGE"));
        assert_eq!(
            field(&events[3], "parent_block_hash").as_slice(),
            Some(&b.0[..]),
            "a block extending another names it"
        );
        let (ts, decoded) = decode_batch(&bytes).unwrap();
        assert_eq!(ts, 1.5);
        assert_eq!(
            decoded,
            [
                Event::AllCleared,
                Event::Stored(vec![a, b], Tier::Dram, None),
                Event::Removed(vec![b], Tier::Nvme),
                Event::Stored(vec![c], Tier::Dram, Some(b)),
            ]
        );
        assert!(decode_batch(b"\x01").is_err());
    }

    #[test]
    fn integer_hashes_are_the_last_8_bytes_big_endian_as_vllm_converts_them() {
        let mut raw = [0u8; 32];
        raw[0] = 0xff;
        raw[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let (a, parent) = (BlockHash(raw), BlockHash([9; 32]));
        let bytes = encode_batch(
            2.0,
            &[Event::Stored(vec![a], Tier::Dram, Some(parent))],
            HashForm::Int,
        );
        let batch = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let stored = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
        let hashes = field(stored, "block_hashes").as_array().unwrap();
        assert_eq!(hashes[0].as_u64(), Some(0x0102_0304_0506_0708));
        assert_eq!(
            field(stored, "parent_block_hash").as_u64(),
            Some(u64::from_be_bytes([9; 8]))
        );
        // Read back, an integer is the hash with its other bytes zero.
        let (_, events) = decode_batch(&bytes).unwrap();
        let Event::Stored(hashes, _, Some(p)) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(hashes[0].0[24..], raw[24..]);
        assert_eq!(hashes[0].0[..24], [0u8; 24]);
        assert_eq!(p.0[24..], [9; 8]);
    }
}
