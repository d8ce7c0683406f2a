//! `certs`: a development CA with a daemon certificate and a client
//! certificate, for QUIC with (mutual) TLS on a test cluster. Production
//! clusters use certificates from their own CA; the files are the same
//! shape (PEM).

use std::path::PathBuf;

use mooncake_net::DevCerts;

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory to write ca.pem, daemon.pem/.key and client.pem/.key to.
    #[arg(long)]
    out: PathBuf,
    /// Names and addresses the daemon certificate is valid for (repeat);
    /// clients check the host part of the daemon's QUIC address.
    #[arg(long = "host", default_values_t = ["127.0.0.1".to_string(), "localhost".to_string()])]
    hosts: Vec<String>,
    /// The client certificate's name (its common name).
    #[arg(long, default_value = "mooncake-client")]
    client: String,
    #[arg(long)]
    json: bool,
}

pub fn run(args: CertsArgs) -> Result<(), Failure> {
    let certs = DevCerts::generate(&args.hosts, &args.client)
        .map_err(|e| Failure::usage(format!("cannot make certificates: {e}")))?;
    certs
        .write(&args.out)
        .map_err(|e| Failure::usage(format!("--out {}: {e}", args.out.display())))?;
    if args.json {
        let out = serde_json::json!({
            "dir": args.out, "hosts": args.hosts, "client": args.client,
            "files": certs.files().iter().map(|f| f.0).collect::<Vec<_>>(),
        });
        println!("{out}");
    } else {
        let dir = args.out.display();
        println!("wrote {dir}/{{ca.pem,ca.key,daemon.pem,daemon.key,client.pem,client.key}}");
        println!("daemon: --quic-listen 0.0.0.0:7171 --tls-cert {dir}/daemon.pem --tls-key {dir}/daemon.key [--tls-client-ca {dir}/ca.pem]");
        println!("client: --quic-ca {dir}/ca.pem [--quic-cert {dir}/client.pem --quic-key {dir}/client.key]");
        println!("servers to each other (daemons with --quic-listen, meta with --quic): --peer-ca {dir}/ca.pem");
    }
    Ok(())
}
