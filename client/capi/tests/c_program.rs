//! A C program, compiled against the committed header and linked with the
//! static library, runs against a real store.

use std::path::PathBuf;
use std::process::Command;

use mooncake_tests::TestCluster;

/// The static library cargo built beside this test: the newest copy (the
/// one in the profile directory is only refreshed by `cargo build`).
fn static_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps.join("libmooncake.a"), deps.join("../libmooncake.a")]
        .into_iter()
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .expect("libmooncake.a next to the test binary")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c_program_round_trips_blocks_through_the_c_abi() {
    let cluster = TestCluster::start(64 << 20).await;
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = std::env::temp_dir().join(format!("mooncake-c-{}", std::process::id()));
    let cc = Command::new("cc")
        .arg(root.join("tests/c/round_trip.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg(static_lib())
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .output()
        .expect("a C compiler (cc)");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let meta = cluster.meta_addr.clone();
    let run = tokio::task::spawn_blocking(move || Command::new(&out).arg(meta).output())
        .await
        .unwrap()
        .unwrap();
    let _ = std::fs::remove_file(
        std::env::temp_dir().join(format!("mooncake-c-{}", std::process::id())),
    );
    assert!(
        run.status.success() && String::from_utf8_lossy(&run.stdout).trim() == "ok",
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
