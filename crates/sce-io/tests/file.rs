//! `FileDevice` specifics: O_DIRECT refusal (tmpfs, procfs, sysfs), block devices through a
//! loop device, file creation and sizes, read-only devices, hole punching.

use sce_io::*;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn opts(direct: DirectMode, create_size: Option<u64>) -> FileOptions {
    FileOptions {
        direct,
        create_size,
        read_only: false,
        ..Default::default()
    }
}

fn fs_type(mount_point: &Path) -> Option<String> {
    let m = std::fs::read_to_string("/proc/mounts").ok()?;
    m.lines().find_map(|l| {
        let f: Vec<_> = l.split_whitespace().collect();
        (f.len() > 2 && Path::new(f[1]) == mount_point).then(|| f[2].to_string())
    })
}

/// Removes a file when dropped, so a failing assertion does not leave it in /dev/shm.
struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn tmpfs_refuses_o_direct_or_skip() {
    let shm = Path::new("/dev/shm");
    match fs_type(shm).as_deref() {
        Some("tmpfs") => {}
        other => {
            sce_testkit::require(
                false,
                "a tmpfs mount at /dev/shm",
                &format!("found {other:?}; a standard Linux system mounts one"),
            );
            return;
        }
    }
    let path = shm.join(format!("sce-io-test-{}", std::process::id()));
    let _rm = RemoveOnDrop(path.clone());
    match FileDevice::open(&path, &opts(DirectMode::Required, Some(8 << 20))) {
        Err(IoError::DirectIoUnsupported { path: p }) => {
            assert_eq!(p, path, "the error names the file");
            let d = FileDevice::open(&path, &opts(DirectMode::Preferred, Some(8 << 20)))
                .expect("Preferred falls back to buffered I/O on tmpfs");
            assert!(!d.is_direct());
            conformance::round_trips(&d);
        }
        Ok(d) => {
            // tmpfs gained O_DIRECT support in Linux 6.6: then this checks that Required
            // and Preferred use it (procfs and sysfs stand in for the refusal:
            // direct_io_refusal_is_explained).
            eprintln!("note: tmpfs accepts O_DIRECT on this kernel; its use is checked instead");
            assert!(d.is_direct());
            drop(d);
            let d = FileDevice::open(&path, &opts(DirectMode::Preferred, Some(8 << 20))).unwrap();
            assert!(
                d.is_direct(),
                "Preferred uses O_DIRECT where it is accepted"
            );
            conformance::round_trips(&d);
        }
        Err(e) => panic!("unexpected error on tmpfs: {e}"),
    }
}

#[test]
fn direct_io_refusal_is_explained() {
    // procfs refuses O_DIRECT at open on every kernel.
    let p = Path::new("/proc/self/status");
    let ro = |direct| FileOptions {
        direct,
        create_size: None,
        read_only: true,
        ..Default::default()
    };
    let e = FileDevice::open(p, &ro(DirectMode::Required)).unwrap_err();
    assert!(matches!(e, IoError::DirectIoUnsupported { .. }), "{e:?}");
    assert_eq!(e.errno(), libc::EOPNOTSUPP);
    let msg = e.to_string();
    for w in [
        "/proc/self/status",
        "O_DIRECT",
        "buffered",
        "--allow-buffered",
    ] {
        assert!(msg.contains(w), "{msg:?} lacks {w:?}");
    }
    // sysfs refuses O_DIRECT too, and its attribute files claim 4096 bytes: Preferred opens
    // one buffered (procfs files claim 0 bytes, which is refused as a size, not for O_DIRECT).
    let sysfs = [
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "/sys/power/state",
        "/sys/kernel/profiling",
    ]
    .iter()
    .map(Path::new)
    .find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0 && m.len() % 512 == 0));
    let Some(sys) = sysfs else {
        sce_testkit::require(
            false,
            "a readable sysfs attribute file",
            "mount sysfs at /sys",
        );
        return;
    };
    match FileDevice::open(sys, &ro(DirectMode::Required)) {
        Err(IoError::DirectIoUnsupported { .. }) => {}
        other => panic!(
            "sysfs {}: expected DirectIoUnsupported, got {other:?}",
            sys.display()
        ),
    }
    let d = FileDevice::open(sys, &ro(DirectMode::Preferred)).expect("Preferred falls back");
    assert!(!d.is_direct(), "fell back to buffered I/O");
    assert_eq!(d.size() % 512, 0);
    let d = FileDevice::open(sys, &ro(DirectMode::Off)).expect("Off never asks for O_DIRECT");
    assert!(!d.is_direct());
}

#[test]
fn missing_file_is_an_open_error_naming_the_path() {
    let p = Path::new("/nonexistent/sce/dev");
    let e = FileDevice::open(p, &FileOptions::default()).unwrap_err();
    assert!(
        matches!(&e, IoError::Open { path, .. } if path == p),
        "{e:?}"
    );
    assert!(e.to_string().contains("/nonexistent/sce/dev"), "{e}");
    assert_eq!(e.errno(), libc::ENOENT);
    assert!(!e.is_media_error());
}

#[test]
fn bad_sizes_are_rejected_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("odd-sized");
    std::fs::write(&p, vec![0u8; 1000]).unwrap();
    for mode in [DirectMode::Off, DirectMode::Required] {
        let e = FileDevice::open(&p, &opts(mode, None)).unwrap_err();
        assert!(
            matches!(e, IoError::Invalid(_)) && e.to_string().contains("odd-sized"),
            "{mode:?}: {e}"
        );
    }
    let empty = dir.path().join("empty");
    std::fs::write(&empty, []).unwrap();
    let e = FileDevice::open(&empty, &opts(DirectMode::Off, None)).unwrap_err();
    assert!(matches!(e, IoError::Invalid(_)), "{e}");
    // A bad size to create is refused before anything is created.
    let q = dir.path().join("never");
    for n in [0, 1000] {
        let e = FileDevice::open(&q, &opts(DirectMode::Off, Some(n))).unwrap_err();
        assert!(matches!(e, IoError::Invalid(_)), "{e}");
    }
    assert!(!q.exists());
    let e = FileDevice::open(
        &q,
        &FileOptions {
            direct: DirectMode::Off,
            create_size: Some(1 << 20),
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, IoError::Invalid(_)), "create + read-only: {e}");
    assert!(!q.exists());
}

#[test]
fn create_size_creates_sparse_and_never_resizes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dev");
    let d = FileDevice::open(&p, &opts(DirectMode::Required, Some(64 << 20))).unwrap();
    assert_eq!(d.size(), 64 << 20);
    assert_eq!(d.path(), p);
    assert!(!d.is_block_device() && !d.is_read_only());
    assert_eq!(d.logical_block_size() % 512, 0);
    let m = std::fs::metadata(&p).unwrap();
    assert_eq!(m.len(), 64 << 20);
    assert!(m.blocks() * 512 < 1 << 20, "sparse: {} blocks", m.blocks());
    d.write_at(0, &AlignedBuf::new(4096)).unwrap();
    assert!(d.created());
    drop(d);
    // An existing file of another size is refused, not truncated.
    let e = FileDevice::open(&p, &opts(DirectMode::Required, Some(16 << 20))).unwrap_err();
    assert!(e.to_string().contains("refusing to resize"), "{e}");
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 64 << 20);
    let d = FileDevice::open(&p, &opts(DirectMode::Required, Some(64 << 20))).unwrap();
    assert!(!d.created(), "it existed");
    drop(d);
    let d = FileDevice::open(&p, &opts(DirectMode::Required, None)).unwrap();
    assert_eq!(d.size(), 64 << 20, "opened at its size");
}

#[test]
fn locks_are_exclusive_and_name_the_holder() {
    use sce_io::LockMode;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dev");
    let lock = |mode| FileOptions {
        direct: DirectMode::Off,
        create_size: Some(1 << 20),
        read_only: false,
        lock: mode,
    };
    let a = FileDevice::open(&p, &lock(LockMode::Exclusive)).unwrap();
    // A second open in this process is refused too: flock belongs to the open file.
    let e = FileDevice::open(&p, &lock(LockMode::Exclusive)).unwrap_err();
    assert!(matches!(e, IoError::Busy { .. }), "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    let e = FileDevice::open(&p, &lock(LockMode::Shared)).unwrap_err();
    assert!(matches!(e, IoError::Busy { .. }), "{e}");
    drop(a);
    let s1 = FileDevice::open(&p, &lock(LockMode::Shared)).unwrap();
    let s2 = FileDevice::open(&p, &lock(LockMode::Shared)).unwrap();
    assert!(FileDevice::open(&p, &lock(LockMode::Exclusive)).is_err());
    drop((s1, s2));
    FileDevice::open(&p, &lock(LockMode::Exclusive)).unwrap();
}

#[test]
fn identity_changes_with_content_and_replacement() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dev");
    let d = FileDevice::open(&p, &opts(DirectMode::Off, Some(1 << 20))).unwrap();
    let i0 = d.identity().unwrap();
    assert_eq!(d.identity().unwrap(), i0, "stable while nothing changes");
    std::thread::sleep(std::time::Duration::from_millis(20));
    d.write_at(0, &[1u8; 512]).unwrap();
    let i1 = d.identity().unwrap();
    assert_ne!(i1, i0, "a write changes the modification time");
    drop(d);
    // Replaced at the same path with the same size.
    let q = dir.path().join("new");
    std::fs::write(&q, vec![0u8; 1 << 20]).unwrap();
    std::fs::rename(&q, &p).unwrap();
    let d = FileDevice::open(&p, &opts(DirectMode::Off, None)).unwrap();
    assert_ne!(d.identity().unwrap(), i1);
}

#[test]
fn read_only_refuses_writes_and_discards() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dev");
    let w = FileDevice::open(&p, &opts(DirectMode::Off, Some(1 << 20))).unwrap();
    w.write_at(4096, &[0xABu8; 4096]).unwrap();
    drop(w);
    let d = FileDevice::open(
        &p,
        &FileOptions {
            direct: DirectMode::Required,
            create_size: None,
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(d.is_read_only() && d.is_direct());
    let mut b = vec![0u8; 4096];
    d.read_at(4096, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0xAB));
    let e = d.write_at(0, &b).unwrap_err();
    assert!(matches!(e, IoError::Unsupported { op: Op::Write }), "{e:?}");
    assert!(!e.is_media_error());
    let e = d.discard(0, 4096).unwrap_err();
    assert!(
        matches!(e, IoError::Unsupported { op: Op::Discard }),
        "{e:?}"
    );
    d.flush().unwrap();
}

#[test]
fn discard_punches_a_hole() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dev");
    let d = FileDevice::open(&p, &opts(DirectMode::Required, Some(8 << 20))).unwrap();
    let mut data = AlignedBuf::new(4 << 20);
    data.fill(0x5A);
    d.write_at(0, &data).unwrap();
    d.flush().unwrap();
    let before = std::fs::metadata(&p).unwrap().blocks();
    d.discard(1 << 20, 2 << 20).unwrap();
    let after = std::fs::metadata(&p).unwrap().blocks();
    let mut r = AlignedBuf::new(4 << 20);
    d.read_at(0, &mut r).unwrap();
    assert!(r[..1 << 20].iter().all(|&x| x == 0x5A));
    assert!(r[1 << 20..3 << 20].iter().all(|&x| x == 0));
    assert!(r[3 << 20..].iter().all(|&x| x == 0x5A));
    // The temp dir is on a filesystem that punches holes (ext4 here; xfs, btrfs, tmpfs too).
    assert!(
        after + (1 << 20) / 512 <= before,
        "no space freed: {before} -> {after} blocks"
    );
}

#[test]
fn block_device_through_a_loop_device() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let has_losetup = Command::new("losetup").arg("--version").output().is_ok();
    if !sce_testkit::require(
        root && has_losetup,
        "a loop device (root and losetup)",
        &format!("run as root with the Debian package mount (root={root}, losetup={has_losetup})"),
    ) {
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
        sce_testkit::require(
            false,
            "a loop device",
            &format!(
                "losetup could not attach one: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        );
        return;
    }
    let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let result = std::panic::catch_unwind(|| {
        let p = Path::new(&loopdev);
        // create_size is ignored for block devices.
        let d = FileDevice::open(p, &opts(DirectMode::Required, Some(4 << 20)))
            .expect("open loop device");
        assert!(d.is_block_device() && d.is_direct());
        assert_eq!(d.size(), 12 << 20, "size from BLKGETSIZE64, not metadata");
        assert_eq!(d.logical_block_size(), 512, "loop devices default to 512");
        conformance::round_trips(&d);
        conformance::odd_memory_addresses(&d);
        conformance::discard_zeroes(&d);
        let b = FileDevice::open(p, &opts(DirectMode::Off, None)).expect("buffered");
        assert!(!b.is_direct());
        conformance::round_trips(&b);
        conformance::discard_zeroes(&b);
    });
    let detached = Command::new("losetup").arg("-d").arg(&loopdev).status();
    result.unwrap();
    assert!(detached.is_ok_and(|s| s.success()), "losetup -d {loopdev}");
}
