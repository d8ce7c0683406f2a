//! Eviction as a serving workload meets it, against a real `mooncake-store
//! up`: a prefill node writes a request's blocks, and a decode node reads
//! them soon after, through the meta service like any reader.

mod common;
use common::up::{metric, up};

use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, Namespace};

const BLOCK: usize = 64 << 10;

fn ns() -> Namespace {
    Namespace::new("t/eviction").unwrap()
}

fn hash(name: &str, i: usize) -> BlockHash {
    BlockHash::from_opaque(format!("{name}-{i}").as_bytes())
}

/// Puts `n` blocks `name-0..n` as one chain.
async fn put_chain(client: &Client, name: &str, n: usize) {
    let value = vec![5u8; BLOCK];
    let blocks: Vec<(BlockHash, &[u8])> = (0..n).map(|i| (hash(name, i), &value[..])).collect();
    let out = client.put_chain(&ns(), None, &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
}

/// Reads blocks `name-0..n` as a reader does (locations from the meta
/// service, then the daemon); how many were missing.
async fn misses(client: &Client, name: &str, n: usize) -> usize {
    let hashes: Vec<BlockHash> = (0..n).map(|i| hash(name, i)).collect();
    let mut bufs = vec![vec![0u8; BLOCK]; n];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let out = client.get_into(&ns(), &hashes, &mut slices).await.unwrap();
    for (o, buf) in out.iter().zip(&bufs) {
        if matches!(o, GetOutcome::Hit(_)) {
            assert!(buf.iter().all(|b| *b == 5), "a hit holds the bytes put");
        }
    }
    out.iter().filter(|o| **o == GetOutcome::Miss).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_read_soon_after_they_are_put_stop_missing_once_readers_miss_them() {
    // 8 MiB of DRAM under 2Q: probation (new blocks not read yet) holds
    // 5% of it, 400 KiB, about 6 blocks of 64 KiB.
    let store = up("8MiB", None).await;
    let connect =
        || Client::new(ClientConfig::new(store.meta.clone()).with_timeout(Duration::from_secs(5)));
    // The prefill node's client, and the decode node's: it never wrote these
    // blocks, so it knows nothing of them but what the meta service says.
    let (client, decode) = (connect(), connect());
    // Blocks in use: put, then read, so that they sit in main and fill the
    // pool.
    put_chain(&client, "used", 120).await;
    assert_eq!(misses(&client, "used", 120).await, 0);
    let limit = "mooncake_daemon_probation_bytes{state=\"limit\"}";
    let early = "mooncake_daemon_eviction_events_total{event=\"early_eviction_read\"}";
    let floor = metric(&store.admin, limit).await;
    // A prefill node writes a request's 24 blocks (1.5 MiB); the decode node
    // reads them at once. Probation lets the first ones go before they are
    // read: the decode node's lookups miss them, the meta service tells the
    // daemon (with the answer to its next heartbeat), and probation grows
    // by each block it let go.
    let mut seen = Vec::new();
    for r in 0..8 {
        let name = format!("request-{r}");
        put_chain(&client, &name, 24).await;
        let missed = misses(&decode, &name, 24).await;
        seen.push(missed);
        if missed == 0 {
            break;
        }
        let told = seen.iter().sum::<usize>() as u64;
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(&store.admin, early).await < told {
            if Instant::now() > deadline {
                panic!(
                    "the daemon never heard of {told} misses: {seen:?}, {} early reads, probation limit {}",
                    metric(&store.admin, early).await,
                    metric(&store.admin, limit).await,
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(seen[0] > 0, "probation is smaller than one request");
    assert_eq!(seen.last(), Some(&0), "requests kept missing: {seen:?}");
    assert!(metric(&store.admin, limit).await > floor, "probation grew");
    let counted = metric(&store.admin, early).await;
    assert_eq!(
        counted,
        seen.iter().sum::<usize>() as u64,
        "each miss once: {seen:?}"
    );
    // And the next requests of that size are read whole too.
    for r in 8..10 {
        let name = format!("request-{r}");
        put_chain(&client, &name, 24).await;
        assert_eq!(misses(&decode, &name, 24).await, 0, "{name}");
    }
    eprintln!("misses per request until probation held one: {seen:?}");
}
