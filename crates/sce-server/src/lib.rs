//! The server of `sce serve` as a library: it turns a [`ServeConfig`] into cached volumes
//! exported over NBD, serves their counters over HTTP, and shuts down in order on SIGTERM
//! or SIGINT. The `sce` binary only parses arguments into a [`ServeConfig`] and prints.
//!
//! - [`config`]: what to serve and how, and the TOML file of `--config`.
//! - [`export`]: opening sources and caches, the checks that keep sce off what is not its
//!   own ([`ownership`]), and the cached volumes.
//! - [`group`]: every export built into what the NBD server serves; exports that name one
//!   cache device share it.
//! - [`metrics`]: the HTTP endpoint, its Prometheus text and its JSON /stats document.
//! - [`server`]: listeners, the signal hook and the shutdown sequence.
//! - [`admin`]: the admin socket that `sce ctl` talks to.
//! - [`attach`]: a cached export whose cache can be detached and attached while it serves.
//! - [`coherent`]: shared mode, several hosts caching one volume through etcd.
//! - [`admission`]: the options of flash-conscious admission, shared with `demo` and `sim`.

pub mod admin;
pub mod admission;
pub mod attach;
pub mod coherent;
pub mod config;
pub mod counters;
pub mod export;
pub mod group;
pub mod health;
pub mod log_size;
pub mod metrics;
pub mod ownership;
pub mod prom;
pub mod rates;
pub mod server;

pub use config::{ConfigFile, ExportConfig, ServeConfig};
pub use server::{run, Event, Stopped};

/// The target of this crate's log lines: that of the `sce serve` command they always came
/// from, so that log filters (`SCE_LOG=sce::serve=debug`) and the lines read the same. An
/// export's name goes in as a string field (`export = n`, not `%n`): the text format quotes
/// it (`export=""` for the default export, where a bare `export=` read as a field left out),
/// and the JSON format writes a JSON string.
const LOG_TARGET: &str = "sce::serve";

/// `e` and its causes joined by ": ", as `{:#}` does, but without a cause whose text the
/// message before it already ends with (an error that prints its source, and also names it
/// as its source, would otherwise say it twice): how `sce` and the admin socket say an error.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.ends_with(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_text;
    use anyhow::Context;

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        let os = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
        let open = sce_io::IoError::Open {
            path: "/tmp/s.sock".into(),
            source: os,
        };
        let e = Err::<(), _>(open).context("export \"\"").unwrap_err();
        let text = error_text(&e);
        assert_eq!(text.matches("os error 111").count(), 1, "{text}");
        assert!(
            text.starts_with("export \"\": cannot open /tmp/s.sock: "),
            "{text}"
        );
        // A cause not yet said is still said.
        let e = Err::<(), _>(std::io::Error::other("disk on fire"))
            .context("loading the cache")
            .unwrap_err();
        assert_eq!(error_text(&e), "loading the cache: disk on fire");
    }
}
