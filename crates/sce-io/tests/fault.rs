//! `FaultDevice`: one test per fault kind, each proving it fires where configured and not
//! elsewhere; counters, `clear`, precedence, and changing faults while I/O runs.

use sce_io::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 20;

/// A fault device over memory whose every 4 KiB block `i` holds the byte `i + 1`.
fn dev() -> (FaultDevice<MemDevice>, Arc<FaultControl>) {
    let d = FaultDevice::new(MemDevice::new(SIZE));
    for i in 0..SIZE / 4096 {
        d.write_at(i * 4096, &[(i + 1) as u8; 4096]).unwrap();
    }
    let c = d.control();
    (d, c)
}

/// The initial content of `[offset, offset + len)`.
fn initial(offset: u64, len: usize) -> Vec<u8> {
    (offset..offset + len as u64)
        .map(|o| (o / 4096 + 1) as u8)
        .collect()
}

fn read(d: &dyn BlockDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    d.read_at(offset, &mut b).unwrap();
    b
}

/// Asserts equal bytes, reporting the first difference instead of both buffers.
#[track_caller]
fn same(got: impl AsRef<[u8]>, want: impl AsRef<[u8]>, what: &str) {
    let (g, w) = (got.as_ref(), want.as_ref());
    assert_eq!(g.len(), w.len(), "{what}: lengths");
    if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
        panic!("{what}: byte {i} is {:#x}, expected {:#x}", g[i], w[i]);
    }
}

fn injected(r: Result<(), IoError>, op: Op, offset: u64) -> bool {
    matches!(r, Err(IoError::Injected { op: o, offset: at, .. }) if o == op && at == offset)
}

#[test]
fn fail_from_fails_every_op_of_the_kind_from_the_nth() {
    let (d, c) = dev();
    let base_writes = c.ops(Op::Write);
    c.fail_from(&[Op::Write], base_writes + 2);
    let b = vec![9u8; 512];
    d.write_at(0, &b).expect("write #0 after the rule");
    d.write_at(512, &b).expect("write #1 after the rule");
    assert!(injected(d.write_at(1024, &b), Op::Write, 1024));
    assert!(
        injected(d.write_at(0, &b), Op::Write, 0),
        "and every later one"
    );
    same(
        read(&d, 1024, 512),
        initial(1024, 512),
        "failed write stored nothing",
    );
    // Other kinds are unaffected.
    read(&d, 0, 4096);
    d.flush().unwrap();
    d.discard(8192, 4096).unwrap();
    // n = 0 fails all operations of the kinds given.
    c.clear();
    c.fail_from(&[Op::Flush, Op::Discard], 0);
    assert!(injected(d.flush(), Op::Flush, 0));
    assert!(injected(d.discard(0, 512), Op::Discard, 0));
    d.write_at(0, &b).expect("writes no longer fail");
    read(&d, 0, 512);
    let e = d.flush().unwrap_err();
    assert!(e.is_media_error() && e.errno() == libc::EIO && e.to_string().contains("injected"));
}

#[test]
fn fail_nth_fails_exactly_one() {
    let (d, c) = dev();
    c.fail_nth(Op::Read, 2);
    let mut b = vec![0u8; 512];
    d.read_at(0, &mut b).expect("read #0");
    d.read_at(0, &mut b).expect("read #1");
    assert!(injected(d.read_at(512, &mut b), Op::Read, 512), "read #2");
    d.read_at(0, &mut b).expect("read #3");
    d.read_at(0, &mut b).expect("read #4");
    assert_eq!(c.ops(Op::Read), 5);
    assert_eq!(c.faults_fired(), 1);
    // Writes numbered 2 are not reads numbered 2.
    c.fail_nth(Op::Write, c.ops(Op::Write) + 1);
    d.write_at(0, &b).expect("this write");
    assert!(d.write_at(0, &b).is_err(), "the next write");
    d.write_at(0, &b).expect("and not the one after");
}

#[test]
fn fail_range_fails_only_overlapping_ops() {
    let (d, c) = dev();
    c.fail_range(&[Op::Write, Op::Discard], 8192..12288);
    let b = vec![1u8; 4096];
    d.write_at(4096, &b).expect("the block before");
    d.write_at(12288, &b).expect("the block after");
    assert!(injected(d.write_at(8192, &b), Op::Write, 8192));
    assert!(
        injected(d.write_at(4096, &[0; 8192]), Op::Write, 4096),
        "overlapping"
    );
    assert!(
        injected(d.write_at(0, &[0; 3 * 8192]), Op::Write, 0),
        "covering"
    );
    assert!(injected(d.discard(10240, 512), Op::Discard, 10240));
    d.discard(0, 8192).expect("discard next to the range");
    d.write_at(8192, &[])
        .expect("a zero-length op touches nothing");
    same(
        read(&d, 8192, 4096),
        initial(8192, 4096),
        "reads are not in the filter",
    );
    d.flush().expect("flushes have no range");
}

/// The offsets at which `a` and `b` differ, and by how many bits in total.
fn diff(a: &[u8], b: &[u8], base: u64) -> (Vec<u64>, u32) {
    let at = (0..a.len())
        .filter(|&i| a[i] != b[i])
        .map(|i| base + i as u64);
    let bits = a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum();
    (at.collect(), bits)
}

#[test]
fn corrupt_reads_flip_one_bit_inside_the_range() {
    let (d, c) = dev();
    c.corrupt_reads(20480..20992);
    let got = read(&d, 16384, 16384);
    let (at, bits) = diff(&got, &initial(16384, 16384), 16384);
    assert_eq!(bits, 1, "one bit flipped");
    assert!((20480..20992).contains(&at[0]), "inside the range: {at:?}");
    same(
        read(&d, 0, 16384),
        initial(0, 16384),
        "reads elsewhere intact",
    );
    same(read(&d, 20992, 4096), initial(20992, 4096), "just after");
    d.write_at(20480, &[7u8; 512]).expect("writes unaffected");
    c.clear();
    same(read(&d, 20480, 512), vec![7u8; 512], "stored data intact");
}

#[test]
fn corrupt_writes_store_one_flipped_bit_inside_the_range() {
    let (d, c) = dev();
    c.corrupt_writes(40960..41472);
    let data = vec![0xC3u8; 16384];
    d.write_at(36864, &data).expect("reports success");
    d.write_at(0, &data).expect("write elsewhere");
    c.clear();
    let (at, bits) = diff(&read(&d, 36864, 16384), &data, 36864);
    assert_eq!(bits, 1, "one bit flipped");
    assert!((40960..41472).contains(&at[0]), "inside the range: {at:?}");
    same(read(&d, 0, 16384), &data, "the write elsewhere is intact");
}

#[test]
fn drop_writes_lose_data_silently() {
    let (d, c) = dev();
    c.drop_writes(65536..69632);
    d.write_at(61440, &[0xEEu8; 8192]).expect("reports success");
    same(
        read(&d, 61440, 8192),
        initial(61440, 8192),
        "nothing stored",
    );
    d.write_at(69632, &[0xEEu8; 4096])
        .expect("write after the range");
    same(read(&d, 69632, 4096), vec![0xEEu8; 4096], "stored");
    assert_eq!(c.faults_fired(), 1);
}

#[test]
fn tear_writes_store_the_first_half() {
    let (d, c) = dev();
    c.tear_writes(16384..16385);
    let data = vec![0x55u8; 8192];
    d.write_at(16384, &data).expect("reports success");
    let got = read(&d, 16384, 8192);
    same(&got[..4096], &data[..4096], "first half stored");
    same(&got[4096..], initial(20480, 4096), "second half not");
    // Half of three blocks rounds down to one block.
    d.write_at(15872, &[0x66u8; 1536]).unwrap();
    let got = read(&d, 15872, 1536);
    same(&got[..512], [0x66u8; 512], "three blocks: the first stored");
    same(
        &got[512..],
        [0x55u8; 1024],
        "what the first torn write stored",
    );
    // A one-block write is stored whole or not at all: not.
    d.write_at(16384, &[0x77u8; 512]).unwrap();
    same(
        read(&d, 16384, 512),
        [0x55u8; 512],
        "one block: nothing stored",
    );
    d.write_at(24576, &data).expect("write elsewhere");
    same(read(&d, 24576, 8192), &data, "stored whole");
}

#[test]
fn misdirect_writes_land_at_offset_plus_delta() {
    let (d, c) = dev();
    c.misdirect_writes(32768..40960, 65536);
    let data = vec![0x99u8; 8192];
    d.write_at(32768, &data).expect("reports success");
    same(
        read(&d, 32768, 8192),
        initial(32768, 8192),
        "not at the intended place",
    );
    same(read(&d, 98304, 8192), &data, "at offset + delta");
    d.write_at(49152, &data).expect("write elsewhere");
    same(read(&d, 49152, 8192), &data, "lands where asked");
    same(
        read(&d, 114688, 8192),
        initial(114688, 8192),
        "and not at + delta",
    );
    // A negative delta works; a target beyond the end or unaligned loses the write.
    c.clear();
    c.misdirect_writes(SIZE - 8192..SIZE, -(SIZE as i64) + 8192);
    d.write_at(SIZE - 4096, &[0x11u8; 4096]).unwrap();
    same(
        read(&d, 4096, 4096),
        vec![0x11u8; 4096],
        "negative delta: landed",
    );
    same(
        read(&d, SIZE - 4096, 4096),
        initial(SIZE - 4096, 4096),
        "negative delta: not at offset",
    );
    c.clear();
    c.misdirect_writes(SIZE - 8192..SIZE, 4096);
    d.write_at(SIZE - 8192, &data)
        .expect("past the end: lost, reported as success");
    same(
        read(&d, SIZE - 8192, 8192),
        initial(SIZE - 8192, 8192),
        "past the end: not at offset",
    );
    c.clear();
    c.misdirect_writes(0..4096, 100);
    d.write_at(0, &[0x22u8; 4096])
        .expect("unaligned target: lost, reported as success");
    same(
        read(&d, 0, 4096),
        initial(0, 4096),
        "unaligned target: not at offset",
    );
    same(
        read(&d, 4096, 4096),
        [0x11u8; 4096],
        "unaligned target: not near offset + delta",
    );
}

#[test]
fn clear_counters_precedence_and_bad_requests() {
    let (d, c) = dev();
    let writes = c.ops(Op::Write);
    assert_eq!(writes, SIZE / 4096, "setup writes are counted");
    // Bad requests are checked first: not faults, not counted.
    c.fail_from(&[Op::Read, Op::Write, Op::Discard], 0);
    let mut b = vec![0u8; 512];
    assert!(matches!(
        d.read_at(SIZE, &mut b),
        Err(IoError::OutOfRange { .. })
    ));
    assert!(matches!(d.write_at(1, &b), Err(IoError::Unaligned { .. })));
    assert!(matches!(
        d.discard(u64::MAX - 10, 512),
        Err(IoError::OutOfRange { .. })
    ));
    assert_eq!(
        (c.ops(Op::Read), c.ops(Op::Write), c.faults_fired()),
        (0, writes, 0)
    );
    assert!(d.read_at(0, &mut b).is_err());
    assert_eq!((c.ops(Op::Read), c.faults_fired()), (1, 1));
    // Error rules win over data rules, wherever they were added.
    c.clear();
    c.drop_writes(0..SIZE);
    c.fail_range(&[Op::Write], 0..4096);
    assert!(injected(d.write_at(0, &b), Op::Write, 0));
    // Among data rules, the first added applies.
    c.clear();
    c.drop_writes(0..SIZE);
    c.misdirect_writes(0..SIZE, 8192);
    d.write_at(4096, &[0xAAu8; 4096]).unwrap();
    same(
        read(&d, 4096, 4096),
        initial(4096, 4096),
        "dropped, the first data rule",
    );
    same(
        read(&d, 12288, 4096),
        initial(12288, 4096),
        "not misdirected either",
    );
    // clear removes every rule; counters keep counting.
    let fired = c.faults_fired();
    c.clear();
    d.write_at(4096, &[0xAAu8; 4096]).unwrap();
    same(
        read(&d, 4096, 4096),
        vec![0xAAu8; 4096],
        "stored after clear",
    );
    d.flush().unwrap();
    assert_eq!(c.faults_fired(), fired);
    assert_eq!(c.ops(Op::Flush), 1);
    // The injected, the dropped and the last write; not the unaligned one.
    assert_eq!(c.ops(Op::Write), writes + 3);
}

#[test]
fn faults_change_while_io_runs() {
    let d = Arc::new(FaultDevice::new(MemDevice::new(SIZE)));
    let c = d.control();
    let stop = AtomicBool::new(false);
    let (ok, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let t0 = Instant::now();
        while !f() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}"
            );
            std::thread::yield_now();
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let b = vec![3u8; 4096];
            while !stop.load(SeqCst) {
                match d.write_at(0, &b) {
                    Ok(()) => ok.fetch_add(1, SeqCst),
                    Err(_) => failed.fetch_add(1, SeqCst),
                };
            }
        });
        wait_for("successful writes", &|| ok.load(SeqCst) > 0);
        c.fail_from(&[Op::Write], 0);
        wait_for("failed writes", &|| failed.load(SeqCst) > 0);
        c.clear();
        let before = ok.load(SeqCst);
        wait_for("writes to succeed again", &|| ok.load(SeqCst) > before);
        stop.store(true, SeqCst);
    });
    assert_eq!(c.faults_fired(), failed.load(SeqCst));
}
