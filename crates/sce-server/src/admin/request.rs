//! The admin socket's request: one JSON line per request, as `sce ctl` sends it.

use serde::{Deserialize, Serialize};

/// A request, as sent by `sce ctl`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Request {
    /// status, stats, flush, exists, evict, prefetch, forget or set.
    pub verb: String,
    /// The export (None: every export for status/stats/flush, else the only or default one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<String>,
    /// exists, evict, prefetch: the range's first byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// exists, evict, prefetch: the range's length in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// set: mode, admission, seq-cutoff or population-rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// set: the new value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// flush: write write-back data to the source too (and flush it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub to_source: bool,
    /// set mode, leaving writeback: refuse if there is dirty data, rather than write it to
    /// the source first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_wait: bool,
    /// set: also write the new value into the TOML file the server was started with.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub save: bool,
}
