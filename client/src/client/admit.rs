//! Same-host puts in one round trip: a batch's leading blocks of a single
//! copy that find room held in the daemon's pool are written there and
//! made visible by the daemon itself (`ShmLink::admit_blocks`), with no
//! reservation or commit at the meta service. The rest of the batch, from
//! the first block without room on, goes the usual way after them, so
//! that a chain's blocks still become visible parent first.

use super::*;

impl Client {
    /// Admits what of `blocks` the daemon on this host can take in one
    /// round trip: per block, its outcome, or `None` to put it the usual
    /// way. None at all with several copies, without a same-host link, or
    /// where that daemon is not one of this client's cluster (it is known
    /// once the meta service named it).
    pub(super) async fn admit_here(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        (parents, tags): (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        replicas: u8,
    ) -> Vec<Option<PutOutcome>> {
        let mut out = vec![None; blocks.len()];
        if replicas > 1 {
            return out;
        }
        // Made by a put the usual way first, which also learns whether the
        // daemon is one of this cluster's.
        let Some(link) = self.shm.lock().0.clone() else {
            return out;
        };
        let daemon = {
            let known = self.daemons.read();
            known
                .iter()
                .find(|(_, p)| p.addr == link.addr)
                .map(|(id, _)| *id)
        };
        let Some(daemon) = daemon else {
            return out;
        };
        let items: Vec<PutItem<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(index, (hash, value))| PutItem {
                index,
                hash: *hash,
                value: *value,
                checksum: None,
                parent: parents[index],
                continues: false,
                tag: tags[index].clone(),
            })
            .collect();
        let written = link.admit_blocks(namespace, &items).await;
        let mut stored = 0;
        for (i, w) in written.into_iter().enumerate() {
            out[i] = match w {
                Some(Written {
                    code: ErrorCode::Ok,
                    checksum,
                }) => {
                    stored += 1;
                    let location = Location {
                        daemons: Copies::one(daemon),
                        size: blocks[i].1.len() as u32,
                        checksum,
                    };
                    let key = BlockKey::new(namespace.clone(), blocks[i].0);
                    self.locations.insert(key, location);
                    Some(PutOutcome::Stored)
                }
                Some(_) => Some(PutOutcome::AlreadyExists),
                None => None,
            };
        }
        self.transports.wrote(TransportKind::Shm, stored);
        out
    }
}
