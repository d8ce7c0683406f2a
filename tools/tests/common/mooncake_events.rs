//! A subscriber to the store events in Mooncake's format, as Mooncake's
//! Conductor runs one: batches of event maps on the empty topic, missed
//! ones asked of the replay port, applied to a picture of which objects
//! each tenant has in each medium. The picture checks the format's
//! promise as it goes: an object is `stored` in a medium only when it was
//! not there, and `removed` only when it was.

use std::collections::{BTreeMap, BTreeSet};

use mooncake_meta::events::mooncake::{decode_batch, EventType, Record};

use super::events::{self, View};

/// One batch: its number and events.
#[derive(Debug, Clone)]
pub struct Batch {
    pub seq: u64,
    pub events: Vec<Record>,
}

fn batch_of(frames: &[bytes::Bytes]) -> (u64, Batch) {
    let [topic, seq, payload] = frames else {
        panic!("a batch is three frames, got {}", frames.len());
    };
    assert!(topic.is_empty(), "Mooncake's batches go on the empty topic");
    let seq = u64::from_be_bytes(seq[..].try_into().expect("8-byte seq"));
    let events = decode_batch(payload)
        .expect("a batch in Mooncake's format")
        .events;
    (seq, Batch { seq, events })
}

/// The store as the events describe it.
#[derive(Default)]
pub struct Picture {
    /// Each (tenant, medium)'s object keys.
    pub held: BTreeMap<(String, String), BTreeSet<String>>,
    /// Every event applied, in order.
    pub log: Vec<Record>,
    /// `cleared` events per tenant.
    pub clears: BTreeMap<String, usize>,
}

/// A subscriber to Mooncake's format.
pub type Subscriber = events::Follower<Picture>;

impl View for Picture {
    type Batch = Batch;
    fn decode(frames: &[bytes::Bytes]) -> (u64, Batch) {
        batch_of(frames)
    }

    fn apply(&mut self, batch: &Batch) {
        for r in &batch.events {
            if let Some(last) = self.log.last() {
                assert!(r.event_id > last.event_id, "event ids grow: {r:?}");
            }
            match r.event_type {
                EventType::Cleared => {
                    *self.clears.entry(r.tenant_id.clone()).or_default() += 1;
                    self.held.retain(|(tenant, _), _| *tenant != r.tenant_id);
                }
                EventType::Stored | EventType::Removed => {
                    let medium = r.medium.clone().expect("a block event names its medium");
                    let key = r
                        .object_key
                        .clone()
                        .expect("a block event names its object");
                    let set = self.held.entry((r.tenant_id.clone(), medium)).or_default();
                    if r.event_type == EventType::Stored {
                        assert!(set.insert(key), "stored where it already was: {r:?}");
                    } else {
                        assert!(set.remove(&key), "removed where it was not: {r:?}");
                    }
                }
            }
            self.log.push(r.clone());
        }
    }
}

impl Picture {
    /// The object keys `tenant` has in any medium.
    pub fn objects(&self, tenant: &str) -> BTreeSet<String> {
        self.held
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .flat_map(|(_, keys)| keys.iter().cloned())
            .collect()
    }

    /// The last stored event of `key`.
    pub fn stored(&self, key: &str) -> Option<&Record> {
        self.log
            .iter()
            .rev()
            .find(|r| r.event_type == EventType::Stored && r.object_key.as_deref() == Some(key))
    }
}
