//! The serving roles: `up` (meta service and daemon in one process, the
//! single-host default), `meta` and `daemon`. Each runs until SIGINT or
//! SIGTERM, then stops in order: stop accepting, finish requests, leave the
//! coordinator, exit. With `--etcd`, `meta` is one replica of several (one
//! leads, the others stand by) and `daemon` follows whoever leads.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use mooncake_coord::{Coordinator, EtcdConfig, EtcdCoordinator, MemberKind};
use mooncake_local::{LocalError, LocalStore};
use mooncake_meta::MetaError;
use mooncake_proto::units::{parse_duration, ByteSize, HumanDuration};
use mooncake_store_daemon::DaemonError;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::FileConfig;
use crate::exit::Failure;
use mooncake_server::admin::{self, Health, Views};

/// How long a graceful stop may take before the process exits anyway.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long `up` waits for its daemon to register before it says it is up.
const REGISTER_WITHIN: Duration = Duration::from_secs(10);

/// How to reach etcd, for the roles that can use it.
#[derive(clap::Args, Debug, Clone)]
pub struct EtcdArgs {
    /// etcd endpoints, comma separated (e.g. http://127.0.0.1:2379).
    /// Without it, a single meta service is the leader.
    #[arg(long, env = "MOONCAKE_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Lease TTL in etcd: a leader or daemon gone this long is replaced or
    /// dropped. Whole seconds.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// How long to wait at start for an etcd that does not answer yet
    /// (started at the same time, or restarting) before giving up with
    /// exit code 3.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub etcd_wait: Duration,
}

impl EtcdArgs {
    pub async fn connect(&self) -> Result<Option<Arc<EtcdCoordinator>>, Failure> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let cfg = EtcdConfig {
            ttl: self.lease_ttl,
            wait: self.etcd_wait,
            ..EtcdConfig::new(self.etcd.clone())
        };
        let coordinator = EtcdCoordinator::connect(cfg).await.map_err(|e| {
            Failure::connection(format!("{e} (is etcd running at {:?}?)", self.etcd))
        })?;
        Ok(Some(coordinator))
    }
}

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// TOML config file with [meta] and [daemon] tables.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Meta service address (clients connect here).
    #[arg(long)]
    meta_listen: Option<String>,
    /// Daemon data address.
    #[arg(long)]
    listen: Option<String>,
    /// DRAM pool size, e.g. 8GiB.
    #[arg(long)]
    dram: Option<ByteSize>,
    /// NVMe drive behind DRAM: PATH:SIZE (a file or device), e.g.
    /// /mnt/nvme0/mc.bin:200GiB; repeat for several drives.
    #[arg(long)]
    nvme: Vec<String>,
    /// Serve clients on this host through shared memory, on this Unix
    /// socket (not with --auth).
    #[arg(long)]
    shm_socket: Option<PathBuf>,
    #[command(flatten)]
    quic: QuicArgs,
    #[command(flatten)]
    rdma: RdmaArgs,
    #[command(flatten)]
    events: EventsArgs,
    /// Admin address (/metrics, /health) of the process; "" for none.
    #[arg(long)]
    admin: Option<String>,
}

/// Store events for routers (docs/events.md).
#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// Publish store events (vLLM's KV-event format, ZeroMQ PUB) on this
    /// address, e.g. 127.0.0.1:5557.
    #[arg(long)]
    events: Option<String>,
    /// Answer event replay requests (ZeroMQ ROUTER) on this address, e.g.
    /// 127.0.0.1:5558; needs --events.
    #[arg(long)]
    events_replay: Option<String>,
}

impl EventsArgs {
    fn apply(self, cfg: &mut mooncake_meta::MetaConfig) {
        if let Some(a) = self.events {
            cfg.events_listen = a;
        }
        if let Some(a) = self.events_replay {
            cfg.events_replay_listen = a;
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct MetaArgs {
    /// Admin address (/metrics, /health); "" for none.
    #[arg(long)]
    admin: Option<String>,
    /// Token file: require a token on every connection (docs/security.md).
    #[arg(long)]
    auth: Option<PathBuf>,
    /// This replica's token (role cluster), for daemons that require one.
    #[arg(long, env = "MOONCAKE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[arg(long)]
    config: Option<PathBuf>,
    /// Control address.
    #[arg(long)]
    listen: Option<String>,
    /// Address clients and daemons should use, when it differs from --listen.
    #[arg(long)]
    advertise: Option<String>,
    /// Serve clients over QUIC too, on UDP at the --listen address; needs
    /// --tls-cert and --tls-key.
    #[arg(long)]
    quic: bool,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    events: EventsArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
}

#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    /// Admin address (/metrics, /health); "" for none.
    #[arg(long)]
    admin: Option<String>,
    /// Token file: require a token on every connection (docs/security.md).
    #[arg(long)]
    auth: Option<PathBuf>,
    /// This daemon's token (role cluster), for a meta service that
    /// requires one.
    #[arg(long, env = "MOONCAKE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[arg(long)]
    config: Option<PathBuf>,
    /// Meta service to register with (without --etcd).
    #[arg(long, env = "MOONCAKE_META")]
    meta: Option<String>,
    /// Data address.
    #[arg(long)]
    listen: Option<String>,
    /// Address clients should use, when it differs from --listen.
    #[arg(long)]
    advertise: Option<String>,
    /// This host's name in the cluster (default: the hostname): a block's
    /// copies go to daemons of distinct nodes, and writers and readers on
    /// a node use its daemons first.
    #[arg(long)]
    node: Option<String>,
    /// DRAM pool size, e.g. 8GiB.
    #[arg(long)]
    dram: Option<ByteSize>,
    /// NVMe drive behind DRAM: PATH:SIZE (a file or device), e.g.
    /// /mnt/nvme0/mc.bin:200GiB; repeat for several drives.
    #[arg(long)]
    nvme: Vec<String>,
    /// Serve clients on this host through shared memory, on this Unix
    /// socket (not with --auth).
    #[arg(long)]
    shm_socket: Option<PathBuf>,
    /// Stop (and leave the meta service) when standard input closes: a
    /// parent process that ends, however it ends, takes its daemon with it.
    #[arg(long)]
    until_stdin_closes: bool,
    #[command(flatten)]
    quic: QuicArgs,
    #[command(flatten)]
    rdma: RdmaArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
}

/// The daemon's QUIC listener.
#[derive(clap::Args, Debug)]
pub struct QuicArgs {
    /// Serve QUIC on this UDP address too (e.g. 0.0.0.0:7171); needs
    /// --tls-cert and --tls-key (`mooncake-store certs` makes a test set).
    #[arg(long)]
    quic_listen: Option<String>,
    /// The QUIC address clients are told (default: the advertised host
    /// with the QUIC port).
    #[arg(long)]
    quic_advertise: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// The daemon's RDMA control port (a build with the `rdma` feature).
#[derive(clap::Args, Debug)]
pub struct RdmaArgs {
    /// Serve the DRAM pool over one-sided RDMA, with this TCP control
    /// address (e.g. 0.0.0.0:7271); on a host without an RDMA NIC the
    /// daemon says so and serves TCP only (not with --auth).
    #[arg(long)]
    rdma_listen: Option<String>,
    /// The RDMA control address clients are told (default: the advertised
    /// host with the RDMA port).
    #[arg(long)]
    rdma_advertise: Option<String>,
    /// The RDMA NIC to use (default: the first with an active port).
    #[arg(long)]
    rdma_device: Option<String>,
}

impl RdmaArgs {
    fn apply(self, cfg: &mut mooncake_store_daemon::config::DaemonConfig) {
        cfg.rdma_listen = self.rdma_listen.or(cfg.rdma_listen.take());
        cfg.rdma_advertise = self.rdma_advertise.or(cfg.rdma_advertise.take());
        cfg.rdma_device = self.rdma_device.or(cfg.rdma_device.take());
    }
}

/// A server's TLS: on its TCP port (--tls), and its certificate for TLS
/// and QUIC.
#[derive(clap::Args, Debug, Clone)]
pub struct TlsArgs {
    /// Speak TLS on the TCP port: clients (--tls-ca) and the other servers
    /// (--peer-ca) must connect with TLS; needs --tls-cert and --tls-key.
    #[arg(long)]
    tls: bool,
    /// The server's certificate (PEM).
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// The certificate's key (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: accept only TLS and QUIC clients whose certificate this
    /// CA signed.
    #[arg(long)]
    tls_client_ca: Option<PathBuf>,
    /// Talk to the other servers (meta service and daemons) encrypted
    /// only, trusting certificates this CA signed and presenting
    /// --tls-cert: over TLS with --tls, else over QUIC (they must serve it).
    #[arg(long)]
    peer_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// Each given flag over the config file's value.
    fn apply(self, files: TlsFields<'_>) {
        *files.tcp |= self.tls;
        *files.cert = self.tls_cert.or(files.cert.take());
        *files.key = self.tls_key.or(files.key.take());
        *files.client_ca = self.tls_client_ca.or(files.client_ca.take());
        *files.peer_ca = self.peer_ca.or(files.peer_ca.take());
    }
}

/// A server config's TLS fields, as `TlsArgs` sets them.
struct TlsFields<'a> {
    tcp: &'a mut bool,
    cert: &'a mut Option<PathBuf>,
    key: &'a mut Option<PathBuf>,
    client_ca: &'a mut Option<PathBuf>,
    peer_ca: &'a mut Option<PathBuf>,
}

impl QuicArgs {
    fn apply(self, cfg: &mut mooncake_store_daemon::config::DaemonConfig) {
        cfg.quic_listen = self.quic_listen.or(cfg.quic_listen.take());
        cfg.quic_advertise = self.quic_advertise.or(cfg.quic_advertise.take());
        self.tls.apply(TlsFields {
            tcp: &mut cfg.tls,
            cert: &mut cfg.tls_cert,
            key: &mut cfg.tls_key,
            client_ca: &mut cfg.tls_client_ca,
            peer_ca: &mut cfg.peer_ca,
        });
    }
}

async fn bind(addr: &str, role: &str) -> Result<TcpListener, Failure> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for the {role} on {addr}"))
        .map_err(Failure::other)
}

/// Serves `/metrics`, `/health` (and a meta service's
/// `/get_all_segments`) on `addr` (none when empty); returns the bound
/// address.
async fn start_admin(
    (addr, metrics_token): (&str, Option<String>),
    registry: Registry,
    views: Views,
    stop: &CancellationToken,
) -> Result<Option<std::net::SocketAddr>, Failure> {
    if addr.is_empty() {
        return Ok(None);
    }
    let listener = bind(addr, "admin endpoint").await?;
    let bound = listener.local_addr()?;
    let token = metrics_token.map(Arc::from);
    tokio::spawn(admin::serve(listener, registry, views, token, stop.clone()));
    Ok(Some(bound))
}

fn admin_note(addr: Option<std::net::SocketAddr>) -> String {
    addr.map_or_else(String::new, |a| format!("; metrics on http://{a}/metrics"))
}

/// A token cancelled by the first SIGINT or SIGTERM.
fn stop_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        cancel.cancel();
    });
    token
}

pub async fn up(args: UpArgs) -> Result<(), Failure> {
    let mut cfg = FileConfig::load(args.config.as_deref())?;
    if let Some(l) = args.meta_listen {
        cfg.meta.listen = l;
    }
    if let Some(l) = args.listen {
        cfg.daemon.listen = l;
    }
    if let Some(d) = args.dram {
        cfg.daemon.dram = d;
    }
    if !args.nvme.is_empty() {
        cfg.daemon.nvme = args.nvme;
    }
    if args.shm_socket.is_some() {
        cfg.daemon.shm_socket = args.shm_socket;
    }
    args.quic.apply(&mut cfg.daemon);
    args.rdma.apply(&mut cfg.daemon);
    args.events.apply(&mut cfg.meta);
    // One host, one certificate: clients set up for QUIC or TLS reach the
    // meta service the same way.
    if cfg.daemon.tls && cfg.daemon.peer_ca.is_none() {
        return Err(Failure::usage(
            "--tls needs --peer-ca too (the CA of --tls-cert): the daemon reaches the meta service over TLS",
        ));
    }
    cfg.meta.tls |= cfg.daemon.tls;
    if cfg.daemon.quic_listen.is_some() || cfg.daemon.tls {
        cfg.meta.quic |= cfg.daemon.quic_listen.is_some();
        cfg.meta.tls_cert = cfg.daemon.tls_cert.clone();
        cfg.meta.tls_key = cfg.daemon.tls_key.clone();
        cfg.meta.tls_client_ca = cfg.daemon.tls_client_ca.clone();
        cfg.meta.peer_ca = cfg.daemon.peer_ca.clone();
    }
    if let Some(a) = args.admin {
        cfg.meta.admin = a;
    }
    cfg.meta
        .validate()
        .map_err(|e| Failure::usage(format!("[meta] {e}")))?;
    // Both checked before either starts: a bad daemon setting stops `up`
    // before its meta service leads.
    cfg.daemon
        .validate()
        .map_err(|e| Failure::usage(format!("[daemon] {e}")))?;
    mooncake_store_daemon::memory_fits(&cfg.daemon)
        .map_err(|e| Failure::other(anyhow::anyhow!("daemon: {e}")))?;
    let registry = Registry::new();
    let meta_listener = bind(&cfg.meta.listen, "meta service").await?;
    let daemon_listener = bind(&cfg.daemon.listen, "daemon").await?;
    let admin_addr = (cfg.meta.admin.clone(), cfg.meta.metrics_token.clone());
    let dram = cfg.daemon.dram;
    // Ready means a put succeeds: the daemon is registered.
    let store = LocalStore::start(
        cfg.meta,
        meta_listener,
        cfg.daemon,
        daemon_listener,
        &registry,
        REGISTER_WITHIN,
    )
    .await
    .map_err(|e| match &e {
        // A setting only starting could refuse (a socket it cannot bind).
        LocalError::Daemon(DaemonError::Config(_)) | LocalError::Meta(MetaError::Config(_)) => {
            Failure::usage(e.to_string())
        }
        _ => Failure::other(e.into()),
    })?;
    let health: Health = Arc::new(|| (true, "ok: meta service and daemon serving".into()));
    let views = Views {
        health,
        segments: Some(store.meta.live_daemons()),
    };
    // The admin endpoint stops last: it answers while the store stops.
    let admin_stop = CancellationToken::new();
    let admin = start_admin((&admin_addr.0, admin_addr.1), registry, views, &admin_stop).await?;
    println!(
        "mooncake-store up: meta service on {}, daemon on {} with {} of DRAM{}. Ctrl-C stops it.",
        store.meta.addr,
        store.daemon.handle.addr,
        dram,
        admin_note(admin)
    );
    wait_for_signal().await;
    println!("stopping: finishing in-flight requests");
    // The daemon leaves the meta service while it still answers.
    if !store.stop(STOP_GRACE).await {
        eprintln!("warning: stop took over {STOP_GRACE:?}; exiting anyway");
    }
    admin_stop.cancel();
    Ok(())
}

pub async fn meta(args: MetaArgs) -> Result<(), Failure> {
    let mut cfg = FileConfig::load(args.config.as_deref())?.meta;
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(a) = args.admin {
        cfg.admin = a;
    }
    if args.auth.is_some() {
        cfg.auth = args.auth;
    }
    if args.token.is_some() {
        cfg.token = args.token;
    }
    cfg.quic |= args.quic;
    args.events.apply(&mut cfg);
    args.tls.apply(TlsFields {
        tcp: &mut cfg.tls,
        cert: &mut cfg.tls_cert,
        key: &mut cfg.tls_key,
        client_ca: &mut cfg.tls_client_ca,
        peer_ca: &mut cfg.peer_ca,
    });
    cfg.validate()
        .map_err(|e| Failure::usage(format!("[meta] {e}")))?;
    let stop = stop_on_signal();
    let registry = Registry::new();
    // Bound first: a port taken stops a replica at once, and a standby
    // holds its port until it leads.
    let listener = bind(&cfg.listen, "meta service").await?;
    let Some(etcd) = args.etcd.connect().await? else {
        let admin_addr = (cfg.admin.clone(), cfg.metrics_token.clone());
        let meta = mooncake_local::start_meta(cfg, listener, &registry, stop.clone())
            .await
            .map_err(|e| Failure::other(e.into()))?;
        let views = Views {
            health: Arc::new(|| (true, "ok: leader".into())),
            segments: Some(meta.live_daemons()),
        };
        let admin = start_admin((&admin_addr.0, admin_addr.1), registry, views, &stop).await?;
        println!("meta service on {}{}", meta.addr, admin_note(admin));
        stop.cancelled().await;
        let _ = tokio::time::timeout(STOP_GRACE, meta.join()).await;
        return Ok(());
    };
    // A replica: stand by, lead when elected, stand by again if the lead
    // is lost. Daemons silent for a lease TTL are dropped.
    cfg.daemon_ttl = HumanDuration(args.etcd.lease_ttl);
    let advertise = args
        .advertise
        .or_else(|| cfg.advertise.clone())
        .unwrap_or_else(|| cfg.listen.clone());
    let listener = listener.into_std().map_err(|e| Failure::other(e.into()))?;
    // Its events ports too, held from now on (a port taken by another
    // process while it stood by would stop it at the failover).
    let events = mooncake_meta::bind_events(&cfg).map_err(|e| Failure::other(e.into()))?;
    etcd.register(MemberKind::Meta, advertise.clone())
        .await
        .map_err(|e| Failure::connection(e.to_string()))?;
    let metrics =
        mooncake_meta::MetaMetrics::new(&registry).map_err(|e| Failure::other(e.into()))?;
    let view = mooncake_meta::ReplicaView::default();
    let health: Health = {
        let view = view.clone();
        Arc::new(move || {
            let role = if view.is_leading() {
                "leader"
            } else {
                "standby"
            };
            (true, format!("ok: {role}"))
        })
    };
    let segments: admin::Segments = {
        let view = view.clone();
        Arc::new(move || view.live_daemons())
    };
    let views = Views {
        health,
        segments: Some(segments),
    };
    let admin = start_admin(
        (&cfg.admin, cfg.metrics_token.clone()),
        registry,
        views,
        &stop,
    )
    .await?;
    if let Some(a) = admin {
        println!("meta replica {advertise}: metrics on http://{a}/metrics");
    }
    println!("meta replica {advertise}: standing by, leading when elected");
    let ran = mooncake_meta::run_replica(
        cfg,
        (listener, events),
        advertise,
        etcd.clone(),
        metrics,
        view,
        stop,
    )
    .await;
    etcd.close().await;
    ran.map_err(|e| Failure::other(e.into()))
}

pub async fn daemon(args: DaemonArgs) -> Result<(), Failure> {
    let mut cfg = FileConfig::load(args.config.as_deref())?.daemon;
    if let Some(m) = args.meta {
        cfg.meta = Some(m);
    }
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(a) = args.advertise {
        cfg.advertise = Some(a);
    }
    if let Some(n) = args.node {
        cfg.node = n;
    }
    if let Some(d) = args.dram {
        cfg.dram = d;
    }
    if !args.nvme.is_empty() {
        cfg.nvme = args.nvme;
    }
    if args.shm_socket.is_some() {
        cfg.shm_socket = args.shm_socket;
    }
    args.quic.apply(&mut cfg);
    args.rdma.apply(&mut cfg);
    if args.auth.is_some() {
        cfg.auth = args.auth;
    }
    if args.token.is_some() {
        cfg.token = args.token;
    }
    if let Some(a) = args.admin {
        cfg.admin = a;
    }
    cfg.validate()
        .map_err(|e| Failure::usage(format!("[daemon] {e}")))?;
    let etcd = args.etcd.connect().await?;
    if cfg.meta.is_none() && etcd.is_none() {
        return Err(Failure::usage(
            "a daemon needs a meta service: pass --meta ADDR or --etcd URL (or use `mooncake-store up` for one host)",
        ));
    }
    let stop = stop_on_signal();
    let listener = bind(&cfg.listen, "daemon").await?;
    let dram = cfg.dram;
    let coordinator = etcd.clone().map(|c| c as Arc<dyn Coordinator>);
    let registry = Registry::new();
    let admin_addr = (cfg.admin.clone(), cfg.metrics_token.clone());
    let daemon = mooncake_store_daemon::start(cfg, listener, coordinator, &registry, stop.clone())
        .await
        .map_err(|e| match e {
            DaemonError::Config(_) => Failure::usage(format!("daemon: {e}")),
            e => Failure::other(e.into()),
        })?;
    let health: Health = Arc::new(|| (true, "ok: daemon serving".into()));
    let views = Views {
        health,
        segments: None,
    };
    let admin = start_admin((&admin_addr.0, admin_addr.1), registry, views, &stop).await?;
    println!(
        "daemon on {} with {} of DRAM{}",
        daemon.addr,
        dram,
        admin_note(admin)
    );
    if args.until_stdin_closes {
        tokio::spawn(stop_when_stdin_closes(stop.clone()));
    }
    // Said once registered, so that whoever started the daemon knows when
    // puts can be placed on it; a meta service not reached yet is retried.
    while !stop.is_cancelled() {
        tokio::select! {
            ok = daemon.registered(REGISTER_WITHIN) => {
                if ok {
                    println!("daemon registered with the meta service");
                    break;
                }
                eprintln!("warning: not registered with the meta service yet; still trying");
            }
            _ = stop.cancelled() => {}
        }
    }
    stop.cancelled().await;
    let _ = tokio::time::timeout(STOP_GRACE, daemon.join()).await;
    if let Some(etcd) = etcd {
        etcd.close().await;
    }
    Ok(())
}

/// Cancels `stop` once standard input reaches its end (or fails).
async fn stop_when_stdin_closes(stop: CancellationToken) {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    stop.cancel();
}

async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(err) => {
            tracing::warn!(%err, "cannot watch SIGTERM; only Ctrl-C stops the process");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
