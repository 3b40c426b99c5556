//! Helpers shared by the engine's concurrency tests (each test binary includes this module
//! with `mod common;`).

// Each test binary uses only part of these helpers.
#![allow(dead_code)]

pub mod crash;
pub mod watchdog;

use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_core::{CoreConfig, WriteMode};
use sce_engine::{EngineConfig, PersistConfig};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use std::sync::Arc;
use std::time::Duration;

/// A persistent write-back engine over 64 KiB fragments (volume `name`, a metadata round
/// every `interval`), for the write-back tests; they set the waits and the idle rule.
pub fn writeback_config(name: &str, interval: Duration) -> EngineConfig {
    let mut p = PersistConfig::new(name);
    p.flush_interval = interval;
    EngineConfig {
        core: CoreConfig {
            fragment_size: 64 * 1024,
            write_mode: WriteMode::WriteBack,
            ..CoreConfig::default()
        },
        persist: Some(p),
        ..EngineConfig::default()
    }
}

/// `len` bytes of `dev` from `at`.
pub fn read(dev: &dyn BlockDevice, at: u64, len: u64) -> Vec<u8> {
    let mut b = AlignedBuf::new(len as usize);
    dev.read_at(at, &mut b).expect("read");
    b.to_vec()
}

/// A memory device of `size` random bytes (the same for the same `seed`).
pub fn random_source(size: u64, seed: u64) -> Arc<MemDevice> {
    let d = MemDevice::new(size);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; size as usize];
    rng.fill(&mut buf[..]);
    d.write_at(0, &buf).unwrap();
    Arc::new(d)
}
