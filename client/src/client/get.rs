//! Gets: locations from the cache or the meta service, then each daemon
//! read in parallel straight into the caller's buffers, every block
//! checked. Of a block's copies the best is read (this host's, else the
//! least busy daemon's); a copy that fails (gone, unreachable, corrupt)
//! costs one more read of the next copy, a stale location one more lookup,
//! all within the call's deadline. A corrupt copy is reported.

use super::*;
use mooncake_proto::message::Tier;

impl Client {
    /// Reads blocks straight into the caller's buffers, one per hash. Every
    /// hit has been verified against the writer's checksum.
    pub async fn get_into(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        let mut dests: Vec<Dest<'_>> = bufs.iter_mut().map(|b| Dest::One(b)).collect();
        self.get_into_pieces(namespace, hashes, &mut dests).await
    }

    /// `get_into`, each block landing in its destination's pieces in
    /// order (`Dest::Pieces`: a page's K and V apart, or one piece per
    /// layer), straight from the transport: no staging copy.
    pub async fn get_into_pieces(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        bufs: &mut [Dest<'_>],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        if hashes.len() != bufs.len() {
            return Err(ClientError::Invalid(format!(
                "{} hashes but {} buffers",
                hashes.len(),
                bufs.len()
            )));
        }
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(hashes.len());
        for (hs, bs) in hashes.chunks(MAX_BATCH).zip(bufs.chunks_mut(MAX_BATCH)) {
            out.extend(
                self.deadline("get", self.get_chunk(namespace, hs, bs))
                    .await?,
            );
        }
        if let Some(m) = &self.cfg.metrics {
            m.gets(started.elapsed().as_secs_f64(), &out);
        }
        Ok(out)
    }

    /// Reads one block into a new buffer; `None` on a miss.
    pub async fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, ClientError> {
        // The buffer is sized from the location; a cached one may describe
        // a block since replaced by a larger one: then ask the index again.
        for cached in [true, false] {
            let location = match self.locations.get(key).filter(|_| cached) {
                Some(loc) => loc,
                None => match self
                    .lookup(&key.namespace, &[key.hash])
                    .await?
                    .items
                    .first()
                {
                    Some(Some(loc)) => *loc,
                    _ => return Ok(None),
                },
            };
            let mut buf = vec![0u8; location.size as usize];
            match self
                .get_into(&key.namespace, &[key.hash], &mut [&mut buf[..]])
                .await?[0]
            {
                GetOutcome::Hit(n) => {
                    buf.truncate(n);
                    return Ok(Some(buf));
                }
                GetOutcome::Miss => return Ok(None),
                GetOutcome::Failed(ErrorCode::TooLarge) if cached => {
                    self.locations.forget(key);
                }
                GetOutcome::Failed(code) => {
                    let first = location.daemons.first().unwrap_or_default();
                    let addr = self.peer(first).map(|p| p.addr.clone());
                    return Err(ClientError::Server {
                        side: ErrorSource::Daemon,
                        addr: addr.unwrap_or_default(),
                        op: "get",
                        code,
                    });
                }
            }
        }
        unreachable!("the second pass returns")
    }

    pub(super) async fn get_chunk(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        bufs: &mut [Dest<'_>],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        let mut locations: Vec<Option<Location>> = hashes
            .iter()
            .map(|h| self.locations.get(&BlockKey::new(namespace.clone(), *h)))
            .collect();
        let mut from_cache: Vec<bool> = locations.iter().map(Option::is_some).collect();
        let unknown: Vec<usize> = (0..hashes.len()).filter(|i| !from_cache[*i]).collect();
        self.locate(namespace, hashes, &unknown, &mut locations)
            .await?;

        let mut outcomes = vec![GetOutcome::Miss; hashes.len()];
        // Each round reads every block still wanted from a copy not tried
        // yet; a block runs out of copies at most once per location (a
        // cached one is then looked up again), so rounds are bounded.
        let mut tried = vec![Copies::default(); hashes.len()];
        let mut wanted: Vec<usize> = (0..hashes.len()).collect();
        while !wanted.is_empty() {
            let reads = self
                .read_located(namespace, hashes, &locations, &mut tried, bufs, &wanted)
                .await;
            let mut next = Vec::new();
            let mut relocate = Vec::new();
            for (index, read) in reads {
                // An unreachable daemon too: the block may live on another
                // copy, or elsewhere now, or nowhere (a miss).
                let retry = matches!(
                    read,
                    Read::Stale
                        | Read::Missing
                        | Read::Corrupt
                        | Read::Failed(ErrorCode::Unavailable | ErrorCode::Timeout)
                );
                let untried = locations[index]
                    .is_some_and(|l| l.daemons.iter().any(|d| !tried[index].contains(d)));
                if retry && untried {
                    next.push(index);
                } else if retry && from_cache[index] {
                    // A hint from the cache that no copy backs is asked
                    // about once more, at the meta service.
                    self.locations
                        .forget(&BlockKey::new(namespace.clone(), hashes[index]));
                    from_cache[index] = false;
                    tried[index] = Copies::default();
                    relocate.push(index);
                } else {
                    outcomes[index] = read.outcome();
                }
            }
            if !relocate.is_empty() {
                self.locate(namespace, hashes, &relocate, &mut locations)
                    .await?;
                next.extend(relocate);
            }
            next.sort_unstable();
            wanted = next;
        }
        Ok(outcomes)
    }

    /// Of a block's copies not tried yet, the one to read: on this host
    /// (shared memory, no network), else one in a daemon's DRAM before one
    /// on NVMe only, then on the daemon with the fewest bytes of this
    /// client's reads in flight, a draw among equals (so that one reader
    /// too spreads over the copies); a daemon this client has not been
    /// told of comes last.
    fn best_copy(&self, location: &Location, tried: &Copies) -> Option<u32> {
        let peers = self.daemons.read();
        location
            .daemons
            .with_tiers()
            .filter(|(d, _)| !tried.contains(*d))
            .min_by_key(|(d, tier)| match peers.get(d) {
                Some(p) => (
                    p.advertised.node != self.cfg.node,
                    *tier == Tier::Nvme,
                    p.reading.load(Ordering::Relaxed),
                    rand::random::<u16>(),
                ),
                None => (true, true, u64::MAX, 0),
            })
            .map(|(d, _)| d)
    }

    /// Fills `locations[i]` for each index in `which` with one meta lookup.
    pub(super) async fn locate(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        which: &[usize],
        locations: &mut [Option<Location>],
    ) -> Result<(), ClientError> {
        if which.is_empty() {
            return Ok(());
        }
        let wanted: Vec<BlockHash> = which.iter().map(|i| hashes[*i]).collect();
        let found = self.lookup_raw(namespace, &wanted).await?;
        if found.items.len() != wanted.len() {
            return Err(self.meta_protocol("lookup answered a different number of items"));
        }
        self.learn_daemons(&found.daemons);
        for (index, loc) in which.iter().zip(found.items) {
            if let Some(loc) = loc {
                self.locations
                    .insert(BlockKey::new(namespace.clone(), hashes[*index]), loc);
            }
            locations[*index] = loc;
        }
        Ok(())
    }

    /// Reads every wanted block that has a location from its best copy not
    /// tried yet (which it marks tried), all daemons in parallel; returns
    /// what each read found.
    async fn read_located(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        locations: &[Option<Location>],
        tried: &mut [Copies],
        bufs: &mut [Dest<'_>],
        wanted: &[usize],
    ) -> Vec<(usize, Read)> {
        let mut results = Vec::new();
        let mut by_daemon: HashMap<u32, Vec<GetItem<'_>>> = HashMap::new();
        let mut want = wanted.iter().peekable();
        for (index, buf) in bufs.iter_mut().enumerate() {
            if want.next_if_eq(&&index).is_none() {
                continue;
            }
            let Some(location) = locations[index] else {
                results.push((index, Read::Missing));
                continue;
            };
            if (location.size as usize) > buf.len() {
                results.push((index, Read::Failed(ErrorCode::TooLarge)));
                continue;
            }
            let Some(daemon) = self.best_copy(&location, &tried[index]) else {
                results.push((index, Read::Missing));
                continue;
            };
            tried[index].push(daemon);
            by_daemon.entry(daemon).or_default().push(GetItem {
                index,
                hash: hashes[index],
                location,
                buf: buf.reborrow(),
            });
        }
        let reads = by_daemon.into_iter().map(|(daemon, mut items)| async move {
            let result = self.get_on_daemon(daemon, namespace, &mut items).await;
            let indexes: Vec<usize> = items.iter().map(|it| it.index).collect();
            (indexes, result)
        });
        for (indexes, result) in join_all(reads).await {
            match result {
                Ok(got) => results.extend(indexes.into_iter().zip(got)),
                Err(err) => {
                    tracing::warn!(%err, "get from daemon failed");
                    let code = err.code().unwrap_or(ErrorCode::Unavailable);
                    results.extend(indexes.into_iter().map(|i| (i, Read::Failed(code))));
                }
            }
        }
        results
    }

    pub(super) async fn get_on_daemon(
        &self,
        daemon: u32,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Read>, ClientError> {
        let peer = self.peer(daemon)?;
        let bytes = items.iter().map(|it| u64::from(it.location.size)).sum();
        let _reading = Reading::start(&peer, bytes);
        let mut reads = None;
        if let Some(link) = self.shm_link(&peer.addr, peer.data.kind()) {
            match link.get(namespace, items).await {
                Ok(got) => {
                    self.transports.read(TransportKind::Shm, hits(&got));
                    reads = Some(got);
                }
                Err(err) => self.shm_lost(&err, peer.data.kind()),
            }
        }
        if let (None, Some(rdma)) = (&reads, &peer.rdma) {
            match rdma.get(namespace, items).await {
                Ok(got) => {
                    self.transports.read(TransportKind::Rdma, hits(&got));
                    reads = Some(got);
                }
                Err(err) => self.rdma_failed(&err, peer.data.kind()),
            }
        }
        let reads = match reads {
            // Blocks not in the daemon's DRAM (on NVMe) come over the network.
            Some(mut reads) => {
                let rest: Vec<usize> = (0..reads.len())
                    .filter(|i| matches!(reads[*i], Read::Missing))
                    .collect();
                if !rest.is_empty() {
                    let mut again: Vec<GetItem<'_>> = items
                        .iter_mut()
                        .enumerate()
                        .filter(|(i, _)| rest.contains(i))
                        .map(|(_, it)| GetItem {
                            index: it.index,
                            hash: it.hash,
                            location: it.location,
                            buf: it.buf.reborrow(),
                        })
                        .collect();
                    let got = peer.data.get(namespace, &mut again).await?;
                    self.transports.read(peer.data.kind(), hits(&got));
                    for (i, read) in rest.into_iter().zip(got) {
                        reads[i] = read;
                    }
                }
                reads
            }
            None => {
                let got = peer.data.get(namespace, items).await?;
                self.transports.read(peer.data.kind(), hits(&got));
                got
            }
        };
        for (item, read) in items.iter().zip(&reads) {
            if matches!(read, Read::Corrupt) {
                self.report_corrupt(&peer.tcp, BlockKey::new(namespace.clone(), item.hash));
            }
        }
        Ok(reads)
    }

    /// The same-host link failed: drop it (it is tried again a second
    /// later) and go over the network meanwhile.
    pub(super) fn shm_lost(&self, err: &ClientError, to: TransportKind) {
        tracing::warn!(%err, "shared-memory link lost; going over {to}");
        *self.shm.lock() = (None, Some(std::time::Instant::now()));
        self.fell_back(TransportKind::Shm, to);
    }

    /// An RDMA call failed: this one goes over the network path instead
    /// (the link itself waits a second before trying RDMA again).
    pub(super) fn rdma_failed(&self, err: &ClientError, to: TransportKind) {
        tracing::warn!(%err, "RDMA call failed; going over {to}");
        self.fell_back(TransportKind::Rdma, to);
    }

    /// Counts a fallback from `from` to `to`.
    pub(super) fn fell_back(&self, from: TransportKind, to: TransportKind) {
        self.transports.fell_back(from, to);
        if let Some(m) = &self.cfg.metrics {
            m.fell_back(from, to);
        }
    }

    /// Bytes that failed their checksum: counted, logged, and reported to
    /// the daemon, which checks its copy and drops it if it is the culprit.
    pub(super) fn report_corrupt(&self, pool: &Arc<ConnPool>, key: BlockKey) {
        self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        if let Some(m) = &self.cfg.metrics {
            m.corrupt.inc();
        }
        tracing::warn!(%key, daemon = pool.addr(), "block failed its checksum on read; treated as a miss");
        let pool = pool.clone();
        let timeout = self.cfg.timeout;
        tokio::spawn(async move {
            let verify = async {
                let (mut conn, _) = pool.get().await?;
                let result = conn
                    .call::<Empty>(Opcode::Verify, &KeyRequest { key }, "verify")
                    .await;
                if matches!(result, Ok(_) | Err(ClientError::Server { .. })) {
                    pool.put_back(conn);
                }
                result
            };
            let _ = tokio::time::timeout(timeout, verify).await;
        });
    }
}

/// Counts a read's bytes as in flight to its daemon until dropped.
struct Reading<'a> {
    peer: &'a Peer,
    bytes: u64,
}

impl<'a> Reading<'a> {
    fn start(peer: &'a Peer, bytes: u64) -> Self {
        peer.reading.fetch_add(bytes, Ordering::Relaxed);
        Reading { peer, bytes }
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.peer.reading.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}
