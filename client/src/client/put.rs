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
        let replicas = self.copies_of(opts)?;
        let implied = self.lineage.fill(
            namespace,
            blocks.iter().map(|(h, _)| *h),
            parents,
            opts.in_order,
        );
        let parents = implied.as_deref().unwrap_or(parents);
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

    /// The copies a put with `opts` asks; refused past `MAX_COPIES`.
    pub(super) fn copies_of(&self, opts: PutOptions) -> Result<u8, ClientError> {
        let replicas = match opts.replicas {
            0 => self.cfg.replicas,
            n => n,
        };
        if usize::from(replicas) > MAX_COPIES {
            return Err(ClientError::Invalid(format!(
                "{replicas} copies asked; at most {MAX_COPIES}"
            )));
        }
        Ok(replicas)
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
        named: (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        replicas: u8,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        sizes_of(blocks.iter().map(|(h, v)| (*h, v.len())))?;
        // Same host: the leading blocks admitted in one round trip.
        let admitted = self.admit_here(namespace, blocks, named, replicas).await;
        let rest: Vec<usize> = (0..blocks.len())
            .filter(|&i| admitted[i].is_none())
            .collect();
        if rest.len() == blocks.len() {
            return self.put_placed(namespace, blocks, named, replicas).await;
        }
        let mut out: Vec<PutOutcome> = admitted
            .iter()
            .map(|a| a.unwrap_or(PutOutcome::Failed(ErrorCode::Internal)))
            .collect();
        if !rest.is_empty() {
            let blocks: Vec<_> = rest.iter().map(|&i| blocks[i]).collect();
            let parents: Vec<_> = rest.iter().map(|&i| named.0[i]).collect();
            let tags: Vec<_> = rest.iter().map(|&i| named.1[i].clone()).collect();
            let placed = self
                .put_placed(namespace, &blocks, (&parents, &tags), replicas)
                .await?;
            for (i, outcome) in rest.into_iter().zip(placed) {
                out[i] = outcome;
            }
        }
        Ok(out)
    }

    /// Puts `blocks` as the meta service places them (reserved, written to
    /// their daemons, committed).
    async fn put_placed(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, Value<'_>)],
        named: (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        replicas: u8,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let sizes = sizes_of(blocks.iter().map(|(h, v)| (*h, v.len())))?;
        let slots = self.place(namespace, &sizes, named.0, replicas).await?;
        let mut by_daemon: HashMap<u32, Vec<PutItem<'_>>> = HashMap::new();
        for (index, (slot, (hash, value))) in slots.iter().zip(blocks).enumerate() {
            if let Slot::Place { copies, continues } = slot {
                // A block with one copy is hashed by its transport: on
                // the same host in the pass that copies it into the
                // pool. One with several is hashed once, here, so that
                // every copy is checked against the same checksum.
                let checksum = (copies.len() > 1).then(|| value.checksum());
                let item = PutItem {
                    index,
                    hash: *hash,
                    value: *value,
                    checksum,
                    parent: named.0[index],
                    continues: *continues,
                    tag: named.1[index].clone(),
                };
                for daemon in copies.iter() {
                    by_daemon.entry(daemon).or_default().push(item.clone());
                }
            }
        }
        let writes = by_daemon.into_iter().map(|(daemon, items)| async move {
            let result = self.put_on_daemon(daemon, namespace, &items).await;
            (daemon, items, result)
        });
        let mut wrote = Wrote::new(blocks.len());
        for (daemon, items, result) in join_all(writes).await {
            let given: Vec<_> = items.iter().map(|it| (it.index, it.checksum)).collect();
            wrote.record(daemon, &given, result);
        }
        self.settle(namespace, &sizes, &slots, wrote, named, replicas)
            .await
    }

    /// Phase one of a put: a place for each block (`sizes`: hash and
    /// length; `parents`: the block each extends) on `replicas` daemons,
    /// from the meta service.
    pub(super) async fn place(
        &self,
        namespace: &Namespace,
        sizes: &[(BlockHash, u32)],
        parents: &[Option<BlockHash>],
        replicas: u8,
    ) -> Result<Vec<Slot>, ClientError> {
        let items = sizes
            .iter()
            .zip(parents)
            .map(|(&(hash, size), &parent)| ToPlace { hash, size, parent })
            .collect();
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
        Ok(slots)
    }

    /// Phase two: each block's outcome from its place (`slots`) and what
    /// its daemons did (`wrote`), and the blocks stored made visible at
    /// the meta service (a place that nothing was written to given up).
    pub(super) async fn settle(
        &self,
        namespace: &Namespace,
        sizes: &[(BlockHash, u32)],
        slots: &[Slot],
        wrote: Wrote,
        (parents, tags): (&[Option<BlockHash>], &[Option<Arc<EngineTag>>]),
        replicas: u8,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let mut outcomes = vec![PutOutcome::Failed(ErrorCode::Internal); sizes.len()];
        for (index, slot) in slots.iter().enumerate() {
            match slot {
                Slot::Place { .. } => {}
                Slot::Skip(ErrorCode::AlreadyExists) => outcomes[index] = PutOutcome::AlreadyExists,
                Slot::Skip(code) => outcomes[index] = PutOutcome::Failed(*code),
            }
        }
        let Wrote { stored_on, sums } = wrote;
        // Committed in the batch's order, so that a chain's blocks appear
        // (and are published to event subscribers) parent first.
        let mut stored_on: Vec<_> = stored_on.into_iter().collect();
        stored_on.sort_unstable_by_key(|(index, _)| *index);
        let mut commits = Vec::with_capacity(stored_on.len());
        for (index, (copies, refused)) in &stored_on {
            let (hash, size) = sizes[*index];
            outcomes[*index] = match (refused, copies.len()) {
                (Some(code), 0) => PutOutcome::Failed(*code),
                (Some(_), n) => PutOutcome::Short { copies: n as u8 },
                (None, _) => PutOutcome::Stored,
            };
            commits.push(CommitItem {
                hash,
                stored_on: *copies,
                size,
                checksum: sums[*index],
                parent: parents[*index],
                tag: tags[*index].clone(),
            });
        }
        // Fewer placed than asked (too few hosts with room): short too.
        for (index, slot) in slots.iter().enumerate() {
            if let (Slot::Place { copies, .. }, PutOutcome::Stored) = (slot, outcomes[index]) {
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
                let index = sizes
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
    ) -> Result<Vec<Written>, ClientError> {
        let peer = self.peer(daemon)?;
        if let Some(link) = self.shm_link(&peer.addr, peer.data.kind()) {
            match link.put(namespace, items).await {
                Ok(written) => {
                    self.transports.wrote(TransportKind::Shm, stored(&written));
                    return Ok(written);
                }
                Err(err) => self.shm_lost(&err, peer.data.kind()),
            }
        }
        if let Some(rdma) = &peer.rdma {
            match rdma.put(namespace, items).await {
                Ok(written) => {
                    self.transports.wrote(TransportKind::Rdma, stored(&written));
                    return Ok(written);
                }
                Err(err) => self.rdma_failed(&err, peer.data.kind()),
            }
        }
        let written = peer.data.put(namespace, items).await?;
        self.transports.wrote(peer.data.kind(), stored(&written));
        Ok(written)
    }
}

/// What the daemons did with a put's blocks, by the block's index: the
/// daemons that stored it and the first refusal of one that did not, and
/// the checksum it was stored under.
pub(super) struct Wrote {
    stored_on: HashMap<usize, (Copies, Option<ErrorCode>)>,
    sums: Vec<u64>,
}

impl Wrote {
    pub(super) fn new(blocks: usize) -> Wrote {
        Wrote {
            stored_on: HashMap::new(),
            sums: vec![0; blocks],
        }
    }

    /// What `daemon` did with the blocks `given` (index, and the checksum
    /// the writer gave, if it gave one): `result`, a status each.
    pub(super) fn record(
        &mut self,
        daemon: u32,
        given: &[(usize, Option<u64>)],
        result: Result<Vec<Written>, ClientError>,
    ) {
        let written = match result {
            Ok(written) => written,
            Err(err) => {
                tracing::warn!(daemon, %err, "put to daemon failed");
                let code = err.code().unwrap_or(ErrorCode::Unavailable);
                vec![Written { code, checksum: 0 }; given.len()]
            }
        };
        for (&(index, checksum), w) in given.iter().zip(written) {
            let (copies, refused) = self.stored_on.entry(index).or_default();
            // A daemon that already holds the key has complete, verified
            // bytes for it: committing makes them visible.
            if matches!(w.code, ErrorCode::Ok | ErrorCode::AlreadyExists) {
                copies.push(daemon);
                self.sums[index] = checksum.unwrap_or(w.checksum);
            } else {
                refused.get_or_insert(w.code);
            }
        }
    }

    /// Block `index` was not written: its place is given up.
    pub(super) fn not_written(&mut self, index: usize, code: ErrorCode) {
        self.stored_on
            .entry(index)
            .or_default()
            .1
            .get_or_insert(code);
    }
}

/// Each block's hash and length, refused past 4 GiB.
pub(super) fn sizes_of(
    blocks: impl Iterator<Item = (BlockHash, usize)>,
) -> Result<Vec<(BlockHash, u32)>, ClientError> {
    blocks
        .map(|(hash, len)| {
            let size = u32::try_from(len)
                .map_err(|_| ClientError::Invalid(format!("block {hash} is over 4 GiB")))?;
            Ok((hash, size))
        })
        .collect()
}

/// Where the put's chunk that starts at `start` ends: at most `MAX_BATCH`
/// blocks, and at most `MAX_COMMIT_TAG_BYTES` of engine tags (at least one
/// block), so that its commit fits a control frame.
pub(super) fn chunk_end(tags: &[Option<Arc<EngineTag>>], start: usize) -> usize {
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
