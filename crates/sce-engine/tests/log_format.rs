//! A cache device formatted with a write-back log (format 6, issue 29): a write-back start
//! serves write-back through it; a write-through start replays it too, and serves while it
//! holds nothing (`wb_log.rs` checks the refusal when it holds dirty pages); `--reformat`
//! keeps the format the start asks for.

mod common;

use common::random_source;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::MemDevice;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn config(reformat: bool, mode: sce_core::WriteMode) -> EngineConfig {
    EngineConfig {
        core: sce_core::CoreConfig {
            write_mode: mode,
            ..Default::default()
        },
        persist: Some(PersistConfig {
            reformat,
            ..PersistConfig::new("log-format")
        }),
        ..EngineConfig::default()
    }
}

#[test]
fn a_device_with_a_write_back_log_serves_either_mode() {
    use sce_core::WriteMode::{WriteBack, WriteThrough};
    let cache = Arc::new(MemDevice::new(64 * MIB));
    let source = random_source(16 * MIB, 1);
    sce_store::format(
        &*cache,
        &sce_store::FormatOptions {
            fragment_size: MIB,
            volume: sce_store::Volume {
                id: 1,
                generation: 1,
                source_size: 16 * MIB,
                name: "log-format".into(),
                identity: [0; 16],
                detached: false,
                writeback: false,
            },
            size: None,
            log_bytes: 16 * MIB,
            lend_bytes: 0,
        },
    )
    .unwrap();
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(false, WriteThrough))
        .expect("write-through over an empty log");
    assert!(vol.writeback_stats().is_none());
    drop(vol);
    let vol = CacheVolume::open(source.clone(), cache.clone(), config(false, WriteBack))
        .expect("write-back through the log");
    assert!(vol.writeback_log_counts().is_some(), "not the log path");
    drop(vol);
    // `reformat` reformats only a device the start cannot use: this one keeps its log.
    let vol = CacheVolume::open(source, cache.clone(), config(true, WriteThrough)).unwrap();
    drop(vol);
    let sb = sce_store::read_superblock(&*cache).unwrap();
    assert!(sb.log.is_some(), "a usable device is not reformatted");
}
