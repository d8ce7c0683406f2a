//! The same-host block index: a table in shared memory where a daemon
//! publishes where each of its DRAM blocks lies (offset, length, checksum),
//! so that a client on the same host finds a block and copies it out of
//! the shared pool without sending a single message.
//!
//! One writer (the daemon, under its pool lock) and any number of readers
//! in other processes. Each slot is a seqlock: the writer makes the slot's
//! sequence odd while it changes the slot; a reader that sees the sequence
//! odd, or changed across its read, reads the slot again. What a reader
//! finds is only a hint: the block may be evicted and its space reused
//! while the client copies it. The client checks the bytes it copied
//! against the checksum the meta service gave for the block, so such a
//! copy is a miss on this path (the client then leases the block), never
//! wrong bytes.
//!
//! Layout, in 8-byte words (little-endian, as the machine's atomics):
//! a header slot (`MAGIC`, version, bucket count), then `buckets` buckets
//! of `BUCKET_SLOTS` slots of `SLOT_WORDS` words: sequence, key digest
//! (two words, zero for an empty slot), offset, length, checksum, two
//! spare. A key lives in the bucket its digest names; a full bucket leaves
//! the block unpublished (readers lease it instead).

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::BlockKey;

/// Words per slot: one cache line.
pub const SLOT_WORDS: usize = 8;
/// Slots per bucket: a lookup reads one bucket (512 bytes).
pub const BUCKET_SLOTS: usize = 8;
const MAGIC: u64 = u64::from_le_bytes(*b"MCSHMIX1");
const VERSION: u64 = 1;
/// Reads of a slot that keeps changing before the reader gives up on it.
const RETRIES: usize = 8;

/// Where a published block lies in the shared pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub offset: u64,
    pub len: u64,
    pub checksum: u64,
}

/// A key's 128-bit digest, never zero (zero marks an empty slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digest([u64; 2]);

impl Digest {
    pub fn of(key: &BlockKey) -> Digest {
        let mut h = twox_hash::XxHash3_128::new();
        h.write(key.namespace.as_str().as_bytes());
        h.write(&[0xff]);
        h.write(&key.hash.0);
        let d = h.finish_128();
        let (lo, hi) = (d as u64, (d >> 64) as u64);
        Digest([if lo == 0 && hi == 0 { 1 } else { lo }, hi])
    }
}

/// Buckets for a pool of `pool_bytes`: a slot per 32 KiB of pool (blocks
/// of KV caches are larger), at least 512 buckets, at most 2^18 (128 MiB).
pub fn buckets_for(pool_bytes: u64) -> usize {
    let slots = (pool_bytes / (32 << 10)).max(1) as usize;
    (slots / BUCKET_SLOTS)
        .next_power_of_two()
        .clamp(512, 1 << 18)
}

/// Bytes of a table of `buckets` buckets.
pub fn bytes_for(buckets: usize) -> usize {
    (1 + buckets * BUCKET_SLOTS) * SLOT_WORDS * 8
}

/// A view of an index table in memory this process has mapped.
pub struct IndexTable {
    words: NonNull<AtomicU64>,
    buckets: usize,
}

// SAFETY: every access goes through atomics; the memory outlives the view
// by the constructors' contracts.
unsafe impl Send for IndexTable {}
unsafe impl Sync for IndexTable {}

impl IndexTable {
    /// Lays out an empty table of `buckets` (a power of two) at `ptr`.
    ///
    /// # Safety
    /// `ptr` is 8-byte aligned, points to `bytes_for(buckets)` writable
    /// bytes that outlive the table, and no one else writes them.
    pub unsafe fn init(ptr: NonNull<u8>, buckets: usize) -> IndexTable {
        assert!(buckets.is_power_of_two(), "buckets must be a power of two");
        let table = IndexTable {
            words: ptr.cast(),
            buckets,
        };
        for i in 0..bytes_for(buckets) / 8 {
            table.word(i).store(0, Ordering::Relaxed);
        }
        table.word(1).store(VERSION, Ordering::Relaxed);
        table.word(2).store(buckets as u64, Ordering::Relaxed);
        // Readers check the magic last written.
        table.word(0).store(MAGIC, Ordering::Release);
        table
    }

    /// Reads the layout of a table another process laid out in `len`
    /// bytes at `ptr`; `None` if it is not one (or not this version).
    ///
    /// # Safety
    /// `ptr` is 8-byte aligned and points to `len` readable bytes that
    /// outlive the table (read-only memory will do: readers only load).
    pub unsafe fn attach(ptr: NonNull<u8>, len: usize) -> Option<IndexTable> {
        if len < SLOT_WORDS * 8 {
            return None;
        }
        let words: NonNull<AtomicU64> = ptr.cast();
        // SAFETY: within the first slot, which `len` covers.
        let load = |i: usize| unsafe { words.add(i).as_ref() }.load(Ordering::Acquire);
        if load(0) != MAGIC || load(1) != VERSION {
            return None;
        }
        let buckets = usize::try_from(load(2)).ok()?;
        if !buckets.is_power_of_two() || bytes_for(buckets) > len {
            return None;
        }
        Some(IndexTable { words, buckets })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < bytes_for(self.buckets) / 8);
        // SAFETY: in bounds (the layout), and alive by the constructors'
        // contracts.
        unsafe { self.words.add(i).as_ref() }
    }

    /// The first word of each slot of `digest`'s bucket.
    fn bucket(&self, digest: Digest) -> impl Iterator<Item = usize> {
        let bucket = digest.0[0] as usize & (self.buckets - 1);
        let first = SLOT_WORDS * (1 + bucket * BUCKET_SLOTS);
        (0..BUCKET_SLOTS).map(move |s| first + s * SLOT_WORDS)
    }

    /// Where the block of `digest` lies, if published.
    pub fn lookup(&self, digest: Digest) -> Option<Entry> {
        for slot in self.bucket(digest) {
            if let Some(entry) = self.read_slot(slot, digest) {
                return Some(entry);
            }
        }
        None
    }

    /// The slot's entry if it holds `digest`, read consistently.
    fn read_slot(&self, slot: usize, digest: Digest) -> Option<Entry> {
        for _ in 0..RETRIES {
            let before = self.word(slot).load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let found = [
                self.word(slot + 1).load(Ordering::Relaxed),
                self.word(slot + 2).load(Ordering::Relaxed),
            ];
            let entry = Entry {
                offset: self.word(slot + 3).load(Ordering::Relaxed),
                len: self.word(slot + 4).load(Ordering::Relaxed),
                checksum: self.word(slot + 5).load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if self.word(slot).load(Ordering::Relaxed) != before {
                continue;
            }
            return (found == digest.0).then_some(entry);
        }
        None
    }

    /// Publishes (or moves) the block of `digest`; `false` when its bucket
    /// is full. Writer only: one caller at a time.
    pub fn publish(&self, digest: Digest, entry: Entry) -> bool {
        let mut free = None;
        for slot in self.bucket(digest) {
            let held = self.digest_at(slot);
            if held == digest.0 {
                self.write_slot(slot, digest.0, entry);
                return true;
            }
            if held == [0, 0] && free.is_none() {
                free = Some(slot);
            }
        }
        match free {
            Some(slot) => {
                self.write_slot(slot, digest.0, entry);
                true
            }
            None => false,
        }
    }

    /// Takes the block of `digest` out of the table; `false` if it was not
    /// in it. Writer only.
    pub fn withdraw(&self, digest: Digest) -> bool {
        let Some(slot) = self.bucket(digest).find(|s| self.digest_at(*s) == digest.0) else {
            return false;
        };
        let empty = Entry {
            offset: 0,
            len: 0,
            checksum: 0,
        };
        self.write_slot(slot, [0, 0], empty);
        true
    }

    fn digest_at(&self, slot: usize) -> [u64; 2] {
        [
            self.word(slot + 1).load(Ordering::Relaxed),
            self.word(slot + 2).load(Ordering::Relaxed),
        ]
    }

    fn write_slot(&self, slot: usize, digest: [u64; 2], entry: Entry) {
        let seq = self.word(slot).load(Ordering::Relaxed);
        self.word(slot).store(seq + 1, Ordering::Relaxed);
        // The odd sequence is visible before any of the changes below.
        fence(Ordering::Release);
        self.word(slot + 1).store(digest[0], Ordering::Relaxed);
        self.word(slot + 2).store(digest[1], Ordering::Relaxed);
        self.word(slot + 3).store(entry.offset, Ordering::Relaxed);
        self.word(slot + 4).store(entry.len, Ordering::Relaxed);
        self.word(slot + 5).store(entry.checksum, Ordering::Relaxed);
        self.word(slot).store(seq + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockHash, Namespace};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn key(i: u64) -> BlockKey {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&i.to_le_bytes());
        BlockKey::new(Namespace::new("ns").unwrap(), BlockHash(h))
    }

    /// Memory for a table, 8-byte aligned.
    fn memory(buckets: usize) -> Vec<u64> {
        vec![0u64; bytes_for(buckets) / 8]
    }

    fn table(mem: &mut [u64], buckets: usize) -> IndexTable {
        // SAFETY: the vector is aligned, large enough and outlives the test.
        unsafe { IndexTable::init(NonNull::new(mem.as_mut_ptr().cast()).unwrap(), buckets) }
    }

    /// The entry a test publishes for key `i`: every field derived from
    /// `i`, so that a mixed read shows.
    fn entry(i: u64, version: u64) -> Entry {
        Entry {
            offset: i * 1000 + version,
            len: i * 7 + version,
            checksum: i ^ (version << 32),
        }
    }

    #[test]
    fn published_blocks_are_found_and_withdrawn_ones_are_not() {
        let mut mem = memory(512);
        let t = table(&mut mem, 512);
        for i in 0..1000 {
            assert!(t.publish(Digest::of(&key(i)), entry(i, 0)));
        }
        for i in 0..1000 {
            assert_eq!(t.lookup(Digest::of(&key(i))), Some(entry(i, 0)), "key {i}");
        }
        assert_eq!(t.lookup(Digest::of(&key(5000))), None);
        for i in (0..1000).step_by(2) {
            assert!(t.withdraw(Digest::of(&key(i))));
        }
        assert!(!t.withdraw(Digest::of(&key(0))));
        for i in 0..1000 {
            let found = t.lookup(Digest::of(&key(i)));
            assert_eq!(found.is_some(), i % 2 == 1, "key {i}");
        }
        // Publishing again moves the entry instead of adding a second one.
        assert!(t.publish(Digest::of(&key(1)), entry(1, 9)));
        assert_eq!(t.lookup(Digest::of(&key(1))), Some(entry(1, 9)));
        assert!(t.withdraw(Digest::of(&key(1))));
        assert_eq!(t.lookup(Digest::of(&key(1))), None);
    }

    #[test]
    fn a_full_bucket_refuses_and_frees_up_on_withdraw() {
        let mut mem = memory(512);
        let t = table(&mut mem, 512);
        // Keys whose digests share bucket 0.
        let same: Vec<u64> = (0..)
            .filter(|i| Digest::of(&key(*i)).0[0] & 511 == 0)
            .take(BUCKET_SLOTS + 1)
            .collect();
        for i in &same[..BUCKET_SLOTS] {
            assert!(t.publish(Digest::of(&key(*i)), entry(*i, 0)));
        }
        let last = same[BUCKET_SLOTS];
        assert!(!t.publish(Digest::of(&key(last)), entry(last, 0)));
        assert_eq!(t.lookup(Digest::of(&key(last))), None);
        assert!(t.withdraw(Digest::of(&key(same[3]))));
        assert!(t.publish(Digest::of(&key(last)), entry(last, 0)));
        assert_eq!(t.lookup(Digest::of(&key(last))), Some(entry(last, 0)));
    }

    #[test]
    fn attach_reads_the_layout_and_refuses_other_memory() {
        let mut mem = memory(1024);
        let _t = table(&mut mem, 1024);
        let ptr = NonNull::new(mem.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: as above.
        let seen = unsafe { IndexTable::attach(ptr, bytes_for(1024)) }.expect("a table");
        assert_eq!(seen.buckets, 1024);
        assert!(unsafe { IndexTable::attach(ptr, bytes_for(512)) }.is_none());
        let mut junk = vec![7u64; 64];
        let junk_ptr = NonNull::new(junk.as_mut_ptr().cast::<u8>()).unwrap();
        assert!(unsafe { IndexTable::attach(junk_ptr, 512) }.is_none());
    }

    #[test]
    fn sizes_follow_the_pool() {
        assert_eq!(buckets_for(0), 512);
        assert_eq!(buckets_for(4 << 30), 16384);
        assert_eq!(buckets_for(1 << 50), 1 << 18);
        assert_eq!(bytes_for(512), (1 + 512 * 8) * 64);
    }

    /// A reader racing the writer never sees an entry mixed from two
    /// writes, nor a key's entry under another key.
    #[test]
    fn readers_never_see_a_torn_entry() {
        let mut mem = memory(512);
        let t = Arc::new(table(&mut mem, 512));
        let stop = Arc::new(AtomicBool::new(false));
        let keys = 64u64;
        // Full passes over the keys each reader made; the writer goes on
        // until every reader made a few while it wrote, however the
        // threads were scheduled.
        let passes: Arc<Vec<AtomicU64>> = Arc::new((0..2).map(|_| AtomicU64::new(0)).collect());
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (t, stop, passes) = (t.clone(), stop.clone(), passes.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        for i in 0..keys {
                            if let Some(e) = t.lookup(Digest::of(&key(i))) {
                                let version = e.offset.wrapping_sub(i * 1000);
                                assert_eq!(e, entry(i, version), "key {i}");
                            }
                        }
                        passes[r].fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let started: Vec<u64> = passes.iter().map(|p| p.load(Ordering::Relaxed)).collect();
        let mut round = 0u64;
        while round < 20_000
            || passes
                .iter()
                .zip(&started)
                .any(|(p, s)| p.load(Ordering::Relaxed) < s + 3)
        {
            let i = round % keys;
            if round % 3 == 0 {
                t.withdraw(Digest::of(&key(i)));
            } else {
                t.publish(Digest::of(&key(i)), entry(i, round));
            }
            round += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().expect("a reader saw a torn entry");
        }
        drop(t);
        drop(mem);
    }
}
