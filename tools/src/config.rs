//! The config file shared by every role: a `[meta]` and a `[daemon]` table,
//! each optional and fully defaulted. Command-line flags override it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use mooncake_meta::MetaConfig;
use mooncake_store_daemon::DaemonConfig;
use serde::{Deserialize, Serialize};

use crate::exit::Failure;

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    pub meta: MetaConfig,
    pub daemon: DaemonConfig,
}

/// `config` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum ConfigCommand {
    /// Print the effective configuration (the file's values over the
    /// defaults) as TOML; with no file, every default.
    Print {
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

pub fn run(cmd: ConfigCommand) -> Result<(), Failure> {
    match cmd {
        ConfigCommand::Print { config } => {
            let cfg = FileConfig::load(config.as_deref())?;
            cfg.meta
                .validate()
                .map_err(|e| Failure::usage(format!("[meta] {e}")))?;
            cfg.daemon
                .validate()
                .map_err(|e| Failure::usage(format!("[daemon] {e}")))?;
            let text = toml::to_string(&cfg).map_err(|e| Failure::other(e.into()))?;
            print!("{text}");
            Ok(())
        }
    }
}

impl FileConfig {
    pub fn load(path: Option<&Path>) -> anyhow::Result<FileConfig> {
        let Some(path) = path else {
            return Ok(FileConfig::default());
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("config file {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_sets_both_roles_and_rejects_typos() {
        let cfg: FileConfig =
            toml::from_str("[meta]\nlisten = \"127.0.0.1:1\"\n[daemon]\ndram = \"8GiB\"\n")
                .unwrap();
        assert_eq!(cfg.meta.listen, "127.0.0.1:1");
        assert_eq!(cfg.daemon.dram.0, 8 << 30);
        assert!(toml::from_str::<FileConfig>("[daemon]\ndarm = \"8GiB\"\n").is_err());
    }
}
