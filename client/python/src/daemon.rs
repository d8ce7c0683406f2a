//! A storage daemon inside the Python process: what Mooncake's
//! `global_segment_size` means here. Mooncake clients contribute a memory
//! segment to the cluster; our clients are separate from storage daemons,
//! so a client asked to contribute memory starts a daemon of that size
//! beside it, registered with the same meta service.

use std::sync::Arc;

use mooncake_daemon::{DaemonConfig, DaemonHandle};
use mooncake_proto::units::ByteSize;
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::runtime;

/// How long starting an embedded daemon waits for it to register.
const REGISTER_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

#[pyclass(frozen, module = "mooncake_store._native")]
pub struct EmbeddedDaemon {
    addr: String,
    stop: CancellationToken,
    handle: Mutex<Option<DaemonHandle>>,
}

#[pymethods]
impl EmbeddedDaemon {
    /// Starts a daemon with `dram` bytes of pool, serving on `host` (a free
    /// port), and returns once it is registered with the meta service at
    /// `meta`.
    #[new]
    #[pyo3(signature = (meta, dram, host = "127.0.0.1"))]
    fn new(py: Python<'_>, meta: String, dram: u64, host: &str) -> PyResult<Self> {
        let stop = CancellationToken::new();
        let cfg = DaemonConfig {
            dram: ByteSize(dram),
            meta: Some(meta.clone()),
            admin: String::new(),
            ..DaemonConfig::default()
        };
        let handle = py
            .detach(|| {
                runtime().block_on(async {
                    let listener = tokio::net::TcpListener::bind((host, 0))
                        .await
                        .map_err(|e| format!("cannot listen on {host}: {e}"))?;
                    let handle = mooncake_daemon::start(
                        cfg,
                        listener,
                        None,
                        &prometheus::Registry::new(),
                        stop.clone(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    // Set up means puts can be placed on it.
                    if !handle.registered(REGISTER_WITHIN).await {
                        stop.cancel();
                        return Err(format!(
                            "the daemon did not register with the meta service at {meta} within {REGISTER_WITHIN:?}"
                        ));
                    }
                    Ok(handle)
                })
            })
            .map_err(PyRuntimeError::new_err)?;
        Ok(EmbeddedDaemon {
            addr: handle.addr.to_string(),
            stop,
            handle: Mutex::new(Some(handle)),
        })
    }

    /// The address the daemon serves on.
    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// Stops the daemon and waits until it has: it leaves the meta service
    /// first, so its blocks leave the index and no put goes to it.
    fn stop(&self, py: Python<'_>) {
        self.stop.cancel();
        if let Some(handle) = self.handle.lock().take() {
            py.detach(|| runtime().block_on(handle.join()));
        }
    }
}

impl Drop for EmbeddedDaemon {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Keeps the type checker honest about what is shared across threads.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<Arc<EmbeddedDaemon>>();
};
