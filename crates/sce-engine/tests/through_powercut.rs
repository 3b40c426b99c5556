//! Write-through over a source that has a volatile write cache of its own (a disk array, an
//! NBD export over a file), with power cuts: the cache device and the source lose their
//! unflushed writes at the same instant (`sce_io::PowerCutDevice`). A write acknowledged and
//! not yet flushed may be lost, but the cache must never keep a copy of it the source lost:
//! that copy reads as newer data for a while (a client may FLUSH it, believing it durable),
//! and the first eviction, partial write or dropped fragment brings the source's older
//! bytes back. Found by the NBD power-cut loop (`../shared/repro/log/pcloop.py`): a page
//! read, flushed, then read as zeroes after the next cut.

mod common;

use sce_core::WriteMode;
use sce_engine::{CacheVolume, EngineConfig};
use sce_io::{AlignedBuf, BlockDevice, Power, PowerCutDevice};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const FRAG: u64 = 64 * 1024;

/// Write-through (AWT), persistent, a metadata round only when the test asks for one.
fn config() -> EngineConfig {
    let mut c = common::writeback_config("wt-cut", Duration::from_secs(3600));
    c.core.write_mode = WriteMode::Awt;
    c.awt_threads = 2;
    c
}

fn pattern(tag: u8, len: u64) -> AlignedBuf {
    let mut b = AlignedBuf::new(len as usize);
    for (i, x) in b.iter_mut().enumerate() {
        *x = tag ^ (i as u8).wrapping_mul(31);
    }
    b
}

#[test]
fn a_cut_never_leaves_the_cache_holding_a_write_the_source_lost() {
    let (mut cache_img, mut src_img) = (
        vec![0u8; (16 * MIB) as usize],
        vec![0u8; (4 * MIB) as usize],
    );
    let mut lost_on_source = 0;
    for round in 0..24u64 {
        let power = Power::new();
        let src = PowerCutDevice::new(src_img.clone(), 512, 512, &power);
        let cache = PowerCutDevice::new(cache_img.clone(), 512, 512, &power);
        let vol = CacheVolume::open(src.clone(), cache.clone(), config()).unwrap();
        let at = (round % 8) * FRAG;
        // The fragment cached and durable on both devices.
        vol.write_at(at, &pattern(round as u8, FRAG)).unwrap();
        vol.flush().unwrap();
        vol.prefetch(at, FRAG).unwrap();
        vol.quiesce();
        assert_eq!(vol.flush_metadata(), 0);
        // A write over the cached pages, acknowledged, not flushed; its cache copies done
        // and (every other time) a metadata round after them, then the power goes.
        let new = pattern(0x80 | round as u8, 4 * 4096);
        vol.write_at(at, &new).unwrap();
        vol.quiesce();
        if round % 2 == 0 {
            assert_eq!(vol.flush_metadata(), 0);
        }
        power.cut(round);
        drop(vol);
        src_img = src.durable();
        cache_img = cache.durable();
        if src_img[at as usize..(at + 4 * 4096) as usize] != new[..] {
            lost_on_source += 1;
        }
        // After the restart the cache reads as the source holds it: not the lost write.
        let power = Power::new();
        let src = PowerCutDevice::new(src_img.clone(), 512, 512, &power);
        let cache = PowerCutDevice::new(cache_img.clone(), 512, 512, &power);
        let vol = CacheVolume::open(src.clone(), cache.clone(), config()).unwrap();
        let seen = common::read(&vol, at, FRAG);
        let on_source = src_img[at as usize..(at + FRAG) as usize].to_vec();
        assert!(
            seen == on_source,
            "round {round}: the cache serves bytes at {at} that the source lost at the cut \
             (the source kept {} of its 4 written pages)",
            (0..4)
                .filter(|p| {
                    let r = (at + p * 4096) as usize..(at + (p + 1) * 4096) as usize;
                    src_img[r.clone()] == new[(p * 4096) as usize..((p + 1) * 4096) as usize]
                })
                .count()
        );
        // What was read, flushed, stays what reads return after the cache lets it go.
        vol.flush().unwrap();
        vol.evict(at, FRAG).unwrap();
        assert_eq!(
            common::read(&vol, at, FRAG),
            seen,
            "round {round}: older bytes after an eviction"
        );
        assert!(vol.shutdown());
        drop(vol);
        src_img = src.durable();
        cache_img = cache.durable();
    }
    // The case in point happened: a cut took the write from the source (without a round
    // since it: a round makes it durable there first).
    assert!(
        lost_on_source > 0,
        "no cut lost the source's copy of the write"
    );
}

/// A source that cannot flush puts a round off (its records would vouch for copies the
/// source may lose): `forget`, which promises that no crash brings the old pages back, says
/// its records were not written; a source whose writes fail needs no flush for them (they
/// made nothing valid), so rounds go on once the last good write is flushed.
#[test]
fn a_round_the_source_cannot_flush_for_is_put_off_and_said() {
    use sce_io::{FaultDevice, MemDevice, Op};
    let source = Arc::new(FaultDevice::new(MemDevice::new(4 * MIB)));
    let ctl = source.control();
    let cache = Arc::new(MemDevice::new(16 * MIB));
    let vol = CacheVolume::open(source.clone(), cache, config()).unwrap();
    vol.write_at(0, &pattern(1, FRAG)).unwrap();
    vol.prefetch(0, FRAG).unwrap();
    vol.quiesce();
    assert_eq!(vol.flush_metadata(), 0, "a round with a healthy source");
    // A write the source took, then its flushes fail: the round is put off, and said.
    ctl.fail_from(&[Op::Flush], ctl.ops(Op::Flush));
    vol.write_at(0, &pattern(2, 4096)).unwrap();
    vol.quiesce();
    assert_eq!(
        vol.flush_metadata(),
        1,
        "a round put off must not pass for done"
    );
    let (_, errors) = vol.forget();
    assert!(errors > 0, "forget said its records were written");
    // The source back: the round goes through.
    ctl.clear();
    assert_eq!(vol.flush_metadata(), 0);
    // Every write fails (and every flush): nothing made valid, nothing to flush for.
    ctl.fail_from(&[Op::Write], ctl.ops(Op::Write));
    ctl.fail_from(&[Op::Flush], ctl.ops(Op::Flush));
    assert!(vol.write_at(FRAG, &pattern(3, 4096)).is_err());
    vol.quiesce();
    assert_eq!(vol.flush_metadata(), 0, "failed writes held the rounds up");
}
