//! Publishes the queued changes as vLLM's `ZmqEventPublisher` frames them:
//! each batch on a PUB socket as (topic, sequence number as 8 bytes big
//! endian, payload), the last `keep` batches kept for a ROUTER socket that
//! replays them. A replay request carries the first sequence number wanted
//! (8 bytes big endian); the answer is every kept batch from there as
//! (topic, sequence number, payload), then an empty topic, the sequence
//! number -1 and an empty payload.
//!
//! A batch's topic is `{topic}@{node}@{namespace}`: the host whose daemon
//! holds the blocks, and their namespace. `AllBlocksCleared` goes out on
//! `{topic}` alone. Subscribing to `{topic}` (or to everything) sees all.
//!
//! Sequence numbers start at the term's start time in microseconds since
//! the Unix epoch, so that they grow across leaders; each term opens with
//! `AllBlocksCleared`, and the blocks follow as daemons report them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mooncake_proto::Namespace;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::mooncake::{self, Availability};
use super::wire::{encode_batch, Event, HashForm, Stored};
use super::{now_us, Change, EventCounters, Feed, Held, Kind, Named, Shared};
use mooncake_proto::message::{EngineHash, Tier};
use mooncake_proto::BlockHash;

/// Most blocks in one batch.
const MAX_BATCH_BLOCKS: usize = 1024;
/// Most changes taken off the queue at once.
const MAX_DRAIN: usize = 16 * 1024;
/// How long one replayed batch may wait for a subscriber that reads slowly.
const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// The replay answer's last frame's sequence number.
const END_SEQ: i64 = -1;

/// The sockets, bound by the caller (so that a taken port is refused when
/// the service starts), and what to publish on them.
pub struct Sockets {
    pub publish: std::net::TcpListener,
    pub replay: Option<std::net::TcpListener>,
    /// The topic prefix.
    pub topic: String,
    /// Whose event format, and its settings.
    pub format: Format,
    /// Batches kept for replay.
    pub keep: usize,
    /// How long changes are gathered after the first arrives.
    pub window: Duration,
}

impl Sockets {
    /// The same sockets for one leader's term, each listener's descriptor
    /// duplicated: a meta replica holds the originals from its start, so
    /// that no other process takes its events ports while it stands by.
    pub fn try_clone(&self) -> std::io::Result<Sockets> {
        Ok(Sockets {
            publish: self.publish.try_clone()?,
            replay: self.replay.as_ref().map(|l| l.try_clone()).transpose()?,
            topic: self.topic.clone(),
            format: self.format.clone(),
            keep: self.keep,
            window: self.window,
        })
    }
}

/// The format events are published in.
#[derive(Debug, Clone)]
pub enum Format {
    /// vLLM's (`wire`); `int_hashes`: block hashes as vLLM's default
    /// 64-bit integers (`wire::HashForm`).
    Vllm { int_hashes: bool },
    /// Mooncake's master's (`mooncake`), on an empty topic.
    Mooncake(mooncake::Context),
}

/// The visible blocks of one shard of the index (daemon, namespace,
/// hash); `None` past the last shard.
pub type Snapshot = Arc<dyn Fn(usize) -> Option<Vec<Held>> + Send + Sync>;

type Kept = Arc<Mutex<VecDeque<(u64, Bytes, Bytes)>>>;

/// Publishes until `stop`.
pub async fn run(feed: Feed, sockets: Sockets, snapshot: Snapshot, stop: CancellationToken) {
    let Feed { mut rx, shared } = feed;
    let window = sockets.window;
    let mut socket = PubSocket::new();
    if let Err(err) = socket.bind_listener(sockets.publish).await {
        tracing::error!(%err, "events: cannot publish on the bound port");
        return;
    }
    let kept: Kept = Arc::new(Mutex::new(VecDeque::new()));
    let replay = sockets.replay.map(|listener| {
        tokio::spawn(serve_replay(
            listener,
            kept.clone(),
            shared.counters.clone(),
            stop.clone(),
        ))
    });
    let mut out = Out {
        socket,
        // Above the numbers of any earlier term (whose clocks agree).
        seq: now_us(),
        kept,
        keep: sockets.keep.max(1),
        prefix: sockets.topic,
        form: match sockets.format {
            Format::Vllm { int_hashes: true } => HashForm::Int,
            _ => HashForm::Bytes,
        },
        mooncake: match sockets.format {
            Format::Mooncake(ctx) => Some(MooncakeOut {
                ctx,
                availability: Availability::default(),
                event_id: now_us(),
            }),
            Format::Vllm { .. } => None,
        },
        counters: shared.counters.clone(),
    };
    // The changes of this term so far are generation 0: kept, after this.
    out.cleared().await;
    let mut generation = 0;
    loop {
        let first = tokio::select! {
            change = rx.recv() => change,
            _ = stop.cancelled() => break,
        };
        let Some(first) = first else { break };
        if !window.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(window) => {}
                _ = stop.cancelled() => {}
            }
        }
        let mut changes = vec![first];
        while changes.len() < MAX_DRAIN {
            match rx.try_recv() {
                Ok(change) => changes.push(change),
                Err(_) => break,
            }
        }
        if shared.resync_due() {
            generation = shared.next_generation();
            out.resync(&shared, &snapshot).await;
            continue;
        }
        changes.retain(|c| c.generation == generation);
        out.changes(&shared, changes).await;
    }
    // Unbound now, so that the next term (on this replica too) binds the
    // same ports.
    out.socket.unbind_all().await;
    if let Some(task) = replay {
        let _ = task.await;
    }
}

struct Out {
    socket: PubSocket,
    seq: u64,
    kept: Kept,
    keep: usize,
    prefix: String,
    form: HashForm,
    /// Set when events are in Mooncake's format.
    mooncake: Option<MooncakeOut>,
    counters: EventCounters,
}

/// What Mooncake's format keeps between batches.
struct MooncakeOut {
    ctx: mooncake::Context,
    availability: Availability,
    /// The next event's number: from the term's start time in
    /// microseconds, so that numbers grow across leaders.
    event_id: u64,
}

impl Out {
    /// `AllBlocksCleared`; in Mooncake's format, `cleared` for each tenant
    /// published so far (none at a term's start: each tenant is cleared
    /// before its first event).
    async fn cleared(&mut self) {
        let Some(m) = &mut self.mooncake else {
            let topic = self.prefix.clone();
            self.publish(topic, &[Event::AllCleared], now_us()).await;
            return;
        };
        let cleared: Vec<mooncake::Event> = m
            .availability
            .reset()
            .into_iter()
            .map(mooncake::Event::Cleared)
            .collect();
        for chunk in cleared.chunks(MAX_BATCH_BLOCKS) {
            self.publish_mooncake(chunk, now_us()).await;
        }
    }

    /// `AllBlocksCleared`, then every visible block.
    async fn resync(&mut self, shared: &Shared, snapshot: &Snapshot) {
        self.counters.resyncs.inc();
        tracing::warn!("events: the queue overflowed; subscribers are resynchronized");
        self.cleared().await;
        if self.mooncake.is_some() {
            let mut shard = 0;
            while let Some(blocks) = snapshot(shard) {
                let at = now_us();
                let copies = blocks
                    .into_iter()
                    .map(|((_, tier), ns, hash, named)| (Kind::Stored, tier, ns, hash, named, at));
                self.mooncake_changes(copies).await;
                shard += 1;
                tokio::task::yield_now().await;
            }
            return;
        }
        let mut shard = 0;
        while let Some(blocks) = snapshot(shard) {
            let mut by_topic: HashMap<(u32, Namespace), Vec<Event>> = HashMap::new();
            for ((daemon, tier), ns, hash, named) in blocks {
                // A block an event of its own: the index's order is not a
                // chain's.
                let stored = Event::Stored(self.stored(hash, tier, &named));
                by_topic.entry((daemon, ns)).or_default().push(stored);
            }
            for ((daemon, ns), events) in by_topic {
                let topic = self.topic(&shared.node(daemon), &ns);
                let at = now_us();
                for chunk in events.chunks(MAX_BATCH_BLOCKS) {
                    self.publish(topic.clone(), chunk, at).await;
                }
            }
            shard += 1;
            tokio::task::yield_now().await;
        }
    }

    /// Batches changes in their order: a batch ends where the topic
    /// changes, and holds one event per run of one kind (in one tier); a
    /// run of stored blocks is also one chain, each block extending the
    /// one before, as a `BlockStored`'s blocks are read.
    async fn changes(&mut self, shared: &Shared, changes: Vec<Change>) {
        if self.mooncake.is_some() {
            let copies = changes
                .into_iter()
                .map(|c| (c.kind, c.tier, c.ns, c.hash, c.named, c.at_us));
            return self.mooncake_changes(copies).await;
        }
        let mut current: Option<(u32, Namespace)> = None;
        let mut events: Vec<Event> = Vec::new();
        let (mut blocks, mut oldest) = (0, u64::MAX);
        // The store's hash of the last block of the last event, if stored:
        // the next extends that chain if it names it as its parent.
        let mut chain_end: Option<BlockHash> = None;
        for c in changes {
            let same = current
                .as_ref()
                .is_some_and(|(d, ns)| *d == c.daemon && *ns == c.ns);
            if !same || blocks == MAX_BATCH_BLOCKS {
                if let Some((daemon, ns)) = current.take() {
                    let topic = self.topic(&shared.node(daemon), &ns);
                    self.publish(topic, &std::mem::take(&mut events), oldest)
                        .await;
                    (blocks, oldest) = (0, u64::MAX);
                }
                current = Some((c.daemon, c.ns.clone()));
                chain_end = None;
            }
            oldest = oldest.min(c.at_us);
            let extends = c.named.parent.is_some() && chain_end == c.named.parent;
            match (events.last_mut(), c.kind) {
                (Some(Event::Stored(s)), Kind::Stored)
                    if extends && s.tier == c.tier && fits(s, &c.named) =>
                {
                    s.hashes.push(self.name(&c.hash, &c.named));
                    if let Some(tag) = &c.named.tag {
                        s.token_ids.extend_from_slice(&tag.token_ids);
                    }
                }
                (Some(Event::Removed(h, t)), Kind::Removed) if *t == c.tier => {
                    h.push(self.name(&c.hash, &c.named))
                }
                (_, Kind::Stored) => {
                    events.push(Event::Stored(self.stored(c.hash, c.tier, &c.named)))
                }
                (_, Kind::Removed) => {
                    events.push(Event::Removed(vec![self.name(&c.hash, &c.named)], c.tier))
                }
            }
            chain_end = (c.kind == Kind::Stored).then_some(c.hash);
            blocks += 1;
        }
        if let Some((daemon, ns)) = current {
            let topic = self.topic(&shared.node(daemon), &ns);
            self.publish(topic, &events, oldest).await;
        }
    }

    /// Copies' changes, in Mooncake's format: an event where a block's
    /// availability in a medium changed, after its tenant's `cleared` if
    /// that is still due; batches of at most `MAX_BATCH_BLOCKS` events.
    async fn mooncake_changes(
        &mut self,
        copies: impl IntoIterator<Item = (Kind, Tier, Namespace, BlockHash, Named, u64)>,
    ) {
        let m = self.mooncake.as_mut().expect("Mooncake's format");
        let mut events = Vec::new();
        let mut oldest = u64::MAX;
        for (kind, tier, ns, hash, named, at) in copies {
            if m.availability.clear_first(&ns) {
                events.push(mooncake::Event::Cleared(ns.clone()));
            }
            if m.availability.apply(kind, tier, &ns, hash) {
                oldest = oldest.min(at);
                events.push(mooncake::Event::Block {
                    kind,
                    tier,
                    ns,
                    hash,
                    named,
                });
            }
        }
        let at = if oldest == u64::MAX { now_us() } else { oldest };
        for chunk in events.chunks(MAX_BATCH_BLOCKS) {
            self.publish_mooncake(chunk, at).await;
        }
    }

    /// Publishes one batch in Mooncake's format, on the empty topic.
    async fn publish_mooncake(&mut self, events: &[mooncake::Event], at_us: u64) {
        let m = self.mooncake.as_mut().expect("Mooncake's format");
        let payload = mooncake::encode_batch(&m.ctx, (at_us / 1000) as i64, m.event_id, events);
        m.event_id += events.len() as u64;
        self.send(Bytes::new(), Bytes::from(payload)).await;
    }

    /// What an event calls a block: the engine's hash its writer
    /// attached, or the store's.
    fn name(&self, hash: &BlockHash, named: &Named) -> EngineHash {
        match named.tag.as_ref().and_then(|t| t.hash.clone()) {
            Some(h) => h,
            None => self.form.name(hash),
        }
    }

    /// One block stored, as an event of its own.
    fn stored(&self, hash: BlockHash, tier: Tier, named: &Named) -> Stored {
        let token_ids = named
            .tag
            .as_ref()
            .map_or_else(Vec::new, |t| t.token_ids.clone());
        Stored {
            hashes: vec![self.name(&hash, named)],
            tier,
            parent: match (&named.parent_hash, &named.parent) {
                (Some(engine), _) => Some(engine.clone()),
                (None, Some(parent)) => Some(self.form.name(parent)),
                (None, None) => None,
            },
            block_size: token_ids.len() as u32,
            token_ids,
        }
    }

    fn topic(&self, node: &str, ns: &Namespace) -> String {
        format!("{}@{node}@{ns}", self.prefix)
    }

    /// Publishes one batch stamped `at_us` (microseconds since the Unix
    /// epoch).
    async fn publish(&mut self, topic: String, events: &[Event], at_us: u64) {
        let payload = Bytes::from(encode_batch(at_us as f64 / 1e6, events));
        self.send(Bytes::from(topic), payload).await;
    }

    /// Sends one batch under the next sequence number, and keeps it for
    /// replays.
    async fn send(&mut self, topic: Bytes, payload: Bytes) {
        let seq = self.seq;
        self.seq += 1;
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        // PUB never waits: a subscriber whose queue is full misses the
        // batch, sees the gap in the numbers and asks for a replay.
        if let Err(err) = self.socket.send(message).await {
            tracing::debug!(%err, seq, "events: batch not published");
        }
        let mut kept = self.kept.lock();
        kept.push_back((seq, topic, payload));
        while kept.len() > self.keep {
            kept.pop_front();
        }
        self.counters.batches.inc();
    }
}

/// Whether a stored block can join an event's blocks as vLLM reads them:
/// each block with as many tokens as the event's `block_size` (none, if
/// the event has none).
fn fits(event: &Stored, named: &Named) -> bool {
    let tokens = named.tag.as_ref().map_or(0, |t| t.token_ids.len());
    tokens as u32 == event.block_size
}

/// Answers replay requests until `stop`, one at a time; a subscriber that
/// stops reading loses its answer after `REPLAY_SEND_TIMEOUT`, nobody else.
async fn serve_replay(
    listener: std::net::TcpListener,
    kept: Kept,
    counters: EventCounters,
    stop: CancellationToken,
) {
    let mut router = RouterSocket::new();
    if let Err(err) = router.bind_listener(listener).await {
        tracing::error!(%err, "events: cannot serve replays on the bound port");
        return;
    }
    loop {
        let request = tokio::select! {
            r = router.recv() => r,
            _ = stop.cancelled() => {
                router.unbind_all().await;
                return;
            }
        };
        let frames = match request {
            Ok(message) => message.into_vec(),
            Err(err) => {
                // A peer's broken request; a pause keeps a socket that keeps
                // failing from spinning.
                tracing::debug!(%err, "events: replay request not read");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let (Some(peer), Some(last)) = (frames.first(), frames.last()) else {
            continue;
        };
        counters.replays.inc();
        // vLLM's subscribers send the number after an empty delimiter.
        let from = <[u8; 8]>::try_from(&last[..]).ok().map(u64::from_be_bytes);
        let batches: Vec<(u64, Bytes, Bytes)> = match from {
            Some(from) => kept
                .lock()
                .iter()
                .filter(|(seq, _, _)| *seq >= from)
                .cloned()
                .collect(),
            None => {
                tracing::debug!(frames = frames.len(), "events: malformed replay request");
                Vec::new()
            }
        };
        let mut answered = true;
        for (seq, topic, payload) in batches {
            let frames = vec![
                peer.clone(),
                Bytes::new(),
                topic,
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if !send(&mut router, frames).await {
                answered = false;
                break;
            }
        }
        if answered {
            let end = vec![
                peer.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&END_SEQ.to_be_bytes()),
                Bytes::new(),
            ];
            send(&mut router, end).await;
        }
    }
}

async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    let message = ZmqMessage::try_from(frames).expect("frames");
    match tokio::time::timeout(REPLAY_SEND_TIMEOUT, router.send(message)).await {
        Ok(Ok(())) => true,
        Ok(Err(err)) => {
            tracing::debug!(%err, "events: replay answer not sent");
            false
        }
        Err(_) => {
            tracing::debug!("events: a replaying subscriber stopped reading");
            false
        }
    }
}
