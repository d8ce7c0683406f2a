//! Store events in Mooncake's own format, as its master publishes them for
//! Mooncake's Conductor and Dynamo's shared-cache router (Mooncake's
//! `docs/source/design/kv-event/publisher-design.md`, the RFC #1527
//! maps): each batch a msgpack array `[timestamp_ms, [event maps],
//! dp_rank]`, each event a map whose `event_type` is `stored`, `removed`
//! or `cleared`.
//!
//! Mooncake's events describe availability, not copies: `stored` when a
//! block's first copy in a medium (`cpu`: DRAM, `disk`: NVMe) appears,
//! `removed` when its last one there goes (`Availability` counts them),
//! and `cleared` for a tenant (our namespace) whose earlier records are
//! void: before a term's first event of that tenant, and on a resync.
//!
//! A block is named by the key its writer stored it under (`object_key`)
//! when that was a string, with the fields a connector key holds
//! (`keys`); otherwise by the hexadecimal store hash.

mod decode;
mod keys;

use std::collections::{HashMap, HashSet};

use mooncake_proto::message::{EngineHash, Tier};
use mooncake_proto::{BlockHash, Namespace};
use rmp::encode::{write_array_len, write_map_len, write_nil, write_sint, write_str, write_uint};

use super::{Kind, Named};

pub use decode::{decode_batch, Batch, EventType, Record};
pub use keys::{parse as parse_key, KeyParts};

/// What every event says of its publisher (the meta service's
/// `events_*` settings).
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// Who owns the cache (`backend_id`).
    pub backend_id: String,
    /// The model of blocks whose key names none (empty: `nil`).
    pub model_name: String,
    /// Tokens per block where the writer attached none (0: `nil`).
    pub block_size: u32,
    pub lora_name: String,
    pub additional_salt: String,
    pub dp_rank: u32,
}

/// One event: a block (its namespace, hash and what the index kept of
/// it) stored in or removed from a medium, or a tenant cleared.
#[derive(Debug, Clone)]
pub enum Event {
    Block {
        kind: Kind,
        tier: Tier,
        ns: Namespace,
        hash: BlockHash,
        named: Named,
    },
    Cleared(Namespace),
}

/// Copies per block and medium, and the tenants cleared in this term (or
/// since the last resync).
#[derive(Default)]
pub struct Availability {
    copies: HashMap<(Namespace, BlockHash), [u32; 2]>,
    cleared: HashSet<Namespace>,
}

impl Availability {
    /// Counts a copy stored or removed; whether that changed the block's
    /// availability in the tier (its first copy there, or its last).
    pub fn apply(&mut self, kind: Kind, tier: Tier, ns: &Namespace, hash: BlockHash) -> bool {
        let slot = tier as usize;
        match kind {
            Kind::Stored => {
                let counts = self.copies.entry((ns.clone(), hash)).or_default();
                counts[slot] += 1;
                counts[slot] == 1
            }
            Kind::Removed => {
                let key = (ns.clone(), hash);
                let Some(counts) = self.copies.get_mut(&key) else {
                    return false;
                };
                if counts[slot] == 0 {
                    return false;
                }
                counts[slot] -= 1;
                let gone = counts[slot] == 0;
                if counts == &[0, 0] {
                    self.copies.remove(&key);
                }
                gone
            }
        }
    }

    /// Whether `ns` still needs its `cleared` (and marks it done).
    pub fn clear_first(&mut self, ns: &Namespace) -> bool {
        self.cleared.insert(ns.clone())
    }

    /// Forgets every count and which tenants were cleared; returns those
    /// tenants, each to be cleared again.
    pub fn reset(&mut self) -> Vec<Namespace> {
        self.copies.clear();
        self.cleared.drain().collect()
    }
}

/// Mooncake's name of a medium.
pub fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Dram => "cpu",
        Tier::Nvme => "disk",
    }
}

/// A block's 64-bit hash (`seq_hashes`): its connector key's, else its
/// engine hash (an integer as is, bytes by their last 8, big-endian, as
/// vLLM converts them), else the store hash's last 8 bytes.
fn seq_hash(hash: &BlockHash, named: &Named, parts: Option<&KeyParts<'_>>) -> u64 {
    if let Some(parts) = parts {
        return parts.seq_hash;
    }
    match named.tag.as_ref().and_then(|t| t.hash.as_ref()) {
        Some(engine) => engine_seq(engine),
        None => store_seq(hash),
    }
}

fn engine_seq(engine: &EngineHash) -> u64 {
    match engine {
        EngineHash::Int(n) => *n,
        EngineHash::Bytes(b) => {
            let mut last = [0u8; 8];
            let n = b.len().min(8);
            last[8 - n..].copy_from_slice(&b[b.len() - n..]);
            u64::from_be_bytes(last)
        }
    }
}

fn store_seq(hash: &BlockHash) -> u64 {
    u64::from_be_bytes(hash.0[24..].try_into().expect("8 bytes"))
}

/// Encodes a batch; `event_id` numbers its first event.
pub fn encode_batch(ctx: &Context, at_ms: i64, event_id: u64, events: &[Event]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + events.len() * 400);
    let _ = write_array_len(&mut out, 3);
    let _ = write_sint(&mut out, at_ms);
    let _ = write_array_len(&mut out, events.len() as u32);
    for (i, event) in events.iter().enumerate() {
        encode_event(&mut out, ctx, at_ms, event_id + i as u64, event);
    }
    let _ = write_uint(&mut out, u64::from(ctx.dp_rank));
    out
}

/// A map's fields, counted as they are written (msgpack puts a map's
/// length first).
struct Fields {
    out: Vec<u8>,
    len: u32,
}

impl Fields {
    fn key(&mut self, name: &str) -> &mut Vec<u8> {
        self.len += 1;
        let _ = write_str(&mut self.out, name);
        &mut self.out
    }
    fn str(&mut self, name: &str, value: &str) {
        let _ = write_str(self.key(name), value);
    }
    fn opt_str(&mut self, name: &str, value: Option<&str>) {
        match value.filter(|v| !v.is_empty()) {
            Some(v) => self.str(name, v),
            None => {
                let _ = write_nil(self.key(name));
            }
        }
    }
    fn uint(&mut self, name: &str, value: u64) {
        let _ = write_uint(self.key(name), value);
    }
    fn opt_uint(&mut self, name: &str, value: Option<u64>) {
        match value {
            Some(v) => self.uint(name, v),
            None => {
                let _ = write_nil(self.key(name));
            }
        }
    }
    fn nil(&mut self, name: &str) {
        let _ = write_nil(self.key(name));
    }
    fn hashes(&mut self, name: &str, seq: u64) {
        let out = self.key(name);
        let _ = write_array_len(out, 1);
        let _ = write_uint(out, seq);
    }
}

fn encode_event(out: &mut Vec<u8>, ctx: &Context, at_ms: i64, id: u64, event: &Event) {
    let mut f = Fields {
        out: Vec::with_capacity(512),
        len: 0,
    };
    let (event_type, legacy, ns, tier) = match event {
        Event::Block { kind, tier, ns, .. } => match kind {
            Kind::Stored => ("stored", "BlockStored", ns, Some(*tier)),
            Kind::Removed => ("removed", "BlockRemoved", ns, Some(*tier)),
        },
        Event::Cleared(ns) => ("cleared", "AllBlocksCleared", ns, None),
    };
    let block = match event {
        Event::Block { hash, named, .. } => Some((hash, named)),
        Event::Cleared(_) => None,
    };
    let key = block.and_then(|(_, named)| named.tag.as_ref().and_then(|t| t.key.as_deref()));
    let parts = key.and_then(parse_key);
    f.uint("event_id", id);
    let _ = write_sint(f.key("timestamp"), at_ms);
    f.str("event_type", event_type);
    f.str("type", legacy);
    let model = parts.as_ref().map(|p| p.model);
    f.opt_str("model_name", model.or(Some(ctx.model_name.as_str())));
    let tokens = block.and_then(|(_, named)| named.tag.as_ref().map(|t| t.token_ids.len()));
    let block_size = match tokens {
        Some(n) if n > 0 => Some(n as u64),
        _ => (ctx.block_size > 0).then_some(u64::from(ctx.block_size)),
    };
    f.opt_uint("block_size", block_size);
    f.opt_str("additional_salt", Some(&ctx.additional_salt));
    f.opt_str("lora_name", Some(&ctx.lora_name));
    f.str("tenant_id", ns.as_str());
    f.str("backend_id", &ctx.backend_id);
    f.opt_str("medium", tier.map(medium));
    f.uint("dp_rank", u64::from(ctx.dp_rank));
    if let Some((hash, named)) = block {
        let seq = seq_hash(hash, named, parts.as_ref());
        f.opt_str("group_id", parts.as_ref().and_then(|p| p.group));
        f.hashes("seq_hashes", seq);
        f.hashes("block_hashes", seq);
        f.nil("base_block_idx");
        match key {
            Some(key) => f.str("object_key", key),
            None => f.str("object_key", &hash.to_hex()),
        }
        if let Some(p) = &parts {
            f.str("connector_block_hash", p.block_hash);
            if let Some(prefix) = p.cache_prefix {
                f.str("cache_prefix", prefix);
            }
            for (name, value) in [
                ("tp_rank", p.tp_rank),
                ("head_or_tp_rank", p.head_or_tp_rank),
                ("pcp_rank", p.pcp_rank),
                ("dcp_rank", p.dcp_rank),
                ("pp_rank", p.pp_rank),
                ("layer_id", p.layer_id),
            ] {
                if let Some(v) = value {
                    f.uint(name, v);
                }
            }
        }
        if matches!(
            event,
            Event::Block {
                kind: Kind::Stored,
                ..
            }
        ) {
            // A block stored under a string key may extend one named by
            // its own key, which its event does not know: no parent then.
            let parent = match (&named.parent_hash, &named.parent) {
                _ if key.is_some() => None,
                (Some(engine), _) => Some(engine_seq(engine)),
                (None, Some(parent)) => Some(store_seq(parent)),
                (None, None) => None,
            };
            f.opt_uint("parent_hash", parent);
            f.opt_uint("parent_block_hash", parent);
            match named.tag.as_ref().filter(|t| !t.token_ids.is_empty()) {
                Some(tag) => {
                    let out = f.key("token_ids");
                    let _ = write_array_len(out, tag.token_ids.len() as u32);
                    for t in &tag.token_ids {
                        let _ = write_uint(out, u64::from(*t));
                    }
                }
                None => f.nil("token_ids"),
            }
        }
    }
    let _ = write_map_len(out, f.len);
    out.extend_from_slice(&f.out);
}

#[cfg(test)]
mod tests;
