//! A session's same-host puts of one round trip (`ShmAdmit`): each block
//! written into a room is named and kept out of the pool while the daemon
//! asks the meta service to make it visible here (`crate::admit`), all
//! the blocks that came together in one call; then stored, or dropped.
//! Answers keep the order of the requests.
//!
//! An answer is `Ok` (stored and visible) or `AlreadyExists` (the meta
//! service's word); any other leaves nothing visible, and the writer puts
//! the block the usual way.

use std::sync::Arc;

use mooncake_proto::message::{
    Body, CommitItem, Copies, EngineTag, ShmRooms, ShmStoreRequest, Slot,
};
use mooncake_proto::{ErrorCode, Header, Namespace, Opcode};

use super::rooms::Rooms;
use crate::admit::{Admitter, NotAdmitted, Outcome};
use crate::pool::{PoolError, WriteSlot};
use crate::tiers::Tiers;

/// The blocks of a session waiting for their admission, in request order.
#[derive(Default)]
pub(super) struct Admits {
    waiting: Vec<Waiting>,
}

/// A request and what became of it so far.
struct Waiting {
    header: Header,
    /// The length of the room it used.
    room: u64,
    state: State,
}

enum State {
    /// Answered without asking (no room, held here already, ...).
    Answered(ErrorCode, Option<ShmRooms>),
    /// To ask about: its block, named in its room.
    Asking {
        slot: WriteSlot,
        checksum: u64,
        tag: Option<Arc<EngineTag>>,
    },
    /// Asked: the answer to send.
    Done(ErrorCode),
}

impl Admits {
    /// Takes a request (`header`, `req`): its block is named in its room,
    /// out of the pool, to be admitted with the others (`settle`).
    pub fn take(&mut self, header: Header, req: ShmStoreRequest, rooms: &mut Rooms, tiers: &Tiers) {
        let answered = |code, rooms| State::Answered(code, rooms);
        let Some(room) = rooms.take(req.room) else {
            self.waiting.push(Waiting {
                header,
                room: 0,
                state: answered(ErrorCode::NoReservation, None),
            });
            return;
        };
        let len = room.len();
        // Held here already, or on its way in: only the meta service may
        // say that it exists, so the writer is sent the usual way.
        if !tiers.start_admitting(&req.key) {
            let back = rooms.answer(tiers, len, Some(room));
            self.waiting.push(Waiting {
                header,
                room: len,
                state: answered(ErrorCode::Busy, back),
            });
            return;
        }
        let state = match tiers
            .dram
            .fill_room(room, req.key.clone(), req.len, Some(req.checksum))
        {
            Err((err, room)) => {
                tiers.not_admitted(&req.key);
                let code = match err {
                    PoolError::AlreadyExists => ErrorCode::Busy,
                    err => err.code(),
                };
                answered(code, rooms.answer(tiers, len, Some(room)))
            }
            Ok(mut slot) => {
                slot.set_parent(req.parent);
                State::Asking {
                    slot,
                    checksum: req.checksum,
                    tag: req.tag,
                }
            }
        };
        self.waiting.push(Waiting {
            header,
            room: len,
            state,
        });
    }

    /// Asks the meta service to admit every block waiting (one call per
    /// namespace), stores those admitted, and appends every answer to
    /// `out`, in order; nothing where none waits (or the session admits
    /// nothing: no `admitter`).
    pub async fn settle(
        &mut self,
        admitter: Option<&Admitter>,
        rooms: &mut Rooms,
        tiers: &Tiers,
        out: &mut Vec<u8>,
    ) {
        let Some(admitter) = admitter.filter(|_| !self.waiting.is_empty()) else {
            return;
        };
        let mut namespaces: Vec<Namespace> = Vec::new();
        for w in &self.waiting {
            if let State::Asking { slot, .. } = &w.state {
                let ns = &slot.key().namespace;
                if !namespaces.contains(ns) {
                    namespaces.push(ns.clone());
                }
            }
        }
        for ns in namespaces {
            self.admit_in(&ns, admitter, tiers).await;
        }
        for w in self.waiting.drain(..) {
            let (code, next) = match w.state {
                State::Answered(code, next) => (code, next),
                State::Done(code) => (code, rooms.answer(tiers, w.room, None)),
                State::Asking { .. } => unreachable!("every namespace was asked"),
            };
            let body = next.map(|r| r.to_bytes()).unwrap_or_default();
            let h = Header::response(
                Opcode::ShmAdmit,
                w.header.request_id,
                code as u16,
                body.len() as u32,
            );
            out.extend_from_slice(&h.encode());
            out.extend_from_slice(&body);
        }
    }

    /// Admits the blocks of `ns` waiting, and stores or drops each.
    async fn admit_in(&mut self, ns: &Namespace, admitter: &Admitter, tiers: &Tiers) {
        let asking: Vec<usize> = (0..self.waiting.len())
            .filter(|&i| {
                matches!(&self.waiting[i].state, State::Asking { slot, .. } if slot.key().namespace == *ns)
            })
            .collect();
        let items: Vec<CommitItem> = asking
            .iter()
            .map(|&i| match &self.waiting[i].state {
                State::Asking {
                    slot,
                    checksum,
                    tag,
                } => CommitItem {
                    hash: slot.key().hash,
                    stored_on: Copies::default(),
                    size: slot.len() as u32,
                    checksum: *checksum,
                    parent: slot.parent(),
                    tag: tag.clone(),
                },
                _ => unreachable!("asking"),
            })
            .collect();
        let answer = admitter.admit(ns, items).await;
        if let Err(NotAdmitted::Unknown(err)) = &answer {
            tracing::warn!(%err, blocks = asking.len(), "admission's answer lost; the blocks are dropped and reported gone, and their writers put them again");
        }
        for (k, &i) in asking.iter().enumerate() {
            let w = &mut self.waiting[i];
            let State::Asking {
                slot,
                checksum,
                tag,
            } = std::mem::replace(&mut w.state, State::Done(ErrorCode::Internal))
            else {
                unreachable!("asking");
            };
            let key = slot.key().clone();
            let code = match &answer {
                Ok(slots) => match slots[k] {
                    Slot::Place { continues, .. } => {
                        let stored = tiers.admitted(&key, move || {
                            let mut slot = slot;
                            slot.set_continues(continues);
                            slot.commit_hashed(checksum)
                        });
                        match stored {
                            // Removed once visible, before it was stored.
                            None => ErrorCode::Ok,
                            Some(Ok(())) => {
                                tiers.set_tag(&key, tag);
                                ErrorCode::Ok
                            }
                            Some(Err(err)) => {
                                // Visible, but not here: the index lets go.
                                if !tiers.contains(&key) {
                                    tiers.dram.report_removed(key.clone());
                                }
                                err.code()
                            }
                        }
                    }
                    Slot::Skip(code) => {
                        tiers.not_admitted(&key);
                        code
                    }
                },
                Err(NotAdmitted::Refused(code)) => {
                    tiers.not_admitted(&key);
                    match code {
                        ErrorCode::AlreadyExists => ErrorCode::Busy,
                        code => *code,
                    }
                }
                Err(NotAdmitted::Unknown(_)) => {
                    tiers.not_admitted(&key);
                    // Perhaps visible: the index is told it is gone.
                    tiers.dram.report_removed(key);
                    ErrorCode::Unavailable
                }
            };
            admitter.count(match (&answer, code) {
                (Err(NotAdmitted::Unknown(_)), _) => Outcome::Lost,
                (Ok(_), ErrorCode::Ok) => Outcome::Admitted,
                (Ok(_), ErrorCode::AlreadyExists) => Outcome::Exists,
                _ => Outcome::Refused,
            });
            w.state = State::Done(code);
        }
    }
}
