//! Store events for routers: every block that becomes visible in the index
//! or leaves it, published in vLLM's KV-event format (`wire`) over ZeroMQ
//! (`publisher`), so that a consumer of vLLM's events (a KV-aware router)
//! reads ours unchanged. `docs/events.md` is the user's side of this.
//!
//! The index emits a change while it holds the lock of the entry it
//! changed, so that the changes of one key are queued in the order they
//! happened. The queue is bounded and never waited on: when it is full the
//! change is dropped and counted, and the publisher resynchronizes its
//! subscribers (`AllBlocksCleared`, then every visible block). A slow
//! publisher never slows a put, and a subscriber never keeps a wrong
//! picture.
//!
//! Changes carry the generation they were made in; a resync starts a new
//! generation and the changes of the old one still queued are skipped:
//! the snapshot, read after the new generation began, already holds them
//! (and one that came after a dropped change would undo it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_proto::message::{EngineHash, EngineTag, KeepTags, Tier};
use mooncake_proto::{BlockHash, Namespace};
use parking_lot::RwLock;
use prometheus::IntCounter;
use tokio::sync::mpsc;

pub mod mooncake;
mod publisher;
mod wire;

pub use publisher::{run, Format, Snapshot, Sockets};
pub use wire::{decode_batch, medium, store_hash, Event};

/// A copy the index holds, as a resync republishes it: (daemon, tier),
/// namespace, block hash, and what events say of it beside its key.
pub type Held = ((u32, Tier), Namespace, BlockHash, Named);

/// What store events say of a visible block beside its key, kept by the
/// index while events are on (and only for blocks that have any of it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Named {
    /// The block it extends, as its writer named it.
    pub parent: Option<BlockHash>,
    /// What the engine calls it (its hash, its tokens), as its writer
    /// attached it.
    pub tag: Option<Arc<EngineTag>>,
    /// What the engine calls its parent: the parent's tag's hash when the
    /// block became visible.
    pub parent_hash: Option<EngineHash>,
}

impl Named {
    pub fn is_empty(&self) -> bool {
        self.parent.is_none() && self.tag.is_none()
    }

    /// A removed block's: its tag names it.
    fn tag_only(&self) -> Named {
        Named {
            tag: self.tag.clone(),
            ..Named::default()
        }
    }
}

/// What happened to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Stored,
    Removed,
}

/// One block's change, as the index emits it.
#[derive(Debug, Clone)]
pub struct Change {
    pub kind: Kind,
    /// The tier the block was stored in or removed from.
    pub tier: Tier,
    pub daemon: u32,
    pub ns: Namespace,
    pub hash: BlockHash,
    /// Its parent and tag (for removals, its tag only).
    pub named: Named,
    /// When the index changed, in microseconds since the Unix epoch: a
    /// batch is stamped with its oldest change's time, so that a
    /// subscriber reads the delay from the change to itself.
    pub at_us: u64,
    generation: u64,
}

/// The publisher's counters (kept across terms by the metrics).
#[derive(Clone)]
pub struct EventCounters {
    pub batches: IntCounter,
    pub dropped: IntCounter,
    pub resyncs: IntCounter,
    pub replays: IntCounter,
}

/// The index's handle on the event queue; does nothing when events are
/// off.
#[derive(Clone, Default)]
pub struct Events(Option<Arc<Shared>>);

struct Shared {
    tx: mpsc::Sender<Change>,
    /// The generation shifted left by one; the low bit set: a change was
    /// dropped in it, and a resync is due.
    state: AtomicU64,
    counters: EventCounters,
    /// Daemon ids to the node (host) names they registered with; kept
    /// after a daemon left, for the removals that follow.
    nodes: RwLock<HashMap<u32, Arc<str>>>,
    /// Whether events name blocks by their object keys (Mooncake's
    /// format): the index keeps a tag's key only then.
    object_keys: bool,
}

/// The publisher's end of the queue.
pub struct Feed {
    rx: mpsc::Receiver<Change>,
    shared: Arc<Shared>,
}

impl Events {
    /// Events on, with a queue of `queue` changes; `object_keys`: events
    /// name blocks by their writers' keys.
    pub fn new(queue: usize, counters: EventCounters, object_keys: bool) -> (Events, Feed) {
        let (tx, rx) = mpsc::channel(queue.max(1));
        let shared = Arc::new(Shared {
            tx,
            state: AtomicU64::new(0),
            counters,
            nodes: RwLock::default(),
            object_keys,
        });
        (Events(Some(shared.clone())), Feed { rx, shared })
    }

    /// Whether events are published (the index skips their work if not).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// What of a writer's tag the index keeps: nothing with events off;
    /// without its object key unless events name blocks by it (a tag that
    /// held only the key is then none).
    pub fn kept(&self, tag: Option<Arc<EngineTag>>) -> Option<Arc<EngineTag>> {
        let s = self.0.as_ref()?;
        let tag = tag?;
        if s.object_keys {
            return Some(tag);
        }
        EngineTag::without_key(tag)
    }

    /// What daemons keep of their blocks' tags for the next leader: what
    /// these events use.
    pub fn keep_tags(&self) -> KeepTags {
        match &self.0 {
            None => KeepTags::No,
            Some(s) if s.object_keys => KeepTags::WithKeys,
            Some(_) => KeepTags::WithoutKeys,
        }
    }

    /// Remembers which node (host) a daemon runs on.
    pub fn set_node(&self, daemon: u32, node: &str) {
        if let Some(s) = &self.0 {
            s.nodes.write().insert(daemon, Arc::from(node));
        }
    }

    /// A copy of `hash` became visible on `daemon`, in `tier`; `named`:
    /// the block it extends and the engine's tag, as its writer named them.
    #[inline]
    pub fn stored(
        &self,
        (daemon, tier): (u32, Tier),
        ns: &Namespace,
        hash: BlockHash,
        named: &Named,
    ) {
        if let Some(s) = &self.0 {
            s.emit((Kind::Stored, tier), daemon, ns, (hash, named.clone()));
        }
    }

    /// A copy of `hash` left `daemon`'s `tier`; `named`: what the index
    /// kept of it (its tag names it in the event).
    #[inline]
    pub fn removed(
        &self,
        (daemon, tier): (u32, Tier),
        ns: &Namespace,
        hash: BlockHash,
        named: &Named,
    ) {
        if let Some(s) = &self.0 {
            s.emit((Kind::Removed, tier), daemon, ns, (hash, named.tag_only()));
        }
    }

    /// A daemon's copy went from tier `from` to `to`: removed from one,
    /// stored in the other (in that order, so that a subscriber never
    /// counts the copy twice).
    #[inline]
    pub fn moved(
        &self,
        daemon: u32,
        (from, to): (Tier, Tier),
        ns: &Namespace,
        hash: BlockHash,
        named: &Named,
    ) {
        self.removed((daemon, from), ns, hash, named);
        self.stored((daemon, to), ns, hash, named);
    }
}

#[cfg(test)]
impl Feed {
    /// Events on, with counters of their own, for tests of what is emitted.
    pub(crate) fn for_tests(queue: usize) -> (Events, Feed) {
        let c = |n: &str| IntCounter::new(n, n).unwrap();
        let counters = EventCounters {
            batches: c("b"),
            dropped: c("d"),
            resyncs: c("r"),
            replays: c("p"),
        };
        Events::new(queue, counters, true)
    }

    /// The changes queued so far: (kind, block hash, what was said of it).
    pub(crate) fn drain_named(&mut self) -> Vec<(Kind, BlockHash, Named)> {
        std::iter::from_fn(|| self.rx.try_recv().ok())
            .map(|c| (c.kind, c.hash, c.named))
            .collect()
    }

    /// The changes queued so far: (kind, daemon, tier).
    pub(crate) fn drain(&mut self) -> Vec<(Kind, u32, Tier)> {
        std::iter::from_fn(|| self.rx.try_recv().ok())
            .map(|c| (c.kind, c.daemon, c.tier))
            .collect()
    }
}

/// Microseconds since the Unix epoch.
pub(crate) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Shared {
    fn emit(
        &self,
        (kind, tier): (Kind, Tier),
        daemon: u32,
        ns: &Namespace,
        (hash, named): (BlockHash, Named),
    ) {
        let state = self.state.load(Ordering::SeqCst);
        if state & 1 == 1 {
            // A resync is due: its snapshot will hold this change.
            self.counters.dropped.inc();
            return;
        }
        let change = Change {
            kind,
            tier,
            daemon,
            ns: ns.clone(),
            hash,
            named,
            at_us: now_us(),
            generation: state >> 1,
        };
        if self.tx.try_send(change).is_err() {
            self.counters.dropped.inc();
            self.state.fetch_or(1, Ordering::SeqCst);
        }
    }

    fn resync_due(&self) -> bool {
        self.state.load(Ordering::SeqCst) & 1 == 1
    }

    /// Starts a new generation (no resync due); returns it.
    fn next_generation(&self) -> u64 {
        let generation = (self.state.load(Ordering::SeqCst) >> 1) + 1;
        self.state.store(generation << 1, Ordering::SeqCst);
        generation
    }

    fn node(&self, daemon: u32) -> Arc<str> {
        self.nodes
            .read()
            .get(&daemon)
            .cloned()
            .unwrap_or_else(|| Arc::from(format!("daemon-{daemon}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_counts_and_asks_for_a_resync_in_a_new_generation() {
        let (events, mut feed) = Feed::for_tests(2);
        let ns = Namespace::new("t").unwrap();
        let h = |i: u8| BlockHash([i; 32]);
        let d = (1, Tier::Dram);
        events.stored(d, &ns, h(1), &Named::default());
        events.removed(d, &ns, h(1), &Named::default());
        assert!(!feed.shared.resync_due());
        events.stored(d, &ns, h(2), &Named::default());
        assert!(feed.shared.resync_due(), "the third change did not fit");
        events.stored(d, &ns, h(3), &Named::default());
        assert_eq!(feed.shared.counters.dropped.get(), 2, "dropped while due");
        let queued: Vec<Change> = std::iter::from_fn(|| feed.rx.try_recv().ok()).collect();
        assert_eq!(queued.len(), 2);
        assert!(queued.iter().all(|c| c.generation == 0));
        assert_eq!(
            queued.iter().map(|c| c.kind).collect::<Vec<_>>(),
            [Kind::Stored, Kind::Removed],
            "one key's changes in order"
        );
        assert_eq!(feed.shared.next_generation(), 1);
        assert!(!feed.shared.resync_due());
        events.removed(d, &ns, h(3), &Named::default());
        let next = feed.rx.try_recv().unwrap();
        assert_eq!((next.kind, next.generation), (Kind::Removed, 1));
    }

    #[test]
    fn events_off_do_nothing() {
        let events = Events::default();
        let ns = Namespace::new("t").unwrap();
        events.stored((1, Tier::Dram), &ns, BlockHash([0; 32]), &Named::default());
        events.set_node(1, "host");
        assert!(events.0.is_none());
    }

    #[test]
    fn a_tags_object_key_is_kept_only_where_events_name_blocks_by_it() {
        let counters = || {
            let c = |n: &str| IntCounter::new(n, n).unwrap();
            EventCounters {
                batches: c("b"),
                dropped: c("d"),
                resyncs: c("r"),
                replays: c("p"),
            }
        };
        let keyed = |hash: Option<EngineHash>| {
            let tag = EngineTag::new(hash, vec![1])
                .unwrap()
                .with_key("k")
                .unwrap();
            Some(Arc::new(tag))
        };
        let key_only = Some(Arc::new(EngineTag::default().with_key("k").unwrap()));
        let (mooncake, _feed) = Events::new(4, counters(), true);
        assert_eq!(mooncake.kept(keyed(None)), keyed(None));
        let (vllm, _feed) = Events::new(4, counters(), false);
        assert_eq!(vllm.kept(key_only.clone()), None, "a key alone is no tag");
        let kept = vllm.kept(keyed(Some(EngineHash::Int(5)))).unwrap();
        assert_eq!((kept.key.as_deref(), &kept.token_ids[..]), (None, &[1][..]));
        assert_eq!(kept.hash, Some(EngineHash::Int(5)));
        assert_eq!(Events::default().kept(key_only), None, "events off");
        assert_eq!(mooncake.keep_tags(), KeepTags::WithKeys);
        assert_eq!(vllm.keep_tags(), KeepTags::WithoutKeys);
        assert_eq!(Events::default().keep_tags(), KeepTags::No);
    }
}
