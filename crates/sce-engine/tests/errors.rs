//! Errors with meaning (issue 28): when write-back cannot take a write, the engine says why
//! with the error's kind, so that a protocol edge answers the truth. A write-back log that
//! cannot be written is a device failure (EIO), never an invalid request; a cache full of
//! dirty data the source does not take is no room (`NoRoom`, ENOSPC); a
//! write still waiting for room when the volume shuts down is `ShuttingDown` (ESHUTDOWN).
//! `sce-nbd/tests/errnos.rs` checks what an NBD client reads for each kind.

mod common;

use common::random_source;
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{BlockDevice, FaultDevice, IoError, MemDevice, Op};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: u64 = 4096;
// Linux's errnos (sce runs on Linux; the engine does not depend on libc).
const EIO: i32 = 5;
const ENOSPC: i32 = 28;
const ESHUTDOWN: i32 = 108;

fn config(state: &std::path::Path, wait: Duration) -> EngineConfig {
    let mut c = EngineConfig {
        writeback_idle: Duration::from_secs(3600),
        writeback_wait: wait,
        ..common::writeback_config("errors", Duration::from_secs(3600))
    };
    c.persist.as_mut().expect("persistent").state_dir = Some(state.to_path_buf());
    c
}

#[test]
fn a_log_that_cannot_be_written_is_a_device_error() {
    let state = tempfile::tempdir().unwrap();
    let cache = Arc::new(FaultDevice::new(MemDevice::new(4 * MIB)));
    let cfg = config(state.path(), Duration::from_secs(5));
    let vol = CacheVolume::open(random_source(8 * MIB, 1), cache.clone(), cfg).expect("open");
    vol.write_at(0, &[1u8; PAGE as usize])
        .expect("a healthy write");
    // The log's blocks, and nothing else, stop taking writes.
    let sb = sce_store::read_superblock(cache.inner()).unwrap();
    assert!(sb.log.is_some(), "write-back formats the device with a log");
    let log = sb.layout.cache_size..cache.size();
    let ctl = cache.control();
    let fired = ctl.faults_fired();
    ctl.fail_range(&[Op::Write], log);
    let e = vol
        .write_at(16 * PAGE, &[2u8; PAGE as usize])
        .expect_err("a write whose log write fails");
    assert!(ctl.faults_fired() > fired, "the log was written: {e}");
    assert_eq!((e.errno(), e.is_media_error()), (EIO, true), "{e:?}");
}

/// A source that takes no writes and a small cache: write-back fills it with dirty data.
fn full_of_dirty_data(state: &std::path::Path, wait: Duration) -> Arc<CacheVolume> {
    let source = Arc::new(FaultDevice::new(random_source(8 * MIB, 2)));
    source.control().fail_range(&[Op::Write], 0..u64::MAX);
    let cache = Arc::new(MemDevice::new(4 * MIB));
    Arc::new(CacheVolume::open(source, cache, config(state, wait)).expect("open"))
}

#[test]
fn no_room_for_dirty_data_is_no_room() {
    let state = tempfile::tempdir().unwrap();
    let vol = full_of_dirty_data(state.path(), Duration::from_millis(300));
    let b = vec![5u8; 64 * KIB as usize];
    let e = (0..8 * MIB / b.len() as u64)
        .find_map(|i| vol.write_at(i * b.len() as u64, &b).err())
        .expect("a 4 MiB cache (a 1 MiB log) cannot hold 8 MiB of dirty data");
    assert!(matches!(e, IoError::NoRoom(_)), "no room: {e:?}");
    assert_eq!((e.errno(), e.is_media_error()), (ENOSPC, false), "{e}");
}

#[test]
fn a_write_waiting_for_room_at_shutdown_is_told_so() {
    let state = tempfile::tempdir().unwrap();
    let vol = full_of_dirty_data(state.path(), Duration::from_secs(600));
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let b = vec![6u8; 64 * KIB as usize];
            (0..8 * MIB / b.len() as u64).find_map(|i| vol.write_at(i * b.len() as u64, &b).err())
        })
    };
    sce_testkit::poll("a write waiting for room", 60, || {
        let w = vol.writeback_stats().expect("write-back");
        (w.waits > 0).then_some(()).ok_or(format!("{w:?}"))
    });
    vol.shutdown();
    let e = writer.join().unwrap().expect("the waiting write fails");
    assert!(
        matches!(e, IoError::ShuttingDown(_)),
        "shutting down: {e:?}"
    );
    assert_eq!((e.errno(), e.is_media_error()), (ESHUTDOWN, false), "{e}");
}
