//! The client SDK that GPU workers link: control calls to the meta service,
//! block data straight to and from storage daemons (never through meta),
//! with pooled connections, pipelined batches and a deadline on every call.
//!
//! Depends on `mooncake-proto` and `mooncake-net` only; never on a server
//! crate, nor on etcd.

pub mod bindings;
mod client;
pub mod device;
mod lineage;
mod locations;
mod metrics;
pub mod pieces;
pub mod transport;

pub use client::{Client, ClientConfig, GetOutcome, PrefixMatch, PutOptions, PutOutcome};
pub use metrics::ClientMetrics;
pub use mooncake_net as net;
/// What a client call returns when it fails: which side, at which
/// address, and whether a retry may help.
pub use mooncake_net::CallError as ClientError;
pub use mooncake_net::{ClientTls, ErrorSource, MetaResolver, TlsError};
pub use mooncake_proto as proto;
pub use pieces::{Dest, Value};
pub use transport::{Transport, TransportCounters};
