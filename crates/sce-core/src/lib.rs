//! `sce-core`: the sans-I/O state machine of the SCE flash cache.
//!
//! It holds the geometry (4 KiB pages, power-of-two fragments from 4 KiB to 64 MiB), the
//! direct-mapped fragment table, slot descriptors with page-validity bitmaps, the eviction
//! policies (generalized CLOCK, LRU, FIFO), the MRU hotness window, the admission policies
//! (`sce`, `sce-paper`, `always`, `nhit:K`), the frequency sketch, stream detector and
//! budgets of flash-conscious admission ([`admit`]), the page area of single pages
//! ([`pagearea`]), Algorithm 1's population throttle and the write modes (`awt`,
//! `write-around`, `write-through`, `passthrough`; write-back is the volume's mode, served by
//! the engine's write-back log with the core's shards in write-through: [`WriteMode`]). It
//! does no I/O, starts no thread and reads no
//! clock: drivers call it and perform the I/O it plans. See [`cache`] for the protocol.
//! [`units`] parses and prints sizes and durations as people write them (`4GiB`, `2ms`),
//! for the command line, the server's configuration and the simulator alike. [`regions`] is
//! shared mode's ownership of regions, one host's view, stepped by events: the server and
//! the simulator's `--hosts` mode both drive it.

pub mod addr;
pub mod admit;
pub mod bitmap;
pub mod cache;
pub mod config;
pub mod evict;
pub mod geometry;
mod global;
pub mod hotness;
pub mod map;
pub mod pagearea;
pub mod regions;
mod sharded;
pub mod shards;
mod slab;
pub mod slots;
pub mod stats;
pub mod throttle;
pub mod units;
pub mod wbtune;

pub use addr::{CacheOffset, FragNo, Nanos, SlotNo, SourceOffset, PAGE_SIZE, SECTOR_SIZE};
pub use cache::{
    AccessLog, CacheCopy, CacheCore, CacheWrite, FillRun, HeldRead, PinnedRead, PopId, Populating,
    Population, PopulationJob, ReadPlan, ReadRun, RequestError, Retune, RunTarget, SourceWrite,
    WriteId, WriteKind, WritePlan, WriteTxn,
};
pub use config::{Admission, ConfigError, CoreConfig, ThrottleConfig, WriteMode};
pub use evict::EvictionKind;
pub use geometry::Geometry;
pub use global::GlobalCore;
pub use sharded::{Globalize, OnShard, ShardedCore, ShardedRead};
pub use shards::{shards_for, Piece, ShardMap, AUTO_CORE_SHARDS, MIN_SLOTS_PER_AUTO_SHARD};
pub use stats::CoreStats;
pub use throttle::ThrottleState;
pub use wbtune::WritebackTuning;
