//! Bodies of a client's calls to the meta service: where blocks are
//! (lookups, prefix matches), two-phase puts (start, commit), removals and
//! pins, and the daemons those answers name.

use super::*;

/// A meta service's answer to `Ping`: the election revision it leads at,
/// so that a client can refuse a leader older than one it has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Revision {
    pub revision: u64,
}

impl Body for Revision {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.revision);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(Revision { revision: r.u64()? })
    }
}

/// A daemon's id and data address, as listed in meta responses so that a
/// client can reach the daemons its keys live on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonAddr {
    pub id: u32,
    /// Its host, so that a reader picks a copy on its own host first.
    pub node: String,
    /// Its TCP data address (every daemon serves TCP).
    pub addr: String,
    /// The other transports it serves, as it advertised them.
    pub endpoints: Vec<Endpoint>,
}

fn encode_daemons(w: &mut Writer, daemons: &[DaemonAddr]) {
    w.count(daemons.len());
    for d in daemons {
        w.u32(d.id);
        w.str(&d.node);
        w.str(&d.addr);
        encode_endpoints(w, &d.endpoints);
    }
}

fn decode_daemons(r: &mut Reader<'_>) -> Result<Vec<DaemonAddr>, ProtoError> {
    let n = r.count(12)?;
    (0..n)
        .map(|_| {
            Ok(DaemonAddr {
                id: r.u32()?,
                node: r.str()?.to_string(),
                addr: r.str()?.to_string(),
                endpoints: decode_endpoints(r)?,
            })
        })
        .collect()
}

/// A namespace and a batch of hashes: the body of `Lookup`, `MatchPrefix`
/// and `MetaRemove`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysRequest {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

impl Body for KeysRequest {
    fn size_hint(&self) -> usize {
        64 + self.hashes.len() * BlockHash::LEN
    }
    fn encode(&self, w: &mut Writer) {
        w.namespace(&self.namespace);
        w.count(self.hashes.len());
        for h in &self.hashes {
            w.hash(h);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let namespace = r.namespace()?;
        let n = r.count(BlockHash::LEN)?;
        let hashes = (0..n).map(|_| r.hash()).collect::<Result<_, _>>()?;
        Ok(KeysRequest { namespace, hashes })
    }
}

/// Pin (or unpin) a batch of keys wherever they are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinRequest {
    pub keys: KeysRequest,
    pub pin: bool,
}

impl Body for PinRequest {
    fn encode(&self, w: &mut Writer) {
        self.keys.encode(w);
        w.u8(self.pin as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let keys = KeysRequest::decode(r)?;
        let pin = r.bool("pin")?;
        Ok(PinRequest { keys, pin })
    }
}

/// Locations of a batch of keys (`Lookup`: one entry per key, `None` for a
/// miss; `MatchPrefix`: the matched leading keys only).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Locations {
    pub items: Vec<Option<Location>>,
    pub daemons: Vec<DaemonAddr>,
}

impl Body for Locations {
    fn size_hint(&self) -> usize {
        8 + self.items.len() * 22 + self.daemons.len() * 64
    }
    fn encode(&self, w: &mut Writer) {
        w.count(self.items.len());
        for item in &self.items {
            match item {
                None => w.u8(0),
                Some(loc) => {
                    w.u8(1);
                    loc.encode(w);
                }
            }
        }
        encode_daemons(w, &self.daemons);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(1)?;
        // A plain loop: prefix matches decode thousands of these a second.
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(match r.u8()? {
                0 => None,
                1 => Some(Location::decode(r)?),
                v => {
                    return Err(ProtoError::Invalid {
                        field: "location tag",
                        why: format!("{v}"),
                    })
                }
            });
        }
        Ok(Locations {
            items,
            daemons: decode_daemons(r)?,
        })
    }
}

/// One block of phase one: its hash, its size, and the block whose prefix
/// it extends (`None`: it starts a chain, or the writer did not say), so
/// that the meta service can judge whether it continues a branch readers
/// come back to (`Slot::Place`'s `continues`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToPlace {
    pub hash: BlockHash,
    pub size: u32,
    pub parent: Option<BlockHash>,
}

impl ToPlace {
    /// A block that names no parent.
    pub fn unchained(hash: BlockHash, size: u32) -> Self {
        ToPlace {
            hash,
            size,
            parent: None,
        }
    }
}

/// Phase one of a put: the blocks to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutStartRequest {
    pub namespace: Namespace,
    /// The writer's host, so that blocks land on its own daemon first
    /// ("": unknown).
    pub node: String,
    /// Copies wanted of each block, on distinct hosts (0: the namespace's
    /// default in the meta service's configuration).
    pub replicas: u8,
    pub items: Vec<ToPlace>,
}

impl Body for PutStartRequest {
    fn encode(&self, w: &mut Writer) {
        w.namespace(&self.namespace);
        w.str(&self.node);
        w.u8(self.replicas);
        w.count(self.items.len());
        for it in &self.items {
            w.hash(&it.hash);
            w.u32(it.size);
            encode_parent(w, &it.parent);
        }
    }
    fn size_hint(&self) -> usize {
        64 + self.node.len() + self.items.len() * (2 * BlockHash::LEN + 4)
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let namespace = r.namespace()?;
        let node = r.str()?.to_string();
        let replicas = r.u8()?;
        let n = r.count(2 * BlockHash::LEN + 4)?;
        let items = (0..n)
            .map(|_| {
                Ok(ToPlace {
                    hash: r.hash()?,
                    size: r.u32()?,
                    parent: decode_parent(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(PutStartRequest {
            namespace,
            node,
            replicas,
            items,
        })
    }
}

/// What the meta service decided for one block of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Write the block to these daemons (one per copy, on distinct
    /// hosts), then commit it. `continues`: the block continues a branch
    /// that readers come back to (`meta/src/branches.rs`): a daemon that
    /// does not hold its parent takes it straight into its main queue
    /// (2Q), as it would if it held the parent.
    Place { copies: Copies, continues: bool },
    /// Do not write it: `AlreadyExists` (stored or being stored by another
    /// writer), `TooLarge`, `Unavailable`.
    Skip(ErrorCode),
}

/// Phase one's answer: a slot per block, and the daemons named in them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PutStartResponse {
    pub slots: Vec<Slot>,
    pub daemons: Vec<DaemonAddr>,
}

impl Body for PutStartResponse {
    fn encode(&self, w: &mut Writer) {
        w.count(self.slots.len());
        for slot in &self.slots {
            match slot {
                Slot::Place { copies, continues } => {
                    w.u16(ErrorCode::Ok as u16);
                    copies.encode(w);
                    w.u8(u8::from(*continues));
                }
                Slot::Skip(code) => w.u16(*code as u16),
            }
        }
        encode_daemons(w, &self.daemons);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(2)?;
        let slots = (0..n)
            .map(|_| {
                Ok(match decode_code(r)? {
                    ErrorCode::Ok => {
                        let copies = Copies::decode(r)?;
                        if copies.is_empty() {
                            return Err(ProtoError::Invalid {
                                field: "slot",
                                why: "placed on no daemon".into(),
                            });
                        }
                        Slot::Place {
                            copies,
                            continues: r.bool("continues")?,
                        }
                    }
                    other => Slot::Skip(other),
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(PutStartResponse {
            slots,
            daemons: decode_daemons(r)?,
        })
    }
}

/// One block of phase two: the daemons, of those it was placed on, that
/// stored it (make it visible there), or none (release the reservation at
/// once rather than at its timeout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitItem {
    pub hash: BlockHash,
    pub stored_on: Copies,
    pub size: u32,
    pub checksum: u64,
    /// The block whose prefix this one extends, as the writer named it
    /// (`put_chain`): the meta service publishes it in store events.
    pub parent: Option<BlockHash>,
    /// What the engine calls the block (its hash, its tokens), for store
    /// events; kept by the meta service only while events are on.
    pub tag: Option<Arc<EngineTag>>,
}

impl CommitItem {
    pub fn stored(&self) -> bool {
        !self.stored_on.is_empty()
    }
}

/// Phase two of a put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutCommitRequest {
    pub namespace: Namespace,
    pub items: Vec<CommitItem>,
}

impl Body for PutCommitRequest {
    fn encode(&self, w: &mut Writer) {
        w.namespace(&self.namespace);
        w.count(self.items.len());
        for it in &self.items {
            w.hash(&it.hash);
            it.stored_on.encode(w);
            w.u32(it.size);
            w.u64(it.checksum);
            encode_parent(w, &it.parent);
            encode_tag(w, &it.tag);
        }
    }
    fn size_hint(&self) -> usize {
        let tags: usize = self
            .items
            .iter()
            .filter_map(|it| it.tag.as_deref())
            .map(EngineTag::encoded_len)
            .sum();
        64 + self.items.len() * (2 * BlockHash::LEN + 14 + 4 * MAX_COPIES) + tags
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let namespace = r.namespace()?;
        let n = r.count(2 * BlockHash::LEN + 14)?;
        let items = (0..n)
            .map(|_| {
                Ok(CommitItem {
                    hash: r.hash()?,
                    stored_on: Copies::decode(r)?,
                    size: r.u32()?,
                    checksum: r.u64()?,
                    parent: decode_parent(r)?,
                    tag: decode_tag(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(PutCommitRequest { namespace, items })
    }
}

/// A status per item of a batch (commit, remove, pin).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Statuses {
    pub codes: Vec<ErrorCode>,
}

impl Body for Statuses {
    fn encode(&self, w: &mut Writer) {
        w.count(self.codes.len());
        for c in &self.codes {
            w.u16(*c as u16);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(2)?;
        let codes = (0..n).map(|_| decode_code(r)).collect::<Result<_, _>>()?;
        Ok(Statuses { codes })
    }
}
