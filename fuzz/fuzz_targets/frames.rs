//! Bytes from the network: a frame header, then its body decoded as every
//! message type. Nothing may panic or allocate beyond the limits, and what
//! decodes encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_proto::frame::{Header, HEADER_LEN};
use mooncake_proto::message::*;

/// Decodes `body` as `T`; if it decodes, encoding gives the bytes back.
fn round_trip<T: Body + std::fmt::Debug>(body: &[u8]) {
    if let Ok(v) = T::from_bytes(body) {
        let again = v.to_bytes();
        let back = T::from_bytes(&again).expect("what we encode decodes");
        assert_eq!(format!("{v:?}"), format!("{back:?}"));
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(Some(header)) = Header::parse(data) else {
        // A header that does not parse is refused; the body too then.
        let _ = Header::parse(data);
        for_each_body(data);
        return;
    };
    assert!(header.body_len <= header.opcode.body_limit(header.response));
    let body = &data[HEADER_LEN..];
    let body = &body[..body.len().min(header.body_len as usize)];
    for_each_body(body);
});

fn for_each_body(body: &[u8]) {
    round_trip::<Empty>(body);
    round_trip::<KeyRequest>(body);
    round_trip::<FetchRequest>(body);
    round_trip::<PutHead>(body);
    round_trip::<PoolStats>(body);
    round_trip::<Revision>(body);
    round_trip::<EvictRequest>(body);
    round_trip::<EvictResponse>(body);
    round_trip::<DrainRequest>(body);
    round_trip::<KeysRequest>(body);
    round_trip::<PinRequest>(body);
    round_trip::<RouteRequest>(body);
    round_trip::<RouteAnswer>(body);
    round_trip::<Locations>(body);
    round_trip::<PutStartRequest>(body);
    round_trip::<PutStartResponse>(body);
    round_trip::<PutCommitRequest>(body);
    round_trip::<Statuses>(body);
    round_trip::<ClusterStats>(body);
    round_trip::<ListRequest>(body);
    round_trip::<ListResponse>(body);
    round_trip::<RegisterRequest>(body);
    round_trip::<RegisterResponse>(body);
    round_trip::<InventoryRequest>(body);
    round_trip::<HeartbeatRequest>(body);
    round_trip::<HeartbeatResponse>(body);
    round_trip::<EventsRequest>(body);
    round_trip::<ShmLease>(body);
    round_trip::<ShmRelease>(body);
    round_trip::<ShmHello>(body);
    round_trip::<ShmTouch>(body);
    round_trip::<ShmPutRequest>(body);
    round_trip::<ShmSlot>(body);
    round_trip::<ShmCommitRequest>(body);
    round_trip::<ShmRoomRequest>(body);
    round_trip::<ShmRooms>(body);
    round_trip::<ShmStoreRequest>(body);
    round_trip::<RdmaPeer>(body);
    round_trip::<RdmaAccept>(body);
}
