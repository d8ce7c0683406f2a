//! The servers' connection state machine, fed a sequence of frames: a real
//! daemon and meta service that require tokens, in this process on
//! loopback, get each input as one connection's bytes: frame headers that
//! parse (known and unknown opcodes, any flags and lengths, bodies cut
//! short or fuzzed), optionally after a valid `Auth`. A panic anywhere,
//! a connection task included, aborts (a crash to libFuzzer), and after
//! every input both servers must still answer a new connection's `Ping`.
#![no_main]

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_proto::auth::{token_digest, AuthRequest};
use mooncake_proto::message::Body;
use mooncake_proto::{Header, Opcode, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLUSTER: &str = "fuzz-cluster-token";
const ADMIN: &str = "fuzz-admin-token";

type Servers = common::Served;

fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let tokens = common::scratch("connection").join("tokens.toml");
        let entry = |name: &str, token: &str, role: &str| {
            format!(
                "[[tokens]]\nname = \"{name}\"\nsha256 = \"{}\"\nrole = \"{role}\"\n",
                token_digest(token)
            )
        };
        std::fs::write(&tokens, entry("storage", CLUSTER, "cluster") + &entry("ops", ADMIN, "admin"))
            .unwrap();
        let meta_cfg = mooncake_meta::MetaConfig {
            auth: Some(tokens.clone()),
            token: Some(CLUSTER.into()),
            admin: String::new(),
            request_timeout: mooncake_proto::units::HumanDuration(Duration::from_millis(500)),
            auth_timeout: mooncake_proto::units::HumanDuration(Duration::from_millis(500)),
            ..mooncake_meta::MetaConfig::default()
        };
        let daemon_cfg = mooncake_store_daemon::DaemonConfig {
            auth: Some(tokens.clone()),
            token: Some(CLUSTER.into()),
            admin: String::new(),
            dram: mooncake_proto::units::ByteSize(16 << 20),
            hugepages: false,
            prefault: false,
            request_timeout: mooncake_proto::units::HumanDuration(Duration::from_millis(500)),
            auth_timeout: mooncake_proto::units::HumanDuration(Duration::from_millis(500)),
            put_stall_timeout: mooncake_proto::units::HumanDuration(Duration::from_millis(200)),
            ..mooncake_store_daemon::DaemonConfig::default()
        };
        common::serve(meta_cfg, daemon_cfg)
    })
}

/// One connection's bytes from the fuzzer's: a valid `Auth` first if the
/// first byte says so, then frames whose headers parse, each made of an
/// opcode (any byte: unknown ones too), a flags byte, a body length (what
/// follows, or more than follows: a frame cut short) and the body.
fn frames(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let Some((&mode, mut rest)) = data.split_first() else {
        return out;
    };
    if mode & 1 == 1 {
        let token = if mode & 2 == 2 { ADMIN } else { CLUSTER };
        let body = AuthRequest { token: token.into() }.to_bytes();
        out.extend_from_slice(&Header::request(Opcode::Auth, 1, body.len() as u32).encode());
        out.extend_from_slice(&body);
    }
    let mut id = 2;
    while rest.len() >= 3 {
        let (op, flags, len) = (rest[0], rest[1], rest[2] as usize * 4);
        rest = &rest[3..];
        let take = len.min(rest.len());
        let opcode = Opcode::from_u8(op).unwrap_or(Opcode::Ping);
        let mut header = Header::request(opcode, id, len as u32).encode();
        header[3] = op;
        if flags & 0x80 != 0 {
            // Now and then any flags (a response sent to a server, unknown bits).
            header[6] = flags & 0x7f;
        }
        out.extend_from_slice(&header);
        out.extend_from_slice(&rest[..take]);
        rest = &rest[take..];
        id += 1;
    }
    out
}

async fn exchange(addr: SocketAddr, bytes: &[u8]) {
    let Ok(mut conn) = TcpStream::connect(addr).await else {
        return;
    };
    let (mut rd, mut wr) = conn.split();
    let write = async {
        let _ = wr.write_all(bytes).await;
        let _ = wr.shutdown().await;
    };
    let read = async {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), rd.read(&mut buf)).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::join!(write, read);
}

async fn answers_ping(addr: SocketAddr) -> bool {
    let Ok(mut conn) = TcpStream::connect(addr).await else {
        return false;
    };
    let body = AuthRequest { token: CLUSTER.into() }.to_bytes();
    let mut req = Header::request(Opcode::Auth, 1, body.len() as u32).encode().to_vec();
    req.extend_from_slice(&body);
    req.extend_from_slice(&Header::request(Opcode::Ping, 2, 0).encode());
    if conn.write_all(&req).await.is_err() {
        return false;
    }
    let mut raw = [0u8; HEADER_LEN];
    for _ in 0..2 {
        let read = tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut raw)).await;
        let Ok(Ok(_)) = read else { return false };
        let Ok(Some(h)) = Header::parse(&raw) else { return false };
        let mut body = vec![0u8; h.body_len as usize];
        if conn.read_exact(&mut body).await.is_err() || h.status != 0 {
            return false;
        }
    }
    true
}

fuzz_target!(|data: &[u8]| {
    let s = servers();
    let bytes = frames(data);
    s.rt.block_on(async {
        for addr in [s.daemon, s.meta] {
            exchange(addr, &bytes).await;
            assert!(
                answers_ping(addr).await,
                "{addr} stopped serving (connections open: daemon {:?}, meta {:?})",
                common::metric(&s.registry, "mooncake_daemon_connections"),
                common::metric(&s.registry, "mooncake_meta_connections"),
            );
        }
    });
});
