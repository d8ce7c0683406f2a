//! Bodies of a daemon's calls to the meta service: register, inventory,
//! heartbeats, events (blocks it dropped) and leaving.

use super::*;

/// A daemon that stops, by the id it was given and the address it
/// registered (so that a stale id never takes another daemon out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaveRequest {
    pub daemon: u32,
    pub addr: String,
}

impl Body for LeaveRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.str(&self.addr);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(LeaveRequest {
            daemon: r.u32()?,
            addr: r.str()?.to_string(),
        })
    }
}

/// A daemon joins the cluster (or joins a new leader). Its blocks follow
/// in `Inventory` messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterRequest {
    pub node: String,
    pub addr: String,
    pub capacity: u64,
    /// The id an earlier leader gave this daemon (0: none), kept if free,
    /// so that locations cached by clients stay meaningful across failover.
    pub id_hint: u32,
    /// Transports served besides TCP at `addr`.
    pub endpoints: Vec<Endpoint>,
    /// Whether the daemon requires a token of its clients: a meta service
    /// that requires one refuses a daemon that does not, whose blocks any
    /// peer could read.
    pub requires_auth: bool,
}

impl Body for RegisterRequest {
    fn encode(&self, w: &mut Writer) {
        w.str(&self.node);
        w.str(&self.addr);
        w.u64(self.capacity);
        w.u32(self.id_hint);
        encode_endpoints(w, &self.endpoints);
        w.u8(u8::from(self.requires_auth));
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(RegisterRequest {
            node: r.str()?.to_string(),
            addr: r.str()?.to_string(),
            capacity: r.u64()?,
            id_hint: r.u32()?,
            endpoints: decode_endpoints(r)?,
            requires_auth: match r.u8()? {
                0 => false,
                1 => true,
                _ => {
                    return Err(ProtoError::Invalid {
                        field: "requires_auth",
                        why: "neither 0 nor 1".into(),
                    })
                }
            },
        })
    }
}

/// What of its blocks' engine tags a daemon keeps, to report them to the
/// next leader: as much as the leader's store events use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepTags {
    /// Events are off: no tags.
    No = 0,
    /// Tags without their object keys (vLLM's event format).
    WithoutKeys = 1,
    /// Whole tags (Mooncake's format names blocks by their keys).
    WithKeys = 2,
}

impl KeepTags {
    fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            0 => KeepTags::No,
            1 => KeepTags::WithoutKeys,
            2 => KeepTags::WithKeys,
            _ => {
                return Err(ProtoError::Invalid {
                    field: "keep_tags",
                    why: format!("unknown value {v}"),
                })
            }
        })
    }
}

/// The id the meta service gave a daemon, and the leader's election
/// revision: a daemon refuses a leader older than one it has seen.
/// `keep_tags`: what of its blocks' engine tags the daemon keeps for the
/// next leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterResponse {
    pub daemon: u32,
    pub revision: u64,
    pub keep_tags: KeepTags,
}

impl Body for RegisterResponse {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.u64(self.revision);
        w.u8(self.keep_tags as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(RegisterResponse {
            daemon: r.u32()?,
            revision: r.u64()?,
            keep_tags: KeepTags::from_u8(r.u8()?)?,
        })
    }
}

/// One stored block, as a daemon reports it to a (new) leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryItem {
    pub key: BlockKey,
    pub size: u32,
    pub checksum: u64,
    /// The fastest tier that holds it.
    pub tier: Tier,
    /// The block whose prefix it extends, as its writer named it.
    pub parent: Option<BlockHash>,
    /// What the engine calls it, as its writer attached it.
    pub tag: Option<Arc<EngineTag>>,
}

/// A batch of the blocks a daemon holds, sent after it registers, so that
/// a new leader rebuilds its index from the daemons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryRequest {
    pub daemon: u32,
    pub items: Vec<InventoryItem>,
}

impl Body for InventoryRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.count(self.items.len());
        for it in &self.items {
            encode_key(w, &it.key);
            w.u32(it.size);
            w.u64(it.checksum);
            it.tier.encode(w);
            encode_parent(w, &it.parent);
            encode_tag(w, &it.tag);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemon = r.u32()?;
        let n = r.count(2 + 1 + 32 + 12 + 1 + 32 + 1)?;
        let items = (0..n)
            .map(|_| {
                Ok(InventoryItem {
                    key: decode_key(r)?,
                    size: r.u32()?,
                    checksum: r.u64()?,
                    tier: Tier::decode(r)?,
                    parent: decode_parent(r)?,
                    tag: decode_tag(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(InventoryRequest { daemon, items })
    }
}

/// A daemon's periodic report: alive, and how full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatRequest {
    pub daemon: u32,
    pub stats: PoolStats,
    /// The blocks it served most since its last heartbeat, with about how
    /// many reads each (the meta service gives hot blocks more copies).
    pub hot: Vec<(BlockKey, u32)>,
}

impl Body for HeartbeatRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        self.stats.encode(w);
        w.count(self.hot.len());
        for (key, reads) in &self.hot {
            encode_key(w, key);
            w.u32(*reads);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemon = r.u32()?;
        let stats = PoolStats::decode(r)?;
        let n = r.count(2 + 1 + 32 + 4)?;
        let hot = (0..n)
            .map(|_| Ok((decode_key(r)?, r.u32()?)))
            .collect::<Result<_, ProtoError>>()?;
        Ok(HeartbeatRequest { daemon, stats, hot })
    }
}

/// The meta service's answer to a heartbeat: blocks this daemon evicted
/// recently that readers then looked for and did not find (its 2Q pool
/// grows probation for those it let go too early). At most `MAX_BATCH`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeartbeatResponse {
    pub missed: Vec<BlockKey>,
}

impl Body for HeartbeatResponse {
    fn encode(&self, w: &mut Writer) {
        w.count(self.missed.len());
        for key in &self.missed {
            encode_key(w, key);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(2 + 1 + 32)?;
        let missed = (0..n).map(|_| decode_key(r)).collect::<Result<_, _>>()?;
        Ok(HeartbeatResponse { missed })
    }
}

/// Blocks a daemon dropped on its own (evicted, or found corrupt), and
/// blocks whose fastest tier changed (demoted to NVMe, promoted back).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EventsRequest {
    pub daemon: u32,
    pub removed: Vec<BlockKey>,
    pub moved: Vec<(BlockKey, Tier)>,
}

impl Body for EventsRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.count(self.removed.len());
        for k in &self.removed {
            encode_key(w, k);
        }
        w.count(self.moved.len());
        for (k, tier) in &self.moved {
            encode_key(w, k);
            tier.encode(w);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemon = r.u32()?;
        let n = r.count(2 + 1 + 32)?;
        let removed = (0..n).map(|_| decode_key(r)).collect::<Result<_, _>>()?;
        let n = r.count(2 + 1 + 32 + 1)?;
        let moved = (0..n)
            .map(|_| Ok((decode_key(r)?, Tier::decode(r)?)))
            .collect::<Result<_, ProtoError>>()?;
        Ok(EventsRequest {
            daemon,
            removed,
            moved,
        })
    }
}
