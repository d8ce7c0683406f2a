//! Keys from Python: a `str` (any key, as Mooncake users write them,
//! hashed into the key space like the Rust SDK's opaque keys) or 32 `bytes`
//! (a block hash, as `block_hashes` computes it).

use mooncake_proto::{BlockHash, Namespace, PrefixHasher};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

pub fn hash_of(key: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    if let Ok(s) = key.cast::<PyString>() {
        return Ok(BlockHash::from_opaque(s.to_str()?.as_bytes()));
    }
    if let Ok(b) = key.cast::<PyBytes>() {
        let raw: [u8; 32] = b.as_bytes().try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "a bytes key is a 32-byte block hash, not {} bytes (use a str for other keys)",
                b.as_bytes().len()
            ))
        })?;
        return Ok(BlockHash(raw));
    }
    Err(PyTypeError::new_err(format!(
        "a key is a str or a 32-byte block hash, not {}",
        key.get_type().name()?
    )))
}

pub fn hashes_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    keys.try_iter()?.map(|k| hash_of(&k?)).collect()
}

pub fn namespace(name: &str) -> PyResult<Namespace> {
    Namespace::new(name).map_err(|e| PyValueError::new_err(format!("namespace {name:?}: {e}")))
}

/// Block hashes of a token sequence, one per full block of `block_tokens`
/// tokens, chained so that each depends on every token before it: the same
/// function as the Rust SDK (`docs/block-keys.md`, same test vectors).
#[pyfunction]
#[pyo3(signature = (tokens, block_tokens, seed = b"".as_slice(), extra = b"".as_slice()))]
pub fn block_hashes<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    block_tokens: usize,
    seed: &[u8],
    extra: &[u8],
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if block_tokens == 0 {
        return Err(PyValueError::new_err("block_tokens must be at least 1"));
    }
    let hashes = PrefixHasher::chain(seed, &tokens, block_tokens, extra);
    Ok(hashes.iter().map(|h| PyBytes::new(py, &h.0)).collect())
}

/// The 32-byte hash a `str` key is stored under.
#[pyfunction]
pub fn opaque_hash<'py>(py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &BlockHash::from_opaque(key.as_bytes()).0)
}
