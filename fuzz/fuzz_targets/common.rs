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

/// A store serving in this process.
pub struct Served {
    pub rt: Runtime,
    pub daemon: SocketAddr,
    pub meta: SocketAddr,
    /// Their metrics.
    pub registry: prometheus::Registry,
}

/// Starts `meta` and `daemon` on loopback, on a runtime of their own.
/// From then on a panic in any thread aborts the process.
pub fn serve(
    meta: mooncake_meta::MetaConfig,
    daemon: mooncake_store_daemon::DaemonConfig,
) -> Served {
    std::panic::set_hook(Box::new(|info| {
        eprintln!("{info}");
        std::process::abort();
    }));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let registry = prometheus::Registry::new();
    let (daemon, meta) = rt.block_on(async {
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
    Served {
        rt,
        daemon,
        meta,
        registry,
    }
}

/// The value of each series of the gauge `name`, with its labels (for a
/// failure's message).
pub fn metric(registry: &prometheus::Registry, name: &str) -> Vec<String> {
    let families = registry.gather();
    let Some(family) = families.iter().find(|f| f.name() == name) else {
        return Vec::new();
    };
    family
        .get_metric()
        .iter()
        .map(|m| {
            let labels: Vec<String> = m
                .get_label()
                .iter()
                .map(|l| format!("{}={}", l.name(), l.value()))
                .collect();
            format!("{{{}}} {}", labels.join(","), m.get_gauge().get_value())
        })
        .collect()
}
