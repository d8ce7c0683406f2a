//! Wire-stable error codes, and the errors of parsing frames and bodies.

use std::fmt;

/// A status code carried in every response header. The numbers are part of
/// the protocol: never renumber, only add.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    Ok = 0,
    /// The block is not stored (or not visible yet). A miss, not a failure.
    NotFound = 1,
    /// A put for a key that is already stored or being stored.
    AlreadyExists = 2,
    /// The request body could not be parsed.
    Malformed = 3,
    /// The opcode is unknown to this server.
    UnknownOpcode = 4,
    /// The protocol version is not spoken by this server.
    UnsupportedVersion = 5,
    /// A key, value or batch exceeds a configured limit.
    TooLarge = 6,
    /// No space could be made for the block (everything else is pinned,
    /// leased or being written).
    NoSpace = 7,
    /// The bytes received do not match the checksum the writer sent.
    ChecksumMismatch = 8,
    /// Stored bytes failed their checksum; the block was dropped.
    Corrupt = 9,
    /// The server refuses work for now (too many requests in flight).
    Busy = 10,
    /// A deadline passed.
    Timeout = 11,
    /// No storage daemon (or no meta leader) can serve the request now.
    Unavailable = 12,
    /// The put's reservation expired or was never made.
    NoReservation = 13,
    /// An invariant broke inside the server.
    Internal = 14,
    /// No valid token was presented, or its identity may not do this (its
    /// tenant does not own the namespace, or the operation needs a role
    /// it does not have).
    Unauthorized = 15,
    /// The port speaks TLS only and the peer sent plain frames: the
    /// server answers this once, in clear, and closes the connection.
    TlsRequired = 16,
    /// A lease on the block has not run out: a removal that is not forced
    /// leaves it (Mooncake's `OBJECT_HAS_LEASE`).
    Leased = 17,
}

impl ErrorCode {
    /// How many codes there are (for tables indexed by code).
    pub const COUNT: usize = 18;
}

impl ErrorCode {
    /// Decodes a status from the wire; unknown codes are kept as `Internal`
    /// by the caller, who still sees the raw number in the error message.
    pub fn from_u16(code: u16) -> Option<Self> {
        use ErrorCode::*;
        Some(match code {
            0 => Ok,
            1 => NotFound,
            2 => AlreadyExists,
            3 => Malformed,
            4 => UnknownOpcode,
            5 => UnsupportedVersion,
            6 => TooLarge,
            7 => NoSpace,
            8 => ChecksumMismatch,
            9 => Corrupt,
            10 => Busy,
            11 => Timeout,
            12 => Unavailable,
            13 => NoReservation,
            14 => Internal,
            15 => Unauthorized,
            16 => TlsRequired,
            17 => Leased,
            _ => return None,
        })
    }

    /// Whether the same request may succeed if retried, here later or
    /// against another replica. A client uses this to choose between
    /// "retry elsewhere" and "give up and recompute".
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::NoSpace
                | ErrorCode::ChecksumMismatch
                | ErrorCode::Busy
                | ErrorCode::Timeout
                | ErrorCode::Unavailable
                | ErrorCode::NoReservation
        )
    }

    /// A short stable name, used in logs, metrics labels and the CLI.
    pub fn name(self) -> &'static str {
        use ErrorCode::*;
        match self {
            Ok => "ok",
            NotFound => "not_found",
            AlreadyExists => "already_exists",
            Malformed => "malformed",
            UnknownOpcode => "unknown_opcode",
            UnsupportedVersion => "unsupported_version",
            TooLarge => "too_large",
            NoSpace => "no_space",
            ChecksumMismatch => "checksum_mismatch",
            Corrupt => "corrupt",
            Busy => "busy",
            Timeout => "timeout",
            Unavailable => "unavailable",
            NoReservation => "no_reservation",
            Internal => "internal",
            Unauthorized => "unauthorized",
            TlsRequired => "tls_required",
            Leased => "leased",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a frame or a body could not be parsed. Every variant is a protocol
/// violation by the peer: the connection that sent it is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("bad magic {0:#06x}: not a Mooncake Store peer")]
    BadMagic(u16),
    #[error("protocol version {0} is not supported (this side speaks {1})")]
    UnsupportedVersion(u8, u8),
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("frame body of {len} bytes exceeds the limit of {limit} for this opcode")]
    TooLarge { len: u64, limit: u64 },
    #[error("body truncated: needed {needed} more bytes")]
    Truncated { needed: usize },
    #[error("{0} trailing bytes after the body")]
    TrailingBytes(usize),
    #[error("invalid field {field}: {why}")]
    Invalid { field: &'static str, why: String },
}

impl ProtoError {
    /// The status a server answers with before closing the connection.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::UnsupportedVersion(..) => ErrorCode::UnsupportedVersion,
            ProtoError::UnknownOpcode(_) => ErrorCode::UnknownOpcode,
            ProtoError::TooLarge { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::Malformed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_rejected() {
        for raw in 0..ErrorCode::COUNT as u16 {
            let code = ErrorCode::from_u16(raw).expect("known code");
            assert_eq!(code as u16, raw);
        }
        assert_eq!(ErrorCode::from_u16(ErrorCode::COUNT as u16), None);
    }

    #[test]
    fn only_transient_codes_are_retryable() {
        assert!(ErrorCode::Unavailable.is_retryable());
        assert!(!ErrorCode::Malformed.is_retryable());
        assert!(!ErrorCode::NotFound.is_retryable());
    }
}
