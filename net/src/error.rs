//! The error of a call to a server (the meta service or a daemon), saying
//! which side failed, at which address, and whether a retry may help, so
//! that a worker decides "retry" or "recompute" without matching on every
//! variant. The client SDK names it `ClientError`.

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
pub enum CallError {
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

impl CallError {
    /// Whether the same call may succeed later or against another replica.
    pub fn is_retryable(&self) -> bool {
        match self {
            CallError::Server { code, .. } => code.is_retryable(),
            CallError::Timeout { .. }
            | CallError::Io { .. }
            | CallError::NoLeader(_)
            | CallError::Stale { .. } => true,
            CallError::Protocol { .. } | CallError::Invalid(_) | CallError::Refused { .. } => false,
        }
    }

    /// An I/O error on a connection to `addr`; one of kind
    /// `PermissionDenied` is the peer's TLS refusing this client.
    pub fn io(side: ErrorSource, addr: &str, err: io::Error) -> CallError {
        if err.kind() == io::ErrorKind::PermissionDenied {
            return CallError::Refused {
                side,
                addr: addr.to_string(),
                why: err.to_string(),
            };
        }
        CallError::Io {
            side,
            addr: addr.to_string(),
            err,
        }
    }

    /// The same error for another caller (one request answered several).
    pub fn duplicate(&self) -> CallError {
        match self {
            CallError::Server {
                side,
                addr,
                op,
                code,
            } => CallError::Server {
                side: *side,
                addr: addr.clone(),
                op,
                code: *code,
            },
            CallError::Timeout {
                side,
                addr,
                op,
                timeout_ms,
            } => CallError::Timeout {
                side: *side,
                addr: addr.clone(),
                op,
                timeout_ms: *timeout_ms,
            },
            CallError::Io { side, addr, err } => CallError::Io {
                side: *side,
                addr: addr.clone(),
                err: io::Error::new(err.kind(), err.to_string()),
            },
            CallError::Protocol { side, addr, err } => CallError::Protocol {
                side: *side,
                addr: addr.clone(),
                err: err.clone(),
            },
            CallError::NoLeader(why) => CallError::NoLeader(why.clone()),
            CallError::Stale {
                addr,
                revision,
                seen,
            } => CallError::Stale {
                addr: addr.clone(),
                revision: *revision,
                seen: *seen,
            },
            CallError::Invalid(why) => CallError::Invalid(why.clone()),
            CallError::Refused { side, addr, why } => CallError::Refused {
                side: *side,
                addr: addr.clone(),
                why: why.clone(),
            },
        }
    }

    /// Where the error came from.
    pub fn source_side(&self) -> ErrorSource {
        match self {
            CallError::Server { side, .. }
            | CallError::Timeout { side, .. }
            | CallError::Io { side, .. }
            | CallError::Protocol { side, .. }
            | CallError::Refused { side, .. } => *side,
            CallError::NoLeader(_) | CallError::Stale { .. } => ErrorSource::Meta,
            CallError::Invalid(_) => ErrorSource::Caller,
        }
    }

    /// The server's error code, when a server answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            CallError::Server { code, .. } => Some(*code),
            CallError::Timeout { .. } => Some(ErrorCode::Timeout),
            CallError::Refused { .. } => Some(ErrorCode::Unauthorized),
            _ => None,
        }
    }
}
