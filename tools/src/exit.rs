//! How a command fails: one line on stderr, and an exit code a script can
//! act on (2 usage, 3 cannot reach the store, 4 the store refused, 1 other).

use mooncake_client::ClientError;
use mooncake_proto::ErrorCode;

/// Codes by which a server says that a peer (a daemon, the leader) did not
/// answer: for a user, the store was not reachable.
fn unreachable(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::Unavailable | ErrorCode::Timeout)
}

pub struct Failure {
    code: i32,
    message: String,
}

impl Failure {
    pub fn usage(message: impl Into<String>) -> Self {
        Failure {
            code: 2,
            message: message.into(),
        }
    }

    /// The store (or its coordinator) cannot be reached.
    pub fn connection(message: impl Into<String>) -> Self {
        Failure {
            code: 3,
            message: message.into(),
        }
    }

    /// A store's answer `code`: unreachable (3) when it says that no one
    /// could answer in time (a dead or unreachable daemon), else refused (4).
    pub fn refusal(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            code: if unreachable(code) { 3 } else { 4 },
            message: message.into(),
        }
    }

    pub fn other(err: anyhow::Error) -> Self {
        Failure {
            code: 1,
            message: format!("{err:#}"),
        }
    }
}

impl From<ClientError> for Failure {
    fn from(err: ClientError) -> Self {
        let (code, hint) = match &err {
            ClientError::Io { .. }
            | ClientError::Timeout { .. }
            | ClientError::NoLeader(_)
            | ClientError::Stale { .. } => (
                3,
                " (is the store running? start one with `mooncake-store up`, or pass --meta ADDR)",
            ),
            ClientError::Server { code, .. } if unreachable(*code) => (3, ""),
            ClientError::Server { .. }
            | ClientError::Protocol { .. }
            | ClientError::Refused { .. } => (4, ""),
            ClientError::Invalid(_) => (2, ""),
        };
        Failure {
            code,
            message: format!("{err}{hint}"),
        }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(err: anyhow::Error) -> Self {
        Failure::other(err)
    }
}

impl From<std::io::Error> for Failure {
    fn from(err: std::io::Error) -> Self {
        Failure::other(err.into())
    }
}

pub fn fail(failure: Failure) -> ! {
    eprintln!("error: {}", failure.message);
    std::process::exit(failure.code)
}
