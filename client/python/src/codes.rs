//! Status codes from Python: the shared ones (`mooncake_client::bindings::
//! status`) as module constants, and failed calls as exceptions.

use mooncake_client::bindings::status::NAMED;
pub use mooncake_client::bindings::status::*;
use mooncake_client::ClientError;
use pyo3::prelude::*;

use crate::{StoreError, StoreUnavailable};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (name, code) in NAMED {
        m.add(name, code)?;
    }
    Ok(())
}

/// The per-key answer of a removal as `True` (removed) or `False` (not
/// stored), or `StoreUnavailable` if a daemon could not confirm one.
pub fn removed(codes: &[mooncake_proto::ErrorCode]) -> PyResult<Vec<bool>> {
    use mooncake_proto::ErrorCode;
    let unconfirmed = codes
        .iter()
        .filter(|c| !matches!(c, ErrorCode::Ok | ErrorCode::NotFound))
        .count();
    if unconfirmed > 0 {
        return Err(StoreUnavailable::new_err(format!(
            "removal of {unconfirmed} of {} keys not confirmed by the daemon holding them; they are out of the index and their daemon is told again when it answers",
            codes.len()
        )));
    }
    Ok(codes.iter().map(|c| *c == ErrorCode::Ok).collect())
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
