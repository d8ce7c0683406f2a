//! Status codes of the batch calls and of the compatible API: the values
//! `mooncake.store.MooncakeDistributedStore` returns where a meaning
//! matches (0 success, negative failure), so that code written against it
//! keeps working.

use mooncake_client::{ClientError, GetOutcome, PutOutcome};
use mooncake_proto::ErrorCode;
use pyo3::prelude::*;

use crate::{StoreError, StoreUnavailable};

pub const OK: i64 = 0;
pub const INTERNAL_ERROR: i64 = -1;
pub const NO_AVAILABLE_HANDLE: i64 = -200;
pub const INVALID_KEY: i64 = -400;
pub const WRITE_FAIL: i64 = -500;
pub const INVALID_PARAMS: i64 = -600;
pub const OBJECT_NOT_FOUND: i64 = -704;
pub const TRANSFER_FAIL: i64 = -800;
pub const RPC_FAIL: i64 = -900;

const NAMED: [(&str, i64); 9] = [
    ("OK", OK),
    ("INTERNAL_ERROR", INTERNAL_ERROR),
    ("NO_AVAILABLE_HANDLE", NO_AVAILABLE_HANDLE),
    ("INVALID_KEY", INVALID_KEY),
    ("WRITE_FAIL", WRITE_FAIL),
    ("INVALID_PARAMS", INVALID_PARAMS),
    ("OBJECT_NOT_FOUND", OBJECT_NOT_FOUND),
    ("TRANSFER_FAIL", TRANSFER_FAIL),
    ("RPC_FAIL", RPC_FAIL),
];

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (name, code) in NAMED {
        m.add(name, code)?;
    }
    Ok(())
}

/// The compatible code of a store error code.
pub fn of_code(code: ErrorCode) -> i64 {
    match code {
        ErrorCode::Ok | ErrorCode::AlreadyExists => OK,
        ErrorCode::NotFound => OBJECT_NOT_FOUND,
        ErrorCode::NoSpace | ErrorCode::Busy => NO_AVAILABLE_HANDLE,
        ErrorCode::TooLarge | ErrorCode::Malformed => INVALID_PARAMS,
        ErrorCode::ChecksumMismatch | ErrorCode::Corrupt | ErrorCode::NoReservation => {
            TRANSFER_FAIL
        }
        ErrorCode::Timeout | ErrorCode::Unavailable => RPC_FAIL,
        _ => INTERNAL_ERROR,
    }
}

/// The compatible code of a failed call.
pub fn of_error(err: &ClientError) -> i64 {
    match err {
        ClientError::Server { code, .. } => of_code(*code),
        ClientError::Invalid(_) => INVALID_PARAMS,
        _ => RPC_FAIL,
    }
}

pub fn of_put(outcome: PutOutcome) -> i64 {
    match outcome {
        PutOutcome::Stored | PutOutcome::AlreadyExists => OK,
        PutOutcome::Failed(ErrorCode::ChecksumMismatch) => WRITE_FAIL,
        PutOutcome::Failed(code) => of_code(code),
    }
}

/// Bytes read, or a negative code (`OBJECT_NOT_FOUND` for a miss).
pub fn of_get(outcome: GetOutcome) -> i64 {
    match outcome {
        GetOutcome::Hit(n) => n as i64,
        GetOutcome::Miss => OBJECT_NOT_FOUND,
        GetOutcome::Failed(code) => of_code(code),
    }
}

/// A failed call as a Python exception: `StoreUnavailable` when a retry
/// may help, `ValueError` for bad arguments, `StoreError` otherwise.
pub fn to_py(err: ClientError) -> PyErr {
    match &err {
        ClientError::Invalid(msg) => pyo3::exceptions::PyValueError::new_err(msg.clone()),
        e if e.is_retryable() => StoreUnavailable::new_err(err.to_string()),
        _ => StoreError::new_err(err.to_string()),
    }
}
