//! The cleaner flushes the source once per batch of runs, not once per run (issue 29: a
//! cleaner that treats the source well). Prints the source flushes per MiB cleaned.

mod common;

use common::random_source;
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{BlockDevice, FaultDevice, MemDevice, Op};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[test]
fn cleaning_flushes_the_source_once_per_batch_of_jobs() {
    let size = 16 * MIB;
    let source = Arc::new(FaultDevice::new(random_source(size, 5)));
    let cfg = EngineConfig {
        // Nothing is cleaned until asked (64 dirty pages are below the log cleaner's low
        // watermark, and the idle rule is off): the flush below cleans everything at once.
        writeback_idle: Duration::from_secs(3600),
        core_shards: 4,
        ..common::writeback_config("clean-batch", Duration::from_secs(3600))
    };
    let vol =
        CacheVolume::open(source.clone(), Arc::new(MemDevice::new(64 * MIB)), cfg).expect("open");
    assert_eq!(vol.core_shards(), 4);
    // 64 fragments of 64 KiB, a page dirty in each: 64 runs to clean, none adjacent.
    let frags = 64u64;
    for f in 0..frags {
        vol.write_at(f * 65536, &[f as u8; 4096]).expect("write");
    }
    let before = source.control().ops(Op::Flush);
    let cleaned = vol
        .flush_to_source(None, Duration::from_secs(60))
        .expect("clean");
    let flushes = source.control().ops(Op::Flush) - before;
    let mib = cleaned as f64 / MIB as f64;
    eprintln!(
        "cleaned {cleaned} bytes in {frags} jobs with {flushes} source flushes: {:.0} per MiB",
        flushes as f64 / mib
    );
    assert_eq!(cleaned, frags * 4096);
    // A batch cleans many runs before it flushes the source (plus the final flush of
    // flush_to_source). One flush per run would be 65.
    assert!(
        flushes <= frags / 2,
        "{flushes} source flushes for {frags} jobs"
    );
    let mut b = vec![0u8; 4096];
    source.read_at(63 * 65536, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == 63),
        "the source has the cleaned data"
    );
}
