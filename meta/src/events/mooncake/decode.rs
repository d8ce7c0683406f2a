//! Reads a batch in Mooncake's format back, as a subscriber does: the
//! `events` command shows such a stream with it, and the tests check what
//! the publisher sent. Fields this store never writes are ignored, as
//! Mooncake's own decoders ignore fields they do not know.

use rmpv::Value;

/// What an event says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Stored,
    Removed,
    Cleared,
}

/// One event of a batch, the fields a router reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub event_id: u64,
    pub event_type: EventType,
    pub tenant_id: String,
    pub backend_id: String,
    /// `cpu` or `disk`; none for `cleared`.
    pub medium: Option<String>,
    pub model_name: Option<String>,
    pub block_size: Option<u64>,
    /// The block's name: its string key, else its store hash in hex.
    pub object_key: Option<String>,
    pub seq_hash: Option<u64>,
    pub parent_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub connector_block_hash: Option<String>,
    pub tp_rank: Option<u64>,
    pub pp_rank: Option<u64>,
}

/// A decoded batch: its time (milliseconds since the epoch), its events
/// and its data-parallel rank.
#[derive(Debug, Clone)]
pub struct Batch {
    pub timestamp_ms: i64,
    pub events: Vec<Record>,
    pub dp_rank: Option<u64>,
}

/// Decodes `[timestamp_ms, [event maps], dp_rank]`.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, String> {
    let value = rmpv::decode::read_value(&mut &payload[..])
        .map_err(|e| format!("not a msgpack value: {e}"))?;
    let items = value
        .as_array()
        .filter(|a| a.len() == 3)
        .ok_or("a batch is [timestamp_ms, events, dp_rank]")?;
    let timestamp_ms = items[0]
        .as_i64()
        .ok_or("a batch's timestamp is an integer of milliseconds")?;
    let events = items[1]
        .as_array()
        .ok_or("a batch's events are an array")?
        .iter()
        .enumerate()
        .map(|(i, e)| record(e).map_err(|why| format!("event {i}: {why}")))
        .collect::<Result<_, _>>()?;
    Ok(Batch {
        timestamp_ms,
        events,
        dp_rank: items[2].as_u64(),
    })
}

fn record(event: &Value) -> Result<Record, String> {
    let map = event.as_map().ok_or("an event is a map")?;
    let get = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
            .filter(|v| !v.is_nil())
    };
    let text = |name: &str| get(name).and_then(Value::as_str).map(str::to_string);
    let number = |name: &str| get(name).and_then(Value::as_u64);
    let event_type = match get("event_type").and_then(Value::as_str) {
        Some("stored") => EventType::Stored,
        Some("removed") => EventType::Removed,
        Some("cleared") => EventType::Cleared,
        Some(other) => return Err(format!("an unknown event_type {other:?}")),
        None => return Err("no event_type".into()),
    };
    let first = |name: &str| {
        get(name)
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_u64)
    };
    let token_ids = match get("token_ids").and_then(Value::as_array) {
        Some(tokens) => tokens
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or("a token id that is not a 32-bit integer")?,
        None => Vec::new(),
    };
    Ok(Record {
        event_id: number("event_id").ok_or("no event_id")?,
        event_type,
        tenant_id: text("tenant_id").ok_or("no tenant_id")?,
        backend_id: text("backend_id").unwrap_or_default(),
        medium: text("medium"),
        model_name: text("model_name"),
        block_size: number("block_size"),
        object_key: text("object_key"),
        seq_hash: first("seq_hashes"),
        parent_hash: number("parent_hash"),
        token_ids,
        connector_block_hash: text("connector_block_hash"),
        tp_rank: number("tp_rank"),
        pp_rank: number("pp_rank"),
    })
}
