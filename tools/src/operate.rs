//! Operator commands: `pin` / `unpin` blocks, `evict` from a daemon now,
//! and `drain` a daemon before taking its host out.

use std::time::Duration;

use mooncake_client::{Client, ErrorSource};
use mooncake_proto::message::{EvictRequest, EvictResponse, ListEntry, ListRequest};
use mooncake_proto::units::{parse_duration, ByteSize};
use mooncake_proto::{BlockHash, ErrorCode, Namespace, Opcode};
use serde_json::json;

use crate::blocks::{client, parse_key, KeyArgs};
use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct PinArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    ns: KeyArgs,
    #[arg(required = true)]
    keys: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct EvictArgs {
    #[command(flatten)]
    target: Target,
    /// The daemon: its id (from `stat`) or its address.
    daemon: String,
    /// How much to free, coldest blocks first (e.g. 10GiB).
    #[arg(long)]
    bytes: ByteSize,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct DrainArgs {
    #[command(flatten)]
    target: Target,
    /// The daemon: its id (from `stat`) or its address.
    daemon: String,
    /// Also drop its blocks from the cache now (workers recompute them and
    /// the new copies land on other daemons), instead of letting the host
    /// go with them.
    #[arg(long)]
    evict: bool,
    /// Take the daemon back: place new blocks on it again.
    #[arg(long, conflicts_with = "evict")]
    undo: bool,
    /// Wait (at most this long, e.g. 10m) until every block of the daemon
    /// has a copy on another host, showing progress; then it can be
    /// stopped without a miss.
    #[arg(long, value_parser = parse_duration, conflicts_with_all = ["evict", "undo"])]
    wait: Option<Duration>,
    #[arg(long)]
    json: bool,
}

/// A daemon named by id or address, as (id, address).
async fn find_daemon(client: &Client, name: &str) -> Result<(u32, String), Failure> {
    let st = client.cluster_stats().await?;
    st.daemons
        .iter()
        .find(|d| d.addr == name || d.id.to_string() == name)
        .map(|d| (d.id, d.addr.clone()))
        .ok_or_else(|| {
            let known: Vec<String> = st
                .daemons
                .iter()
                .map(|d| format!("{} ({})", d.id, d.addr))
                .collect();
            Failure::usage(format!("no daemon {name:?}; known: {}", known.join(", ")))
        })
}

pub async fn pin(args: PinArgs, pin: bool) -> Result<(), Failure> {
    let ns = Namespace::new(&args.ns.namespace).map_err(|e| Failure::usage(e.to_string()))?;
    let hashes: Vec<BlockHash> = args.keys.iter().map(|k| parse_key(&ns, k).hash).collect();
    let codes = client(&args.target).await?.pin(&ns, &hashes, pin).await?;
    let verb = if pin { "pinned" } else { "unpinned" };
    for (hash, code) in hashes.iter().zip(codes) {
        match code {
            ErrorCode::Ok => println!("{verb} {hash}"),
            ErrorCode::NotFound => println!("not found {hash}"),
            other => println!("failed {hash}: {other}"),
        }
    }
    Ok(())
}

pub async fn evict(args: EvictArgs) -> Result<(), Failure> {
    let client = client(&args.target).await?;
    let (id, addr) = find_daemon(&client, &args.daemon).await?;
    let mut conn = client
        .config()
        .tcp_dialer()
        .open(&addr, ErrorSource::Daemon, Duration::from_secs(2))
        .await?;
    if let Some(token) = &client.config().token {
        conn.authenticate(token).await?;
    }
    let request = EvictRequest {
        bytes: args.bytes.0,
    };
    let call = conn.call::<EvictResponse>(Opcode::Evict, &request, "evict");
    let freed = tokio::time::timeout(args.target.timeout, call)
        .await
        .map_err(|_| {
            Failure::connection(format!(
                "daemon {addr} did not answer within {:?}",
                args.target.timeout
            ))
        })??;
    if args.json {
        println!(
            "{}",
            json!({"daemon": id, "freed_bytes": freed.bytes, "blocks": freed.blocks})
        );
    } else {
        println!(
            "daemon {id} ({addr}): evicted {} blocks, {} freed",
            freed.blocks,
            ByteSize(freed.bytes)
        );
    }
    Ok(())
}

pub async fn drain(args: DrainArgs) -> Result<(), Failure> {
    let client = client(&args.target).await?;
    let (id, addr) = find_daemon(&client, &args.daemon).await?;
    client.drain(id, !args.undo).await?;
    if args.undo {
        println!("daemon {id} ({addr}) takes new blocks again");
        return Ok(());
    }
    // Its blocks, namespace by namespace, as the index lists them.
    let keys: Vec<(Namespace, BlockHash)> = blocks_on(&client, id)
        .await?
        .into_iter()
        .map(|e| (e.key.namespace, e.key.hash))
        .collect();
    let mut evicted = 0;
    if args.evict {
        for chunk in keys.chunk_by(|a, b| a.0 == b.0) {
            let hashes: Vec<BlockHash> = chunk.iter().map(|(_, h)| *h).collect();
            evicted += client
                .remove(&chunk[0].0, &hashes)
                .await?
                .iter()
                .filter(|c| **c == ErrorCode::Ok)
                .count();
        }
    }
    let left = match args.wait {
        Some(within) => Some(wait_copied(&client, id, keys.len(), within, args.json).await?),
        None => None,
    };
    if args.json {
        println!(
            "{}",
            json!({"daemon": id, "draining": true, "blocks": keys.len(), "evicted": evicted,
                   "not_copied": left})
        );
    } else if args.evict {
        println!("daemon {id} ({addr}) is draining: no new blocks; {evicted} of its {} blocks evicted. It can be stopped now.", keys.len());
    } else {
        match left {
            Some(0) => println!(
                "daemon {id} ({addr}) is drained: each of its {} blocks has a copy on another host. It can be stopped now.",
                keys.len()
            ),
            Some(n) => println!(
                "daemon {id} ({addr}) is draining: {n} of its {} blocks have no copy on another host yet (copies are made at the meta service's repair_rate); stopping it now makes them misses.",
                keys.len()
            ),
            None => println!(
                "daemon {id} ({addr}) is draining: no new blocks, and its {} blocks are being copied to other hosts (at the meta service's repair_rate). Run again with --wait to wait for that; stopping it sooner makes the rest misses.",
                keys.len()
            ),
        }
    }
    match left {
        Some(n) if n > 0 => Err(Failure::other(anyhow::anyhow!(
            "daemon {id}: {n} blocks not copied to another host within {:?}",
            args.wait.unwrap_or_default()
        ))),
        _ => Ok(()),
    }
}

/// Every block with a copy on daemon `id`, as the index lists them.
async fn blocks_on(client: &Client, id: u32) -> Result<Vec<ListEntry>, Failure> {
    let mut all = Vec::new();
    let mut after = None;
    loop {
        let page = client
            .list(&ListRequest {
                namespace: None,
                after: after.clone(),
                prefix: Vec::new(),
                daemon: id,
                limit: 4096,
            })
            .await?;
        after = page.entries.last().map(|e| e.key.clone());
        all.extend(page.entries);
        if !page.more || after.is_none() {
            return Ok(all);
        }
    }
}

/// Waits until each block on daemon `id` also has a copy on a daemon that
/// is not draining, for at most `within`; returns how many do not.
async fn wait_copied(
    client: &Client,
    id: u32,
    blocks: usize,
    within: Duration,
    quiet: bool,
) -> Result<usize, Failure> {
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(blocks as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "copied {pos}/{len} blocks to other hosts {bar:30} {elapsed}",
        )
        .expect("a valid template"),
    );
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let st = client.cluster_stats().await?;
        let staying: std::collections::HashSet<u32> = st
            .daemons
            .iter()
            .filter(|d| d.alive && !d.draining && d.id != id)
            .map(|d| d.id)
            .collect();
        let on_it = blocks_on(client, id).await?;
        let alone = on_it
            .iter()
            .filter(|e| !e.location.daemons.iter().any(|d| staying.contains(&d)))
            .count();
        let on_it = on_it.len();
        bar.set_length(on_it.max(blocks) as u64);
        bar.set_position((on_it.max(blocks) - alone) as u64);
        if alone == 0 || tokio::time::Instant::now() >= deadline {
            bar.finish_and_clear();
            return Ok(alone);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
