//! The contract between every part of Mooncake Store: block keys and their
//! chained prefix hash, the checksum every block carries, the binary frame
//! format, the request and response bodies, and the wire-stable error codes.
//!
//! This crate must stay slim: no async runtime, no I/O, no storage engine.
//! Parsing is pure (byte slices in, typed values out), so that the daemon,
//! the meta service, the client SDK and the fuzzers all share one parser.

pub mod auth;
pub mod checksum;
pub mod codec;
pub mod error;
pub mod frame;
pub mod key;
pub mod message;
pub mod shm_index;
pub mod transport;
pub mod units;

pub use checksum::checksum;
pub use error::{ErrorCode, ProtoError};
pub use frame::{Header, Opcode, HEADER_LEN, MAX_CONTROL_BODY, MAX_VALUE_LEN, PROTOCOL_VERSION};
pub use key::{BlockHash, BlockKey, Namespace, PrefixHasher};
