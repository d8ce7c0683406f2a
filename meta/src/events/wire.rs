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
//! 32 bytes of the block key's hash, as msgpack bin.

use mooncake_proto::BlockHash;
use rmp::encode::{
    write_array_len, write_bin, write_f64, write_map_len, write_nil, write_str, write_uint,
};

/// vLLM's name for host memory (`MEDIUM_CPU`): a block a daemon holds.
pub const MEDIUM: &str = "CPU";

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored(Vec<BlockHash>),
    Removed(Vec<BlockHash>),
    AllCleared,
}

impl Event {
    pub fn blocks(&self) -> usize {
        match self {
            Event::Stored(h) | Event::Removed(h) => h.len(),
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
                h.as_slice()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .map(BlockHash)
                    .ok_or_else(|| format!("block hash {h} is not 32 bytes"))
            })
            .collect()
    };
    match field("type").and_then(rmpv::Value::as_str) {
        Some("BlockStored") => Ok(Event::Stored(hashes()?)),
        Some("BlockRemoved") => Ok(Event::Removed(hashes()?)),
        Some("AllBlocksCleared") => Ok(Event::AllCleared),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// Encodes a batch stamped `ts` (seconds since the Unix epoch).
pub fn encode_batch(ts: f64, events: &[Event]) -> Vec<u8> {
    let blocks: usize = events.iter().map(Event::blocks).sum();
    let mut out = Vec::with_capacity(16 + events.len() * 96 + blocks * 35);
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
        Event::Stored(hashes) => {
            let _ = write_map_len(out, 8);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockStored");
            hashes_field(out, hashes);
            let _ = write_str(out, "parent_block_hash");
            let _ = write_nil(out);
            let _ = write_str(out, "token_ids");
            let _ = write_array_len(out, 0);
            let _ = write_str(out, "block_size");
            let _ = write_uint(out, 0);
            let _ = write_str(out, "lora_id");
            let _ = write_nil(out);
            medium_field(out);
            let _ = write_str(out, "lora_name");
            let _ = write_nil(out);
        }
        Event::Removed(hashes) => {
            let _ = write_map_len(out, 3);
            let _ = write_str(out, "type");
            let _ = write_str(out, "BlockRemoved");
            hashes_field(out, hashes);
            medium_field(out);
        }
        Event::AllCleared => {
            let _ = write_map_len(out, 1);
            let _ = write_str(out, "type");
            let _ = write_str(out, "AllBlocksCleared");
        }
    }
}

fn hashes_field(out: &mut Vec<u8>, hashes: &[BlockHash]) {
    let _ = write_str(out, "block_hashes");
    let _ = write_array_len(out, hashes.len() as u32);
    for h in hashes {
        let _ = write_bin(out, &h.0);
    }
}

fn medium_field(out: &mut Vec<u8>) {
    let _ = write_str(out, "medium");
    let _ = write_str(out, MEDIUM);
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
        let bytes = encode_batch(
            1.5,
            &[
                Event::AllCleared,
                Event::Stored(vec![a, b]),
                Event::Removed(vec![b]),
            ],
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
        assert_eq!(field(stored, "medium").as_str(), Some(MEDIUM));
        for name in ["block_size", "lora_id", "lora_name"] {
            field(stored, name);
        }
        assert_eq!(field(&events[2], "type").as_str(), Some("BlockRemoved"));
        assert_eq!(
            field(&events[2], "block_hashes").as_array().unwrap().len(),
            1
        );
        let (ts, decoded) = decode_batch(&bytes).unwrap();
        assert_eq!(ts, 1.5);
        assert_eq!(
            decoded,
            [
                Event::AllCleared,
                Event::Stored(vec![a, b]),
                Event::Removed(vec![b])
            ]
        );
        assert!(decode_batch(b"\x01").is_err());
    }
}
