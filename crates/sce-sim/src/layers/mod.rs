//! What sits around a flash cache in a simulation (Holland et al.'s system model):
//! - [`VolumeLayout`]: the volumes of a trace are separate address spaces, laid side by side
//!   in the one source address space a cache sees;
//! - [`RamCache`]: an LRU page cache in RAM above the flash cache, with Holland's write
//!   policies towards it (synchronous, asynchronous, periodic, none);
//! - [`Stack`]: one or several hosts, each with its RAM cache and flash cache, over one
//!   shared source; a write by one host invalidates the other hosts' copies (the global-
//!   knowledge scheme of Holland's simulator), and the invalidations are counted, with the
//!   etcd operations `sce serve --shared` would spend: per write, or with [`Ownership`] of
//!   regions (issue 31) only when a region changes hands or several hosts write it.
//!
//! The stack also keeps the read hit ratio and the cache bytes written per interval of
//! virtual time (the warm-up curve), issues the requests as [`Replay`] says (at their trace
//! times, or in a closed loop with a fixed number in flight), and models the I/O of the
//! reference policies over the same [`DeviceModel`]s as the engine's: latencies and the
//! devices' utilization come out for every policy alike.

mod flash;
mod host;
mod ownership;
#[cfg(test)]
mod ownership_tests;
mod stack;
#[cfg(test)]
mod tests;

pub use flash::Flash;
pub use host::{Host, RamCache};
pub use ownership::Ownership;
pub use stack::{warmup, Stack, StackResult};

#[cfg(doc)]
use crate::engine::DeviceModel;
use std::collections::BTreeMap;

const PAGE: u64 = 4096;

/// Lays the volumes of a trace side by side: each volume gets its own range of the source
/// address space, `align`-aligned, in volume-number order.
#[derive(Clone, Debug)]
pub struct VolumeLayout {
    align: u64,
    ends: BTreeMap<u32, u64>,
    bases: BTreeMap<u32, u64>,
    size: u64,
}

impl VolumeLayout {
    /// An empty layout whose volumes start at multiples of `align` (a power of two).
    pub fn new(align: u64) -> Self {
        VolumeLayout {
            align: align.max(1).next_power_of_two(),
            ends: BTreeMap::new(),
            bases: BTreeMap::new(),
            size: 0,
        }
    }

    /// Notes that `volume` is addressed up to byte `end` (exclusive).
    pub fn observe(&mut self, volume: u32, end: u64) {
        let e = self.ends.entry(volume).or_insert(0);
        *e = (*e).max(end);
    }

    /// Fixes the bases once every request has been observed.
    pub fn finish(&mut self) {
        let mut base = 0u64;
        self.bases.clear();
        for (&v, &end) in &self.ends {
            self.bases.insert(v, base);
            let span = end.max(1).div_ceil(self.align).saturating_mul(self.align);
            base = base.saturating_add(span);
        }
        self.size = base.max(self.align);
    }

    /// Where byte `offset` of `volume` is in the source address space (None for a volume
    /// that was never observed).
    pub fn place(&self, volume: u32, offset: u64) -> Option<u64> {
        self.bases.get(&volume).map(|b| b.saturating_add(offset))
    }

    /// Bytes of the source address space.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of volumes.
    pub fn volumes(&self) -> usize {
        self.ends.len()
    }
}

/// When the RAM cache writes modified pages down to the flash cache (Holland's four).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RamPolicy {
    /// Synchronous write-through: the write goes down at once (the application waits).
    Sync,
    /// Asynchronous write-through: the write goes down at once, the application does not
    /// wait. In a trace replay, which has no application to block, the flash cache sees
    /// the same stream as with `Sync`.
    Async,
    /// Every so many nanoseconds of trace time, all modified pages go down (in address
    /// order, coalesced into runs); a modified page evicted earlier goes down then.
    Periodic(u64),
    /// Modified pages go down only when evicted (and at the end of the trace).
    None,
}

impl std::str::FromStr for RamPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "sync" => RamPolicy::Sync,
            "async" => RamPolicy::Async,
            "none" => RamPolicy::None,
            _ => match s.strip_prefix("periodic:") {
                Some(secs) => {
                    let v: f64 = secs
                        .parse()
                        .map_err(|_| format!("ram policy {s:?}: {secs:?} is not seconds"))?;
                    if !(v.is_finite() && v > 0.0) {
                        return Err(format!("ram policy {s:?}: the period must be > 0"));
                    }
                    RamPolicy::Periodic((v * 1e9) as u64)
                }
                None => {
                    return Err(format!(
                        "unknown ram policy {s:?} (sync, async, periodic:SECS or none)"
                    ))
                }
            },
        })
    }
}

/// How the requests of a trace are issued in virtual time.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Replay {
    /// Open loop: each request issues at its trace time, whatever the devices sustain (a
    /// trace faster than the models queues on them).
    #[default]
    Open,
    /// Closed loop with this many requests in flight: the trace times are ignored, and a
    /// request issues as soon as one of the requests in flight completes (the first `QD` at
    /// time zero). A read completes when its data is read (and inline fills written), a
    /// write when it is acknowledged, a request served by the RAM cache at once.
    Closed(u32),
}

impl Replay {
    /// The most requests in flight `closed:QD` takes.
    pub const MAX_QUEUE_DEPTH: u32 = 1 << 20;
}

impl std::fmt::Display for RamPolicy {
    /// As `--ram-policy` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RamPolicy::Sync => f.write_str("sync"),
            RamPolicy::Async => f.write_str("async"),
            RamPolicy::Periodic(ns) => write!(f, "periodic:{}", *ns as f64 / 1e9),
            RamPolicy::None => f.write_str("none"),
        }
    }
}

impl std::fmt::Display for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replay::Open => write!(f, "open"),
            Replay::Closed(qd) => write!(f, "closed:{qd}"),
        }
    }
}

impl std::str::FromStr for Replay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "open" {
            return Ok(Replay::Open);
        }
        let qd = s
            .strip_prefix("closed:")
            .ok_or_else(|| format!("unknown replay {s:?} (open or closed:QD)"))?;
        match qd.parse::<u32>() {
            Ok(n) if (1..=Self::MAX_QUEUE_DEPTH).contains(&n) => Ok(Replay::Closed(n)),
            _ => Err(format!(
                "replay {s:?}: the queue depth must be 1 to {}",
                Self::MAX_QUEUE_DEPTH
            )),
        }
    }
}
