//! Bodies of the operators' calls: cluster stats, listings, draining.

use super::*;

/// Stop (or resume) placing new blocks on a daemon, before taking it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainRequest {
    pub daemon: u32,
    pub drain: bool,
}

impl Body for DrainRequest {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.daemon);
        w.u8(self.drain as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(DrainRequest {
            daemon: r.u32()?,
            drain: r.u8()? != 0,
        })
    }
}

/// One daemon as the meta service sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonInfo {
    pub id: u32,
    pub node: String,
    pub addr: String,
    pub alive: bool,
    /// No new blocks are placed on it.
    pub draining: bool,
    pub capacity: u64,
    pub used: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    /// Transports it serves besides TCP.
    pub endpoints: Vec<Endpoint>,
}

/// How often one operation failed with one code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorCount {
    pub op: String,
    pub code: String,
    pub count: u64,
}

/// The whole cluster at a glance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterStats {
    /// The answering leader's address and election revision.
    pub leader: String,
    pub revision: u64,
    /// Meta replicas standing by.
    pub standbys: Vec<String>,
    /// Visible blocks, each counted once, and their copies (a block stored
    /// on three hosts: one block, three copies).
    pub blocks: u64,
    pub copies: u64,
    pub bytes: u64,
    pub pending: u64,
    /// Blocks waiting for a copy to be made (lost with a host, or on a
    /// host being drained).
    pub repairing: u64,
    pub daemons: Vec<DaemonInfo>,
    /// The meta service's most frequent error answers since it leads.
    pub errors: Vec<ErrorCount>,
}

impl Body for ClusterStats {
    fn encode(&self, w: &mut Writer) {
        w.str(&self.leader);
        w.u64(self.revision);
        w.count(self.standbys.len());
        for s in &self.standbys {
            w.str(s);
        }
        w.u64(self.blocks);
        w.u64(self.copies);
        w.u64(self.bytes);
        w.u64(self.pending);
        w.u64(self.repairing);
        w.count(self.daemons.len());
        for d in &self.daemons {
            w.u32(d.id);
            w.str(&d.node);
            w.str(&d.addr);
            w.u8(d.alive as u8);
            w.u8(d.draining as u8);
            w.u64(d.capacity);
            w.u64(d.used);
            w.u64(d.blocks);
            w.u64(d.hits);
            w.u64(d.misses);
            encode_endpoints(w, &d.endpoints);
        }
        w.count(self.errors.len());
        for e in &self.errors {
            w.str(&e.op);
            w.str(&e.code);
            w.u64(e.count);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let leader = r.str()?.to_string();
        let revision = r.u64()?;
        let n = r.count(2)?;
        let standbys = (0..n)
            .map(|_| Ok(r.str()?.to_string()))
            .collect::<Result<_, ProtoError>>()?;
        let blocks = r.u64()?;
        let copies = r.u64()?;
        let bytes = r.u64()?;
        let pending = r.u64()?;
        let repairing = r.u64()?;
        let n = r.count(37)?;
        let daemons = (0..n)
            .map(|_| {
                Ok(DaemonInfo {
                    id: r.u32()?,
                    node: r.str()?.to_string(),
                    addr: r.str()?.to_string(),
                    alive: r.u8()? != 0,
                    draining: r.u8()? != 0,
                    capacity: r.u64()?,
                    used: r.u64()?,
                    blocks: r.u64()?,
                    hits: r.u64()?,
                    misses: r.u64()?,
                    endpoints: decode_endpoints(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let n = r.count(12)?;
        let errors = (0..n)
            .map(|_| {
                Ok(ErrorCount {
                    op: r.str()?.to_string(),
                    code: r.str()?.to_string(),
                    count: r.u64()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(ClusterStats {
            leader,
            revision,
            standbys,
            blocks,
            copies,
            bytes,
            pending,
            repairing,
            daemons,
            errors,
        })
    }
}

/// Page through the index, ordered by (namespace, hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListRequest {
    /// Only this namespace, or every namespace.
    pub namespace: Option<Namespace>,
    /// Start after this key (the last key of the previous page).
    pub after: Option<BlockKey>,
    /// Only hashes starting with these bytes (at most 32).
    pub prefix: Vec<u8>,
    /// Only blocks on this daemon (0: any).
    pub daemon: u32,
    pub limit: u32,
}

impl Body for ListRequest {
    fn encode(&self, w: &mut Writer) {
        w.str(self.namespace.as_ref().map_or("", |n| n.as_str()));
        match &self.after {
            None => w.u8(0),
            Some(k) => {
                w.u8(1);
                encode_key(w, k);
            }
        }
        w.u8(self.prefix.len().min(32) as u8);
        w.buf
            .extend_from_slice(&self.prefix[..self.prefix.len().min(32)]);
        w.u32(self.daemon);
        w.u32(self.limit);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let ns = r.str()?;
        let namespace = if ns.is_empty() {
            None
        } else {
            Some(Namespace::new(ns)?)
        };
        let after = match r.u8()? {
            0 => None,
            _ => Some(decode_key(r)?),
        };
        let n = r.u8()? as usize;
        if n > 32 {
            return Err(ProtoError::Invalid {
                field: "prefix",
                why: format!("{n} bytes, at most 32"),
            });
        }
        let prefix = r.take(n)?.to_vec();
        Ok(ListRequest {
            namespace,
            after,
            prefix,
            daemon: r.u32()?,
            limit: r.u32()?,
        })
    }
}

/// One listed block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub key: BlockKey,
    pub location: Location,
}

/// A page of the index; `more` says whether a next page exists.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListResponse {
    pub entries: Vec<ListEntry>,
    pub more: bool,
}

impl Body for ListResponse {
    fn encode(&self, w: &mut Writer) {
        w.count(self.entries.len());
        for e in &self.entries {
            encode_key(w, &e.key);
            e.location.encode(w);
        }
        w.u8(self.more as u8);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count(2 + 1 + 32 + 17)?;
        let entries = (0..n)
            .map(|_| {
                Ok(ListEntry {
                    key: decode_key(r)?,
                    location: Location::decode(r)?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(ListResponse {
            entries,
            more: r.u8()? != 0,
        })
    }
}
