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
//! A block hash is vLLM's `ExternalBlockHash` (bytes or int): the engine's
//! own hash where the block's writer attached one (`EngineTag`), otherwise
//! the 32 bytes of the block key's hash, as msgpack bin, or
//! (`HashForm::Int`) its last 8 bytes as a big-endian integer, which is
//! what vLLM publishes by default (`maybe_convert_block_hash`). Tokens a
//! writer attached fill `token_ids` and `block_size`. The medium is the tier
//! a daemon holds the blocks in, by vLLM's names for its offloading tiers
//! (`vllm/v1/kv_offload/base.py`, `Medium`): `CPU` for DRAM, `STORAGE` for
//! NVMe.

use mooncake_proto::message::{EngineHash, Tier, MAX_ENGINE_HASH_LEN};
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
    /// How an event names a block of the store's that has no engine hash.
    pub fn name(self, hash: &BlockHash) -> EngineHash {
        match self {
            HashForm::Bytes => EngineHash::Bytes(hash.0.into()),
            HashForm::Int => EngineHash::Int(u64::from_be_bytes(
                hash.0[24..].try_into().expect("8 bytes"),
            )),
        }
    }
}

/// The store's hash an event's name stands for, if it is one: 32 bytes,
/// or an integer (the hash's last 8 bytes, the others zero).
pub fn store_hash(name: &EngineHash) -> Option<BlockHash> {
    match name {
        EngineHash::Int(n) => {
            let mut hash = [0u8; 32];
            hash[24..].copy_from_slice(&n.to_be_bytes());
            Some(BlockHash(hash))
        }
        EngineHash::Bytes(b) => <[u8; 32]>::try_from(&b[..]).ok().map(BlockHash),
    }
}

fn name_of(value: &rmpv::Value) -> Option<EngineHash> {
    if let Some(n) = value.as_u64() {
        return Some(EngineHash::Int(n));
    }
    value
        .as_slice()
        .filter(|b| !b.is_empty() && b.len() <= MAX_ENGINE_HASH_LEN)
        .map(|b| EngineHash::Bytes(b.into()))
}

/// Blocks of one chain stored in a tier, as a `BlockStored` lays them out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// In order, each extending the one before: the engine's hash where
    /// its writer attached one, the store's otherwise.
    pub hashes: Vec<EngineHash>,
    pub tier: Tier,
    /// The block the first extends (`parent_block_hash`; `None`: it
    /// starts a chain, or its writer named no parent).
    pub parent: Option<EngineHash>,
    /// The blocks' tokens, one block after the other (empty: their
    /// writers attached none).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0: none attached).
    pub block_size: u32,
}

/// One event of a batch: blocks stored in, or removed from, a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored(Stored),
    Removed(Vec<EngineHash>, Tier),
    AllCleared,
}

impl Event {
    pub fn blocks(&self) -> usize {
        match self {
            Event::Stored(s) => s.hashes.len(),
            Event::Removed(h, _) => h.len(),
            Event::AllCleared => 0,
        }
    }
}

/// Decodes a batch this store published: `(ts, events)`. Anything else
/// (another schema, hashes longer than 64 bytes) is an error naming what
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
    let hashes = || -> Result<Vec<EngineHash>, String> {
        field("block_hashes")
            .and_then(rmpv::Value::as_array)
            .ok_or("an event without block_hashes")?
            .iter()
            .map(|h| {
                name_of(h).ok_or_else(|| format!("block hash {h} is neither bytes nor an integer"))
            })
            .collect()
    };
    let parent = || -> Result<Option<EngineHash>, String> {
        match field("parent_block_hash") {
            None => Ok(None),
            Some(v) if v.is_nil() => Ok(None),
            Some(v) => name_of(v)
                .map(Some)
                .ok_or_else(|| format!("parent block hash {v} is neither bytes nor an integer")),
        }
    };
    let tokens = || -> Result<Vec<u32>, String> {
        let Some(ids) = field("token_ids") else {
            return Ok(Vec::new());
        };
        ids.as_array()
            .ok_or("token_ids is not an array")?
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| format!("token id {t} is not a u32"))
            })
            .collect()
    };
    let tier = || -> Result<Tier, String> {
        let medium = field("medium").and_then(rmpv::Value::as_str);
        medium
            .and_then(tier_of_medium)
            .ok_or_else(|| format!("unknown medium {medium:?}"))
    };
    match field("type").and_then(rmpv::Value::as_str) {
        Some("BlockStored") => Ok(Event::Stored(Stored {
            hashes: hashes()?,
            tier: tier()?,
            parent: parent()?,
            token_ids: tokens()?,
            block_size: field("block_size")
                .and_then(rmpv::Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0),
        })),
        Some("BlockRemoved") => Ok(Event::Removed(hashes()?, tier()?)),
        Some("AllBlocksCleared") => Ok(Event::AllCleared),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// Encodes a batch stamped `ts` (seconds since the Unix epoch).
pub fn encode_batch(ts: f64, events: &[Event]) -> Vec<u8> {
    let blocks: usize = events.iter().map(Event::blocks).sum();
    let tokens: usize = events
        .iter()
        .map(|e| match e {
            Event::Stored(s) => s.token_ids.len(),
            _ => 0,
        })
        .sum();
    let mut out = Vec::with_capacity(16 + events.len() * 96 + blocks * 35 + tokens * 5);
    // Writing to a Vec cannot fail: the results are ignored below.
    let _ = write_array_len(&mut out, 2);
    let _ = write_f64(&mut out, ts);
    let _ = write_array_len(&mut out, events.len() as u32);
    for event in events {
        encode_event(&mut out, event);
    }
    out
}

fn encode_event(out: &mut Vec<u8>, event: &Event) {
    match event {
        Event::Stored(s) => {
            let _ = write_map_len(out, 8);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockStored");
            hashes_field(out, &s.hashes);
            let _ = write_str(out, "parent_block_hash");
            if let Some(p) = &s.parent {
                write_name(out, p);
            } else {
                let _ = write_nil(out);
            }
            let _ = write_str(out, "token_ids");
            let _ = write_array_len(out, s.token_ids.len() as u32);
            for t in &s.token_ids {
                let _ = write_uint(out, u64::from(*t));
            }
            let _ = write_str(out, "block_size");
            let _ = write_uint(out, u64::from(s.block_size));
            let _ = write_str(out, "lora_id");
            let _ = write_nil(out);
            medium_field(out, s.tier);
            let _ = write_str(out, "lora_name");
            let _ = write_nil(out);
        }
        Event::Removed(hashes, tier) => {
            let _ = write_map_len(out, 3);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockRemoved");
            hashes_field(out, hashes);
            medium_field(out, *tier);
        }
        Event::AllCleared => {
            let _ = write_map_len(out, 1);
            let _ = write_str(out, "type");
            let _ = write_str(out, "AllBlocksCleared");
        }
    }
}

fn hashes_field(out: &mut Vec<u8>, hashes: &[EngineHash]) {
    let _ = write_str(out, "block_hashes");
    let _ = write_array_len(out, hashes.len() as u32);
    for h in hashes {
        write_name(out, h);
    }
}

fn write_name(out: &mut Vec<u8>, name: &EngineHash) {
    match name {
        EngineHash::Int(n) => {
            let _ = write_uint(out, *n);
        }
        EngineHash::Bytes(b) => {
            let _ = write_bin(out, b);
        }
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

    fn stored(hashes: &[&BlockHash], tier: Tier, parent: Option<&BlockHash>) -> Event {
        let form = HashForm::Bytes;
        Event::Stored(Stored {
            hashes: hashes.iter().map(|h| form.name(h)).collect(),
            tier,
            parent: parent.map(|p| form.name(p)),
            token_ids: Vec::new(),
            block_size: 0,
        })
    }

    #[test]
    fn a_batch_decodes_as_vllms_schema_lays_it_out() {
        let a = BlockHash::from_opaque(b"a");
        let b = BlockHash::from_opaque(b"b");
        let c = BlockHash::from_opaque(b"c");
        let events = [
            Event::AllCleared,
            stored(&[&a, &b], Tier::Dram, None),
            Event::Removed(vec![HashForm::Bytes.name(&b)], Tier::Nvme),
            stored(&[&c], Tier::Dram, Some(&b)),
        ];
        let bytes = encode_batch(1.5, &events);
        let batch = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let batch = batch.as_array().unwrap();
        assert_eq!(batch.len(), 2, "[ts, events]");
        assert_eq!(batch[0].as_f64(), Some(1.5));
        let out = batch[1].as_array().unwrap();
        assert_eq!(field(&out[0], "type").as_str(), Some("AllBlocksCleared"));
        let first = &out[1];
        assert_eq!(field(first, "type").as_str(), Some("BlockStored"));
        let hashes: Vec<&[u8]> = field(first, "block_hashes")
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_slice().unwrap())
            .collect();
        assert_eq!(hashes, [&a.0[..], &b.0[..]]);
        assert!(field(first, "parent_block_hash").is_nil());
        assert_eq!(field(first, "token_ids").as_array().unwrap().len(), 0);
        assert_eq!(field(first, "medium").as_str(), Some("CPU"));
        for name in ["block_size", "lora_id", "lora_name"] {
            field(first, name);
        }
        assert_eq!(field(&out[2], "type").as_str(), Some("BlockRemoved"));
        assert_eq!(field(&out[2], "block_hashes").as_array().unwrap().len(), 1);
        assert_eq!(field(&out[2], "medium").as_str(), Some("STORAGE"));
        assert_eq!(
            field(&out[3], "parent_block_hash").as_slice(),
            Some(&b.0[..]),
            "a block extending another names it"
        );
        let (ts, decoded) = decode_batch(&bytes).unwrap();
        assert_eq!(ts, 1.5);
        assert_eq!(decoded, events);
        assert!(decode_batch(b"\x01").is_err());
    }

    #[test]
    fn integer_hashes_are_the_last_8_bytes_big_endian_as_vllm_converts_them() {
        let mut raw = [0u8; 32];
        raw[0] = 0xff;
        raw[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let (a, parent) = (BlockHash(raw), BlockHash([9; 32]));
        let form = HashForm::Int;
        let event = Event::Stored(Stored {
            hashes: vec![form.name(&a)],
            tier: Tier::Dram,
            parent: Some(form.name(&parent)),
            token_ids: Vec::new(),
            block_size: 0,
        });
        let bytes = encode_batch(2.0, &[event]);
        let batch = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let first = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
        let hashes = field(first, "block_hashes").as_array().unwrap();
        assert_eq!(hashes[0].as_u64(), Some(0x0102_0304_0506_0708));
        assert_eq!(
            field(first, "parent_block_hash").as_u64(),
            Some(u64::from_be_bytes([9; 8]))
        );
        // Read back, an integer is the hash with its other bytes zero.
        let (_, events) = decode_batch(&bytes).unwrap();
        let Event::Stored(s) = &events[0] else {
            panic!("{events:?}")
        };
        let h = store_hash(&s.hashes[0]).unwrap();
        assert_eq!(h.0[24..], raw[24..]);
        assert_eq!(h.0[..24], [0u8; 24]);
        assert_eq!(
            store_hash(s.parent.as_ref().unwrap()).unwrap().0[24..],
            [9; 8]
        );
    }

    #[test]
    fn an_engines_hashes_and_tokens_are_published_as_its_own_events_carry_them() {
        let event = Event::Stored(Stored {
            hashes: vec![EngineHash::Int(7), EngineHash::Int(8)],
            tier: Tier::Dram,
            parent: Some(EngineHash::Bytes(b"page-0".to_vec().into())),
            token_ids: vec![1, 2, 3, 70_000, 5, 6],
            block_size: 3,
        });
        let bytes = encode_batch(3.0, std::slice::from_ref(&event));
        let batch = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let first = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
        let tokens: Vec<u64> = field(first, "token_ids")
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(tokens, [1, 2, 3, 70_000, 5, 6]);
        assert_eq!(field(first, "block_size").as_u64(), Some(3));
        assert_eq!(
            field(first, "parent_block_hash").as_slice(),
            Some(&b"page-0"[..])
        );
        assert_eq!(decode_batch(&bytes).unwrap().1, [event]);
    }
}
