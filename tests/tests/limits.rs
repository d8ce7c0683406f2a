//! What a peer gets that never authenticates, drips, or idles: a bounded
//! time and a bounded number of bytes, and never the connections a client
//! with a token needs. Each test holds raw sockets against a real meta
//! service and daemon while a real client keeps working.
//!
//! No assertion here is on time: a closed connection is waited for with a
//! bound far past its deadline, and then what must hold is checked.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig, PutOutcome};
use mooncake_proto::auth::token_digest;
use mooncake_proto::units::HumanDuration;
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Header, Namespace, Opcode, HEADER_LEN};
use mooncake_tests::{daemon_config, fast_meta, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ACME: &str = "acme-token";
const CLUSTER: &str = "cluster-token";
/// Far past every deadline these tests set: a connection still open then
/// was kept.
const CLOSED_WITHIN: Duration = Duration::from_secs(30);

fn token_file(dir: &std::path::Path) -> std::path::PathBuf {
    let entry = |name: &str, token: &str, role: &str, tenant: &str| {
        format!(
            "[[tokens]]\nname = \"{name}\"\nsha256 = \"{}\"\nrole = \"{role}\"\n{tenant}",
            token_digest(token)
        )
    };
    let text = [
        entry("acme-workers", ACME, "client", "tenant = \"acme\"\n"),
        entry("storage", CLUSTER, "cluster", ""),
    ]
    .join("\n");
    let path = dir.join("tokens.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A meta service and a daemon with short deadlines: `auth` for a token,
/// `idle` between requests, and at most 4 peers without a token each.
async fn cluster(with_auth: bool, auth: Duration, idle: Duration) -> TestCluster {
    let mut meta = fast_meta();
    let mut daemon = daemon_config(32 << 20);
    meta.auth_timeout = HumanDuration(auth);
    meta.idle_timeout = HumanDuration(idle);
    meta.max_unauthenticated_connections = 4;
    daemon.auth_timeout = HumanDuration(auth);
    daemon.idle_timeout = HumanDuration(idle);
    daemon.max_unauthenticated_connections = 4;
    if !with_auth {
        return TestCluster::start_with(meta, vec![daemon]).await;
    }
    let dir = std::env::temp_dir().join(format!(
        "mooncake-limits-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = token_file(&dir);
    meta.auth = Some(tokens.clone());
    meta.token = Some(CLUSTER.into());
    daemon.auth = Some(tokens);
    daemon.token = Some(CLUSTER.into());
    TestCluster::start_as(meta, vec![daemon], Some(CLUSTER)).await
}

fn client(cluster: &TestCluster, token: Option<&str>) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(5));
    if let Some(t) = token {
        cfg = cfg.with_token(t);
    }
    Client::new(cfg)
}

/// A put and a get of a fresh block round trip.
async fn works(client: &Client, n: u32) {
    let ns = Namespace::new("acme/limits").unwrap();
    let hash = BlockHash::from_opaque(&n.to_le_bytes());
    let value = vec![n as u8; 8192];
    assert_eq!(
        client.put(&ns, &[(hash, &value)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    let got = client.get(&BlockKey::new(ns, hash)).await.unwrap();
    assert_eq!(got.as_deref(), Some(&value[..]));
}

/// Whether the server closed `conn` within `CLOSED_WITHIN`, reading (and
/// dropping) whatever it answered first.
async fn closed_by_server(conn: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    let until = tokio::time::Instant::now() + CLOSED_WITHIN;
    loop {
        match tokio::time::timeout_at(until, conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

async fn open(addr: &str, n: usize) -> Vec<TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(TcpStream::connect(addr).await.unwrap());
    }
    conns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_token_never_keep_a_client_with_one_out() {
    let cluster = cluster(true, Duration::from_secs(2), Duration::from_secs(300)).await;
    let servers = [cluster.meta_addr.clone(), cluster.daemon_addr(0)];
    // Three times as many silent peers as each server keeps without a
    // token, on both servers; then a client with a token connects anew.
    let mut silent = Vec::new();
    for addr in &servers {
        silent.extend(open(addr, 12).await);
    }
    let acme = client(&cluster, Some(ACME));
    works(&acme, 1).await;
    // A peer dripping an `Auth` frame, a byte at a time, never finishes.
    let mut drip = TcpStream::connect(&cluster.daemon_addr(0)).await.unwrap();
    let frame = {
        let body = mooncake_proto::message::Body::to_bytes(&mooncake_proto::auth::AuthRequest {
            token: ACME.into(),
        });
        let mut f = Header::request(Opcode::Auth, 1, body.len() as u32)
            .encode()
            .to_vec();
        f.extend_from_slice(&body);
        f
    };
    let mut dripped = 0;
    for byte in &frame[..frame.len() - 1] {
        if drip.write_all(&[*byte]).await.is_err() {
            break;
        }
        dripped += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for conn in &mut silent {
        assert!(
            closed_by_server(conn).await,
            "a silent peer without a token is closed"
        );
    }
    assert!(
        closed_by_server(&mut drip).await,
        "a dripping peer is closed"
    );
    assert!(dripped < frame.len(), "and never got its frame in");
    // Held out all along? No: the client's connections are still served.
    works(&acme, 2).await;
    assert!(
        client(&cluster, None)
            .exists(&Namespace::new("acme").unwrap(), &[BlockHash([0; 32])])
            .await
            .is_err(),
        "and still nothing for a client without a token"
    );
}

/// A Ping on `conn`, and the status of its answer; `None` if the server
/// closed the connection without one.
async fn ping(conn: &mut TcpStream) -> Option<u16> {
    conn.write_all(&Header::request(Opcode::Ping, 9, 0).encode())
        .await
        .ok()?;
    let mut raw = [0u8; HEADER_LEN];
    tokio::time::timeout(CLOSED_WITHIN, conn.read_exact(&mut raw))
        .await
        .ok()?
        .ok()?;
    Some(Header::parse(&raw).unwrap().unwrap().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_servers_turn_a_client_past_its_connection_cap_away_busy_and_take_it_back_after() {
    const CAP: usize = 6;
    let mut meta = fast_meta();
    let mut daemon = daemon_config(32 << 20);
    meta.max_connections_per_client = CAP;
    daemon.max_connections_per_client = CAP;
    let cluster = TestCluster::start_with(meta, vec![daemon]).await;
    for addr in [cluster.meta_addr.clone(), cluster.daemon_addr(0)] {
        // Every connection from this host counts, the daemon's own link to
        // the meta service included: open until one is turned away.
        let mut held = Vec::new();
        let refused = loop {
            assert!(held.len() <= CAP, "{addr}: {} connections kept", held.len());
            let mut conn = TcpStream::connect(&addr).await.unwrap();
            match ping(&mut conn).await {
                Some(status) if status == ErrorCode::Ok as u16 => held.push(conn),
                other => break (other, conn),
            }
        };
        let (status, mut conn) = refused;
        assert_eq!(
            status,
            Some(ErrorCode::Busy as u16),
            "{addr}: answered busy"
        );
        assert!(closed_by_server(&mut conn).await, "{addr} closes it");
        // A place freed is a place taken again.
        drop(held.pop());
        let again = eventually_serves(&addr).await;
        assert!(again, "{addr} serves a new connection once one closed");
    }
}

/// Whether a new connection to `addr` is served within `CLOSED_WITHIN` (a
/// closed connection's place is freed when the server sees it close).
async fn eventually_serves(addr: &str) -> bool {
    let until = tokio::time::Instant::now() + CLOSED_WITHIN;
    while tokio::time::Instant::now() < until {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        if ping(&mut conn).await == Some(ErrorCode::Ok as u16) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auth_larger_than_a_token_is_refused_from_its_header() {
    let cluster = cluster(true, Duration::from_secs(5), Duration::from_secs(300)).await;
    for addr in [cluster.meta_addr.clone(), cluster.daemon_addr(0)] {
        let mut conn = TcpStream::connect(&addr).await.unwrap();
        // A header announcing 4 MiB of token, and no body: refused at once,
        // nothing allocated for it.
        conn.write_all(&Header::request(Opcode::Auth, 1, 4 << 20).encode())
            .await
            .unwrap();
        let mut raw = [0u8; HEADER_LEN];
        conn.read_exact(&mut raw).await.unwrap();
        let reply = Header::parse(&raw).unwrap().unwrap();
        assert_eq!(
            reply.status,
            ErrorCode::TooLarge as u16,
            "{addr}: {reply:?}"
        );
        assert!(closed_by_server(&mut conn).await, "{addr} closes it");
    }
    works(&client(&cluster, Some(ACME)), 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_clients_carry_on() {
    let cluster = cluster(false, Duration::from_secs(5), Duration::from_secs(1)).await;
    let worker = client(&cluster, None);
    works(&worker, 4).await;
    for addr in [cluster.meta_addr.clone(), cluster.daemon_addr(0)] {
        let mut idle = TcpStream::connect(&addr).await.unwrap();
        assert!(
            closed_by_server(&mut idle).await,
            "{addr} closes an idle peer"
        );
    }
    // By now the worker's pooled connections were closed as idle too: it
    // finds out and opens new ones.
    works(&worker, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_headers_without_values_push_out_no_stored_block() {
    let mut daemon = daemon_config(32 << 20);
    daemon.put_stall_timeout = HumanDuration(Duration::from_secs(1));
    let cluster = TestCluster::start_with(fast_meta(), vec![daemon]).await;
    let victim = client(&cluster, None);
    let ns = Namespace::new("globex/kept").unwrap();
    let stored: Vec<(BlockHash, Vec<u8>)> = (0..40u32)
        .map(|i| {
            (
                BlockHash::from_opaque(&i.to_le_bytes()),
                vec![i as u8; 256 << 10],
            )
        })
        .collect();
    let blocks: Vec<(BlockHash, &[u8])> = stored.iter().map(|(h, v)| (*h, &v[..])).collect();
    assert!(victim
        .put(&ns, &blocks)
        .await
        .unwrap()
        .iter()
        .all(|o| *o == PutOutcome::Stored));
    // 40 connections each announce a 4 MiB value (160 MiB against a 32 MiB
    // pool) and send only the head.
    let mut heads = Vec::new();
    for i in 0..40u32 {
        let head = mooncake_proto::message::PutHead {
            key: BlockKey::new(
                Namespace::new("acme/flood").unwrap(),
                BlockHash::from_opaque(&(1000 + i).to_le_bytes()),
            ),
            checksum: 1,
            parent: None,
            continues: false,
            tag: None,
        };
        let head = mooncake_proto::message::Body::to_bytes(&head);
        let mut conn = TcpStream::connect(cluster.daemon_addr(0)).await.unwrap();
        let len = (head.len() + (4 << 20)) as u32;
        conn.write_all(&Header::request(Opcode::Put, 1, len).encode())
            .await
            .unwrap();
        conn.write_all(&head).await.unwrap();
        heads.push(conn);
    }
    let fresh = client(&cluster, None);
    for (hash, value) in &stored {
        let got = fresh.get(&BlockKey::new(ns.clone(), *hash)).await.unwrap();
        assert_eq!(
            got.as_deref(),
            Some(&value[..]),
            "a stored block was pushed out"
        );
    }
    // The heads' room is freed once their values stop coming; puts go on.
    for conn in &mut heads {
        assert!(closed_by_server(conn).await, "a stalled put is dropped");
    }
    works(&victim, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_past_the_cap_are_busy_and_a_client_goes_on_after_they_expire() {
    let mut meta = fast_meta();
    meta.max_pending_puts = 10;
    let cluster = TestCluster::start_with(meta, vec![daemon_config(16 << 20)]).await;
    let mut conn = mooncake_net::Connection::connect(
        &cluster.meta_addr,
        mooncake_client::ErrorSource::Meta,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    // A writer that reserves 25 keys and never commits.
    assert_eq!(hoard(&mut conn, "acme/hoard", 25).await, (10, 15));
    // Its reservations expire (put_timeout); puts go on.
    let worker = client(&cluster, None);
    let mut n = 10u32;
    let stored = mooncake_tests::eventually(CLOSED_WITHIN, || {
        n += 1;
        let worker = &worker;
        async move {
            let ns = Namespace::new("acme/limits").unwrap();
            let hash = BlockHash::from_opaque(&n.to_le_bytes());
            worker
                .put(&ns, &[(hash, &[1u8; 100][..])])
                .await
                .is_ok_and(|o| o[0] == PutOutcome::Stored)
        }
    })
    .await;
    assert!(stored, "a put after the hoard expired");
}

/// A connection to the meta service from `from`, a loopback address of
/// its own (another client, as the meta service tells clients apart).
async fn meta_conn_from(cluster: &TestCluster, from: [u8; 4]) -> mooncake_net::Connection {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
    let stream = socket
        .connect(cluster.meta_addr.parse().unwrap())
        .await
        .unwrap();
    let (rd, wr) = stream.into_split();
    mooncake_net::Connection::from_halves(
        &cluster.meta_addr,
        mooncake_client::ErrorSource::Meta,
        Box::new(rd),
        Box::new(wr),
    )
}

/// Reserves `n` keys of `ns` on `conn` and never commits them: how many
/// were placed, and how many answered busy.
async fn hoard(conn: &mut mooncake_net::Connection, ns: &str, n: u32) -> (usize, usize) {
    use mooncake_proto::message::{PutStartRequest, PutStartResponse, Slot, ToPlace};
    let req = PutStartRequest {
        namespace: Namespace::new(ns).unwrap(),
        node: String::new(),
        replicas: 1,
        items: (0..n)
            .map(|i| ToPlace::unchained(BlockHash::from_opaque(&i.to_le_bytes()), 4096))
            .collect(),
    };
    let answer: PutStartResponse = conn
        .call(Opcode::PutStart, &req, "put_start")
        .await
        .unwrap();
    let count = |want: fn(&Slot) -> bool| answer.slots.iter().filter(|s| want(s)).count();
    (
        count(|s| matches!(s, Slot::Place { .. })),
        count(|s| matches!(s, Slot::Skip(ErrorCode::Busy))),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_holds_at_most_its_share_of_reservations_and_others_go_on() {
    let mut meta = fast_meta();
    meta.max_pending_puts = 100;
    meta.max_pending_puts_per_client = 10;
    let cluster = TestCluster::start_with(meta, vec![daemon_config(16 << 20)]).await;
    // A client (127.0.0.2) hoards over two connections: it gets its 10.
    let mut first = meta_conn_from(&cluster, [127, 0, 0, 2]).await;
    let mut second = meta_conn_from(&cluster, [127, 0, 0, 2]).await;
    assert_eq!(hoard(&mut first, "acme/hoard", 25).await, (10, 15));
    assert_eq!(
        hoard(&mut second, "acme/hoard2", 5).await,
        (0, 5),
        "the cap is the client's, not the connection's"
    );
    // Another client (127.0.0.3) gets its own 10 at once.
    let mut other = meta_conn_from(&cluster, [127, 0, 0, 3]).await;
    assert_eq!(hoard(&mut other, "acme/other", 10).await, (10, 0));
    // And a worker (127.0.0.1) stores without waiting for those to expire.
    let worker = client(&cluster, None);
    let ns = Namespace::new("acme/limits").unwrap();
    let stored = worker
        .put(&ns, &[(BlockHash::from_opaque(b"w"), &[1u8; 100][..])])
        .await
        .unwrap();
    assert_eq!(stored, vec![PutOutcome::Stored]);
}
