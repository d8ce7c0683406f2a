//! Calls to the meta service (prefix match, lookups, removals, pins,
//! admin), and following its leader across failovers.

use super::*;

/// Pause between attempts to reach a meta leader during a failover.
const LEADER_RETRY_PAUSE: Duration = Duration::from_millis(100);

impl Client {
    /// Checks the meta service answers; returns its election revision.
    pub async fn ping(&self) -> Result<u64, ClientError> {
        let r: Revision = self.meta_call(Opcode::Ping, &Empty, "ping").await?;
        Ok(r.revision)
    }

    /// How many leading keys of a chain are stored, in one round trip.
    pub async fn match_prefix(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<PrefixMatch, ClientError> {
        let started = std::time::Instant::now();
        let mut out = PrefixMatch::default();
        for chunk in hashes.chunks(MAX_BATCH) {
            let locs: Locations = self
                .meta_call(
                    Opcode::MatchPrefix,
                    &KeysRequest {
                        namespace: namespace.clone(),
                        hashes: chunk.to_vec(),
                    },
                    "match_prefix",
                )
                .await?;
            self.learn_daemons(&locs.daemons);
            self.remember(namespace, chunk, &locs.items);
            let matched = locs.items.iter().take_while(|l| l.is_some()).count();
            out.matched += matched;
            out.locations
                .extend(locs.items.into_iter().flatten().take(matched));
            out.daemons.extend(locs.daemons);
            if matched < chunk.len() {
                break;
            }
        }
        if let Some(m) = &self.cfg.metrics {
            m.matched(started.elapsed().as_secs_f64());
        }
        Ok(out)
    }

    /// The router's question (`docs/events.md`): for a request's chain and
    /// candidate hosts (with `every_host`, every host with a live daemon
    /// too), how much of its prefix each holds, and which serves it at the
    /// least cost; `transfer` is what moving one block costs against
    /// prefilling it (e.g. 0.1). A chain is judged on its first
    /// `MAX_BATCH` blocks.
    pub async fn route(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        candidates: &[RouteCandidate],
        every_host: bool,
        transfer: f64,
    ) -> Result<RouteAnswer, ClientError> {
        let req = RouteRequest {
            keys: KeysRequest {
                namespace: namespace.clone(),
                hashes: hashes[..hashes.len().min(MAX_BATCH)].to_vec(),
            },
            candidates: candidates.to_vec(),
            every_host,
            transfer_permille: (transfer.max(0.0) * 1000.0).round() as u32,
        };
        self.meta_call(Opcode::Route, &req, "route").await
    }

    /// Whether each key is stored and visible.
    pub async fn exists(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, ClientError> {
        let locs = self.lookup(namespace, hashes).await?;
        Ok(locs.items.iter().map(Option::is_some).collect())
    }

    /// Locations of each key (`None`: not stored).
    pub async fn lookup(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Locations, ClientError> {
        let mut out = Locations::default();
        for chunk in hashes.chunks(MAX_BATCH) {
            let locs = self.lookup_raw(namespace, chunk).await?;
            self.learn_daemons(&locs.daemons);
            self.remember(namespace, chunk, &locs.items);
            out.items.extend(locs.items);
            out.daemons.extend(locs.daemons);
        }
        self.lineage.looked_up(namespace, hashes, &out.items);
        Ok(out)
    }

    pub(super) async fn lookup_raw(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Locations, ClientError> {
        self.meta_call(
            Opcode::Lookup,
            &KeysRequest {
                namespace: namespace.clone(),
                hashes: hashes.to_vec(),
            },
            "lookup",
        )
        .await
    }

    /// Removes keys everywhere: a status per key, `Ok` once the daemon that
    /// held it dropped its bytes, `NotFound` if it was not stored, else why
    /// the removal is not confirmed (`Timeout`, `Unavailable`: the key is
    /// gone from the index and its daemon is told again when it answers).
    pub async fn remove(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        self.remove_by(Opcode::MetaRemove, namespace, hashes).await
    }

    /// `remove`, but a key a lease holds (a client looked it up with a
    /// lease, Mooncake's `batch_is_exist`, and its lease has not run out)
    /// stays, with status `Leased`: Mooncake's `remove` without `force`.
    pub async fn remove_unleased(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        self.remove_by(Opcode::MetaRemoveUnleased, namespace, hashes)
            .await
    }

    async fn remove_by(
        &self,
        op: Opcode,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let mut out = Vec::with_capacity(hashes.len());
        for chunk in hashes.chunks(MAX_BATCH) {
            let st: Statuses = self
                .meta_call(
                    op,
                    &KeysRequest {
                        namespace: namespace.clone(),
                        hashes: chunk.to_vec(),
                    },
                    "remove",
                )
                .await?;
            for hash in chunk {
                self.locations
                    .forget(&BlockKey::new(namespace.clone(), *hash));
            }
            out.extend(st.codes);
        }
        Ok(out)
    }

    /// Pins keys against eviction (or unpins them); a status per key.
    pub async fn pin(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        pin: bool,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let mut out = Vec::with_capacity(hashes.len());
        for chunk in hashes.chunks(MAX_BATCH) {
            let st: Statuses = self
                .meta_call(
                    Opcode::MetaPin,
                    &PinRequest {
                        keys: KeysRequest {
                            namespace: namespace.clone(),
                            hashes: chunk.to_vec(),
                        },
                        pin,
                    },
                    "pin",
                )
                .await?;
            out.extend(st.codes);
        }
        Ok(out)
    }

    /// Stops (or resumes) placing new blocks on a daemon.
    pub async fn drain(&self, daemon: u32, drain: bool) -> Result<(), ClientError> {
        let req = mooncake_proto::message::DrainRequest { daemon, drain };
        self.meta_call::<Empty>(Opcode::Drain, &req, "drain")
            .await?;
        Ok(())
    }

    /// The cluster at a glance: daemons, capacity, use, block count.
    pub async fn cluster_stats(&self) -> Result<ClusterStats, ClientError> {
        self.meta_call(Opcode::ClusterStat, &Empty, "stat").await
    }

    /// One page of the index.
    pub async fn list(&self, req: &ListRequest) -> Result<ListResponse, ClientError> {
        self.meta_call(Opcode::List, req, "list").await
    }

    pub(super) fn remember(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        items: &[Option<Location>],
    ) {
        self.locations
            .insert_batch(namespace, hashes.iter().zip(items));
    }

    pub(super) async fn meta_call<Resp: Body>(
        &self,
        op: Opcode,
        req: &impl Body,
        name: &'static str,
    ) -> Result<Resp, ClientError> {
        self.deadline(name, async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let pool = self.meta.read().clone();
                let result = match self.meta_conn(&pool).await {
                    Ok((mut conn, reused)) => match conn.call(op, req, name).await {
                        Ok(resp) => {
                            pool.put_back(conn);
                            return Ok(resp);
                        }
                        Err(err @ ClientError::Server { .. }) => {
                            pool.put_back(conn);
                            return Err(err);
                        }
                        Err(ClientError::Io { .. }) if reused && attempt == 1 => continue,
                        Err(err) => err,
                    },
                    Err(err) => err,
                };
                // The meta service is unreachable: with a resolver, find
                // the (new) leader and try again until the deadline.
                if !matches!(
                    result,
                    ClientError::Io { .. }
                        | ClientError::Timeout { .. }
                        | ClientError::Stale { .. }
                ) || !self.follow_leader(&pool).await
                {
                    return Err(result);
                }
            }
        })
        .await
    }

    /// A connection to the meta service. A new one is first asked for its
    /// election revision: a leader older than one this client has already
    /// seen is stale (it lost its lead and has not noticed), and refused.
    pub(super) async fn meta_conn(
        &self,
        pool: &ConnPool,
    ) -> Result<(Connection, bool), ClientError> {
        let (mut conn, reused) = pool.get().await?;
        if reused {
            return Ok((conn, true));
        }
        let revision = match conn.call(Opcode::Ping, &Empty, "ping").await? {
            PingAnswer::Meta(revision) => revision,
            PingAnswer::Daemon => {
                return Err(ClientError::Invalid(format!(
                    "{} is a storage daemon, not the meta service: give clients the meta service's address (`up --meta-listen`, 127.0.0.1:7070 by default; `daemon --meta`)",
                    pool.addr()
                )))
            }
        };
        let seen = self.leader_revision.fetch_max(revision, Ordering::Relaxed);
        if revision < seen {
            return Err(ClientError::Stale {
                addr: pool.addr().to_string(),
                revision,
                seen,
            });
        }
        Ok((conn, false))
    }

    /// Points the client at the leader the resolver names; `false` when
    /// there is no resolver (a fixed meta address).
    pub(super) async fn follow_leader(&self, failed: &Arc<ConnPool>) -> bool {
        let Some(resolver) = &self.cfg.resolver else {
            return false;
        };
        match resolver.resolve().await {
            Ok(addr) if addr != failed.addr() => {
                tracing::info!(leader = %addr, "following the new meta leader");
                *self.meta.write() = Arc::new(pool_for(&self.cfg, addr, ErrorSource::Meta));
            }
            Ok(_) => {
                failed.clear();
                tokio::time::sleep(LEADER_RETRY_PAUSE).await;
            }
            Err(why) => {
                tracing::debug!(%why, "no meta leader yet");
                tokio::time::sleep(LEADER_RETRY_PAUSE).await;
            }
        }
        true
    }

    pub(super) async fn deadline<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        match tokio::time::timeout(self.cfg.timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout {
                side: ErrorSource::Meta,
                addr: self.cfg.meta_addr.clone(),
                op,
                timeout_ms: self.cfg.timeout.as_millis() as u64,
            }),
        }
    }

    pub(super) fn meta_protocol(&self, why: &str) -> ClientError {
        ClientError::Protocol {
            side: ErrorSource::Meta,
            addr: self.cfg.meta_addr.clone(),
            err: mooncake_proto::ProtoError::Invalid {
                field: "response",
                why: why.to_string(),
            },
        }
    }
}

/// The answer to `Ping`: the meta service's election revision, or nothing
/// from a storage daemon, which answers `Ping` too (a client pointed at a
/// daemon's address by mistake).
enum PingAnswer {
    Meta(u64),
    Daemon,
}

impl Body for PingAnswer {
    fn encode(&self, w: &mut mooncake_proto::codec::Writer) {
        if let PingAnswer::Meta(revision) = self {
            Revision {
                revision: *revision,
            }
            .encode(w);
        }
    }

    fn decode(
        r: &mut mooncake_proto::codec::Reader<'_>,
    ) -> Result<Self, mooncake_proto::ProtoError> {
        if r.remaining() == 0 {
            return Ok(PingAnswer::Daemon);
        }
        Ok(PingAnswer::Meta(Revision::decode(r)?.revision))
    }
}
