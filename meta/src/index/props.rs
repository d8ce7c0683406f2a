//! The index against a plain map of what it should hold, under any sequence
//! of reservations, commits, removals and daemon deaths.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        ns: u8,
        h: u8,
        daemons: Vec<u32>,
        size: u32,
    },
    Commit {
        ns: u8,
        h: u8,
        /// Empty: not stored.
        stored_on: Vec<u32>,
        size: u32,
    },
    Report {
        ns: u8,
        h: u8,
        daemon: u32,
        size: u32,
        checksum: u64,
        nvme: bool,
    },
    /// A daemon's copy demoted to NVMe, or promoted back to DRAM.
    Tier {
        ns: u8,
        h: u8,
        daemon: u32,
        nvme: bool,
    },
    Remove {
        ns: u8,
        h: u8,
    },
    /// A copy made again (repair, or for a hot block) reported back.
    AddCopy {
        ns: u8,
        h: u8,
        daemon: u32,
        size: u32,
        checksum: u64,
    },
    /// A block turned hot (more copies wanted), or cooled (back to `want`).
    Want {
        ns: u8,
        h: u8,
        want: u8,
        raise: bool,
    },
    RemoveAt {
        ns: u8,
        h: u8,
        daemon: u32,
    },
    DaemonDied {
        daemon: u32,
    },
    /// A daemon drained (its copies no longer count toward a block's
    /// wanted copies), or taken back.
    Drain {
        daemon: u32,
        on: bool,
    },
    /// Expires reservations made more than `age` steps ago.
    Expire {
        age: u64,
    },
    /// Frees namespaces no entry uses.
    Sweep,
}

/// Distinct daemons among 1..=5, in the order drawn.
fn daemons(min: usize) -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(1u32..6, min..5).prop_map(|ds| {
        let mut out: Vec<u32> = Vec::new();
        for d in ds {
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out
    })
}

fn op() -> impl Strategy<Value = Op> {
    let (ns, h, d, size) = (0u8..3, 0u8..12, 1u32..6, 1u32..1000);
    prop_oneof![
        (ns.clone(), h.clone(), daemons(1), size.clone()).prop_map(|(ns, h, daemons, size)| {
            Op::Reserve {
                ns,
                h,
                daemons,
                size,
            }
        }),
        (ns.clone(), h.clone(), daemons(0), size.clone()).prop_map(|(ns, h, stored_on, size)| {
            Op::Commit {
                ns,
                h,
                stored_on,
                size,
            }
        }),
        (
            ns.clone(),
            h.clone(),
            d.clone(),
            size.clone(),
            7u64..9,
            any::<bool>()
        )
            .prop_map(|(ns, h, daemon, size, checksum, nvme)| Op::Report {
                ns,
                h,
                daemon,
                size,
                checksum,
                nvme
            }),
        (ns.clone(), h.clone(), d.clone(), any::<bool>()).prop_map(|(ns, h, daemon, nvme)| {
            Op::Tier {
                ns,
                h,
                daemon,
                nvme,
            }
        }),
        (ns.clone(), h.clone()).prop_map(|(ns, h)| Op::Remove { ns, h }),
        (ns.clone(), h.clone(), d.clone(), size.clone(), 7u64..9).prop_map(
            |(ns, h, daemon, size, checksum)| Op::AddCopy {
                ns,
                h,
                daemon,
                size,
                checksum
            }
        ),
        (ns.clone(), h.clone(), 1u8..5, any::<bool>()).prop_map(|(ns, h, want, raise)| Op::Want {
            ns,
            h,
            want,
            raise
        }),
        (ns, h, d.clone()).prop_map(|(ns, h, daemon)| Op::RemoveAt { ns, h, daemon }),
        d.clone().prop_map(|daemon| Op::DaemonDied { daemon }),
        (d, any::<bool>()).prop_map(|(daemon, on)| Op::Drain { daemon, on }),
        (0u64..40).prop_map(|age| Op::Expire { age }),
        Just(Op::Sweep),
    ]
}

#[derive(Debug, Clone)]
struct Model {
    copies: Vec<u32>,
    /// The copies on NVMe only.
    nvme: Vec<u32>,
    want: u8,
    size: u32,
    checksum: u64,
    visible: bool,
    /// The step of the reservation, while pending.
    since: u64,
    /// Who reserved it, while pending.
    client: u8,
    /// A copy was evicted while pending.
    evicted: bool,
}

impl Model {
    fn visible(copies: Vec<u32>, want: u8, size: u32, checksum: u64) -> Self {
        Model {
            copies,
            nvme: Vec::new(),
            want,
            size,
            checksum,
            visible: true,
            since: 0,
            client: 0,
            evicted: false,
        }
    }

    fn short(&self) -> bool {
        self.visible && !self.copies.is_empty() && self.copies.len() < usize::from(self.want)
    }

    /// Visible, with room for another copy, and fewer copies than wanted
    /// on daemons not `draining`.
    fn wants_copy(&self, draining: &[u32]) -> bool {
        let staying = self.copies.iter().filter(|d| !draining.contains(d)).count();
        self.visible
            && !self.copies.is_empty()
            && self.copies.len() < MAX_COPIES
            && staying < usize::from(self.want)
    }

    /// Its copies, each in its tier.
    fn located(&self) -> Copies {
        let mut c = set(&self.copies);
        for d in &self.nvme {
            c.set_tier(*d, Tier::Nvme);
        }
        c
    }

    fn set_tier(&mut self, daemon: u32, nvme: bool) -> bool {
        let was = self.nvme.contains(&daemon);
        if !self.copies.contains(&daemon) || was == nvme {
            return false;
        }
        if nvme {
            self.nvme.push(daemon);
        } else {
            self.nvme.retain(|d| *d != daemon);
        }
        true
    }
}

fn client_of(i: u8) -> Client {
    Client::of([10, 0, 0, i].into())
}

fn name(i: u8) -> Namespace {
    Namespace::new(format!("ns{i}")).unwrap()
}

fn hash(i: u8) -> BlockHash {
    BlockHash::from_opaque(&[i])
}

fn set(ds: &[u32]) -> Copies {
    ds.iter().copied().collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_index_holds_what_a_plain_map_holds(ops in proptest::collection::vec(op(), 1..150)) {
        let index = Index::new();
        let mut model: HashMap<(u8, u8), Model> = HashMap::new();
        let mut draining: Vec<u32> = Vec::new();
        let t0 = Instant::now();
        let at = |step: u64| t0 + std::time::Duration::from_millis(step);
        for (step, op) in ops.into_iter().enumerate() {
            let step = step as u64;
            match op {
                Op::Reserve { ns, h, daemons, size } => {
                    // Clients take turns, apart from daemons.
                    let client = (step % 3) as u8;
                    let want = daemons.len() as u8;
                    let r = index.reserve(&name(ns), hash(h), (size, set(&daemons), want), client_of(client), at(step));
                    let exists = model.contains_key(&(ns, h));
                    prop_assert_eq!(r == Reservation::Exists, exists);
                    if !exists {
                        let m = Model { copies: daemons, nvme: Vec::new(), want, size, checksum: 0, visible: false, since: step, client, evicted: false };
                        model.insert((ns, h), m);
                    }
                }
                Op::Commit { ns, h, stored_on, size } => {
                    let item = CommitItem { hash: hash(h), stored_on: set(&stored_on), size, checksum: 7, parent: None, tag: None };
                    let code = index.commit(&name(ns), &item);
                    match model.get(&(ns, h)).cloned() {
                        Some(m) if !m.visible => {
                            let kept: Vec<u32> = stored_on.iter().copied().filter(|d| m.copies.contains(d)).collect();
                            if !stored_on.is_empty() && kept.is_empty() && !m.evicted {
                                // Another writer's reservation stays, and says so.
                                prop_assert_eq!(code, ErrorCode::NoReservation);
                            } else {
                                prop_assert_eq!(code, ErrorCode::Ok);
                                if kept.is_empty() {
                                    model.remove(&(ns, h));
                                } else {
                                    model.insert((ns, h), Model::visible(kept, m.want, size, 7));
                                }
                            }
                        }
                        _ if stored_on.is_empty() => prop_assert_eq!(code, ErrorCode::Ok),
                        _ => prop_assert_eq!(code, ErrorCode::NoReservation),
                    }
                }
                Op::Report { ns, h, daemon, size, checksum, nvme } => {
                    let tier = if nvme { Tier::Nvme } else { Tier::Dram };
                    index.insert_visible(&BlockKey::new(name(ns), hash(h)), (daemon, tier), (size, checksum), None);
                    match model.get_mut(&(ns, h)) {
                        Some(m) if m.visible && m.size == size && m.checksum == checksum => {
                            if !m.copies.contains(&daemon) && m.copies.len() < MAX_COPIES {
                                m.copies.push(daemon);
                            }
                            m.set_tier(daemon, nvme);
                            m.want = m.want.max(m.copies.len() as u8);
                        }
                        _ => {
                            let mut m = Model::visible(vec![daemon], 1, size, checksum);
                            m.set_tier(daemon, nvme);
                            model.insert((ns, h), m);
                        }
                    }
                }
                Op::Tier { ns, h, daemon, nvme } => {
                    let tier = if nvme { Tier::Nvme } else { Tier::Dram };
                    let moved = index.set_tier(&BlockKey::new(name(ns), hash(h)), daemon, tier);
                    let want = model.get_mut(&(ns, h)).filter(|m| m.visible).is_some_and(|m| m.set_tier(daemon, nvme));
                    prop_assert_eq!(moved, want);
                }
                Op::AddCopy { ns, h, daemon, size, checksum } => {
                    let leaving = |d: u32| draining.contains(&d);
                    let added = index.add_copy(&BlockKey::new(name(ns), hash(h)), (daemon, size, checksum), &leaving);
                    let want = match model.get_mut(&(ns, h)) {
                        Some(m) if m.visible && m.size == size && m.checksum == checksum => {
                            if m.copies.contains(&daemon) {
                                true
                            } else if m.wants_copy(&draining) {
                                m.copies.push(daemon);
                                true
                            } else {
                                false
                            }
                        }
                        _ => false,
                    };
                    prop_assert_eq!(added, want);
                }
                Op::Want { ns, h, want, raise } => {
                    let key = BlockKey::new(name(ns), hash(h));
                    let m = model.get_mut(&(ns, h)).filter(|m| m.visible);
                    if raise {
                        let got = index.raise_want(&key, want);
                        let expect = m.and_then(|m| {
                            let before = m.want;
                            (before < want).then(|| {
                                m.want = want;
                                before
                            })
                        });
                        prop_assert_eq!(got, expect);
                    } else {
                        let got = index.lower_want(&key, want);
                        let mut extra = Vec::new();
                        if let Some(m) = m {
                            m.want = want.min(m.want);
                            while m.copies.len() > usize::from(want.max(1)) {
                                extra.push(m.copies.pop().unwrap());
                            }
                        }
                        prop_assert_eq!(got, set(&extra));
                    }
                }
                Op::Remove { ns, h } => {
                    let got = index.remove(&name(ns), &[hash(h)]);
                    let want = model.get(&(ns, h)).filter(|m| m.visible).map(Model::located);
                    prop_assert_eq!(got, vec![want]);
                    if want.is_some() {
                        model.remove(&(ns, h));
                    }
                }
                Op::RemoveAt { ns, h, daemon } => {
                    let removed = index.remove_at(&BlockKey::new(name(ns), hash(h)), daemon);
                    let want = model.get(&(ns, h)).is_some_and(|m| m.copies.contains(&daemon));
                    prop_assert_eq!(removed, want);
                    if let Some(m) = model.get_mut(&(ns, h)).filter(|_| want) {
                        m.copies.retain(|d| *d != daemon);
                        m.evicted |= !m.visible;
                        if m.visible && m.copies.is_empty() {
                            model.remove(&(ns, h));
                        }
                    }
                }
                Op::DaemonDied { daemon } => {
                    let gone = index.remove_daemon(daemon);
                    let (mut copies, before) = (0, model.len());
                    let mut short = Vec::new();
                    model.retain(|(ns, h), m| {
                        if !m.copies.contains(&daemon) {
                            return true;
                        }
                        copies += 1;
                        m.copies.retain(|d| *d != daemon);
                        m.evicted |= !m.visible;
                        if m.short() {
                            short.push(BlockKey::new(name(*ns), hash(*h)));
                        }
                        !m.copies.is_empty()
                    });
                    let mut got = gone.short.clone();
                    got.sort();
                    short.sort();
                    prop_assert_eq!((gone.copies, gone.blocks, got), (copies, before - model.len(), short));
                }
                Op::Drain { daemon, on } => {
                    draining.retain(|d| *d != daemon);
                    if on {
                        draining.push(daemon);
                        let mut got = index.keys_on(daemon);
                        let mut want: Vec<BlockKey> = model
                            .iter()
                            .filter(|(_, m)| m.visible && m.copies.contains(&daemon))
                            .map(|((ns, h), _)| BlockKey::new(name(*ns), hash(*h)))
                            .collect();
                        got.sort();
                        want.sort();
                        prop_assert_eq!(got, want, "the blocks a drain copies away");
                    }
                }
                Op::Expire { age } => {
                    let deadline = step.saturating_sub(age);
                    let mut got: Vec<(BlockKey, Copies)> = index.expire_pending(at(deadline));
                    let mut want: Vec<(BlockKey, Copies)> = model
                        .iter()
                        .filter(|(_, m)| !m.visible && m.since < deadline)
                        .map(|((ns, h), m)| (BlockKey::new(name(*ns), hash(*h)), set(&m.copies)))
                        .collect();
                    got.sort_by_key(|(k, _)| k.to_string());
                    want.sort_by_key(|(k, _)| k.to_string());
                    prop_assert_eq!(got, want);
                    model.retain(|_, m| m.visible || m.since >= deadline);
                }
                Op::Sweep => {
                    index.sweep_namespaces();
                    let used: std::collections::HashSet<u8> = model.keys().map(|(ns, _)| *ns).collect();
                    prop_assert_eq!(index.namespaces(), used.len(), "exactly the namespaces in use stay");
                }
            }
            // A copy that went leaves its tier behind.
            for m in model.values_mut() {
                let copies = m.copies.clone();
                m.nvme.retain(|d| copies.contains(d));
            }
            // Blocks short of copies (those of draining daemons not
            // counted), as the model says.
            let leaving = |d: u32| draining.contains(&d);
            for ((ns, h), m) in &model {
                let short = index.short_of_copies(&BlockKey::new(name(*ns), hash(*h)), &leaving);
                prop_assert_eq!(short.map(|(l, w)| (l.daemons, w)), m.wants_copy(&draining).then(|| (m.located(), m.want)));
            }
            // Every key, and a chain per namespace, read as the model says.
            for ns in 0..3u8 {
                let hashes: Vec<BlockHash> = (0..12).map(hash).collect();
                let want: Vec<Option<(Copies, u32, u64)>> = (0..12u8)
                    .map(|h| model.get(&(ns, h)).filter(|m| m.visible).map(|m| (m.located(), m.size, m.checksum)))
                    .collect();
                let got: Vec<Option<(Copies, u32, u64)>> = index
                    .lookup(&name(ns), &hashes)
                    .into_iter()
                    .map(|l| l.map(|l| (l.daemons, l.size, l.checksum)))
                    .collect();
                prop_assert_eq!(&got, &want);
                let prefix = want.iter().take_while(|w| w.is_some()).count();
                prop_assert_eq!(index.match_prefix(&name(ns), &hashes).len(), prefix);
            }
            let st = index.stats();
            prop_assert_eq!(st.visible as usize, model.values().filter(|m| m.visible).count());
            prop_assert_eq!(st.copies as usize, model.values().filter(|m| m.visible).map(|m| m.copies.len()).sum::<usize>());
            prop_assert_eq!(st.pending as usize, model.values().filter(|m| !m.visible).count());
            for c in 0..3u8 {
                let want = model.values().filter(|m| !m.visible && m.client == c).count();
                prop_assert_eq!(index.pending_of(client_of(c)) as usize, want, "client {}'s reservations", c);
            }
            prop_assert_eq!(
                st.bytes,
                model.values().filter(|m| m.visible).map(|m| m.size as u64).sum::<u64>()
            );
        }
    }
}
