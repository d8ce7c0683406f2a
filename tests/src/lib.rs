//! Test harness: a whole store (meta service and daemons) started in this
//! process on `127.0.0.1:0`, by the composition `mooncake-store up` uses
//! (`mooncake-local`).

use std::sync::Arc;
use std::time::Duration;

use mooncake_client::{Client, ClientConfig};
use mooncake_meta::MetaConfig;
use mooncake_proto::units::{ByteSize, HumanDuration};
use mooncake_store_daemon::DaemonConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub struct TestCluster {
    pub meta_addr: String,
    pub daemons: Vec<TestDaemon>,
    pub shutdown: CancellationToken,
    /// Presented by `client()`, when the cluster requires authentication.
    pub token: Option<Arc<str>>,
    /// How `client()` and the fake daemons reach servers that speak TLS on
    /// their TCP ports (`tls = true`). Default none: plain TCP.
    pub tls: Option<mooncake_net::ClientTls>,
}

/// A daemon of the test's store, and what stops it.
pub type TestDaemon = mooncake_local::LocalDaemon;

/// Meta settings that make timeouts observable within a test.
pub fn fast_meta() -> MetaConfig {
    MetaConfig {
        daemon_ttl: HumanDuration(Duration::from_millis(800)),
        put_timeout: HumanDuration(Duration::from_millis(500)),
        ..MetaConfig::default()
    }
}

pub fn daemon_config(dram: u64) -> DaemonConfig {
    DaemonConfig {
        dram: ByteSize(dram),
        hugepages: false,
        heartbeat_interval: HumanDuration(Duration::from_millis(100)),
        ..DaemonConfig::default()
    }
}

impl TestCluster {
    /// A meta service and one daemon with `dram` bytes of pool.
    pub async fn start(dram: u64) -> TestCluster {
        Self::start_with(fast_meta(), vec![daemon_config(dram)]).await
    }

    /// The same, its daemon evicting least recently used first: for tests
    /// of what that order promises (a block put last outlives older ones
    /// read before; 2Q, the default, keeps the read ones).
    pub async fn start_lru(dram: u64) -> TestCluster {
        let cfg = DaemonConfig {
            eviction: mooncake_store_daemon::pool::Eviction::Lru,
            ..daemon_config(dram)
        };
        Self::start_with(fast_meta(), vec![cfg]).await
    }

    pub async fn start_with(meta: MetaConfig, daemons: Vec<DaemonConfig>) -> TestCluster {
        Self::start_as(meta, daemons, None).await
    }

    /// A cluster whose own clients (`client()`, the readiness checks)
    /// present `token`, for servers that require authentication.
    pub async fn start_as(
        meta: MetaConfig,
        daemons: Vec<DaemonConfig>,
        token: Option<&str>,
    ) -> TestCluster {
        let shutdown = CancellationToken::new();
        let mut tries = 0;
        let handle = loop {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let stop = shutdown.child_token();
            let started = mooncake_local::start_meta(
                meta.clone(),
                listener,
                &prometheus::Registry::new(),
                stop.clone(),
            )
            .await;
            match started {
                Ok(handle) => break handle,
                // With QUIC the meta service binds UDP at its TCP port,
                // which a UDP socket of a test running beside this one
                // may hold: another port then.
                Err(err) if meta.quic && tries < 20 && err.to_string().contains("in use") => {
                    stop.cancel();
                    tries += 1;
                }
                Err(err) => panic!("the meta service did not start: {err}"),
            }
        };
        let mut cluster = TestCluster {
            meta_addr: handle.addr.to_string(),
            daemons: Vec::new(),
            shutdown,
            token: token.map(Arc::from),
            tls: None,
        };
        for cfg in daemons {
            cluster.add_daemon(cfg).await;
        }
        cluster
    }

    /// Starts a daemon pointed at this cluster's meta service, without
    /// waiting for it to register (nor keeping it in `daemons`).
    pub async fn launch_daemon(&self, mut cfg: DaemonConfig) -> TestDaemon {
        let stop = self.shutdown.child_token();
        cfg.meta = Some(self.meta_addr.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        TestDaemon::launch(cfg, listener, &prometheus::Registry::new(), stop)
            .await
            .unwrap()
    }

    /// Starts one more daemon and waits until the meta service lists it.
    pub async fn add_daemon(&mut self, cfg: DaemonConfig) -> usize {
        let daemon = self.launch_daemon(cfg).await;
        let addr = daemon.handle.addr;
        assert!(
            daemon.handle.registered(Duration::from_secs(10)).await,
            "daemon {addr} did not register"
        );
        self.daemons.push(daemon);
        self.daemons.len() - 1
    }

    pub fn client(&self) -> Client {
        self.client_with_timeout(Duration::from_secs(10))
    }

    pub fn client_with_timeout(&self, timeout: Duration) -> Client {
        let mut cfg = ClientConfig::new(self.meta_addr.clone()).with_timeout(timeout);
        cfg.token = self.token.clone();
        if let Some(tls) = &self.tls {
            cfg = cfg
                .with_tls(tls)
                .expect("the cluster's client certificates load");
        }
        Client::new(cfg)
    }

    /// Registers a daemon that is not one: its TCP address (and any other
    /// endpoint) is whatever the test serves there, a black hole or a peer
    /// that answers garbage.
    pub async fn register_fake_daemon(
        &self,
        addr: String,
        endpoints: Vec<mooncake_proto::transport::Endpoint>,
    ) {
        use mooncake_proto::message::{RegisterRequest, RegisterResponse};
        let dialer = match &self.tls {
            Some(tls) => mooncake_net::Dialer::Tls(Arc::new(
                mooncake_net::TlsConnector::new(tls).expect("the certificates load"),
            )),
            None => mooncake_net::Dialer::Tcp,
        };
        let mut conn = dialer
            .open(
                &self.meta_addr,
                mooncake_client::ErrorSource::Meta,
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        let _: RegisterResponse = conn
            .call(
                mooncake_proto::Opcode::Register,
                &RegisterRequest {
                    node: "fake".into(),
                    addr,
                    capacity: 1 << 40,
                    id_hint: 0,
                    endpoints,
                    requires_auth: false,
                },
                "register",
            )
            .await
            .unwrap();
    }

    pub fn daemon_addr(&self, i: usize) -> String {
        self.daemons[i].handle.addr.to_string()
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Deterministic block contents: every byte depends on the seed and the
/// position, so a block swapped with another or shifted never verifies.
pub fn block_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Polls `check` every 20 ms until it holds or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
