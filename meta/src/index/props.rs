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
        daemon: u32,
        size: u32,
    },
    Commit {
        ns: u8,
        h: u8,
        daemon: u32,
        stored: bool,
        size: u32,
    },
    Report {
        ns: u8,
        h: u8,
        daemon: u32,
        size: u32,
    },
    Remove {
        ns: u8,
        h: u8,
    },
    RemoveAt {
        ns: u8,
        h: u8,
        daemon: u32,
    },
    DaemonDied {
        daemon: u32,
    },
    /// Expires reservations made more than `age` steps ago.
    Expire {
        age: u64,
    },
    /// Frees namespaces no entry uses.
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    let (ns, h, d, size) = (0u8..3, 0u8..12, 1u32..4, 1u32..1000);
    prop_oneof![
        (ns.clone(), h.clone(), d.clone(), size.clone()).prop_map(|(ns, h, daemon, size)| {
            Op::Reserve {
                ns,
                h,
                daemon,
                size,
            }
        }),
        (
            ns.clone(),
            h.clone(),
            d.clone(),
            any::<bool>(),
            size.clone()
        )
            .prop_map(|(ns, h, daemon, stored, size)| Op::Commit {
                ns,
                h,
                daemon,
                stored,
                size
            }),
        (ns.clone(), h.clone(), d.clone(), size).prop_map(|(ns, h, daemon, size)| Op::Report {
            ns,
            h,
            daemon,
            size
        }),
        (ns.clone(), h.clone()).prop_map(|(ns, h)| Op::Remove { ns, h }),
        (ns, h, d.clone()).prop_map(|(ns, h, daemon)| Op::RemoveAt { ns, h, daemon }),
        d.prop_map(|daemon| Op::DaemonDied { daemon }),
        (0u64..40).prop_map(|age| Op::Expire { age }),
        Just(Op::Sweep),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Model {
    daemon: u32,
    size: u32,
    visible: bool,
    /// The step of the reservation, while pending.
    since: u64,
    /// Who reserved it, while pending.
    client: u8,
    /// Evicted by its daemon while pending.
    evicted: bool,
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_index_holds_what_a_plain_map_holds(ops in proptest::collection::vec(op(), 1..150)) {
        let index = Index::new();
        let mut model: HashMap<(u8, u8), Model> = HashMap::new();
        let t0 = Instant::now();
        let at = |step: u64| t0 + std::time::Duration::from_millis(step);
        for (step, op) in ops.into_iter().enumerate() {
            let step = step as u64;
            match op {
                Op::Reserve { ns, h, daemon, size } => {
                    // Clients take turns, apart from daemons.
                    let client = (step % 3) as u8;
                    let r = index.reserve(&name(ns), hash(h), (size, daemon), client_of(client), at(step));
                    let exists = model.contains_key(&(ns, h));
                    prop_assert_eq!(r == Reservation::Exists, exists);
                    if !exists {
                        model.insert((ns, h), Model { daemon, size, visible: false, since: step, client, evicted: false });
                    }
                }
                Op::Commit { ns, h, daemon, stored, size } => {
                    let item = CommitItem { hash: hash(h), daemon, size, checksum: 7, stored };
                    let code = index.commit(&name(ns), &item);
                    match model.get(&(ns, h)).copied() {
                        Some(m) if !m.visible && m.daemon == daemon => {
                            prop_assert_eq!(code, ErrorCode::Ok);
                            if stored && !m.evicted {
                                model.insert((ns, h), Model { daemon, size, visible: true, since: 0, client: 0, evicted: false });
                            } else {
                                model.remove(&(ns, h));
                            }
                        }
                        // Another writer's reservation stays, and says so.
                        Some(m) if !m.visible => prop_assert_eq!(code, ErrorCode::NoReservation),
                        _ if !stored => prop_assert_eq!(code, ErrorCode::Ok),
                        _ => prop_assert_eq!(code, ErrorCode::NoReservation),
                    }
                }
                Op::Report { ns, h, daemon, size } => {
                    index.insert_visible(&BlockKey::new(name(ns), hash(h)), daemon, size, 7);
                    model.insert((ns, h), Model { daemon, size, visible: true, since: 0, client: 0, evicted: false });
                }
                Op::Remove { ns, h } => {
                    let got = index.remove(&name(ns), &[hash(h)]);
                    let want = model.get(&(ns, h)).filter(|m| m.visible).map(|m| m.daemon);
                    prop_assert_eq!(got, vec![want]);
                    if want.is_some() {
                        model.remove(&(ns, h));
                    }
                }
                Op::RemoveAt { ns, h, daemon } => {
                    let removed = index.remove_at(&BlockKey::new(name(ns), hash(h)), daemon);
                    let want = model.get(&(ns, h)).is_some_and(|m| m.daemon == daemon);
                    prop_assert_eq!(removed, want);
                    match model.get_mut(&(ns, h)) {
                        Some(m) if want && !m.visible => m.evicted = true,
                        _ if want => {
                            model.remove(&(ns, h));
                        }
                        _ => {}
                    }
                }
                Op::DaemonDied { daemon } => {
                    let gone = index.remove_daemon(daemon);
                    let before = model.len();
                    model.retain(|_, m| m.daemon != daemon);
                    prop_assert_eq!(gone, before - model.len());
                }
                Op::Expire { age } => {
                    let deadline = step.saturating_sub(age);
                    let mut got: Vec<(BlockKey, u32)> = index.expire_pending(at(deadline));
                    let mut want: Vec<(BlockKey, u32)> = model
                        .iter()
                        .filter(|(_, m)| !m.visible && m.since < deadline)
                        .map(|((ns, h), m)| (BlockKey::new(name(*ns), hash(*h)), m.daemon))
                        .collect();
                    got.sort_by_key(|(k, d)| (k.to_string(), *d));
                    want.sort_by_key(|(k, d)| (k.to_string(), *d));
                    prop_assert_eq!(got, want);
                    model.retain(|_, m| m.visible || m.since >= deadline);
                }
                Op::Sweep => {
                    index.sweep_namespaces();
                    let used: std::collections::HashSet<u8> = model.keys().map(|(ns, _)| *ns).collect();
                    prop_assert_eq!(index.namespaces(), used.len(), "exactly the namespaces in use stay");
                }
            }
            // Every key, and a chain per namespace, read as the model says.
            for ns in 0..3u8 {
                let hashes: Vec<BlockHash> = (0..12).map(hash).collect();
                let want: Vec<Option<(u32, u32)>> = (0..12u8)
                    .map(|h| model.get(&(ns, h)).filter(|m| m.visible).map(|m| (m.daemon, m.size)))
                    .collect();
                let got: Vec<Option<(u32, u32)>> = index
                    .lookup(&name(ns), &hashes)
                    .into_iter()
                    .map(|l| l.map(|l| (l.daemon, l.size)))
                    .collect();
                prop_assert_eq!(&got, &want);
                let prefix = want.iter().take_while(|w| w.is_some()).count();
                prop_assert_eq!(index.match_prefix(&name(ns), &hashes).len(), prefix);
            }
            let st = index.stats();
            prop_assert_eq!(st.visible as usize, model.values().filter(|m| m.visible).count());
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
