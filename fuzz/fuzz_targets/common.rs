//! What the targets that fuzz running servers share: a panic anywhere
//! aborts (a crash to libFuzzer), and a store (a meta service and one
//! daemon registered with it) in this process, serving until it ends.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::runtime::Runtime;

/// A folder of this process's for the servers' files (tokens, sockets).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mooncake-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Starts `meta` and `daemon` on loopback, on a runtime of their own;
/// answers it and their addresses (the daemon's, the meta service's).
/// From then on a panic in any thread aborts the process.
pub fn serve(
    meta: mooncake_meta::MetaConfig,
    daemon: mooncake_store_daemon::DaemonConfig,
) -> (Runtime, SocketAddr, SocketAddr) {
    std::panic::set_hook(Box::new(|info| {
        eprintln!("{info}");
        std::process::abort();
    }));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (daemon, meta) = rt.block_on(async {
        let registry = prometheus::Registry::new();
        let store = mooncake_local::LocalStore::start(
            meta,
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            daemon,
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            &registry,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        let addrs = (store.daemon.handle.addr, store.meta.addr);
        // Serves until the process ends.
        std::mem::forget(store);
        addrs
    });
    (rt, daemon, meta)
}
