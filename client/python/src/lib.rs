//! `mooncake_store._native`: the Rust client inside Python.
//!
//! Every call that touches the network releases the GIL and runs on one
//! tokio runtime shared by the process, so Python threads issue requests in
//! parallel. Batches cross into Rust once per batch. Data lands straight in
//! the caller's buffer (anything with the buffer protocol, or a registered
//! address range): no copy on the client side.

mod buffers;
mod client;
mod codes;
mod daemon;
mod keys;

use std::sync::OnceLock;

use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    StoreError,
    pyo3::exceptions::PyException,
    "The store refused or failed a call; `str()` says which side and why."
);
pyo3::create_exception!(
    _native,
    StoreUnavailable,
    StoreError,
    "The store could not be reached in time (a retry may help)."
);

/// The runtime every call runs on, started on first use: `MOONCAKE_THREADS`
/// worker threads, by default half the cores (at least one), like the CLI,
/// which leaves the other half to the GPU worker's own threads.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let threads = std::env::var("MOONCAKE_THREADS")
            .ok()
            .and_then(|t| t.parse::<usize>().ok())
            .filter(|t| *t > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
            });
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("mooncake-client")
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add_class::<daemon::EmbeddedDaemon>()?;
    m.add_function(wrap_pyfunction!(keys::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(keys::opaque_hash, m)?)?;
    m.add("StoreError", m.py().get_type::<StoreError>())?;
    m.add("StoreUnavailable", m.py().get_type::<StoreUnavailable>())?;
    codes::register(m)?;
    Ok(())
}
