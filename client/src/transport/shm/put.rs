//! Same-host puts. A block goes into room the connection holds ahead for
//! blocks of its size where it holds one (`ShmStore`: one round trip,
//! whose answer hands over the room for the next block): written into the
//! shared pool, which spares it the socket's two copies, and hashed in
//! the pass that copies it there; the checksum of the bytes as they lie in
//! the pool goes with it, so the daemon need not read them again. Serving
//! engines put blocks of one size, so from their second put on every
//! block finds its room.
//!
//! A block without room held:
//! - a small one goes with its bytes in the frame (`Put`: one round trip;
//!   the daemon reads them straight into their place), and asks for rooms
//!   of its size where the connection holds none, or after `MAX_STRAYS`
//!   such blocks in a row;
//! - a larger one asks for rooms of its size (`ShmRoom`, sent with the
//!   call's other requests; the session lets go of rooms of other sizes),
//!   and goes into room reserved for it (`ShmPut`), then is stored
//!   (`ShmCommit`): two round trips.
//!
//! Room held ahead beats the frame even for small blocks: 16 KiB puts, 8
//! in flight, went from 30,000-39,000 a second to 45,000-46,000
//! (docs/benchmarks.md, "Small same-host puts into room held ahead").
//!
//! A connection holding rooms is kept for puts (`Writer`); its rooms end
//! with it.
//!
//! A block of a single copy with room held can skip the meta service's
//! reservation and commit altogether (`admit_blocks`): the daemon makes it
//! visible itself before it stores it (`ShmAdmit`), one round trip in all.

use super::*;
use mooncake_proto::message::{ShmRoomRequest, ShmRooms, ShmStoreRequest};
use std::sync::atomic::Ordering::Relaxed;

/// Blocks up to this size, without room held for them, are put with their
/// bytes in the frame (one round trip on the socket) rather than through
/// room reserved in the shared pool (two).
const INLINE_PUT: usize = 16 << 10;
/// Rooms asked for at once, at most (the daemon caps them further).
const MAX_ROOMS: usize = 64;
/// Blocks small enough for their frame, in a row, that found no room of
/// their size on a connection holding rooms of another before they ask
/// for rooms of theirs: a request's last, partial chunk (LMCache's) goes
/// in its frame and leaves the rooms of the full chunks, while a put load
/// that moved to another size gets rooms of it.
const MAX_STRAYS: u32 = 8;

/// An idle connection kept for puts, with the rooms it holds.
pub(super) struct Writer {
    stream: UnixStream,
    rooms: Rooms,
}

/// The rooms a connection's session holds, all for blocks of `len` bytes:
/// asking for rooms of another length (`ShmRoom`) has the daemon let go of
/// the others, so an answer read after such a request may hand over a room
/// the daemon no longer holds for this client. Only rooms of the length
/// last asked for are kept.
#[derive(Default)]
struct Rooms {
    len: u64,
    held: Vec<ShmSlot>,
    /// Blocks in a row that found no room of their size (`stray`).
    strays: u32,
}

impl Rooms {
    /// A room for a block of `len` bytes, if one is held.
    fn take(&mut self, len: u64) -> Option<ShmSlot> {
        let room = match self.len == len {
            true => self.held.pop(),
            false => None,
        };
        if room.is_some() {
            self.strays = 0;
        }
        room
    }

    /// A block small enough for its frame found no room of its size:
    /// whether it asks for rooms of its size (where none are held, or
    /// after `MAX_STRAYS` such blocks in a row).
    fn stray(&mut self) -> bool {
        self.strays += 1;
        self.held.is_empty() || self.strays >= MAX_STRAYS
    }

    /// Rooms of `len` bytes are asked for: those of any other go.
    fn asked(&mut self, len: u64) {
        self.strays = 0;
        if self.len != len {
            self.held.clear();
            self.len = len;
        }
    }

    /// Rooms an answer handed over, if of the length held.
    fn add(&mut self, given: ShmRooms) {
        if given.len == self.len {
            self.held.extend(given.rooms);
        }
    }

    fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// What a put of a batch may send.
#[derive(Clone, Copy)]
struct Ways {
    /// Small blocks with their bytes (`Put`).
    inline: bool,
    /// Rooms held ahead (`ShmRoom`, `ShmStore`).
    rooms: bool,
}

impl ShmLink {
    /// Stores `items` through the daemon's socket (see the module's
    /// comment); a status per item.
    pub(super) async fn put_blocks(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> io::Result<Vec<Written>> {
        loop {
            let ways = Ways {
                inline: self.inline_puts.load(Relaxed),
                rooms: self.rooms.load(Relaxed),
            };
            let refused = match self.put_batch(namespace, items, ways).await? {
                Ok(written) => return Ok(written),
                Err(refused) => refused,
            };
            // A daemon of an older version refused a request it does not
            // know and closed the session: nothing of the batch was kept.
            // All of it, and every later put, goes without that request.
            let flag = match refused {
                Opcode::Put if ways.inline => &self.inline_puts,
                Opcode::ShmRoom if ways.rooms => &self.rooms,
                _ => return Err(io::Error::other(format!("{refused:?} refused, not sent"))),
            };
            tracing::info!(path = %self.path.display(), request = ?refused, "the same-host daemon does not know this request (an older version); putting without it");
            flag.store(false, Relaxed);
        }
    }

    /// One try of `put_blocks`, the ways `ways` allows; `Err(opcode)` where
    /// the daemon did not know a request (and closed the session).
    async fn put_batch(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
        ways: Ways,
    ) -> io::Result<Result<Vec<Written>, Opcode>> {
        let inline = |it: &PutItem<'_>| ways.inline && it.value.len() <= INLINE_PUT;
        let held = self.writers.lock().pop();
        let (mut conn, mut rooms) = match held {
            Some(Writer { stream, rooms }) => (stream, rooms),
            None => (self.conn().await?, Rooms::default()),
        };
        // Requests in the order they go out, each with the item it is for
        // (request k has id k + 1; `usize::MAX`: for none). A block's
        // commit goes out as soon as its bytes are in place, so a call
        // holds room for at most about a window of blocks at once: the
        // pool caps the room that puts in progress hold, and a large call
        // reserving all before committing any met that cap (`Busy`).
        let mut outbox = Outbox::default();
        let mut queued: Vec<(Opcode, usize)> = Vec::new();
        let mut written: Vec<Written> = items
            .iter()
            .map(|it| Written {
                code: ErrorCode::Ok,
                checksum: it.checksum.unwrap_or(0),
            })
            .collect();
        let mut asked_rooms = !ways.rooms;
        let (mut next, mut k) = (0, 0);
        while k < queued.len() || next < items.len() {
            while next < items.len() && queued.len() - k < WINDOW {
                let it = &items[next];
                let key = BlockKey::new(namespace.clone(), it.hash);
                let id = queued.len() as u64 + 1;
                let len = it.value.len() as u64;
                let room = rooms.take(len);
                if room.is_none() && !asked_rooms && (!inline(it) || rooms.stray()) {
                    // Rooms for the blocks of this size still to come (the
                    // session lets go of those of other sizes, so a block
                    // small enough to go in its frame asks only as
                    // `Rooms::stray` says).
                    asked_rooms = true;
                    let wanted = items[next..]
                        .iter()
                        .filter(|it| it.value.len() as u64 == len)
                        .count();
                    rooms.asked(len);
                    let body = ShmRoomRequest {
                        len,
                        count: wanted.min(MAX_ROOMS) as u32,
                    };
                    outbox.push(Opcode::ShmRoom, id, &body.to_bytes());
                    queued.push((Opcode::ShmRoom, usize::MAX));
                    continue;
                }
                if let Some(room) = room {
                    written[next].checksum = self.write_into(room.offset, it)?;
                    let body = ShmStoreRequest {
                        room: room.slot,
                        key,
                        len,
                        checksum: written[next].checksum,
                        parent: it.parent,
                        continues: it.continues,
                        tag: it.tag.clone(),
                    };
                    outbox.push(Opcode::ShmStore, id, &body.to_bytes());
                    queued.push((Opcode::ShmStore, next));
                    self.counts
                        .room_writes
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else if inline(it) {
                    written[next].checksum = it.sum();
                    let head = PutHead {
                        key,
                        checksum: written[next].checksum,
                        parent: it.parent,
                        continues: it.continues,
                        tag: it.tag.clone(),
                    }
                    .to_bytes();
                    let len = (head.len() + it.value.len()) as u32;
                    outbox.push_with(|frames| {
                        frames.extend_from_slice(&Header::request(Opcode::Put, id, len).encode());
                        frames.extend_from_slice(&head);
                        for piece in it.value.pieces() {
                            frames.extend_from_slice(piece);
                        }
                    });
                    queued.push((Opcode::Put, next));
                } else {
                    let body = ShmPutRequest {
                        key,
                        len,
                        // Else said at commit, of the bytes in the pool.
                        checksum: it.checksum,
                        parent: it.parent,
                        continues: it.continues,
                        tag: it.tag.clone(),
                    }
                    .to_bytes();
                    outbox.push(Opcode::ShmPut, id, &body);
                    queued.push((Opcode::ShmPut, next));
                }
                next += 1;
            }
            outbox.before_answer(&mut conn, k).await?;
            let (op, i) = queued[k];
            let (status, body) = answer(&mut conn, op, k as u64 + 1).await?;
            k += 1;
            match (op, status) {
                (Opcode::Put | Opcode::ShmRoom, ErrorCode::UnknownOpcode) => return Ok(Err(op)),
                (Opcode::ShmRoom, _) | (Opcode::ShmStore, _) if !body.is_empty() => {
                    rooms.add(self.rooms_in(&body)?);
                    if i != usize::MAX {
                        written[i].code = status;
                    }
                }
                (Opcode::ShmRoom, _) => {}
                (Opcode::ShmPut, ErrorCode::Ok) => {
                    let slot = ShmSlot::from_bytes(&body).map_err(io::Error::other)?;
                    self.in_pool(slot.offset, items[i].value.len() as u64)?;
                    written[i].checksum = self.write_into(slot.offset, &items[i])?;
                    let commit = ShmCommitRequest {
                        slot: slot.slot,
                        checksum: Some(written[i].checksum),
                    };
                    let id = queued.len() as u64 + 1;
                    outbox.push(Opcode::ShmCommit, id, &commit.to_bytes());
                    queued.push((Opcode::ShmCommit, i));
                }
                _ => written[i].code = status,
            }
        }
        match rooms.is_empty() {
            true => self.put_back(conn, Vec::new()),
            false => {
                let mut writers = self.writers.lock();
                if writers.len() < MAX_IDLE {
                    writers.push(Writer {
                        stream: conn,
                        rooms,
                    });
                }
            }
        }
        Ok(Ok(written))
    }

    /// Stores and makes visible, in one round trip, each of `items` (of a
    /// single copy) for which the link holds room of its size: the daemon
    /// asks the meta service itself (`ShmAdmit`). Per item, `Some` with the
    /// outcome (`Ok`, or the meta service's `AlreadyExists`), or `None`:
    /// nothing of it is visible, and it is to be put the usual way.
    pub(crate) async fn admit_blocks(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> Vec<Option<Written>> {
        let mut out = vec![None; items.len()];
        if !self.admits.load(Relaxed) {
            return out;
        }
        let Some(Writer {
            mut stream,
            mut rooms,
        }) = self.writers.lock().pop()
        else {
            return out;
        };
        let mut outbox = Outbox::default();
        let mut sent: Vec<(usize, u64)> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let len = it.value.len() as u64;
            // The leading blocks only: those after go the usual way, after
            // these (a chain's blocks become visible parent first).
            let Some(room) = rooms.take(len) else {
                break;
            };
            let Ok(checksum) = self.write_into(room.offset, it) else {
                break;
            };
            let body = ShmStoreRequest {
                room: room.slot,
                key: BlockKey::new(namespace.clone(), it.hash),
                len,
                checksum,
                parent: it.parent,
                continues: false,
                tag: it.tag.clone(),
            };
            outbox.push(Opcode::ShmAdmit, sent.len() as u64 + 1, &body.to_bytes());
            sent.push((i, checksum));
        }
        for (k, &(i, checksum)) in sent.iter().enumerate() {
            let answered = async {
                outbox.before_answer(&mut stream, k).await?;
                answer(&mut stream, Opcode::ShmAdmit, k as u64 + 1).await
            };
            let (code, body) = match answered.await {
                Ok(answered) => answered,
                // The connection and its rooms are gone; what was not
                // answered goes the usual way (a daemon gone, or one of
                // an older version that closed the session).
                Err(err) => {
                    tracing::debug!(%err, "same-host admission cut short");
                    return out;
                }
            };
            if !body.is_empty() {
                match self.rooms_in(&body) {
                    Ok(given) => rooms.add(given),
                    Err(_) => return out,
                }
            }
            out[i] = match code {
                ErrorCode::Ok | ErrorCode::AlreadyExists => {
                    if code == ErrorCode::Ok {
                        self.counts.room_writes.fetch_add(1, Relaxed);
                        self.counts.admitted.fetch_add(1, Relaxed);
                    }
                    Some(Written { code, checksum })
                }
                ErrorCode::UnknownOpcode => {
                    // A daemon that does not admit (no meta service to ask,
                    // or clients that must show a token).
                    self.admits.store(false, Relaxed);
                    None
                }
                _ => None,
            };
        }
        let mut writers = self.writers.lock();
        if writers.len() < MAX_IDLE {
            writers.push(Writer { stream, rooms });
        }
        out
    }

    /// The rooms an answer hands over, each checked to lie in the pool.
    fn rooms_in(&self, body: &[u8]) -> io::Result<ShmRooms> {
        let given = ShmRooms::from_bytes(body).map_err(io::Error::other)?;
        for room in &given.rooms {
            self.in_pool(room.offset, given.len)?;
        }
        Ok(given)
    }

    /// Refuses room the daemon gave that does not lie in its pool.
    fn in_pool(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.map.len as u64 => Ok(()),
            _ => Err(io::Error::other("room outside the shared pool")),
        }
    }

    /// Copies a block into room at `offset` (checked to lie in the pool,
    /// and held for it alone) and hashes it in the same pass.
    fn write_into(&self, offset: u64, item: &PutItem<'_>) -> io::Result<u64> {
        let len = item.value.len();
        self.in_pool(offset, len as u64)?;
        // SAFETY: in bounds (checked above), and reserved for this block
        // alone until it is stored.
        let room = unsafe {
            std::slice::from_raw_parts_mut(self.map.ptr.as_ptr().add(offset as usize), len)
        };
        Ok(item.value.copy_with_checksum(room))
    }
}
