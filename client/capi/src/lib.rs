//! The C ABI of the client, for C and C++ inference engines: the same
//! client as the Rust and Python SDKs, behind a handful of blocking calls.
//!
//! Conventions: keys are 32-byte block hashes laid end to end
//! (`mc_block_hashes` computes them from tokens, `mc_opaque_hash` from a
//! string); batch calls write one status per key into `results` (bytes read
//! or 0 on success, a negative `MC_*` status otherwise, the values of
//! Mooncake's own client) and return 0, or a negative status when the
//! arguments are unusable. Nothing panics across the boundary; a failed
//! `mc_connect` returns NULL and `mc_last_error` says why.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use mooncake_client::bindings::{block_on, except, overlapping, status};
use mooncake_client::device::Span;
use mooncake_client::{Client, ClientConfig, PutOptions};
use mooncake_proto::{BlockHash, Namespace, PrefixHasher};

pub const MC_OK: i64 = 0;
pub const MC_INTERNAL_ERROR: i64 = -1;
pub const MC_NO_AVAILABLE_HANDLE: i64 = -200;
pub const MC_INVALID_KEY: i64 = -400;
pub const MC_WRITE_FAIL: i64 = -500;
pub const MC_INVALID_PARAMS: i64 = -600;
pub const MC_ILLEGAL_CLIENT: i64 = -601;
pub const MC_OBJECT_NOT_FOUND: i64 = -704;
/// A lease holds the object (a removal without force leaves it).
pub const MC_OBJECT_HAS_LEASE: i64 = -706;
pub const MC_TRANSFER_FAIL: i64 = -800;
pub const MC_RPC_FAIL: i64 = -900;

/// A connection to a Mooncake Store cluster, shared by any number of
/// threads. Opaque.
pub struct McClient {
    client: Client,
    namespace: Namespace,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: impl Into<String>) {
    let msg = CString::new(msg.into().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

/// Runs `f`, turning a panic into `MC_INTERNAL_ERROR`.
fn guard(f: impl FnOnce() -> i64) -> i64 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_error("internal error (a panic in the client)");
        status::INTERNAL_ERROR
    })
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char) -> Option<&'a str> {
    if s.is_null() {
        return None;
    }
    // SAFETY: the caller's promise.
    unsafe { CStr::from_ptr(s) }.to_str().ok()
}

/// # Safety
/// `keys` is NULL or points at `n` 32-byte hashes.
unsafe fn hashes(keys: *const u8, n: usize) -> Option<Vec<BlockHash>> {
    if keys.is_null() && n > 0 {
        return None;
    }
    if n == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the caller's promise.
    let raw = unsafe { std::slice::from_raw_parts(keys, n.checked_mul(32)?) };
    Some(
        raw.chunks_exact(32)
            .map(|c| BlockHash(c.try_into().expect("32 bytes")))
            .collect(),
    )
}

/// # Safety
/// `p` is NULL or points at `n` values of `T`.
unsafe fn slice<'a, T>(p: *const T, n: usize) -> Option<&'a [T]> {
    match (p.is_null(), n) {
        (_, 0) => Some(&[]),
        (true, _) => None,
        // SAFETY: the caller's promise.
        (false, _) => Some(unsafe { std::slice::from_raw_parts(p, n) }),
    }
}

/// The last error of the calling thread ("" if none); valid until the
/// thread's next call.
#[no_mangle]
pub extern "C" fn mc_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Connects to the meta service at `meta` ("host:port"); every key of the
/// client lives in namespace `ns`; `token` (or NULL) authenticates with a
/// store that requires it; every call ends within `timeout_ms`. Returns
/// NULL on failure (see `mc_last_error`).
///
/// # Safety
/// `meta` and `ns` are NUL-terminated strings; `token` is one or NULL.
#[no_mangle]
pub unsafe extern "C" fn mc_connect(
    meta: *const c_char,
    ns: *const c_char,
    token: *const c_char,
    timeout_ms: u32,
) -> *mut McClient {
    // SAFETY: the caller's promise.
    let (Some(meta), Some(ns)) = (unsafe { text(meta) }, unsafe { text(ns) }) else {
        set_error("meta and ns must be UTF-8 strings");
        return std::ptr::null_mut();
    };
    let namespace = match Namespace::new(ns) {
        Ok(n) => n,
        Err(e) => {
            set_error(format!("namespace {ns:?}: {e}"));
            return std::ptr::null_mut();
        }
    };
    let mut cfg =
        ClientConfig::new(meta).with_timeout(Duration::from_millis(timeout_ms.max(1) as u64));
    // SAFETY: the caller's promise.
    if let Some(token) = unsafe { text(token) } {
        cfg = cfg.with_token(token);
    }
    let connected = catch_unwind(AssertUnwindSafe(|| block_on(Client::connect(cfg))));
    match connected {
        Ok(Ok(client)) => Box::into_raw(Box::new(McClient { client, namespace })),
        Ok(Err(e)) => {
            set_error(e.to_string());
            std::ptr::null_mut()
        }
        Err(_) => {
            set_error("internal error (a panic in the client)");
            std::ptr::null_mut()
        }
    }
}

/// Closes a client (NULL is ignored).
///
/// # Safety
/// `client` came from `mc_connect` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mc_close(client: *mut McClient) {
    if !client.is_null() {
        // SAFETY: the caller's promise.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// Writes the 32-byte hash a string key is stored under to `out`.
///
/// # Safety
/// `key` is a NUL-terminated string; `out` has room for 32 bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_opaque_hash(key: *const c_char, out: *mut u8) -> i64 {
    if key.is_null() || out.is_null() {
        return status::INVALID_PARAMS;
    }
    // SAFETY: the caller's promise.
    let key = unsafe { CStr::from_ptr(key) }.to_bytes();
    let hash = BlockHash::from_opaque(key);
    // SAFETY: `out` has room for 32 bytes.
    unsafe { std::ptr::copy_nonoverlapping(hash.0.as_ptr(), out, 32) };
    status::OK
}

/// The chained block hashes of `n_tokens` tokens, one per full block of
/// `block_tokens` (docs/block-keys.md): writes at most `cap` of them (32
/// bytes each) to `out` and returns how many full blocks there are.
///
/// # Safety
/// `tokens` points at `n_tokens` values, `seed` at `seed_len` bytes (or is
/// NULL with 0), `out` has room for `cap` hashes.
#[no_mangle]
pub unsafe extern "C" fn mc_block_hashes(
    tokens: *const u32,
    n_tokens: usize,
    block_tokens: usize,
    seed: *const u8,
    seed_len: usize,
    out: *mut u8,
    cap: usize,
) -> i64 {
    guard(|| {
        // SAFETY: the caller's promise.
        let (Some(tokens), Some(seed)) = (unsafe { slice(tokens, n_tokens) }, unsafe {
            slice(seed, seed_len)
        }) else {
            return status::INVALID_PARAMS;
        };
        if block_tokens == 0 || (out.is_null() && cap > 0) {
            return status::INVALID_PARAMS;
        }
        let chain = PrefixHasher::chain(seed, tokens, block_tokens, b"");
        for (i, h) in chain.iter().take(cap).enumerate() {
            // SAFETY: `out` has room for `cap` hashes.
            unsafe { std::ptr::copy_nonoverlapping(h.0.as_ptr(), out.add(i * 32), 32) };
        }
        chain.len() as i64
    })
}

/// Stores `n` blocks: key `i` is the `i`-th 32-byte hash of `keys`, its
/// value the `lens[i]` bytes at `values[i]`, in host memory or in a GPU's
/// (CUDA device memory, copied down through pinned staging); `results[i]`
/// gets 0 or a negative status.
///
/// # Safety
/// `client` is live; the arrays hold `n` entries; each value is readable
/// for its length.
#[no_mangle]
pub unsafe extern "C" fn mc_put(
    client: *const McClient,
    keys: *const u8,
    values: *const *const u8,
    lens: *const usize,
    n: usize,
    results: *mut i64,
) -> i64 {
    guard(|| {
        // SAFETY: the caller's promise, for each of these.
        let (Some(c), Some(hashes), Some(values), Some(lens)) = (
            unsafe { client.as_ref() },
            unsafe { hashes(keys, n) },
            unsafe { slice(values, n) },
            unsafe { slice(lens, n) },
        ) else {
            return status::INVALID_PARAMS;
        };
        if results.is_null() && n > 0 {
            return status::INVALID_PARAMS;
        }
        if values.iter().zip(lens).any(|(v, l)| v.is_null() && *l > 0) {
            return status::INVALID_PARAMS;
        }
        let blocks: Vec<(BlockHash, Vec<Span>)> = hashes
            .iter()
            .zip(values.iter().zip(lens))
            .map(|(h, (v, l))| (*h, vec![Span::new(*v as usize, *l)]))
            .collect();
        let opts = PutOptions::default();
        // SAFETY: each value is readable (host or GPU memory) for its
        // length, for the call.
        let put = unsafe { c.client.put_spans(&c.namespace, &blocks, None, &[], opts) };
        let out = match block_on(put) {
            Ok(outcomes) => outcomes.into_iter().map(status::of_put).collect(),
            Err(e) => {
                set_error(e.to_string());
                vec![status::of_error(&e); n]
            }
        };
        write_results(results, &out);
        status::OK
    })
}

/// Reads `n` blocks straight into caller buffers, in host memory or in a
/// GPU's (CUDA device memory, reached through pinned staging): `bufs[i]`
/// has room for `caps[i]` bytes; `results[i]` gets the bytes read or a
/// negative status
/// (`MC_OBJECT_NOT_FOUND` for a miss, `MC_INVALID_PARAMS` for a buffer
/// that is too small or overlaps another of the call).
///
/// # Safety
/// `client` is live; the arrays hold `n` entries; each buffer is writable
/// for its capacity.
#[no_mangle]
pub unsafe extern "C" fn mc_get_into(
    client: *const McClient,
    keys: *const u8,
    bufs: *const *mut u8,
    caps: *const usize,
    n: usize,
    results: *mut i64,
) -> i64 {
    guard(|| {
        // SAFETY: the caller's promise, for each of these.
        let (Some(c), Some(hashes), Some(bufs), Some(caps)) = (
            unsafe { client.as_ref() },
            unsafe { hashes(keys, n) },
            unsafe { slice(bufs, n) },
            unsafe { slice(caps, n) },
        ) else {
            return status::INVALID_PARAMS;
        };
        if results.is_null() && n > 0 {
            return status::INVALID_PARAMS;
        }
        let spans: Vec<(usize, usize)> = bufs
            .iter()
            .zip(caps)
            .map(|(b, c)| (*b as usize, *c))
            .collect();
        let refused: Vec<bool> = overlapping(&spans)
            .into_iter()
            .zip(&spans)
            .map(|(clash, (at, len))| clash || (*at == 0 && *len > 0))
            .collect();
        let items: Vec<(BlockHash, (usize, usize))> = hashes.into_iter().zip(spans).collect();
        let out = except(items, &refused, status::INVALID_PARAMS, |items| {
            let hashes: Vec<BlockHash> = items.iter().map(|(h, _)| *h).collect();
            let dest: Vec<Vec<Span>> = items
                .iter()
                .map(|(_, (at, len))| vec![Span::new(*at, *len)])
                .collect();
            // SAFETY: each buffer is writable (host or GPU memory) for its
            // capacity, and overlaps no other destination of the call.
            let get = unsafe { c.client.get_into_spans(&c.namespace, &hashes, &dest) };
            match block_on(get) {
                Ok(outcomes) => outcomes.into_iter().map(status::of_get).collect(),
                Err(e) => {
                    set_error(e.to_string());
                    vec![status::of_error(&e); items.len()]
                }
            }
        });
        write_results(results, &out);
        status::OK
    })
}

/// How many leading keys of a chain of `n` are stored (one round trip),
/// or a negative status.
///
/// # Safety
/// `client` is live; `keys` holds `n` hashes.
#[no_mangle]
pub unsafe extern "C" fn mc_match_prefix(
    client: *const McClient,
    keys: *const u8,
    n: usize,
) -> i64 {
    guard(|| {
        // SAFETY: the caller's promise.
        let (Some(c), Some(hashes)) = (unsafe { client.as_ref() }, unsafe { hashes(keys, n) })
        else {
            return status::INVALID_PARAMS;
        };
        match block_on(c.client.match_prefix(&c.namespace, &hashes)) {
            Ok(m) => m.matched as i64,
            Err(e) => {
                set_error(e.to_string());
                status::of_error(&e)
            }
        }
    })
}

/// Removes `n` keys, whether a lease holds them or not (Mooncake's
/// `remove` with `force`); `results[i]` gets 0, or `MC_OBJECT_NOT_FOUND`
/// for a key that was not stored.
///
/// # Safety
/// `client` is live; `keys` holds `n` hashes, `results` room for `n`.
#[no_mangle]
pub unsafe extern "C" fn mc_remove(
    client: *const McClient,
    keys: *const u8,
    n: usize,
    results: *mut i64,
) -> i64 {
    guard(|| {
        // SAFETY: the caller's promise.
        let (Some(c), Some(hashes)) = (unsafe { client.as_ref() }, unsafe { hashes(keys, n) })
        else {
            return status::INVALID_PARAMS;
        };
        if results.is_null() && n > 0 {
            return status::INVALID_PARAMS;
        }
        let out: Vec<i64> = match block_on(c.client.remove(&c.namespace, &hashes)) {
            Ok(codes) => codes.into_iter().map(status::of_code).collect(),
            Err(e) => {
                set_error(e.to_string());
                vec![status::of_error(&e); n]
            }
        };
        write_results(results, &out);
        status::OK
    })
}

fn write_results(results: *mut i64, out: &[i64]) {
    if !out.is_empty() {
        // SAFETY: checked non-NULL by the callers, with room for every key.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), results, out.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_statuses_are_the_shared_ones() {
        let exported = [
            MC_OK,
            MC_INTERNAL_ERROR,
            MC_NO_AVAILABLE_HANDLE,
            MC_INVALID_KEY,
            MC_WRITE_FAIL,
            MC_INVALID_PARAMS,
            MC_ILLEGAL_CLIENT,
            MC_OBJECT_NOT_FOUND,
            MC_OBJECT_HAS_LEASE,
            MC_TRANSFER_FAIL,
            MC_RPC_FAIL,
        ];
        let shared: Vec<i64> = status::NAMED.iter().map(|(_, c)| *c).collect();
        assert_eq!(exported.to_vec(), shared);
    }

    #[test]
    fn the_committed_header_is_the_generated_one() {
        let generated = include_str!(concat!(env!("OUT_DIR"), "/mooncake.h"));
        let committed = std::fs::read_to_string(
            std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap())
                .join("include/mooncake.h"),
        )
        .unwrap_or_default();
        assert!(
            committed == generated,
            "include/mooncake.h is stale: copy it from {}/mooncake.h",
            env!("OUT_DIR")
        );
    }
}
