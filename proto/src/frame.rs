//! The frame header shared by every message, and its pure check-then-parse.
//!
//! ```text
//! offset  size  field
//!      0     2  magic "MK"
//!      2     1  protocol version (2)
//!      3     1  opcode
//!      4     2  status (ErrorCode; 0 in requests)
//!      6     2  flags (bit 0: response; other bits must be 0)
//!      8     8  request id (echoed in the response; many may be in flight)
//!     16     4  body length in bytes
//! ```
//! All integers are little-endian. The body length is checked against the
//! opcode's limit before a single byte of the body is allocated.

use crate::error::ProtoError;

pub const MAGIC: [u8; 2] = *b"MK";
pub const PROTOCOL_VERSION: u8 = 8;
pub const HEADER_LEN: usize = 20;
/// Largest control body (every opcode but value-carrying ones).
pub const MAX_CONTROL_BODY: u32 = 4 << 20;
/// Largest block value the protocol can carry. Servers may set less.
pub const MAX_VALUE_LEN: u32 = 512 << 20;
/// Most items in one batch message.
pub const MAX_BATCH: usize = 4096;

const FLAG_RESPONSE: u16 = 1;

macro_rules! opcodes {
    ($($(#[$doc:meta])* $name:ident = $val:expr,)*) => {
        /// Every operation of the protocol. Numbers are wire-stable.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Opcode { $($(#[$doc])* $name = $val,)* }

        impl Opcode {
            pub fn from_u8(v: u8) -> Option<Self> {
                match v { $($val => Some(Opcode::$name),)* _ => None }
            }
            pub fn name(self) -> &'static str {
                match self { $(Opcode::$name => stringify!($name),)* }
            }
        }
    };
}

opcodes! {
    // Data plane, served by storage daemons.
    /// Store one block: head, then the value bytes.
    Put = 0x01,
    /// Read one block: the response carries its checksum, then the bytes.
    Get = 0x02,
    /// Drop one block from the daemon.
    Remove = 0x03,
    /// Keep a block from eviction until unpinned.
    Pin = 0x04,
    Unpin = 0x05,
    /// Pool capacity and use of one daemon.
    DaemonStats = 0x06,
    /// Liveness check, answered with an empty body.
    Ping = 0x07,
    /// Re-check one block's checksum (a client read bytes that did not
    /// match); a corrupt block is dropped and `Corrupt` answered.
    Verify = 0x08,
    /// Evict the coldest blocks now, up to a number of bytes (admin).
    Evict = 0x09,
    /// Presents a token; the first request on a connection to a server
    /// that requires authentication (served by daemons and meta alike).
    Auth = 0x0A,
    /// Same host, over the daemon's Unix socket: lease a block in the
    /// shared pool; the answer says where its bytes are.
    ShmGet = 0x0B,
    /// Same host: end leases taken with `ShmGet`.
    ShmRelease = 0x0C,
    /// Same host: reserve room for a block in the shared pool; the client
    /// writes the bytes there itself.
    ShmPut = 0x0D,
    /// Same host: verify a block written with `ShmPut` and store it.
    ShmCommit = 0x0E,
    /// Same host: blocks read through the shared index, for the daemon's
    /// LRU and hit counts.
    ShmTouch = 0x0F,
    /// RDMA, on the daemon's RDMA control port: the client's queue pair;
    /// the answer is the daemon's queue pair and its pool's registered
    /// regions. The connection then carries `ShmGet`, `ShmRelease`,
    /// `ShmPut`, `ShmCommit`, `ShmTouch`, `ShmRoom` and `ShmStore`, whose
    /// offsets the client reads and writes with one-sided RDMA.
    RdmaConnect = 0x10,
    /// From the meta service: fetch a block from another daemon that holds
    /// it (a copy lost with a host, made again); the bytes are checked
    /// against the block's checksum before they are stored.
    Fetch = 0x11,
    /// Same host: reserve room in the shared pool for blocks not yet
    /// named, which the client keeps for its next puts of that size.
    ShmRoom = 0x12,
    /// Same host: store a block the client wrote into room it holds
    /// (`ShmRoom`), in one message; the answer hands it room for the next.
    ShmStore = 0x13,
    /// Lease a batch of stored blocks for the daemon's `kv_lease_ttl`:
    /// kept from eviction until then (a client found them and will read
    /// them; Mooncake's `batch_is_exist`). A status per key.
    Hold = 0x14,
    /// Remove a block unless a lease holds it (`Leased`): the meta
    /// service's call for a removal that is not forced.
    RemoveUnleased = 0x15,
    /// Whether a lease holds a block (`Leased`), without removing it: the
    /// meta service asks every daemon holding a copy before a removal
    /// that is not forced takes any.
    LeaseOf = 0x16,
    /// Same-host put in one round trip: a block written into room held
    /// ahead (body as `ShmStore`), made visible by the daemon itself
    /// (`Admit` to the meta service) before it is stored and answered;
    /// any answer but `Ok` or `AlreadyExists` leaves nothing visible, and
    /// the writer puts it the usual way instead.
    ShmAdmit = 0x17,

    // Control plane, served by the meta service.
    /// Reserve places for new blocks (phase one of a put).
    PutStart = 0x20,
    /// Make stored blocks visible, or abort reservations (phase two).
    PutCommit = 0x21,
    /// Locations of a batch of keys.
    Lookup = 0x22,
    /// Longest stored prefix of a chain of keys, with locations.
    MatchPrefix = 0x23,
    /// Remove a batch of keys from the index and their daemons.
    MetaRemove = 0x24,
    /// Daemons, capacity and use of the whole cluster.
    ClusterStat = 0x25,
    /// Page through the index.
    List = 0x26,
    /// Pin or unpin a batch of keys wherever they are stored.
    MetaPin = 0x27,
    /// Stop or resume placing blocks on a daemon (before taking it out).
    Drain = 0x28,
    /// For a request's chain and candidate hosts: how much of its prefix
    /// each holds, and the cheapest to serve it.
    Route = 0x29,
    /// Remove a batch of keys, but not those a lease holds (Mooncake's
    /// `remove` without `force`).
    MetaRemoveUnleased = 0x2A,
    /// A daemon's blocks, written on it by same-host clients and not yet
    /// in its pool, made visible on it at once (a reservation and a
    /// commit in one): a place for each (`PutStartResponse`), or why not.
    Admit = 0x2B,

    // Daemon to meta service.
    /// A daemon joins and gets its id.
    Register = 0x30,
    /// A daemon's periodic liveness and usage report.
    Heartbeat = 0x31,
    /// Blocks a daemon dropped on its own (eviction, corruption).
    Events = 0x32,
    /// A batch of the blocks a daemon holds (after it registers).
    Inventory = 0x33,
    /// A daemon stops: it and its blocks leave the index now, rather than
    /// after its lease or heartbeats run out.
    Leave = 0x34,
}

impl Opcode {
    /// Largest body a frame with this opcode may carry, in each direction.
    pub fn body_limit(self, response: bool) -> u32 {
        match (self, response) {
            (Opcode::Put, false) | (Opcode::Get, true) => MAX_VALUE_LEN + 4096,
            // Read before the peer is known: no larger than a token needs.
            (Opcode::Auth, false) => crate::auth::MAX_TOKEN_LEN as u32 + 16,
            _ => MAX_CONTROL_BODY,
        }
    }
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub opcode: Opcode,
    pub status: u16,
    pub response: bool,
    pub request_id: u64,
    pub body_len: u32,
}

impl Header {
    pub fn request(opcode: Opcode, request_id: u64, body_len: u32) -> Self {
        Header {
            opcode,
            status: 0,
            response: false,
            request_id,
            body_len,
        }
    }

    pub fn response(opcode: Opcode, request_id: u64, status: u16, body_len: u32) -> Self {
        Header {
            opcode,
            status,
            response: true,
            request_id,
            body_len,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = PROTOCOL_VERSION;
        out[3] = self.opcode as u8;
        out[4..6].copy_from_slice(&self.status.to_le_bytes());
        let flags = if self.response { FLAG_RESPONSE } else { 0 };
        out[6..8].copy_from_slice(&flags.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        out
    }

    /// The error response to a raw request header that could not be
    /// served (even an unknown opcode): same opcode byte and request id.
    pub fn error_reply(raw: &[u8; HEADER_LEN], status: u16) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = PROTOCOL_VERSION;
        out[3] = raw[3];
        out[4..6].copy_from_slice(&status.to_le_bytes());
        out[6..8].copy_from_slice(&FLAG_RESPONSE.to_le_bytes());
        out[8..16].copy_from_slice(&raw[8..16]);
        out
    }

    /// Parses a header from the start of `buf`. `Ok(None)` means not enough
    /// bytes yet (a normal result while reading a stream); an error means
    /// the peer broke the protocol and the connection must close.
    pub fn parse(buf: &[u8]) -> Result<Option<Header>, ProtoError> {
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        if buf[0..2] != MAGIC {
            return Err(ProtoError::BadMagic(u16::from_le_bytes([buf[0], buf[1]])));
        }
        if buf[2] != PROTOCOL_VERSION {
            return Err(ProtoError::UnsupportedVersion(buf[2], PROTOCOL_VERSION));
        }
        let opcode = Opcode::from_u8(buf[3]).ok_or(ProtoError::UnknownOpcode(buf[3]))?;
        let status = u16::from_le_bytes([buf[4], buf[5]]);
        let flags = u16::from_le_bytes([buf[6], buf[7]]);
        if flags & !FLAG_RESPONSE != 0 {
            return Err(ProtoError::Invalid {
                field: "flags",
                why: format!("unknown flag bits {flags:#06x}"),
            });
        }
        let response = flags & FLAG_RESPONSE != 0;
        let request_id = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
        let body_len = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes"));
        let limit = opcode.body_limit(response);
        if body_len > limit {
            return Err(ProtoError::TooLarge {
                len: body_len as u64,
                limit: limit as u64,
            });
        }
        Ok(Some(Header {
            opcode,
            status,
            response,
            request_id,
            body_len,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header::response(Opcode::Get, 42, 1, 1234);
        assert_eq!(Header::parse(&h.encode()).unwrap(), Some(h));
    }

    #[test]
    fn short_input_is_not_an_error() {
        let h = Header::request(Opcode::Ping, 1, 0).encode();
        for n in 0..HEADER_LEN {
            assert_eq!(Header::parse(&h[..n]).unwrap(), None);
        }
    }

    #[test]
    fn four_gib_length_is_refused_before_allocation() {
        let mut h = Header::request(Opcode::Put, 1, 0).encode();
        h[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Header::parse(&h),
            Err(ProtoError::TooLarge { .. })
        ));
        let mut h = Header::request(Opcode::Lookup, 1, 0).encode();
        h[16..20].copy_from_slice(&(MAX_CONTROL_BODY + 1).to_le_bytes());
        assert!(matches!(
            Header::parse(&h),
            Err(ProtoError::TooLarge { .. })
        ));
    }

    #[test]
    fn bad_magic_version_opcode_and_flags_are_refused() {
        let good = Header::request(Opcode::Ping, 1, 0).encode();
        let mut h = good;
        h[0] = b'X';
        assert!(matches!(Header::parse(&h), Err(ProtoError::BadMagic(_))));
        let mut h = good;
        h[2] = 9;
        assert!(matches!(
            Header::parse(&h),
            Err(ProtoError::UnsupportedVersion(9, PROTOCOL_VERSION))
        ));
        let mut h = good;
        h[3] = 0xee;
        assert!(matches!(
            Header::parse(&h),
            Err(ProtoError::UnknownOpcode(0xee))
        ));
        let mut h = good;
        h[6] = 0x80;
        assert!(matches!(Header::parse(&h), Err(ProtoError::Invalid { .. })));
    }
}
