//! One conformance suite, run against every transport that can run here:
//! same-host shared memory, TCP, TLS over TCP, QUIC, and TLS and QUIC with
//! mutual TLS. Each must round-trip blocks byte for byte, singly, in
//! batches, and made of pieces written and read in place; cost no more than its deadline against a peer that never
//! answers; return a clean error (never wrong bytes) when its peer dies
//! mid-transfer or sends garbage. Then (`encrypted`) what only the encrypted ones have:
//! a client without the right certificate is refused when mutual TLS is
//! on, a client that asks for QUIC never falls back to plain TCP, and a
//! TLS port refuses plain frames in one line and goes on serving.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mooncake_client::{
    Client, ClientConfig, ClientError, Dest, ErrorSource, GetOutcome, PutOptions, PutOutcome, Value,
};
use mooncake_net::DevCerts;
use mooncake_proto::message::Empty;
use mooncake_proto::transport::{Endpoint, TransportKind};
use mooncake_proto::{BlockHash, ErrorCode, Namespace, Opcode};
use mooncake_tests::{block_bytes, daemon_config, fast_meta, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn ns() -> Namespace {
    Namespace::new("t/transports").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Shm,
    Tcp,
    /// TLS on every TCP port, the servers' calls to each other included.
    Tls,
    TlsMutual,
    Quic,
    QuicMutual,
}

impl Kind {
    fn transport(self) -> TransportKind {
        match self {
            Kind::Shm => TransportKind::Shm,
            Kind::Tcp | Kind::Tls | Kind::TlsMutual => TransportKind::Tcp,
            Kind::Quic | Kind::QuicMutual => TransportKind::Quic,
        }
    }

    fn mutual(self) -> bool {
        matches!(self, Kind::TlsMutual | Kind::QuicMutual)
    }
}

/// A scratch directory with a development CA and certificates in it.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "mooncake-transports-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        DevCerts::generate(&["127.0.0.1".into()], "worker-1")
            .unwrap()
            .write(&dir)
            .unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A store whose daemon serves `kind`, and a client that uses it.
async fn setup(kind: Kind, dram: u64) -> (TestCluster, Client, Scratch) {
    let dir = Scratch::new();
    let mut cfg = daemon_config(dram);
    match kind {
        Kind::Tls | Kind::TlsMutual => {
            cfg = mooncake_store_daemon::DaemonConfig {
                dram: mooncake_proto::units::ByteSize(dram),
                ..tls_daemon(dir.path(), kind.mutual())
            }
        }
        Kind::Shm => cfg.shm_socket = Some(dir.path().join("daemon.sock")),
        Kind::Tcp => {}
        Kind::Quic | Kind::QuicMutual => {
            let tls = DevCerts::server_tls(dir.path(), kind.mutual());
            cfg.quic_listen = Some("127.0.0.1:0".into());
            cfg.tls_cert = Some(tls.cert);
            cfg.tls_key = Some(tls.key);
            cfg.tls_client_ca = tls.client_ca;
        }
    }
    let cluster = start_cluster(kind, dir.path(), vec![cfg]).await;
    let client = client_for(kind, &cluster, dir.path(), Duration::from_secs(5));
    (cluster, client, dir)
}

/// A cluster whose meta service suits `kind`, whose own checks (and fake
/// daemons) speak TLS when its servers do.
async fn start_cluster(
    kind: Kind,
    dir: &Path,
    daemons: Vec<mooncake_store_daemon::DaemonConfig>,
) -> TestCluster {
    let mut cluster = TestCluster::start_with(meta_for(kind, dir), Vec::new()).await;
    if matches!(kind, Kind::Tls | Kind::TlsMutual) {
        cluster.tls = Some(DevCerts::client_tls(dir, kind.mutual()));
    }
    for cfg in daemons {
        cluster.add_daemon(cfg).await;
    }
    cluster
}

/// A daemon speaking TLS on its TCP port (mutual TLS if `mutual`) and
/// reaching the meta service over TLS, trusting the development CA.
fn tls_daemon(dir: &Path, mutual: bool) -> mooncake_store_daemon::DaemonConfig {
    let tls = DevCerts::server_tls(dir, mutual);
    let mut cfg = daemon_config(16 << 20);
    cfg.tls = true;
    cfg.tls_cert = Some(tls.cert);
    cfg.tls_key = Some(tls.key);
    cfg.tls_client_ca = tls.client_ca;
    cfg.peer_ca = Some(dir.join("ca.pem"));
    cfg
}

/// The meta service for a client of `kind`: over QUIC for QUIC clients
/// (they reach it there too), over TLS (and calling daemons over TLS) for
/// TLS clients, with the same certificates as the daemons.
fn meta_for(kind: Kind, dir: &Path) -> mooncake_meta::MetaConfig {
    let mut meta = fast_meta();
    if matches!(
        kind,
        Kind::Quic | Kind::QuicMutual | Kind::Tls | Kind::TlsMutual
    ) {
        let tls = DevCerts::server_tls(dir, kind.mutual());
        meta.tls_cert = Some(tls.cert);
        meta.tls_key = Some(tls.key);
        meta.tls_client_ca = tls.client_ca;
    }
    match kind {
        Kind::Quic | Kind::QuicMutual => meta.quic = true,
        Kind::Tls | Kind::TlsMutual => {
            meta.tls = true;
            meta.peer_ca = Some(dir.join("ca.pem"));
        }
        Kind::Shm | Kind::Tcp => {}
    }
    meta
}

fn client_for(kind: Kind, cluster: &TestCluster, dir: &Path, timeout: Duration) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(timeout);
    match kind {
        Kind::Shm => cfg.shm_socket = Some(dir.join("daemon.sock")),
        Kind::Tcp => {}
        Kind::Tls | Kind::TlsMutual => {
            cfg = cfg
                .with_tls(&DevCerts::client_tls(dir, kind.mutual()))
                .unwrap()
        }
        Kind::Quic => cfg = cfg.with_quic(&DevCerts::client_tls(dir, false)).unwrap(),
        Kind::QuicMutual => cfg = cfg.with_quic(&DevCerts::client_tls(dir, true)).unwrap(),
    }
    Client::new(cfg)
}

async fn round_trips(kind: Kind) {
    let (_cluster, client, _dir) = setup(kind, 64 << 20).await;
    let sizes: Vec<usize> = (0..40).map(|i| 1 + i * 26_017 % (1 << 20)).collect();
    for (i, n) in sizes.iter().enumerate() {
        let value = block_bytes(i as u64, *n);
        let out = client
            .put(&ns(), &[(hash(i as u64), &value)])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
    for (i, n) in sizes.iter().enumerate() {
        let key = mooncake_proto::BlockKey::new(ns(), hash(i as u64));
        let got = client.get(&key).await.unwrap().expect("a hit");
        assert!(got == block_bytes(i as u64, *n), "block {i}: wrong bytes");
    }
    let t = client.transports();
    assert_eq!(t.writes(kind.transport()), 40, "{kind:?} carried every put");
    assert_eq!(t.reads(kind.transport()), 40, "{kind:?} carried every get");
}

/// Every namespace length the protocol allows, 1 to 128 bytes, stores and
/// reads back (a put's head is longest with the longest namespace).
async fn every_namespace_length(kind: Kind) {
    let (_cluster, client, _dir) = setup(kind, 16 << 20).await;
    let max = mooncake_proto::key::MAX_NAMESPACE_LEN;
    for len in 1..=max {
        let ns = Namespace::new("n".repeat(len)).unwrap();
        let value = block_bytes(len as u64, 100);
        let out = client
            .put(&ns, &[(hash(len as u64), &value)])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "namespace of {len} bytes");
        let key = mooncake_proto::BlockKey::new(ns, hash(len as u64));
        assert_eq!(
            client.get(&key).await.unwrap(),
            Some(value),
            "namespace of {len} bytes"
        );
    }
    let t = client.transports();
    assert_eq!(
        t.writes(kind.transport()),
        max as u64,
        "{kind:?} carried every put"
    );
    assert_eq!(
        t.reads(kind.transport()),
        max as u64,
        "{kind:?} carried every get"
    );
}

async fn batches(kind: Kind) {
    let (_cluster, client, _dir) = setup(kind, 64 << 20).await;
    let values: Vec<Vec<u8>> = (0..64).map(|i| block_bytes(100 + i, 64 << 10)).collect();
    let blocks: Vec<(BlockHash, &[u8])> = values
        .iter()
        .enumerate()
        .map(|(i, v)| (hash(100 + i as u64), &v[..]))
        .collect();
    let out = client.put(&ns(), &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    // The 64 stored blocks and 4 never stored, in one batch.
    let hashes: Vec<BlockHash> = (100..168).map(hash).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 64 << 10]; hashes.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.get_into(&ns(), &hashes, &mut slices).await.unwrap();
    for (i, outcome) in got.iter().enumerate() {
        if i < 64 {
            assert_eq!(*outcome, GetOutcome::Hit(64 << 10), "block {i}");
            assert!(bufs[i] == values[i], "block {i}: wrong bytes");
        } else {
            assert_eq!(*outcome, GetOutcome::Miss, "block {i}");
        }
    }
    assert_eq!(client.transports().reads(kind.transport()), 64);
}

/// Blocks made of pieces (a page's K and V apart, per-layer rows) are
/// written from their pieces and read into pieces cut another way, byte
/// for byte, and are the same blocks as when read whole; a destination
/// too small for a block is refused.
async fn pieces(kind: Kind) {
    let (_cluster, client, _dir) = setup(kind, 64 << 20).await;
    // A small page (inline on the same host), K and V of 256 KiB, uneven
    // rows with empty ones, one piece alone.
    let shapes: Vec<Vec<usize>> = vec![
        vec![4 << 10, 4 << 10],
        vec![256 << 10, 256 << 10],
        vec![0, 1000, 70_001, 3, 129 << 10, 0],
        vec![1 << 20],
    ];
    let values: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| block_bytes(500 + i as u64, s.iter().sum()))
        .collect();
    let pieces: Vec<Vec<&[u8]>> = values
        .iter()
        .zip(&shapes)
        .map(|(v, shape)| {
            let mut at = 0;
            shape
                .iter()
                .map(|n| {
                    at += n;
                    &v[at - n..at]
                })
                .collect()
        })
        .collect();
    let hashes: Vec<BlockHash> = (500..500 + values.len() as u64).map(hash).collect();
    let blocks: Vec<(BlockHash, Value<'_>)> = hashes
        .iter()
        .zip(&pieces)
        .map(|(h, p)| (*h, Value::Pieces(p)))
        .collect();
    let out = client
        .put_pieces(&ns(), &blocks, Some(None), PutOptions::default())
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");

    // Read into thirds of a buffer one byte longer than the block.
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len() + 1]).collect();
    let mut dests: Vec<Dest<'_>> = bufs
        .iter_mut()
        .map(|b| {
            let third = b.len() / 3;
            let (a, rest) = b.split_at_mut(third);
            let (b, c) = rest.split_at_mut(third);
            Dest::Pieces(vec![a, b, c])
        })
        .collect();
    let got = client
        .get_into_pieces(&ns(), &hashes, &mut dests)
        .await
        .unwrap();
    drop(dests);
    for (i, value) in values.iter().enumerate() {
        assert_eq!(got[i], GetOutcome::Hit(value.len()), "block {i}");
        assert!(
            bufs[i][..value.len()] == value[..],
            "block {i}: wrong bytes"
        );
        assert_eq!(bufs[i][value.len()], 0, "block {i}: written past its end");
        let key = mooncake_proto::BlockKey::new(ns(), hashes[i]);
        assert_eq!(
            client.get(&key).await.unwrap().as_ref(),
            Some(value),
            "block {i} whole"
        );
    }
    let mut small = [0u8; 10];
    let (a, b) = small.split_at_mut(5);
    let got = client
        .get_into_pieces(&ns(), &hashes[1..2], &mut [Dest::Pieces(vec![a, b])])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Failed(ErrorCode::TooLarge)]);
    assert!(small.iter().all(|b| *b == 0), "nothing written");
    let t = client.transports();
    assert_eq!(t.writes(kind.transport()), 4, "{kind:?} carried every put");
    assert_eq!(t.reads(kind.transport()), 8, "{kind:?} carried every get");
}

/// A peer that never answers costs one deadline, no more. For shared
/// memory the peer is a socket that accepts and says nothing: the link is
/// given up (a counted fallback) and the put goes over TCP, to a daemon
/// that never answers either.
async fn deadlines(kind: Kind) {
    let dir = Scratch::new();
    let cluster = start_cluster(kind, dir.path(), vec![]).await;
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    // A UDP socket that reads nothing: a QUIC handshake never completes.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let udp_addr = udp.local_addr().unwrap().to_string();
    let unix = std::os::unix::net::UnixListener::bind(dir.path().join("daemon.sock")).unwrap();
    let endpoints = vec![Endpoint {
        kind: TransportKind::Quic,
        addr: udp_addr,
    }];
    cluster.register_fake_daemon(hole_addr, endpoints).await;
    let timeout = Duration::from_millis(600);
    let client = client_for(kind, &cluster, dir.path(), timeout);
    let started = Instant::now();
    let result = client.put(&ns(), &[(hash(1), &[7u8; 300_000][..])]).await;
    let took = started.elapsed();
    assert!(
        matches!(result, Err(ClientError::Timeout { .. })),
        "{kind:?}: {result:?}"
    );
    assert!(
        took < timeout + Duration::from_millis(300),
        "{kind:?} took {took:?}"
    );
    if kind == Kind::Shm {
        let fell = client
            .transports()
            .fallbacks(TransportKind::Shm, TransportKind::Tcp);
        assert_eq!(fell, 1, "the link that never formed is counted");
    }
    drop((udp, unix));
}

/// The daemon stops while a client reads a large batch from it: the call
/// ends in an error or in failed and missed blocks, within its deadline,
/// and every block it calls a hit has the right bytes.
async fn peer_dies_mid_transfer(kind: Kind) {
    let (mut cluster, client, _dir) = setup(kind, 256 << 20).await;
    let n = 96;
    let values: Vec<Vec<u8>> = (0..n).map(|i| block_bytes(500 + i, 1 << 20)).collect();
    for (i, v) in values.iter().enumerate() {
        let out = client
            .put(&ns(), &[(hash(500 + i as u64), v)])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
    }
    let hashes: Vec<BlockHash> = (500..500 + n).map(hash).collect();
    let stop = cluster.daemons[0].stop.clone();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        stop.cancel();
    });
    let mut saw_failure = false;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !saw_failure && Instant::now() < deadline {
        let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 1 << 20]; hashes.len()];
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let started = Instant::now();
        let got = client.get_into(&ns(), &hashes, &mut slices).await;
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{kind:?}: past the deadline"
        );
        match got {
            Ok(outcomes) => {
                for (i, o) in outcomes.iter().enumerate() {
                    match o {
                        GetOutcome::Hit(len) => {
                            assert!(
                                bufs[i][..*len] == values[i][..],
                                "{kind:?}: wrong bytes in block {i}"
                            )
                        }
                        _ => saw_failure = true,
                    }
                }
            }
            Err(_) => saw_failure = true,
        }
    }
    killer.await.unwrap();
    assert!(saw_failure, "{kind:?}: the stopped daemon kept answering");
    cluster.daemons.clear();
}

/// A peer that answers with garbage: a clean error for the call, nothing
/// stored, and the client goes on working with a real daemon.
async fn peer_sends_garbage(kind: Kind) {
    let dir = Scratch::new();
    let cluster = start_cluster(kind, dir.path(), vec![]).await;
    let garbage = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = garbage.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = garbage.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(&noise(1 << 16)).await;
            });
        }
    });
    // A QUIC server with a valid certificate whose streams answer noise.
    let tls = DevCerts::server_tls(dir.path(), false);
    let server = mooncake_net::quic::server_config(&tls).unwrap();
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
    let quic_addr = endpoint.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let mut buf = [0u8; 64];
                    let _ = recv.read(&mut buf).await;
                    let _ = send.write_all(&noise(1 << 16)).await;
                }
            });
        }
    });
    // A Unix socket whose hello is noise.
    let unix = tokio::net::UnixListener::bind(dir.path().join("daemon.sock")).unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = unix.accept().await {
            let _ = s.write_all(&noise(4096)).await;
        }
    });
    let endpoints = vec![Endpoint {
        kind: TransportKind::Quic,
        addr: quic_addr,
    }];
    cluster.register_fake_daemon(tcp_addr, endpoints).await;
    let client = client_for(kind, &cluster, dir.path(), Duration::from_secs(2));
    let value = block_bytes(9, 200_000);
    let started = Instant::now();
    let out = client.put(&ns(), &[(hash(9), &value)]).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{kind:?}: past the deadline"
    );
    match out {
        Ok(outcomes) => assert!(
            matches!(outcomes[0], PutOutcome::Failed(_)),
            "{kind:?}: {outcomes:?}"
        ),
        Err(err) => assert!(
            !matches!(err, ClientError::Timeout { .. }),
            "{kind:?}: {err}"
        ),
    }
    assert_eq!(client.exists(&ns(), &[hash(9)]).await.unwrap(), vec![false]);
}

fn noise(len: usize) -> Vec<u8> {
    (0..len).map(|_| rand::random::<u8>()).collect()
}

macro_rules! conformance {
    ($($module:ident => $kind:expr),* $(,)?) => {$(
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn round_trips_byte_for_byte() {
                round_trips($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_namespace_length_round_trips() {
                every_namespace_length($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_with_hits_and_misses() {
                batches($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn blocks_in_pieces_round_trip_in_place_byte_for_byte() {
                pieces($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_silent_peer_costs_one_deadline() {
                deadlines($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_peer_that_dies_mid_transfer_never_yields_wrong_bytes() {
                peer_dies_mid_transfer($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_peer_that_sends_garbage_gets_a_clean_error() {
                peer_sends_garbage($kind).await
            }
        }
    )*};
}

conformance! {
    shm => Kind::Shm,
    tcp => Kind::Tcp,
    tls => Kind::Tls,
    tls_mutual => Kind::TlsMutual,
    quic => Kind::Quic,
    quic_mutual => Kind::QuicMutual,
}

mod encrypted;
