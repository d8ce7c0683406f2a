//! The config file shared by every role: a `[meta]` and a `[daemon]` table,
//! each optional and fully defaulted. Command-line flags override it.

use std::path::{Path, PathBuf};

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
    /// The file at `path` (defaults if none). A file that cannot be read
    /// or does not parse is a usage error, told in one line with where in
    /// the file it is.
    pub fn load(path: Option<&Path>) -> Result<FileConfig, Failure> {
        let Some(path) = path else {
            return Ok(FileConfig::default());
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            Failure::usage(format!("cannot read config file {}: {e}", path.display()))
        })?;
        toml::from_str(&text).map_err(|e| {
            Failure::usage(format!(
                "config file {}{}",
                path.display(),
                one_line(&e, &text)
            ))
        })
    }
}

/// A parse error as `, line L, column C: message`: the TOML crate's own
/// text draws the line with a caret over several lines.
fn one_line(err: &toml::de::Error, text: &str) -> String {
    let at = err.span().map(|span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        format!(", line {line}, column {column}")
    });
    let message = err
        .message()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    format!("{}: {message}", at.unwrap_or_default())
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

    #[test]
    fn a_parse_error_is_one_line_that_says_where() {
        let text = "[meta]\n\n[daemon]\ndram = \"lots\"\n";
        let err = toml::from_str::<FileConfig>(text).unwrap_err();
        let line = one_line(&err, text);
        assert!(!line.contains('\n'), "{line}");
        assert!(
            line.starts_with(", line 4, column 8: ") && line.contains("\"lots\" is not a size"),
            "{line}"
        );
    }
}
