//! How a `Client` reaches the store: its certificates, and the meta
//! leader as etcd names it.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A client's certificates for `kind` ("tls" or "quic"): the arguments
/// `{kind}_ca`, `{kind}_cert` and `{kind}_key`, each defaulting to
/// `$MOONCAKE_{KIND}_CA` and so on. `None` without a CA.
pub(super) fn tls_settings(
    kind: &str,
    ca: Option<std::path::PathBuf>,
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
) -> PyResult<Option<mooncake_client::ClientTls>> {
    let env = |what: &str| {
        let name = format!("MOONCAKE_{}_{what}", kind.to_uppercase());
        std::env::var_os(name).map(std::path::PathBuf::from)
    };
    let identity = match (cert.or_else(|| env("CERT")), key.or_else(|| env("KEY"))) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(format!(
                "{kind}_cert and {kind}_key go together"
            )))
        }
    };
    match ca.or_else(|| env("CA")) {
        Some(ca) => Ok(Some(mooncake_client::ClientTls { ca, identity })),
        None if identity.is_some() => Err(PyValueError::new_err(format!(
            "{kind}_cert needs {kind}_ca (the CA that signed the store's certificates)"
        ))),
        None => Ok(None),
    }
}

/// `cfg` following whichever meta replica leads, as etcd at `endpoints`
/// says.
#[cfg(feature = "etcd")]
pub(super) async fn follow_leader_through_etcd(
    cfg: mooncake_client::ClientConfig,
    endpoints: Vec<String>,
) -> PyResult<mooncake_client::ClientConfig> {
    use mooncake_coord::{leader_address, EtcdConfig, EtcdCoordinator};
    let etcd = EtcdCoordinator::connect(EtcdConfig::new(endpoints.clone()))
        .await
        .map_err(|e| crate::StoreUnavailable::new_err(format!("etcd at {endpoints:?}: {e}")))?;
    cfg.with_resolver(std::sync::Arc::new(leader_address(etcd)))
        .await
        .map_err(|e| crate::StoreUnavailable::new_err(e.to_string()))
}

/// Without the `etcd` feature: a clear error instead of a silent fallback.
#[cfg(not(feature = "etcd"))]
pub(super) async fn follow_leader_through_etcd(
    _: mooncake_client::ClientConfig,
    endpoints: Vec<String>,
) -> PyResult<mooncake_client::ClientConfig> {
    Err(PyValueError::new_err(format!(
        "etcd {endpoints:?}: this build of mooncake-store has no etcd support; give the meta \
         leader's address instead, or install it with MATURIN_PEP517_ARGS=\"--features etcd\""
    )))
}
