//! Device specifics: O_DIRECT refusal, block devices, bad files; every fault kind; the
//! latency wrapper's queueing.

use sce_io::*;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn is_tmpfs(p: &Path) -> bool {
    std::fs::read_to_string("/proc/mounts")
        .map(|m| {
            m.lines().any(|l| {
                let f: Vec<_> = l.split_whitespace().collect();
                f.len() > 2 && Path::new(f[1]) == p && f[2] == "tmpfs"
            })
        })
        .unwrap_or(false)
}

#[test]
fn direct_io_refusal_is_explained() {
    // procfs refuses O_DIRECT at open on every kernel, so it stands for any such filesystem.
    let p = Path::new("/proc/self/status");
    let req = FileOptions {
        direct: DirectMode::Required,
        create_size: None,
        read_only: true,
    };
    let e = FileDevice::open(p, &req).unwrap_err();
    assert!(matches!(e, IoError::DirectIoUnsupported { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("O_DIRECT") && msg.contains("buffered") && msg.contains("/proc/self/status"),
        "{msg}"
    );
    // Preferred falls back to buffered I/O (the file is then refused for its size, not O_DIRECT).
    let e = FileDevice::open(
        p,
        &FileOptions {
            direct: DirectMode::Preferred,
            ..req
        },
    )
    .unwrap_err();
    assert!(matches!(e, IoError::Invalid(_)), "{e:?}");
    // tmpfs refused O_DIRECT before Linux 6.6; newer kernels accept it.
    let shm = Path::new("/dev/shm");
    if is_tmpfs(shm) {
        let path = shm.join(format!("sce-io-test-{}", std::process::id()));
        let opts = FileOptions {
            direct: DirectMode::Required,
            create_size: Some(8 << 20),
            read_only: false,
        };
        match FileDevice::open(&path, &opts) {
            Err(IoError::DirectIoUnsupported { .. }) => {
                let d = FileDevice::open(
                    &path,
                    &FileOptions {
                        direct: DirectMode::Preferred,
                        ..opts
                    },
                )
                .unwrap();
                assert!(!d.is_direct());
            }
            Ok(d) => {
                eprintln!("NOTE: tmpfs accepts O_DIRECT on this kernel");
                conformance::round_trips(&d);
            }
            Err(e) => panic!("unexpected error on tmpfs: {e}"),
        }
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn missing_file_and_bad_size_are_named() {
    let e =
        FileDevice::open(Path::new("/nonexistent/sce/dev"), &FileOptions::default()).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/sce/dev"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("odd");
    std::fs::write(&p, vec![0u8; 1000]).unwrap();
    let e = FileDevice::open(
        &p,
        &FileOptions {
            direct: DirectMode::Off,
            ..FileOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(e, IoError::Invalid(_)) && e.to_string().contains("odd"),
        "{e}"
    );
}

#[test]
fn block_device_size_comes_from_the_ioctl() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let has_losetup = Command::new("losetup").arg("--version").output().is_ok();
    if !root || !has_losetup {
        eprintln!("SKIP: needs root and losetup to make a loop device (root={root}, losetup={has_losetup})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(12 << 20)
        .unwrap();
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&img)
        .output()
        .unwrap();
    if !out.status.success() {
        eprintln!(
            "SKIP: losetup could not attach a loop device: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return;
    }
    let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let result = std::panic::catch_unwind(|| {
        let d = FileDevice::open(Path::new(&loopdev), &FileOptions::default())
            .expect("open loop device");
        assert!(d.is_block_device());
        assert_eq!(d.size(), 12 << 20, "size from BLKGETSIZE64");
        conformance::round_trips(&d);
        conformance::discard_zeroes(&d);
    });
    let _ = Command::new("losetup").arg("-d").arg(&loopdev).status();
    result.unwrap();
}

fn dev() -> (FaultDevice<MemDevice>, Arc<FaultControl>) {
    let d = FaultDevice::new(MemDevice::new(1 << 20));
    let c = d.control();
    (d, c)
}

#[test]
fn fail_from_and_fail_nth() {
    let (d, c) = dev();
    let mut b = vec![0u8; 512];
    c.fail_from(&[Op::Write], 2);
    d.write_at(0, &b).unwrap();
    d.write_at(0, &b).unwrap();
    assert!(matches!(
        d.write_at(0, &b),
        Err(IoError::Injected { op: Op::Write, .. })
    ));
    assert!(d.write_at(0, &b).is_err());
    d.read_at(0, &mut b).expect("reads unaffected");
    c.clear();
    c.fail_nth(Op::Read, 2);
    d.read_at(0, &mut b).expect("read #1");
    assert!(d.read_at(0, &mut b).is_err(), "read #2 (0-based) fails");
    d.read_at(0, &mut b).expect("read #3");
    assert_eq!(c.ops(Op::Read), 4);
    assert!(c.faults_fired() >= 3);
    // Range checks come first: a bad request is not an injected fault.
    c.fail_from(&[Op::Read], 0);
    assert!(matches!(
        d.read_at(1 << 20, &mut b),
        Err(IoError::OutOfRange { .. })
    ));
}

#[test]
fn fail_range_only_in_range() {
    let (d, c) = dev();
    let b = vec![1u8; 4096];
    c.fail_range(&[Op::Write, Op::Discard], 8192..12288);
    d.write_at(4096, &b).unwrap();
    assert!(d.write_at(8192, &b).is_err());
    assert!(
        d.write_at(4096, &vec![0; 8192]).is_err(),
        "overlapping write fails"
    );
    assert!(d.discard(10240, 512).is_err());
    d.write_at(12288, &b).unwrap();
}

#[test]
fn silent_corruption_of_reads_and_writes() {
    let (d, c) = dev();
    let b = vec![0xAAu8; 4096];
    d.write_at(0, &b).unwrap();
    c.corrupt_reads(0..512);
    let mut r = vec![0u8; 4096];
    d.read_at(0, &mut r).unwrap();
    assert_ne!(r, b, "read corrupted");
    d.read_at(4096, &mut r).unwrap();
    assert!(r.iter().all(|&x| x == 0), "other range intact");
    c.clear();
    c.corrupt_writes(8192..8193);
    d.write_at(8192, &b).unwrap();
    c.clear();
    d.read_at(8192, &mut r).unwrap();
    assert_ne!(r, b, "stored data corrupted");
    assert_eq!(
        r.iter().filter(|&&x| x != 0xAA).count(),
        1,
        "one byte differs"
    );
}

#[test]
fn lost_torn_and_misdirected_writes() {
    let (d, c) = dev();
    let b = vec![0x55u8; 8192];
    let mut r = vec![0u8; 8192];
    c.drop_writes(0..8192);
    d.write_at(0, &b).unwrap();
    d.read_at(0, &mut r).unwrap();
    assert!(r.iter().all(|&x| x == 0), "lost write stored nothing");
    c.clear();
    c.tear_writes(16384..16385);
    d.write_at(16384, &b).unwrap();
    d.read_at(16384, &mut r).unwrap();
    assert!(
        r[..4096].iter().all(|&x| x == 0x55) && r[4096..].iter().all(|&x| x == 0),
        "torn in half"
    );
    c.clear();
    c.misdirect_writes(32768..40960, 65536);
    d.write_at(32768, &b).unwrap();
    d.read_at(32768, &mut r).unwrap();
    assert!(r.iter().all(|&x| x == 0), "nothing at the intended place");
    d.read_at(32768 + 65536, &mut r).unwrap();
    assert!(r.iter().all(|&x| x == 0x55), "landed at offset + delta");
}

/// Counts concurrent operations of the inner device.
struct Probe {
    inner: MemDevice,
    now: AtomicUsize,
    max: AtomicUsize,
}

impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, o: u64, b: &mut [u8]) -> Result<(), IoError> {
        let n = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(n, SeqCst);
        std::thread::sleep(Duration::from_millis(2));
        self.now.fetch_sub(1, SeqCst);
        self.inner.read_at(o, b)
    }
    fn write_at(&self, o: u64, b: &[u8]) -> Result<(), IoError> {
        self.inner.write_at(o, b)
    }
    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    fn discard(&self, o: u64, l: u64) -> Result<(), IoError> {
        self.inner.discard(o, l)
    }
}

#[test]
fn latency_bounds_concurrency_and_delays() {
    let probe = Probe {
        inner: MemDevice::new(1 << 20),
        now: AtomicUsize::new(0),
        max: AtomicUsize::new(0),
    };
    let d = Arc::new(LatencyDevice::new(
        probe,
        LatencyConfig::disk(Duration::from_millis(3), 3),
    ));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..8 {
            let d = d.clone();
            s.spawn(move || {
                let mut b = vec![0u8; 512];
                for _ in 0..4 {
                    d.read_at(0, &mut b).unwrap();
                }
            });
        }
    });
    let max = d.inner().max.load(SeqCst);
    assert!((1..=3).contains(&max), "at most 3 in flight, saw {max}");
    // 32 ops, 3 at a time, each at least 3 ms: a lower bound only.
    assert!(
        t0.elapsed() >= Duration::from_millis(3 * 32 / 3),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn bandwidth_is_shared() {
    let cfg = LatencyConfig {
        bandwidth: Some(64 << 20),
        ..LatencyConfig::disk(Duration::ZERO, 8)
    };
    let d = Arc::new(LatencyDevice::new(MemDevice::new(8 << 20), cfg));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let d = d.clone();
            s.spawn(move || {
                let mut b = AlignedBuf::new(1 << 20);
                d.read_at(i << 20, &mut b).unwrap();
            });
        }
    });
    // 4 MiB over a 64 MiB/s link takes at least 62.5 ms, however many threads.
    assert!(
        t0.elapsed() >= Duration::from_millis(60),
        "{:?}",
        t0.elapsed()
    );
}
