//! Puts: a batch reserved at the meta service, written to each daemon in
//! parallel (pipelined, verified there; a block with several copies to
//! each of its daemons), then committed with the daemons that stored it.

use super::*;

impl Client {
    /// Stores blocks; each becomes visible to every client once this
    /// returns `Stored` for it.
    pub async fn put(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        self.put_with(namespace, blocks, PutOptions::default())
            .await
    }

    /// `put`, with options (copies).
    pub async fn put_with(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        self.put_with_parents(namespace, blocks, &vec![None; blocks.len()], opts)
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
        self.put_chain_with(namespace, parent, blocks, PutOptions::default())
            .await
    }

    /// `put_chain`, with options (copies).
    pub async fn put_chain_with(
        &self,
        namespace: &Namespace,
        parent: Option<BlockHash>,
        blocks: &[(BlockHash, &[u8])],
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let parents = chained(parent, blocks.iter().map(|(h, _)| *h));
        self.put_with_parents(namespace, blocks, &parents, opts)
            .await
    }

    /// Stores blocks each made of pieces (`Value::Pieces`: a page's K and
    /// V apart, or one piece per layer), written straight from them: no
    /// staging copy. With `chain: Some(parent)`, the blocks are
    /// consecutive blocks of one chain, as in `put_chain`.
    pub async fn put_pieces(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        chain: Option<Option<BlockHash>>,
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        self.put_tagged(namespace, blocks, chain, &[], opts).await
    }

    /// `put_pieces`, with what the engine calls each block: `tags[i]`
    /// (its hash, its tokens) for `blocks[i]`, published in store events
    /// in place of the store's hash (`docs/events.md`); `tags` may be
    /// empty (no block tagged).
    pub async fn put_tagged(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        chain: Option<Option<BlockHash>>,
        tags: &[Option<Arc<EngineTag>>],
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let parents = parents_of(chain, blocks.iter().map(|(h, _)| *h), tags.len())?;
        let tags = match tags.is_empty() {
            true => vec![None; blocks.len()],
            false => tags.to_vec(),
        };
        self.put_values(namespace, blocks, (&parents, &tags), opts)
            .await
    }

    async fn put_with_parents(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        parents: &[Option<BlockHash>],
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let values: Vec<(BlockHash, Value<'_>)> =
            blocks.iter().map(|(h, v)| (*h, Value::One(v))).collect();
        let tags = vec![None; blocks.len()];
        self.put_values(namespace, &values, (parents, &tags), opts)
            .await
    }

    pub(super) async fn put_values(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        (parents, tags): (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        opts: PutOptions,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let replicas = match opts.replicas {
            0 => self.cfg.replicas,
            n => n,
        };
        if usize::from(replicas) > MAX_COPIES {
            return Err(ClientError::Invalid(format!(
                "{replicas} copies asked; at most {MAX_COPIES}"
            )));
        }
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(blocks.len());
        let mut start = 0;
        while start < blocks.len() {
            let end = chunk_end(tags, start);
            let (chunk, named) = (
                &blocks[start..end],
                (&parents[start..end], &tags[start..end]),
            );
            out.extend(
                self.deadline("put", self.put_chunk(namespace, chunk, named, replicas))
                    .await?,
            );
            start = end;
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

    async fn put_chunk(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        (parents, tags): (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        replicas: u8,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let mut items = Vec::with_capacity(blocks.len());
        for (hash, value) in blocks {
            let size = u32::try_from(value.len())
                .map_err(|_| ClientError::Invalid(format!("block {hash} is over 4 GiB")))?;
            items.push((*hash, size));
        }
        let (slots, daemons) = self.reservations[usize::from(replicas)]
            .call(namespace.clone(), items, |namespace, items| async move {
                let start: PutStartResponse = self
                    .meta_call(
                        Opcode::PutStart,
                        &PutStartRequest {
                            namespace,
                            node: self.cfg.node.clone(),
                            replicas,
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
        let mut sums = vec![0u64; blocks.len()];
        for (index, (slot, (hash, value))) in slots.iter().zip(blocks).enumerate() {
            match slot {
                Slot::Place(copies) => {
                    sums[index] = value.checksum();
                    let item = PutItem {
                        index,
                        hash: *hash,
                        value: *value,
                        checksum: sums[index],
                        parent: parents[index],
                        tag: tags[index].clone(),
                    };
                    for daemon in copies.iter() {
                        by_daemon.entry(daemon).or_default().push(item.clone());
                    }
                }
                Slot::Skip(ErrorCode::AlreadyExists) => outcomes[index] = PutOutcome::AlreadyExists,
                Slot::Skip(code) => outcomes[index] = PutOutcome::Failed(*code),
            }
        }

        let writes = by_daemon.into_iter().map(|(daemon, items)| async move {
            let result = self.put_on_daemon(daemon, namespace, &items).await;
            (daemon, items, result)
        });
        // Per block placed: the daemons that stored it, and the first
        // refusal of one that did not.
        let mut stored_on: HashMap<usize, (Copies, Option<ErrorCode>)> = HashMap::new();
        for (daemon, items, result) in join_all(writes).await {
            let codes = match result {
                Ok(codes) => codes,
                Err(err) => {
                    tracing::warn!(daemon, %err, "put to daemon failed");
                    vec![err.code().unwrap_or(ErrorCode::Unavailable); items.len()]
                }
            };
            for (item, code) in items.iter().zip(codes) {
                let (copies, refused) = stored_on.entry(item.index).or_default();
                // A daemon that already holds the key has complete, verified
                // bytes for it: committing makes them visible.
                if matches!(code, ErrorCode::Ok | ErrorCode::AlreadyExists) {
                    copies.push(daemon);
                } else {
                    refused.get_or_insert(code);
                }
            }
        }
        // Committed in the batch's order, so that a chain's blocks appear
        // (and are published to event subscribers) parent first.
        let mut stored_on: Vec<_> = stored_on.into_iter().collect();
        stored_on.sort_unstable_by_key(|(index, _)| *index);
        let mut commits = Vec::with_capacity(stored_on.len());
        for (index, (copies, refused)) in &stored_on {
            let (hash, value) = blocks[*index];
            outcomes[*index] = match (refused, copies.len()) {
                (Some(code), 0) => PutOutcome::Failed(*code),
                (Some(_), n) => PutOutcome::Short { copies: n as u8 },
                (None, _) => PutOutcome::Stored,
            };
            commits.push(CommitItem {
                hash,
                stored_on: *copies,
                size: value.len() as u32,
                checksum: sums[*index],
                parent: parents[*index],
                tag: tags[*index].clone(),
            });
        }
        // Fewer placed than asked (too few hosts with room): short too.
        for (index, slot) in slots.iter().enumerate() {
            if let (Slot::Place(copies), PutOutcome::Stored) = (slot, outcomes[index]) {
                let asked = usize::from(replicas).max(1);
                if copies.len() < asked {
                    outcomes[index] = PutOutcome::Short {
                        copies: copies.len() as u8,
                    };
                }
            }
        }
        let short = outcomes
            .iter()
            .filter(|o| matches!(o, PutOutcome::Short { .. }))
            .count();
        if short > 0 {
            tracing::warn!(short, replicas, "blocks stored on fewer hosts than asked");
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
            if !item.stored() {
                continue;
            }
            if code == ErrorCode::Ok {
                let location = Location {
                    daemons: item.stored_on,
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

/// Where the put's chunk that starts at `start` ends: at most `MAX_BATCH`
/// blocks, and at most `MAX_COMMIT_TAG_BYTES` of engine tags (at least one
/// block), so that its commit fits a control frame.
fn chunk_end(tags: &[Option<Arc<EngineTag>>], start: usize) -> usize {
    let mut bytes = 0;
    let mut end = start;
    for tag in tags[start..].iter().take(MAX_BATCH) {
        bytes += tag.as_deref().map_or(0, EngineTag::encoded_len);
        if end > start && bytes > MAX_COMMIT_TAG_BYTES {
            break;
        }
        end += 1;
    }
    end
}

/// Each block's parent in a chain of `hashes` that extends `parent`: the
/// one before it.
/// Each block's parent: with `chain: Some(parent)`, the blocks `hashes`
/// are consecutive blocks of one chain extending `parent`; else none has
/// one. Refused: `tags` engine tags (0: none) for another number of blocks.
pub(super) fn parents_of(
    chain: Option<Option<BlockHash>>,
    hashes: impl ExactSizeIterator<Item = BlockHash>,
    tags: usize,
) -> Result<Vec<Option<BlockHash>>, ClientError> {
    let n = hashes.len();
    if tags != 0 && tags != n {
        return Err(ClientError::Invalid(format!(
            "{tags} engine tags for {n} blocks"
        )));
    }
    Ok(match chain {
        Some(parent) => chained(parent, hashes),
        None => vec![None; n],
    })
}

fn chained(
    parent: Option<BlockHash>,
    hashes: impl ExactSizeIterator<Item = BlockHash>,
) -> Vec<Option<BlockHash>> {
    let n = hashes.len();
    std::iter::once(parent)
        .chain(hashes.map(Some))
        .take(n)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_puts_chunks_keep_their_tags_within_a_commit_frame() {
        let big = Some(Arc::new(
            EngineTag::new(None, vec![7; mooncake_proto::message::MAX_TAG_TOKENS]).unwrap(),
        ));
        let untagged = vec![None; 2 * MAX_BATCH + 1];
        assert_eq!(chunk_end(&untagged, 0), MAX_BATCH);
        assert_eq!(chunk_end(&untagged, 2 * MAX_BATCH), 2 * MAX_BATCH + 1);
        let tagged = vec![big.clone(); 2000];
        let per = MAX_COMMIT_TAG_BYTES / big.as_deref().unwrap().encoded_len();
        assert_eq!(chunk_end(&tagged, 0), per);
        assert_eq!(chunk_end(&tagged, 1990), 2000);
        let total: usize = tagged[..per]
            .iter()
            .map(|t| t.as_deref().unwrap().encoded_len())
            .sum();
        assert!(total <= MAX_COMMIT_TAG_BYTES);
    }
}
