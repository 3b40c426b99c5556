//! Helpers shared by the engine's concurrency tests (each test binary includes this module
//! with `mod common;`).

// Each test binary uses only part of these helpers.
#![allow(dead_code)]

pub mod crash;
pub mod watchdog;

use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_core::{CoreConfig, WriteMode};
use sce_engine::{EngineConfig, PersistConfig};
use sce_io::{AlignedBuf, BlockDevice, DirectMode, FileDevice, FileOptions, MemDevice};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The file `dir/name`, created at `size` bytes and opened with O_DIRECT required (a cache
/// or source as the server opens it).
pub fn direct_file(dir: &Path, name: &str, size: u64) -> Arc<FileDevice> {
    let opts = FileOptions {
        direct: DirectMode::Required,
        create_size: Some(size),
        ..Default::default()
    };
    Arc::new(FileDevice::open(&dir.join(name), &opts).expect(name))
}

/// A core of `fragment_size` fragments with a small hotness window (16 accesses), so that a
/// missed fragment stays hot only for the next few reads.
pub fn small_window_core(fragment_size: u64) -> CoreConfig {
    CoreConfig {
        fragment_size,
        hot_window: 16,
        ..CoreConfig::default()
    }
}

/// An engine over `core` with two AWT threads and the background population workers (as
/// the server runs it).
pub fn awt_engine(core: CoreConfig) -> EngineConfig {
    EngineConfig {
        core,
        awt_threads: 2,
        background_population: true,
        ..EngineConfig::default()
    }
}

/// Population as eager as the tests want it: the throttle's periods at 1 and 2 ms, and no
/// miss rate low enough to slow it.
pub fn eager_throttle(core: &mut CoreConfig) {
    core.throttle.period = Duration::from_millis(1);
    core.throttle.slow_period = Duration::from_millis(2);
    core.throttle.target_missrate = 0.0;
}

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

/// The device as a crash would leave it right now (a memory device loses nothing written).
pub fn crash_image(dev: &MemDevice) -> Arc<MemDevice> {
    let copy = MemDevice::new(dev.size());
    let mib = 1usize << 20;
    let mut b = AlignedBuf::new(mib);
    for at in (0..dev.size()).step_by(mib) {
        let n = (dev.size() - at).min(mib as u64) as usize;
        dev.read_at(at, &mut b[..n]).unwrap();
        copy.write_at(at, &b[..n]).unwrap();
    }
    Arc::new(copy)
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
