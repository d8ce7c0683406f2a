//! `gen-trace KIND`: synthetic serving traces in the Mooncake trace format
//! (JSON lines of timestamp, input_length, hash_ids), so that an eviction
//! policy is judged on more than one workload. Blocks are chains: a
//! request's `hash_ids` are its prompt's blocks in order, and two requests
//! share ids exactly where their prompts share a prefix.
//!
//! - `chat`: multi-turn conversations over a few shared system prompts;
//!   each turn resends the whole history plus the last answer and a new
//!   question, and turns of many conversations interleave, so the gap
//!   between two turns of one conversation varies widely.
//! - `agents`: tool-calling agents with one long common prefix (tool
//!   definitions) and many quick steps, each appending a tool's output.
//! - `shared-prompt`: one-shot requests: a popular system prompt, often a
//!   popular document, then a question never seen again (the blocks used
//!   once that push reusable ones out of an LRU).

use std::io::Write;
use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::exit::Failure;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Agents,
    SharedPrompt,
}

#[derive(clap::Args, Debug)]
pub struct GenTraceArgs {
    kind: Kind,
    /// Where to write the trace (JSON lines).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// The same seed gives the same trace.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
}

/// One request of a trace: its prompt's blocks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gen {
    pub blocks: Vec<u64>,
}

/// Draws index `i` of `n` with weight 1/(i+1)^s: a few popular items and a
/// long tail.
struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut total = 0.0;
        let cumulative = (0..n)
            .map(|i| {
                total += 1.0 / ((i + 1) as f64).powf(s);
                total
            })
            .collect();
        Zipf { cumulative }
    }

    fn draw(&self, rng: &mut StdRng) -> usize {
        let total = *self.cumulative.last().expect("at least one item");
        let x = rng.gen::<f64>() * total;
        self.cumulative.partition_point(|c| *c < x)
    }
}

/// Fresh block ids, and chains of them.
struct Blocks {
    next: u64,
}

impl Blocks {
    fn fresh(&mut self, n: usize) -> Vec<u64> {
        let ids = (self.next..self.next + n as u64).collect();
        self.next += n as u64;
        ids
    }
}

/// `requests` prompts of a workload of `kind`, the same for the same seed.
pub fn generate(kind: Kind, requests: usize, seed: u64) -> Vec<Gen> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut blocks = Blocks { next: 1 };
    match kind {
        Kind::Chat => chat(requests, &mut rng, &mut blocks),
        Kind::Agents => agents(requests, &mut rng, &mut blocks),
        Kind::SharedPrompt => shared_prompt(requests, &mut rng, &mut blocks),
    }
}

fn chat(requests: usize, rng: &mut StdRng, blocks: &mut Blocks) -> Vec<Gen> {
    let systems: Vec<Vec<u64>> = (0..20)
        .map(|_| {
            let n = rng.gen_range(2..=6);
            blocks.fresh(n)
        })
        .collect();
    let popular = Zipf::new(systems.len(), 1.1);
    // Open conversations, each its prompt so far.
    let mut open: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::with_capacity(requests);
    while out.len() < requests {
        if open.len() < 8 || (open.len() < 2000 && rng.gen_bool(0.25)) {
            let mut prompt = systems[popular.draw(rng)].clone();
            let question = rng.gen_range(1..=3);
            prompt.extend(blocks.fresh(question));
            out.push(Gen {
                blocks: prompt.clone(),
            });
            open.push(prompt);
            continue;
        }
        // Recent conversations come back sooner: the gap between turns
        // ranges from the next request to thousands later.
        let back = (rng.gen::<f64>().powi(2) * open.len() as f64) as usize;
        let i = open.len() - 1 - back.min(open.len() - 1);
        let answer = rng.gen_range(1..=3);
        let question = rng.gen_range(1..=2);
        let mut prompt = open.swap_remove(i);
        prompt.extend(blocks.fresh(answer + question));
        out.push(Gen {
            blocks: prompt.clone(),
        });
        // A conversation ends after a few turns, or at 64 blocks.
        if prompt.len() < 64 && rng.gen_bool(0.8) {
            open.push(prompt);
        }
    }
    out
}

fn agents(requests: usize, rng: &mut StdRng, blocks: &mut Blocks) -> Vec<Gen> {
    let tools = blocks.fresh(16);
    let mut open: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::with_capacity(requests);
    while out.len() < requests {
        if open.len() < 4 || (open.len() < 256 && rng.gen_bool(0.05)) {
            let mut prompt = tools.clone();
            let task = rng.gen_range(1..=4);
            prompt.extend(blocks.fresh(task));
            out.push(Gen {
                blocks: prompt.clone(),
            });
            open.push(prompt);
            continue;
        }
        let i = rng.gen_range(0..open.len());
        let output = rng.gen_range(1..=4);
        let prompt = &mut open[i];
        prompt.extend(blocks.fresh(output));
        out.push(Gen {
            blocks: prompt.clone(),
        });
        if prompt.len() > 96 || rng.gen_bool(0.04) {
            open.swap_remove(i);
        }
    }
    out
}

fn shared_prompt(requests: usize, rng: &mut StdRng, blocks: &mut Blocks) -> Vec<Gen> {
    let systems: Vec<Vec<u64>> = (0..50)
        .map(|_| {
            let n = rng.gen_range(4..=10);
            blocks.fresh(n)
        })
        .collect();
    let documents: Vec<Vec<u64>> = (0..2000)
        .map(|_| {
            let n = rng.gen_range(4..=8);
            blocks.fresh(n)
        })
        .collect();
    let (popular, read) = (
        Zipf::new(systems.len(), 1.2),
        Zipf::new(documents.len(), 0.9),
    );
    (0..requests)
        .map(|_| {
            let mut prompt = systems[popular.draw(rng)].clone();
            if rng.gen_bool(0.6) {
                prompt.extend(&documents[read.draw(rng)]);
            }
            let question = rng.gen_range(1..=6);
            prompt.extend(blocks.fresh(question));
            Gen { blocks: prompt }
        })
        .collect()
}

pub fn run(args: GenTraceArgs) -> Result<(), Failure> {
    if args.requests == 0 || args.block_tokens == 0 {
        return Err(Failure::usage(
            "--requests and --block-tokens must be at least 1",
        ));
    }
    let trace = generate(args.kind, args.requests, args.seed);
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x5eed);
    let mut write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&args.out)?);
        let mut now = 0u64;
        for r in &trace {
            now += rng.gen_range(1..=200);
            // The last block is partly filled.
            let tokens =
                r.blocks.len() as u64 * args.block_tokens - rng.gen_range(0..args.block_tokens);
            let line = json!({"timestamp": now, "input_length": tokens, "hash_ids": r.blocks});
            writeln!(out, "{line}")?;
        }
        out.flush()
    };
    write()
        .map_err(|e| Failure::other(anyhow::anyhow!("cannot write {}: {e}", args.out.display())))?;
    let distinct: std::collections::HashSet<u64> = trace
        .iter()
        .flat_map(|r| r.blocks.iter().copied())
        .collect();
    eprintln!(
        "{}: {} requests, {} block reads, {} distinct blocks",
        args.out.display(),
        trace.len(),
        trace.iter().map(|r| r.blocks.len()).sum::<usize>(),
        distinct.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_trace_and_another_seed_another() {
        for kind in [Kind::Chat, Kind::Agents, Kind::SharedPrompt] {
            let a = generate(kind, 500, 7);
            assert_eq!(a.len(), 500);
            assert_eq!(a, generate(kind, 500, 7), "{kind:?}");
            assert_ne!(a, generate(kind, 500, 8), "{kind:?}");
        }
    }

    #[test]
    fn a_chat_turn_extends_an_earlier_turn_of_its_conversation() {
        let trace = generate(Kind::Chat, 2000, 1);
        // Every request longer than a first turn starts with the whole
        // prompt of an earlier request (its conversation's last turn).
        let later_turns = trace
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                trace[..*i]
                    .iter()
                    .any(|e| e.blocks.len() < r.blocks.len() && r.blocks.starts_with(&e.blocks))
            })
            .count();
        assert!(
            later_turns > trace.len() / 2,
            "{later_turns} of {}",
            trace.len()
        );
    }

    #[test]
    fn shared_prompt_questions_are_never_reused() {
        let trace = generate(Kind::SharedPrompt, 3000, 1);
        let mut seen = std::collections::HashMap::<u64, usize>::new();
        for r in &trace {
            for id in r.blocks.iter().rev().take(1) {
                *seen.entry(*id).or_default() += 1;
            }
        }
        // A request's last block is its question's: read once.
        assert!(seen.values().all(|&n| n == 1));
    }
}
