//! Leases on found blocks, as Mooncake's `batch_is_exist` grants them: a
//! serving engine looks a prompt's blocks up, plans a load of those found,
//! and loads them a scheduler step or more later. So that eviction does
//! not take them in between, each daemon holding a copy keeps it from
//! eviction for its `kv_lease_ttl` (`Opcode::Hold`).

use super::*;

impl Client {
    /// Whether each key is stored, each one found leased on every daemon
    /// that holds a copy. A key whose copies are all gone by the time
    /// their daemons are asked (evicted after the index answered) is
    /// reported missing; a daemon that cannot be asked leaves the index's
    /// answer standing, without a lease there.
    pub async fn exists_leased(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, ClientError> {
        let locs = self.lookup(namespace, hashes).await?;
        let found: Vec<Option<&Location>> = locs.items.iter().map(Option::as_ref).collect();
        Ok(self.hold_found(namespace, hashes, &found).await)
    }

    /// `match_prefix`, its matched blocks leased as `exists_leased` leases
    /// them: the match ends before the first of them found gone.
    pub async fn match_prefix_leased(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<PrefixMatch, ClientError> {
        let mut m = self.match_prefix(namespace, hashes).await?;
        let found: Vec<Option<&Location>> = m.locations.iter().map(Some).collect();
        let held = self
            .hold_found(namespace, &hashes[..m.matched], &found)
            .await;
        m.matched = held.iter().take_while(|&&h| h).count();
        m.locations.truncate(m.matched);
        Ok(m)
    }

    /// Leases each key found (`found`: where the index says it is) on
    /// every daemon holding a copy; whether each is still stored.
    async fn hold_found(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        found: &[Option<&Location>],
    ) -> Vec<bool> {
        // The positions of each daemon's keys.
        let mut on: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, loc) in found.iter().enumerate() {
            for d in loc.iter().flat_map(|l| l.daemons.iter()) {
                on.entry(d).or_default().push(i);
            }
        }
        let calls = on.into_iter().map(|(daemon, at)| async move {
            let keys: Vec<BlockHash> = at.iter().map(|&i| hashes[i]).collect();
            (at, self.hold_on(daemon, namespace, &keys).await)
        });
        // Copies found gone, per key.
        let mut gone = vec![0usize; hashes.len()];
        for (at, held) in join_all(calls).await {
            match held {
                Ok(codes) => {
                    for (&i, code) in at.iter().zip(codes) {
                        gone[i] += usize::from(code == ErrorCode::NotFound);
                    }
                }
                Err(err) => tracing::debug!(%err, "no lease on a daemon's blocks"),
            }
        }
        let mut out = Vec::with_capacity(hashes.len());
        for ((hash, loc), gone) in hashes.iter().zip(found).zip(gone) {
            let stored = loc.is_some_and(|l| gone < l.daemons.len());
            if loc.is_some() && !stored {
                self.locations
                    .forget(&BlockKey::new(namespace.clone(), *hash));
            }
            out.push(stored);
        }
        out
    }

    /// Leases `hashes` on one daemon; its status for each.
    async fn hold_on(
        &self,
        daemon: u32,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let pool = self.peer(daemon)?.tcp.clone();
        let call = async {
            let mut codes = Vec::with_capacity(hashes.len());
            for chunk in hashes.chunks(MAX_BATCH) {
                let req = KeysRequest {
                    namespace: namespace.clone(),
                    hashes: chunk.to_vec(),
                };
                let (mut conn, _) = pool.get().await?;
                let st: Statuses = match conn.call(Opcode::Hold, &req, "hold").await {
                    Ok(st) => st,
                    Err(err) => {
                        if matches!(err, ClientError::Server { .. }) {
                            pool.put_back(conn);
                        }
                        return Err(err);
                    }
                };
                pool.put_back(conn);
                if st.codes.len() != chunk.len() {
                    return Err(ClientError::Protocol {
                        side: ErrorSource::Daemon,
                        addr: pool.addr().to_string(),
                        err: mooncake_proto::ProtoError::Invalid {
                            field: "response",
                            why: "a lease answered for another number of keys".into(),
                        },
                    });
                }
                codes.extend(st.codes);
            }
            Ok(codes)
        };
        match tokio::time::timeout(self.cfg.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout {
                side: ErrorSource::Daemon,
                addr: pool.addr().to_string(),
                op: "hold",
                timeout_ms: self.cfg.timeout.as_millis() as u64,
            }),
        }
    }
}
