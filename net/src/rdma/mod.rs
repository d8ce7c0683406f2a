//! RDMA (feature `rdma`), on rdma-core's libibverbs, which `sideway` loads
//! at run time: the same binary runs on hosts with and without RDMA, and
//! says why a host has none.
//!
//! - `nic`: a NIC opened for use, memory registration, queue pairs.
//! - `regions`: where pool bytes lie in a daemon's registered regions.
//! - `registered`: caller memory registered once, read into and written
//!   from with no copy.
//!
//! The client's data path over RDMA is `client/src/transport/rdma.rs`; the
//! daemon's side is `store/src/rdma.rs`.

pub mod nic;
pub mod regions;
pub mod registered;

pub use nic::{MemoryRegion, Nic, NicChoice, Queue};
pub use registered::Registered;

use sideway::ibverbs::device::{DeviceInfo, DeviceList};

/// One RDMA device, as libibverbs names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    pub name: String,
    /// The link layer family: InfiniBand, iWARP, ...
    pub transport: String,
}

/// The devices this host has; an error saying why there are none usable
/// (no kernel support, no libibverbs, no device).
pub fn devices() -> Result<Vec<RdmaDevice>, String> {
    let list = DeviceList::new().map_err(|err| {
        let cause = std::error::Error::source(&err)
            .map(|e| e.to_string())
            .unwrap_or_default();
        format!("no RDMA: listing devices failed ({cause}); the kernel or libibverbs lacks RDMA support")
    })?;
    let found: Vec<RdmaDevice> = list
        .iter()
        .map(|d| RdmaDevice {
            name: d.name(),
            transport: d.transport_type().to_string(),
        })
        .collect();
    if found.is_empty() {
        return Err("no RDMA: libibverbs lists no device".to_string());
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the host has, discovery answers (a list, or one line
    /// saying why not) and never panics.
    #[test]
    fn discovery_answers_cleanly() {
        match devices() {
            Ok(found) => assert!(found.iter().all(|d| !d.name.is_empty())),
            Err(why) => {
                assert!(why.starts_with("no RDMA: "), "{why}");
                assert!(!why.contains('\n'), "{why}");
            }
        }
    }

    /// These build machines have no RDMA device (the kernel has no RDMA
    /// support); set MOONCAKE_EXPECT_RDMA=1 on a host that has one.
    #[test]
    fn this_host_reports_what_it_has() {
        let expect = std::env::var("MOONCAKE_EXPECT_RDMA").is_ok_and(|v| v == "1");
        assert_eq!(devices().is_ok(), expect, "{:?}", devices());
    }
}
