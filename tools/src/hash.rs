//! `hash`: the block keys of a token sequence, exactly as the SDK computes
//! them. When two workers see no hits from each other, compare this output
//! with what each of them computed (seed, block size and extra must match).

use std::io::Read;

use mooncake_proto::PrefixHasher;
use serde_json::json;

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct HashArgs {
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// Chain seed (e.g. a model fingerprint); empty by default.
    #[arg(long, default_value = "")]
    seed: String,
    /// Extra bytes mixed into every block (e.g. a LoRA id).
    #[arg(long, default_value = "")]
    extra: String,
    /// Token ids; read from stdin (spaces, commas or newlines) when absent.
    tokens: Vec<u32>,
    #[arg(long)]
    json: bool,
}

pub fn run(args: HashArgs) -> Result<(), Failure> {
    if args.block_tokens == 0 {
        return Err(Failure::usage("--block-tokens must be at least 1"));
    }
    let tokens = if args.tokens.is_empty() {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        text.split(|c: char| c.is_whitespace() || c == ',')
            .filter(|t| !t.is_empty())
            .map(|t| {
                t.parse::<u32>()
                    .map_err(|_| Failure::usage(format!("{t:?} is not a token id")))
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        args.tokens
    };
    let keys = PrefixHasher::chain(
        args.seed.as_bytes(),
        &tokens,
        args.block_tokens,
        args.extra.as_bytes(),
    );
    let partial = tokens.len() % args.block_tokens;
    if args.json {
        let keys: Vec<String> = keys.iter().map(|k| k.to_hex()).collect();
        println!(
            "{}",
            json!({"block_tokens": args.block_tokens, "seed": args.seed, "extra": args.extra,
                   "tokens": tokens.len(), "keys": keys, "unhashed_tail_tokens": partial})
        );
        return Ok(());
    }
    for (i, k) in keys.iter().enumerate() {
        println!("{i:>5}  {k}");
    }
    if partial > 0 {
        eprintln!("({partial} trailing tokens do not fill a block and have no key)");
    }
    Ok(())
}
