//! A subscriber to the store events, as a KV-aware router runs one: a
//! ZeroMQ SUB socket on the leader's events port, each batch decoded as
//! vLLM's `KVEventBatch` (by the meta service's own decoder; the Python
//! tests decode with vLLM's schema), batches it missed (a late start, a
//! gap in the numbers) asked of the replay port, and the blocks applied to
//! a picture of what the store holds.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use mooncake_client::Client;
use mooncake_meta::events::{decode_batch, store_hash, Event};
use mooncake_proto::message::{EngineHash, ListRequest, Tier};
use mooncake_proto::{BlockHash, Namespace};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

#[derive(Debug, Clone)]
pub struct Batch {
    pub topic: String,
    pub seq: u64,
    pub events: Vec<Event>,
}

fn batch_of(frames: &[bytes::Bytes]) -> Batch {
    let [topic, seq, payload] = frames else {
        panic!("a batch is three frames, got {}", frames.len());
    };
    Batch {
        topic: String::from_utf8(topic.to_vec()).expect("topic"),
        seq: u64::from_be_bytes(seq[..].try_into().expect("8-byte seq")),
        events: decode_batch(payload).expect("a batch of this store").1,
    }
}

/// Asks `replay` for the kept batches from `from` on.
pub async fn replay(replay: &str, from: u64) -> Vec<Batch> {
    replay_frames(replay, from)
        .await
        .iter()
        .map(|frames| batch_of(frames))
        .collect()
}

/// The kept batches from `from` on, each as its (topic, number, payload)
/// frames, whichever format.
pub async fn replay_frames(replay: &str, from: u64) -> Vec<Vec<bytes::Bytes>> {
    let mut socket = DealerSocket::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        socket.connect(&format!("tcp://{replay}")),
    )
    .await
    .expect("replay port answers")
    .expect("replay connect");
    let request = vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
    ];
    socket
        .send(ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    let mut out = Vec::new();
    loop {
        let mut frames = tokio::time::timeout(Duration::from_secs(5), socket.recv())
            .await
            .expect("replay answers within 5 s")
            .expect("replay frame")
            .into_vec();
        // An empty delimiter, then (topic, seq, payload).
        assert!(frames[0].is_empty(), "delimiter first");
        if i64::from_be_bytes(frames[2][..].try_into().unwrap()) == -1 {
            return out;
        }
        frames.remove(0);
        out.push(frames);
    }
}

/// The store as the events describe it: each topic's blocks.
#[derive(Default)]
pub struct Picture {
    pub blocks: HashMap<String, BTreeSet<Vec<u8>>>,
    /// Sequence numbers applied, in order.
    pub seqs: Vec<u64>,
    pub clears: usize,
    /// Every (topic, hash) ever stored, and removed, in order.
    pub log: Vec<(String, Vec<u8>, bool)>,
    /// The medium each (topic, hash) held is in.
    pub media: HashMap<(String, Vec<u8>), Tier>,
    /// The parent each block was last published with.
    pub parents: HashMap<Vec<u8>, Option<Vec<u8>>>,
    /// Where in `log` each `AllBlocksCleared` came.
    pub cleared_at: Vec<usize>,
    /// The tokens each block was last published with, if any.
    pub tokens: HashMap<Vec<u8>, Vec<u32>>,
}

/// A block's name as the picture keys it: a store hash's 32 bytes (an
/// integer is its last 8), an engine's bytes as they are.
pub fn raw(name: &EngineHash) -> Vec<u8> {
    match store_hash(name) {
        Some(h) => h.0.to_vec(),
        None => match name {
            EngineHash::Bytes(b) => b.to_vec(),
            EngineHash::Int(_) => unreachable!("an integer is a store hash's form"),
        },
    }
}

/// What a subscriber keeps of the batches: how it decodes one and
/// applies it.
pub trait View: Default {
    type Batch;
    /// A batch's number and events, from its (topic, number, payload).
    fn decode(frames: &[bytes::Bytes]) -> (u64, Self::Batch);
    fn apply(&mut self, batch: &Self::Batch);
}

impl View for Picture {
    type Batch = Batch;
    fn decode(frames: &[bytes::Bytes]) -> (u64, Batch) {
        let batch = batch_of(frames);
        (batch.seq, batch)
    }

    fn apply(&mut self, batch: &Batch) {
        self.seqs.push(batch.seq);
        for event in &batch.events {
            match event {
                Event::AllCleared => {
                    self.clears += 1;
                    self.cleared_at.push(self.log.len());
                    self.blocks.clear();
                    self.media.clear();
                }
                Event::Stored(s) => {
                    let set = self.blocks.entry(batch.topic.clone()).or_default();
                    // The first names its parent; each next one extends
                    // the one before.
                    let parents =
                        std::iter::once(s.parent.as_ref()).chain(s.hashes.iter().map(Some));
                    for (h, parent) in s.hashes.iter().zip(parents) {
                        self.parents.insert(raw(h), parent.map(raw));
                        set.insert(raw(h));
                        self.log.push((batch.topic.clone(), raw(h), true));
                        self.media.insert((batch.topic.clone(), raw(h)), s.tier);
                    }
                    let size = s.block_size as usize;
                    for (h, tokens) in s.hashes.iter().zip(s.token_ids.chunks(size.max(1))) {
                        if size > 0 {
                            self.tokens.insert(raw(h), tokens.to_vec());
                        }
                    }
                }
                Event::Removed(hashes, tier) => {
                    let set = self.blocks.entry(batch.topic.clone()).or_default();
                    for h in hashes {
                        set.remove(&raw(h));
                        self.log.push((batch.topic.clone(), raw(h), false));
                        let at = (batch.topic.clone(), raw(h));
                        if let Some(was) = self.media.remove(&at) {
                            assert_eq!(was, *tier, "a removal names the block's medium");
                        }
                    }
                }
            }
        }
    }
}

impl Picture {
    /// Every block held, whichever host.
    pub fn all(&self) -> BTreeSet<Vec<u8>> {
        self.blocks.values().flatten().cloned().collect()
    }
}

/// A SUB socket on `publish`, subscribed to every topic.
pub async fn sub_socket(publish: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        sub.connect(&format!("tcp://{publish}")),
    )
    .await
    .expect("events port answers")
    .expect("events connect");
    sub.subscribe("").await.unwrap();
    sub
}

/// A subscriber to vLLM's format.
pub type Subscriber = Follower<Picture>;

/// A subscriber keeping a `View` of the batches.
pub struct Follower<V: View> {
    sub: SubSocket,
    replay: String,
    pub picture: V,
    last: Option<u64>,
    /// Batches that arrived after a gap, and were filled by a replay.
    pub gaps: usize,
}

impl<V: View> Follower<V> {
    /// Subscribes to every topic at `publish`, then catches up from the
    /// replay port: from `from` (0: everything kept).
    pub async fn connect(publish: &str, replay: &str, from: u64) -> Self {
        let mut s = Self::resume(publish, replay, None).await;
        s.catch_up(from).await;
        s
    }

    /// Subscribes as one that last applied batch `last`, without catching
    /// up first: the first live batch shows the gap.
    pub async fn resume(publish: &str, replay: &str, last: Option<u64>) -> Self {
        Follower {
            sub: sub_socket(publish).await,
            replay: replay.to_string(),
            picture: V::default(),
            last,
            gaps: 0,
        }
    }

    /// Follows another publisher (a new leader), catching up on all it
    /// kept.
    pub async fn switch(&mut self, publish: &str, replay: &str) {
        self.sub = sub_socket(publish).await;
        self.replay = replay.to_string();
        self.catch_up(0).await;
    }

    async fn catch_up(&mut self, from: u64) {
        for frames in replay_frames(&self.replay, from).await {
            self.take(V::decode(&frames));
        }
    }

    fn take(&mut self, (seq, batch): (u64, V::Batch)) {
        if self.last.is_some_and(|last| seq <= last) {
            return;
        }
        self.last = Some(seq);
        self.picture.apply(&batch);
    }

    /// Follows the live batches until `done` holds of the picture, or
    /// `within` passed; false then. A gap is filled from the replay port.
    pub async fn follow_until(
        &mut self,
        within: Duration,
        mut done: impl FnMut(&V) -> bool,
    ) -> bool {
        let start = Instant::now();
        while !done(&self.picture) {
            let left = within.saturating_sub(start.elapsed());
            if left.is_zero() {
                return false;
            }
            let wait = left.min(Duration::from_millis(200));
            let Ok(message) = tokio::time::timeout(wait, self.sub.recv()).await else {
                continue;
            };
            let (seq, batch) = V::decode(&message.expect("live frame").into_vec());
            match self.last {
                Some(last) if seq > last + 1 => {
                    self.gaps += 1;
                    self.catch_up(last + 1).await;
                    self.take((seq, batch));
                }
                _ => self.take((seq, batch)),
            }
        }
        true
    }
}

/// Follows `sub` until what `seen` reads from its picture is what `truth`
/// reads from the store (read again each round, as eviction reports
/// land), for at most `within`; the store's set then.
pub async fn converge<V: View, K: Ord>(
    sub: &mut Follower<V>,
    within: Duration,
    truth: impl AsyncFn() -> BTreeSet<K>,
    seen: impl Fn(&V) -> BTreeSet<K>,
) -> BTreeSet<K> {
    let deadline = Instant::now() + within;
    loop {
        let held = truth().await;
        if sub
            .follow_until(Duration::from_millis(500), |p| seen(p) == held)
            .await
        {
            return held;
        }
        assert!(
            Instant::now() < deadline,
            "the events never showed what the store holds: {} held, {} in the picture",
            held.len(),
            seen(&sub.picture).len()
        );
    }
}

/// The hashes the store's index holds in `ns`, every page of them.
pub async fn listed(client: &Client, ns: &Namespace) -> Vec<BlockHash> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let page = client
            .list(&ListRequest {
                namespace: Some(ns.clone()),
                after: after.clone(),
                prefix: Vec::new(),
                daemon: 0,
                limit: 1000,
            })
            .await
            .unwrap();
        after = page.entries.last().map(|e| e.key.clone());
        out.extend(page.entries.iter().map(|e| e.key.hash));
        if !page.more {
            return out;
        }
    }
}
