//! Helpers shared by the engine's concurrency tests (each test binary includes this module
//! with `mod common;`).

// Each test binary uses only part of these helpers.
#![allow(dead_code)]

pub mod crash;
pub mod watchdog;

use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::{BlockDevice, MemDevice};
use std::sync::Arc;

/// A memory device of `size` random bytes (the same for the same `seed`).
pub fn random_source(size: u64, seed: u64) -> Arc<MemDevice> {
    let d = MemDevice::new(size);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; size as usize];
    rng.fill(&mut buf[..]);
    d.write_at(0, &buf).unwrap();
    Arc::new(d)
}
