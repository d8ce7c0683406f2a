//! `events`: follow the store events as a router would (`docs/events.md`),
//! one line a batch: its number, topic, and what it stored and removed,
//! with the gaps in the numbers said (and, with `--replay`, filled). Both
//! of the meta service's formats are read: vLLM's and Mooncake's.

use std::time::Duration;

use bytes::Bytes;
use mooncake_meta::events::mooncake::{self, EventType, Record};
use mooncake_meta::events::{decode_batch, medium, Event};
use mooncake_proto::message::EngineHash;
use serde_json::json;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::exit::Failure;

/// How long the replay port may take to answer each batch.
const REPLAY_WAIT: Duration = Duration::from_secs(5);

#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// The meta service's events port (its `events_listen`).
    #[arg(long, env = "MOONCAKE_EVENTS")]
    events: String,
    /// Its replay port (`events_replay_listen`): missed batches are asked
    /// there.
    #[arg(long, env = "MOONCAKE_EVENTS_REPLAY")]
    replay: Option<String>,
    /// Start with every batch the replay port kept (the leader's term from
    /// its `AllBlocksCleared`, if it kept that far back).
    #[arg(long, requires = "replay")]
    from_start: bool,
    /// Stop after this many batches.
    #[arg(long)]
    count: Option<u64>,
    /// Print each block's hash.
    #[arg(long)]
    keys: bool,
    /// Only topics starting with this (e.g. kv@gpu-1).
    #[arg(long, default_value = "")]
    topic: String,
    /// How long to wait for the events port to accept the connection.
    #[arg(long, default_value = "5s", value_parser = mooncake_proto::units::parse_duration)]
    connect_timeout: Duration,
    #[arg(long)]
    json: bool,
}

struct Batch {
    topic: String,
    seq: u64,
    /// Seconds since the epoch.
    ts: f64,
    events: Events,
}

/// A batch's events, in the format the meta service publishes.
enum Events {
    Vllm(Vec<Event>),
    Mooncake(Vec<Record>),
}

pub async fn run(args: EventsArgs) -> Result<(), Failure> {
    let mut sub = SubSocket::new();
    let endpoint = format!("tcp://{}", args.events);
    match tokio::time::timeout(args.connect_timeout, sub.connect(&endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Failure::connection(format!("events at {}: {e}", args.events))),
        Err(_) => {
            return Err(Failure::connection(format!(
                "events at {}: no answer within {:?} (is the meta service publishing there, and leading?)",
                args.events, args.connect_timeout
            )))
        }
    }
    sub.subscribe(&args.topic)
        .await
        .map_err(|e| Failure::connection(format!("events at {}: {e}", args.events)))?;
    let mut shown = 0u64;
    let mut last: Option<u64> = None;
    if args.from_start {
        for batch in replay(&args, 0).await? {
            show(&args, &batch, &mut last);
            shown += 1;
            if args.count.is_some_and(|c| shown >= c) {
                return Ok(());
            }
        }
    }
    while args.count.is_none_or(|c| shown < c) {
        let message = sub
            .recv()
            .await
            .map_err(|e| Failure::connection(format!("events at {}: {e}", args.events)))?;
        let batch = parse(&message.into_vec())?;
        if let Some(prev) = last.filter(|prev| batch.seq > prev + 1) {
            if args.replay.is_some() {
                for missed in replay(&args, prev + 1).await? {
                    if missed.seq < batch.seq && shown < args.count.unwrap_or(u64::MAX) {
                        show(&args, &missed, &mut last);
                        shown += 1;
                    }
                }
            } else {
                eprintln!(
                    "gap: {} batches missed before {} (give --replay to fill it)",
                    batch.seq - prev - 1,
                    batch.seq
                );
            }
        }
        if last.is_some_and(|prev| batch.seq <= prev) || args.count.is_some_and(|c| shown >= c) {
            continue;
        }
        show(&args, &batch, &mut last);
        shown += 1;
    }
    Ok(())
}

fn parse(frames: &[Bytes]) -> Result<Batch, Failure> {
    let [topic, seq, payload] = frames else {
        return Err(Failure::other(anyhow::anyhow!(
            "an event message of {} frames (expected topic, number, batch)",
            frames.len()
        )));
    };
    let seq = <[u8; 8]>::try_from(&seq[..])
        .map(u64::from_be_bytes)
        .map_err(|_| Failure::other(anyhow::anyhow!("a batch number of {} bytes", seq.len())))?;
    // Mooncake's batch opens with an integer of milliseconds and its
    // events name their `event_type`; vLLM's opens with a float of
    // seconds. vLLM's decoder would take Mooncake's legacy `type` fields,
    // so Mooncake's is tried first.
    let (ts, events) = match mooncake::decode_batch(payload) {
        Ok(batch) => (
            batch.timestamp_ms as f64 / 1e3,
            Events::Mooncake(batch.events),
        ),
        Err(theirs) => match decode_batch(payload) {
            Ok((ts, events)) => (ts, Events::Vllm(events)),
            Err(vllm) => {
                return Err(Failure::other(anyhow::anyhow!(
                    "batch {seq} is in neither format: as vLLM's, {vllm}; as Mooncake's, {theirs}"
                )))
            }
        },
    };
    Ok(Batch {
        topic: String::from_utf8_lossy(topic).into_owned(),
        seq,
        ts,
        events,
    })
}

/// The kept batches from `from` on, from the replay port.
async fn replay(args: &EventsArgs, from: u64) -> Result<Vec<Batch>, Failure> {
    let addr = args.replay.as_deref().expect("asked only with --replay");
    let fail = |e: String| Failure::connection(format!("replay at {addr}: {e}"));
    let mut socket = DealerSocket::new();
    tokio::time::timeout(
        args.connect_timeout,
        socket.connect(&format!("tcp://{addr}")),
    )
    .await
    .map_err(|_| fail(format!("no answer within {:?}", args.connect_timeout)))?
    .map_err(|e| fail(e.to_string()))?;
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
    socket
        .send(ZmqMessage::try_from(request).expect("two frames"))
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut out = Vec::new();
    loop {
        let frames = tokio::time::timeout(REPLAY_WAIT, socket.recv())
            .await
            .map_err(|_| fail(format!("no batch within {REPLAY_WAIT:?}")))?
            .map_err(|e| fail(e.to_string()))?
            .into_vec();
        // An empty delimiter, then (topic, number, batch); number -1 ends.
        if frames.len() == 4 && frames[2][..] == (-1i64).to_be_bytes() {
            return Ok(out);
        }
        let batch = frames
            .get(1..)
            .ok_or_else(|| fail("an empty answer".into()))
            .and_then(parse)?;
        if batch.topic.starts_with(&args.topic) {
            out.push(batch);
        }
    }
}

fn show(args: &EventsArgs, batch: &Batch, last: &mut Option<u64>) {
    *last = Some(batch.seq);
    let events = match &batch.events {
        Events::Vllm(events) => events,
        Events::Mooncake(records) => return show_mooncake(args, batch, records),
    };
    if args.json {
        let events: Vec<_> = events
            .iter()
            .map(|e| match e {
                Event::Stored(s) => json!({"type": "BlockStored", "blocks": s.hashes.len(), "medium": medium(s.tier),
                    "block_size": s.block_size, "tokens": s.token_ids.len(),
                    "block_hashes": args.keys.then(|| s.hashes.iter().map(name_json).collect::<Vec<_>>()),
                    "parent_block_hash": args.keys.then(|| s.parent.as_ref().map(name_json))}),
                Event::Removed(h, t) => json!({"type": "BlockRemoved", "blocks": h.len(), "medium": medium(*t),
                    "block_hashes": args.keys.then(|| h.iter().map(name_json).collect::<Vec<_>>())}),
                Event::AllCleared => json!({"type": "AllBlocksCleared"}),
            })
            .collect();
        println!(
            "{}",
            json!({"seq": batch.seq, "topic": batch.topic, "ts": batch.ts, "events": events})
        );
        return;
    }
    let (mut stored, mut removed, mut cleared) = (0, 0, false);
    for e in events {
        match e {
            Event::Stored(s) => stored += s.hashes.len(),
            Event::Removed(h, _) => removed += h.len(),
            Event::AllCleared => cleared = true,
        }
    }
    let what = if cleared {
        "all blocks cleared".to_string()
    } else {
        format!("stored {stored:>5}  removed {removed:>5}")
    };
    println!("{:>20}  {:<40} {what}", batch.seq, batch.topic);
    if args.keys {
        for e in events {
            match e {
                Event::Stored(s) => {
                    let parents =
                        std::iter::once(s.parent.as_ref()).chain(s.hashes.iter().map(Some));
                    let tokens = match s.block_size {
                        0 => String::new(),
                        n => format!("  {n} tokens"),
                    };
                    for (h, p) in s.hashes.iter().zip(parents) {
                        let (h, m) = (name_text(h), medium(s.tier));
                        match p {
                            Some(p) => println!("    + {h}  {m}{tokens}  after {}", name_text(p)),
                            None => println!("    + {h}  {m}{tokens}"),
                        }
                    }
                }
                Event::Removed(h, t) => h
                    .iter()
                    .for_each(|h| println!("    - {}  {}", name_text(h), medium(*t))),
                Event::AllCleared => {}
            }
        }
    }
}

/// A batch in Mooncake's format: one line a batch, and with `--keys` one
/// a block (its tenant, medium and object key).
fn show_mooncake(args: &EventsArgs, batch: &Batch, records: &[Record]) {
    let what = |r: &Record| match r.event_type {
        EventType::Stored => "stored",
        EventType::Removed => "removed",
        EventType::Cleared => "cleared",
    };
    if args.json {
        let events: Vec<_> = records
            .iter()
            .map(|r| {
                json!({"type": what(r), "event_id": r.event_id, "tenant_id": r.tenant_id,
                    "medium": r.medium, "model_name": r.model_name, "block_size": r.block_size,
                    "object_key": args.keys.then_some(r.object_key.as_ref()).flatten(),
                    "seq_hash": args.keys.then_some(r.seq_hash).flatten()})
            })
            .collect();
        println!(
            "{}",
            json!({"seq": batch.seq, "format": "mooncake", "ts": batch.ts, "events": events})
        );
        return;
    }
    let count = |t: EventType| records.iter().filter(|r| r.event_type == t).count();
    let cleared = count(EventType::Cleared);
    let mut line = format!(
        "stored {:>5}  removed {:>5}",
        count(EventType::Stored),
        count(EventType::Removed)
    );
    if cleared > 0 {
        line += &format!("  cleared {cleared} tenant(s)");
    }
    println!("{:>20}  {:<40} {line}", batch.seq, "(mooncake)");
    if args.keys {
        for r in records {
            let sign = match r.event_type {
                EventType::Stored => '+',
                EventType::Removed => '-',
                EventType::Cleared => '*',
            };
            let key = r.object_key.as_deref().unwrap_or("(all)");
            let medium = r.medium.as_deref().unwrap_or("");
            println!("    {sign} {}  {key}  {medium}", r.tenant_id);
        }
    }
}

/// A block's name in JSON: an integer hash as a number, bytes as hex.
fn name_json(name: &EngineHash) -> serde_json::Value {
    match name {
        EngineHash::Int(n) => json!(n),
        EngineHash::Bytes(_) => json!(name_text(name)),
    }
}

/// A block's name as text: an integer in decimal, bytes in hex.
fn name_text(name: &EngineHash) -> String {
    match name {
        EngineHash::Int(n) => n.to_string(),
        EngineHash::Bytes(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
    }
}
