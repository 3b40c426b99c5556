//! `sce-engine`: drives the `sce-core` state machine against real `BlockDevice`s.
//!
//! [`CacheVolume`] is the cached volume: a `BlockDevice` that any number of threads may use
//! at once, with background population workers (Algorithm 1), AWT writer threads and
//! counters ([`VolumeStats`]).

mod brlock;
mod checks;
mod control;
mod cores;
mod crcs;
mod device;
mod devices;
mod engine;
mod fills;
mod flusher;
mod health;
mod load;
mod log;
mod open;
pub use sce_io::order;
pub mod parts;
mod path;
pub mod persist;
mod population;
mod progress;
mod ranges;
mod read;
mod readahead;
mod refill;
mod shard;
mod slots;
pub mod stats;
mod through;
mod verify;
pub mod volume;

pub use log::WriteBackStats;
pub use log::{DrainControl, DrainDone};
pub use parts::VolumePart;
pub use persist::{PersistConfig, PersistStats};
pub use stats::VolumeStats;
pub use volume::{CacheVolume, EngineConfig, EngineError};
