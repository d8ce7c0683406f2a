//! The README's encrypted set-ups through the binary: QUIC and TLS over
//! TCP with a development CA (`mooncake-store certs`), mutual TLS, and the
//! one-line refusal of a client that does not speak them.

mod common;
use common::store::{run, succeeded, Store, FRESH};
use common::BIN;

use std::process::Command;

/// A development CA and certificates (`mooncake-store certs`) in a scratch
/// folder named after `what`: the folder, and the certificates' folder.
fn dev_certs(what: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("mooncake-cli-{what}-{}", std::process::id()));
    let certs = dir.join("certs").to_str().unwrap().to_string();
    let made = Command::new(BIN)
        .args(["certs", "--out", &certs])
        .output()
        .unwrap();
    succeeded(&made);
    (dir, certs)
}

/// Puts a 300 KB block as `key` and gets it back, with `client` arguments.
fn round_trips(meta: &str, key: &str, client: &[&str]) {
    let value: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let put = run(meta, &[&["put", key], client].concat(), Some(&value));
    succeeded(&put);
    let get = run(meta, &[&["get", key], client].concat(), None);
    succeeded(&get);
    assert!(get.stdout == value, "wrong bytes with {client:?}");
}

#[test]
fn the_readme_quic_commands_work_and_mutual_tls_refuses_strangers() {
    let (dir, certs) = dev_certs("quic");
    let (cert, key, ca) = (
        format!("{certs}/daemon.pem"),
        format!("{certs}/daemon.key"),
        format!("{certs}/ca.pem"),
    );
    let store = Store::up_with(&[
        "--quic-listen",
        FRESH,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    let quic = store.fresh[0].clone();
    let (client_cert, client_key) = (format!("{certs}/client.pem"), format!("{certs}/client.key"));
    let with_cert = [
        "--quic-ca",
        ca.as_str(),
        "--quic-cert",
        client_cert.as_str(),
        "--quic-key",
        client_key.as_str(),
    ];
    round_trips(&store.meta, "qblock", &with_cert);
    // Without a client certificate the store refuses the handshake (the
    // meta service first): a clean failure, exit code 4 (refused), the
    // reason on stderr, and no bytes.
    let anonymous = run(&store.meta, &["get", "qblock", "--quic-ca", &ca], None);
    assert_eq!(anonymous.status.code(), Some(4), "refused");
    assert!(anonymous.stdout.is_empty());
    let why = String::from_utf8_lossy(&anonymous.stderr);
    assert!(why.contains("quic"), "the reason names QUIC: {why}");
    let stat = run(&store.meta, &["stat", "--json"], None);
    let stat = String::from_utf8_lossy(&stat.stdout);
    assert!(
        stat.contains(&format!("\"quic\":\"{quic}\"")),
        "stat lists the QUIC endpoint: {stat}"
    );
    let transports = Command::new(BIN)
        .args(["transports", "--json"])
        .output()
        .unwrap();
    let json = String::from_utf8_lossy(&transports.stdout);
    assert!(json.contains("\"quic\":{\"available\":true"), "{json}");
    assert!(json.contains("\"rdma\":{\"available\":false"), "{json}");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_readme_tls_commands_work_and_a_plain_client_is_told_why() {
    let (dir, certs) = dev_certs("tls");
    let (cert, key, ca) = (
        format!("{certs}/daemon.pem"),
        format!("{certs}/daemon.key"),
        format!("{certs}/ca.pem"),
    );
    // `up --tls` without --peer-ca: a usage error that names the flag.
    let incomplete = Command::new(BIN)
        .args(["up", "--tls", "--tls-cert", &cert, "--tls-key", &key])
        .output()
        .unwrap();
    assert_eq!(incomplete.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&incomplete.stderr).contains("--peer-ca"),
        "{}",
        String::from_utf8_lossy(&incomplete.stderr)
    );
    let (client_cert, client_key) = (format!("{certs}/client.pem"), format!("{certs}/client.key"));
    let with_cert = [
        "--tls-ca",
        ca.as_str(),
        "--tls-client-cert",
        client_cert.as_str(),
        "--tls-client-key",
        client_key.as_str(),
    ];
    let store = Store::launch(
        "64MiB",
        &[
            "--tls",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
            "--peer-ca",
            &ca,
        ],
        &with_cert,
    );
    round_trips(&store.meta, "tblock", &with_cert);
    // A plain client, and one without a client certificate: refused (exit
    // code 4), the reason in one line, no bytes.
    for (who, args) in [
        ("plain", vec!["get", "tblock"]),
        ("no certificate", vec!["get", "tblock", "--tls-ca", &ca]),
    ] {
        let refused = run(&store.meta, &args, None);
        assert_eq!(refused.status.code(), Some(4), "{who}: refused");
        assert!(refused.stdout.is_empty(), "{who}");
        let why = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(why.trim_end().lines().count(), 1, "{who}: one line: {why}");
        if who == "plain" {
            assert!(why.contains("speaks TLS only"), "{who}: {why}");
        }
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
