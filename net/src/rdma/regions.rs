//! Where bytes of a daemon's pool lie in the daemon's memory, as one-sided
//! RDMA addresses them. The pool is registered as one or more regions (split
//! where a NIC limits a region's size); a block may cross from one region
//! into the next, and is then read or written in one piece per region.

use mooncake_proto::message::{RdmaRegion, MAX_RDMA_REGIONS};

/// Pieces of at most `max` bytes covering `len` bytes, in order, as
/// `(offset, len)`.
pub fn split(len: u64, max: u64) -> Vec<(u64, u64)> {
    let max = max.max(1);
    let mut pieces = Vec::with_capacity(len.div_ceil(max) as usize);
    let mut offset = 0;
    while offset < len {
        let piece = max.min(len - offset);
        pieces.push((offset, piece));
        offset += piece;
    }
    pieces
}

/// One remote piece of a block: `len` bytes at `addr` (under `rkey`), which
/// are the block's bytes from `skip` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
    pub skip: u64,
}

/// A daemon's pool as its regions describe it, checked once when the
/// connection is made: they must cover the pool from offset 0 in order,
/// with no gap.
#[derive(Debug, Clone)]
pub struct RemotePool {
    regions: Vec<RdmaRegion>,
    len: u64,
}

impl RemotePool {
    pub fn new(regions: Vec<RdmaRegion>) -> Result<RemotePool, String> {
        if regions.is_empty() || regions.len() > MAX_RDMA_REGIONS {
            return Err(format!(
                "{} regions (1 to {MAX_RDMA_REGIONS})",
                regions.len()
            ));
        }
        let mut next = 0u64;
        for r in &regions {
            if r.offset != next || r.len == 0 {
                return Err(format!(
                    "region at offset {} of {} bytes where offset {next} was due",
                    r.offset, r.len
                ));
            }
            if r.addr.checked_add(r.len).is_none() {
                return Err(format!("region at {:#x} of {} bytes wraps", r.addr, r.len));
            }
            next = r.offset.checked_add(r.len).ok_or("regions overflow")?;
        }
        Ok(RemotePool { regions, len: next })
    }

    /// Bytes of the pool.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: a pool has at least one region, of at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remote pieces of `len` bytes at `offset` of the pool, one per
    /// region they touch; an error if they do not lie in the pool.
    pub fn spans(&self, offset: u64, len: u64) -> Result<Vec<Span>, String> {
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= self.len)
            .ok_or_else(|| format!("{len} bytes at {offset} lie outside a pool of {}", self.len))?;
        // The region holding `offset`: the last one starting at or before it.
        let mut i = self.regions.partition_point(|r| r.offset <= offset) - 1;
        let mut spans = Vec::new();
        let mut at = offset;
        while at < end {
            let r = &self.regions[i];
            let piece = (r.offset + r.len).min(end) - at;
            spans.push(Span {
                addr: r.addr + (at - r.offset),
                rkey: r.rkey,
                len: u32::try_from(piece).map_err(|_| format!("a piece of {piece} bytes"))?,
                skip: at - offset,
            });
            at += piece;
            i += 1;
        }
        Ok(spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pool(len: u64, max: u64) -> RemotePool {
        let regions = split(len, max)
            .into_iter()
            .enumerate()
            .map(|(i, (offset, len))| RdmaRegion {
                offset,
                len,
                // Regions need not be adjacent in the daemon's memory.
                addr: 0x1000_0000 * (i as u64 + 1) + offset,
                rkey: 100 + i as u32,
            })
            .collect();
        RemotePool::new(regions).unwrap()
    }

    #[test]
    fn split_covers_in_order_with_pieces_at_most_max() {
        assert_eq!(split(10, 4), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(split(8, 4), vec![(0, 4), (4, 4)]);
        assert_eq!(split(3, 4), vec![(0, 3)]);
        assert!(split(0, 4).is_empty());
    }

    #[test]
    fn a_block_inside_one_region_is_one_span() {
        let p = pool(100, 40);
        assert_eq!(
            p.spans(42, 10).unwrap(),
            vec![Span {
                addr: 0x2000_0000 + 42,
                rkey: 101,
                len: 10,
                skip: 0
            }]
        );
    }

    #[test]
    fn a_block_across_regions_is_read_in_one_piece_per_region() {
        let p = pool(100, 40);
        let spans = p.spans(30, 60).unwrap();
        assert_eq!(
            spans,
            vec![
                Span {
                    addr: 0x1000_0000 + 30,
                    rkey: 100,
                    len: 10,
                    skip: 0
                },
                Span {
                    addr: 0x2000_0000 + 40,
                    rkey: 101,
                    len: 40,
                    skip: 10
                },
                Span {
                    addr: 0x3000_0000 + 80,
                    rkey: 102,
                    len: 10,
                    skip: 50
                },
            ]
        );
    }

    #[test]
    fn bytes_outside_the_pool_are_refused() {
        let p = pool(100, 40);
        assert!(p.spans(95, 10).is_err());
        assert!(p.spans(u64::MAX, 2).is_err());
        assert!(p.spans(0, 100).is_ok());
    }

    #[test]
    fn regions_with_a_gap_or_overlap_are_refused() {
        let r = |offset, len| RdmaRegion {
            offset,
            len,
            addr: 0x1000,
            rkey: 1,
        };
        assert!(RemotePool::new(vec![]).is_err());
        assert!(RemotePool::new(vec![r(0, 10), r(11, 10)]).is_err());
        assert!(RemotePool::new(vec![r(0, 10), r(5, 10)]).is_err());
        assert!(RemotePool::new(vec![r(1, 10)]).is_err());
        assert!(RemotePool::new(vec![r(0, 0)]).is_err());
        assert_eq!(RemotePool::new(vec![r(0, 10), r(10, 5)]).unwrap().len(), 15);
    }

    proptest! {
        /// Spans cover exactly the asked bytes, in order, each inside one
        /// region, at the address that region gives them.
        #[test]
        fn spans_cover_the_block_exactly(
            len in 1u64..10_000,
            // At least 3 bytes a region: at most 3,333 regions (the wire
            // allows 4,096).
            max in 3u64..3_000,
            at in 0u64..10_000,
            n in 0u64..10_000,
        ) {
            let p = pool(len, max);
            let (at, n) = (at % len, n % (len - at % len) + 1);
            let spans = p.spans(at, n).unwrap();
            let mut skip = 0;
            for s in &spans {
                prop_assert_eq!(s.skip, skip);
                let offset = at + s.skip;
                let region = p.regions.iter().find(|r| r.rkey == s.rkey).unwrap();
                prop_assert!(offset >= region.offset);
                prop_assert!(offset + s.len as u64 <= region.offset + region.len);
                prop_assert_eq!(s.addr, region.addr + (offset - region.offset));
                skip += s.len as u64;
            }
            prop_assert_eq!(skip, n);
        }
    }
}
