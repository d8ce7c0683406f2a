//! `transports`: which data paths this host can offer (TCP, QUIC, shared
//! memory, RDMA), and why not one it cannot.

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct TransportsArgs {
    #[arg(long)]
    json: bool,
}

/// Prints the data paths this build and host offer.
pub fn run(args: TransportsArgs) -> Result<(), Failure> {
    let rdma = rdma_status();
    let rows = [
        ("tcp", Ok("every daemon serves it".to_string())),
        (
            "quic",
            Ok("TLS 1.3 (rustls, ring); daemons: --quic-listen".to_string()),
        ),
        (
            "shm",
            Ok("same-host pool in a memfd; daemons: --shm-socket".to_string()),
        ),
        ("rdma", rdma),
    ];
    if args.json {
        let out: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(name, status)| {
                let v = match status {
                    Ok(what) => serde_json::json!({"available": true, "detail": what}),
                    Err(why) => serde_json::json!({"available": false, "detail": why}),
                };
                (name.to_string(), v)
            })
            .collect();
        println!("{}", serde_json::Value::Object(out));
    } else {
        for (name, status) in rows {
            match status {
                Ok(what) => println!("{name:<5} yes  {what}"),
                Err(why) => println!("{name:<5} no   {why}"),
            }
        }
    }
    Ok(())
}

#[cfg(feature = "rdma")]
fn rdma_status() -> Result<String, String> {
    use mooncake_net::rdma::{devices, Nic, NicChoice};
    let names: Vec<String> = devices()?
        .iter()
        .map(|d| format!("{} ({})", d.name, d.transport))
        .collect();
    let nic = Nic::open(&NicChoice::default())?;
    Ok(format!(
        "devices {}; would use {nic:?} (daemons: --rdma-listen, clients: --rdma)",
        names.join(", ")
    ))
}

#[cfg(not(feature = "rdma"))]
fn rdma_status() -> Result<String, String> {
    Err("not built with the `rdma` feature (cargo build --features rdma)".to_string())
}
