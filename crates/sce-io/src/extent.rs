//! Allocation extents: which ranges of a device are holes that read as zeroes, for NBD's
//! `base:allocation` block status (what `nbdinfo --map` and `qemu-img map` show).

use crate::{check_range, IoError, Op};
use std::os::fd::RawFd;

/// The most extents one query returns: a query over a badly fragmented range answers for a
/// prefix of it, and the caller asks again from where it ends.
pub const MAX_EXTENTS: usize = 4096;

/// A run of blocks with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (nonzero).
    pub len: u64,
    /// Not allocated on the device: it reads as zeroes and costs no space.
    pub hole: bool,
}

impl Extent {
    /// Allocated data (what a device that cannot tell reports).
    pub fn data(len: u64) -> Extent {
        Extent { len, hole: false }
    }

    /// A hole.
    pub fn hole(len: u64) -> Extent {
        Extent { len, hole: true }
    }
}

/// Extents of `[offset, offset + len)` of a device that cannot tell: all data.
pub fn all_data(offset: u64, len: u64, size: u64, lbs: u32) -> Result<Vec<Extent>, IoError> {
    check_range(Op::Read, offset, len, size, lbs)?;
    Ok(if len == 0 {
        Vec::new()
    } else {
        vec![Extent::data(len)]
    })
}

/// Extents of `[offset, offset + len)` of a file, from `lseek(SEEK_DATA / SEEK_HOLE)`. A file
/// system that cannot tell (or a block device) reports all data, which is always true.
/// Extents are merged when adjacent and equal, and cut at the end of the range; at most
/// `max` of them (and [`MAX_EXTENTS`]), each whole but one cut at the range's end.
pub fn file_extents(fd: RawFd, offset: u64, len: u64, max: usize) -> Vec<Extent> {
    let max = max.clamp(1, MAX_EXTENTS);
    let end = offset + len;
    let mut out: Vec<Extent> = Vec::new();
    let mut at = offset;
    while at < end && out.len() < max {
        let Some(data) = seek(fd, at, libc::SEEK_DATA) else {
            // ENXIO: no data at or after `at` (the rest is a hole); any other error: the
            // file system cannot tell, so the rest is reported as data.
            let hole = std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
            push(
                &mut out,
                Extent {
                    len: end - at,
                    hole,
                },
            );
            break;
        };
        if data > at {
            push(&mut out, Extent::hole(data.min(end) - at));
            at = data.min(end);
            continue;
        }
        let next_hole = seek(fd, at, libc::SEEK_HOLE).unwrap_or(end).min(end);
        // A hole seek that does not move on (a racing truncate) must not loop forever.
        let next_hole = next_hole.max(at + 1).min(end);
        push(&mut out, Extent::data(next_hole - at));
        at = next_hole;
    }
    out
}

fn seek(fd: RawFd, at: u64, whence: libc::c_int) -> Option<u64> {
    let at = i64::try_from(at).ok()?;
    // SAFETY: lseek on a descriptor the caller keeps open; it moves only this descriptor's
    // offset, which no other code uses (all I/O is positional: pread/pwrite).
    let r = unsafe { libc::lseek(fd, at, whence) };
    (r >= 0).then_some(r as u64)
}

fn push(out: &mut Vec<Extent>, e: Extent) {
    if e.len == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.hole == e.hole => last.len += e.len,
        _ => out.push(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_sparse_file_shows_its_holes_and_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("sparse"))
            .unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[7u8; 1 << 20], 2 << 20).unwrap();
        f.sync_all().unwrap();
        let e = file_extents(f.as_raw_fd(), 0, 8 << 20, MAX_EXTENTS);
        let total: u64 = e.iter().map(|e| e.len).sum();
        assert_eq!(total, 8 << 20, "{e:?}");
        // Every Linux file system of today (ext4, xfs, btrfs, tmpfs, overlayfs) knows its
        // holes.
        assert_eq!(
            e,
            vec![
                Extent::hole(2 << 20),
                Extent::data(1 << 20),
                Extent::hole(5 << 20)
            ]
        );
        let mid = file_extents(f.as_raw_fd(), (2 << 20) + 4096, 8192, MAX_EXTENTS);
        assert_eq!(mid, vec![Extent::data(8192)]);
        assert!(file_extents(f.as_raw_fd(), 0, 0, MAX_EXTENTS).is_empty());
    }
}
