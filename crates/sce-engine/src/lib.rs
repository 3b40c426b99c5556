//! `sce-engine`: drives the `sce-core` state machine against real `BlockDevice`s.
//!
//! [`CacheVolume`] is the cached volume: a `BlockDevice` that any number of threads may use
//! at once, with background population workers (Algorithm 1), AWT writer threads and
//! counters ([`VolumeStats`]).

mod awt;
mod brlock;
mod cleaner;
mod control;
mod device;
mod flusher;
mod health;
mod outage;
pub mod parts;
pub mod persist;
mod population;
mod queued;
mod read;
mod shard;
mod shared;
pub mod stats;
mod verify;
pub mod volume;
mod wback;
mod write;

pub use control::WriteBackStats;
pub use parts::VolumePart;
pub use persist::{PersistConfig, PersistStats};
pub use stats::VolumeStats;
pub use volume::{CacheVolume, EngineConfig, EngineError};
