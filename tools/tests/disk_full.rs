//! A daemon's disk fills. The NVMe drive's space is reserved when the
//! daemon starts, so a filesystem too small for it is one clear error at
//! start, and a filesystem that fills up afterwards (another program's
//! files) takes nothing from the tier: demotions keep landing and every
//! block read back is byte for byte what was written.
//!
//! The small filesystem is a tmpfs of a few MiB, mounted in a private mount
//! namespace (`unshare -rm`), so the test needs no privileges beyond what
//! user namespaces allow.

mod common;
use common::{free_port, BIN};

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, Namespace};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(dir.join("mnt")).unwrap();
    dir
}

/// `sh -c script` in a new user and mount namespace, where `$MNT` is a
/// tmpfs of `size` and `$BIN` the store's binary.
fn in_small_fs(dir: &std::path::Path, size: &str, script: &str) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["-rm", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o size={size} none \"$MNT\" || exit 99\n{script}"
        ))
        .env("MNT", dir.join("mnt"))
        .env("BIN", BIN);
    cmd
}

#[test]
fn a_drive_larger_than_its_filesystem_is_refused_at_start_in_one_line() {
    let dir = scratch("small-fs");
    let out = in_small_fs(
        &dir,
        "8m",
        "exec \"$BIN\" up --meta-listen 127.0.0.1:0 --listen 127.0.0.1:0 --admin '' \
         --dram 4MiB --nvme \"$MNT/drive.bin:64MiB\"",
    )
    .output()
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(out.status.code(), Some(99), "cannot mount a tmpfs here");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ")
            && last.contains("drive.bin")
            && last.contains("no space for 67108864 bytes"),
        "one line naming the drive and the shortfall: {stderr}"
    );
}

/// Puts `range` blocks of 256 KiB, then reads them all back: every put is
/// stored, every hit is byte for byte right; returns the hits.
async fn put_then_get(client: &Client, range: std::ops::Range<u64>) -> usize {
    let ns = Namespace::new("t/full").unwrap();
    let value = |i: u64| -> Vec<u8> { (0..256 << 10).map(|j| (i * 7 + j / 5) as u8).collect() };
    let hash = |i: u64| BlockHash::from_opaque(&i.to_le_bytes());
    for i in range.clone() {
        let out = client.put(&ns, &[(hash(i), &value(i))]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
    // Let the demotions land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut hits = 0;
    for i in range {
        let mut buf = vec![0u8; 256 << 10];
        match client
            .get_into(&ns, &[hash(i)], &mut [&mut buf[..]])
            .await
            .unwrap()[0]
        {
            GetOutcome::Hit(n) => {
                assert_eq!(n, buf.len());
                assert!(buf == value(i), "block {i} came back with wrong bytes");
                hits += 1;
            }
            GetOutcome::Miss => {}
            GetOutcome::Failed(code) => panic!("block {i}: {code:?}"),
        }
    }
    hits
}

/// Waits for a line starting with `prefix` on the store's script output.
async fn line(
    lines: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    log: &std::path::Path,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match lines.try_recv() {
            Ok(l) if l.starts_with(prefix) => return l,
            Ok(_) => {}
            Err(std::sync::mpsc::TryRecvError::Empty) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(_) => panic!(
                "no {prefix:?} line; store log: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_that_fills_costs_misses_never_the_process_and_recovers() {
    let dir = scratch("full-fs");
    let log = dir.join("store.log");
    let (meta, daemon) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    // The store runs with an 8 MiB drive on a 64 MiB filesystem (its data
    // space reserved, its index beside it). Another program then fills the
    // filesystem, and later deletes what it wrote. DRAM evicts least
    // recently used first, so that what it keeps is the last blocks put
    // (2Q would keep the blocks read before the fill instead).
    let config = dir.join("lru.toml");
    std::fs::write(&config, "[daemon]\neviction = \"lru\"\n").unwrap();
    let script = format!(
        "( until [ -e \"$MNT/drive.bin.index/BALLAST\" ]; do sleep 0.05; done
           echo started
           until [ -e \"{fill}\" ]; do sleep 0.05; done
           dd if=/dev/zero of=\"$MNT/filler\" bs=1M count=64 2>/dev/null
           df -k \"$MNT\" | awk 'NR==2 {{print \"filled, free KiB:\", $4}}'
           until [ -e \"{release}\" ]; do sleep 0.05; done
           rm \"$MNT/filler\"; echo released ) &
         exec \"$BIN\" up --config \"{config}\" --meta-listen {meta} --listen {daemon} --admin '' \
           --dram 4MiB --nvme \"$MNT/drive.bin:8MiB\" 2>\"{log}\" >/dev/null",
        fill = dir.join("fill").display(),
        release = dir.join("release").display(),
        config = config.display(),
        log = log.display()
    );
    let mut child = in_small_fs(&dir, "64m", &script)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let store = Killed(child);
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    line(&lines, "started", &log).await;
    let client = Client::new(ClientConfig::new(meta).with_timeout(Duration::from_secs(5)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !client
        .cluster_stats()
        .await
        .is_ok_and(|st| st.daemons.iter().any(|d| d.alive))
    {
        assert!(Instant::now() < deadline, "store did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Room on the drive: 40 blocks (10 MiB) through 4 MiB of DRAM, the
    // rest demoted; all 40 fit DRAM and the drive together.
    let hits = put_then_get(&client, 0..40).await;
    assert!(hits >= 36, "before the fill: {hits} of 40 hits");

    // The filesystem fills: the drive takes no new blocks, so blocks that
    // leave DRAM now are misses; the store keeps serving and never returns
    // wrong bytes.
    std::fs::write(dir.join("fill"), b"").unwrap();
    let filled = line(&lines, "filled", &log).await;
    assert!(filled.ends_with(" 0"), "nothing left: {filled}");
    let hits = put_then_get(&client, 100..140).await;
    assert!(hits < 36, "a full drive took new blocks: {hits} of 40 hits");
    assert!(hits >= 8, "DRAM still serves: {hits} of 40 hits");

    // Room again: the drive takes blocks once more.
    std::fs::write(dir.join("release"), b"").unwrap();
    line(&lines, "released", &log).await;
    let hits = put_then_get(&client, 200..240).await;
    assert!(hits >= 36, "after the release: {hits} of 40 hits");

    drop(store);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        text.contains("index filesystem nearly full") && text.contains("has room again"),
        "the drive said when it filled and when it recovered: {text}"
    );
}
