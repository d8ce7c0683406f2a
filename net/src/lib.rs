//! The networking layer under every Mooncake Store component: framed
//! connections over TCP (plain or TLS) or QUIC streams, pools of them and
//! how they are dialed, QUIC endpoints for both ends, TLS settings, RDMA verbs (feature
//! `rdma`), group commit for batch calls (`coalesce`), and the error every
//! call returns. It knows frames, not what
//! they mean: the client SDK, the daemon and the meta service build their
//! calls on it, and none of them depends on another for it.

pub mod coalesce;
mod conn;
mod error;
mod pool;
pub mod quic;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod sockbuf;
pub mod tcp_tls;
pub mod tls;

pub use conn::{Connection, FrameReader, FrameWriter, ReadHalf, WriteHalf};
pub use error::{CallError, ErrorSource};
pub use pool::{ConnPool, Dialer};
pub use tcp_tls::{TlsAcceptor, TlsConnector};
pub use tls::{ClientTls, DevCerts, ServerTls, TlsError};

/// Finds the meta service's current address (the leader's, in a cluster),
/// so that a caller follows leader changes without restarting. Any
/// function returning the address is one (`mooncake-coord` builds one from
/// its coordinator).
pub trait MetaResolver: Send + Sync + 'static {
    fn resolve(&self) -> futures::future::BoxFuture<'_, Result<String, String>>;
}

impl<F> MetaResolver for F
where
    F: Fn() -> futures::future::BoxFuture<'static, Result<String, String>> + Send + Sync + 'static,
{
    fn resolve(&self) -> futures::future::BoxFuture<'_, Result<String, String>> {
        self()
    }
}
