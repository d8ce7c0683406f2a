//! Leases on found blocks, as Mooncake's `batch_is_exist` grants them: a
//! serving engine looks a prompt's blocks up, plans a load of those found,
//! and loads them a scheduler step or more later. So that eviction does
//! not take them in between, each daemon holding a copy keeps it from
//! eviction for its `kv_lease_ttl` (`Opcode::Hold`).
//!
//! Where this client has seen a key before (`LocationCache`), its daemons
//! are asked while the index is: a lookup of blocks looked up or put
//! before costs no round trip more. Only daemons the index names and the
//! hints did not are asked after its answer.

use super::*;

/// Daemons' answers to holds, by (position of the key, daemon); a daemon
/// that could not be asked is absent.
type Answers = HashMap<(usize, u32), ErrorCode>;

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
        let hinted = self.locations.peek_daemons(namespace, hashes);
        let (locs, early) = futures::join!(
            self.lookup(namespace, hashes),
            self.hold_where(namespace, hashes, &hinted)
        );
        let locs = locs?;
        let found: Vec<Option<&Location>> = locs.items.iter().map(Option::as_ref).collect();
        Ok(self
            .hold_found(namespace, hashes, &found, &hinted, early)
            .await)
    }

    /// `match_prefix`, its matched blocks leased as `exists_leased` leases
    /// them: the match ends before the first of them found gone.
    pub async fn match_prefix_leased(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<PrefixMatch, ClientError> {
        let hinted = self.locations.peek_daemons(namespace, hashes);
        let (m, early) = futures::join!(
            self.match_prefix(namespace, hashes),
            self.hold_where(namespace, hashes, &hinted)
        );
        let mut m = m?;
        let found: Vec<Option<&Location>> = m.locations.iter().map(Some).collect();
        let held = self
            .hold_found(namespace, &hashes[..m.matched], &found, &hinted, early)
            .await;
        m.matched = held.iter().take_while(|&&h| h).count();
        m.locations.truncate(m.matched);
        Ok(m)
    }

    /// Leases each key found (`found`: where the index says it is) on
    /// every daemon holding a copy that `early` has no answer of (asked
    /// because `hinted` named it); whether each is still stored.
    async fn hold_found(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        found: &[Option<&Location>],
        hinted: &[Vec<u32>],
        mut early: Answers,
    ) -> Vec<bool> {
        let rest: Vec<Vec<u32>> = found
            .iter()
            .zip(hinted)
            .map(|(loc, hinted)| {
                loc.iter()
                    .flat_map(|l| l.daemons.iter())
                    .filter(|d| !hinted.contains(d))
                    .collect()
            })
            .collect();
        if rest.iter().any(|r| !r.is_empty()) {
            early.extend(self.hold_where(namespace, hashes, &rest).await);
        }
        let mut out = Vec::with_capacity(hashes.len());
        for (i, (hash, loc)) in hashes.iter().zip(found).enumerate() {
            let stored = loc.is_some_and(|l| {
                let gone = l
                    .daemons
                    .iter()
                    .filter(|&d| early.get(&(i, d)) == Some(&ErrorCode::NotFound))
                    .count();
                gone < l.daemons.len()
            });
            if loc.is_some() && !stored {
                self.locations
                    .forget(&BlockKey::new(namespace.clone(), *hash));
            }
            out.push(stored);
        }
        out
    }

    /// Asks each daemon of `at[i]` to hold key `i`, all daemons at once.
    async fn hold_where(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        at: &[Vec<u32>],
    ) -> Answers {
        // The positions of each daemon's keys.
        let mut on: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, daemons) in at.iter().enumerate() {
            for &d in daemons {
                on.entry(d).or_default().push(i);
            }
        }
        let calls = on.into_iter().map(|(daemon, at)| async move {
            let keys: Vec<BlockHash> = at.iter().map(|&i| hashes[i]).collect();
            (daemon, at, self.hold_on(daemon, namespace, &keys).await)
        });
        let mut answers = Answers::new();
        for (daemon, at, held) in join_all(calls).await {
            match held {
                Ok(codes) => answers.extend(at.into_iter().map(|i| (i, daemon)).zip(codes)),
                Err(err) => tracing::debug!(%err, daemon, "no lease on a daemon's blocks"),
            }
        }
        answers
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
