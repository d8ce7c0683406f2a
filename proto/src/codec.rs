//! Little-endian body encoding: an append-only writer and a bounds-checked
//! reader. The reader never allocates more than the bytes it was given.

use crate::error::ProtoError;
use crate::frame::MAX_BATCH;
use crate::key::{BlockHash, Namespace};

/// Appends fields to a body.
#[derive(Default, Debug)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Writer::default()
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn hash(&mut self, h: &BlockHash) {
        self.buf.extend_from_slice(&h.0);
    }
    /// A string of at most 65535 bytes, u16 length first.
    pub fn str(&mut self, s: &str) {
        let len = u16::try_from(s.len()).expect("strings on the wire are short");
        self.u16(len);
        self.buf.extend_from_slice(s.as_bytes());
    }
    pub fn namespace(&mut self, ns: &Namespace) {
        self.str(ns.as_str());
    }
    /// A batch length; callers keep batches within `MAX_BATCH`.
    pub fn count(&mut self, n: usize) {
        debug_assert!(n <= MAX_BATCH, "batch of {n} exceeds MAX_BATCH");
        self.u32(n as u32);
    }
}

/// Reads fields from a body, failing with `Truncated` on short input.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.buf.len() < n {
            return Err(ProtoError::Truncated {
                needed: n - self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.take(1)?[0])
    }
    /// A byte that must be 0 or 1; `field` names it in the refusal.
    pub fn bool(&mut self, field: &'static str) -> Result<bool, ProtoError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(ProtoError::Invalid {
                field,
                why: format!("{v} is not a boolean"),
            }),
        }
    }
    pub fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub fn hash(&mut self) -> Result<BlockHash, ProtoError> {
        Ok(BlockHash(self.take(32)?.try_into().expect("32")))
    }
    pub fn str(&mut self) -> Result<&'a str, ProtoError> {
        let len = self.u16()? as usize;
        std::str::from_utf8(self.take(len)?).map_err(|e| ProtoError::Invalid {
            field: "string",
            why: e.to_string(),
        })
    }
    pub fn namespace(&mut self) -> Result<Namespace, ProtoError> {
        Namespace::new(self.str()?)
    }
    /// A batch length, refused past `MAX_BATCH` or past what the remaining
    /// bytes could hold at `min_item` bytes an item (so a forged count never
    /// makes the reader reserve memory the body does not back).
    pub fn count(&mut self, min_item: usize) -> Result<usize, ProtoError> {
        let n = self.u32()? as usize;
        if n > MAX_BATCH {
            return Err(ProtoError::TooLarge {
                len: n as u64,
                limit: MAX_BATCH as u64,
            });
        }
        if n.saturating_mul(min_item.max(1)) > self.remaining() {
            return Err(ProtoError::Truncated {
                needed: n * min_item.max(1) - self.remaining(),
            });
        }
        Ok(n)
    }
    /// Fails if bytes are left over: a body must be consumed exactly.
    pub fn finish(self) -> Result<(), ProtoError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::TrailingBytes(self.buf.len()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let mut w = Writer::new();
        w.u8(1);
        w.u16(2);
        w.u32(3);
        w.u64(4);
        w.str("héllo");
        w.hash(&BlockHash([7; 32]));
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8().unwrap(), 1);
        assert_eq!(r.u16().unwrap(), 2);
        assert_eq!(r.u32().unwrap(), 3);
        assert_eq!(r.u64().unwrap(), 4);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.hash().unwrap(), BlockHash([7; 32]));
        r.finish().unwrap();
    }

    #[test]
    fn forged_count_is_refused_without_allocating() {
        let mut w = Writer::new();
        w.u32(4000);
        let mut r = Reader::new(&w.buf);
        assert!(matches!(r.count(32), Err(ProtoError::Truncated { .. })));
        let mut w = Writer::new();
        w.u32(u32::MAX);
        assert!(matches!(
            Reader::new(&w.buf).count(0),
            Err(ProtoError::TooLarge { .. })
        ));
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        assert!(Reader::new(&[1]).finish().is_err());
    }
}
