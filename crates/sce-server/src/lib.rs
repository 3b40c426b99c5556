//! The server of `sce serve` as a library: it turns a [`ServeConfig`] into cached volumes
//! exported over NBD, serves their counters over HTTP, and shuts down in order on SIGTERM
//! or SIGINT. The `sce` binary only parses arguments into a [`ServeConfig`] and prints.
//!
//! - [`config`]: what to serve and how, and the TOML file of `--config`.
//! - [`export`]: opening sources and caches, the checks that keep sce off what is not its
//!   own ([`ownership`]), and the cached volumes.
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
pub mod export;
pub mod group;
pub mod metrics;
pub mod ownership;
pub mod prom;
pub mod rates;
pub mod server;

pub use config::{ConfigFile, ExportConfig, ServeConfig};
pub use server::{run, Event, Stopped};

/// The target of this crate's log lines: that of the `sce serve` command they always came
/// from, so that log filters (`SCE_LOG=sce::serve=debug`) and the lines read the same.
const LOG_TARGET: &str = "sce::serve";
