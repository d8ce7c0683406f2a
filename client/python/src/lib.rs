//! `mooncake_store._native`: the Rust client inside Python.
//!
//! Every call that touches the network releases the GIL and runs on one
//! tokio runtime shared by the process (on its workers, the calling thread
//! waiting: `bindings::block_on`), so Python threads issue requests in
//! parallel. Batches cross into Rust once per batch. Data lands straight in
//! the caller's buffer (anything with the buffer protocol, or a registered
//! address range): no copy on the client side.

mod buffers;
mod client;
mod codes;
mod keys;
mod pieces;
mod tags;

use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    StoreError,
    pyo3::exceptions::PyException,
    "The store refused or failed a call; `str()` says which side and why."
);
pyo3::create_exception!(
    _native,
    StoreUnavailable,
    StoreError,
    "The store could not be reached in time (a retry may help)."
);

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add_function(wrap_pyfunction!(keys::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(keys::opaque_hash, m)?)?;
    m.add("StoreError", m.py().get_type::<StoreError>())?;
    m.add("StoreUnavailable", m.py().get_type::<StoreUnavailable>())?;
    codes::register(m)?;
    Ok(())
}
