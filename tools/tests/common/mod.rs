//! Helpers shared by the tests that run the `mooncake-store` binary.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::net::TcpListener;

pub mod cluster;

pub const BIN: &str = env!("CARGO_BIN_EXE_mooncake-store");

/// A path in the repository, resolved at run time (a build cache may be
/// shared by checkouts in different places).
pub fn repo(rel: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
        .join("..")
        .join(rel)
}

/// A loopback port free right now (the kernel's pick).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
