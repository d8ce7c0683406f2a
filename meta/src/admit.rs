//! Admissions: a daemon's blocks that clients of its own host wrote into
//! room held ahead (`ShmAdmit`), made visible on it in one call, a
//! reservation and a commit at once, so that a same-host put is one round
//! trip for its writer instead of three.
//!
//! A block is admitted only where a put would have placed it anyway (the
//! daemon's own host, while it has room, or the daemon that evicted it),
//! and only as a put would be: not over one being stored or removed, nor
//! over a removal still owed to the daemon, nor in a namespace that keeps
//! more than one copy. Anything else is refused, and its writer puts it
//! the usual way. The daemon stores an admitted block after this answer,
//! and drops it if a removal came meanwhile, so a removal that reaches the
//! daemon before the block does still takes it.

use std::time::Instant;

use mooncake_proto::message::{Copies, PutCommitRequest, PutStartResponse, Slot};
use mooncake_proto::{BlockKey, ErrorCode};

use crate::clients::Client;
use crate::index::Reservation;
use crate::server::State;

/// Admits `req`'s blocks on the one daemon they all name (`stored_on`): a
/// slot each, `Place` (visible now; `continues` as a put's) or `Skip`
/// with why not; `Malformed` where the items name no daemon, several, or
/// different ones.
pub(crate) fn admit(
    state: &State,
    req: PutCommitRequest,
    client: Client,
    now: Instant,
) -> Result<PutStartResponse, ErrorCode> {
    let daemon = match req.items.first().map(|it| it.stored_on) {
        Some(on) if on.len() == 1 => on.iter().next().expect("one copy"),
        _ => return Err(ErrorCode::Malformed),
    };
    if req
        .items
        .iter()
        .any(|it| it.stored_on != Copies::one(daemon))
    {
        return Err(ErrorCode::Malformed);
    }
    let ns = &req.namespace;
    let one_copy = crate::config::replicas_in(&state.replicas, ns.as_str()) <= 1;
    let evicted_by = state
        .misses
        .returning(ns, req.items.iter().map(|it| &it.hash));
    let returning: Vec<bool> = evicted_by.iter().map(Option::is_some).collect();
    let mut slots: Vec<Slot> = req
        .items
        .iter()
        .zip(evicted_by)
        .map(|(it, evicted_by)| {
            if !one_copy {
                return Slot::Skip(ErrorCode::NoSpace);
            }
            if state.index.lookup(ns, &[it.hash])[0].is_some() {
                return Slot::Skip(ErrorCode::AlreadyExists);
            }
            // Out of the index, its daemons not all told yet (`removing`).
            if state.removing.contains(ns, it.hash) {
                return Slot::Skip(ErrorCode::Busy);
            }
            if !state
                .daemons
                .admit_on(daemon, u64::from(it.size), evicted_by)
            {
                return Slot::Skip(ErrorCode::NoSpace);
            }
            let want = (it.size, Copies::one(daemon), 1);
            if let Reservation::Exists = state.index.reserve(ns, it.hash, want, client, now) {
                return Slot::Skip(ErrorCode::AlreadyExists);
            }
            // A removal owed to the daemon and on its way there could take
            // the block after it is stored (as for a put).
            if state.owed.any() {
                let key = BlockKey::new(ns.clone(), it.hash);
                if !state.owed.settle_for_put(&[daemon], &key) {
                    state.index.release(ns, it.hash);
                    return Slot::Skip(ErrorCode::Busy);
                }
            }
            Slot::Place {
                copies: Copies::one(daemon),
                continues: false,
            }
        })
        .collect();
    let blocks = req.items.iter().map(|it| (it.hash, it.parent));
    crate::server::judge_branches(state, ns, blocks, returning, &mut slots);
    for (slot, it) in slots.iter().zip(&req.items) {
        if let Slot::Place { .. } = slot {
            let committed = state.index.commit(ns, it);
            debug_assert_eq!(committed, ErrorCode::Ok, "just reserved");
        }
    }
    // The daemon asking needs no addresses (it is the one placed on).
    Ok(PutStartResponse {
        slots,
        daemons: Vec::new(),
    })
}
