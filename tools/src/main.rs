//! `mooncake-store`: one binary for every role of Mooncake Store. `main`
//! parses arguments, starts logging and hands over to a command module;
//! errors end as one line on stderr and a distinct exit code.

mod bench;
mod bench_gpu;
mod bench_io;
mod bench_memcpy;
mod bench_meta;
mod bench_peer;
mod bench_pool;
mod blocks;
mod certs;
mod config;
mod events;
mod exit;
mod hash;
mod health;
mod operate;
mod replay;
mod route;
mod route_sim;
mod serve;
mod simulate;
mod svg;
mod tiers_sim;
mod token;
mod trace;
mod trace_gen;
mod transports;

use std::time::Duration;

use clap::{Parser, Subcommand};
use mooncake_proto::units::parse_duration;

#[derive(Parser)]
#[command(
    name = "mooncake-store",
    version,
    about = "A global KV cache store for LLM serving"
)]
struct Cli {
    /// Runtime worker threads. Default: half the cores (at least 1), which
    /// leaves the other half to the GPU worker or client on the same host.
    #[arg(long, env = "MOONCAKE_THREADS", global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

/// How a client command reaches the store.
#[derive(clap::Args, Clone, Debug)]
pub struct Target {
    /// Meta service address.
    #[arg(
        long,
        env = "MOONCAKE_META",
        default_value = "127.0.0.1:7070",
        global = true
    )]
    meta: String,
    /// Deadline of each call.
    #[arg(long, default_value = "5s", value_parser = parse_duration, global = true)]
    timeout: Duration,
    /// etcd endpoints, comma separated: follow whichever meta replica leads
    /// (instead of --meta).
    #[arg(long, env = "MOONCAKE_ETCD", value_delimiter = ',', global = true)]
    etcd: Vec<String>,
    /// Token for a store that requires authentication (`token new` makes
    /// one); its tenant decides which namespaces this command may use.
    #[arg(long, env = "MOONCAKE_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Unix socket of the daemon on this host (its --shm-socket): its
    /// blocks are read straight from its shared pool.
    #[arg(long, env = "MOONCAKE_SHM_SOCKET", global = true)]
    shm_socket: Option<std::path::PathBuf>,
    /// Threads that copy blocks out of the same-host pool and check them
    /// (for gets into GPU memory: that check their checksums while the GPU
    /// copies); default: a quarter of this host's cores, 1 to 8.
    #[arg(long, global = true)]
    copy_threads: Option<usize>,
    /// Speak TLS on every TCP connection (to a cluster whose servers run
    /// with --tls), trusting servers whose certificates this CA (PEM)
    /// signed.
    #[arg(long, env = "MOONCAKE_TLS_CA", global = true)]
    tls_ca: Option<std::path::PathBuf>,
    /// This client's certificate (PEM), for servers that require mutual TLS.
    #[arg(
        long,
        env = "MOONCAKE_TLS_CERT",
        global = true,
        requires = "tls_client_key"
    )]
    tls_client_cert: Option<std::path::PathBuf>,
    /// The key of --tls-client-cert (PEM).
    #[arg(
        long,
        env = "MOONCAKE_TLS_KEY",
        global = true,
        requires = "tls_client_cert"
    )]
    tls_client_key: Option<std::path::PathBuf>,
    /// Move blocks over QUIC, trusting daemons whose certificates this CA
    /// (PEM) signed; daemons without QUIC are refused, not reached over TCP.
    #[arg(long, env = "MOONCAKE_QUIC_CA", global = true)]
    quic_ca: Option<std::path::PathBuf>,
    /// This client's certificate (PEM), for daemons that require mutual TLS.
    #[arg(long, env = "MOONCAKE_QUIC_CERT", global = true, requires = "quic_key")]
    quic_cert: Option<std::path::PathBuf>,
    /// The key of --quic-cert (PEM).
    #[arg(long, env = "MOONCAKE_QUIC_KEY", global = true, requires = "quic_cert")]
    quic_key: Option<std::path::PathBuf>,
    /// Move blocks over RDMA to daemons that serve it, with a build that
    /// has the `rdma` feature (else, and on hosts without an RDMA NIC, over
    /// QUIC or TCP, counted in mooncake_client_transport_fallbacks_total).
    #[arg(long, env = "MOONCAKE_RDMA", global = true)]
    rdma: bool,
    /// The RDMA NIC to use with --rdma (default: the first with an active
    /// port).
    #[arg(long, env = "MOONCAKE_RDMA_DEVICE", global = true)]
    rdma_device: Option<String>,
    /// Most connections one large batch to one daemon is spread over.
    #[arg(long, env = "MOONCAKE_STRIPES", default_value_t = 4, global = true)]
    stripes: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Run a whole single-host store in one process: meta service and daemon.
    Up(serve::UpArgs),
    /// Run a meta service.
    Meta(serve::MetaArgs),
    /// Run a storage daemon that registers with a meta service.
    Daemon(serve::DaemonArgs),
    /// Store a block from a file or stdin.
    Put(blocks::PutArgs),
    /// Fetch a block to a file or stdout.
    Get(blocks::GetArgs),
    /// Remove blocks.
    Rm(blocks::RmArgs),
    /// Show the cluster: daemons, capacity, use, blocks.
    Stat(blocks::StatArgs),
    /// List stored blocks.
    Ls(blocks::LsArgs),
    /// Keep blocks from eviction.
    Pin(operate::PinArgs),
    /// Let pinned blocks be evicted again.
    Unpin(operate::PinArgs),
    /// Make a daemon evict its coldest blocks now (admin).
    Evict(operate::EvictArgs),
    /// Stop placing blocks on a daemon before taking its host out.
    Drain(operate::DrainArgs),
    /// Print the block keys of a token sequence.
    Hash(hash::HashArgs),
    /// Which host holds most of a request's prefix, and where serving it
    /// costs least (for a KV-aware router).
    Route(route::RouteArgs),
    /// Follow the store events (blocks stored and removed) as a router
    /// would, one line a batch.
    Events(events::EventsArgs),
    /// Drive a put/get load and report throughput and latency.
    Bench(bench::BenchArgs),
    /// Replay a serving trace against the store and report its hit rates.
    Replay(replay::ReplayArgs),
    /// Routing policies compared on a trace: simulated prefill instances,
    /// one per host of a real store, routed at random, by prefix, by route.
    RouteSim(route_sim::RouteSimArgs),
    /// Hit rate against cache size for a trace, offline: exact LRU, the
    /// daemon's eviction orders (its own pool) and Belady's MIN.
    Simulate(simulate::SimulateArgs),
    /// Write a synthetic serving trace (chat, agents, shared-prompt) in
    /// the format `simulate` and `replay` read
    GenTrace(trace_gen::GenTraceArgs),
    /// The same load as `bench`, against redis-server or memcached.
    BenchPeer(bench_peer::BenchPeerArgs),
    /// Random direct reads through the NVMe tier's I/O engines (vs fio).
    BenchIo(bench_io::BenchIoArgs),
    /// One core copying blocks: the same-host ceiling for a get.
    BenchMemcpy(bench_memcpy::BenchMemcpyArgs),
    /// KV blocks put from and read into GPU memory, beside the GPU's own
    /// pinned copies of the same bytes (checked byte for byte).
    BenchGpu(bench_gpu::BenchGpuArgs),
    /// What each DRAM eviction order costs: pool operations per second
    /// over a trace.
    BenchPool(bench_pool::BenchPoolArgs),
    /// Measure the meta service alone: prefix matches and two-phase puts.
    BenchMeta(bench_meta::BenchMetaArgs),
    /// Show the configuration.
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// Make tokens for a store that requires authentication.
    #[command(subcommand)]
    Token(token::TokenCommand),
    /// Make a development CA and certificates for QUIC (mutual) TLS.
    Certs(certs::CertsArgs),
    /// What data paths this host offers: RDMA devices, QUIC, shared memory.
    Transports(transports::TransportsArgs),
    /// Ask a server's admin port for /health (a container's health check).
    Health(health::HealthArgs),
}

fn main() {
    quiet_on_closed_stdout();
    let cli = Cli::parse();
    let serving = matches!(
        cli.command,
        Command::Up(_) | Command::Meta(_) | Command::Daemon(_)
    );
    init_logging(serving);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cli.threads.unwrap_or(cores / 2).max(1);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => exit::fail(exit::Failure::other(anyhow::anyhow!(
            "cannot start the runtime: {err}"
        ))),
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Up(a) => serve::up(a).await,
            Command::Meta(a) => serve::meta(a).await,
            Command::Daemon(a) => serve::daemon(a).await,
            Command::Put(a) => blocks::put(a).await,
            Command::Get(a) => blocks::get(a).await,
            Command::Rm(a) => blocks::rm(a).await,
            Command::Route(a) => route::run(a).await,
            Command::Events(a) => events::run(a).await,
            Command::Stat(a) => blocks::stat(a).await,
            Command::Ls(a) => blocks::ls(a).await,
            Command::Hash(a) => hash::run(a),
            Command::Pin(a) => operate::pin(a, true).await,
            Command::Unpin(a) => operate::pin(a, false).await,
            Command::Evict(a) => operate::evict(a).await,
            Command::Drain(a) => operate::drain(a).await,
            Command::Bench(a) => bench::run(a).await,
            Command::BenchMeta(a) => bench_meta::run(a).await,
            Command::BenchIo(a) => bench_io::run(a).await,
            Command::BenchPeer(a) => bench_peer::run(a).await,
            Command::BenchMemcpy(a) => bench_memcpy::run(a),
            Command::BenchGpu(a) => bench_gpu::run(a).await,
            Command::BenchPool(a) => bench_pool::run(a),
            Command::Replay(a) => replay::run(a).await,
            Command::RouteSim(a) => route_sim::run(a).await,
            Command::Simulate(a) => simulate::run(a),
            Command::GenTrace(a) => trace_gen::run(a),
            Command::Config(c) => config::run(c),
            Command::Token(c) => token::run(c),
            Command::Certs(a) => certs::run(a),
            Command::Transports(a) => transports::run(a),
            Command::Health(a) => health::run(a).await,
        }
    });
    if let Err(failure) = result {
        exit::fail(failure);
    }
}

/// Servers log at info by default; client commands only errors, so that a
/// failure is the one line `exit::fail` prints (`RUST_LOG=warn` shows the
/// library's warnings: retries, fallbacks). `RUST_LOG` overrides both.
fn init_logging(serving: bool) {
    let default = if serving { "info" } else { "error" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Output piped into a reader that stops early (`simulate ... | head`)
/// ends the command quietly, as a Unix tool does, instead of panicking on
/// the closed pipe. Everything else still panics as before.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}
