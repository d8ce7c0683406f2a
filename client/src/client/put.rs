//! Puts: a batch reserved at the meta service, written to each daemon in
//! parallel (pipelined, verified there), then committed.

use super::*;

impl Client {
    /// Stores blocks; each becomes visible to every client once this
    /// returns `Stored` for it.
    pub async fn put(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        self.put_with_parents(namespace, blocks, &vec![None; blocks.len()])
            .await
    }

    /// Stores consecutive blocks of one chain: `blocks[0]` extends
    /// `parent` (`None`: it starts the chain), each next block extends the
    /// one before. Daemons then evict a chain from its tail, keeping the
    /// prefixes later requests match (see `docs/ARCHITECTURE.md`).
    pub async fn put_chain(
        &self,
        namespace: &Namespace,
        parent: Option<BlockHash>,
        blocks: &[(BlockHash, &[u8])],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let parents: Vec<Option<BlockHash>> = std::iter::once(parent)
            .chain(blocks.iter().map(|(h, _)| Some(*h)))
            .take(blocks.len())
            .collect();
        self.put_with_parents(namespace, blocks, &parents).await
    }

    pub(super) async fn put_with_parents(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        parents: &[Option<BlockHash>],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(blocks.len());
        for (chunk, parents) in blocks.chunks(MAX_BATCH).zip(parents.chunks(MAX_BATCH)) {
            out.extend(
                self.deadline("put", self.put_chunk(namespace, chunk, parents))
                    .await?,
            );
        }
        if let Some(m) = &self.cfg.metrics {
            let sizes = blocks.iter().map(|(_, v)| v.len());
            m.puts(started.elapsed().as_secs_f64(), &out, sizes);
        }
        Ok(out)
    }

    /// Stores one block.
    pub async fn put_one(&self, key: &BlockKey, value: &[u8]) -> Result<PutOutcome, ClientError> {
        let out = self.put(&key.namespace, &[(key.hash, value)]).await?;
        Ok(out[0])
    }

    pub(super) async fn put_chunk(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        parents: &[Option<BlockHash>],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let mut items = Vec::with_capacity(blocks.len());
        for (hash, value) in blocks {
            let size = u32::try_from(value.len())
                .map_err(|_| ClientError::Invalid(format!("block {hash} is over 4 GiB")))?;
            items.push((*hash, size));
        }
        let (slots, daemons) = self
            .reservations
            .call(namespace.clone(), items, |namespace, items| async move {
                let start: PutStartResponse = self
                    .meta_call(
                        Opcode::PutStart,
                        &PutStartRequest {
                            namespace,
                            node: self.cfg.node.clone(),
                            items,
                        },
                        "put_start",
                    )
                    .await?;
                Ok((start.slots, start.daemons))
            })
            .await?;
        self.learn_daemons(&daemons);

        let mut outcomes = vec![PutOutcome::Failed(ErrorCode::Internal); blocks.len()];
        let mut by_daemon: HashMap<u32, Vec<PutItem<'_>>> = HashMap::new();
        for (index, (slot, (hash, value))) in slots.iter().zip(blocks).enumerate() {
            match slot {
                Slot::Place(daemon) => by_daemon.entry(*daemon).or_default().push(PutItem {
                    index,
                    hash: *hash,
                    value,
                    checksum: checksum(value),
                    parent: parents[index],
                }),
                Slot::Skip(ErrorCode::AlreadyExists) => outcomes[index] = PutOutcome::AlreadyExists,
                Slot::Skip(code) => outcomes[index] = PutOutcome::Failed(*code),
            }
        }

        let writes = by_daemon.into_iter().map(|(daemon, items)| async move {
            let result = self.put_on_daemon(daemon, namespace, &items).await;
            (daemon, items, result)
        });
        let mut commits = Vec::new();
        for (daemon, items, result) in join_all(writes).await {
            let codes = match result {
                Ok(codes) => codes,
                Err(err) => {
                    tracing::warn!(daemon, %err, "put to daemon failed");
                    vec![err.code().unwrap_or(ErrorCode::Unavailable); items.len()]
                }
            };
            for (item, code) in items.iter().zip(codes) {
                // A daemon that already holds the key has complete, verified
                // bytes for it: committing makes them visible.
                let stored = matches!(code, ErrorCode::Ok | ErrorCode::AlreadyExists);
                outcomes[item.index] = if stored {
                    PutOutcome::Stored
                } else {
                    PutOutcome::Failed(code)
                };
                commits.push(CommitItem {
                    hash: item.hash,
                    daemon,
                    size: item.value.len() as u32,
                    checksum: item.checksum,
                    stored,
                });
            }
        }
        if commits.is_empty() {
            return Ok(outcomes);
        }
        let (codes, ()) = self
            .commits
            .call(
                namespace.clone(),
                commits.clone(),
                |namespace, items| async move {
                    let statuses: Statuses = self
                        .meta_call(
                            Opcode::PutCommit,
                            &PutCommitRequest { namespace, items },
                            "put_commit",
                        )
                        .await?;
                    Ok((statuses.codes, ()))
                },
            )
            .await?;
        for (item, code) in commits.iter().zip(codes) {
            if !item.stored {
                continue;
            }
            if code == ErrorCode::Ok {
                let location = Location {
                    daemon: item.daemon,
                    size: item.size,
                    checksum: item.checksum,
                };
                self.locations
                    .insert(BlockKey::new(namespace.clone(), item.hash), location);
            } else {
                let index = blocks
                    .iter()
                    .position(|(h, _)| *h == item.hash)
                    .expect("hash of this batch");
                outcomes[index] = PutOutcome::Failed(code);
            }
        }
        Ok(outcomes)
    }

    pub(super) async fn put_on_daemon(
        &self,
        daemon: u32,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let peer = self.peer(daemon)?;
        if let Some(link) = self.shm_link(&peer.addr, peer.data.kind()) {
            match link.put(namespace, items).await {
                Ok(codes) => {
                    self.transports.wrote(TransportKind::Shm, stored(&codes));
                    return Ok(codes);
                }
                Err(err) => self.shm_lost(&err, peer.data.kind()),
            }
        }
        if let Some(rdma) = &peer.rdma {
            match rdma.put(namespace, items).await {
                Ok(codes) => {
                    self.transports.wrote(TransportKind::Rdma, stored(&codes));
                    return Ok(codes);
                }
                Err(err) => self.rdma_failed(&err, peer.data.kind()),
            }
        }
        let codes = peer.data.put(namespace, items).await?;
        self.transports.wrote(peer.data.kind(), stored(&codes));
        Ok(codes)
    }
}
