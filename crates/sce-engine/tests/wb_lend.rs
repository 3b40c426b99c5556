//! Room that follows the work (issue 45, format 9): a burst of writes larger than the
//! write-back log's own region lends chunks of the read slots to it (their read data
//! evicted first, never served again from there), and once cleaning empties them they go
//! back to the read cache; every read meanwhile returns the newest bytes.

mod common;

use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{BlockDevice, LatencyConfig, LatencyDevice, MemDevice};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1024 * 1024;
const PAGE: u64 = 4096;
const SIZE: u64 = 64 * MIB;

fn config() -> EngineConfig {
    let mut c = EngineConfig {
        writeback_wait: Duration::from_secs(60),
        writeback_idle: Duration::from_secs(3600),
        background_population: false,
        ..common::writeback_config("wb-lend", Duration::from_millis(100))
    };
    c.persist.as_mut().unwrap().writeback_log = 4 * MIB;
    c
}

/// Every byte of the volume against the model.
fn check_all(vol: &CacheVolume, model: &[u8], when: &str) {
    let mut buf = vec![0u8; MIB as usize];
    for at in (0..SIZE).step_by(MIB as usize) {
        vol.read_at(at, &mut buf).expect("read");
        if buf[..] != model[at as usize..(at + MIB) as usize] {
            let p = (0..MIB as usize)
                .find(|&i| buf[i] != model[at as usize + i])
                .unwrap();
            panic!(
                "{when}: byte {} differs from the newest write",
                at + p as u64
            );
        }
    }
}

#[test]
fn a_burst_lends_read_slots_cleaning_gives_them_back_and_no_read_is_stale() {
    let mem = common::random_source(SIZE, 45);
    let mut model = common::read(&*mem, 0, SIZE);
    // The source takes 3 ms a write (16 at once): the burst outruns the cleaner.
    let mut slow = LatencyConfig::disk(Duration::from_millis(3), 16);
    slow.read = sce_io::latency::Delay::None;
    let source: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(mem.clone(), slow));
    let cache = Arc::new(MemDevice::new(SIZE));
    let vol = CacheVolume::open(source, cache.clone(), config()).expect("open");
    let w0 = vol.writeback_stats().unwrap();
    assert_eq!(w0.log_lent_bytes, 0);
    assert!(
        w0.log_max_bytes >= 24 * MIB && w0.log_capacity_bytes < 5 * MIB,
        "{w0:?}"
    );
    // The read cache full of the first 48 MiB.
    vol.prefetch(0, 48 * MIB).expect("prefetch");
    let cached: u64 = vol.exists(0, SIZE).unwrap().iter().map(|e| e.1).sum();
    assert!(cached >= 40 * MIB, "{cached} bytes cached");
    // 24 MiB of 4 KiB writes over it, scattered, a FLUSH every 64: six times the log's own
    // region.
    let mut x: u64 = 0x9e37_79b9;
    let mut most = 0;
    for k in 0..6144u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % (48 * MIB / PAGE)) * PAGE;
        let b = [(k % 251) as u8 + 1; PAGE as usize];
        vol.write_at(at, &b).expect("write");
        model[at as usize..(at + PAGE) as usize].copy_from_slice(&b);
        if k % 64 == 63 {
            vol.flush().expect("flush");
            most = most.max(vol.writeback_stats().unwrap().log_lent_bytes);
        }
    }
    vol.flush().expect("flush");
    let w = vol.writeback_stats().unwrap();
    println!("after the burst: {w:?}; at most {most} bytes lent");
    assert!(w.log_lends > 0 && most > 0, "nothing lent: {w:?}");
    check_all(&vol, &model, "after the burst");
    // Cleaned: the chunks go back, the read cache fills them again.
    vol.flush_to_source(None, Duration::from_secs(60))
        .expect("flush to source");
    sce_testkit::poll("the lent chunks given back", 60, || {
        let w = vol.writeback_stats().unwrap();
        (w.log_lent_bytes == 0 && w.log_give_backs > 0)
            .then_some(())
            .ok_or(format!("{w:?}"))
    });
    check_all(&vol, &model, "after cleaning");
    vol.prefetch(0, 48 * MIB).expect("prefetch");
    check_all(&vol, &model, "refilled");
    let again: u64 = vol.exists(0, SIZE).unwrap().iter().map(|e| e.1).sum();
    assert!(
        again >= 40 * MIB,
        "{again} bytes cached once the slots came back"
    );
    // A restart finds the same bytes.
    assert!(vol.shutdown());
    drop(vol);
    let source: Arc<dyn BlockDevice> = mem.clone();
    let vol = CacheVolume::open(source, cache, config()).expect("reopen");
    check_all(&vol, &model, "after a restart");
}
