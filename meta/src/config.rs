//! The meta service's configuration: one TOML table, every field defaulted.

use std::time::Duration;

use mooncake_proto::message::MAX_COPIES;
use mooncake_proto::units::{ByteSize, HumanDuration};
use mooncake_server::{Deadlines, Limits, TlsFiles};
use serde::{Deserialize, Serialize};

/// Whose format store events are published in (`events_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventsFormat {
    Vllm,
    Mooncake,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetaConfig {
    /// Control port. Default `127.0.0.1:7070`.
    pub listen: String,
    /// Address clients and daemons are told to use (with etcd). Default:
    /// `listen`.
    pub advertise: Option<String>,
    /// Admin port: `/metrics` and `/health` over HTTP (with `up`, for the
    /// whole process). Default `127.0.0.1:9070`; empty to serve none.
    pub admin: String,
    /// Token a scrape must present (`Authorization: Bearer TOKEN`, as
    /// Prometheus's `authorization` setting sends it) to read `/metrics`,
    /// which names tenants; `/health` stays open. Default none: anyone who
    /// reaches the admin port reads it (it binds to loopback by default).
    pub metrics_token: Option<String>,
    /// A daemon silent this long is dead and its blocks leave the index.
    /// Default 5s.
    pub daemon_ttl: HumanDuration,
    /// A put reserved but not committed this long is abandoned: the key
    /// becomes free again and the daemon is told to drop any bytes it got.
    /// Default 30s.
    pub put_timeout: HumanDuration,
    /// Most concurrent connections; more are refused. Default 4096.
    pub max_connections: usize,
    /// Most concurrent connections from one client address. Default 256.
    pub max_connections_per_client: usize,
    /// Longest time one request may take once its header arrived. Default 10s.
    pub request_timeout: HumanDuration,
    /// Most puts reserved and not yet committed, cluster-wide; past it a
    /// put is answered busy (back-pressure) instead of growing the index
    /// (about 150 bytes each). Default 1000000.
    pub max_pending_puts: u64,
    /// Most of those one client may hold (clients are told apart by
    /// address, `docs/operations.md`), so that no client can turn every
    /// other's puts away as busy. Default 262144.
    pub max_pending_puts_per_client: u32,
    /// With `auth`: how long a connection may take, from accept, to present
    /// a valid token; then it is closed. Default 5s.
    pub auth_timeout: HumanDuration,
    /// A connection with no request for this long is closed (clients open
    /// another when they need one). Default 300s.
    pub idle_timeout: HumanDuration,
    /// With `auth`: most connections at once that have not presented a
    /// valid token yet. Past it the oldest of them is closed to make room,
    /// so peers without a token never hold more, and cannot keep a client
    /// with a token from connecting (`docs/operations.md`). Default 1024.
    pub max_unauthenticated_connections: usize,
    /// Token file (`docs/security.md`): when set, every connection must
    /// present a token listed there; clients may use only their tenant's
    /// namespaces, daemons need a `cluster` token. Default none: no
    /// authentication (loopback and trusted networks only).
    pub auth: Option<std::path::PathBuf>,
    /// This replica's own token (role `cluster`), presented to daemons
    /// that require authentication. Default none.
    pub token: Option<String>,
    /// Also serve clients over QUIC, on UDP at the same address and port
    /// as `listen` (clients set up for QUIC reach the meta service there,
    /// so that keys and tokens travel encrypted). Needs `tls_cert` and
    /// `tls_key`. Default false.
    pub quic: bool,
    /// Speak TLS on the TCP port (`listen`): clients, daemons and the
    /// other replicas must then connect with TLS (`tls_ca`, `peer_ca`),
    /// and one that sends plain frames is refused in one line. Needs
    /// `tls_cert` and `tls_key`; with `tls_client_ca`, mutual TLS. With
    /// `peer_ca`, this replica calls daemons over TLS on their TCP ports
    /// too. Default false.
    pub tls: bool,
    /// This replica's certificate (PEM, with its chain) for TLS and QUIC.
    pub tls_cert: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM).
    pub tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: accept only TLS and QUIC clients whose certificate this
    /// CA signed (and, with `auth`, only the token of the certificate's
    /// name).
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// The CA that signed the daemons' certificates: with it this replica
    /// calls daemons (removals, pins) encrypted only, presenting `tls_cert`
    /// and `tls_key`: over TLS on their TCP ports with `tls`, else over
    /// QUIC at the endpoint each registered (a daemon with none is not
    /// called). Default none: plain TCP.
    pub peer_ca: Option<std::path::PathBuf>,
    /// Publish store events (`docs/events.md`): every block stored or
    /// removed, in vLLM's KV-event format on a ZeroMQ PUB socket bound
    /// here (host:port), while this replica leads. Default "": none.
    pub events_listen: String,
    /// Serve replays of the last `events_replay_batches` batches on a
    /// ZeroMQ ROUTER socket bound here (host:port), as vLLM's
    /// `replay_endpoint` does. Default "": none.
    pub events_replay_listen: String,
    /// The events' topic prefix: a batch's topic is
    /// `{events_topic}@{node}@{namespace}`. Default `kv`.
    pub events_topic: String,
    /// Batches kept for replay. Default 10000.
    pub events_replay_batches: usize,
    /// Block hashes in events as 64-bit integers (the hash's last 8 bytes,
    /// big endian), as vLLM publishes its own by default
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), so that a router reading
    /// both matches them. Default false: the 32 bytes.
    pub events_int_hashes: bool,
    /// Whose format events are published in: `vllm` (vLLM's KV events) or
    /// `mooncake` (Mooncake's master's, which Mooncake's Conductor and
    /// Dynamo's shared-cache router read; `docs/events.md`). Default
    /// `vllm`.
    pub events_format: EventsFormat,
    /// In Mooncake's format, every event's `backend_id`: the store's name
    /// to its subscribers. Default `mooncake-store`.
    pub events_backend_id: String,
    /// In Mooncake's format, the `model_name` of blocks whose key names
    /// none. Default "": `nil`.
    pub events_model_name: String,
    /// In Mooncake's format, the `block_size` (tokens) of blocks whose
    /// writer attached no tokens. Default 0: `nil`.
    pub events_block_size: u32,
    /// In Mooncake's format, every event's `lora_name`. Default "": `nil`.
    pub events_lora_name: String,
    /// In Mooncake's format, every event's `additional_salt`. Default "":
    /// `nil`.
    pub events_additional_salt: String,
    /// In Mooncake's format, every event's and batch's `dp_rank`. Default 0.
    pub events_dp_rank: u32,
    /// How long the publisher gathers changes into one batch after the
    /// first arrives: longer windows make fewer, larger batches (less work
    /// per block for the service and its subscribers), and delay events
    /// by up to this much. Default 1ms; 0 publishes what is queued at once.
    pub events_window: HumanDuration,
    /// The serving instance on each host, by the `node` name its daemons
    /// register with (e.g. `gpu-node-1 = "prefill-0"`): `route` names
    /// them and takes them as candidates. Default none.
    pub instances: std::collections::BTreeMap<String, String>,
    /// Block changes queued for the publisher; past it they are dropped,
    /// counted, and subscribers are resynchronized. Default 65536.
    pub events_queue: usize,
    /// Copies of each block, on distinct hosts, for puts that ask for no
    /// number of their own: by namespace, `"*"` for the others (e.g.
    /// `"*" = 1` and `system-prompts = 3`). From 1 to 4. Default: 1
    /// everywhere.
    pub replicas: std::collections::BTreeMap<String, u8>,
    /// Lost copies are made again (a daemon fetches the block from a
    /// surviving copy) at most this many bytes a second; 0 makes none.
    /// Default 256MiB.
    pub repair_rate: ByteSize,
    /// Most blocks waiting for a copy to be made again; past it a loss is
    /// counted (`mooncake_meta_repairs{what="dropped"}`) and not repaired.
    /// Default 1000000 (about 100 bytes each).
    pub repair_queue: usize,
    /// A block read this many times a second at one daemon is hot and gets
    /// `hot_copies` copies on distinct hosts; 0: no block is. Default 100.
    pub hot_reads: u64,
    /// Copies a hot block gets (at most one per host, at most 4); 1 turns
    /// hot copies off. Default 3.
    pub hot_copies: u8,
    /// A hot block not reported hot for this long goes back to the copies
    /// its writer asked for. Default 30s.
    pub hot_cool: HumanDuration,
    /// Most blocks hot at once. Default 1024.
    pub hot_blocks: usize,
    /// Most of each daemon's pool the copies given to hot blocks may take,
    /// from 0 to 1. Default 0.1.
    pub hot_share: f64,
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            listen: "127.0.0.1:7070".into(),
            advertise: None,
            admin: "127.0.0.1:9070".into(),
            metrics_token: None,
            daemon_ttl: HumanDuration(Duration::from_secs(5)),
            put_timeout: HumanDuration(Duration::from_secs(30)),
            max_connections: 4096,
            max_connections_per_client: 256,
            request_timeout: HumanDuration(Duration::from_secs(10)),
            max_pending_puts: 1_000_000,
            max_pending_puts_per_client: 262_144,
            auth_timeout: HumanDuration(Duration::from_secs(5)),
            idle_timeout: HumanDuration(Duration::from_secs(300)),
            max_unauthenticated_connections: 1024,
            auth: None,
            token: None,
            quic: false,
            tls: false,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            peer_ca: None,
            events_listen: String::new(),
            events_replay_listen: String::new(),
            events_topic: "kv".into(),
            events_replay_batches: 10_000,
            events_int_hashes: false,
            events_window: HumanDuration(Duration::from_millis(1)),
            events_format: EventsFormat::Vllm,
            events_backend_id: "mooncake-store".into(),
            events_model_name: String::new(),
            events_block_size: 0,
            events_lora_name: String::new(),
            events_additional_salt: String::new(),
            events_dp_rank: 0,
            events_queue: 65_536,
            instances: Default::default(),
            replicas: Default::default(),
            repair_rate: ByteSize(256 << 20),
            repair_queue: 1_000_000,
            hot_reads: 100,
            hot_copies: 3,
            hot_cool: HumanDuration(Duration::from_secs(30)),
            hot_blocks: 1024,
            hot_share: 0.1,
        }
    }
}

impl MetaConfig {
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

    pub fn validate(&self) -> Result<(), String> {
        if self.quic {
            self.tls_files().server_tls("quic")?;
        }
        if self.tls {
            self.tls_files().server_tls("tls")?;
        }
        if self.daemon_ttl.0 < Duration::from_millis(100) {
            return Err(format!("daemon_ttl = {} is below 100ms", self.daemon_ttl));
        }
        if self.put_timeout.0 < Duration::from_millis(100) {
            return Err(format!("put_timeout = {} is below 100ms", self.put_timeout));
        }
        if self.max_connections == 0 || self.max_connections_per_client == 0 {
            return Err("max_connections and max_connections_per_client must be at least 1".into());
        }
        if self.max_unauthenticated_connections == 0 {
            return Err("max_unauthenticated_connections must be at least 1".into());
        }
        if self.auth_timeout.0.is_zero() || self.idle_timeout.0.is_zero() {
            return Err("auth_timeout and idle_timeout must be more than 0".into());
        }
        for (what, addr) in [
            ("events_listen", &self.events_listen),
            ("events_replay_listen", &self.events_replay_listen),
        ] {
            let port = addr.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
            if !addr.is_empty() && !matches!(port, Some(Ok(_))) {
                return Err(format!("{what} = {addr:?} is not host:port"));
            }
        }
        if self.events_listen.is_empty() && !self.events_replay_listen.is_empty() {
            return Err("events_replay_listen needs events_listen".into());
        }
        if self.events_format == EventsFormat::Mooncake && self.events_backend_id.is_empty() {
            return Err("events_backend_id must not be empty in Mooncake's event format".into());
        }
        if self.events_queue == 0 || self.events_replay_batches == 0 {
            return Err("events_queue and events_replay_batches must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.hot_share) {
            return Err(format!("hot_share = {} is not from 0 to 1", self.hot_share));
        }
        for (ns, n) in &self.replicas {
            if !(1..=MAX_COPIES).contains(&usize::from(*n)) {
                return Err(format!("replicas.{ns} = {n} is not from 1 to {MAX_COPIES}"));
            }
        }
        self.tokens()?;
        Ok(())
    }

    /// The hot-block policy.
    pub fn hot(&self) -> crate::hot::HotConfig {
        crate::hot::HotConfig {
            reads_per_sec: self.hot_reads,
            copies: self.hot_copies.clamp(1, MAX_COPIES as u8),
            cool: self.hot_cool.0,
            max_blocks: self.hot_blocks,
            share: self.hot_share,
        }
    }

    /// Copies a put in `namespace` gets when it asks for none.
    pub fn replicas_of(&self, namespace: &str) -> u8 {
        replicas_in(&self.replicas, namespace)
    }

    /// The token table `auth` names, read now; `None` without one.
    pub fn tokens(
        &self,
    ) -> Result<Option<std::sync::Arc<mooncake_proto::auth::TokenTable>>, String> {
        mooncake_proto::auth::TokenTable::load_optional(self.auth.as_deref())
    }
}

/// Copies a put in `namespace` gets when it asks for none, by the
/// `replicas` table.
pub fn replicas_in(table: &std::collections::BTreeMap<String, u8>, namespace: &str) -> u8 {
    table
        .get(namespace)
        .or_else(|| table.get("*"))
        .copied()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_toml_overrides_apply() {
        MetaConfig::default().validate().unwrap();
        let cfg: MetaConfig =
            toml::from_str("daemon_ttl = \"2s\"\nput_timeout = \"500ms\"").unwrap();
        assert_eq!(cfg.daemon_ttl.0, Duration::from_secs(2));
        assert_eq!(cfg.put_timeout.0, Duration::from_millis(500));
        let bad = MetaConfig {
            daemon_ttl: HumanDuration(Duration::from_millis(1)),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let events = |listen: &str, replay: &str| MetaConfig {
            events_listen: listen.into(),
            events_replay_listen: replay.into(),
            ..Default::default()
        };
        events("127.0.0.1:5557", "127.0.0.1:5558")
            .validate()
            .unwrap();
        assert!(events("127.0.0.1", "").validate().is_err(), "no port");
        assert!(
            events("", "127.0.0.1:5558").validate().is_err(),
            "replay alone"
        );
        let cfg: MetaConfig = toml::from_str("[replicas]\n\"*\" = 2\nhot = 3").unwrap();
        cfg.validate().unwrap();
        assert_eq!((cfg.replicas_of("hot"), cfg.replicas_of("other")), (3, 2));
        assert_eq!(MetaConfig::default().replicas_of("any"), 1);
        let five: MetaConfig = toml::from_str("[replicas]\nhot = 5").unwrap();
        assert!(five.validate().is_err(), "more than MAX_COPIES");
    }
}
