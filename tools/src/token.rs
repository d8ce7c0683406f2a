//! `token new`: a fresh random token and the entry that lists it in a
//! token file. The file keeps only the token's SHA-256; the token itself is
//! printed once, for the worker or daemon that will present it.

use mooncake_proto::auth::{token_digest, Role};
use mooncake_proto::Namespace;
use rand::RngCore;

use crate::exit::Failure;

#[derive(clap::Subcommand, Debug)]
pub enum TokenCommand {
    /// Print a new token and its `[[tokens]]` entry for the token file.
    New {
        /// Who holds it, for logs: e.g. `acme-prefill`.
        #[arg(long)]
        name: String,
        /// client (a tenant's workers), cluster (daemons and meta
        /// replicas) or admin (operators).
        #[arg(long, default_value = "client")]
        role: String,
        /// The tenant of a client token: it may use the namespace of that
        /// name and those below it (`acme`, `acme/llama-3`).
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: TokenCommand) -> Result<(), Failure> {
    let TokenCommand::New {
        name,
        role,
        tenant,
        json,
    } = cmd;
    let parsed = Role::parse(&role)
        .ok_or_else(|| Failure::usage(format!("--role {role}: client, cluster or admin")))?;
    match (parsed, &tenant) {
        (Role::Client, None) => return Err(Failure::usage("a client token needs --tenant")),
        (Role::Cluster | Role::Admin, Some(_)) => {
            return Err(Failure::usage("only client tokens have a --tenant"))
        }
        (_, Some(t)) => {
            Namespace::new(t.clone())
                .map_err(|e| Failure::usage(format!("--tenant {t:?}: {e}")))?;
        }
        _ => {}
    }
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    let token = format!("mc_{}", hex::encode(raw));
    let digest = token_digest(&token);
    if json {
        let out = serde_json::json!({
            "token": token, "name": name, "role": role, "tenant": tenant, "sha256": digest,
        });
        println!("{out}");
        return Ok(());
    }
    println!("token (give it to its holder; it is not stored anywhere):\n  {token}\n");
    println!("entry for the token file:\n");
    println!("[[tokens]]\nname = {name:?}\nsha256 = \"{digest}\"\nrole = \"{role}\"");
    if let Some(t) = tenant {
        println!("tenant = {t:?}");
    }
    Ok(())
}
