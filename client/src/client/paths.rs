//! Which data path reaches each daemon: same-host shared memory, RDMA,
//! then QUIC or TCP, as the daemon advertises and this host offers; and
//! this host's RDMA NIC and registered memory.

use super::*;

impl Client {
    /// The same-host link to the daemon at `addr`, if configured and up;
    /// (re)connects at most once a second.
    /// A link that cannot be made counts a fallback to `instead`.
    pub(super) fn shm_link(&self, addr: &str, instead: TransportKind) -> Option<Arc<ShmLink>> {
        self.shm_connect(Some(instead)).filter(|l| l.addr == addr)
    }

    /// Makes the same-host link and waits (at most `within`) until this
    /// process's view of the daemon's pool is in place, so that the first
    /// reads do not share a core with setting it up (a few seconds for a
    /// large pool of 4 KiB pages). A daemon not serving its socket yet is
    /// tried again (once a second). `false` without a link, or if time
    /// ran out. For a worker's warm-up; calls work without it.
    pub async fn same_host_ready(&self, within: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        let link = loop {
            if let Some(link) = self.shm_connect(None) {
                break link;
            }
            if self.cfg.shm_socket.is_none() || std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        while !link.populated() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        true
    }

    /// What pages this process's view of the same-host pool has, in words
    /// ("4KiB", "2MiB (reserved huge pages)", or 4 KiB with the share the
    /// kernel maps as transparent huge pages); `None` without a link.
    pub fn same_host_pages(&self) -> Option<String> {
        self.shm_connect(None).map(|link| link.pages())
    }

    /// The same-host link, made if need be (at most once a second); a
    /// failure counts a fallback to `instead`, if given.
    pub(super) fn shm_connect(&self, instead: Option<TransportKind>) -> Option<Arc<ShmLink>> {
        let path = self.cfg.shm_socket.as_ref()?;
        let mut shm = self.shm.lock();
        if shm.0.is_none() && shm.1.is_none_or(|t| t.elapsed() > SHM_RETRY) {
            shm.1 = Some(std::time::Instant::now());
            match ShmLink::connect(path, self.shm_counts.clone(), self.cfg.copy_threads) {
                Ok(link) => shm.0 = Some(Arc::new(link)),
                Err(err) => {
                    drop(shm);
                    if let Some(instead) = instead {
                        tracing::warn!(%err, path = %path.display(), "no shared-memory link; going over {instead}");
                        self.fell_back(TransportKind::Shm, instead);
                    }
                    return None;
                }
            }
        }
        shm.0.clone()
    }

    pub(super) fn learn_daemons(&self, daemons: &[DaemonAddr]) {
        if daemons.is_empty() {
            return;
        }
        {
            let known = self.daemons.read();
            if daemons
                .iter()
                .all(|d| known.get(&d.id).is_some_and(|p| p.advertised == *d))
            {
                return;
            }
        }
        let mut known = self.daemons.write();
        for d in daemons {
            if known.get(&d.id).is_none_or(|p| p.advertised != *d) {
                known.insert(d.id, Arc::new(self.reach(d)));
            }
        }
    }

    /// Chooses how to reach a daemon from what it advertised and what this
    /// client is configured for: RDMA if asked and both sides have it, then
    /// QUIC if configured (never plain TCP instead: a client that asks for
    /// QUIC does not trust the network), else TCP. Same-host shared memory
    /// comes before all of them, per call (see `shm_link`).
    pub(super) fn reach(&self, d: &DaemonAddr) -> Peer {
        let tcp = Arc::new(pool_for(&self.cfg, d.addr.clone(), ErrorSource::Daemon));
        let offered = |kind| d.endpoints.iter().find(|e| e.kind == kind);
        let data: Arc<dyn Transport> = match (&self.cfg.quic, offered(TransportKind::Quic)) {
            (Some(quic), Some(endpoint)) => Arc::new(StreamTransport {
                pool: Arc::new(
                    pool_for(&self.cfg, endpoint.addr.clone(), ErrorSource::Daemon)
                        .with_dialer(Dialer::Quic(quic.clone())),
                ),
                stripes: self.cfg.stripes,
            }),
            (Some(_), None) => Arc::new(Unreachable {
                kind: TransportKind::Quic,
                why: format!(
                    "daemon {} at {} serves no QUIC endpoint, and this client sends blocks only over QUIC",
                    d.id, d.addr
                ),
            }),
            (None, _) => Arc::new(StreamTransport {
                pool: tcp.clone(),
                stripes: self.cfg.stripes,
            }),
        };
        let rdma = if self.cfg.rdma {
            let link = match offered(TransportKind::Rdma) {
                Some(endpoint) => self.rdma_link(&endpoint.addr, &d.addr),
                None => Err("the daemon offers no RDMA endpoint".to_string()),
            };
            link.inspect_err(|why| {
                tracing::debug!(daemon = d.id, why, to = %data.kind(), "RDMA not used");
                self.fell_back(TransportKind::Rdma, data.kind());
            })
            .ok()
        } else {
            None
        };
        Peer {
            advertised: d.clone(),
            addr: d.addr.clone(),
            tcp,
            data,
            rdma,
            reading: AtomicU64::new(0),
        }
    }

    /// This host's RDMA NIC, opened on first use.
    #[cfg(feature = "rdma")]
    pub(super) fn nic(&self) -> Result<Arc<mooncake_net::rdma::Nic>, String> {
        use mooncake_net::rdma::{Nic, NicChoice};
        self.nic
            .get_or_init(|| {
                Nic::open(&NicChoice {
                    device: self.cfg.rdma_device.clone(),
                    gid_index: self.cfg.rdma_gid_index,
                })
                .inspect(|nic| tracing::info!(nic = %nic.name, "RDMA ready"))
                .inspect_err(|why| {
                    tracing::warn!(why, "RDMA unavailable; blocks go over QUIC or TCP")
                })
            })
            .clone()
    }

    /// Registers `len` bytes at `ptr`, once: the client remembers which
    /// memory they are (host or a GPU's, asked of the driver once rather
    /// than at every call), and registers host memory with this host's
    /// RDMA NIC, so that blocks read into it (`get_into`) or written from
    /// it (`put`) move by RDMA straight between it and a daemon's pool,
    /// with no copy here. True if registered with the NIC; false where
    /// this client moves blocks otherwise (`rdma` not configured, no NIC,
    /// a build without the feature, GPU memory): the memory then works as
    /// any other, through copies. GPU memory is not registered with the
    /// NIC (no GPUDirect yet): every block read is checked by this CPU
    /// where it lands, so blocks bound for GPU memory go through pinned
    /// staging (`get_into_spans`, `put_spans`; `docs/gpu.md`).
    ///
    /// # Safety
    ///
    /// The bytes must stay allocated until `unregister_memory(ptr)` and
    /// until every call using them has returned.
    pub unsafe fn register_memory(&self, ptr: *mut u8, len: usize) -> Result<bool, ClientError> {
        let memory = self.memory_of(ptr as usize);
        self.memory_ranges
            .write()
            .insert(ptr as usize, (len, memory));
        if memory != crate::device::Memory::Host {
            return Ok(false);
        }
        #[cfg(feature = "rdma")]
        if self.cfg.rdma {
            let Ok(nic) = self.nic() else {
                return Ok(false);
            };
            // SAFETY: the caller's promise above.
            unsafe { self.registered.add(&nic, ptr, len) }.map_err(ClientError::Invalid)?;
            return Ok(true);
        }
        let _ = (ptr, len);
        Ok(false)
    }

    /// Ends a registration made with `register_memory`; false if `ptr`
    /// had none.
    pub fn unregister_memory(&self, ptr: *const u8) -> bool {
        self.memory_ranges.write().remove(&(ptr as usize));
        #[cfg(feature = "rdma")]
        return self.registered.remove(ptr);
        #[cfg(not(feature = "rdma"))]
        {
            let _ = ptr;
            false
        }
    }

    /// The RDMA data path to the daemon at `addr` whose RDMA control port
    /// is `control`, through this host's NIC (opened once).
    #[cfg(feature = "rdma")]
    pub(super) fn rdma_link(
        &self,
        control: &str,
        addr: &str,
    ) -> Result<Arc<dyn Transport>, String> {
        Ok(Arc::new(crate::transport::rdma::RdmaLink::new(
            self.nic()?,
            control.to_string(),
            addr.to_string(),
            self.cfg.connect_timeout,
            self.registered.clone(),
        )))
    }

    #[cfg(not(feature = "rdma"))]
    pub(super) fn rdma_link(&self, _: &str, _: &str) -> Result<Arc<dyn Transport>, String> {
        Err("this client is built without the `rdma` feature".to_string())
    }

    pub(super) fn peer(&self, daemon: u32) -> Result<Arc<Peer>, ClientError> {
        self.daemons
            .read()
            .get(&daemon)
            .cloned()
            .ok_or_else(|| self.meta_protocol("a location named a daemon it did not list"))
    }
}
