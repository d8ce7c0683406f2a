//! What a Mooncake connector key says of its block. vLLM's Mooncake store
//! connector (and vLLM Ascend's) build keys of `@`-separated fields, and
//! Mooncake's event format carries those fields apart (`docs/events.md`,
//! "Mooncake's format"). The forms read here:
//!
//! - `[cache_prefix@]model@tp_rank:N@pcpN@dcpN@pp_rank:N[@group:G]@hash`
//!   (vLLM; the `group` field came with later connectors);
//! - `model@pcpN@dcpN@head_or_tp_rank:N@pp_rank:N@hash` and
//!   `model@pcpN@dcpN@head_or_tp_rank:N@hash@layer` (vLLM Ascend).
//!
//! `hash` is hexadecimal (an optional `0x`, then an even number of at
//! least 16 digits); its last 16 digits, read as a big-endian integer,
//! are the block's 64-bit hash. Any other key names no connector fields.

/// The fields of a connector key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyParts<'a> {
    pub cache_prefix: Option<&'a str>,
    pub model: &'a str,
    pub tp_rank: Option<u64>,
    pub head_or_tp_rank: Option<u64>,
    pub pcp_rank: Option<u64>,
    pub dcp_rank: Option<u64>,
    pub pp_rank: Option<u64>,
    pub group: Option<&'a str>,
    pub layer_id: Option<u64>,
    /// The hash as the key writes it.
    pub block_hash: &'a str,
    /// Its last 8 bytes, big-endian.
    pub seq_hash: u64,
}

/// The connector fields of `key`, if it is a connector key.
pub fn parse(key: &str) -> Option<KeyParts<'_>> {
    let fields: Vec<&str> = key.split('@').collect();
    if let Some(at) = fields.iter().position(|f| f.starts_with("tp_rank:")) {
        return vllm(key, &fields, at);
    }
    if fields
        .get(3)
        .is_some_and(|f| f.starts_with("head_or_tp_rank:"))
    {
        return ascend(&fields);
    }
    None
}

fn vllm<'a>(key: &'a str, fields: &[&'a str], at: usize) -> Option<KeyParts<'a>> {
    let model = *fields.get(at.checked_sub(1)?)?;
    // The prefix may hold `@`s of its own: everything before the model.
    let cache_prefix = (at >= 2).then(|| {
        let len: usize = fields[..at - 1].iter().map(|f| f.len() + 1).sum();
        &key[..len - 1]
    });
    let rest = &fields[at..];
    let (group, hash) = match rest.len() {
        5 => (None, rest[4]),
        6 => (Some(rest[4].strip_prefix("group:")?), rest[5]),
        _ => return None,
    };
    let (block_hash, seq_hash) = hex_hash(hash)?;
    Some(KeyParts {
        cache_prefix,
        model,
        tp_rank: Some(number(rest[0], "tp_rank:")?),
        pcp_rank: Some(number(rest[1], "pcp")?),
        dcp_rank: Some(number(rest[2], "dcp")?),
        pp_rank: Some(number(rest[3], "pp_rank:")?),
        group,
        block_hash,
        seq_hash,
        ..KeyParts::default()
    })
}

fn ascend<'a>(fields: &[&'a str]) -> Option<KeyParts<'a>> {
    if fields.len() != 6 {
        return None;
    }
    let parts = KeyParts {
        model: fields[0],
        pcp_rank: Some(number(fields[1], "pcp")?),
        dcp_rank: Some(number(fields[2], "dcp")?),
        head_or_tp_rank: Some(number(fields[3], "head_or_tp_rank:")?),
        ..KeyParts::default()
    };
    if let Some(pp) = fields[4].strip_prefix("pp_rank:") {
        let (block_hash, seq_hash) = hex_hash(fields[5])?;
        return Some(KeyParts {
            pp_rank: Some(pp.parse().ok()?),
            block_hash,
            seq_hash,
            ..parts
        });
    }
    let (block_hash, seq_hash) = hex_hash(fields[4])?;
    Some(KeyParts {
        layer_id: Some(fields[5].parse().ok()?),
        block_hash,
        seq_hash,
        ..parts
    })
}

fn number(field: &str, name: &str) -> Option<u64> {
    let digits = field.strip_prefix(name)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The hash as written, and its last 16 digits as an integer.
fn hex_hash(text: &str) -> Option<(&str, u64)> {
    let digits = text.strip_prefix("0x").unwrap_or(text);
    if digits.len() < 16 || digits.len() % 2 != 0 || !digits.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    let seq = u64::from_str_radix(&digits[digits.len() - 16..], 16).ok()?;
    Some((text, seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "00112233445566778899aabbccddeeff0011223344556677deadbeefcafef00d";

    #[test]
    fn vllm_connector_keys_give_their_model_ranks_group_and_hash() {
        let key = format!("Qwen/Qwen3-8B@tp_rank:1@pcp0@dcp2@pp_rank:3@group:0@{HASH}");
        let parts = parse(&key).unwrap();
        assert_eq!(parts.model, "Qwen/Qwen3-8B");
        assert_eq!(parts.cache_prefix, None);
        assert_eq!(
            (parts.tp_rank, parts.pcp_rank, parts.dcp_rank, parts.pp_rank),
            (Some(1), Some(0), Some(2), Some(3))
        );
        assert_eq!(parts.group, Some("0"));
        assert_eq!(parts.block_hash, HASH);
        assert_eq!(parts.seq_hash, 0xdeadbeefcafef00d);
        // Without a group, and behind a prefix that holds an `@` itself.
        let key = format!("run@7@m@tp_rank:0@pcp0@dcp0@pp_rank:0@0x{HASH}");
        let parts = parse(&key).unwrap();
        assert_eq!((parts.cache_prefix, parts.model), (Some("run@7"), "m"));
        assert_eq!(parts.group, None);
        assert_eq!(parts.block_hash, format!("0x{HASH}"));
        assert_eq!(parts.seq_hash, 0xdeadbeefcafef00d);
    }

    #[test]
    fn vllm_ascend_keys_give_their_head_rank_and_pipeline_rank_or_layer() {
        let key = format!("m@pcp1@dcp0@head_or_tp_rank:4@pp_rank:2@{HASH}");
        let parts = parse(&key).unwrap();
        assert_eq!(
            (parts.head_or_tp_rank, parts.pp_rank, parts.layer_id),
            (Some(4), Some(2), None)
        );
        let key = format!("m@pcp1@dcp0@head_or_tp_rank:4@{HASH}@17");
        let parts = parse(&key).unwrap();
        assert_eq!((parts.pp_rank, parts.layer_id), (None, Some(17)));
        assert_eq!(parts.seq_hash, 0xdeadbeefcafef00d);
    }

    #[test]
    fn other_keys_and_bad_hashes_name_no_connector_fields() {
        for key in [
            "plain-key".to_string(),
            format!("{HASH}_0_k"),
            "m@tp_rank:0@pcp0@dcp0@pp_rank:0@0123456789abcde".into(), // 15 digits
            "m@tp_rank:0@pcp0@dcp0@pp_rank:0@0123456789abcdef0".into(), // odd
            "m@tp_rank:0@pcp0@dcp0@pp_rank:0@0123456789abcdeg".into(),
            format!("m@tp_rank:x@pcp0@dcp0@pp_rank:0@{HASH}"),
            format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@grp:1@{HASH}"),
            format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@{HASH}@extra@more"),
            format!("tp_rank:0@pcp0@dcp0@pp_rank:0@{HASH}"),
            format!("m@pcp1@dcp0@head_or_tp_rank:4@{HASH}@layer"),
        ] {
            assert_eq!(parse(&key), None, "{key}");
        }
    }
}
