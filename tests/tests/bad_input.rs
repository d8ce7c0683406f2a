//! Malformed frames are refused, nothing is allocated for them, and the
//! servers go on serving everyone else.

use std::time::Duration;

use mooncake_client::PutOutcome;
use mooncake_proto::codec::Writer;
use mooncake_proto::{BlockHash, ErrorCode, Header, Namespace, Opcode, HEADER_LEN};
use mooncake_tests::TestCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The fields of an error answer. Its opcode byte echoes the request's,
/// which may be no known opcode, so it is read raw rather than parsed.
#[derive(Debug)]
struct Answer {
    status: u16,
    request_id: u64,
}

/// Sends raw bytes, then returns the server's answer (if any) and whether
/// it closed the connection afterwards.
async fn exchange(addr: &str, bytes: &[u8], close_write: bool) -> (Option<Answer>, bool) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    if close_write {
        let _ = s.shutdown().await;
    }
    let mut raw = [0u8; HEADER_LEN];
    let header = match tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut raw)).await {
        Ok(Ok(_)) => {
            assert_eq!(&raw[..2], b"MK", "answers carry the protocol magic");
            assert_eq!(raw[6] & 1, 1, "answers carry the response flag");
            Some(Answer {
                status: u16::from_le_bytes([raw[4], raw[5]]),
                request_id: u64::from_le_bytes(raw[8..16].try_into().unwrap()),
            })
        }
        _ => None,
    };
    let mut rest = [0u8; 64];
    let closed = matches!(
        tokio::time::timeout(Duration::from_secs(3), s.read(&mut rest)).await,
        Ok(Ok(0)) | Ok(Err(_))
    );
    (header, closed)
}

fn frame(op: Opcode, body: &[u8]) -> Vec<u8> {
    let mut out = Header::request(op, 1, body.len() as u32).encode().to_vec();
    out.extend_from_slice(body);
    out
}

async fn still_serves(cluster: &TestCluster) {
    let client = cluster.client();
    let ns = Namespace::new("t/alive").unwrap();
    let h = BlockHash::from_opaque(&rand::random::<u64>().to_le_bytes());
    assert_eq!(
        client.put(&ns, &[(h, b"still here")]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    let key = mooncake_proto::BlockKey::new(ns, h);
    assert_eq!(client.get(&key).await.unwrap().unwrap(), b"still here");
}

#[tokio::test]
async fn daemon_refuses_bad_frames_and_keeps_serving() {
    let cluster = TestCluster::start(16 << 20).await;
    let daemon = cluster.daemon_addr(0);
    let pool = cluster.daemons[0].handle.pool.clone();

    // A length field of 4 GiB: refused before any allocation.
    let mut huge = Header::request(Opcode::Put, 1, 0).encode();
    huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    let (h, closed) = exchange(&daemon, &huge, false).await;
    assert_eq!(h.unwrap().status, ErrorCode::TooLarge as u16);
    assert!(closed);

    // An unknown opcode.
    let mut unknown = Header::request(Opcode::Ping, 7, 0).encode();
    unknown[3] = 0xee;
    let (h, closed) = exchange(&daemon, &unknown, false).await;
    let h = h.expect("an error answer");
    assert_eq!(h.status, ErrorCode::UnknownOpcode as u16);
    assert_eq!(h.request_id, 7);
    assert!(closed);

    // Random garbage.
    let garbage: Vec<u8> = (0..1024).map(|_| rand::random::<u8>()).collect();
    let (h, closed) = exchange(&daemon, &garbage, false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);
    assert!(closed);

    // A truncated frame: the header promises more than ever arrives.
    let mut truncated = Header::request(Opcode::Get, 1, 100).encode().to_vec();
    truncated.extend_from_slice(&[0u8; 10]);
    let (h, closed) = exchange(&daemon, &truncated, true).await;
    assert!(h.is_none());
    assert!(closed);

    // A key whose hash is 10 bytes instead of 32.
    let mut w = Writer::new();
    w.str("ns");
    w.buf.extend_from_slice(&[1u8; 10]);
    let (h, closed) = exchange(&daemon, &frame(Opcode::Get, &w.buf), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);
    assert!(closed);

    // A put whose namespace claims 300 bytes.
    let mut put = Header::request(Opcode::Put, 1, 1000).encode().to_vec();
    put.extend_from_slice(&300u16.to_le_bytes());
    let (h, closed) = exchange(&daemon, &put, false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);
    assert!(closed);

    // A put head of namespace `ns` (no parent) whose tag claims `tag_len`
    // bytes, in a frame announcing `value` bytes after it.
    let put_frame = |ns: &str, tag_len: u32, value: usize| {
        let mut w = Writer::new();
        w.str(ns);
        w.hash(&BlockHash([1; 32]));
        w.u64(0);
        w.hash(&BlockHash([0; 32])); // no parent
        w.u8(0); // continues
        w.u32(tag_len);
        let mut frame = Header::request(Opcode::Put, 1, (w.buf.len() + value) as u32)
            .encode()
            .to_vec();
        frame.extend_from_slice(&w.buf);
        frame
    };
    // A value larger than the whole pool (no engine tag), and a head whose
    // engine tag claims more bytes than any tag has.
    for frame in [
        put_frame("t/big", 0, 32 << 20),
        put_frame(
            "t/tag",
            mooncake_proto::message::MAX_TAG_LEN as u32 + 1,
            1 << 20,
        ),
    ] {
        let (h, closed) = exchange(&daemon, &frame, false).await;
        assert_eq!(h.unwrap().status, ErrorCode::TooLarge as u16);
        assert!(closed);
    }

    // A meta-service opcode sent to a daemon.
    let (h, closed) = exchange(&daemon, &frame(Opcode::ClusterStat, &[]), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::UnknownOpcode as u16);
    assert!(closed);

    assert_eq!(pool.stats().used, 0, "nothing was allocated for bad frames");
    still_serves(&cluster).await;
}

#[tokio::test]
async fn meta_refuses_bad_frames_and_keeps_serving() {
    let cluster = TestCluster::start(16 << 20).await;
    let meta = cluster.meta_addr.clone();

    let garbage: Vec<u8> = (0..512).map(|i| (i * 7) as u8).collect();
    let (h, closed) = exchange(&meta, &garbage, false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);
    assert!(closed);

    // A batch count of 4000 with no keys behind it.
    let mut w = Writer::new();
    w.str("ns");
    w.u32(4000);
    let (h, closed) = exchange(&meta, &frame(Opcode::Lookup, &w.buf), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);
    assert!(closed);

    // A batch over the protocol's limit.
    let mut w = Writer::new();
    w.str("ns");
    w.u32(1_000_000);
    let (h, closed) = exchange(&meta, &frame(Opcode::MatchPrefix, &w.buf), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::TooLarge as u16);
    assert!(closed);

    // A namespace with a forbidden character.
    let mut w = Writer::new();
    w.str("bad ns");
    w.u32(0);
    let (h, _) = exchange(&meta, &frame(Opcode::Lookup, &w.buf), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::Malformed as u16);

    // Block data is never accepted by the meta service.
    let (h, closed) = exchange(&meta, &frame(Opcode::Get, &[]), false).await;
    assert_eq!(h.unwrap().status, ErrorCode::UnknownOpcode as u16);
    assert!(closed);

    still_serves(&cluster).await;
}

#[tokio::test]
async fn an_oversized_block_is_refused_by_the_client_path_too() {
    let cluster = TestCluster::start(8 << 20).await;
    let client = cluster.client();
    let ns = Namespace::new("t/too-big").unwrap();
    let big = vec![0u8; 9 << 20];
    let out = client
        .put(&ns, &[(BlockHash([9; 32]), &big)])
        .await
        .unwrap();
    assert_eq!(out, vec![PutOutcome::Failed(ErrorCode::TooLarge)]);
    still_serves(&cluster).await;
}
