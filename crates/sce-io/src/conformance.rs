//! The one conformance suite every `BlockDevice` must pass: memory and file devices, the
//! wrappers, the cached volume, and later the NBD client. It panics with the name of the
//! failed check (it is test support; panicking is how it fails a test).
//!
//! Requirements on the device: at least 4 MiB, any initial content (it writes what it reads).

use crate::error::IoError;
use crate::{extent, AlignedBuf, BlockDevice};

fn pattern(seed: u64, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for w in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = w.len();
        w.copy_from_slice(&x.to_le_bytes()[..n]);
    }
    b
}

fn round_trip(dev: &dyn BlockDevice, what: &str, offset: u64, len: usize, seed: u64) {
    let data = pattern(seed, len);
    dev.write_at(offset, &data)
        .unwrap_or_else(|e| panic!("{what}: write {len}@{offset}: {e}"));
    let mut back = AlignedBuf::new(len);
    dev.read_at(offset, &mut back)
        .unwrap_or_else(|e| panic!("{what}: read {len}@{offset}: {e}"));
    assert!(
        back[..] == data[..],
        "{what}: data read back at {offset} (+{len}) differs from what was written"
    );
}

/// Runs every check, in order; panics naming the failed check. The checks are also public
/// one by one, for a device that can only pass some of them.
pub fn run_all(dev: &dyn BlockDevice) {
    geometry(dev);
    round_trips(dev);
    bad_requests(dev);
    odd_memory_addresses(dev);
    discard_zeroes(dev);
    concurrent_writers(dev);
    shared_writes(dev);
    extents_are_true(dev);
}

/// `extents` tells the truth: extents in order, nonzero, whole blocks, covering a nonempty
/// prefix of the range; every hole reads as zeroes and written data is never a hole;
/// requests out of range fail; asked for one extent, a device answers the first of them.
pub fn extents_are_true(dev: &dyn BlockDevice) {
    let lbs = dev.logical_block_size() as u64;
    let base = 2 << 20;
    let data = pattern(9, 3 * 65536);
    dev.write_at(base, &data).expect("extents: write");
    dev.discard(base + 65536, 65536).expect("extents: discard");
    for (offset, len) in [(0, dev.size()), (base, 3 * 65536), (base + 65536, 65536)] {
        let ext = dev
            .extents(offset, len, extent::MAX_EXTENTS)
            .unwrap_or_else(|e| panic!("extents: {len}@{offset}: {e}"));
        assert!(!ext.is_empty(), "extents: {len}@{offset}: none returned");
        let one = dev
            .extents(offset, len, 1)
            .unwrap_or_else(|e| panic!("extents: one of {len}@{offset}: {e}"));
        assert_eq!(
            one,
            ext[..1],
            "extents: {len}@{offset}: one is not the first"
        );
        let mut at = offset;
        for e in &ext {
            assert!(
                e.len > 0 && e.len % lbs == 0 && at + e.len <= offset + len,
                "extents: {len}@{offset}: bad extent {e:?} at {at}"
            );
            let written = [(base, base + 65536), (base + 131072, base + 196608)];
            if e.hole {
                assert!(
                    written.iter().all(|&(a, b)| at + e.len <= a || b <= at),
                    "extents: written data at {at} (+{}) reported as a hole",
                    e.len
                );
                let mut r = AlignedBuf::new(e.len.min(1 << 20) as usize);
                dev.read_at(at, &mut r).expect("extents: read a hole");
                assert!(
                    r.iter().all(|&b| b == 0),
                    "extents: hole at {at} does not read as zeroes"
                );
            }
            at += e.len;
        }
    }
    let all = extent::MAX_EXTENTS;
    assert!(dev.extents(0, 0, all).expect("extents: empty").is_empty());
    assert!(
        dev.extents(dev.size(), lbs, all).is_err(),
        "extents: a query past the end succeeded"
    );
}

/// `write_shared` writes what `write_at` would, read back at once (a device that keeps the
/// buffer for a later copy, the cached volume's AWT, must serve the write's data anyway).
pub fn shared_writes(dev: &dyn BlockDevice) {
    let lbs = dev.logical_block_size() as usize;
    let len = (64 << 10).max(lbs);
    for (i, offset) in [0u64, 1 << 20, 3 << 20].into_iter().enumerate() {
        let data = pattern(100 + i as u64, len);
        let expect = data.to_vec();
        dev.write_shared(offset, std::sync::Arc::new(data))
            .unwrap_or_else(|e| panic!("shared_writes: write {len}@{offset}: {e}"));
        let mut back = AlignedBuf::new(len);
        dev.read_at(offset, &mut back)
            .unwrap_or_else(|e| panic!("shared_writes: read {len}@{offset}: {e}"));
        assert!(
            back[..] == expect[..],
            "shared_writes: data read back at {offset} differs from what was written"
        );
    }
    dev.flush()
        .unwrap_or_else(|e| panic!("shared_writes: flush: {e}"));
}

/// Size and block size are sane.
pub fn geometry(dev: &dyn BlockDevice) {
    let lbs = dev.logical_block_size() as u64;
    assert!(
        lbs >= 1 && lbs.is_power_of_two(),
        "geometry: block size {lbs} is not a power of two"
    );
    assert!(
        dev.size() > 0 && dev.size().is_multiple_of(lbs),
        "geometry: size {} is not a multiple of {lbs}",
        dev.size()
    );
    assert!(
        dev.size() >= 4 << 20,
        "geometry: the suite needs at least 4 MiB"
    );
}

/// Writes then reads back patterns at boundaries and sizes that matter.
pub fn round_trips(dev: &dyn BlockDevice) {
    let lbs = dev.logical_block_size() as u64;
    let size = dev.size();
    let offsets = [
        0,
        lbs,
        4096,
        (1 << 20) - lbs,
        (1 << 20) - 4096,
        size - (1 << 20) - 8192,
        size - lbs,
    ];
    let lens = [lbs as usize, 4096, 65536, (1 << 20) + 4096];
    let mut seed = 1;
    for &o in &offsets {
        for &l in &lens {
            if o + l as u64 <= size {
                round_trip(dev, "round trip", o, l, seed);
                seed += 1;
            }
        }
    }
    // Overwrite replaces, neighbours untouched.
    round_trip(dev, "overwrite", 8192, 8192, 1000);
    let before = pattern(1001, 4096);
    dev.write_at(16384, &before)
        .expect("overwrite: write neighbour");
    round_trip(dev, "overwrite", 8192, 8192, 1002);
    let mut n = AlignedBuf::new(4096);
    dev.read_at(16384, &mut n)
        .expect("overwrite: read neighbour");
    assert!(
        n[..] == before[..],
        "overwrite: a neighbouring block changed"
    );
    dev.flush()
        .unwrap_or_else(|e| panic!("flush: flush after writes failed: {e}"));
}

/// Out-of-range and unaligned requests get typed errors; empty requests succeed.
pub fn bad_requests(dev: &dyn BlockDevice) {
    let lbs = dev.logical_block_size() as u64;
    let size = dev.size();
    let mut b = AlignedBuf::new(lbs as usize * 2);
    let oor = |r: Result<(), IoError>, what: &str| {
        assert!(
            matches!(r, Err(IoError::OutOfRange { .. })),
            "bad requests: {what} gave {r:?}, not OutOfRange"
        )
    };
    oor(dev.read_at(size, &mut b[..lbs as usize]), "read at the end");
    oor(dev.write_at(size, &b[..lbs as usize]), "write at the end");
    oor(dev.write_at(size - lbs, &b), "write crossing the end");
    oor(
        dev.read_at(u64::MAX - 10, &mut b[..lbs as usize]),
        "read at u64::MAX - 10",
    );
    oor(
        dev.write_at(u64::MAX - lbs + 1, &b[..lbs as usize]),
        "write overflowing u64",
    );
    oor(dev.discard(size - lbs, 2 * lbs), "discard crossing the end");
    if lbs > 1 {
        let un = |r: Result<(), IoError>, what: &str| {
            assert!(
                matches!(r, Err(IoError::Unaligned { .. })),
                "bad requests: {what} gave {r:?}, not Unaligned"
            )
        };
        un(
            dev.read_at(1, &mut b[..lbs as usize]),
            "read at an unaligned offset",
        );
        un(
            dev.write_at(0, &b[..lbs as usize - 1]),
            "write of an unaligned length",
        );
        un(dev.discard(lbs / 2, lbs), "discard at an unaligned offset");
    }
    dev.read_at(size, &mut [])
        .expect("bad requests: empty read at the end");
    dev.write_at(size, &[])
        .expect("bad requests: empty write at the end");
    dev.read_at(0, &mut []).expect("bad requests: empty read");
}

/// Buffers at odd memory addresses work.
pub fn odd_memory_addresses(dev: &dyn BlockDevice) {
    let data = pattern(77, 8192);
    let mut v = vec![0u8; 8192 + 1];
    v[1..].copy_from_slice(&data);
    dev.write_at(65536, &v[1..]).expect("odd address: write");
    let mut r = vec![0u8; 8192 + 3];
    dev.read_at(65536, &mut r[3..]).expect("odd address: read");
    assert!(r[3..] == data[..], "odd address: data differs");
}

/// Discard makes a range read back as zeroes, neighbours untouched.
pub fn discard_zeroes(dev: &dyn BlockDevice) {
    let base = 2 << 20;
    let data = pattern(5, 3 * 65536);
    dev.write_at(base, &data).expect("discard: write");
    dev.discard(base + 65536, 65536)
        .expect("discard: discard of 64 KiB");
    let mut r = AlignedBuf::new(3 * 65536);
    dev.read_at(base, &mut r).expect("discard: read");
    assert!(
        r[..65536] == data[..65536],
        "discard: the block before changed"
    );
    assert!(
        r[65536..131072].iter().all(|&b| b == 0),
        "discard: range does not read as zeroes"
    );
    assert!(
        r[131072..] == data[131072..],
        "discard: the block after changed"
    );
}

/// Four threads write and verify disjoint regions concurrently.
pub fn concurrent_writers(dev: &dyn BlockDevice) {
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                let base = (1 << 20) + t * 65536;
                for i in 0..50u64 {
                    let len = 4096 * (1 + (i % 4) as usize);
                    round_trip(
                        dev,
                        "concurrent writers",
                        base + (i % 8) * 4096,
                        len,
                        t * 1000 + i,
                    );
                }
            });
        }
    });
}
