//! The skeleton both servers (the storage daemon and the meta service)
//! are built on, so that they apply the same limits, refusals, deadlines,
//! authentication and metrics:
//!
//! - `listen`: accept TCP connections and QUIC streams, admit each under
//!   one budget ([`Limits`]), serve it in a tracked task, drain on stop;
//! - `frames`: the frame loop of a connection and the [`Service`] trait a
//!   server implements to answer requests;
//! - `metrics`: request and connection metrics under a server's prefix;
//! - `admin`: the HTTP admin endpoint (`/metrics`, `/health`, ...);
//! - `settings`: configuration both servers read under the same names.

pub mod admin;
mod admit;
mod frames;
mod limits;
mod listen;
pub mod metrics;
mod settings;

pub use admit::Limits;
pub use frames::{read_body, reply, ConnError, Service, IO_BUFFER};
pub use limits::Deadlines;
pub use listen::Server;
pub use metrics::{MetricsSpec, ServerMetrics};
pub use settings::TlsFiles;
