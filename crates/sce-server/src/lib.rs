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
