//! The router's question (`Route`): for a request's chain of blocks and
//! some candidate hosts, how much of its prefix each host holds and what
//! serving it there would cost. `meta/src/route.rs` answers it; the cost
//! is documented in `docs/events.md`.

use super::*;

/// A host a router could send the request to, with what the router knows
/// of its own queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCandidate {
    /// The `node` name its daemon registered with, or the name of the
    /// serving instance the meta service's `instances` puts there.
    pub node: String,
    /// Work already queued on the serving instance there, in blocks of
    /// prefill (0: unknown or idle).
    pub queue: u32,
}

/// `Route`: the request's chain, the candidate hosts, and what moving one
/// block between hosts costs against prefilling it, in thousandths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRequest {
    pub keys: KeysRequest,
    /// Hosts to judge, with their queues.
    pub candidates: Vec<RouteCandidate>,
    /// Judge every host with a live daemon too (those not among the
    /// candidates with no queue).
    pub every_host: bool,
    pub transfer_permille: u32,
}

impl Body for RouteRequest {
    fn size_hint(&self) -> usize {
        self.keys.size_hint() + self.candidates.len() * 32
    }
    fn encode(&self, w: &mut Writer) {
        self.keys.encode(w);
        w.count(self.candidates.len());
        for c in &self.candidates {
            w.str(&c.node);
            w.u32(c.queue);
        }
        w.u8(self.every_host as u8);
        w.u32(self.transfer_permille);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let keys = KeysRequest::decode(r)?;
        let n = r.count(2 + 4)?;
        let candidates = (0..n)
            .map(|_| {
                Ok(RouteCandidate {
                    node: r.str()?.to_string(),
                    queue: r.u32()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let every_host = r.bool("every_host")?;
        Ok(RouteRequest {
            keys,
            candidates,
            every_host,
            transfer_permille: r.u32()?,
        })
    }
}

/// One candidate host in the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteHost {
    pub node: String,
    /// The serving instance there (the meta service's `instances`), or "".
    pub instance: String,
    /// Its live daemons.
    pub daemons: u32,
    /// Leading blocks of the request all held on this host: what an
    /// instance there reads without the network.
    pub leading: u32,
    /// Blocks of the cluster's prefix (`RouteAnswer::matched`) held on
    /// this host; the rest of the prefix moves from other hosts.
    pub held: u32,
    /// Of `leading`, the blocks this host holds on NVMe only (a drive read
    /// each; the rest are in DRAM).
    pub leading_nvme: u32,
    /// Of `held`, the blocks this host holds on NVMe only.
    pub held_nvme: u32,
    /// Gets its daemons answered per second, over their last heartbeats.
    pub reads_per_sec: u64,
    pub used: u64,
    pub capacity: u64,
    /// The candidate's queue, as asked.
    pub queue: u32,
    /// Blocks to prefill + transfer cost x blocks to move + queue, in
    /// thousandths of a block's prefill.
    pub cost_milli: u64,
}

/// The answer to `Route`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteAnswer {
    /// Blocks of the request in the chain.
    pub blocks: u32,
    /// Its leading blocks held anywhere in the cluster.
    pub matched: u32,
    pub hosts: Vec<RouteHost>,
    /// Index into `hosts` of the cheapest; none without candidates.
    pub best: Option<u32>,
}

impl Body for RouteAnswer {
    fn size_hint(&self) -> usize {
        16 + self.hosts.len() * 80
    }
    fn encode(&self, w: &mut Writer) {
        w.u32(self.blocks);
        w.u32(self.matched);
        w.count(self.hosts.len());
        for h in &self.hosts {
            w.str(&h.node);
            w.str(&h.instance);
            w.u32(h.daemons);
            w.u32(h.leading);
            w.u32(h.held);
            w.u32(h.leading_nvme);
            w.u32(h.held_nvme);
            w.u64(h.reads_per_sec);
            w.u64(h.used);
            w.u64(h.capacity);
            w.u32(h.queue);
            w.u64(h.cost_milli);
        }
        w.u32(self.best.unwrap_or(u32::MAX));
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let blocks = r.u32()?;
        let matched = r.u32()?;
        let n = r.count(2 + 2 + 4 * 6 + 8 * 4)?;
        let hosts: Vec<RouteHost> = (0..n)
            .map(|_| {
                Ok(RouteHost {
                    node: r.str()?.to_string(),
                    instance: r.str()?.to_string(),
                    daemons: r.u32()?,
                    leading: r.u32()?,
                    held: r.u32()?,
                    leading_nvme: r.u32()?,
                    held_nvme: r.u32()?,
                    reads_per_sec: r.u64()?,
                    used: r.u64()?,
                    capacity: r.u64()?,
                    queue: r.u32()?,
                    cost_milli: r.u64()?,
                })
            })
            .collect::<Result<_, ProtoError>>()?;
        let best = match r.u32()? {
            u32::MAX => None,
            i if (i as usize) < hosts.len() => Some(i),
            i => {
                return Err(ProtoError::Invalid {
                    field: "best",
                    why: format!("{i} with {} hosts", hosts.len()),
                })
            }
        };
        Ok(RouteAnswer {
            blocks,
            matched,
            hosts,
            best,
        })
    }
}
