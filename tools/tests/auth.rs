//! Authentication through the binary: tokens made by `token new`, a meta
//! service and a daemon started with `--auth`, and client commands that
//! succeed in their tenant's namespace and fail, in one line with exit code
//! 4, anywhere else or without a token.

mod common;
use common::{free_port, BIN};

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A token of `role` (and `tenant`) and its token-file entry.
fn new_token(name: &str, role: &str, tenant: Option<&str>) -> (String, String) {
    let mut args = vec!["token", "new", "--json", "--name", name, "--role", role];
    if let Some(t) = tenant {
        args.extend(["--tenant", t]);
    }
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tenant = tenant.map_or(String::new(), |t| format!("tenant = \"{t}\"\n"));
    let entry = format!(
        "[[tokens]]\nname = \"{name}\"\nsha256 = \"{}\"\nrole = \"{role}\"\n{tenant}",
        v["sha256"].as_str().unwrap()
    );
    (v["token"].as_str().unwrap().to_string(), entry)
}

fn cli(meta: &str, token: Option<&str>, args: &[&str], stdin: &[u8]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .args(["--meta", meta])
        .env_remove("MOONCAKE_TOKEN");
    if let Some(t) = token {
        cmd.env("MOONCAKE_TOKEN", t);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn a_store_with_auth_serves_each_tenant_its_own_namespaces_only() {
    let dir = std::env::temp_dir().join(format!("mooncake-cli-auth-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let (acme, acme_entry) = new_token("acme-workers", "client", Some("acme"));
    let (cluster, cluster_entry) = new_token("storage", "cluster", None);
    let file = dir.join("tokens.toml");
    std::fs::write(&file, format!("{acme_entry}\n{cluster_entry}")).unwrap();
    let file = file.to_str().unwrap();
    let meta = format!("127.0.0.1:{}", free_port());
    let _meta = Killed(
        Command::new(BIN)
            .args(["meta", "--listen", &meta, "--admin", "", "--auth", file])
            .env("MOONCAKE_TOKEN", &cluster)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _daemon = Killed(
        Command::new(BIN)
            .args([
                "daemon", "--meta", &meta, "--admin", "", "--dram", "16MiB", "--auth", file,
            ])
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .env("MOONCAKE_TOKEN", &cluster)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let put = cli(
            &meta,
            Some(&acme),
            &["put", "-n", "acme/llama", "k1"],
            b"acme bytes",
        );
        if put.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            String::from_utf8_lossy(&put.stderr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let get = cli(&meta, Some(&acme), &["get", "-n", "acme/llama", "k1"], b"");
    assert_eq!(get.stdout, b"acme bytes");

    for (token, ns) in [
        (Some(acme.as_str()), "globex"),
        (None, "acme/llama"),
        (Some("mc_forged"), "acme"),
    ] {
        let out = cli(&meta, token, &["get", "-n", ns, "k1"], b"");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{token:?} {ns}: {stderr}");
        assert!(
            stderr.contains("unauthorized") && stderr.lines().count() == 1,
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
