//! What a client is configured with: where the meta service is, the
//! deadlines, the token, and which data paths it may use.

use super::*;

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("meta_addr", &self.meta_addr)
            .field("follows_leader", &self.resolver.is_some())
            .field("metrics", &self.metrics.is_some())
            .field("timeout", &self.timeout)
            .field("tls", &self.tls.is_some())
            .field("quic", &self.quic.is_some())
            .field("rdma", &self.rdma)
            .field("device", &self.device)
            .finish()
    }
}

/// How a client reaches the cluster and how long it waits.
#[derive(Clone)]
pub struct ClientConfig {
    /// The meta service's address, e.g. `127.0.0.1:7070` (the first one to
    /// try, when a resolver is set).
    pub meta_addr: String,
    /// Finds the current meta leader when the meta service is unreachable
    /// (e.g. through etcd); without one the client keeps `meta_addr`.
    pub resolver: Option<Arc<dyn MetaResolver>>,
    /// Client-side metrics, in a registry the application exposes. Default
    /// none.
    pub metrics: Option<Arc<ClientMetrics>>,
    /// This host's name, as its daemon registers it: new blocks go to the
    /// daemon on the same host first. Default: the hostname.
    pub node: String,
    /// Deadline of every call, end to end. Default 5s.
    pub timeout: Duration,
    /// Deadline of opening one connection. Default 1s.
    pub connect_timeout: Duration,
    /// Idle connections kept per peer. Default 64.
    pub max_idle_per_peer: usize,
    /// Block locations remembered, so that gets of known blocks skip the
    /// meta lookup (0 disables). Default 1M (about 100 MiB at most).
    pub location_cache: usize,
    /// How long a location this client reads often is used before it is
    /// looked up again (how soon a reader finds the copies added to a hot
    /// block); a block read now and then keeps its location. Default 2s.
    pub location_ttl: Duration,
    /// Token presented to servers that require authentication (its tenant
    /// decides which namespaces this client may use). Default none.
    pub token: Option<Arc<str>>,
    /// The Unix socket of the daemon on this host (its `shm_socket`): its
    /// blocks are then copied straight out of its shared pool. Default
    /// none.
    pub shm_socket: Option<std::path::PathBuf>,
    /// Threads that copy one large same-host batch (8 MiB or more) out of
    /// the shared pool side by side: one core copies and checks about
    /// 7 GB/s. Default a quarter of the cores, 1 to 8.
    pub copy_threads: usize,
    /// Speaks TLS on every TCP connection, to the meta service and to the
    /// daemons, with these settings (see [`ClientConfig::with_tls`]): for
    /// clusters whose servers run with `tls = true`. Default none.
    pub tls: Option<Arc<TlsConnector>>,
    /// Talks to the meta service and moves blocks over QUIC with these TLS
    /// settings (see [`ClientConfig::with_quic`]); daemons that serve no
    /// QUIC are refused, never reached over plain TCP. Default none: TCP.
    pub quic: Option<Arc<QuicConnector>>,
    /// Moves blocks over RDMA (one-sided reads and writes of the daemon's
    /// pool) to daemons that serve it, when this host has an RDMA NIC and
    /// the client is built with the `rdma` feature. Otherwise, and for
    /// blocks a daemon holds only on NVMe, blocks go over QUIC or TCP, and
    /// each fallback is counted. Default false.
    pub rdma: bool,
    /// The RDMA NIC to use (e.g. `mlx5_0`). Default: the first with an
    /// active port.
    pub rdma_device: Option<String>,
    /// The GID index to use on it. Default: its first routable RoCE v2
    /// GID (InfiniBand: 0).
    pub rdma_gid_index: Option<u32>,
    /// Most connections (or QUIC streams) one large batch to one daemon is
    /// spread over, 1 MiB or more each. Default 4; 1 keeps every batch on
    /// one connection.
    pub stripes: usize,
    /// Copies of each block a put stores, on distinct hosts, unless the
    /// call asks for its own number (`PutOptions`). From 1 to 4; default
    /// 0: the meta service's default for the namespace (1 unless its
    /// `[meta.replicas]` says otherwise).
    pub replicas: u8,
    /// Which GPU support moves blocks to and from device memory. Default
    /// NVIDIA's CUDA driver where the host has one; without it every
    /// address is host memory.
    pub device: crate::device::DeviceChoice,
    /// Pinned bytes of each of a call's two staging buffers for GPU
    /// memory: a batch goes up (or down) in chunks of this much, each
    /// copied while the next is read (or put). Default 32 MiB.
    pub device_staging: usize,
}

impl ClientConfig {
    pub fn new(meta_addr: impl Into<String>) -> Self {
        ClientConfig {
            meta_addr: meta_addr.into(),
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
            max_idle_per_peer: 64,
            location_cache: 1 << 20,
            location_ttl: Duration::from_secs(2),
            resolver: None,
            metrics: None,
            node: hostname(),
            token: None,
            shm_socket: None,
            copy_threads: (std::thread::available_parallelism().map_or(1, |n| n.get()) / 4)
                .clamp(1, 8),
            tls: None,
            quic: None,
            rdma: false,
            rdma_device: None,
            rdma_gid_index: None,
            stripes: 4,
            replicas: 0,
            device: Default::default(),
            device_staging: 32 << 20,
        }
    }

    /// Authenticates with `token` (see `docs/security.md`).
    pub fn with_token(mut self, token: impl Into<Arc<str>>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Records latency, hits and misses in `registry` (which the
    /// application serves on its own /metrics).
    pub fn with_metrics(mut self, registry: &prometheus::Registry) -> prometheus::Result<Self> {
        self.metrics = Some(ClientMetrics::new(registry)?);
        Ok(self)
    }

    /// Follows the meta leader through `resolver`, starting from the
    /// address it names now.
    pub async fn with_resolver(
        mut self,
        resolver: Arc<dyn MetaResolver>,
    ) -> Result<Self, ClientError> {
        self.meta_addr = resolver.resolve().await.map_err(ClientError::NoLeader)?;
        self.resolver = Some(resolver);
        Ok(self)
    }

    /// Speaks TLS on every TCP connection, trusting servers whose
    /// certificates `tls.ca` signed (and presenting `tls.identity` for
    /// mutual TLS). Fails, in one line naming the file, if a certificate or
    /// key does not load.
    pub fn with_tls(mut self, tls: &ClientTls) -> Result<Self, ClientError> {
        let connector =
            TlsConnector::new(tls).map_err(|err| ClientError::Invalid(err.to_string()))?;
        self.tls = Some(Arc::new(connector));
        Ok(self)
    }

    /// How this client opens a TCP connection: with TLS when configured.
    pub fn tcp_dialer(&self) -> Dialer {
        match &self.tls {
            Some(tls) => Dialer::Tls(tls.clone()),
            None => Dialer::Tcp,
        }
    }

    /// Sends blocks over QUIC, trusting daemons whose certificates `tls.ca`
    /// signed (and presenting `tls.identity` for mutual TLS). Fails, in
    /// one line naming the file, if a certificate or key does not load.
    pub fn with_quic(mut self, tls: &ClientTls) -> Result<Self, ClientError> {
        let connector =
            QuicConnector::new(tls).map_err(|err| ClientError::Invalid(err.to_string()))?;
        self.quic = Some(Arc::new(connector));
        Ok(self)
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A connection pool to `addr` with the client's limits and token, over
/// TLS when the client is set up for it. A client set up for QUIC reaches
/// the meta service over QUIC too (UDP, at the meta address), so that keys
/// and tokens never travel in clear.
pub(super) fn pool_for(cfg: &ClientConfig, addr: String, side: ErrorSource) -> ConnPool {
    let pool = ConnPool::new(addr, side, cfg.connect_timeout, cfg.max_idle_per_peer)
        .with_token(cfg.token.clone());
    match (&cfg.quic, side) {
        (Some(quic), ErrorSource::Meta) => pool.with_dialer(Dialer::Quic(quic.clone())),
        _ => pool.with_dialer(cfg.tcp_dialer()),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_debug_form_never_shows_the_token() {
        let cfg = ClientConfig::new("10.0.0.1:7070").with_token("s3cret-token");
        let shown = format!("{cfg:?}");
        assert!(shown.contains("10.0.0.1:7070"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    #[tokio::test]
    async fn a_resolver_is_any_function_and_names_the_first_address() {
        let resolver = || -> futures::future::BoxFuture<'static, Result<String, String>> {
            Box::pin(async { Ok("10.0.0.9:7070".to_string()) })
        };
        let cfg = ClientConfig::new("unused:1")
            .with_resolver(Arc::new(resolver))
            .await
            .unwrap();
        assert_eq!(cfg.meta_addr, "10.0.0.9:7070");
        assert!(cfg.resolver.is_some());
        let failing = || -> futures::future::BoxFuture<'static, Result<String, String>> {
            Box::pin(async { Err("no meta leader is elected".to_string()) })
        };
        let err = ClientConfig::new("unused:1")
            .with_resolver(Arc::new(failing))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::NoLeader(_)), "{err}");
        assert!(err.is_retryable());
    }

    #[test]
    fn meta_calls_go_over_quic_when_the_client_does_and_daemons_stay_on_their_own_dialer() {
        let dir = std::env::temp_dir().join(format!("mc-client-cfg-{}", std::process::id()));
        let certs = mooncake_net::DevCerts::generate(&["127.0.0.1".into()], "client").unwrap();
        certs.write(&dir).unwrap();
        let cfg = ClientConfig::new("127.0.0.1:7070")
            .with_quic(&mooncake_net::DevCerts::client_tls(&dir, false))
            .unwrap();
        let meta = pool_for(&cfg, cfg.meta_addr.clone(), ErrorSource::Meta);
        assert_eq!(meta.kind(), TransportKind::Quic);
        let daemon = pool_for(&cfg, "127.0.0.1:7071".into(), ErrorSource::Daemon);
        assert_eq!(daemon.kind(), TransportKind::Tcp);
        let plain = ClientConfig::new("127.0.0.1:7070");
        let meta = pool_for(&plain, plain.meta_addr.clone(), ErrorSource::Meta);
        assert_eq!(meta.kind(), TransportKind::Tcp);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
