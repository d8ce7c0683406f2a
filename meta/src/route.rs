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
//! costs about a `match_prefix`.

use std::collections::{BTreeMap, HashMap};

use mooncake_proto::message::{RouteAnswer, RouteCandidate, RouteHost, RouteRequest};

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
    // the leading ones in a row (copies are on distinct hosts).
    let mut held = vec![0u32; hosts.len()];
    let mut leading = vec![0u32; hosts.len()];
    for (i, l) in locations.iter().enumerate() {
        for h in l.daemons.iter().filter_map(|d| host_of.get(&d)) {
            held[*h] += 1;
            if leading[*h] as usize == i {
                leading[*h] += 1;
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
            let held = at.map_or(0, |i| held[i]);
            let cost_milli = u64::from(blocks - matched) * 1000
                + u64::from(req.transfer_permille) * u64::from(matched - held)
                + u64::from(c.queue) * 1000;
            RouteHost {
                instance: instances.get(&c.node).cloned().unwrap_or_default(),
                daemons: host.map_or(0, |h| h.daemons.len() as u32),
                leading: at.map_or(0, |i| leading[i]),
                held,
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
