//! Client errors, each saying where it came from and whether a retry may
//! help, so that a worker decides "retry" or "recompute" without matching
//! on every variant.

use std::io;

use mooncake_proto::{ErrorCode, ProtoError};

/// Which side of the call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSource {
    /// The meta service (control plane).
    Meta,
    /// A storage daemon (data plane).
    Daemon,
    /// This process: bad arguments or a buffer too small.
    Caller,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{side:?} at {addr} answered {code} to {op}")]
    Server {
        side: ErrorSource,
        addr: String,
        op: &'static str,
        code: ErrorCode,
    },
    #[error("{side:?} at {addr}: {op} did not finish within {timeout_ms} ms")]
    Timeout {
        side: ErrorSource,
        addr: String,
        op: &'static str,
        timeout_ms: u64,
    },
    #[error("{side:?} at {addr}: {err}")]
    Io {
        side: ErrorSource,
        addr: String,
        #[source]
        err: io::Error,
    },
    #[error("{side:?} at {addr} broke the protocol: {err}")]
    Protocol {
        side: ErrorSource,
        addr: String,
        #[source]
        err: ProtoError,
    },
    #[error("no meta leader found: {0}")]
    NoLeader(String),
    #[error("meta service at {addr} leads at election revision {revision}, older than {seen}: a stale leader, refused")]
    Stale {
        addr: String,
        revision: u64,
        seen: u64,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// TLS refused the connection: a certificate missing, not signed by a
    /// trusted CA, or not for this name. Retrying does not help.
    #[error("{side:?} at {addr} refused the connection: {why}")]
    Refused {
        side: ErrorSource,
        addr: String,
        why: String,
    },
}

impl ClientError {
    /// Whether the same call may succeed later or against another replica.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Server { code, .. } => code.is_retryable(),
            ClientError::Timeout { .. }
            | ClientError::Io { .. }
            | ClientError::NoLeader(_)
            | ClientError::Stale { .. } => true,
            ClientError::Protocol { .. }
            | ClientError::Invalid(_)
            | ClientError::Refused { .. } => false,
        }
    }

    /// An I/O error on a connection to `addr`; one of kind
    /// `PermissionDenied` is the peer's TLS refusing this client.
    pub fn io(side: ErrorSource, addr: &str, err: io::Error) -> ClientError {
        if err.kind() == io::ErrorKind::PermissionDenied {
            return ClientError::Refused {
                side,
                addr: addr.to_string(),
                why: err.to_string(),
            };
        }
        ClientError::Io {
            side,
            addr: addr.to_string(),
            err,
        }
    }

    /// The same error for another caller (one request answered several).
    pub(crate) fn duplicate(&self) -> ClientError {
        match self {
            ClientError::Server {
                side,
                addr,
                op,
                code,
            } => ClientError::Server {
                side: *side,
                addr: addr.clone(),
                op,
                code: *code,
            },
            ClientError::Timeout {
                side,
                addr,
                op,
                timeout_ms,
            } => ClientError::Timeout {
                side: *side,
                addr: addr.clone(),
                op,
                timeout_ms: *timeout_ms,
            },
            ClientError::Io { side, addr, err } => ClientError::Io {
                side: *side,
                addr: addr.clone(),
                err: io::Error::new(err.kind(), err.to_string()),
            },
            ClientError::Protocol { side, addr, err } => ClientError::Protocol {
                side: *side,
                addr: addr.clone(),
                err: err.clone(),
            },
            ClientError::NoLeader(why) => ClientError::NoLeader(why.clone()),
            ClientError::Stale {
                addr,
                revision,
                seen,
            } => ClientError::Stale {
                addr: addr.clone(),
                revision: *revision,
                seen: *seen,
            },
            ClientError::Invalid(why) => ClientError::Invalid(why.clone()),
            ClientError::Refused { side, addr, why } => ClientError::Refused {
                side: *side,
                addr: addr.clone(),
                why: why.clone(),
            },
        }
    }

    /// Where the error came from.
    pub fn source_side(&self) -> ErrorSource {
        match self {
            ClientError::Server { side, .. }
            | ClientError::Timeout { side, .. }
            | ClientError::Io { side, .. }
            | ClientError::Protocol { side, .. }
            | ClientError::Refused { side, .. } => *side,
            ClientError::NoLeader(_) | ClientError::Stale { .. } => ErrorSource::Meta,
            ClientError::Invalid(_) => ErrorSource::Caller,
        }
    }

    /// The server's error code, when a server answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::Timeout { .. } => Some(ErrorCode::Timeout),
            ClientError::Refused { .. } => Some(ErrorCode::Unauthorized),
            _ => None,
        }
    }
}
