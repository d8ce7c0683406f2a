//! Helpers shared by the tests that run the `mooncake-store` binary.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::net::TcpListener;

pub const BIN: &str = env!("CARGO_BIN_EXE_mooncake-store");

/// A loopback port free right now (the kernel's pick).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
