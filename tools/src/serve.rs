//! The serving roles: `up` (meta service and daemon in one process, the
//! single-host default), `meta` and `daemon`. Each runs until SIGINT or
//! SIGTERM, then stops in order: stop accepting, finish requests, exit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use mooncake_meta::EmbeddedCoordinator;
use mooncake_proto::units::ByteSize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::FileConfig;
use crate::exit::Failure;

/// How long a graceful stop may take before the process exits anyway.
const STOP_GRACE: Duration = Duration::from_secs(10);

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
}

#[derive(clap::Args, Debug)]
pub struct MetaArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Control address.
    #[arg(long)]
    listen: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Meta service to register with.
    #[arg(long, env = "MOONCAKE_META")]
    meta: Option<String>,
    /// Data address.
    #[arg(long)]
    listen: Option<String>,
    /// Address clients should use, when it differs from --listen.
    #[arg(long)]
    advertise: Option<String>,
    /// DRAM pool size, e.g. 8GiB.
    #[arg(long)]
    dram: Option<ByteSize>,
}

async fn bind(addr: &str, role: &str) -> Result<TcpListener, Failure> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for the {role} on {addr}"))
        .map_err(Failure::other)
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
    let shutdown = CancellationToken::new();
    let meta_listener = bind(&cfg.meta.listen, "meta service").await?;
    let daemon_listener = bind(&cfg.daemon.listen, "daemon").await?;
    let coordinator = Arc::new(EmbeddedCoordinator::new());
    let meta = mooncake_meta::start(cfg.meta, meta_listener, coordinator, shutdown.clone())
        .await
        .map_err(|e| Failure::other(e.into()))?;
    cfg.daemon.meta = Some(meta.addr.to_string());
    let dram = cfg.daemon.dram;
    let daemon = mooncake_daemon::start(cfg.daemon, daemon_listener, shutdown.clone())
        .await
        .map_err(|e| Failure::other(e.into()))?;
    println!(
        "mooncake-store up: meta service on {}, daemon on {} with {} of DRAM. Ctrl-C stops it.",
        meta.addr, daemon.addr, dram
    );
    wait_for_signal().await;
    println!("stopping: finishing in-flight requests");
    shutdown.cancel();
    let stopped = async {
        daemon.join().await;
        meta.join().await;
    };
    if tokio::time::timeout(STOP_GRACE, stopped).await.is_err() {
        eprintln!("warning: stop took over {STOP_GRACE:?}; exiting anyway");
    }
    Ok(())
}

pub async fn meta(args: MetaArgs) -> Result<(), Failure> {
    let mut cfg = FileConfig::load(args.config.as_deref())?.meta;
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    let shutdown = CancellationToken::new();
    let listener = bind(&cfg.listen, "meta service").await?;
    let meta = mooncake_meta::start(
        cfg,
        listener,
        Arc::new(EmbeddedCoordinator::new()),
        shutdown.clone(),
    )
    .await
    .map_err(|e| Failure::other(e.into()))?;
    println!("meta service on {}", meta.addr);
    wait_for_signal().await;
    shutdown.cancel();
    let _ = tokio::time::timeout(STOP_GRACE, meta.join()).await;
    Ok(())
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
    if let Some(d) = args.dram {
        cfg.dram = d;
    }
    if cfg.meta.is_none() {
        return Err(Failure::usage(
            "a daemon needs a meta service: pass --meta ADDR (or use `mooncake-store up` for one host)",
        ));
    }
    let shutdown = CancellationToken::new();
    let listener = bind(&cfg.listen, "daemon").await?;
    let dram = cfg.dram;
    let daemon = mooncake_daemon::start(cfg, listener, shutdown.clone())
        .await
        .map_err(|e| Failure::other(e.into()))?;
    println!("daemon on {} with {} of DRAM", daemon.addr, dram);
    wait_for_signal().await;
    shutdown.cancel();
    let _ = tokio::time::timeout(STOP_GRACE, daemon.join()).await;
    Ok(())
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
