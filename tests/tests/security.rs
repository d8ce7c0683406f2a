//! Authentication and tenants: with a token file, nothing is served before
//! a valid token, each tenant's clients use only their own namespaces (at
//! the meta service and straight at the daemons alike), operator calls need
//! the admin role, and a daemon without a cluster token cannot join.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig, ClientError, ErrorSource, GetOutcome, PutOutcome};
use mooncake_net::Connection;
use mooncake_proto::auth::token_digest;
use mooncake_proto::message::{Empty, KeyRequest, ListRequest};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace, Opcode};
use mooncake_tests::{daemon_config, fast_meta, TestCluster};

const ACME: &str = "acme-token";
const GLOBEX: &str = "globex-token";
const CLUSTER: &str = "cluster-token";
const ADMIN: &str = "admin-token";

fn token_file(dir: &std::path::Path) -> std::path::PathBuf {
    let entry = |name: &str, token: &str, role: &str, tenant: Option<&str>| {
        let tenant = tenant.map_or(String::new(), |t| format!("tenant = \"{t}\"\n"));
        format!(
            "[[tokens]]\nname = \"{name}\"\nsha256 = \"{}\"\nrole = \"{role}\"\n{tenant}",
            token_digest(token)
        )
    };
    let text = [
        entry("acme-workers", ACME, "client", Some("acme")),
        entry("globex-workers", GLOBEX, "client", Some("globex")),
        entry("storage", CLUSTER, "cluster", None),
        entry("ops", ADMIN, "admin", None),
    ]
    .join("\n");
    let path = dir.join("tokens.toml");
    std::fs::write(&path, text).unwrap();
    path
}

async fn secured() -> (TestCluster, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-auth-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = token_file(&dir);
    let mut meta = fast_meta();
    meta.auth = Some(tokens.clone());
    meta.token = Some(CLUSTER.into());
    let mut daemon = daemon_config(32 << 20);
    daemon.auth = Some(tokens.clone());
    daemon.token = Some(CLUSTER.into());
    let cluster = TestCluster::start_as(meta, vec![daemon], Some(ADMIN)).await;
    (cluster, dir)
}

fn client(cluster: &TestCluster, token: Option<&str>) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(5));
    if let Some(t) = token {
        cfg = cfg.with_token(t);
    }
    Client::new(cfg)
}

/// A removal sent straight to the daemon, skipping the meta service, on a
/// connection that presents `token` first (if any).
async fn remove_at_daemon(
    cluster: &TestCluster,
    token: Option<&str>,
    key: BlockKey,
) -> Result<Empty, ClientError> {
    let mut conn = Connection::connect(
        &cluster.daemon_addr(0),
        ErrorSource::Daemon,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    if let Some(token) = token {
        conn.authenticate(token).await.unwrap();
    }
    conn.call::<Empty>(Opcode::Remove, &KeyRequest { key }, "remove")
        .await
}

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

fn unauthorized<T: std::fmt::Debug>(result: Result<T, ClientError>) -> bool {
    matches!(
        result,
        Err(ClientError::Server {
            code: ErrorCode::Unauthorized,
            ..
        })
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_served_without_a_valid_token() {
    let (cluster, dir) = secured().await;
    let h = [BlockHash::from_opaque(b"k")];
    assert!(unauthorized(
        client(&cluster, None).exists(&ns("acme"), &h).await
    ));
    assert!(unauthorized(
        client(&cluster, Some("wrong"))
            .exists(&ns("acme"), &h)
            .await
    ));
    // Straight at the daemon, without a token: refused before any work.
    assert!(unauthorized(
        remove_at_daemon(&cluster, None, BlockKey::new(ns("acme"), h[0])).await
    ));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_can_neither_read_nor_write_nor_probe_each_other() {
    let (cluster, dir) = secured().await;
    let acme = client(&cluster, Some(ACME));
    let globex = client(&cluster, Some(GLOBEX));
    let h = [BlockHash::from_opaque(b"system-prompt")];
    let secret = b"acme's KV block".to_vec();
    assert_eq!(
        acme.put(&ns("acme/llama"), &[(h[0], &secret)])
            .await
            .unwrap(),
        vec![PutOutcome::Stored]
    );
    assert!(acme.exists(&ns("acme/llama"), &h).await.unwrap()[0]);

    // Globex names acme's namespace: refused everywhere, not a miss (a miss
    // would tell whether acme has the prefix cached).
    assert!(unauthorized(globex.exists(&ns("acme/llama"), &h).await));
    assert!(unauthorized(
        globex.match_prefix(&ns("acme/llama"), &h).await
    ));
    let mut buf = [0u8; 64];
    assert!(unauthorized(
        globex
            .get_into(&ns("acme/llama"), &h, &mut [&mut buf[..]])
            .await
    ));
    assert!(unauthorized(
        globex.put(&ns("acme/llama"), &[(h[0], b"poison")]).await
    ));
    assert!(unauthorized(globex.remove(&ns("acme/llama"), &h).await));
    assert!(unauthorized(
        globex
            .list(&ListRequest {
                namespace: None,
                after: None,
                prefix: vec![],
                daemon: 0,
                limit: 10
            })
            .await
    ));

    // Straight at the daemon with the key in hand: refused too.
    assert!(unauthorized(
        remove_at_daemon(
            &cluster,
            Some(GLOBEX),
            BlockKey::new(ns("acme/llama"), h[0])
        )
        .await
    ));

    // Globex's own namespace works, and the same hash there is a different
    // block: acme's bytes never come back to it.
    assert!(!globex.exists(&ns("globex"), &h).await.unwrap()[0]);
    globex
        .put(&ns("globex"), &[(h[0], b"globex's own")])
        .await
        .unwrap();
    let got = acme
        .get_into(&ns("acme/llama"), &h, &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(secret.len())]);
    assert_eq!(&buf[..secret.len()], &secret[..]);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_calls_need_the_admin_role_and_daemons_a_cluster_token() {
    let (mut cluster, dir) = secured().await;
    let acme = client(&cluster, Some(ACME));
    let admin = client(&cluster, Some(ADMIN));
    let daemon = admin.cluster_stats().await.unwrap().daemons[0].id;
    assert!(unauthorized(acme.drain(daemon, true).await));
    admin.drain(daemon, true).await.unwrap();
    admin.drain(daemon, false).await.unwrap();

    // A daemon whose token is not a cluster token never joins.
    let mut rogue = daemon_config(8 << 20);
    rogue.auth = Some(dir.join("tokens.toml"));
    rogue.token = Some(ACME.into());
    let stop = cluster.shutdown.child_token();
    rogue.meta = Some(cluster.meta_addr.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rogue_addr = listener.local_addr().unwrap().to_string();
    let _handle =
        mooncake_store_daemon::start(rogue, listener, None, &prometheus::Registry::new(), stop)
            .await
            .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = admin.cluster_stats().await.unwrap();
    assert!(
        st.daemons.iter().all(|d| d.addr != rogue_addr),
        "a client token registered a daemon"
    );
    assert_eq!(st.daemons.len(), 1);
    cluster.daemons.truncate(1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_dram_share_cannot_push_out_another_tenants_blocks() {
    let mut cfg = daemon_config(8 << 20);
    cfg.dram_quota.insert("noisy".into(), 0.25);
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let client = cluster.client();
    let block = vec![9u8; 256 << 10];
    // A quiet tenant stores 4 MiB first: the coldest blocks of the pool.
    let quiet: Vec<BlockHash> = (0..16u32)
        .map(|i| BlockHash::from_opaque(&i.to_le_bytes()))
        .collect();
    for h in &quiet {
        client.put(&ns("quiet"), &[(*h, &block)]).await.unwrap();
    }
    // The noisy tenant writes 8 MiB, four times its 2 MiB share.
    for i in 0..32u32 {
        let h = BlockHash::from_opaque(&(1000 + i).to_le_bytes());
        let out = client
            .put(&ns("noisy/model"), &[(h, &block)])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
    }
    let kept = client.exists(&ns("quiet"), &quiet).await.unwrap();
    assert!(
        kept.iter().all(|k| *k),
        "the quiet tenant lost blocks: {kept:?}"
    );
    let (_, used, limit) = cluster.daemons[0].handle.pool.tenant_usage()[0].clone();
    assert!(used <= limit, "noisy holds {used} of {limit}");
}

/// Connects from a given loopback address (127.0.0.0/8 is all local).
async fn connect_from(local: &str, daemon: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{local}:0").parse().unwrap()).unwrap();
    socket.connect(daemon.parse().unwrap()).await.unwrap()
}

/// Whether the daemon serves a ping on `stream` (a refused connection is
/// answered `busy` and closed). The stream stays open: the daemon may take
/// a connection in later than the client made it, and must still count
/// every one open then.
async fn serves(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ping = mooncake_proto::Header::request(Opcode::Ping, 1, 0).encode();
    if stream.write_all(&ping).await.is_err() {
        return false;
    }
    let mut answer = [0u8; mooncake_proto::HEADER_LEN];
    match tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut answer)).await {
        Ok(Ok(_)) => u16::from_le_bytes([answer[4], answer[5]]) == ErrorCode::Ok as u16,
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_address_cannot_take_every_connection() {
    let mut cfg = daemon_config(8 << 20);
    cfg.max_connections_per_client = 2;
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let daemon = cluster.daemon_addr(0);
    let mut a1 = connect_from("127.0.0.2", &daemon).await;
    let mut a2 = connect_from("127.0.0.2", &daemon).await;
    // Both served (so taken in by the daemon) before the third is made.
    assert!(
        serves(&mut a1).await && serves(&mut a2).await,
        "within the allowance"
    );
    let mut a3 = connect_from("127.0.0.2", &daemon).await;
    let mut b1 = connect_from("127.0.0.3", &daemon).await;
    assert!(
        !serves(&mut a3).await,
        "a third connection from one address is refused"
    );
    assert!(serves(&mut b1).await, "another client is not held back");
    drop((a1, a2));
}

/// With mutual TLS on, a QUIC connection belongs to the client its
/// certificate names, and only that client's token is accepted on it: a
/// token stolen from another holder is useless without its certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_a_token_works_only_with_its_holder_s_certificate() {
    token_bound_to_certificate(false).await
}

/// The same over TLS on the TCP ports (the servers calling each other over
/// TLS too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_on_tcp_a_token_works_only_with_its_holder_s_certificate() {
    token_bound_to_certificate(true).await
}

/// Mutual TLS over QUIC, or with `tls_on_tcp` over TLS on the TCP ports.
async fn token_bound_to_certificate(tls_on_tcp: bool) {
    use mooncake_net::DevCerts;
    let dir = std::env::temp_dir().join(format!(
        "mooncake-mtls-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    // The client certificate is issued to "acme-workers", the name of the
    // ACME token's entry.
    DevCerts::generate(&["127.0.0.1".into()], "acme-workers")
        .unwrap()
        .write(&dir)
        .unwrap();
    let tokens = token_file(&dir);
    let tls = DevCerts::server_tls(&dir, true);
    let mut meta = fast_meta();
    meta.auth = Some(tokens.clone());
    meta.token = Some(CLUSTER.into());
    meta.tls_cert = Some(tls.cert.clone());
    meta.tls_key = Some(tls.key.clone());
    meta.tls_client_ca = tls.client_ca.clone();
    let mut daemon = daemon_config(32 << 20);
    daemon.auth = Some(tokens);
    daemon.token = Some(CLUSTER.into());
    daemon.tls_cert = Some(tls.cert);
    daemon.tls_key = Some(tls.key);
    daemon.tls_client_ca = tls.client_ca;
    if tls_on_tcp {
        let ca = Some(dir.join("ca.pem"));
        (meta.tls, meta.peer_ca) = (true, ca.clone());
        (daemon.tls, daemon.peer_ca) = (true, ca);
    } else {
        meta.quic = true;
        daemon.quic_listen = Some("127.0.0.1:0".into());
    }
    let cluster = TestCluster::start_as(meta, vec![daemon], Some(ADMIN)).await;
    let client_tls = DevCerts::client_tls(&dir, true);
    let quic_client = |token: &str| {
        let cfg = ClientConfig::new(cluster.meta_addr.clone())
            .with_timeout(Duration::from_secs(5))
            .with_token(token);
        let cfg = if tls_on_tcp {
            cfg.with_tls(&client_tls)
        } else {
            cfg.with_quic(&client_tls)
        };
        Client::new(cfg.unwrap())
    };
    let value = vec![7u8; 50_000];

    // The certificate's holder, with its own token: served.
    let acme = quic_client(ACME);
    let ns = Namespace::new("acme/m").unwrap();
    let out = acme
        .put(&ns, &[(BlockHash([1; 32]), &value)])
        .await
        .unwrap();
    assert_eq!(out, vec![PutOutcome::Stored]);
    let mut buf = vec![0u8; value.len()];
    let got = acme
        .get_into(&ns, &[BlockHash([1; 32])], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(value.len())]);
    assert_eq!(buf, value);

    // Globex's token (valid over TCP) on connections whose certificate
    // says acme-workers: the meta service refuses it...
    let stolen = quic_client(GLOBEX);
    let ns = Namespace::new("globex/m").unwrap();
    let out = stolen.put(&ns, &[(BlockHash([2; 32]), &value)]).await;
    assert!(
        matches!(
            out,
            Err(ClientError::Server {
                code: ErrorCode::Unauthorized,
                ..
            })
        ),
        "a token used with another holder's certificate was accepted: {out:?}"
    );
    // ...and so does a daemon, asked straight.
    let (dialer, daemon_addr) = if tls_on_tcp {
        let tls = mooncake_net::TlsConnector::new(&client_tls).unwrap();
        (
            mooncake_net::Dialer::Tls(std::sync::Arc::new(tls)),
            cluster.daemon_addr(0),
        )
    } else {
        let quic = mooncake_net::quic::QuicConnector::new(&client_tls).unwrap();
        (
            mooncake_net::Dialer::Quic(std::sync::Arc::new(quic)),
            cluster.daemons[0].handle.endpoints[0].addr.clone(),
        )
    };
    for (token, refused) in [(GLOBEX, true), (ACME, false)] {
        let mut conn = dialer
            .open(&daemon_addr, ErrorSource::Daemon, Duration::from_secs(2))
            .await
            .unwrap();
        let got = conn.authenticate(token).await;
        if refused {
            assert!(
                matches!(
                    got,
                    Err(ClientError::Server {
                        code: ErrorCode::Unauthorized,
                        ..
                    })
                ),
                "{got:?}"
            );
        } else {
            got.unwrap();
        }
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_requires_no_token_cannot_join_a_cluster_that_does() {
    let (cluster, dir) = secured().await;
    // Asked directly, with a valid cluster token: refused.
    let mut conn = Connection::connect(
        &cluster.meta_addr,
        ErrorSource::Meta,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    conn.authenticate(CLUSTER).await.unwrap();
    let register = mooncake_proto::message::RegisterRequest {
        node: "open".into(),
        addr: "127.0.0.1:1".into(),
        capacity: 1 << 30,
        id_hint: 0,
        endpoints: vec![],
        requires_auth: false,
    };
    let refused = conn
        .call::<mooncake_proto::message::RegisterResponse>(Opcode::Register, &register, "register")
        .await;
    assert!(
        unauthorized(refused),
        "a registration that requires no token"
    );
    // A real daemon with the cluster's token but no token file of its own
    // keeps trying and never joins; the secured one stays the only one.
    let mut open = daemon_config(16 << 20);
    open.token = Some(CLUSTER.into());
    let open = cluster.launch_daemon(open).await;
    let admin = client(&cluster, Some(ADMIN));
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let st = admin.cluster_stats().await.unwrap();
        assert_eq!(st.daemons.len(), 1, "only the daemon that requires tokens");
    }
    open.stop.cancel();
    let _ = std::fs::remove_dir_all(dir);
}
