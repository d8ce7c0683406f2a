//! Daemon membership as the meta service sees it: who is alive, where they
//! listen, how full they are, and where a new block should go.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mooncake_proto::message::{
    Copies, DaemonAddr, DaemonInfo, PoolStats, RegisterRequest, MAX_COPIES,
};
use mooncake_proto::transport::Endpoint;
use parking_lot::RwLock;

/// A daemon with less than this share of its pool free is full (see
/// `Daemons::place`).
pub const FULL_MARGIN: f64 = 0.05;

/// A daemon that has just (re)joined is empty, so it would have the most
/// room and take every new block (and the whole cluster's write load) at
/// once. For this long after it joins its share of new blocks is bounded:
/// from a quarter of a fair share (one over the daemons alive), growing
/// with its age to the fair share.
pub const WARMUP: Duration = Duration::from_secs(60);

struct Member {
    node: String,
    addr: String,
    endpoints: Vec<Endpoint>,
    stats: PoolStats,
    /// Bytes placed on it since its last heartbeat (not in `stats` yet).
    placed: u64,
    /// Bytes placed on it over its capacity, since it joined (starting
    /// level with the least loaded daemon then). Full daemons take new
    /// blocks in turn by it: by `placed`, which each report resets, a
    /// daemon that reports after every eviction (as daemons do) would take
    /// every new block of a full cluster.
    load: f64,
    last_seen: Instant,
    /// Gets answered per second between its last two heartbeats.
    reads_per_sec: u64,
    alive: bool,
    /// Takes no new blocks (an operator is taking it out).
    draining: bool,
    /// When it (re)joined, and the cluster's count of placed copies then;
    /// copies placed on it since.
    joined: Instant,
    placed_before: u64,
    placed_since: u64,
}

/// A host's live daemons together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Host {
    pub node: String,
    pub daemons: Vec<u32>,
    /// Gets its daemons answered per second, over their last heartbeats.
    pub reads_per_sec: u64,
    pub used: u64,
    pub capacity: u64,
}

#[derive(Default)]
pub struct Daemons {
    members: RwLock<HashMap<u32, Member>>,
    /// Copies placed on any daemon, ever (for the share of a new one).
    placed_total: std::sync::atomic::AtomicU64,
}

impl Daemons {
    /// Registers a daemon. One that comes back at the same address keeps
    /// its id; one that brings an id from an earlier leader keeps that, if
    /// no other daemon holds it.
    pub fn register(&self, req: RegisterRequest, now: Instant) -> u32 {
        let RegisterRequest {
            node,
            addr,
            capacity,
            id_hint,
            endpoints,
            requires_auth: _,
        } = req;
        let mut members = self.members.write();
        let load = members
            .values()
            .filter(|m| m.alive)
            .map(|m| m.load)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0);
        let hint_free = id_hint != 0 && members.get(&id_hint).is_none_or(|m| m.addr == addr);
        let id = if hint_free {
            members.retain(|id, m| *id == id_hint || m.addr != addr);
            id_hint
        } else {
            members
                .iter()
                .find(|(_, m)| m.addr == addr)
                .map(|(id, _)| *id)
                .unwrap_or_else(|| members.keys().max().map_or(1, |m| m + 1))
        };
        members.insert(
            id,
            Member {
                node,
                addr,
                endpoints,
                stats: PoolStats {
                    capacity,
                    ..PoolStats::default()
                },
                placed: 0,
                load,
                last_seen: now,
                reads_per_sec: 0,
                alive: true,
                draining: false,
                joined: now,
                placed_before: self.placed_total.load(Ordering::Relaxed),
                placed_since: 0,
            },
        );
        id
    }

    /// Records a heartbeat; `false` if the daemon is unknown or was declared
    /// dead (it must register again).
    /// Returns the seconds since the one before (what its counts cover).
    pub fn heartbeat(&self, id: u32, stats: PoolStats, now: Instant) -> Option<f64> {
        let mut members = self.members.write();
        match members.get_mut(&id) {
            Some(m) if m.alive => {
                let reads = |s: &PoolStats| s.hits + s.misses;
                let secs = now.duration_since(m.last_seen).as_secs_f64();
                if secs > 0.0 && reads(&stats) >= reads(&m.stats) {
                    m.reads_per_sec = ((reads(&stats) - reads(&m.stats)) as f64 / secs) as u64;
                }
                m.stats = stats;
                m.placed = 0;
                m.last_seen = now;
                Some(secs)
            }
            _ => None,
        }
    }

    /// Hosts with a live daemon.
    pub fn hosts_alive(&self) -> usize {
        let members = self.members.read();
        let mut nodes: Vec<&str> = members
            .values()
            .filter(|m| m.alive && !m.draining)
            .map(|m| m.node.as_str())
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len()
    }

    /// Forgets a daemon that says it stops; `false` if no daemon with this
    /// id registered from `addr`.
    pub fn leave(&self, id: u32, addr: &str) -> bool {
        let mut members = self.members.write();
        if members.get(&id).is_none_or(|m| m.addr != addr) {
            return false;
        }
        members.remove(&id);
        true
    }

    /// Marks daemons silent for longer than `ttl` dead; returns them.
    pub fn expire(&self, ttl: Duration, now: Instant) -> Vec<u32> {
        let mut members = self.members.write();
        members
            .iter_mut()
            .filter(|(_, m)| m.alive && now.duration_since(m.last_seen) > ttl)
            .map(|(id, m)| {
                m.alive = false;
                *id
            })
            .collect()
    }

    /// Where a new block of `size` bytes from a writer on `node` goes: a
    /// daemon on the writer's own host if one has room for it (the worker
    /// that computed a block is the likeliest to read it again, and a
    /// same-host read crosses no network), else the live daemon with the
    /// most room. A daemon evicts only what a put needs, so in a busy
    /// cluster every pool is full: one with less than `FULL_MARGIN` of its
    /// pool free is full, and among full daemons new blocks go to the one
    /// given the least of its capacity so far (`Member::load`), so that
    /// they spread evenly instead of following the last few free bytes or
    /// the timing of reports. Draining daemons take nothing.
    #[cfg(test)]
    pub fn place(&self, size: u64, node: &str) -> Option<u32> {
        self.place_copies(size, node, 1, None).first()
    }

    /// Where the `copies` copies of a new block go, each on a distinct host
    /// (`node`; two daemons of one host are not two copies): the first as
    /// `place` puts a single copy, each next one as `place` puts a block
    /// of a writer on no host, among the hosts not chosen yet. Fewer if
    /// fewer hosts can take it; none if no daemon can.
    ///
    /// A block stored again after `evicted_by` evicted it goes back there
    /// (its first copy), if no daemon of the writer's host has room for it
    /// and `evicted_by` can take it: has room, or no daemon has. Its pool
    /// remembers the key and keeps the block as one that came back (2Q's
    /// main queue); anywhere else it would start as a new block.
    pub fn place_copies(
        &self,
        size: u64,
        node: &str,
        copies: usize,
        evicted_by: Option<u32>,
    ) -> Copies {
        let mut members = self.members.write();
        let mut chosen = Copies::default();
        let mut hosts: Vec<String> = Vec::new();
        let now = Instant::now();
        for i in 0..copies.clamp(1, MAX_COPIES) {
            let (writer, back) = match i {
                0 => (node, evicted_by),
                _ => ("", None),
            };
            let Some(id) = self.place_one(&members, size, (writer, back), (&hosts, &[]), now)
            else {
                break;
            };
            self.placed_on(&mut members, id, size);
            hosts.push(members[&id].node.clone());
            chosen.push(id);
        }
        chosen
    }

    /// Whether a block of `size` bytes written on daemon `id` by a client
    /// of its host (`Admit`) stays there: where `place_copies` would put
    /// its single copy (back on `evicted_by`, else on a roomy daemon of
    /// that host, else elsewhere), counted as placed there if so.
    pub fn admit_on(&self, id: u32, size: u64, evicted_by: Option<u32>) -> bool {
        let mut members = self.members.write();
        let Some(node) = members.get(&id).map(|m| m.node.clone()) else {
            return false;
        };
        let now = Instant::now();
        let chosen = self.place_one(&members, size, (&node, evicted_by), (&[], &[]), now);
        if chosen != Some(id) {
            return false;
        }
        self.placed_on(&mut members, id, size);
        true
    }

    fn placed_on(&self, members: &mut HashMap<u32, Member>, id: u32, size: u64) {
        let m = members.get_mut(&id).expect("just chosen");
        m.placed += size;
        m.load += size as f64 / m.stats.capacity.max(1) as f64;
        m.placed_since += 1;
        self.placed_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a daemon still warming up has had its share of the copies
    /// placed since it joined (see `WARMUP`).
    fn had_its_share(m: &Member, alive: usize, total: u64, now: Instant) -> bool {
        let age = now.duration_since(m.joined);
        if age >= WARMUP {
            return false;
        }
        let since = total.saturating_sub(m.placed_before);
        let fair = 1.0 / alive.max(1) as f64;
        let share = fair * (age.as_secs_f64() / WARMUP.as_secs_f64()).max(0.25);
        m.placed_since as f64 >= (since as f64 * share).max(1.0)
    }

    /// Where one more copy of a block already on `copies` goes: as
    /// `place_copies` puts a next copy, on a host none of them is on, and
    /// on a daemon `allow` (given its id and capacity) takes.
    pub fn place_beside(
        &self,
        size: u64,
        copies: &Copies,
        allow: &dyn Fn(u32, u64) -> bool,
    ) -> Option<u32> {
        let mut members = self.members.write();
        let taken: Vec<String> = copies
            .iter()
            .filter_map(|d| members.get(&d).map(|m| m.node.clone()))
            .collect();
        let barred: Vec<u32> = members
            .iter()
            .filter(|(id, m)| !allow(**id, m.stats.capacity))
            .map(|(id, _)| *id)
            .collect();
        let id = self.place_one(
            &members,
            size,
            ("", None),
            (&taken, &barred),
            Instant::now(),
        )?;
        self.placed_on(&mut members, id, size);
        Some(id)
    }

    /// One daemon for a copy, on none of the hosts in `taken`. The writer's
    /// own daemon is always open to it, then the daemon that evicted the
    /// block (`back`); a daemon warming up that has had its share is
    /// passed over while another can take the block.
    fn place_one(
        &self,
        members: &HashMap<u32, Member>,
        size: u64,
        (node, back): (&str, Option<u32>),
        (taken, barred): (&[String], &[u32]),
        now: Instant,
    ) -> Option<u32> {
        let alive = members.values().filter(|m| m.alive).count();
        let total = self.placed_total.load(Ordering::Relaxed);
        let settled = |m: &Member| !Self::had_its_share(m, alive, total, now);
        let room = |m: &Member| {
            i128::from(m.stats.capacity) - i128::from(m.stats.used) - i128::from(m.placed)
        };
        let roomy = |m: &Member| {
            room(m) >= i128::from(size) + (m.stats.capacity as f64 * FULL_MARGIN) as i128
        };
        let open = |m: &Member| {
            m.alive && !m.draining && m.stats.capacity >= size && !taken.contains(&m.node)
        };
        let local = members
            .iter()
            .filter(|(id, m)| {
                open(m) && !barred.contains(id) && !node.is_empty() && m.node == node && roomy(m)
            })
            .max_by_key(|(id, m)| (room(m), std::cmp::Reverse(**id)))
            .map(|(id, _)| *id);
        let roomiest = |eligible: &dyn Fn(&Member) -> bool| {
            members
                .iter()
                .filter(|(id, m)| open(m) && !barred.contains(id) && roomy(m) && eligible(m))
                .max_by_key(|(id, m)| (room(m), std::cmp::Reverse(**id)))
                .map(|(id, _)| *id)
        };
        let least_loaded = |eligible: &dyn Fn(&Member) -> bool| {
            members
                .iter()
                .filter(|(id, m)| open(m) && !barred.contains(id) && eligible(m))
                .min_by(|(a, x), (b, y)| x.load.total_cmp(&y.load).then(a.cmp(b)))
                .map(|(id, _)| *id)
        };
        let any = |_: &Member| true;
        let back = back.filter(|id| {
            let full = || roomiest(&any).is_none();
            !barred.contains(id)
                && members
                    .get(id)
                    .is_some_and(|m| open(m) && (roomy(m) || full()))
        });
        local
            .or(back)
            .or_else(|| roomiest(&settled))
            .or_else(|| least_loaded(&settled))
            .or_else(|| roomiest(&any))
            .or_else(|| least_loaded(&any))
    }

    /// Largest pool among live daemons: no block larger can be placed.
    pub fn largest_capacity(&self) -> u64 {
        self.members
            .read()
            .values()
            .filter(|m| m.alive)
            .map(|m| m.stats.capacity)
            .max()
            .unwrap_or(0)
    }

    pub fn addrs(&self, ids: impl IntoIterator<Item = u32>) -> Vec<DaemonAddr> {
        // A chain's blocks sit on a few daemons: keep each id once as it
        // comes rather than collect, sort and dedup one per block.
        let mut unique: Vec<u32> = Vec::new();
        for id in ids {
            if !unique.contains(&id) {
                unique.push(id);
            }
        }
        unique.sort_unstable();
        let ids = unique;
        let members = self.members.read();
        ids.into_iter()
            .filter_map(|id| {
                members.get(&id).map(|m| DaemonAddr {
                    id,
                    node: m.node.clone(),
                    addr: m.addr.clone(),
                    endpoints: m.endpoints.clone(),
                })
            })
            .collect()
    }

    /// Whether a daemon is draining (its copies do not count toward the
    /// copies a block wants).
    pub fn is_draining(&self, id: u32) -> bool {
        self.members.read().get(&id).is_some_and(|m| m.draining)
    }

    /// Marks a daemon draining (no new placements) or not; `false` if
    /// there is no such daemon.
    pub fn set_draining(&self, id: u32, draining: bool) -> bool {
        match self.members.write().get_mut(&id) {
            Some(m) => {
                m.draining = draining;
                true
            }
            None => false,
        }
    }

    /// The live daemons by host (`node`), sorted by name, for `route`.
    pub fn hosts(&self) -> Vec<Host> {
        let members = self.members.read();
        let mut hosts: Vec<Host> = Vec::new();
        for (id, m) in members.iter().filter(|(_, m)| m.alive) {
            let at = match hosts.iter().position(|h| h.node == m.node) {
                Some(i) => i,
                None => {
                    hosts.push(Host {
                        node: m.node.clone(),
                        ..Host::default()
                    });
                    hosts.len() - 1
                }
            };
            let h = &mut hosts[at];
            h.daemons.push(*id);
            h.reads_per_sec += m.reads_per_sec;
            h.used += m.stats.used;
            h.capacity += m.stats.capacity;
        }
        hosts.sort_by(|a, b| a.node.cmp(&b.node));
        hosts
    }

    pub fn infos(&self) -> Vec<DaemonInfo> {
        let members = self.members.read();
        let mut out: Vec<DaemonInfo> = members
            .iter()
            .map(|(id, m)| DaemonInfo {
                id: *id,
                node: m.node.clone(),
                addr: m.addr.clone(),
                alive: m.alive,
                draining: m.draining,
                capacity: m.stats.capacity,
                used: m.stats.used,
                blocks: m.stats.blocks,
                hits: m.stats.hits,
                misses: m.stats.misses,
                endpoints: m.endpoints.clone(),
            })
            .collect();
        out.sort_by_key(|d| d.id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(node: &str, addr: &str, capacity: u64, id_hint: u32) -> RegisterRequest {
        RegisterRequest {
            node: node.into(),
            addr: addr.into(),
            capacity,
            id_hint,
            endpoints: vec![],
            requires_auth: false,
        }
    }

    /// Three daemons of 100 bytes, on hosts n0, n1 and n2.
    fn three(d: &Daemons, t: Instant) -> Vec<u32> {
        ["a:1", "b:1", "c:1"]
            .iter()
            .enumerate()
            .map(|(i, addr)| d.register(req(&format!("n{i}"), addr, 100, 0), t))
            .collect()
    }

    /// What a daemon of 100 bytes with `used` of them in use reports.
    fn used(used: u64) -> PoolStats {
        PoolStats {
            capacity: 100,
            used,
            ..Default::default()
        }
    }

    #[test]
    fn a_block_is_admitted_on_its_writers_daemon_only_where_a_put_would_place_it() {
        let d = Daemons::default();
        let t = Instant::now();
        let ids = three(&d, t);
        for id in &ids {
            d.heartbeat(*id, used(0), t);
        }
        assert!(d.admit_on(ids[0], 10, None), "its host's daemon, with room");
        assert!(!d.admit_on(99, 10, None), "no such daemon");
        // Full while others have room: a put would go elsewhere.
        d.heartbeat(ids[0], used(95), t);
        assert!(!d.admit_on(ids[0], 10, None));
        // Unless it is the daemon that evicted the block, and all are full.
        for id in &ids[1..] {
            d.heartbeat(*id, used(95), t);
        }
        assert!(d.admit_on(ids[0], 10, Some(ids[0])));
        // A draining daemon takes nothing.
        d.heartbeat(ids[1], used(0), t);
        assert!(d.set_draining(ids[1], true));
        assert!(!d.admit_on(ids[1], 10, None));
    }

    #[test]
    fn an_id_from_an_earlier_leader_is_kept_unless_taken() {
        let d = Daemons::default();
        let t = Instant::now();
        assert_eq!(d.register(req("n", "a:1", 1, 7), t), 7);
        assert_eq!(d.register(req("n", "b:1", 1, 7), t), 8, "7 is taken");
        assert_eq!(d.register(req("n", "c:1", 1, 0), t), 9);
    }

    #[test]
    fn placement_prefers_free_space_and_skips_the_dead() {
        let d = Daemons::default();
        let t = Instant::now();
        let a = d.register(req("n1", "a:1", 100, 0), t);
        let b = d.register(req("n2", "b:1", 100, 0), t);
        d.heartbeat(
            a,
            PoolStats {
                capacity: 100,
                used: 90,
                ..Default::default()
            },
            t,
        );
        assert_eq!(d.place(5, ""), Some(b));
        assert!(d
            .expire(Duration::from_secs(1), t + Duration::from_secs(2))
            .contains(&b));
        assert_eq!(d.place(5, ""), None, "a lacks no room but was also silent");
        assert!(
            d.heartbeat(b, PoolStats::default(), t).is_none(),
            "dead daemons must re-register"
        );
        assert_eq!(
            d.register(req("n2", "b:1", 100, 0), t),
            b,
            "same address, same id"
        );
        assert_eq!(d.place(500, ""), None, "too large for every pool");
    }

    #[test]
    fn a_draining_daemon_gets_no_new_blocks() {
        let d = Daemons::default();
        let t = Instant::now();
        let a = d.register(req("n1", "a:1", 100, 0), t);
        let b = d.register(req("n2", "b:1", 100, 0), t);
        assert!(d.set_draining(a, true));
        assert!((0..5).all(|_| d.place(1, "") == Some(b)));
        assert!(!d.set_draining(99, true));
        assert!(d.infos().iter().any(|i| i.id == a && i.draining));
    }

    #[test]
    fn the_writers_own_host_comes_first_while_it_has_room() {
        let d = Daemons::default();
        let t = Instant::now();
        let here = d.register(req("gpu-1", "a:1", 100, 0), t);
        let there = d.register(req("gpu-2", "b:1", 1000, 0), t);
        assert_eq!(
            d.place(40, "gpu-1"),
            Some(here),
            "local, though the other is emptier"
        );
        assert_eq!(d.place(40, "gpu-1"), Some(here));
        assert_eq!(
            d.place(40, "gpu-1"),
            Some(there),
            "local is out of free room"
        );
        assert_eq!(
            d.place(40, ""),
            Some(there),
            "unknown writer: most free room"
        );
    }

    #[test]
    fn placements_spread_between_heartbeats() {
        let d = Daemons::default();
        let t = Instant::now();
        let a = d.register(req("n1", "a:1", 100, 0), t);
        let b = d.register(req("n2", "b:1", 100, 0), t);
        let picks: Vec<u32> = (0..4).map(|_| d.place(30, "").unwrap()).collect();
        assert!(picks.contains(&a) && picks.contains(&b), "{picks:?}");
    }

    #[test]
    fn full_daemons_still_share_new_blocks_whatever_their_last_free_bytes() {
        // Three pools filled to the brim (daemons evict only what a put
        // needs, so a busy cluster is always full): new blocks go round.
        let d = Daemons::default();
        let t = Instant::now();
        let ids = three(&d, t);
        for (id, bytes) in ids.iter().zip([100, 99, 97]) {
            d.heartbeat(*id, used(bytes), t);
        }
        let picks: Vec<u32> = (0..6).map(|_| d.place(10, "").unwrap()).collect();
        for id in &ids {
            assert_eq!(picks.iter().filter(|p| *p == id).count(), 2, "{picks:?}");
        }
    }

    #[test]
    fn a_full_daemon_that_reports_after_every_eviction_takes_only_its_share() {
        // Daemons report at once when they evict, so in a full cluster the
        // daemon that took the last block reports before the next one
        // comes. Placed by what each was given since its last report, it
        // would take every block; it takes its turn.
        let d = Daemons::default();
        let t = Instant::now();
        let ids = three(&d, t);
        let full = used(100);
        for id in &ids {
            d.heartbeat(*id, full, t);
        }
        let mut picks = Vec::new();
        for _ in 0..30 {
            let id = d.place(10, "").unwrap();
            d.heartbeat(id, full, t);
            picks.push(id);
        }
        for id in &ids {
            assert_eq!(picks.iter().filter(|p| *p == id).count(), 10, "{picks:?}");
        }
        // One that joins later starts level with the least loaded: it
        // takes its turn, not every block until it has caught up.
        let late = d.register(req("n3", "d:1", 100, 0), t);
        d.heartbeat(late, full, t);
        let t = t + WARMUP;
        for id in ids.iter().chain([&late]) {
            d.heartbeat(*id, full, t);
        }
        let picks: Vec<u32> = (0..8).map(|_| d.place(10, "").unwrap()).collect();
        assert_eq!(picks.iter().filter(|p| **p == late).count(), 2, "{picks:?}");
    }

    #[test]
    fn a_block_stored_again_goes_back_to_the_daemon_that_evicted_it() {
        let d = Daemons::default();
        let t = Instant::now();
        let ids = three(&d, t);
        let fill = |id: u32, bytes: u64| d.heartbeat(id, used(bytes), t);
        for id in &ids {
            fill(*id, 100);
        }
        let back = ids[1];
        for _ in 0..4 {
            let copies = d.place_copies(10, "", 1, Some(back));
            assert_eq!(
                copies.first(),
                Some(back),
                "every pool full: back where it was"
            );
        }
        let two = d.place_copies(10, "", 2, Some(back));
        assert_eq!(two.first(), Some(back));
        assert_eq!(two.len(), 2, "its other copy elsewhere");

        fill(ids[2], 0);
        assert_eq!(
            d.place_copies(10, "", 1, Some(back)).first(),
            Some(ids[2]),
            "a daemon with room to spare takes it without evicting"
        );
        fill(ids[2], 100);
        assert_eq!(
            d.place_copies(10, "n0", 1, Some(back)).first(),
            Some(back),
            "the writer's own daemon, full, does not keep it from going back"
        );
        d.set_draining(back, true);
        assert_ne!(
            d.place_copies(10, "", 1, Some(back)).first(),
            Some(back),
            "draining"
        );
        d.set_draining(back, false);
        d.expire(Duration::ZERO, t + Duration::from_secs(1));
        assert_eq!(
            d.place_copies(10, "", 1, Some(back)).first(),
            None,
            "all dead"
        );
    }

    #[test]
    fn copies_go_to_distinct_hosts_the_writers_first() {
        let d = Daemons::default();
        let t = Instant::now();
        // Two daemons on gpu-1, one each on gpu-2 and gpu-3.
        let a = d.register(req("gpu-1", "a:1", 100, 0), t);
        let b = d.register(req("gpu-1", "b:1", 1000, 0), t);
        let c = d.register(req("gpu-2", "c:1", 100, 0), t);
        let e = d.register(req("gpu-3", "e:1", 100, 0), t);
        let three = d.place_copies(10, "gpu-2", 3, None);
        assert_eq!(three.len(), 3);
        assert_eq!(three.first(), Some(c), "the writer's host first");
        assert!(
            !(three.contains(a) && three.contains(b)),
            "two daemons of one host are one copy: {three:?}"
        );
        assert!(three.contains(e));
        assert_eq!(
            d.place_copies(10, "", 4, None).len(),
            3,
            "three hosts, three copies"
        );
        assert!(d.set_draining(e, true));
        assert_eq!(
            d.place_copies(10, "", 3, None).len(),
            2,
            "a draining host takes none"
        );
    }

    #[test]
    fn a_daemon_that_just_joined_takes_a_bounded_share_then_its_fair_share() {
        let d = Daemons::default();
        let t = Instant::now() - WARMUP;
        let old: Vec<u32> = (0..3)
            .map(|i| d.register(req(&format!("n{i}"), &format!("a:{i}"), 1000, 0), t))
            .collect();
        for id in &old {
            // Busy pools are full: daemons evict only what a put needs.
            let full = PoolStats {
                capacity: 1000,
                used: 990,
                ..Default::default()
            };
            d.heartbeat(*id, full, Instant::now());
        }
        // Back empty, just now: the most room by far.
        let young = d.register(req("n3", "a:3", 1000, 0), Instant::now());
        let picks: Vec<u32> = (0..400).map(|_| d.place(1, "").unwrap()).collect();
        let share = picks.iter().filter(|p| **p == young).count() as f64 / 400.0;
        // A quarter of a fair share (1/4) at first, not all of them.
        assert!((0.05..=0.1).contains(&share), "new daemon's share {share}");
        // Its own host's writers still write to it.
        assert_eq!(d.place(1, "n3"), Some(young));
        // Past its warm-up it is a daemon like any: the roomiest wins.
        let mut members = d.members.write();
        members.get_mut(&young).unwrap().joined = Instant::now() - WARMUP;
        drop(members);
        assert!((0..20).all(|_| d.place(1, "") == Some(young)));
    }

    proptest::proptest! {
        /// Against a model: copies land on distinct, open hosts that fit the
        /// block, as many as asked where enough hosts can take one, the
        /// writer's own host first when it has room.
        #[test]
        fn placement_of_copies_follows_the_rules(
            daemons in proptest::collection::vec((0u8..4, 1u64..200, 0u64..200, proptest::bool::ANY), 1..8),
            size in 1u64..150,
            writer in 0u8..5,
            asked in 1usize..5,
        ) {
            let d = Daemons::default();
            let t = Instant::now();
            let mut open_hosts = std::collections::HashSet::new();
            let mut roomy_writer = false;
            for (i, (host, capacity, used, draining)) in daemons.iter().enumerate() {
                let id = d.register(req(&format!("h{host}"), &format!("a:{i}"), *capacity, 0), t);
                let stats = PoolStats { capacity: *capacity, used: (*used).min(*capacity), ..Default::default() };
                d.heartbeat(id, stats, t);
                d.set_draining(id, *draining);
                if !draining && *capacity >= size {
                    open_hosts.insert(*host);
                    let room = capacity - stats.used;
                    roomy_writer |= *host == writer
                        && room as f64 >= size as f64 + *capacity as f64 * FULL_MARGIN;
                }
            }
            let node = format!("h{writer}");
            let copies = d.place_copies(size, &node, asked, None);
            let infos = d.infos();
            let info = |id: u32| infos.iter().find(|i| i.id == id).unwrap().clone();
            proptest::prop_assert_eq!(copies.len(), asked.min(open_hosts.len()));
            let mut seen = std::collections::HashSet::new();
            for id in copies.iter() {
                let i = info(id);
                proptest::prop_assert!(!i.draining && i.capacity >= size);
                proptest::prop_assert!(seen.insert(i.node.clone()), "one copy per host");
            }
            if roomy_writer {
                proptest::prop_assert_eq!(info(copies.first().unwrap()).node, node);
            }
        }
    }
}
