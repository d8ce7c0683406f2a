//! Bytes from the disk: an NVMe index entry as RocksDB hands it back after
//! a crash or a corruption. Recovery either understands it or drops it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let split = data[0] as usize % data.len();
    let (key, value) = data[1..].split_at(split.min(data.len() - 1));
    if let Some((k, _offset, _len, _sum)) = mooncake_store_daemon::nvme::decode_index_entry(key, value) {
        assert!(!k.namespace.as_str().is_empty());
    }
});
