use std::sync::Arc;

use mooncake_proto::message::EngineTag;
use rmpv::Value;

use super::*;

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

fn ctx() -> Context {
    Context {
        backend_id: "pool-a".into(),
        model_name: "fallback-model".into(),
        block_size: 0,
        lora_name: String::new(),
        additional_salt: "salt".into(),
        dp_rank: 2,
    }
}

fn decode(payload: &[u8]) -> (i64, Vec<Value>, u64) {
    let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let items = batch.as_array().unwrap();
    assert_eq!(items.len(), 3, "[timestamp_ms, events, dp_rank]");
    (
        items[0].as_i64().unwrap(),
        items[1].as_array().unwrap().clone(),
        items[2].as_u64().unwrap(),
    )
}

const HASH: &str = "00112233445566778899aabbccddeeff0011223344556677deadbeefcafef00d";

fn keyed(key: &str, tokens: Vec<u32>) -> Named {
    Named {
        tag: Some(Arc::new(
            EngineTag::new(None, tokens).unwrap().with_key(key).unwrap(),
        )),
        ..Named::default()
    }
}

#[test]
fn a_connector_keys_block_is_published_with_the_fields_mooncakes_master_gives_it() {
    let ns = Namespace::new("default").unwrap();
    let key = format!("Qwen/Qwen3-8B@tp_rank:1@pcp0@dcp0@pp_rank:0@group:3@{HASH}");
    let hash = BlockHash::from_opaque(key.as_bytes());
    let events = [
        Event::Cleared(ns.clone()),
        Event::Block {
            kind: Kind::Stored,
            tier: Tier::Dram,
            ns: ns.clone(),
            hash,
            named: keyed(&key, vec![5; 16]),
        },
        Event::Block {
            kind: Kind::Removed,
            tier: Tier::Nvme,
            ns: ns.clone(),
            hash,
            named: keyed(&key, vec![]),
        },
    ];
    let payload = encode_batch(&ctx(), 1_700_000_000_123, 40, &events);
    let (at, events, dp) = decode(&payload);
    assert_eq!((at, dp), (1_700_000_000_123, 2));
    let cleared = &events[0];
    assert_eq!(
        field(cleared, "event_type").unwrap().as_str(),
        Some("cleared")
    );
    assert_eq!(
        field(cleared, "type").unwrap().as_str(),
        Some("AllBlocksCleared")
    );
    assert_eq!(
        field(cleared, "tenant_id").unwrap().as_str(),
        Some("default")
    );
    assert_eq!(
        field(cleared, "backend_id").unwrap().as_str(),
        Some("pool-a")
    );
    assert!(field(cleared, "medium").unwrap().is_nil());
    assert!(field(cleared, "object_key").is_none(), "no object fields");
    assert_eq!(field(cleared, "event_id").unwrap().as_u64(), Some(40));

    let stored = &events[1];
    let text = |name| field(stored, name).unwrap().as_str().map(str::to_string);
    let num = |name| field(stored, name).unwrap().as_u64();
    assert_eq!(text("event_type").as_deref(), Some("stored"));
    assert_eq!(text("type").as_deref(), Some("BlockStored"));
    assert_eq!(num("event_id"), Some(41));
    assert_eq!(
        field(stored, "timestamp").unwrap().as_i64(),
        Some(1_700_000_000_123)
    );
    assert_eq!(
        text("model_name").as_deref(),
        Some("Qwen/Qwen3-8B"),
        "the key's model"
    );
    assert_eq!(num("block_size"), Some(16), "the writer's tokens");
    assert_eq!(text("additional_salt").as_deref(), Some("salt"));
    assert!(field(stored, "lora_name").unwrap().is_nil());
    assert_eq!(text("medium").as_deref(), Some("cpu"));
    assert_eq!(text("object_key"), Some(key.clone()));
    assert_eq!(text("connector_block_hash").as_deref(), Some(HASH));
    assert_eq!(text("group_id").as_deref(), Some("3"));
    assert_eq!(
        (num("tp_rank"), num("pcp_rank"), num("pp_rank")),
        (Some(1), Some(0), Some(0))
    );
    assert!(field(stored, "head_or_tp_rank").is_none());
    for name in ["seq_hashes", "block_hashes"] {
        let hashes = field(stored, name).unwrap().as_array().unwrap();
        assert_eq!(hashes[0].as_u64(), Some(0xdeadbeefcafef00d), "{name}");
    }
    assert!(field(stored, "base_block_idx").unwrap().is_nil());
    assert!(field(stored, "parent_hash").unwrap().is_nil());
    assert_eq!(
        field(stored, "token_ids")
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        16
    );

    let removed = &events[2];
    assert_eq!(
        field(removed, "event_type").unwrap().as_str(),
        Some("removed")
    );
    assert_eq!(field(removed, "medium").unwrap().as_str(), Some("disk"));
    assert_eq!(
        field(removed, "object_key").unwrap().as_str(),
        Some(key.as_str())
    );
    assert!(field(removed, "token_ids").is_none(), "stored-only fields");
    assert!(field(removed, "parent_hash").is_none());
    assert_eq!(
        field(removed, "block_size").unwrap().as_u64(),
        None,
        "no tokens and no default: nil"
    );
}

#[test]
fn a_block_without_a_string_key_is_named_by_its_store_hash_and_engine_hash() {
    let ns = Namespace::new("tenant-b").unwrap();
    let hash = BlockHash([7; 32]);
    let parent = BlockHash([9; 32]);
    let plain = Named {
        parent: Some(parent),
        ..Named::default()
    };
    let engine = Named {
        parent: Some(parent),
        parent_hash: Some(EngineHash::Int(77)),
        tag: Some(Arc::new(
            EngineTag::new(Some(EngineHash::Bytes(vec![1, 2, 3].into())), vec![1, 2]).unwrap(),
        )),
    };
    let event = |named| Event::Block {
        kind: Kind::Stored,
        tier: Tier::Dram,
        ns: ns.clone(),
        hash,
        named,
    };
    let mut with_size = ctx();
    with_size.block_size = 64;
    let payload = encode_batch(&with_size, 1, 1, &[event(plain), event(engine)]);
    let (_, events, _) = decode(&payload);
    let seq = |e: &Value| field(e, "seq_hashes").unwrap().as_array().unwrap()[0].as_u64();
    assert_eq!(
        field(&events[0], "object_key").unwrap().as_str(),
        Some(hash.to_hex().as_str())
    );
    assert_eq!(seq(&events[0]), Some(0x0707070707070707));
    assert_eq!(
        field(&events[0], "parent_hash").unwrap().as_u64(),
        Some(0x0909090909090909)
    );
    assert_eq!(
        field(&events[0], "model_name").unwrap().as_str(),
        Some("fallback-model")
    );
    assert_eq!(field(&events[0], "block_size").unwrap().as_u64(), Some(64));
    assert!(field(&events[0], "connector_block_hash").is_none());
    assert_eq!(seq(&events[1]), Some(0x010203), "bytes by their last 8");
    assert_eq!(field(&events[1], "parent_hash").unwrap().as_u64(), Some(77));
    assert_eq!(field(&events[1], "block_size").unwrap().as_u64(), Some(2));
    assert_eq!(
        field(&events[1], "tenant_id").unwrap().as_str(),
        Some("tenant-b")
    );
}

#[test]
fn availability_changes_with_a_mediums_first_copy_and_its_last() {
    let mut a = Availability::default();
    let ns = Namespace::new("t").unwrap();
    let h = BlockHash([1; 32]);
    assert!(a.clear_first(&ns));
    assert!(!a.clear_first(&ns), "once per term");
    assert!(a.apply(Kind::Stored, Tier::Dram, &ns, h), "first copy");
    assert!(!a.apply(Kind::Stored, Tier::Dram, &ns, h), "a second copy");
    assert!(a.apply(Kind::Stored, Tier::Nvme, &ns, h), "first on disk");
    assert!(!a.apply(Kind::Removed, Tier::Dram, &ns, h), "one copy left");
    assert!(
        a.apply(Kind::Removed, Tier::Dram, &ns, h),
        "the last in DRAM"
    );
    assert!(!a.apply(Kind::Removed, Tier::Dram, &ns, h), "none was left");
    assert!(a.apply(Kind::Removed, Tier::Nvme, &ns, h));
    assert!(a.copies.is_empty(), "a block with no copy is forgotten");
    assert!(!a.apply(Kind::Removed, Tier::Dram, &ns, BlockHash([2; 32])));
    assert_eq!(a.reset(), vec![ns.clone()]);
    assert!(a.clear_first(&ns), "cleared again after a reset");
}

#[test]
fn the_decoder_reads_back_what_the_encoder_wrote_and_refuses_other_batches() {
    let ns = Namespace::new("tenant-c").unwrap();
    let key = format!("m@tp_rank:2@pcp0@dcp0@pp_rank:1@{HASH}");
    let hash = BlockHash::from_opaque(key.as_bytes());
    let events = [
        Event::Cleared(ns.clone()),
        Event::Block {
            kind: Kind::Stored,
            tier: Tier::Nvme,
            ns: ns.clone(),
            hash,
            named: keyed(&key, vec![1, 2, 3]),
        },
    ];
    let batch = decode_batch(&encode_batch(&ctx(), 99, 7, &events)).unwrap();
    assert_eq!((batch.timestamp_ms, batch.dp_rank), (99, Some(2)));
    let [cleared, stored] = &batch.events[..] else {
        panic!("two events, got {:?}", batch.events);
    };
    assert_eq!(
        (
            cleared.event_type,
            cleared.event_id,
            cleared.medium.as_deref()
        ),
        (EventType::Cleared, 7, None)
    );
    assert_eq!(cleared.tenant_id, "tenant-c");
    assert_eq!(stored.event_type, EventType::Stored);
    assert_eq!(stored.event_id, 8);
    assert_eq!(stored.medium.as_deref(), Some("disk"));
    assert_eq!(stored.object_key.as_deref(), Some(key.as_str()));
    assert_eq!(stored.connector_block_hash.as_deref(), Some(HASH));
    assert_eq!((stored.tp_rank, stored.pp_rank), (Some(2), Some(1)));
    assert_eq!(stored.seq_hash, Some(0xdeadbeefcafef00d));
    assert_eq!(stored.token_ids, [1, 2, 3]);
    assert_eq!(stored.block_size, Some(3));
    assert_eq!(stored.backend_id, "pool-a");

    // vLLM's batch starts with a float of seconds; a truncated one is no
    // msgpack value.
    let vllm = super::super::wire::encode_batch(1.5, &[super::super::wire::Event::AllCleared]);
    assert!(decode_batch(&vllm).is_err());
    let good = encode_batch(&ctx(), 99, 7, &events);
    assert!(decode_batch(&good[..good.len() / 2]).is_err());
}

/// The rules Mooncake Conductor's decoder holds every event to: the
/// fields it requires, each event's `timestamp` equal to its batch's,
/// `block_hashes` equal to `seq_hashes`, `parent_block_hash` to
/// `parent_hash`, no object field in `cleared` and no stored-only field
/// in `removed`.
#[test]
fn every_event_keeps_the_rules_of_mooncake_conductors_decoder() {
    let ns = Namespace::new("tenant-d").unwrap();
    let key = format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@{HASH}");
    let parent = Named {
        parent: Some(BlockHash([3; 32])),
        ..Named::default()
    };
    let block = |kind, named: Named| Event::Block {
        kind,
        tier: Tier::Dram,
        ns: ns.clone(),
        hash: BlockHash([4; 32]),
        named,
    };
    let events = [
        Event::Cleared(ns.clone()),
        block(Kind::Stored, keyed(&key, vec![1, 2])),
        block(Kind::Stored, parent.clone()),
        block(Kind::Removed, keyed(&key, vec![])),
        block(Kind::Removed, parent),
    ];
    let (at, events, _) = decode(&encode_batch(&ctx(), 1_700_000_000_999, 1, &events));
    let common = [
        "event_id",
        "timestamp",
        "model_name",
        "block_size",
        "additional_salt",
        "lora_name",
        "tenant_id",
        "backend_id",
        "medium",
        "dp_rank",
    ];
    let object = ["group_id", "seq_hashes", "base_block_idx"];
    let object_only = [
        "group_id",
        "object_key",
        "connector_block_hash",
        "cache_prefix",
        "tp_rank",
        "head_or_tp_rank",
        "pcp_rank",
        "dcp_rank",
        "pp_rank",
        "layer_id",
        "seq_hashes",
        "block_hashes",
        "base_block_idx",
        "parent_hash",
        "token_ids",
        "parent_block_hash",
    ];
    let stored_only = ["parent_hash", "token_ids", "parent_block_hash"];
    for (i, e) in events.iter().enumerate() {
        for name in common {
            assert!(field(e, name).is_some(), "event {i} lacks {name}");
        }
        assert_eq!(
            field(e, "timestamp").unwrap().as_i64(),
            Some(at),
            "event {i}"
        );
        match field(e, "event_type").unwrap().as_str().unwrap() {
            "cleared" => {
                for name in object_only {
                    assert!(field(e, name).is_none(), "cleared event {i} has {name}");
                }
            }
            kind => {
                for name in object {
                    assert!(field(e, name).is_some(), "event {i} lacks {name}");
                }
                assert_eq!(
                    field(e, "block_hashes"),
                    field(e, "seq_hashes"),
                    "event {i}"
                );
                if kind == "removed" {
                    for name in stored_only {
                        assert!(field(e, name).is_none(), "removed event {i} has {name}");
                    }
                } else {
                    assert!(field(e, "parent_hash").is_some() && field(e, "token_ids").is_some());
                    assert_eq!(
                        field(e, "parent_block_hash"),
                        field(e, "parent_hash"),
                        "event {i}"
                    );
                }
            }
        }
    }
    assert_eq!(
        field(&events[2], "parent_hash").unwrap().as_u64(),
        Some(0x0303030303030303),
        "an unkeyed block names its parent"
    );
}
