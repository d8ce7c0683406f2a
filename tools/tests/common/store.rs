//! `mooncake-store up` as a user starts it, and the block commands run
//! against it from another process.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, BIN};

/// A running `mooncake-store up`, killed when dropped.
pub struct Store {
    pub child: Child,
    pub meta: String,
    /// Its daemon's data address.
    pub daemon: String,
    /// The addresses that stood for [`FRESH`] in `up`'s arguments.
    pub fresh: Vec<String>,
    /// Its stderr, shown when it fails to start.
    pub log: std::path::PathBuf,
}

impl Store {
    pub fn up() -> Store {
        Store::up_with(&[])
    }

    /// `up` with more arguments.
    pub fn up_with(extra: &[&str]) -> Store {
        Store::up_sized("64MiB", extra)
    }

    /// `up` with a DRAM pool of `dram`, and more arguments.
    pub fn up_sized(dram: &str, extra: &[&str]) -> Store {
        Store::launch(dram, extra, &[])
    }

    /// `up` with more arguments, ready once a client with `client`'s
    /// arguments sees its daemon. An argument [`FRESH`] becomes a loopback
    /// address on a free port (in `Store::fresh`, in order); a start that
    /// lost one of its ports to another process is retried on new ones.
    pub fn launch(dram: &str, extra: &[&str], client: &[&str]) -> Store {
        for _ in 0..3 {
            match Store::try_launch(dram, extra, client) {
                Ok(store) => return store,
                Err(why) if why.contains("in use") => continue,
                Err(why) => panic!("{why}"),
            }
        }
        panic!("up found a port taken three times over");
    }

    fn try_launch(dram: &str, extra: &[&str], client: &[&str]) -> Result<Store, String> {
        let address = || format!("127.0.0.1:{}", free_port());
        let (meta, daemon) = (address(), address());
        let mut fresh = Vec::new();
        let extra: Vec<String> = extra
            .iter()
            .map(|arg| {
                if *arg == FRESH {
                    fresh.push(address());
                    fresh.last().unwrap().clone()
                } else {
                    arg.to_string()
                }
            })
            .collect();
        static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log_path =
            std::env::temp_dir().join(format!("mooncake-cli-up-{}-{n}.log", std::process::id()));
        let log = std::fs::File::create(&log_path).unwrap();
        // No admin port unless the test asks for one.
        let admin: &[&str] = if extra.iter().any(|a| a == "--admin") {
            &[]
        } else {
            &["--admin", ""]
        };
        let child = Command::new(BIN)
            .args([
                "up",
                "--meta-listen",
                &meta,
                "--listen",
                &daemon,
                "--dram",
                dram,
            ])
            .args(admin)
            .args(&extra)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        // Owned at once, so that any failure below still stops the process.
        let mut store = Store {
            child,
            meta: meta.clone(),
            daemon: daemon.clone(),
            fresh,
            log: log_path,
        };
        let mut line = String::new();
        BufReader::new(store.child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        if !line.starts_with("mooncake-store up:") {
            let _ = store.child.wait();
            let log = std::fs::read_to_string(&store.log).unwrap_or_default();
            return Err(format!("unexpected banner {line:?}; stderr: {log}"));
        }
        assert!(line.contains(&meta) && line.contains(&daemon));
        // The daemon registers right after the banner.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let out = run(&meta, &[&["stat", "--json"], client].concat(), None);
            if out.status.success()
                && String::from_utf8_lossy(&out.stdout).contains("\"alive\":true")
            {
                return Ok(store);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(&store.log).unwrap_or_default();
        panic!("store did not come up; stderr: {log}");
    }
}

/// In `Store::launch`'s arguments: a loopback address on a free port.
pub const FRESH: &str = "<fresh address>";

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Asserts that a command succeeded, showing its stderr if it did not.
pub fn succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn run(meta: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .args(["--meta", meta])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        input.write_all(bytes).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}
