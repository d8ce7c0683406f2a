//! `route`: the router's question asked from the shell: for a request's
//! blocks and candidate hosts, how much of its prefix each host holds and
//! where serving it costs least (`docs/events.md` has the cost).

use mooncake_proto::message::RouteCandidate;
use mooncake_proto::units::ByteSize;
use serde_json::json;

use crate::blocks::{client, namespace, parse_key, KeyArgs};
use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct RouteArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    ns: KeyArgs,
    /// Candidate hosts (the node names daemons registered with, or the
    /// serving instances the meta service's `instances` puts on them),
    /// comma separated; default: every host with a live daemon.
    #[arg(long, value_delimiter = ',')]
    candidates: Vec<String>,
    /// Work waiting at a candidate's serving instance, in blocks of
    /// prefill: NODE=BLOCKS; repeat for several.
    #[arg(long)]
    queue: Vec<String>,
    /// What moving one block between hosts costs against prefilling it.
    #[arg(long, default_value_t = 0.1)]
    transfer_cost: f64,
    /// The request's block keys in order (as `hash` prints them, or
    /// opaque keys).
    #[arg(required = true)]
    keys: Vec<String>,
    #[arg(long)]
    json: bool,
}

pub async fn run(args: RouteArgs) -> Result<(), Failure> {
    let ns = namespace(&args.ns.namespace)?;
    let hashes: Vec<_> = args.keys.iter().map(|k| parse_key(&ns, k).hash).collect();
    let mut queues = Vec::new();
    for q in &args.queue {
        let (node, blocks) = q
            .split_once('=')
            .and_then(|(n, b)| Some((n, b.parse::<u32>().ok()?)))
            .ok_or_else(|| Failure::usage(format!("--queue {q:?}: expected NODE=BLOCKS")))?;
        queues.push((node.to_string(), blocks));
    }
    if !(args.transfer_cost >= 0.0 && args.transfer_cost.is_finite()) {
        return Err(Failure::usage("--transfer-cost must be 0 or more"));
    }
    let queue_of = |node: &str| {
        queues
            .iter()
            .find(|(n, _)| n == node)
            .map_or(0, |(_, b)| *b)
    };
    let client = client(&args.target).await?;
    let mut nodes = args.candidates.clone();
    for (node, _) in &queues {
        if !nodes.contains(node) {
            if !args.candidates.is_empty() {
                return Err(Failure::usage(format!(
                    "--queue names {node}, which is not in --candidates"
                )));
            }
            nodes.push(node.clone());
        }
    }
    let candidates: Vec<RouteCandidate> = nodes
        .iter()
        .map(|n| RouteCandidate {
            node: n.clone(),
            queue: queue_of(n),
        })
        .collect();
    let answer = client
        .route(
            &ns,
            &hashes,
            &candidates,
            args.candidates.is_empty(),
            args.transfer_cost,
        )
        .await?;
    let hosts = &answer.hosts;
    let best = answer.best.map(|i| i as usize);
    if args.json {
        let hosts: Vec<_> = hosts
            .iter()
            .map(|h| {
                json!({"node": h.node, "instance": h.instance, "daemons": h.daemons, "leading": h.leading, "held": h.held,
                       "leading_nvme": h.leading_nvme, "held_nvme": h.held_nvme,
                       "reads_per_sec": h.reads_per_sec, "used": h.used, "capacity": h.capacity,
                       "queue": h.queue, "cost": h.cost_milli as f64 / 1000.0})
            })
            .collect();
        println!(
            "{}",
            json!({"blocks": answer.blocks, "matched": answer.matched, "hosts": hosts,
                   "best": best.map(|i| hosts[i]["node"].clone())})
        );
        return Ok(());
    }
    println!(
        "{} of {} blocks held in the cluster (transfer cost {} of a block's prefill)",
        answer.matched, answer.blocks, args.transfer_cost
    );
    println!(
        "{:<16} {:<12} {:>7} {:>7} {:>6} {:>6} {:>8} {:>10} {:>6} {:>9}",
        "host",
        "instance",
        "daemons",
        "leading",
        "held",
        "nvme",
        "reads/s",
        "used",
        "queue",
        "cost"
    );
    for (i, h) in hosts.iter().enumerate() {
        println!(
            "{:<16} {:<12} {:>7} {:>7} {:>6} {:>6} {:>8} {:>10} {:>6} {:>9.2}{}",
            h.node,
            if h.instance.is_empty() {
                "-"
            } else {
                &h.instance
            },
            h.daemons,
            h.leading,
            h.held,
            h.held_nvme,
            h.reads_per_sec,
            ByteSize(h.used).to_string(),
            h.queue,
            h.cost_milli as f64 / 1000.0,
            if Some(i) == best { "  <- best" } else { "" }
        );
    }
    Ok(())
}
