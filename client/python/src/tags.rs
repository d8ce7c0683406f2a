//! Engine tags from Python: what the engine calls each block (its own
//! block hash, the tokens the block holds), attached to a put so that the
//! store's events name blocks as the engine's own events do.

use std::sync::Arc;

use mooncake_proto::message::{EngineHash, EngineTag, MAX_OBJECT_KEY_LEN};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString};

/// One tag per key from `tags` (`None`: no key tagged): each `None`, or
/// `(hash, token_ids)` with `hash` an int (0 to 2**64-1), bytes (1 to 64),
/// a str (its UTF-8 bytes) or `None`, and `token_ids` a sequence of ints
/// or `None`.
pub fn tags_of(
    tags: Option<&Bound<'_, PyAny>>,
    keys: usize,
) -> PyResult<Vec<Option<Arc<EngineTag>>>> {
    let Some(tags) = tags.filter(|t| !t.is_none()) else {
        return Ok(Vec::new());
    };
    let tags: Vec<Option<Arc<EngineTag>>> = tags
        .try_iter()?
        .enumerate()
        .map(|(i, t)| tag_of(&t?).map_err(|e| PyValueError::new_err(format!("tags[{i}]: {e}"))))
        .collect::<PyResult<_>>()?;
    if tags.len() != keys {
        return Err(PyValueError::new_err(format!(
            "{keys} keys and {} tags",
            tags.len()
        )));
    }
    Ok(tags)
}

fn tag_of(tag: &Bound<'_, PyAny>) -> PyResult<Option<Arc<EngineTag>>> {
    if tag.is_none() {
        return Ok(None);
    }
    let (hash, tokens): (Bound<'_, PyAny>, Bound<'_, PyAny>) = tag
        .extract()
        .map_err(|_| PyValueError::new_err("a tag is None or a pair (hash, token_ids)"))?;
    let hash = if hash.is_none() {
        None
    } else if hash.is_instance_of::<PyInt>() {
        let n: u64 = hash
            .extract()
            .map_err(|_| PyValueError::new_err("an integer hash is 0 to 2**64-1"))?;
        Some(EngineHash::Int(n))
    } else if let Ok(b) = hash.cast::<PyBytes>() {
        Some(EngineHash::Bytes(b.as_bytes().into()))
    } else if let Ok(s) = hash.cast::<PyString>() {
        Some(EngineHash::Bytes(s.to_str()?.as_bytes().into()))
    } else {
        return Err(PyValueError::new_err(
            "a hash is an int, bytes, a str or None",
        ));
    };
    let token_ids: Vec<u32> = if tokens.is_none() {
        Vec::new()
    } else {
        tokens.extract().map_err(|_| {
            PyValueError::new_err("token_ids is a sequence of ints from 0 to 2**32-1")
        })?
    };
    EngineTag::new(hash, token_ids)
        .map(|t| Some(Arc::new(t)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `tags` (one per key, or none) with the text of each `str` key attached
/// (`EngineTag::key`): Mooncake's event format names blocks by the key
/// they were stored under. A key past `MAX_OBJECT_KEY_LEN` bytes goes
/// without (its events name it by the store's hash).
pub fn with_keys(
    tags: Vec<Option<Arc<EngineTag>>>,
    keys: &Bound<'_, PyAny>,
    count: usize,
) -> PyResult<Vec<Option<Arc<EngineTag>>>> {
    let mut out = tags;
    for (i, key) in keys.try_iter()?.enumerate() {
        let key = key?;
        if !key_fits(&key) {
            continue;
        }
        if out.is_empty() {
            out = vec![None; count];
        }
        let Some(slot) = out.get_mut(i) else { break };
        *slot = with_key(slot.take(), &key)?;
    }
    Ok(out)
}

/// Whether `key` is text a tag can carry.
fn key_fits(key: &Bound<'_, PyAny>) -> bool {
    key.cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok())
        .is_some_and(|s| s.len() <= MAX_OBJECT_KEY_LEN)
}

/// `tag` (or an empty one) naming `key`, if `key` is text a tag can
/// carry; `tag` as it was otherwise.
pub fn with_key(
    tag: Option<Arc<EngineTag>>,
    key: &Bound<'_, PyAny>,
) -> PyResult<Option<Arc<EngineTag>>> {
    if !key_fits(key) {
        return Ok(tag);
    }
    let text = key.cast::<PyString>()?.to_str()?;
    let bare = tag.as_deref().cloned().unwrap_or_default();
    let tagged = bare
        .with_key(text)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Some(Arc::new(tagged)))
}
