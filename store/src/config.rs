//! The daemon's configuration: one TOML table, every field defaulted.

use std::time::Duration;

use mooncake_proto::units::{ByteSize, HumanDuration};
use mooncake_server::{Deadlines, Limits, TlsFiles};
use serde::{Deserialize, Serialize};

use crate::pool::{Eviction, PoolConfig, PROBATION_SHARE};
use crate::server::DataConfig;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Data port. Default `127.0.0.1:7071`.
    pub listen: String,
    /// Admin port: `/metrics` and `/health` over HTTP. Default
    /// `127.0.0.1:9071`; empty to serve none.
    pub admin: String,
    /// Token a scrape must present (`Authorization: Bearer TOKEN`, as
    /// Prometheus's `authorization` setting sends it) to read `/metrics`,
    /// which names tenants; `/health` stays open. Default none: anyone who
    /// reaches the admin port reads it (it binds to loopback by default).
    pub metrics_token: Option<String>,
    /// Address clients are told to use. Default: the bound address.
    pub advertise: Option<String>,
    /// This host's name in the cluster. Default: the hostname.
    pub node: String,
    /// Size of the DRAM pool, allocated once at start. Default 1GiB (or a
    /// quarter of the available memory, if less).
    pub dram: ByteSize,
    /// Largest block accepted. Default 256MiB (and never more than the pool).
    pub max_block: ByteSize,
    /// A put that would fill the pool past this share evicts what it
    /// needs first. Default 1.0: all of the pool holds blocks.
    pub high_watermark: f64,
    /// Ignored (eviction now frees only what a put needs); still accepted
    /// so that older config files load.
    pub low_watermark: Option<f64>,
    /// Which blocks go first when room is needed, in DRAM and on the NVMe
    /// drives: "2q" (default: new blocks wait in probation until read
    /// again, reused ones stay in main; see docs/operations.md) or "lru"
    /// (least recently used chain tail first).
    pub eviction: Eviction,
    /// Under "2q", the share of the pool (and of each drive) that new
    /// blocks, not yet read again, may hold. Default 0.05.
    pub probation_share: f64,
    /// Back the pool with huge pages when the host has them. Default true.
    pub hugepages: bool,
    /// Touch every page of the pool at start, so that no request pays for
    /// a page fault and the memory is really there. Default true.
    pub prefault: bool,
    /// Verify each block's checksum before sending it. Default false: every
    /// client verifies what it receives and reports a mismatch, upon which
    /// the daemon checks its copy and drops it if corrupt.
    pub verify_on_read: bool,
    /// Most concurrent client connections; more are refused. Default 1024.
    pub max_connections: usize,
    /// Most concurrent connections from one client address, so that one
    /// host cannot take them all. Default 256.
    pub max_connections_per_client: usize,
    /// Longest time one request may take once its header arrived, reading
    /// its body and writing its answer included. Default 30s.
    pub request_timeout: HumanDuration,
    /// With `auth`: how long a connection may take, from accept, to present
    /// a valid token; then it is closed. Default 5s.
    pub auth_timeout: HumanDuration,
    /// A connection with no request for this long is closed (clients open
    /// another when they need one). Default 300s.
    pub idle_timeout: HumanDuration,
    /// A put whose value stops arriving (no 128 KiB piece) for this long is
    /// dropped and its room freed: a header alone holds room only briefly.
    /// Default 5s.
    pub put_stall_timeout: HumanDuration,
    /// How long a client that found a block (Mooncake's `batch_is_exist`,
    /// which vLLM's and SGLang's connectors call before they load) keeps
    /// it from eviction, so that the load finds it; as Mooncake's master
    /// flag `default_kv_lease_ttl`. A lookup again extends it. Leases hold
    /// at most half the DRAM pool; past it a block found is not leased, so
    /// puts always have room. At most 10 minutes; 0s: a lookup leases
    /// nothing. Default 5s.
    pub kv_lease_ttl: HumanDuration,
    /// With `auth`: most connections at once that have not presented a
    /// valid token yet. Past it the oldest of them is closed to make room,
    /// so peers without a token never hold more, and cannot keep a client
    /// with a token from connecting (`docs/operations.md`). Default 256.
    pub max_unauthenticated_connections: usize,
    /// NVMe tier: one `PATH:SIZE` per drive (a file or a block device, and
    /// how much of it to use), e.g. `/mnt/nvme0/mooncake.bin:200GiB`; a
    /// single string or a list. Blocks evicted from DRAM go there, spread
    /// over the drives, and survive a restart. Default none.
    #[serde(deserialize_with = "one_or_many")]
    pub nvme: Vec<String>,
    /// I/O engine of the NVMe tier: `uring` (falls back to `psync` where
    /// io_uring is unavailable) or `psync`. Default uring.
    pub nvme_engine: crate::io::EngineKind,
    /// Transfers in flight on the NVMe tier. Default 32.
    pub nvme_depth: u32,
    /// A block read from NVMe this many times goes back to DRAM, as does
    /// one a lookup's lease finds there (0: never). Default 2.
    pub promote_after: u32,
    /// Shares of the DRAM pool per tenant, e.g. `{ acme = 0.5, globex =
    /// 0.25 }`: a tenant's blocks (its namespace and those below it) never
    /// take more than its share, and past it its own coldest blocks are
    /// evicted first. Tenants not listed share what is left. Default none.
    pub dram_quota: std::collections::BTreeMap<String, f64>,
    /// Shares of each NVMe drive per tenant, as `dram_quota`. Default none.
    pub nvme_quota: std::collections::BTreeMap<String, f64>,
    /// Unix socket for clients on the same host: they map the DRAM pool
    /// read-only and copy blocks straight out of it. The pool is then kept
    /// in a memfd. Anyone who can connect reads every block: not with
    /// `auth`. Default none.
    pub shm_socket: Option<std::path::PathBuf>,
    /// UDP address to serve QUIC on (e.g. `0.0.0.0:7171`), for clients
    /// configured for QUIC; needs `tls_cert` and `tls_key`. Default none.
    pub quic_listen: Option<String>,
    /// The QUIC address clients are told. Default: the advertised TCP
    /// host with the QUIC port.
    pub quic_advertise: Option<String>,
    /// TCP address of the RDMA control port (e.g. `0.0.0.0:7271`): clients
    /// built with RDMA connect a queue pair here and then read and write
    /// the DRAM pool with one-sided RDMA. Needs a daemon built with the
    /// `rdma` feature; on a host without an RDMA NIC the daemon says so
    /// and serves TCP only. Peers can read and write the whole pool: not
    /// with `auth`. Default none.
    pub rdma_listen: Option<String>,
    /// The RDMA control address clients are told. Default: the advertised
    /// TCP host with the RDMA port.
    pub rdma_advertise: Option<String>,
    /// The RDMA NIC to register the pool with (e.g. `mlx5_0`). Default:
    /// the first with an active port.
    pub rdma_device: Option<String>,
    /// The GID index to use on it. Default: its first routable RoCE v2
    /// GID (InfiniBand: 0).
    pub rdma_gid_index: Option<u32>,
    /// Speak TLS on the TCP port (`listen`): clients and the meta service
    /// must then connect with TLS (`tls_ca`, `peer_ca`), and one that
    /// sends plain frames is refused in one line. Needs `tls_cert` and
    /// `tls_key`; with `tls_client_ca`, mutual TLS. With `peer_ca`, this
    /// daemon reaches the meta service over TLS on its TCP port too.
    /// Default false.
    pub tls: bool,
    /// This daemon's certificate (PEM, with its chain) for TLS and QUIC.
    pub tls_cert: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM).
    pub tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: only clients whose certificate this CA signed may
    /// connect over TLS or QUIC. Default none: any client (tokens still
    /// apply).
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// The CA that signed the meta service's certificate: with it the
    /// daemon reaches the meta service encrypted only, presenting
    /// `tls_cert` and `tls_key` as its identity, so that its token and
    /// inventories never travel in clear: over TLS on its TCP port with
    /// `tls`, else over QUIC (on UDP at its address; the meta service
    /// needs `quic`). Default none: plain TCP.
    pub peer_ca: Option<std::path::PathBuf>,
    /// Meta service to register with. Default none (a standalone daemon).
    pub meta: Option<String>,
    /// Token file (`docs/security.md`): when set, every connection must
    /// present a token listed there, and may use only its tenant's
    /// namespaces. Default none: no authentication (loopback and trusted
    /// networks only).
    pub auth: Option<std::path::PathBuf>,
    /// This daemon's own token (role `cluster`), presented to the meta
    /// service when it requires authentication. Default none.
    pub token: Option<String>,
    /// How often to report to the meta service. Default 1s.
    pub heartbeat_interval: HumanDuration,
}

/// The longest `kv_lease_ttl`: a lease is for the load that follows a
/// lookup, and every held block is memory no put can use.
const MAX_KV_LEASE_TTL: Duration = Duration::from_secs(600);

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            listen: "127.0.0.1:7071".into(),
            admin: "127.0.0.1:9071".into(),
            metrics_token: None,
            advertise: None,
            node: hostname(),
            dram: ByteSize(default_dram()),
            max_block: ByteSize(256 << 20),
            high_watermark: 1.0,
            low_watermark: None,
            eviction: Eviction::default(),
            probation_share: PROBATION_SHARE,
            hugepages: true,
            prefault: true,
            verify_on_read: false,
            max_connections: 1024,
            max_connections_per_client: 256,
            request_timeout: HumanDuration(Duration::from_secs(30)),
            auth_timeout: HumanDuration(Duration::from_secs(5)),
            idle_timeout: HumanDuration(Duration::from_secs(300)),
            put_stall_timeout: HumanDuration(Duration::from_secs(5)),
            kv_lease_ttl: HumanDuration(Duration::from_secs(5)),
            max_unauthenticated_connections: 256,
            nvme: Vec::new(),
            nvme_engine: crate::io::EngineKind::Uring,
            nvme_depth: 32,
            promote_after: 2,
            dram_quota: Default::default(),
            nvme_quota: Default::default(),
            shm_socket: None,
            quic_listen: None,
            quic_advertise: None,
            rdma_listen: None,
            rdma_advertise: None,
            rdma_device: None,
            rdma_gid_index: None,
            tls: false,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            peer_ca: None,
            meta: None,
            auth: None,
            token: None,
            heartbeat_interval: HumanDuration(Duration::from_secs(1)),
        }
    }
}

impl DaemonConfig {
    /// Checks values that parse but make no sense together.
    pub fn validate(&self) -> Result<(), String> {
        if self.quic_listen.is_some() {
            self.tls_files().server_tls("quic_listen")?;
        }
        if self.tls {
            self.tls_files().server_tls("tls")?;
        }
        if self.dram.0 < 1 << 20 {
            return Err(format!("dram = {} is below the minimum of 1MiB", self.dram));
        }
        if self.dram.0 > (1u64 << 40) {
            return Err(format!("dram = {} is above the maximum of 1TiB", self.dram));
        }
        if self.max_block.0 == 0 || self.max_block.0 > mooncake_proto::MAX_VALUE_LEN as u64 {
            return Err(format!(
                "max_block = {} must be between 1B and {}",
                self.max_block,
                ByteSize(mooncake_proto::MAX_VALUE_LEN as u64)
            ));
        }
        if !(0.5..=1.0).contains(&self.high_watermark) {
            return Err(format!(
                "high_watermark = {} must be between 0.5 and 1",
                self.high_watermark
            ));
        }
        if !(self.probation_share > 0.0 && self.probation_share < 1.0) {
            return Err(format!(
                "probation_share = {} must be above 0 and below 1",
                self.probation_share
            ));
        }
        if self.kv_lease_ttl.0 > MAX_KV_LEASE_TTL {
            return Err(format!(
                "kv_lease_ttl = {} is above the maximum of 10m",
                self.kv_lease_ttl
            ));
        }
        if self.max_connections == 0 || self.max_connections_per_client == 0 {
            return Err("max_connections and max_connections_per_client must be at least 1".into());
        }
        if self.max_unauthenticated_connections == 0 {
            return Err("max_unauthenticated_connections must be at least 1".into());
        }
        if self.auth_timeout.0.is_zero()
            || self.idle_timeout.0.is_zero()
            || self.put_stall_timeout.0.is_zero()
        {
            return Err(
                "auth_timeout, idle_timeout and put_stall_timeout must be more than 0".into(),
            );
        }
        for (path, _) in self.nvme_drives()? {
            in_a_directory("nvme", &path)?;
        }
        if self.rdma_listen.is_some() && self.auth.is_some() {
            return Err(
                "rdma_listen lets peers read and write the whole pool: it cannot be combined with auth"
                    .into(),
            );
        }
        if self.rdma_listen.is_some() && !cfg!(feature = "rdma") {
            return Err(
                "rdma_listen needs a daemon built with the `rdma` feature (cargo build --features mooncake-tools/rdma)"
                    .into(),
            );
        }
        if self.shm_socket.is_some() && self.auth.is_some() {
            return Err(
                "shm_socket lets local processes read every block: it cannot be combined with auth"
                    .into(),
            );
        }
        if let Some(path) = &self.shm_socket {
            in_a_directory("shm_socket", path)?;
        }
        for (field, quota) in [
            ("dram_quota", &self.dram_quota),
            ("nvme_quota", &self.nvme_quota),
        ] {
            for (tenant, share) in quota {
                mooncake_proto::Namespace::new(tenant.clone())
                    .map_err(|e| format!("{field}: tenant {tenant:?}: {e}"))?;
                if !(*share > 0.0 && *share <= 1.0) {
                    return Err(format!(
                        "{field}: {tenant} = {share}: a share is above 0 and at most 1"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The NVMe drives' paths and sizes, parsed from `nvme`.
    pub fn nvme_drives(&self) -> Result<Vec<(std::path::PathBuf, u64)>, String> {
        if !self.nvme.is_empty() && self.nvme_depth == 0 {
            return Err("nvme_depth must be at least 1".into());
        }
        let mut drives: Vec<(std::path::PathBuf, u64)> = Vec::new();
        for spec in &self.nvme {
            let (path, size) = spec.rsplit_once(':').ok_or_else(|| {
                format!("nvme = {spec:?}: expected PATH:SIZE, e.g. /mnt/nvme0/mooncake.bin:200GiB")
            })?;
            let size: ByteSize = size.parse().map_err(|e| format!("nvme = {spec:?}: {e}"))?;
            if size.0 < 1 << 20 {
                return Err(format!("nvme = {spec:?}: at least 1MiB"));
            }
            if drives
                .iter()
                .any(|(p, _)| p.as_path() == std::path::Path::new(path))
            {
                return Err(format!("nvme = {spec:?}: {path} is named twice"));
            }
            drives.push((path.into(), size.0));
        }
        Ok(drives)
    }

    pub(crate) fn pool(&self) -> PoolConfig {
        if self.low_watermark.is_some() {
            tracing::warn!("low_watermark is ignored: eviction frees only what a put needs");
        }
        PoolConfig {
            capacity: self.dram.0,
            max_block: self.max_block.0.min(self.dram.0),
            high_watermark: self.high_watermark,
            eviction: self.eviction,
            probation_share: self.probation_share,
            hugepages: self.hugepages,
            prefault: self.prefault,
            quotas: quotas(&self.dram_quota),
            shared: self.shm_socket.is_some(),
        }
    }

    /// The certificate files, as both servers name them.
    pub fn tls_files(&self) -> TlsFiles {
        TlsFiles {
            tcp: self.tls,
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            client_ca: self.tls_client_ca.clone(),
            peer_ca: self.peer_ca.clone(),
        }
    }

    /// The limits on connections, as both servers apply them.
    pub fn limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_connections_per_client: self.max_connections_per_client,
            max_unauthenticated: self.max_unauthenticated_connections,
            request_timeout: self.request_timeout.0,
            deadlines: Deadlines {
                auth: self.auth_timeout.0,
                idle: self.idle_timeout.0,
            },
        }
    }

    pub(crate) fn data(&self) -> DataConfig {
        DataConfig {
            verify_on_read: self.verify_on_read,
            request_timeout: self.request_timeout.0,
            put_stall_timeout: self.put_stall_timeout.0,
            peers: crate::fetch::Peers::default(),
            kv_lease_ttl: self.kv_lease_ttl.0,
        }
    }

    /// Tenants' shares of each NVMe drive.
    pub(crate) fn nvme_quotas(&self) -> crate::quota::Quotas {
        quotas(&self.nvme_quota)
    }

    /// The token table `auth` names, read now; `None` without one.
    pub fn tokens(
        &self,
    ) -> Result<Option<std::sync::Arc<mooncake_proto::auth::TokenTable>>, String> {
        mooncake_proto::auth::TokenTable::load_optional(self.auth.as_deref())
    }
}

fn quotas(shares: &std::collections::BTreeMap<String, f64>) -> crate::quota::Quotas {
    crate::quota::Quotas::new(
        shares
            .iter()
            .map(|(t, s)| (std::sync::Arc::from(t.as_str()), *s)),
    )
}

/// Accepts `nvme = "PATH:SIZE"` as well as a list of them.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// 1 GiB, or a quarter of the memory available now if that is less.
fn default_dram() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    let quarter = available.map_or(u64::MAX, |a| a / 4);
    (1u64 << 30).min(quarter).max(1 << 20)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Whether the directory `path` (setting `field`) would be made in exists:
/// a daemon makes its files and sockets, not their directories.
fn in_a_directory(field: &str, path: &std::path::Path) -> Result<(), String> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => Err(format!(
            "{field} = {}: no directory {}",
            path.display(),
            dir.display()
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_toml_takes_human_units() {
        DaemonConfig::default().validate().unwrap();
        let cfg: DaemonConfig = toml::from_str(
            r#"
            dram = "64MiB"
            request_timeout = "2s"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.dram.0, 64 << 20);
        assert_eq!(cfg.request_timeout.0, Duration::from_secs(2));
        assert!(toml::from_str::<DaemonConfig>("dram = \"lots\"").is_err());
        assert!(toml::from_str::<DaemonConfig>("unknown_option = 1").is_err());
    }

    #[test]
    fn rdma_is_refused_with_auth_and_in_a_build_without_it() {
        let cfg: DaemonConfig = toml::from_str(
            r#"
            rdma_listen = "0.0.0.0:7271"
            auth = "/etc/mooncake/tokens.toml"
            "#,
        )
        .unwrap();
        assert!(cfg
            .validate()
            .unwrap_err()
            .contains("cannot be combined with auth"));
        let cfg = DaemonConfig {
            rdma_listen: Some("0.0.0.0:7271".into()),
            ..DaemonConfig::default()
        };
        let checked = cfg.validate();
        if cfg!(feature = "rdma") {
            checked.unwrap();
        } else {
            assert!(checked.unwrap_err().contains("`rdma` feature"));
        }
    }

    #[test]
    fn nvme_takes_one_drive_or_several() {
        let one: DaemonConfig = toml::from_str(r#"nvme = "/a/t.bin:1GiB""#).unwrap();
        assert_eq!(
            one.nvme_drives().unwrap(),
            vec![("/a/t.bin".into(), 1 << 30)]
        );
        let two: DaemonConfig =
            toml::from_str(r#"nvme = ["/a/t.bin:1GiB", "/b/t.bin:2GiB"]"#).unwrap();
        assert_eq!(two.nvme_drives().unwrap().len(), 2);
        let twice: DaemonConfig =
            toml::from_str(r#"nvme = ["/a/t.bin:1GiB", "/a/t.bin:2GiB"]"#).unwrap();
        assert!(twice.validate().unwrap_err().contains("named twice"));
        let bad: DaemonConfig = toml::from_str(r#"nvme = "/a/t.bin""#).unwrap();
        assert!(bad.validate().unwrap_err().contains("PATH:SIZE"));
    }

    #[test]
    fn bad_watermarks_and_tiny_pools_are_refused() {
        let mut cfg = DaemonConfig {
            high_watermark: 1.2,
            ..Default::default()
        };
        assert!(cfg.validate().is_err());
        cfg = DaemonConfig {
            probation_share: 1.0,
            ..Default::default()
        };
        assert!(cfg.validate().is_err());
        cfg = DaemonConfig {
            dram: ByteSize(1000),
            ..Default::default()
        };
        assert!(cfg.validate().is_err());
    }
}
