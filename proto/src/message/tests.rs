//! Round trips and refusals of the bodies.

use super::*;

fn ns() -> Namespace {
    Namespace::new("t/m").unwrap()
}

fn round_trip<T: Body + PartialEq + std::fmt::Debug>(v: T) {
    let bytes = v.to_bytes();
    assert_eq!(T::from_bytes(&bytes).unwrap(), v);
    // Every strict prefix is refused, never misparsed.
    for n in 0..bytes.len() {
        assert!(T::from_bytes(&bytes[..n]).is_err(), "prefix {n} accepted");
    }
}

#[test]
fn every_body_round_trips_and_refuses_truncation() {
    let h = BlockHash([3; 32]);
    round_trip(KeyRequest {
        key: BlockKey::new(ns(), h),
    });
    round_trip(PutHead {
        key: BlockKey::new(ns(), h),
        checksum: 9,
        parent: Some(BlockHash([4; 32])),
        continues: true,
        tag: None,
    });
    round_trip(PutHead {
        key: BlockKey::new(ns(), h),
        checksum: 9,
        parent: Some(BlockHash([4; 32])),
        continues: false,
        tag: Some(Arc::new(
            EngineTag::new(Some(EngineHash::Bytes(b"k".to_vec().into())), vec![3, 4]).unwrap(),
        )),
    });
    round_trip(PutHead {
        key: BlockKey::new(ns(), h),
        checksum: 9,
        parent: None,
        continues: true,
        tag: Some(Arc::new(
            EngineTag::new(None, vec![])
                .unwrap()
                .with_key("model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab")
                .unwrap(),
        )),
    });
    round_trip(PutHead {
        key: BlockKey::new(ns(), h),
        checksum: 9,
        parent: None,
        continues: false,
        tag: None,
    });
    round_trip(KeysRequest {
        namespace: ns(),
        hashes: vec![h, h],
    });
    for (tag, checksum) in [
        (None, Some(5)),
        (
            Some(Arc::new(EngineTag::new(None, vec![9; 16]).unwrap())),
            None,
        ),
    ] {
        round_trip(ShmPutRequest {
            key: BlockKey::new(ns(), h),
            len: 4096,
            checksum,
            parent: Some(h),
            continues: true,
            tag,
        });
    }
    for checksum in [None, Some(0), Some(u64::MAX)] {
        round_trip(ShmCommitRequest { slot: 9, checksum });
    }
    round_trip(ShmRoomRequest {
        len: 256 << 10,
        count: 8,
    });
    for rooms in [
        vec![],
        vec![
            ShmSlot {
                slot: 3,
                offset: 1 << 20
            };
            2
        ],
    ] {
        round_trip(ShmRooms {
            len: 256 << 10,
            rooms,
        });
    }
    round_trip(ShmStoreRequest {
        room: 3,
        key: BlockKey::new(ns(), h),
        len: 4096,
        checksum: 77,
        parent: Some(h),
        continues: true,
        tag: Some(Arc::new(EngineTag::new(None, vec![9; 16]).unwrap())),
    });
    round_trip(RouteRequest {
        keys: KeysRequest {
            namespace: ns(),
            hashes: vec![h, h],
        },
        candidates: vec![RouteCandidate {
            node: "gpu-1".into(),
            queue: 7,
        }],
        every_host: true,
        transfer_permille: 100,
    });
    for best in [None, Some(0)] {
        round_trip(RouteAnswer {
            blocks: 4,
            matched: 3,
            hosts: vec![RouteHost {
                node: "gpu-1".into(),
                instance: "prefill-0".into(),
                daemons: 1,
                leading: 2,
                held: 3,
                leading_nvme: 1,
                held_nvme: 2,
                reads_per_sec: 10,
                used: 5,
                capacity: 9,
                queue: 1,
                cost_milli: 2100,
            }],
            best,
        });
    }
    round_trip(PinRequest {
        keys: KeysRequest {
            namespace: ns(),
            hashes: vec![h],
        },
        pin: true,
    });
    round_trip(Locations {
        items: vec![
            None,
            Some(Location {
                daemons: [1, 5, 9].into_iter().collect(),
                size: 2,
                checksum: 3,
            }),
        ],
        daemons: vec![DaemonAddr {
            id: 1,
            node: "gpu-1".into(),
            addr: "127.0.0.1:1".into(),
            endpoints: vec![Endpoint {
                kind: crate::transport::TransportKind::Quic,
                addr: "127.0.0.1:2".into(),
            }],
        }],
    });
    round_trip(PutStartRequest {
        namespace: ns(),
        node: "gpu-1".into(),
        replicas: 3,
        items: vec![
            ToPlace::unchained(h, 10),
            ToPlace {
                hash: BlockHash([5; 32]),
                size: 11,
                parent: Some(h),
            },
        ],
    });
    round_trip(PutStartResponse {
        slots: vec![
            Slot::Place {
                copies: [4, 2].into_iter().collect(),
                continues: true,
            },
            Slot::Place {
                copies: [1].into_iter().collect(),
                continues: false,
            },
            Slot::Skip(ErrorCode::AlreadyExists),
        ],
        daemons: vec![],
    });
    round_trip(PutCommitRequest {
        namespace: ns(),
        items: vec![
            CommitItem {
                hash: h,
                stored_on: [1, 3].into_iter().collect(),
                size: 5,
                checksum: 6,
                parent: None,
                tag: None,
            },
            CommitItem {
                hash: BlockHash([5; 32]),
                stored_on: [2].into_iter().collect(),
                size: 7,
                checksum: 8,
                parent: Some(h),
                tag: Some(Arc::new(
                    EngineTag::new(Some(EngineHash::Int(u64::MAX)), vec![1, 2, 70_000]).unwrap(),
                )),
            },
            CommitItem {
                hash: BlockHash([6; 32]),
                stored_on: [2].into_iter().collect(),
                size: 7,
                checksum: 8,
                parent: None,
                tag: Some(Arc::new(
                    EngineTag::new(Some(EngineHash::Bytes(vec![7; 64].into())), vec![]).unwrap(),
                )),
            },
            CommitItem {
                hash: BlockHash([7; 32]),
                stored_on: [2].into_iter().collect(),
                size: 7,
                checksum: 8,
                parent: None,
                tag: Some(Arc::new(
                    EngineTag::new(None, vec![5; MAX_TAG_TOKENS]).unwrap(),
                )),
            },
        ],
    });
    round_trip(FetchRequest {
        key: BlockKey::new(ns(), h),
        from: "127.0.0.1:7071".into(),
        size: 4096,
        checksum: 7,
    });
    round_trip(Statuses {
        codes: vec![ErrorCode::Ok, ErrorCode::NotFound],
    });
    round_trip(ClusterStats {
        leader: "l".into(),
        revision: 9,
        standbys: vec!["s".into()],
        blocks: 1,
        copies: 5,
        bytes: 2,
        pending: 3,
        repairing: 8,
        daemons: vec![DaemonInfo {
            id: 1,
            node: "n".into(),
            addr: "a".into(),
            alive: true,
            draining: false,
            capacity: 4,
            used: 5,
            blocks: 6,
            hits: 7,
            misses: 8,
            endpoints: vec![],
        }],
        errors: vec![ErrorCount {
            op: "put_commit".into(),
            code: "no_reservation".into(),
            count: 3,
        }],
    });
    round_trip(EvictRequest { bytes: 9 });
    round_trip(EvictResponse {
        bytes: 9,
        blocks: 1,
    });
    round_trip(DrainRequest {
        daemon: 2,
        drain: true,
    });
    round_trip(LeaveRequest {
        daemon: 3,
        addr: "10.0.0.3:7071".into(),
    });
    round_trip(ListRequest {
        namespace: Some(ns()),
        after: Some(BlockKey::new(ns(), h)),
        prefix: vec![3, 3],
        daemon: 1,
        limit: 7,
    });
    round_trip(ListResponse {
        entries: vec![ListEntry {
            key: BlockKey::new(ns(), h),
            location: Location::on(1, 2, 3),
        }],
        more: true,
    });
    round_trip(RegisterRequest {
        node: "n".into(),
        addr: "a".into(),
        capacity: 1,
        id_hint: 3,
        endpoints: vec![],
        requires_auth: true,
    });
    round_trip(RegisterResponse {
        daemon: 3,
        revision: 77,
        keep_tags: KeepTags::WithKeys,
    });
    assert!(
        RegisterResponse::from_bytes(&[3, 0, 0, 0, 77, 0, 0, 0, 0, 0, 0, 0, 9]).is_err(),
        "an unknown keep_tags"
    );
    round_trip(InventoryRequest {
        daemon: 3,
        items: vec![InventoryItem {
            key: BlockKey::new(ns(), h),
            size: 5,
            checksum: 6,
            tier: Tier::Nvme,
            parent: Some(BlockHash([9; 32])),
            tag: Some(Arc::new(
                EngineTag::new(Some(EngineHash::Int(5)), vec![1]).unwrap(),
            )),
        }],
    });
    round_trip(HeartbeatResponse {
        missed: vec![BlockKey::new(ns(), h)],
    });
    round_trip(HeartbeatRequest {
        daemon: 1,
        stats: PoolStats::default(),
        hot: vec![(BlockKey::new(ns(), h), 400)],
    });
    round_trip(EventsRequest {
        daemon: 2,
        removed: vec![BlockKey::new(ns(), h)],
        moved: vec![
            (BlockKey::new(ns(), h), Tier::Nvme),
            (BlockKey::new(ns(), h), Tier::Dram),
        ],
    });
}

#[test]
fn put_head_refuses_long_namespace_length() {
    assert!(PutHead::rest_len(129).is_err());
    assert_eq!(
        2 + PutHead::rest_len(128).unwrap() + MAX_TAG_LEN,
        PutHead::MAX_LEN
    );
    assert_eq!(PutHead::rest_len(3).unwrap(), 3 + 32 + 8 + 32 + 1 + 4);
    assert!(PutHead::tag_len((MAX_TAG_LEN as u32 + 1).to_le_bytes()).is_err());
    // The longest head a writer can make fits.
    let tag = EngineTag::new(
        Some(EngineHash::Bytes(vec![1; MAX_ENGINE_HASH_LEN].into())),
        vec![2; MAX_TAG_TOKENS],
    )
    .unwrap()
    .with_key(&"k".repeat(MAX_OBJECT_KEY_LEN))
    .unwrap();
    let head = PutHead {
        key: BlockKey::new(Namespace::new("n".repeat(128)).unwrap(), BlockHash([1; 32])),
        checksum: 1,
        parent: None,
        continues: true,
        tag: Some(Arc::new(tag)),
    };
    assert_eq!(head.to_bytes().len(), PutHead::MAX_LEN);
}

#[test]
fn bad_namespace_on_the_wire_is_refused() {
    let mut w = Writer::new();
    w.str("bad space");
    w.hash(&BlockHash([0; 32]));
    assert!(KeyRequest::from_bytes(&w.buf).is_err());
}

#[test]
fn an_engine_tag_past_its_limits_is_refused_on_both_ends() {
    assert!(EngineTag::new(
        Some(EngineHash::Bytes(vec![1; MAX_ENGINE_HASH_LEN + 1].into())),
        vec![]
    )
    .is_err());
    assert!(EngineTag::new(Some(EngineHash::Bytes(Vec::new().into())), vec![]).is_err());
    assert!(EngineTag::new(None, vec![0; MAX_TAG_TOKENS + 1]).is_err());
    let no_key = EngineTag::new(None, vec![]).unwrap();
    assert!(no_key
        .clone()
        .with_key(&"k".repeat(MAX_OBJECT_KEY_LEN + 1))
        .is_err());
    assert_eq!(
        no_key.with_key("").unwrap().key,
        None,
        "an empty key is none"
    );
    // Forged on the wire: a commit whose tag claims too many tokens, a
    // hash of 65 bytes, or an unknown kind.
    let item = |tag: &[u8]| {
        let mut w = Writer::new();
        w.namespace(&ns());
        w.count(1);
        w.hash(&BlockHash([1; 32]));
        Copies::one(1).encode(&mut w);
        w.u32(5);
        w.u64(6);
        encode_parent(&mut w, &None);
        w.buf.extend_from_slice(tag);
        PutCommitRequest::from_bytes(&w.buf)
    };
    let mut too_many = vec![1u8];
    too_many.extend_from_slice(&((MAX_TAG_TOKENS as u32 + 1).to_le_bytes()));
    too_many.extend(std::iter::repeat_n(0, 4 * (MAX_TAG_TOKENS + 1)));
    assert!(matches!(item(&too_many), Err(ProtoError::TooLarge { .. })));
    let mut long_hash = vec![3u8, 65];
    long_hash.extend_from_slice(&[9; 65]);
    long_hash.extend_from_slice(&0u32.to_le_bytes());
    assert!(item(&long_hash).is_err());
    // An object key past its limit, or not UTF-8.
    let with_key = |len: u16, bytes: &[u8]| {
        let mut tag = vec![1u8];
        tag.extend_from_slice(&0u32.to_le_bytes());
        tag.extend_from_slice(&len.to_le_bytes());
        tag.extend_from_slice(bytes);
        tag
    };
    let long = vec![b'k'; MAX_OBJECT_KEY_LEN + 1];
    assert!(matches!(
        item(&with_key(long.len() as u16, &long)),
        Err(ProtoError::TooLarge { .. })
    ));
    assert!(item(&with_key(2, &[0xff, 0xfe])).is_err());
    assert!(item(&with_key(2, b"ok")).is_ok());
    assert!(matches!(
        item(&[9]),
        Err(ProtoError::Invalid {
            field: "engine tag",
            ..
        })
    ));
}

#[test]
fn a_tag_read_back_from_its_bytes_is_the_same_tag_and_trailing_bytes_are_refused() {
    let tags = [
        None,
        Some(Arc::new(
            EngineTag::new(Some(EngineHash::Int(7)), vec![1, 2, 3]).unwrap(),
        )),
        Some(Arc::new(
            EngineTag::new(Some(EngineHash::Bytes(vec![4; 32].into())), vec![])
                .unwrap()
                .with_key("model@tp_rank:0@pcp0@dcp0@pp_rank:0@abcd")
                .unwrap(),
        )),
    ];
    for tag in tags {
        let bytes = EngineTag::to_wire(&tag);
        assert_eq!(EngineTag::from_wire(&bytes).unwrap(), tag);
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(EngineTag::from_wire(&longer).is_err());
        assert!(EngineTag::from_wire(&bytes[..bytes.len() - 1]).is_err());
    }
}
