//! Rooms a session holds in the pool for blocks not yet named
//! (`ShmRoom`), and the blocks its client writes into them (`ShmStore`):
//! a put in one message to the daemon instead of a reservation and a
//! commit. A client asks for rooms of its blocks' size once; each store's
//! answer then hands it the room for its next block.

use std::collections::HashMap;

use mooncake_proto::message::{ShmRoomRequest, ShmRooms, ShmSlot, ShmStoreRequest};
use mooncake_proto::ErrorCode;

use crate::pool::Room;
use crate::tiers::Tiers;

/// Rooms one session holds at most: a client's window of requests.
const MAX_ROOMS: usize = 64;
/// Bytes of rooms one session holds at most (one room always).
const ROOM_BYTES: u64 = 4 << 20;

/// The rooms of one session, all of one length.
#[derive(Default)]
pub(super) struct Rooms {
    held: HashMap<u64, Room>,
    next_id: u64,
}

impl Rooms {
    /// `ShmRoom`: up to `count` rooms of `len` bytes, within the session's
    /// caps and what the pool spares without waiting (perhaps none).
    /// Rooms of another length held are let go.
    pub fn reserve(&mut self, tiers: &Tiers, req: ShmRoomRequest) -> ShmRooms {
        self.held.retain(|_, room| room.len() == req.len);
        let mut rooms = Vec::new();
        while rooms.len() < req.count as usize && self.room_for(req.len) {
            match tiers.reserve_room(req.len) {
                Some(room) => rooms.push(self.hold(room)),
                None => break,
            }
        }
        ShmRooms {
            len: req.len,
            rooms,
        }
    }

    /// `ShmStore`: names the block written into one of the rooms and
    /// stores it; the answer's rooms (the room for the next block, or this
    /// one back where the block was not taken) are the client's instead.
    /// A same-host client's checksum of the bytes is kept; over RDMA
    /// (`same_host` false) this daemon checks it against the bytes.
    pub fn store(
        &mut self,
        tiers: &Tiers,
        req: ShmStoreRequest,
        same_host: bool,
    ) -> (ErrorCode, Option<ShmRooms>) {
        let Some(room) = self.take(req.room) else {
            return (ErrorCode::NoReservation, None);
        };
        let len = room.len();
        let (code, back) = match tiers.fill_room(room, req.key.clone(), req.len, req.checksum) {
            Err((err, room)) => (err.code(), Some(room)),
            Ok(mut slot) => {
                slot.set_parent(req.parent);
                slot.set_continues(req.continues);
                let stored = match same_host {
                    true => slot.commit_hashed(req.checksum),
                    false => slot.commit(),
                };
                match stored {
                    Ok(()) => {
                        tiers.set_tag(&req.key, req.tag);
                        (ErrorCode::Ok, None)
                    }
                    Err(err) => (err.code(), None),
                }
            }
        };
        (code, self.answer(tiers, len, back))
    }

    /// The room `id`, given up by the session (filled, or handed back).
    pub fn take(&mut self, id: u64) -> Option<Room> {
        self.held.remove(&id)
    }

    /// The rooms an answer hands over after a room of `len` bytes was
    /// used: `back` (not filled after all), else a new one if the pool
    /// spares it and the session may hold it.
    pub fn answer(&mut self, tiers: &Tiers, len: u64, back: Option<Room>) -> Option<ShmRooms> {
        let next = back.or_else(|| match self.room_for(len) {
            true => tiers.reserve_room(len),
            false => None,
        });
        next.map(|room| ShmRooms {
            len,
            rooms: vec![self.hold(room)],
        })
    }

    /// Whether the session may hold one more room of `len` bytes.
    fn room_for(&self, len: u64) -> bool {
        let held: u64 = self.held.values().map(Room::len).sum();
        self.held.is_empty() || (self.held.len() < MAX_ROOMS && held + len <= ROOM_BYTES)
    }

    fn hold(&mut self, room: Room) -> ShmSlot {
        self.next_id += 1;
        let slot = ShmSlot {
            slot: self.next_id,
            offset: room.byte_offset(),
        };
        self.held.insert(self.next_id, room);
        slot
    }
}
