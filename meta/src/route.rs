//! The router's question: for a request's chain of blocks, how much of its
//! prefix each candidate host holds, and where serving it costs least.
//!
//! The cost of serving a request of `blocks` blocks on host `h`, in units
//! of one block's prefill (the Mooncake paper's Conductor weighs the same
//! three parts, as time to first token):
//!
//! ```text
//! cost(h) = (blocks - matched)              blocks no host holds: prefilled
//!         + transfer x (matched - held(h))  blocks of the prefix moved to h
//!         + queue(h)                        work already waiting at h
//! ```
//!
//! `matched` is the request's leading blocks held anywhere in the
//! cluster, `held(h)` those of them on `h`'s daemons, `transfer` what
//! moving a block costs against prefilling it (the caller's figure, e.g.
//! 0.1), and `queue(h)` the router's own knowledge of the instance there.
//! One prefix match and one pass over its locations: a 128-block request
//! costs about a `match_prefix`. The answer also says how many of a host's
//! blocks are on NVMe only (the cost does not weigh them: a drive read is
//! far cheaper than a prefill or a network transfer, and a router that
//! cares has the figure).

use std::collections::{BTreeMap, HashMap};

use mooncake_proto::message::{RouteAnswer, RouteCandidate, RouteHost, RouteRequest, Tier};

use crate::daemons::Host;
use crate::index::Index;

/// Answers `req` from the index, the live hosts and the serving instance
/// on each host (by node name).
pub fn route(
    index: &Index,
    hosts: &[Host],
    instances: &BTreeMap<String, String>,
    req: &RouteRequest,
) -> RouteAnswer {
    let locations = index.match_prefix(&req.keys.namespace, &req.keys.hashes);
    let matched = locations.len() as u32;
    let host_of: HashMap<u32, usize> = hosts
        .iter()
        .enumerate()
        .flat_map(|(i, h)| h.daemons.iter().map(move |d| (*d, i)))
        .collect();
    // Per host: the matched blocks it holds a copy of, and how many of
    // the leading ones in a row; each also counted when on NVMe only.
    let mut held = vec![(0u32, 0u32); hosts.len()];
    let mut leading = vec![(0u32, 0u32); hosts.len()];
    for (i, l) in locations.iter().enumerate() {
        // A block's fastest copy per host (two daemons of one host may
        // both hold it).
        let mut on: [(usize, Tier); 4] = [(usize::MAX, Tier::Dram); 4];
        for (d, tier) in l.daemons.with_tiers() {
            let Some(h) = host_of.get(&d).copied() else {
                continue;
            };
            match on.iter_mut().find(|(at, _)| *at == h || *at == usize::MAX) {
                Some((at, t)) if *at == h && tier == Tier::Dram => *t = tier,
                Some((at, _)) if *at == h => {}
                Some(slot) => *slot = (h, tier),
                None => {}
            }
        }
        for (h, tier) in on.into_iter().filter(|(h, _)| *h != usize::MAX) {
            let nvme = u32::from(tier == Tier::Nvme);
            held[h].0 += 1;
            held[h].1 += nvme;
            if leading[h].0 as usize == i {
                leading[h].0 += 1;
                leading[h].1 += nvme;
            }
        }
    }
    // A candidate named by its instance (and not a host's name) stands
    // for that instance's host.
    let host_named = |name: &str| {
        if hosts.iter().any(|h| h.node == name) {
            return name.to_string();
        }
        instances
            .iter()
            .find(|(_, instance)| *instance == name)
            .map_or_else(|| name.to_string(), |(node, _)| node.clone())
    };
    let mut candidates: Vec<RouteCandidate> = req
        .candidates
        .iter()
        .map(|c| RouteCandidate {
            node: host_named(&c.node),
            queue: c.queue,
        })
        .collect();
    if req.every_host {
        for h in hosts {
            if !candidates.iter().any(|c| c.node == h.node) {
                candidates.push(RouteCandidate {
                    node: h.node.clone(),
                    queue: 0,
                });
            }
        }
    }
    let blocks = req.keys.hashes.len() as u32;
    let answer: Vec<RouteHost> = candidates
        .into_iter()
        .map(|c| {
            let at = hosts.iter().position(|h| h.node == c.node);
            let host = at.map(|i| &hosts[i]);
            let (held, held_nvme) = at.map_or((0, 0), |i| held[i]);
            let (leading, leading_nvme) = at.map_or((0, 0), |i| leading[i]);
            let cost_milli = u64::from(blocks - matched) * 1000
                + u64::from(req.transfer_permille) * u64::from(matched - held)
                + u64::from(c.queue) * 1000;
            RouteHost {
                instance: instances.get(&c.node).cloned().unwrap_or_default(),
                daemons: host.map_or(0, |h| h.daemons.len() as u32),
                leading,
                held,
                leading_nvme,
                held_nvme,
                reads_per_sec: host.map_or(0, |h| h.reads_per_sec),
                used: host.map_or(0, |h| h.used),
                capacity: host.map_or(0, |h| h.capacity),
                queue: c.queue,
                cost_milli,
                node: c.node,
            }
        })
        .collect();
    // Cheapest; among equals, the one holding more, then the first asked.
    let best = answer
        .iter()
        .enumerate()
        .min_by_key(|(i, h)| (h.cost_milli, std::cmp::Reverse(h.held), *i))
        .map(|(i, _)| i as u32);
    RouteAnswer {
        blocks,
        matched,
        hosts: answer,
        best,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::message::KeysRequest;
    use mooncake_proto::{BlockHash, BlockKey, Namespace};

    fn host(node: &str, daemons: &[u32]) -> Host {
        Host {
            node: node.into(),
            daemons: daemons.to_vec(),
            reads_per_sec: 0,
            used: 0,
            capacity: 0,
        }
    }

    #[test]
    fn each_host_counts_its_leading_and_held_blocks_and_those_on_nvme_only() {
        let ns = Namespace::new("t").unwrap();
        let hashes: Vec<BlockHash> = (0..5u8).map(|i| BlockHash([i; 32])).collect();
        let index = Index::new();
        let put = |i: usize, copy: (u32, Tier)| {
            index.insert_visible(&BlockKey::new(ns.clone(), hashes[i]), copy, (10, 1), None);
        };
        // Host a (daemons 1, 2): blocks 0-2, block 1 on NVMe only, block 2
        // on NVMe on one daemon and in DRAM on the other.
        put(0, (1, Tier::Dram));
        put(1, (1, Tier::Nvme));
        put(2, (1, Tier::Nvme));
        put(2, (2, Tier::Dram));
        // Host b (daemon 3): blocks 0, 3 on NVMe; nobody holds block 4.
        put(0, (3, Tier::Nvme));
        put(3, (3, Tier::Nvme));
        let hosts = [host("a", &[1, 2]), host("b", &[3])];
        let req = RouteRequest {
            keys: KeysRequest {
                namespace: ns.clone(),
                hashes: hashes.clone(),
            },
            candidates: Vec::new(),
            every_host: true,
            transfer_permille: 100,
        };
        let answer = route(&index, &hosts, &BTreeMap::new(), &req);
        assert_eq!((answer.blocks, answer.matched), (5, 4));
        let got: Vec<(&str, u32, u32, u32, u32)> = answer
            .hosts
            .iter()
            .map(|h| {
                let n = h.node.as_str();
                (n, h.leading, h.leading_nvme, h.held, h.held_nvme)
            })
            .collect();
        assert_eq!(got, [("a", 3, 1, 3, 1), ("b", 1, 1, 2, 2)]);
        assert_eq!(answer.best, Some(0));
    }
}
