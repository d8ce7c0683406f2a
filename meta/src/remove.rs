//! Removing keys at a caller's request. A forced removal (`MetaRemove`)
//! takes a key out of the index first, then tells each daemon holding a
//! copy to drop it (owed until the daemon confirms: `removals`). One that
//! is not forced (`MetaRemoveUnleased`, Mooncake's `remove` without
//! `force`) asks each daemon first, and a daemon where a lease holds its
//! copy keeps it: the key stays in the index with that copy and the
//! caller hears `Leased` (Mooncake's `OBJECT_HAS_LEASE`). Leases are
//! taken at the daemons (`Hold`, after a lookup), so they are the ones to
//! ask. A key with copies on several daemons is asked about at each
//! (`LeaseOf`) before any copy goes, so that a lease on one copy keeps
//! them all, as a lease on a Mooncake object does.

use mooncake_proto::message::{Copies, KeyRequest};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace, Opcode};

use crate::server::{State, DAEMON_CALL_TIMEOUT};

/// Removes `hashes` of `namespace` everywhere: a status per key, `Ok`
/// once every daemon that held a copy dropped it, `NotFound` if it was
/// not stored, else why one of them did not confirm (the key is out of
/// the index, and that daemon is told again when it answers).
pub(crate) async fn forced(
    state: &State,
    namespace: &Namespace,
    hashes: &[BlockHash],
) -> Vec<ErrorCode> {
    // Before they leave the index: a put that no longer finds them there
    // waits for their daemons to drop them (`removing`).
    let mut removing = state.removing.mark(namespace, hashes);
    let removed = state.index.remove(namespace, hashes);
    let mut codes = Vec::with_capacity(removed.len());
    for (i, (hash, copies)) in hashes.iter().zip(removed).enumerate() {
        let Some(copies) = copies else {
            removing.done(i);
            codes.push(ErrorCode::NotFound);
            continue;
        };
        // Invisible already. Removed only once every daemon that holds a
        // copy drops it; until then the caller hears that it could not be
        // confirmed.
        let key = BlockKey::new(namespace.clone(), *hash);
        let mut code = ErrorCode::Ok;
        for d in copies.iter() {
            let said = state.remove_on_daemon(d, key.clone()).await;
            if code == ErrorCode::Ok {
                code = said;
            }
        }
        removing.done(i);
        codes.push(code);
    }
    codes
}

/// Removes `hashes` of `namespace`, but not a copy a lease holds: a
/// status per key, `Leased` where a daemon kept its copy for a lease
/// (the key stays in the index with the copies kept), else as `forced`
/// says. A daemon that cannot be asked is treated as for a forced
/// removal: its copy leaves the index and its removal is owed.
pub(crate) async fn unleased(
    state: &State,
    namespace: &Namespace,
    hashes: &[BlockHash],
) -> Vec<ErrorCode> {
    let found = state.index.lookup(namespace, hashes);
    let mut codes = Vec::with_capacity(found.len());
    for (hash, location) in hashes.iter().zip(found) {
        let Some(location) = location else {
            codes.push(ErrorCode::NotFound);
            continue;
        };
        let key = BlockKey::new(namespace.clone(), *hash);
        if location.daemons.len() > 1 && leased_anywhere(state, &key, &location.daemons).await {
            codes.push(ErrorCode::Leased);
            continue;
        }
        let (mut code, mut leased) = (ErrorCode::Ok, false);
        for d in location.daemons.iter() {
            let req = KeyRequest { key: key.clone() };
            let said = state
                .call_daemon(d, Opcode::RemoveUnleased, &req, DAEMON_CALL_TIMEOUT)
                .await;
            match said {
                ErrorCode::Leased => leased = true,
                ErrorCode::Ok | ErrorCode::NotFound => {
                    state.index.remove_at(&key, d);
                }
                other => {
                    tracing::warn!(daemon = d, %key, code = %other, "daemon not asked whether a lease holds its copy; removed as if forced");
                    state.index.remove_at(&key, d);
                    state.owe_removal(d, key.clone());
                    if code == ErrorCode::Ok {
                        code = other;
                    }
                }
            }
        }
        codes.push(if leased { ErrorCode::Leased } else { code });
    }
    codes
}

/// Whether a lease holds any of `copies` of `key`; a daemon that cannot
/// be asked holds none (its copy's removal then goes as forced).
async fn leased_anywhere(state: &State, key: &BlockKey, copies: &Copies) -> bool {
    for d in copies.iter() {
        let req = KeyRequest { key: key.clone() };
        let said = state
            .call_daemon(d, Opcode::LeaseOf, &req, DAEMON_CALL_TIMEOUT)
            .await;
        if said == ErrorCode::Leased {
            return true;
        }
    }
    false
}
