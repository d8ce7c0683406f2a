//! Block operations from the shell: `put`, `get`, `rm`, `stat`, `ls`.
//! A KEY is 64 hex digits (a block hash as workers compute it) or any other
//! string, which is mapped to a hash as an opaque key.

use std::io::{Read, Write};
use std::path::PathBuf;

use std::sync::Arc;

use mooncake_client::{Client, ClientConfig, PutOptions, PutOutcome, Value};
use mooncake_coord::{leader_address, EtcdConfig, EtcdCoordinator};
use mooncake_proto::message::{EngineTag, ListRequest, Tier};
use mooncake_proto::units::ByteSize;
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace};
use serde_json::json;

use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct KeyArgs {
    /// Namespace (tenant/model) of the keys.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
}

#[derive(clap::Args, Debug)]
pub struct PutArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    ns: KeyArgs,
    key: String,
    /// File to store; stdin when absent or `-`.
    file: Option<PathBuf>,
    /// Copies to store, each on a distinct host (1 to 4). Default: the
    /// meta service's for the namespace.
    #[arg(long, default_value_t = 0)]
    replicas: u8,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    ns: KeyArgs,
    key: String,
    /// Write the block here instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct RmArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    ns: KeyArgs,
    #[arg(required = true)]
    keys: Vec<String>,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct StatArgs {
    #[command(flatten)]
    target: Target,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    target: Target,
    /// Only this namespace.
    #[arg(short, long)]
    namespace: Option<String>,
    /// Only keys whose hash starts with these hex bytes.
    #[arg(long)]
    prefix: Option<String>,
    /// Only blocks on this daemon (its id in `stat`).
    #[arg(long)]
    daemon: Option<u32>,
    /// Most blocks to list.
    #[arg(long, default_value_t = 1000)]
    limit: usize,
    #[arg(long)]
    json: bool,
}

/// A client of the store `target` names: a fixed meta address, or the
/// leader found (and followed) through etcd.
pub async fn client(target: &Target) -> Result<Client, Failure> {
    let mut cfg = ClientConfig::new(target.meta.clone()).with_timeout(target.timeout);
    if let Some(token) = &target.token {
        cfg = cfg.with_token(token.as_str());
    }
    cfg.shm_socket = target.shm_socket.clone();
    if let Some(threads) = target.copy_threads {
        cfg.copy_threads = threads.max(1);
    }
    cfg.rdma = target.rdma;
    cfg.rdma_device = target.rdma_device.clone();
    cfg.stripes = target.stripes;
    if let Some(ca) = &target.tls_ca {
        let identity = target
            .tls_client_cert
            .clone()
            .zip(target.tls_client_key.clone());
        cfg = cfg
            .with_tls(&mooncake_net::ClientTls {
                ca: ca.clone(),
                identity,
            })
            .map_err(|e| Failure::usage(e.to_string()))?;
    } else if target.tls_client_cert.is_some() {
        return Err(Failure::usage(
            "--tls-client-cert needs --tls-ca (the CA that signed the servers' certificates)",
        ));
    }
    if let Some(ca) = &target.quic_ca {
        let identity = target.quic_cert.clone().zip(target.quic_key.clone());
        cfg = cfg
            .with_quic(&mooncake_net::ClientTls {
                ca: ca.clone(),
                identity,
            })
            .map_err(|e| Failure::usage(e.to_string()))?;
    } else if target.quic_cert.is_some() {
        return Err(Failure::usage(
            "--quic-cert needs --quic-ca (the CA that signed the daemons' certificates)",
        ));
    }
    if target.etcd.is_empty() {
        return Ok(Client::new(cfg));
    }
    let etcd = EtcdCoordinator::connect(EtcdConfig::new(target.etcd.clone()))
        .await
        .map_err(|e| Failure::connection(format!("{e} (is etcd running at {:?}?)", target.etcd)))?;
    let cfg = cfg.with_resolver(Arc::new(leader_address(etcd))).await?;
    Ok(Client::new(cfg))
}

/// DRAM bytes of the store's live daemons; an error if none is alive.
pub async fn live_capacity(client: &Client) -> Result<u64, Failure> {
    let stats = client.cluster_stats().await?;
    let capacity = stats
        .daemons
        .iter()
        .filter(|d| d.alive)
        .map(|d| d.capacity)
        .sum();
    if capacity == 0 {
        return Err(Failure::other(anyhow::anyhow!(
            "the store has no live daemon"
        )));
    }
    Ok(capacity)
}

pub fn namespace(s: &str) -> Result<Namespace, Failure> {
    Namespace::new(s).map_err(|e| Failure::usage(format!("--namespace {s:?}: {e}")))
}

/// A key as typed: 64 hex digits are a hash, anything else is opaque.
pub fn parse_key(ns: &Namespace, key: &str) -> BlockKey {
    let hash = if key.len() == 64 {
        BlockHash::from_hex(key).unwrap_or_else(|_| BlockHash::from_opaque(key.as_bytes()))
    } else {
        BlockHash::from_opaque(key.as_bytes())
    };
    BlockKey::new(ns.clone(), hash)
}

pub async fn put(args: PutArgs) -> Result<(), Failure> {
    let ns = namespace(&args.ns.namespace)?;
    let key = parse_key(&ns, &args.key);
    let value = match args.file.as_deref() {
        None => read_stdin()?,
        Some(p) if p.as_os_str() == "-" => read_stdin()?,
        Some(p) => std::fs::read(p)
            .map_err(|e| Failure::usage(format!("cannot read {}: {e}", p.display())))?,
    };
    let opts = PutOptions::copies(args.replicas);
    // A key typed as text names the block in Mooncake's event format, as
    // a Python `str` key does.
    let opaque = key.hash == BlockHash::from_opaque(args.key.as_bytes());
    let tag = EngineTag::default()
        .with_key(&args.key)
        .ok()
        .filter(|_| opaque)
        .map(Arc::new);
    let outcome = client(&args.target)
        .await?
        .put_tagged(&ns, &[(key.hash, Value::One(&value))], None, &[tag], opts)
        .await?[0];
    let (word, copies) = match outcome {
        PutOutcome::Stored => ("stored", None),
        PutOutcome::Short { copies } => ("short", Some(copies)),
        PutOutcome::AlreadyExists => ("already stored", None),
        PutOutcome::Failed(code) => {
            let hint = match code {
                ErrorCode::TooLarge => format!(
                    ": {} is more than any daemon takes, its `max_block` or its pool",
                    ByteSize(value.len() as u64)
                ),
                _ => String::new(),
            };
            let message = format!("put of {} not stored ({code}{hint})", key.hash);
            return Err(Failure::refusal(code, message));
        }
    };
    if args.json {
        println!(
            "{}",
            json!({"key": key.hash.to_hex(), "namespace": ns.as_str(), "outcome": word,
                   "copies": copies, "bytes": value.len()})
        );
    } else {
        let size = ByteSize(value.len() as u64);
        match copies {
            // Fewer hosts could take it than copies were asked.
            Some(n) => println!(
                "stored {} ({size}), {n} copies of {}",
                key.hash, args.replicas
            ),
            None => println!("{word} {} ({size})", key.hash),
        }
    }
    Ok(())
}

fn read_stdin() -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::new();
    std::io::stdin().read_to_end(&mut buf)?;
    Ok(buf)
}

pub async fn get(args: GetArgs) -> Result<(), Failure> {
    let ns = namespace(&args.ns.namespace)?;
    let key = parse_key(&ns, &args.key);
    let Some(bytes) = client(&args.target).await?.get(&key).await? else {
        return Err(Failure::other(anyhow::anyhow!(
            "not found: {} in namespace {}",
            key.hash,
            ns
        )));
    };
    match args.output {
        Some(path) => std::fs::write(&path, &bytes)
            .map_err(|e| Failure::other(anyhow::anyhow!("cannot write {}: {e}", path.display())))?,
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(&bytes)?;
            out.flush()?;
        }
    }
    Ok(())
}

pub async fn rm(args: RmArgs) -> Result<(), Failure> {
    let ns = namespace(&args.ns.namespace)?;
    let keys: Vec<BlockKey> = args.keys.iter().map(|k| parse_key(&ns, k)).collect();
    let hashes: Vec<BlockHash> = keys.iter().map(|k| k.hash).collect();
    let codes = client(&args.target).await?.remove(&ns, &hashes).await?;
    let mut unconfirmed = None;
    for (hash, code) in hashes.iter().zip(&codes) {
        let removed = *code == ErrorCode::Ok;
        if !matches!(code, ErrorCode::Ok | ErrorCode::NotFound) {
            unconfirmed.get_or_insert(*code);
        }
        if args.json {
            println!(
                "{}",
                json!({"key": hash.to_hex(), "removed": removed, "status": code.name()})
            );
        } else {
            match code {
                ErrorCode::Ok => println!("removed {hash}"),
                ErrorCode::NotFound => println!("not found {hash}"),
                code => println!("not confirmed {hash} ({code})"),
            }
        }
    }
    match unconfirmed {
        // Out of the index, but its daemon did not answer: it is told again
        // when it does. Unreachable is exit 3, any other refusal 4.
        Some(code) => Err(Failure::refusal(
            code,
            format!("the daemon holding a key did not confirm its removal ({code}); it is told again when it answers"),
        )),
        None => Ok(()),
    }
}

pub async fn stat(args: StatArgs) -> Result<(), Failure> {
    let st = client(&args.target).await?.cluster_stats().await?;
    let (hits, misses) = st
        .daemons
        .iter()
        .fold((0, 0), |(h, m), d| (h + d.hits, m + d.misses));
    if args.json {
        let daemons: Vec<_> = st
            .daemons
            .iter()
            .map(|d| {
                let transports: serde_json::Map<String, serde_json::Value> =
                    std::iter::once(("tcp".to_string(), json!(d.addr)))
                        .chain(
                            d.endpoints
                                .iter()
                                .map(|e| (e.kind.name().to_string(), json!(e.addr))),
                        )
                        .collect();
                json!({"id": d.id, "node": d.node, "addr": d.addr, "alive": d.alive,
                       "draining": d.draining, "tier": "dram", "capacity": d.capacity,
                       "used": d.used, "blocks": d.blocks, "hits": d.hits, "misses": d.misses,
                       "transports": transports})
            })
            .collect();
        let errors: Vec<_> = st
            .errors
            .iter()
            .map(|e| json!({"op": e.op, "code": e.code, "count": e.count}))
            .collect();
        println!(
            "{}",
            json!({"leader": st.leader, "revision": st.revision, "standbys": st.standbys,
                   "blocks": st.blocks, "copies": st.copies, "bytes": st.bytes, "pending": st.pending,
                   "repairing": st.repairing,
                   "hits": hits, "misses": misses, "daemons": daemons, "errors": errors})
        );
        return Ok(());
    }
    let alive = st.daemons.iter().filter(|d| d.alive).count();
    println!(
        "leader    {} (election revision {})",
        st.leader, st.revision
    );
    if st.standbys.is_empty() {
        println!("standbys  none");
    } else {
        println!("standbys  {}", st.standbys.join(", "));
    }
    println!(
        "blocks    {} ({}), {} copies, {} puts in progress",
        st.blocks,
        ByteSize(st.bytes),
        st.copies,
        st.pending
    );
    if st.repairing > 0 {
        println!(
            "repairs   {} blocks waiting for a copy on another host (a host lost, or draining)",
            st.repairing
        );
    }
    println!(
        "hit rate  {} ({hits} hits, {misses} misses since the daemons started)",
        percent(hits, misses)
    );
    println!("daemons   {alive} alive of {}", st.daemons.len());
    if !st.daemons.is_empty() {
        println!();
        println!(
            "{:<4} {:<14} {:<22} {:<8} {:<5} {:>9} {:>9} {:>6} {:>9} {:>6}  TRANSPORTS",
            "ID", "NODE", "ADDRESS", "STATE", "TIER", "CAPACITY", "USED", "USE%", "BLOCKS", "HIT%"
        );
        for d in &st.daemons {
            let state = match (d.alive, d.draining) {
                (false, _) => "dead",
                (true, true) => "draining",
                (true, false) => "alive",
            };
            let use_pct = if d.capacity == 0 {
                0.0
            } else {
                100.0 * d.used as f64 / d.capacity as f64
            };
            let transports: Vec<String> = std::iter::once("tcp".to_string())
                .chain(d.endpoints.iter().map(|e| format!("{} {}", e.kind, e.addr)))
                .collect();
            println!(
                "{:<4} {:<14} {:<22} {:<8} {:<5} {:>9} {:>9} {:>6.1} {:>9} {:>6}  {}",
                d.id,
                d.node,
                d.addr,
                state,
                "dram",
                ByteSize(d.capacity).to_string(),
                ByteSize(d.used).to_string(),
                use_pct,
                d.blocks,
                percent(d.hits, d.misses),
                transports.join(", ")
            );
        }
    }
    println!();
    if st.errors.is_empty() {
        println!("errors    none since this leader was elected");
    } else {
        println!("top errors since this leader was elected:");
        for e in &st.errors {
            println!("  {:>8}  {} {}", e.count, e.op, e.code);
        }
    }
    Ok(())
}

fn percent(hits: u64, misses: u64) -> String {
    if hits + misses == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * hits as f64 / (hits + misses) as f64)
    }
}

pub async fn ls(args: LsArgs) -> Result<(), Failure> {
    let ns = args.namespace.as_deref().map(namespace).transpose()?;
    let prefix = match &args.prefix {
        None => Vec::new(),
        Some(p) => hex::decode(p)
            .ok()
            .filter(|b| b.len() <= 32)
            .ok_or_else(|| {
                Failure::usage(format!(
                    "--prefix {p:?}: expected whole bytes in hex, e.g. 3fa2"
                ))
            })?,
    };
    let client = client(&args.target).await?;
    let mut after = None;
    let mut shown = 0;
    loop {
        let page = client
            .list(&ListRequest {
                namespace: ns.clone(),
                after: after.clone(),
                prefix: prefix.clone(),
                daemon: args.daemon.unwrap_or(0),
                limit: (args.limit - shown).min(1024) as u32,
            })
            .await?;
        for e in &page.entries {
            if args.json {
                println!(
                    "{}",
                    json!({"namespace": e.key.namespace.as_str(), "key": e.key.hash.to_hex(),
                           "size": e.location.size, "daemons": e.location.daemons.as_slice(),
                           "nvme": e.location.daemons.with_tiers()
                               .filter(|(_, t)| *t == Tier::Nvme).map(|(d, _)| d).collect::<Vec<_>>()})
                );
            } else {
                // A copy on NVMe only is marked (`3 (nvme)`).
                let on: Vec<String> = e
                    .location
                    .daemons
                    .with_tiers()
                    .map(|(d, t)| match t {
                        Tier::Dram => d.to_string(),
                        Tier::Nvme => format!("{d} (nvme)"),
                    })
                    .collect();
                let word = if on.len() == 1 { "daemon" } else { "daemons" };
                println!(
                    "{}  {}  {:>10}  {word} {}",
                    e.key.namespace,
                    e.key.hash,
                    ByteSize(e.location.size as u64).to_string(),
                    on.join(",")
                );
            }
        }
        shown += page.entries.len();
        after = page.entries.last().map(|e| e.key.clone());
        if !page.more || shown >= args.limit || after.is_none() {
            if page.more && !args.json {
                eprintln!("(more blocks not shown: raise --limit)");
            }
            return Ok(());
        }
    }
}
