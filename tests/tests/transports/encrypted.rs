//! What only the encrypted transports have: a client without the right
//! certificate is refused when mutual TLS is on, a client that asks for
//! QUIC never falls back to plain TCP, servers reach each other over QUIC
//! only with a CA to check each other by, and a TLS port refuses plain
//! frames in one line and goes on serving.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_client_without_the_right_certificate() {
    let (cluster, client, dir) = setup(Kind::QuicMutual, 16 << 20).await;
    let value = block_bytes(1, 10_000);
    assert_eq!(
        client.put(&ns(), &[(hash(1), &value)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    // No client certificate.
    let anonymous = client_for(Kind::Quic, &cluster, dir.path(), Duration::from_secs(2));
    // A certificate from another CA (which trusts the daemon's CA, so that
    // only the client side is wrong).
    let other = Scratch::new();
    std::fs::copy(dir.path().join("ca.pem"), other.path().join("ca.pem")).unwrap();
    let stranger = client_for(
        Kind::QuicMutual,
        &cluster,
        other.path(),
        Duration::from_secs(2),
    );
    for (who, c) in [("no certificate", anonymous), ("another CA's", stranger)] {
        // The meta service refuses them first...
        let mut buf = vec![0u8; value.len()];
        let got = c.get_into(&ns(), &[hash(1)], &mut [&mut buf[..]]).await;
        assert!(
            matches!(got, Err(ClientError::Refused { .. })),
            "{who}: {got:?}"
        );
        assert!(buf.iter().all(|b| *b == 0), "{who}: bytes were delivered");
        let out = c.put(&ns(), &[(hash(2), &value)]).await;
        assert!(
            matches!(out, Err(ClientError::Refused { .. })),
            "{who}: {out:?}"
        );
        assert_eq!(c.transports().reads(TransportKind::Quic), 0);
        assert_eq!(
            c.transports().reads(TransportKind::Tcp),
            0,
            "{who}: no TCP fallback"
        );
    }
    // ...and the daemon too, asked straight.
    let daemon_quic = cluster.daemons[0].handle.endpoints[0].addr.clone();
    let tls = [
        ("no certificate", DevCerts::client_tls(dir.path(), false)),
        ("another CA's", DevCerts::client_tls(other.path(), true)),
    ];
    for (who, tls) in tls {
        let connector = mooncake_net::quic::QuicConnector::new(&tls).unwrap();
        let dialer = mooncake_net::Dialer::Quic(std::sync::Arc::new(connector));
        refuses(&dialer, &daemon_quic, who).await;
    }
}

/// A daemon at `addr`, asked straight through `dialer` (a ping), refuses
/// the connection.
async fn refuses(dialer: &mooncake_net::Dialer, addr: &str, who: &str) {
    let answer = async {
        let mut conn = dialer
            .open(addr, ErrorSource::Daemon, Duration::from_secs(2))
            .await?;
        conn.call::<Empty>(Opcode::Ping, &Empty, "ping").await
    };
    let got = answer.await;
    assert!(
        matches!(got, Err(ClientError::Refused { .. })),
        "{who}: {got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_client_refuses_a_daemon_without_quic_rather_than_use_tcp() {
    // The meta service serves QUIC; the daemon only TCP.
    let dir = Scratch::new();
    let cluster = TestCluster::start_with(
        meta_for(Kind::Quic, dir.path()),
        vec![daemon_config(16 << 20)],
    )
    .await;
    let client = client_for(Kind::Quic, &cluster, dir.path(), Duration::from_secs(2));
    let out = client
        .put(&ns(), &[(hash(3), &[1u8; 1000][..])])
        .await
        .unwrap();
    assert!(matches!(out[0], PutOutcome::Failed(_)), "{out:?}");
    assert_eq!(client.transports().writes(TransportKind::Tcp), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_prefers_rdma_counts_its_fallback_to_tcp() {
    let (cluster, _, dir) = setup(Kind::Tcp, 16 << 20).await;
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone());
    cfg.rdma = true;
    let client = Client::new(cfg);
    let value = block_bytes(4, 5000);
    let out = client.put(&ns(), &[(hash(4), &value)]).await.unwrap();
    assert_eq!(out, vec![PutOutcome::Stored]);
    let t = client.transports();
    assert_eq!(t.fallbacks(TransportKind::Rdma, TransportKind::Tcp), 1);
    assert_eq!(t.writes(TransportKind::Tcp), 1);
    drop(dir);
}

/// A daemon set up like `setup`'s mutual-TLS one, reaching the meta
/// service over QUIC when `peer_ca` names a CA.
fn quic_daemon(dir: &Path, peer_ca: Option<PathBuf>) -> mooncake_store_daemon::DaemonConfig {
    let tls = DevCerts::server_tls(dir, true);
    let mut cfg = daemon_config(16 << 20);
    cfg.quic_listen = Some("127.0.0.1:0".into());
    cfg.tls_cert = Some(tls.cert);
    cfg.tls_key = Some(tls.key);
    cfg.tls_client_ca = tls.client_ca;
    cfg.peer_ca = peer_ca;
    cfg
}

/// With `peer_ca` on both, the servers talk to each other over QUIC with
/// mutual TLS: a daemon registers (and reports) over QUIC, and the meta
/// service's calls to it (a removal) arrive over QUIC. A daemon that
/// trusts another CA never joins, and a meta service that trusts another
/// CA cannot call a daemon: nothing goes over TCP instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_reach_each_other_over_quic_only_with_peer_ca() {
    let dir = Scratch::new();
    let other = Scratch::new();
    let ca = dir.path().join("ca.pem");
    let mut meta = meta_for(Kind::QuicMutual, dir.path());
    meta.peer_ca = Some(ca.clone());
    let mut cluster = TestCluster::start_with(meta, Vec::new()).await;
    cluster
        .add_daemon(quic_daemon(dir.path(), Some(ca.clone())))
        .await;
    let client = cluster.client();
    let value = block_bytes(7, 10_000);
    assert_eq!(
        client.put(&ns(), &[(hash(7), &value)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    let key = mooncake_proto::BlockKey::new(ns(), hash(7));
    let pool = cluster.daemons[0].handle.pool.clone();
    assert!(pool.contains(&key));
    assert_eq!(
        client.remove(&ns(), &[hash(7)]).await.unwrap(),
        vec![mooncake_proto::ErrorCode::Ok]
    );
    assert!(
        !pool.contains(&key),
        "the meta service's call reached the daemon"
    );

    // A daemon trusting another CA cannot verify the meta service.
    let stranger = cluster
        .launch_daemon(quic_daemon(dir.path(), Some(other.path().join("ca.pem"))))
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let listed = client.cluster_stats().await.unwrap().daemons;
    assert!(
        listed
            .iter()
            .all(|d| d.addr != stranger.handle.addr.to_string()),
        "a daemon that cannot verify the meta service joined: {listed:?}"
    );
    stranger.stop.cancel();

    // A meta service trusting another CA cannot call its daemon (which
    // registered over TCP): the key leaves the index, the caller hears
    // that the daemon did not confirm, and the bytes stay on the daemon,
    // not removed over TCP instead.
    let mut meta = meta_for(Kind::QuicMutual, dir.path());
    meta.peer_ca = Some(other.path().join("ca.pem"));
    let mut wary = TestCluster::start_with(meta, Vec::new()).await;
    wary.add_daemon(quic_daemon(dir.path(), None)).await;
    let client = wary.client();
    assert_eq!(
        client.put(&ns(), &[(hash(8), &value)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    let codes = client.remove(&ns(), &[hash(8)]).await.unwrap();
    assert!(
        !matches!(
            codes[..],
            [mooncake_proto::ErrorCode::Ok | mooncake_proto::ErrorCode::NotFound]
        ),
        "not confirmed: {codes:?}"
    );
    let key = mooncake_proto::BlockKey::new(ns(), hash(8));
    assert_eq!(client.get(&key).await.unwrap(), None, "out of the index");
    assert!(wary.daemons[0].handle.pool.contains(&key));
}

/// A TLS port refuses, in one line, whoever cannot talk to it: a client
/// without a certificate or with another CA's (mutual TLS), one that
/// trusts another CA (it cannot verify the server), and one that sends
/// plain frames; it goes on serving the right client; and the meta
/// service's calls to its daemon (a removal) go over TLS too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_port_refuses_wrong_certificates_and_plain_frames_and_keeps_serving() {
    let (cluster, client, dir) = setup(Kind::TlsMutual, 16 << 20).await;
    let value = block_bytes(11, 10_000);
    assert_eq!(
        client.put(&ns(), &[(hash(11), &value)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    // Another CA's client certificate, trusting the cluster's CA.
    let other = Scratch::new();
    std::fs::copy(dir.path().join("ca.pem"), other.path().join("ca.pem")).unwrap();
    // Another CA altogether.
    let stranger = Scratch::new();
    let ways = [
        (
            "no certificate",
            Some(DevCerts::client_tls(dir.path(), false)),
        ),
        (
            "another CA's",
            Some(DevCerts::client_tls(other.path(), true)),
        ),
        (
            "trusting another CA",
            Some(DevCerts::client_tls(stranger.path(), true)),
        ),
        ("plain TCP", None),
    ];
    for (who, tls) in &ways {
        let mut cfg =
            ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(2));
        if let Some(tls) = tls {
            cfg = cfg.with_tls(tls).unwrap();
        }
        let c = Client::new(cfg);
        let mut buf = vec![0u8; value.len()];
        let got = c.get_into(&ns(), &[hash(11)], &mut [&mut buf[..]]).await;
        let Err(err @ ClientError::Refused { .. }) = got else {
            panic!("{who}: {got:?}");
        };
        assert!(!err.to_string().contains('\n'), "{who}: {err}");
        if tls.is_none() {
            assert!(err.to_string().contains("speaks TLS only"), "{who}: {err}");
        }
        assert!(buf.iter().all(|b| *b == 0), "{who}: bytes were delivered");
        let out = c.put(&ns(), &[(hash(12), &value)]).await;
        assert!(
            matches!(out, Err(ClientError::Refused { .. })),
            "{who}: {out:?}"
        );
    }
    // The daemon too, asked straight.
    let daemon = cluster.daemon_addr(0);
    for (who, tls) in &ways {
        let dialer = match tls {
            Some(tls) => mooncake_net::Dialer::Tls(std::sync::Arc::new(
                mooncake_net::TlsConnector::new(tls).unwrap(),
            )),
            None => mooncake_net::Dialer::Tcp,
        };
        refuses(&dialer, &daemon, who).await;
    }
    // Still serving, and the meta service reaches the daemon over TLS.
    let key = mooncake_proto::BlockKey::new(ns(), hash(11));
    assert_eq!(client.get(&key).await.unwrap(), Some(value));
    let pool = cluster.daemons[0].handle.pool.clone();
    assert_eq!(
        client.remove(&ns(), &[hash(11)]).await.unwrap(),
        vec![mooncake_proto::ErrorCode::Ok]
    );
    assert!(
        !pool.contains(&key),
        "the meta service's call reached the daemon"
    );
}
