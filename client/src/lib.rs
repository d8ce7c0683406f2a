//! The client SDK that GPU workers link: control calls to the meta service,
//! block data straight to and from storage daemons (never through meta),
//! with pooled connections, pipelined batches and a deadline on every call.
//!
//! Depends on `mooncake-proto` only; never on a server crate. The daemon and
//! the meta service reuse its [`Connection`] to talk to each other.

pub mod bindings;
mod client;
mod coalesce;
mod conn;
mod error;
mod locations;
mod metrics;
mod pool;
pub mod transport;

pub use client::{Client, ClientConfig, GetOutcome, PrefixMatch, PutOutcome};
pub use conn::{Connection, FrameReader, FrameWriter};
pub use error::{ClientError, ErrorSource};
pub use metrics::ClientMetrics;
pub use mooncake_proto as proto;
pub use pool::{ConnPool, Dialer};
pub use transport::quic::{ClientTls, ServerTls, TlsError};
pub use transport::{Transport, TransportCounters};

/// Finds the meta service's current address (the leader's, in a cluster),
/// so that a client follows leader changes without restarting.
pub trait MetaResolver: Send + Sync + 'static {
    fn resolve(&self) -> futures::future::BoxFuture<'_, Result<String, String>>;
}
