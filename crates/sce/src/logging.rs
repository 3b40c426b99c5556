//! Log options shared by every subcommand: `-v`, `--log-level`, `--log-format`.
//!
//! Logs go to stderr through `tracing`, each event once: as text (a timestamp, the level,
//! the target and the message) or as one JSON object per line. Which events show: the
//! `--log-level` filter if given, else `SCE_LOG` if set, else `info` for `serve` and
//! `warn` for the other subcommands, raised one level by each `-v`. A closed stderr drops
//! the log lines, and nothing else: the server goes on serving.

use tracing_subscriber::EnvFilter;

/// The log format on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    Text,
    /// One JSON object per line: timestamp, level, target, fields (message and the rest).
    Json,
}

/// The log options, global to every subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct LogArgs {
    /// More log detail: -v one level more than the default (info for serve, warn for the
    /// rest), -vv two.
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log level (error, warn, info, debug, trace) or a filter such as
    /// `info,sce::serve=debug`. Overrides -v and the SCE_LOG variable.
    #[arg(long, global = true, value_name = "LEVEL|FILTER")]
    pub log_level: Option<String>,
    /// Log format on stderr: text, or json (one object per line, for log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

impl LogArgs {
    /// The filter: `--log-level`, else SCE_LOG, else `default` raised by -v.
    pub fn filter(&self, default: &str) -> Result<EnvFilter, String> {
        if let Some(f) = &self.log_level {
            return EnvFilter::try_new(f).map_err(|e| format!("--log-level {f:?}: {e}"));
        }
        if let Ok(f) = EnvFilter::try_from_env("SCE_LOG") {
            if self.verbose == 0 {
                return Ok(f);
            }
        }
        let base = LEVELS.iter().position(|l| *l == default).unwrap_or(1);
        let level = LEVELS[(base + self.verbose as usize).min(LEVELS.len() - 1)];
        // rustls warns of every client that sends an IP address as its server name (libnbd
        // does): noise for an operator; its errors still show.
        Ok(EnvFilter::new(format!("{level},rustls=error")))
    }

    /// Installs the subscriber for the process.
    pub fn init(&self, default: &str) -> Result<(), String> {
        let filter = self.filter(default)?;
        // A log line that cannot be written (stderr closed: `sce serve 2>&1 | head -1`)
        // is dropped. The default reports it with `eprintln!`, which panics on a closed
        // stderr and took the server down.
        let b = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .log_internal_errors(false);
        match self.log_format {
            LogFormat::Text => b
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init(),
            LogFormat::Json => b.json().with_ansi(false).init(),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(verbose: u8, level: Option<&str>) -> LogArgs {
        LogArgs {
            verbose,
            log_level: level.map(str::to_string),
            log_format: LogFormat::Text,
        }
    }

    #[test]
    fn verbosity_raises_the_default_and_log_level_wins() {
        // rustls is held at errors unless --log-level says otherwise.
        let f = |v, d| args(v, None).filter(d).unwrap().to_string();
        assert_eq!(f(0, "warn"), "rustls=error,warn");
        assert_eq!(f(1, "info"), "rustls=error,debug");
        assert_eq!(f(9, "info"), "rustls=error,trace");
        assert_eq!(
            args(2, Some("error")).filter("info").unwrap().to_string(),
            "error"
        );
        assert!(args(0, Some("sce=nonsense=1")).filter("info").is_err());
    }
}
