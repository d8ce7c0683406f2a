//! Bytes from a config file: parsed and validated, or refused with an
//! error; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = toml::from_str::<mooncake_store_daemon::DaemonConfig>(text) {
        let _ = cfg.validate();
    }
    if let Ok(cfg) = toml::from_str::<mooncake_meta::MetaConfig>(text) {
        let _ = cfg.validate();
    }
    let _ = text.parse::<mooncake_proto::units::ByteSize>();
    let _ = text.parse::<mooncake_proto::units::HumanDuration>();
});
