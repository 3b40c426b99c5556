//! A cache device formatted with a write-back log (format 6, issue 29) is not served by
//! this build's engine yet: a start refuses it with a clear error (never a start that
//! ignores a log that may hold the only copy of data), and `--reformat` makes it a plain
//! format 5 device.

mod common;

use common::random_source;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::MemDevice;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn config(reformat: bool) -> EngineConfig {
    EngineConfig {
        persist: Some(PersistConfig {
            reformat,
            ..PersistConfig::new("log-format")
        }),
        ..EngineConfig::default()
    }
}

#[test]
fn a_device_with_a_write_back_log_is_refused_until_reformatted() {
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
        },
    )
    .unwrap();
    let Err(e) = CacheVolume::open(source.clone(), cache.clone(), config(false)) else {
        panic!("a device with a write-back log was served");
    };
    assert!(e.to_string().contains("write-back log"), "{e}");
    let vol = CacheVolume::open(source, cache.clone(), config(true)).expect("reformatted");
    drop(vol);
    let sb = sce_store::read_superblock(&*cache).unwrap();
    assert_eq!((sb.version, sb.log), (5, None));
}
