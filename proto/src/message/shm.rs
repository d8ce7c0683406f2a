//! Bodies of the same-host path (a Unix socket beside the shared pool):
//! leases on blocks read in place, and puts written in place.

use super::*;

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
    /// The writer's checksum of the bytes it will write, which the daemon
    /// checks at commit. `None` only from a same-host client: it hashes
    /// the bytes where they landed in the pool and says the checksum with
    /// its commit (`ShmCommitRequest`), so that they are read once.
    pub checksum: Option<u64>,
    /// As in `PutHead`.
    pub parent: Option<BlockHash>,
    /// As in `PutHead`.
    pub continues: bool,
    /// As in `PutHead`.
    pub tag: Option<Arc<EngineTag>>,
}

impl Body for ShmPutRequest {
    fn encode(&self, w: &mut Writer) {
        encode_key(w, &self.key);
        w.u64(self.len);
        encode_checksum(w, self.checksum);
        encode_parent(w, &self.parent);
        w.u8(u8::from(self.continues));
        encode_tag(w, &self.tag);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmPutRequest {
            key: decode_key(r)?,
            len: r.u64()?,
            checksum: decode_checksum(r)?,
            parent: decode_parent(r)?,
            continues: r.bool("continues")?,
            tag: decode_tag(r)?,
        })
    }
}

/// Where to write a reserved block (`ShmPut`'s answer).
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

/// Makes a block written into the shared pool visible (`ShmCommit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmCommitRequest {
    /// The slot `ShmPut` answered.
    pub slot: u64,
    /// `None`: the daemon hashes the slot's bytes and checks them against
    /// the checksum given at `ShmPut` (RDMA, where only the daemon's CPU
    /// can read them). `Some`: a same-host writer's checksum of the bytes
    /// as they lie in the slot, which it hashed after writing them; the
    /// daemon keeps it (refused where it disagrees with one given at
    /// `ShmPut`, and over RDMA).
    pub checksum: Option<u64>,
}

impl Body for ShmCommitRequest {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.slot);
        encode_checksum(w, self.checksum);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmCommitRequest {
            slot: r.u64()?,
            checksum: decode_checksum(r)?,
        })
    }
}

/// Room to hold for blocks of up to `len` bytes not yet named
/// (`ShmRoom`): at most `count` rooms. A session holds rooms of one length
/// at a time: those of another length it held are freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmRoomRequest {
    pub len: u64,
    pub count: u32,
}

impl Body for ShmRoomRequest {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.len);
        w.u32(self.count);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmRoomRequest {
            len: r.u64()?,
            count: r.u32()?,
        })
    }
}

/// Rooms the client now holds in the shared pool, each for a block of up
/// to `len` bytes (`ShmRoom`'s answer; `ShmStore`'s, where it is the room
/// for the writer's next block, or its own room handed back unfilled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmRooms {
    pub len: u64,
    pub rooms: Vec<ShmSlot>,
}

impl Body for ShmRooms {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.len);
        w.count(self.rooms.len());
        for room in &self.rooms {
            room.encode(w);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let len = r.u64()?;
        let n = r.count(16)?;
        let rooms = (0..n)
            .map(|_| ShmSlot::decode(r))
            .collect::<Result<_, _>>()?;
        Ok(ShmRooms { len, rooms })
    }
}

/// A block written into room the client holds, to store (`ShmStore`):
/// reservation and commit in one message. The room is spent whatever the
/// answer; the answer's rooms are what the client holds instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmStoreRequest {
    /// The room (`ShmSlot::slot` of a `ShmRooms`).
    pub room: u64,
    pub key: BlockKey,
    pub len: u64,
    /// The writer's checksum of the bytes as they lie in the room: kept
    /// by a same-host daemon, checked by the daemon itself over RDMA.
    pub checksum: u64,
    /// As in `PutHead`.
    pub parent: Option<BlockHash>,
    /// As in `PutHead`.
    pub continues: bool,
    /// As in `PutHead`.
    pub tag: Option<Arc<EngineTag>>,
}

impl Body for ShmStoreRequest {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.room);
        encode_key(w, &self.key);
        w.u64(self.len);
        w.u64(self.checksum);
        encode_parent(w, &self.parent);
        w.u8(u8::from(self.continues));
        encode_tag(w, &self.tag);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmStoreRequest {
            room: r.u64()?,
            key: decode_key(r)?,
            len: r.u64()?,
            checksum: r.u64()?,
            parent: decode_parent(r)?,
            continues: r.bool("continues")?,
            tag: decode_tag(r)?,
        })
    }
}

fn encode_checksum(w: &mut Writer, sum: Option<u64>) {
    w.u8(sum.is_some() as u8);
    w.u64(sum.unwrap_or(0));
}

fn decode_checksum(r: &mut Reader<'_>) -> Result<Option<u64>, ProtoError> {
    let given = r.bool("checksum given")?;
    match (given, r.u64()?) {
        (true, sum) => Ok(Some(sum)),
        (false, 0) => Ok(None),
        (false, _) => Err(ProtoError::Invalid {
            field: "checksum",
            why: "a checksum given as absent".into(),
        }),
    }
}
