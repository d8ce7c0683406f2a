//! Request and response bodies. Each type encodes itself with `Writer` and
//! is validated once on receive by `decode`, into fields that are valid by
//! construction (namespaces checked, batch sizes bounded).

use crate::codec::{Reader, Writer};
use crate::error::{ErrorCode, ProtoError};
use crate::key::{BlockHash, BlockKey, Namespace, MAX_NAMESPACE_LEN};
use crate::transport::{decode_endpoints, encode_endpoints, Endpoint};

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

/// One key: the body of daemon `Get`, `Remove`, `Pin` and `Unpin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRequest {
    pub key: BlockKey,
}

impl Body for KeyRequest {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(KeyRequest {
            key: decode_key(r)?,
        })
    }
}

/// The head of a daemon `Put` body; the value bytes follow it to the end of
/// the frame, so that a server can read them straight into their place.
///
/// Layout: `u16 namespace length, namespace, 32-byte hash, u64 checksum`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutHead {
    pub key: BlockKey,
    pub checksum: u64,
    /// The block whose prefix this one extends (same namespace), so that
    /// the daemon evicts chain tails before the blocks they need.
    pub parent: Option<BlockHash>,
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

impl PutHead {
    /// Bytes of the head after its leading u16, given that u16's value;
    /// refused if the namespace would be too long.
    /// The longest head on the wire: the namespace's length, the longest
    /// namespace, the hash, the checksum and the parent.
    pub const MAX_LEN: usize = 2 + MAX_NAMESPACE_LEN + BlockHash::LEN + 8 + BlockHash::LEN;

    pub fn rest_len(ns_len: u16) -> Result<usize, ProtoError> {
        if ns_len as usize > MAX_NAMESPACE_LEN {
            return Err(ProtoError::Invalid {
                field: "namespace",
                why: format!("{ns_len} bytes, at most {MAX_NAMESPACE_LEN}"),
            });
        }
        Ok(ns_len as usize + BlockHash::LEN + 8 + BlockHash::LEN)
    }

    pub fn encoded_len(&self) -> usize {
        2 + self.key.namespace.as_str().len() + BlockHash::LEN + 8 + BlockHash::LEN
    }
}

impl Body for PutHead {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
        w.u64(self.checksum);
        encode_parent(w, &self.parent);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(PutHead {
            key: decode_key(r)?,
            checksum: r.u64()?,
            parent: decode_parent(r)?,
        })
    }
}

/// Length of the head of a `Get` response: the block's checksum (u64);
/// the value follows to the end of the frame.
pub const GET_HEAD_LEN: usize = 8;

/// One daemon's pool, as reported by `DaemonStats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub capacity: u64,
    pub used: u64,
    pub blocks: u64,
    pub pinned: u64,
    pub evictions: u64,
    /// Gets answered with the block, and gets that missed, since start.
    pub hits: u64,
    pub misses: u64,
}

impl Body for PoolStats {
    fn encode(&self, w: &mut Writer) {
        for v in [
            self.capacity,
            self.used,
            self.blocks,
            self.pinned,
            self.evictions,
            self.hits,
            self.misses,
        ] {
            w.u64(v);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(PoolStats {
            capacity: r.u64()?,
            used: r.u64()?,
            blocks: r.u64()?,
            pinned: r.u64()?,
            evictions: r.u64()?,
            hits: r.u64()?,
            misses: r.u64()?,
        })
    }
}

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

/// A daemon evicts its coldest blocks now (an operator freeing memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictRequest {
    pub bytes: u64,
}

impl Body for EvictRequest {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.bytes);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(EvictRequest { bytes: r.u64()? })
    }
}

/// What an eviction freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictResponse {
    pub bytes: u64,
    pub blocks: u64,
}

impl Body for EvictResponse {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.bytes);
        w.u64(self.blocks);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(EvictResponse {
            bytes: r.u64()?,
            blocks: r.u64()?,
        })
    }
}

/// Stop (or resume) placing new blocks on a daemon, before taking it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainRequest {
    pub daemon: u32,
    pub drain: bool,
}

impl Body for DrainRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.u8(self.drain as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(DrainRequest {
            daemon: r.u32()?,
            drain: r.u8()? != 0,
        })
    }
}

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
        let pin = match r.u8()? {
            0 => false,
            1 => true,
            v => {
                return Err(ProtoError::Invalid {
                    field: "pin",
                    why: format!("{v} is not a boolean"),
                })
            }
        };
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

fn decode_code(r: &mut Reader<'_>) -> Result<ErrorCode, ProtoError> {
    let raw = r.u16()?;
    ErrorCode::from_u16(raw).ok_or(ProtoError::Invalid {
        field: "error code",
        why: format!("unknown code {raw}"),
    })
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

/// One daemon as the meta service sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonInfo {
    pub id: u32,
    pub node: String,
    pub addr: String,
    pub alive: bool,
    /// No new blocks are placed on it.
    pub draining: bool,
    pub capacity: u64,
    pub used: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    /// Transports it serves besides TCP.
    pub endpoints: Vec<Endpoint>,
}

/// How often one operation failed with one code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorCount {
    pub op: String,
    pub code: String,
    pub count: u64,
}

/// The whole cluster at a glance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterStats {
    /// The answering leader's address and election revision.
    pub leader: String,
    pub revision: u64,
    /// Meta replicas standing by.
    pub standbys: Vec<String>,
    pub blocks: u64,
    pub bytes: u64,
    pub pending: u64,
    pub daemons: Vec<DaemonInfo>,
    /// The meta service's most frequent error answers since it leads.
    pub errors: Vec<ErrorCount>,
}

impl Body for ClusterStats {
    fn encode(&self, w: &mut Writer) {
        w.str(&self.leader);
        w.u64(self.revision);
        w.count(self.standbys.len());
        for s in &self.standbys {
            w.str(s);
        }
        w.u64(self.blocks);
        w.u64(self.bytes);
        w.u64(self.pending);
        w.count(self.daemons.len());
        for d in &self.daemons {
            w.u32(d.id);
            w.str(&d.node);
            w.str(&d.addr);
            w.u8(d.alive as u8);
            w.u8(d.draining as u8);
            w.u64(d.capacity);
            w.u64(d.used);
            w.u64(d.blocks);
            w.u64(d.hits);
            w.u64(d.misses);
            encode_endpoints(w, &d.endpoints);
        }
        w.count(self.errors.len());
        for e in &self.errors {
            w.str(&e.op);
            w.str(&e.code);
            w.u64(e.count);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let leader = r.str()?.to_string();
        let revision = r.u64()?;
        let n = r.count(2)?;
        let standbys = (0..n)
            .map(|_| Ok(r.str()?.to_string()))
            .collect::<Result<_, ProtoError>>()?;
        let blocks = r.u64()?;
        let bytes = r.u64()?;
        let pending = r.u64()?;
        let n = r.count(37)?;
        let daemons = (0..n)
            .map(|_| {
                Ok(DaemonInfo {
                    id: r.u32()?,
                    node: r.str()?.to_string(),
                    addr: r.str()?.to_string(),
                    alive: r.u8()? != 0,
                    draining: r.u8()? != 0,
                    capacity: r.u64()?,
                    used: r.u64()?,
                    blocks: r.u64()?,
                    hits: r.u64()?,
                    misses: r.u64()?,
                    endpoints: decode_endpoints(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let n = r.count(12)?;
        let errors = (0..n)
            .map(|_| {
                Ok(ErrorCount {
                    op: r.str()?.to_string(),
                    code: r.str()?.to_string(),
                    count: r.u64()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(ClusterStats {
            leader,
            revision,
            standbys,
            blocks,
            bytes,
            pending,
            daemons,
            errors,
        })
    }
}

/// Page through the index, ordered by (namespace, hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListRequest {
    /// Only this namespace, or every namespace.
    pub namespace: Option<Namespace>,
    /// Start after this key (the last key of the previous page).
    pub after: Option<BlockKey>,
    /// Only hashes starting with these bytes (at most 32).
    pub prefix: Vec<u8>,
    /// Only blocks on this daemon (0: any).
    pub daemon: u32,
    pub limit: u32,
}

impl Body for ListRequest {
    fn encode(&self, w: &mut Writer) {
        w.str(self.namespace.as_ref().map_or("", |n| n.as_str()));
        match &self.after {
            None => w.u8(0),
            Some(k) => {
                w.u8(1);
                encode_key(w, k);
            }
        }
        w.u8(self.prefix.len().min(32) as u8);
        w.buf
            .extend_from_slice(&self.prefix[..self.prefix.len().min(32)]);
        w.u32(self.daemon);
        w.u32(self.limit);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let ns = r.str()?;
        let namespace = if ns.is_empty() {
            None
        } else {
            Some(Namespace::new(ns)?)
        };
        let after = match r.u8()? {
            0 => None,
            _ => Some(decode_key(r)?),
        };
        let n = r.u8()? as usize;
        if n > 32 {
            return Err(ProtoError::Invalid {
                field: "prefix",
                why: format!("{n} bytes, at most 32"),
            });
        }
        let prefix = r.take(n)?.to_vec();
        Ok(ListRequest {
            namespace,
            after,
            prefix,
            daemon: r.u32()?,
            limit: r.u32()?,
        })
    }
}

/// One listed block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub key: BlockKey,
    pub location: Location,
}

/// A page of the index; `more` says whether a next page exists.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListResponse {
    pub entries: Vec<ListEntry>,
    pub more: bool,
}

impl Body for ListResponse {
    fn encode(&self, w: &mut Writer) {
        w.count(self.entries.len());
        for e in &self.entries {
            encode_key(w, &e.key);
            w.u32(e.location.daemon);
            w.u32(e.location.size);
            w.u64(e.location.checksum);
        }
        w.u8(self.more as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(2 + 1 + 32 + 16)?;
        let entries = (0..n)
            .map(|_| {
                Ok(ListEntry {
                    key: decode_key(r)?,
                    location: Location {
                        daemon: r.u32()?,
                        size: r.u32()?,
                        checksum: r.u64()?,
                    },
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(ListResponse {
            entries,
            more: r.u8()? != 0,
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

/// The id the meta service gave a daemon, and the leader's election
/// revision: a daemon refuses a leader older than one it has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterResponse {
    pub daemon: u32,
    pub revision: u64,
}

impl Body for RegisterResponse {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.u64(self.revision);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(RegisterResponse {
            daemon: r.u32()?,
            revision: r.u64()?,
        })
    }
}

/// One stored block, as a daemon reports it to a (new) leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryItem {
    pub key: BlockKey,
    pub size: u32,
    pub checksum: u64,
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
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemon = r.u32()?;
        let n = r.count(2 + 1 + 32 + 12)?;
        let items = (0..n)
            .map(|_| {
                Ok(InventoryItem {
                    key: decode_key(r)?,
                    size: r.u32()?,
                    checksum: r.u64()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(InventoryRequest { daemon, items })
    }
}

/// A daemon's periodic report: alive, and how full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatRequest {
    pub daemon: u32,
    pub stats: PoolStats,
}

impl Body for HeartbeatRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        self.stats.encode(w);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(HeartbeatRequest {
            daemon: r.u32()?,
            stats: PoolStats::decode(r)?,
        })
    }
}

/// Blocks a daemon dropped on its own (evicted, or found corrupt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsRequest {
    pub daemon: u32,
    pub removed: Vec<BlockKey>,
}

impl Body for EventsRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.count(self.removed.len());
        for k in &self.removed {
            encode_key(w, k);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemon = r.u32()?;
        let n = r.count(2 + 1 + 32)?;
        let removed = (0..n).map(|_| decode_key(r)).collect::<Result<_, _>>()?;
        Ok(EventsRequest { daemon, removed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("t/m").unwrap()
    }

    fn round_trip<T: Body + PartialEq + std::fmt::Debug>(v: T) {
        let bytes = v.to_bytes();
        assert_eq!(T::from_bytes(&bytes).unwrap(), v);
        // Every strict prefix is refused, never misparsed.
        for n in 0..bytes.len() {
            assert!(T::from_bytes(&bytes[..n]).is_err(), "prefix {n} accepted");
        }
    }

    #[test]
    fn every_body_round_trips_and_refuses_truncation() {
        let h = BlockHash([3; 32]);
        round_trip(KeyRequest {
            key: BlockKey::new(ns(), h),
        });
        round_trip(PutHead {
            key: BlockKey::new(ns(), h),
            checksum: 9,
            parent: Some(BlockHash([4; 32])),
        });
        round_trip(PutHead {
            key: BlockKey::new(ns(), h),
            checksum: 9,
            parent: None,
        });
        round_trip(KeysRequest {
            namespace: ns(),
            hashes: vec![h, h],
        });
        round_trip(PinRequest {
            keys: KeysRequest {
                namespace: ns(),
                hashes: vec![h],
            },
            pin: true,
        });
        round_trip(Locations {
            items: vec![
                None,
                Some(Location {
                    daemon: 1,
                    size: 2,
                    checksum: 3,
                }),
            ],
            daemons: vec![DaemonAddr {
                id: 1,
                addr: "127.0.0.1:1".into(),
                endpoints: vec![Endpoint {
                    kind: crate::transport::TransportKind::Quic,
                    addr: "127.0.0.1:2".into(),
                }],
            }],
        });
        round_trip(PutStartRequest {
            namespace: ns(),
            node: "gpu-1".into(),
            items: vec![(h, 10)],
        });
        round_trip(PutStartResponse {
            slots: vec![Slot::Place(4), Slot::Skip(ErrorCode::AlreadyExists)],
            daemons: vec![],
        });
        round_trip(PutCommitRequest {
            namespace: ns(),
            items: vec![CommitItem {
                hash: h,
                daemon: 1,
                size: 5,
                checksum: 6,
                stored: true,
            }],
        });
        round_trip(Statuses {
            codes: vec![ErrorCode::Ok, ErrorCode::NotFound],
        });
        round_trip(ClusterStats {
            leader: "l".into(),
            revision: 9,
            standbys: vec!["s".into()],
            blocks: 1,
            bytes: 2,
            pending: 3,
            daemons: vec![DaemonInfo {
                id: 1,
                node: "n".into(),
                addr: "a".into(),
                alive: true,
                draining: false,
                capacity: 4,
                used: 5,
                blocks: 6,
                hits: 7,
                misses: 8,
                endpoints: vec![],
            }],
            errors: vec![ErrorCount {
                op: "put_commit".into(),
                code: "no_reservation".into(),
                count: 3,
            }],
        });
        round_trip(EvictRequest { bytes: 9 });
        round_trip(EvictResponse {
            bytes: 9,
            blocks: 1,
        });
        round_trip(DrainRequest {
            daemon: 2,
            drain: true,
        });
        round_trip(LeaveRequest {
            daemon: 3,
            addr: "10.0.0.3:7071".into(),
        });
        round_trip(ListRequest {
            namespace: Some(ns()),
            after: Some(BlockKey::new(ns(), h)),
            prefix: vec![3, 3],
            daemon: 1,
            limit: 7,
        });
        round_trip(ListResponse {
            entries: vec![ListEntry {
                key: BlockKey::new(ns(), h),
                location: Location {
                    daemon: 1,
                    size: 2,
                    checksum: 3,
                },
            }],
            more: true,
        });
        round_trip(RegisterRequest {
            node: "n".into(),
            addr: "a".into(),
            capacity: 1,
            id_hint: 3,
            endpoints: vec![],
            requires_auth: true,
        });
        round_trip(RegisterResponse {
            daemon: 3,
            revision: 77,
        });
        round_trip(InventoryRequest {
            daemon: 3,
            items: vec![InventoryItem {
                key: BlockKey::new(ns(), h),
                size: 5,
                checksum: 6,
            }],
        });
        round_trip(HeartbeatRequest {
            daemon: 1,
            stats: PoolStats::default(),
        });
        round_trip(EventsRequest {
            daemon: 2,
            removed: vec![BlockKey::new(ns(), h)],
        });
    }

    #[test]
    fn put_head_refuses_long_namespace_length() {
        assert!(PutHead::rest_len(129).is_err());
        assert_eq!(2 + PutHead::rest_len(128).unwrap(), PutHead::MAX_LEN);
        assert_eq!(PutHead::rest_len(3).unwrap(), 3 + 32 + 8 + 32);
    }

    #[test]
    fn bad_namespace_on_the_wire_is_refused() {
        let mut w = Writer::new();
        w.str("bad space");
        w.hash(&BlockHash([0; 32]));
        assert!(KeyRequest::from_bytes(&w.buf).is_err());
    }
}

/// Where a leased block lies in the daemon's shared pool (`ShmGet`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmLease {
    pub lease: u64,
    pub offset: u64,
    pub len: u32,
    pub checksum: u64,
}

impl Body for ShmLease {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.lease);
        w.u64(self.offset);
        w.u32(self.len);
        w.u64(self.checksum);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmLease {
            lease: r.u64()?,
            offset: r.u64()?,
            len: r.u32()?,
            checksum: r.u64()?,
        })
    }
}

/// Leases to end (`ShmRelease`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmRelease {
    pub leases: Vec<u64>,
}

impl Body for ShmRelease {
    fn encode(&self, w: &mut Writer) {
        w.count(self.leases.len());
        for l in &self.leases {
            w.u64(*l);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(8)?;
        let leases = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
        Ok(ShmRelease { leases })
    }
}

/// The first message on a daemon's Unix socket, sent with the pool's file
/// descriptor: the pool's size and the daemon's TCP address (which client
/// locations name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmHello {
    pub len: u64,
    pub addr: String,
    /// Bytes of the daemon's block index (`shm_index`), sent as a second
    /// descriptor; 0 when it publishes none.
    pub index_len: u64,
}

impl Body for ShmHello {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.len);
        w.str(&self.addr);
        w.u64(self.index_len);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmHello {
            len: r.u64()?,
            addr: r.str()?.to_string(),
            index_len: r.u64()?,
        })
    }
}

/// Blocks a same-host client read through the daemon's index, without a
/// lease (`ShmTouch`): the daemon counts them as hits and as recent uses,
/// as if they had been leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmTouch {
    pub keys: Vec<BlockKey>,
}

impl Body for ShmTouch {
    fn encode(&self, w: &mut Writer) {
        w.count(self.keys.len());
        for key in &self.keys {
            encode_key(w, key);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(35)?;
        let keys = (0..n).map(|_| decode_key(r)).collect::<Result<_, _>>()?;
        Ok(ShmTouch { keys })
    }
}

/// A block a same-host client is about to write into the shared pool
/// (`ShmPut`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmPutRequest {
    pub key: BlockKey,
    pub len: u64,
    pub checksum: u64,
    /// As in `PutHead`.
    pub parent: Option<BlockHash>,
}

impl Body for ShmPutRequest {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
        w.u64(self.len);
        w.u64(self.checksum);
        encode_parent(w, &self.parent);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmPutRequest {
            key: decode_key(r)?,
            len: r.u64()?,
            checksum: r.u64()?,
            parent: decode_parent(r)?,
        })
    }
}

/// Where to write a reserved block (`ShmPut`'s answer), and the slot to
/// commit (`ShmCommit`'s request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmSlot {
    pub slot: u64,
    pub offset: u64,
}

impl Body for ShmSlot {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.slot);
        w.u64(self.offset);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmSlot {
            slot: r.u64()?,
            offset: r.u64()?,
        })
    }
}

/// One end of an RDMA reliable connection (`RdmaConnect`): what the other
/// end needs to address its queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaPeer {
    /// The port's local identifier (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// The port's global identifier (RoCE, or InfiniBand across subnets).
    pub gid: [u8; 16],
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number this end sends (24 bits).
    pub psn: u32,
    /// Path MTU this end can use, as libibverbs numbers it (1 = 256 bytes
    /// to 5 = 4096).
    pub mtu: u8,
}

impl Body for RdmaPeer {
    fn encode(&self, w: &mut Writer) {
        w.u16(self.lid);
        w.buf.extend_from_slice(&self.gid);
        w.u32(self.qpn);
        w.u32(self.psn);
        w.u8(self.mtu);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let lid = r.u16()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(r.take(16)?);
        let (qpn, psn, mtu) = (r.u32()?, r.u32()?, r.u8()?);
        if psn >= 1 << 24 {
            return Err(ProtoError::Invalid {
                field: "psn",
                why: format!("{psn} does not fit 24 bits"),
            });
        }
        if !(1..=5).contains(&mtu) {
            return Err(ProtoError::Invalid {
                field: "mtu",
                why: format!("{mtu} is not an MTU code (1 to 5)"),
            });
        }
        Ok(RdmaPeer {
            lid,
            gid,
            qpn,
            psn,
            mtu,
        })
    }
}

/// A registered piece of a daemon's pool: its bytes `offset..offset + len`
/// lie at `addr` in the daemon's memory, readable and writable with `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaRegion {
    pub offset: u64,
    pub len: u64,
    pub addr: u64,
    pub rkey: u32,
}

/// Regions one daemon may describe, at most (a pool split where a NIC
/// limits a region's size).
pub const MAX_RDMA_REGIONS: usize = 4096;

/// The daemon's answer to `RdmaConnect`: its queue pair, the regions that
/// cover its pool in order, and its TCP address (which locations name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaAccept {
    pub peer: RdmaPeer,
    pub regions: Vec<RdmaRegion>,
    pub addr: String,
}

impl Body for RdmaAccept {
    fn encode(&self, w: &mut Writer) {
        self.peer.encode(w);
        w.count(self.regions.len());
        for region in &self.regions {
            w.u64(region.offset);
            w.u64(region.len);
            w.u64(region.addr);
            w.u32(region.rkey);
        }
        w.str(&self.addr);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let peer = RdmaPeer::decode(r)?;
        let n = r.count(28)?;
        if n > MAX_RDMA_REGIONS {
            return Err(ProtoError::Invalid {
                field: "regions",
                why: format!("{n} regions (at most {MAX_RDMA_REGIONS})"),
            });
        }
        let regions = (0..n)
            .map(|_| {
                Ok(RdmaRegion {
                    offset: r.u64()?,
                    len: r.u64()?,
                    addr: r.u64()?,
                    rkey: r.u32()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let addr = r.str()?.to_string();
        Ok(RdmaAccept {
            peer,
            regions,
            addr,
        })
    }
}

#[cfg(test)]
mod rdma_tests {
    use super::*;

    fn peer() -> RdmaPeer {
        RdmaPeer {
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x11_2233,
            psn: 0xab_cdef,
            mtu: 5,
        }
    }

    #[test]
    fn rdma_handshake_round_trips() {
        assert_eq!(RdmaPeer::from_bytes(&peer().to_bytes()).unwrap(), peer());
        let accept = RdmaAccept {
            peer: peer(),
            regions: vec![
                RdmaRegion {
                    offset: 0,
                    len: 1 << 30,
                    addr: 0x7f00_0000_0000,
                    rkey: 9,
                },
                RdmaRegion {
                    offset: 1 << 30,
                    len: 1 << 20,
                    addr: 0x7f00_4000_0000,
                    rkey: 10,
                },
            ],
            addr: "10.0.0.5:7801".into(),
        };
        assert_eq!(RdmaAccept::from_bytes(&accept.to_bytes()).unwrap(), accept);
    }

    #[test]
    fn rdma_peer_refuses_what_no_nic_sends() {
        let mut bad = peer();
        bad.psn = 1 << 24;
        assert!(RdmaPeer::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = peer();
        bad.mtu = 6;
        assert!(RdmaPeer::from_bytes(&bad.to_bytes()).is_err());
        let bytes = peer().to_bytes();
        assert!(RdmaPeer::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    }
}
