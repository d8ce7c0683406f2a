//! `bench-peer`: the same load as `bench`, against the stores users would
//! pick instead (redis-server, memcached), from the same async Rust client
//! loop, so that a comparison measures servers rather than clients. Also
//! the prefix-match question asked the Redis way: pipelined `EXISTS` over a
//! chain of keys.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;
use mooncake_proto::units::ByteSize;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use crate::exit::Failure;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Peer {
    Redis,
    Memcached,
}

#[derive(clap::Args, Debug)]
pub struct BenchPeerArgs {
    /// Which server speaks at --addr.
    #[arg(long, value_enum)]
    peer: Peer,
    /// Its address, e.g. 127.0.0.1:6379.
    #[arg(long)]
    addr: String,
    #[arg(long, value_delimiter = ',', default_value = "16KiB,256KiB,4MiB")]
    sizes: Vec<ByteSize>,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Gets per size (sets: as many distinct values, at most this many and
    /// at most --max-bytes in all).
    #[arg(long, default_value_t = 2000)]
    ops: usize,
    #[arg(long, default_value = "2GiB")]
    max_bytes: ByteSize,
    /// Also time prefix matches of chains of this many keys with pipelined
    /// EXISTS (redis only).
    #[arg(long)]
    chain: Option<usize>,
}

/// One connection to the peer, speaking its text protocol.
struct PeerConn {
    peer: Peer,
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    line: String,
}

fn bad(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why)
}

impl PeerConn {
    async fn connect(peer: Peer, addr: &str) -> std::io::Result<Self> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (rd, wr) = s.into_split();
        Ok(PeerConn {
            peer,
            rd: BufReader::with_capacity(64 << 10, rd),
            wr: BufWriter::with_capacity(64 << 10, wr),
            line: String::new(),
        })
    }

    async fn read_line(&mut self) -> std::io::Result<&str> {
        self.line.clear();
        if self.rd.read_line(&mut self.line).await? == 0 {
            return Err(bad("peer closed the connection".into()));
        }
        Ok(self.line.trim_end())
    }

    async fn set(&mut self, key: &str, value: &[u8]) -> std::io::Result<()> {
        match self.peer {
            Peer::Redis => {
                let head = format!(
                    "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n",
                    key.len(),
                    value.len()
                );
                self.wr.write_all(head.as_bytes()).await?;
            }
            Peer::Memcached => {
                let head = format!("set {key} 0 0 {}\r\n", value.len());
                self.wr.write_all(head.as_bytes()).await?;
            }
        }
        self.wr.write_all(value).await?;
        self.wr.write_all(b"\r\n").await?;
        self.wr.flush().await?;
        let line = self.read_line().await?;
        if line == "+OK" || line == "STORED" {
            Ok(())
        } else {
            Err(bad(format!("set answered {line:?}")))
        }
    }

    /// Reads a value into `buf`; `false` on a miss.
    async fn get(&mut self, key: &str, buf: &mut [u8]) -> std::io::Result<bool> {
        let req = match self.peer {
            Peer::Redis => format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()),
            Peer::Memcached => format!("get {key}\r\n"),
        };
        self.wr.write_all(req.as_bytes()).await?;
        self.wr.flush().await?;
        let line = self.read_line().await?.to_string();
        let len: usize = match self.peer {
            Peer::Redis if line == "$-1" => return Ok(false),
            Peer::Redis => line.strip_prefix('$').and_then(|n| n.parse().ok()),
            Peer::Memcached if line == "END" => return Ok(false),
            Peer::Memcached => line.rsplit(' ').next().and_then(|n| n.parse().ok()),
        }
        .ok_or_else(|| bad(format!("get answered {line:?}")))?;
        if len > buf.len() {
            return Err(bad(format!(
                "value of {len} bytes for a {}-byte buffer",
                buf.len()
            )));
        }
        self.rd.read_exact(&mut buf[..len]).await?;
        let mut crlf = [0u8; 2];
        self.rd.read_exact(&mut crlf).await?;
        if matches!(self.peer, Peer::Memcached) {
            let end = self.read_line().await?;
            if end != "END" {
                return Err(bad(format!("expected END, got {end:?}")));
            }
        }
        Ok(true)
    }

    /// How many leading keys exist, asked with `pipeline` (one `EXISTS` per
    /// key, made once by `exists_pipeline`) of `keys` commands.
    async fn leading_existing(&mut self, pipeline: &[u8], keys: usize) -> std::io::Result<usize> {
        self.wr.write_all(pipeline).await?;
        self.wr.flush().await?;
        let mut leading = 0;
        let mut gap = false;
        for _ in 0..keys {
            let line = self.read_line().await?;
            if line == ":1" && !gap {
                leading += 1;
            } else {
                gap = true;
            }
        }
        Ok(leading)
    }
}

/// One `EXISTS` per key, in one buffer: encoded once, so that timing
/// measures redis rather than this client's formatting.
fn exists_pipeline(keys: &[String]) -> Vec<u8> {
    keys.iter()
        .flat_map(|key| format!("*2\r\n$6\r\nEXISTS\r\n${}\r\n{key}\r\n", key.len()).into_bytes())
        .collect()
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

fn row(
    op: &str,
    size: u64,
    ops: usize,
    seconds: f64,
    hist: &Histogram<u64>,
    misses: u64,
    errors: u64,
) -> serde_json::Value {
    json!({"op": op, "size": size, "ops": ops, "seconds": seconds,
           // Only values that arrived count as bytes moved.
           "ops_per_sec": ops as f64 / seconds,
           "gb_per_sec": ((ops as u64).saturating_sub(misses + errors) * size) as f64 / seconds / 1e9,
           "p50_us": hist.value_at_quantile(0.5), "p99_us": hist.value_at_quantile(0.99),
           "p999_us": hist.value_at_quantile(0.999), "misses": misses, "errors": errors})
}

/// `total` operations from `concurrency` connections; `op(conn, i, buf)`
/// returns whether it hit.
async fn phase(
    args: &BenchPeerArgs,
    size: usize,
    total: usize,
    keys: usize,
    set: bool,
) -> Result<(f64, Histogram<u64>, u64, u64), Failure> {
    let next = Arc::new(AtomicUsize::new(0));
    let value = Arc::new(vec![7u8; size]);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let mut conn = PeerConn::connect(args.peer, &args.addr)
            .await
            .map_err(|e| Failure::connection(format!("{:?} at {}: {e}", args.peer, args.addr)))?;
        let (next, value) = (next.clone(), value.clone());
        workers.push(tokio::spawn(async move {
            let (mut hist, mut misses, mut errors) = (histogram(), 0u64, 0u64);
            let mut buf = vec![0u8; size];
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let key = format!("bench-{size}-{}", i % keys);
                let t = Instant::now();
                let result = if set {
                    conn.set(&key, &value).await.map(|_| true)
                } else {
                    conn.get(&key, &mut buf).await
                };
                hist.saturating_record(t.elapsed().as_micros() as u64);
                match result {
                    Ok(true) => {}
                    Ok(false) => misses += 1,
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            (hist, misses, errors)
        }));
    }
    let (mut hist, mut misses, mut errors) = (histogram(), 0, 0);
    for w in workers {
        if let Ok((h, m, e)) = w.await {
            hist.add(h).expect("same bounds");
            misses += m;
            errors += e;
        }
    }
    Ok((start.elapsed().as_secs_f64(), hist, misses, errors))
}

pub async fn run(args: BenchPeerArgs) -> Result<(), Failure> {
    if args.concurrency == 0 || args.ops == 0 {
        return Err(Failure::usage("--concurrency and --ops must be at least 1"));
    }
    for size in &args.sizes {
        let size = size.0 as usize;
        let keys = (args.max_bytes.0 as usize / size.max(1)).clamp(1, args.ops);
        let (secs, hist, misses, errors) = phase(&args, size, keys, keys, true).await?;
        println!(
            "{}",
            row("put", size as u64, keys, secs, &hist, misses, errors)
        );
        let (secs, hist, misses, errors) = phase(&args, size, args.ops, keys, false).await?;
        println!(
            "{}",
            row("get", size as u64, args.ops, secs, &hist, misses, errors)
        );
    }
    if let (Some(chain), Peer::Redis) = (args.chain, args.peer) {
        let mut conn = PeerConn::connect(args.peer, &args.addr)
            .await
            .map_err(|e| Failure::connection(e.to_string()))?;
        let chains = 200usize;
        let all: Vec<Vec<String>> = (0..chains)
            .map(|c| (0..chain).map(|k| format!("chain-{c}-{k}")).collect())
            .collect();
        for keys in &all {
            for key in keys {
                conn.set(key, b"1")
                    .await
                    .map_err(|e| Failure::other(e.into()))?;
            }
        }
        let pipelines: Arc<Vec<Vec<u8>>> =
            Arc::new(all.iter().map(|k| exists_pipeline(k)).collect());
        drop(conn);
        // As many connections as `bench-meta` has requests in flight, each
        // asking one chain at a time.
        let rounds = (args.ops * 10).max(chains);
        let next = Arc::new(AtomicUsize::new(0));
        let mut workers = Vec::new();
        let start = Instant::now();
        for _ in 0..args.concurrency {
            let mut conn = PeerConn::connect(args.peer, &args.addr)
                .await
                .map_err(|e| Failure::connection(e.to_string()))?;
            let (next, pipelines) = (next.clone(), pipelines.clone());
            workers.push(tokio::spawn(async move {
                let (mut hist, mut matched) = (histogram(), 0usize);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= rounds {
                        break;
                    }
                    let t = Instant::now();
                    matched += conn.leading_existing(&pipelines[i % chains], chain).await?;
                    hist.saturating_record(t.elapsed().as_micros() as u64);
                }
                Ok::<_, std::io::Error>((hist, matched))
            }));
        }
        let (mut hist, mut matched) = (histogram(), 0usize);
        for w in workers {
            let (h, m) = w
                .await
                .map_err(|e| Failure::other(e.into()))?
                .map_err(|e| Failure::other(e.into()))?;
            hist.add(h).expect("same bounds");
            matched += m;
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{}",
            json!({"op": "match_prefix", "chain": chain, "requests": rounds, "concurrency": args.concurrency, "keys_per_sec": matched as f64 / secs,
                   "p50_us": hist.value_at_quantile(0.5), "p99_us": hist.value_at_quantile(0.99),
                   "matched": matched, "expected": rounds * chain})
        );
    }
    Ok(())
}
