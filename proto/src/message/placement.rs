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
    /// Its TCP data address (every daemon serves TCP).
    pub addr: String,
    /// The other transports it serves, as it advertised them.
    pub endpoints: Vec<Endpoint>,
}

fn encode_daemons(w: &mut Writer, daemons: &[DaemonAddr]) {
    w.count(daemons.len());
    for d in daemons {
        w.u32(d.id);
        w.str(&d.addr);
        encode_endpoints(w, &d.endpoints);
    }
}

fn decode_daemons(r: &mut Reader<'_>) -> Result<Vec<DaemonAddr>, ProtoError> {
    let n = r.count(10)?;
    (0..n)
        .map(|_| {
            Ok(DaemonAddr {
                id: r.u32()?,
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

/// Where a stored block lives, with what the writer declared of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub daemon: u32,
    pub size: u32,
    pub checksum: u64,
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
        8 + self.items.len() * 17 + self.daemons.len() * 64
    }
    fn encode(&self, w: &mut Writer) {
        w.count(self.items.len());
        for item in &self.items {
            match item {
                None => w.u8(0),
                Some(loc) => {
                    w.u8(1);
                    w.u32(loc.daemon);
                    w.u32(loc.size);
                    w.u64(loc.checksum);
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
                1 => Some(Location {
                    daemon: r.u32()?,
                    size: r.u32()?,
                    checksum: r.u64()?,
                }),
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

/// Phase one of a put: the sizes of the blocks to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutStartRequest {
    pub namespace: Namespace,
    /// The writer's host, so that blocks land on its own daemon first
    /// ("": unknown).
    pub node: String,
    pub items: Vec<(BlockHash, u32)>,
}

impl Body for PutStartRequest {
    fn encode(&self, w: &mut Writer) {
        w.namespace(&self.namespace);
        w.str(&self.node);
        w.count(self.items.len());
        for (h, size) in &self.items {
            w.hash(h);
            w.u32(*size);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let namespace = r.namespace()?;
        let node = r.str()?.to_string();
        let n = r.count(BlockHash::LEN + 4)?;
        let items = (0..n)
            .map(|_| Ok((r.hash()?, r.u32()?)))
            .collect::<Result<_, ProtoError>>()?;
        Ok(PutStartRequest {
            namespace,
            node,
            items,
        })
    }
}

/// What the meta service decided for one block of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Write the block to this daemon, then commit it.
    Place(u32),
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
                Slot::Place(d) => {
                    w.u16(ErrorCode::Ok as u16);
                    w.u32(*d);
                }
                Slot::Skip(code) => {
                    w.u16(*code as u16);
                    w.u32(0);
                }
            }
        }
        encode_daemons(w, &self.daemons);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(6)?;
        let slots = (0..n)
            .map(|_| {
                let code = decode_code(r)?;
                let daemon = r.u32()?;
                Ok(match code {
                    ErrorCode::Ok => Slot::Place(daemon),
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

/// One block of phase two: stored (make it visible) or not (release the
/// reservation at once rather than at its timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitItem {
    pub hash: BlockHash,
    pub daemon: u32,
    pub size: u32,
    pub checksum: u64,
    pub stored: bool,
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
            w.u32(it.daemon);
            w.u32(it.size);
            w.u64(it.checksum);
            w.u8(it.stored as u8);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let namespace = r.namespace()?;
        let n = r.count(BlockHash::LEN + 17)?;
        let items = (0..n)
            .map(|_| {
                Ok(CommitItem {
                    hash: r.hash()?,
                    daemon: r.u32()?,
                    size: r.u32()?,
                    checksum: r.u64()?,
                    stored: r.u8()? != 0,
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
