//! Guards that keep sce from destroying what is not its own: a cache path that is (or
//! overlaps) the source, a device that holds data that is not an sce cache, two exports that
//! share a device. Every check runs before anything is written.

use anyhow::{bail, Result};
use sce_io::{AlignedBuf, BlockDevice};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// First bytes of a non-persistent (`--no-persist`) cache device: its first 8 KiB hold this
/// marker, so that the next start knows the device is sce's to overwrite.
pub const VOLATILE_MAGIC: &[u8; 16] = b"SCE-VOLATILE-V1\n";
/// Bytes reserved at the start of a non-persistent cache device for the marker.
pub const VOLATILE_HEADER: u64 = 8192;

/// What a cache device holds before sce uses it.
#[derive(Debug)]
pub enum Contents {
    /// Nothing: its first MiB reads as zeroes (or it is empty).
    Blank,
    /// A persistent sce cache (its superblock decodes, or is from another sce version).
    SceCache,
    /// A non-persistent sce cache (the volatile marker).
    VolatileCache,
    /// Something else; the string says what was seen.
    Foreign(String),
}

/// True if the regular file at `path` holds data past its first `from` bytes (its
/// allocated extents, as `SEEK_DATA` sees them). False for block devices and when unknown.
fn file_data_after(path: Option<&Path>, from: u64) -> bool {
    use std::os::unix::io::AsRawFd;
    let Some(p) = path else { return false };
    let Ok(f) = std::fs::File::open(p) else {
        return false;
    };
    if !f.metadata().is_ok_and(|m| m.file_type().is_file()) {
        return false;
    }
    // SAFETY: lseek on a descriptor we own; no memory is passed.
    let r = unsafe { libc::lseek(f.as_raw_fd(), from as libc::off_t, libc::SEEK_DATA) };
    r >= 0
}

/// Looks at the start of `dev` (at `path`, if it is a file) to tell whose it is. Reads at
/// most 1 MiB; a regular file whose first MiB is zero counts as blank only if it holds no
/// data past it either.
pub fn contents_at(dev: &dyn BlockDevice, path: Option<&Path>) -> Result<Contents> {
    let c = contents(dev)?;
    if matches!(c, Contents::Blank) && file_data_after(path, 1 << 20) {
        return Ok(Contents::Foreign(
            "its first MiB is zero but it holds data further in".into(),
        ));
    }
    Ok(c)
}

/// Looks at the start of `dev` to tell whose it is. Reads at most 1 MiB.
pub fn contents(dev: &dyn BlockDevice) -> Result<Contents> {
    let n = dev.size().min(1 << 20);
    let mut buf = AlignedBuf::new(n as usize);
    dev.read_at(0, &mut buf)?;
    if buf.starts_with(VOLATILE_MAGIC) {
        return Ok(Contents::VolatileCache);
    }
    match sce_store::read_superblock(dev) {
        Ok(_)
        | Err(sce_store::StoreError::Version(_))
        | Err(sce_store::StoreError::OldVersion(_))
        | Err(sce_store::StoreError::Corrupt(_)) => return Ok(Contents::SceCache),
        _ => {}
    }
    if buf.iter().all(|&b| b == 0) {
        return Ok(Contents::Blank);
    }
    let first: String = buf[..16]
        .iter()
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '.' })
        .collect();
    Ok(Contents::Foreign(format!(
        "its first MiB is not zero and it is not an sce cache (starts with \"{first}\")"
    )))
}

/// Writes the volatile marker over the first `VOLATILE_HEADER` bytes of `dev`.
pub fn mark_volatile(dev: &dyn BlockDevice) -> Result<()> {
    let mut b = AlignedBuf::new(VOLATILE_HEADER as usize);
    b[..VOLATILE_MAGIC.len()].copy_from_slice(VOLATILE_MAGIC);
    dev.write_at(0, &b)?;
    dev.flush()?;
    Ok(())
}

/// Where a path's bytes live: a file's (device, inode), or a block device's whole disk and
/// the byte range of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    /// A regular file.
    File {
        /// The device of its filesystem.
        dev: u64,
        /// Its inode number.
        ino: u64,
    },
    /// A block device: its disk's major:minor, and the bytes of the disk it covers.
    Block {
        /// The whole disk's major:minor.
        disk: (u32, u32),
        /// The first byte of the disk it covers.
        start: u64,
        /// The byte past the last it covers.
        end: u64,
    },
    /// A path that does not exist yet, by its canonical name.
    Missing(PathBuf),
}

/// `path` with its directory canonicalized (the file itself may not exist).
pub fn canonical_name(path: &Path) -> PathBuf {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    match path.file_name() {
        Some(n) => dir.join(n),
        None => dir,
    }
}

impl Storage {
    /// True if the two share bytes.
    pub fn overlaps(&self, other: &Storage) -> bool {
        match (self, other) {
            (Storage::File { dev: a, ino: b }, Storage::File { dev: c, ino: d }) => {
                a == c && b == d
            }
            (
                Storage::Block {
                    disk: a,
                    start: s1,
                    end: e1,
                },
                Storage::Block {
                    disk: b,
                    start: s2,
                    end: e2,
                },
            ) => a == b && s1 < e2 && s2 < e1,
            (Storage::Missing(a), Storage::Missing(b)) => a == b,
            _ => false,
        }
    }
}

fn sys_u64(p: PathBuf) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Where the bytes of `path` live, and for a loop device also its backing file. None if the
/// path does not exist (yet) or is a URI.
pub fn storage(path: &Path) -> Option<Vec<Storage>> {
    let m = std::fs::metadata(path).ok()?;
    if m.file_type().is_file() {
        return Some(vec![Storage::File {
            dev: m.dev(),
            ino: m.ino(),
        }]);
    }
    if !m.file_type().is_block_device() {
        return Some(Vec::new());
    }
    let (maj, min) = (libc::major(m.rdev()), libc::minor(m.rdev()));
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    let sectors = sys_u64(sys.join("size")).unwrap_or(u64::MAX / 512);
    let mut out = Vec::new();
    match sys_u64(sys.join("start")) {
        // A partition: its disk is the parent directory in sysfs.
        Some(start) => {
            let disk = std::fs::read_to_string(sys.join("../dev"))
                .ok()
                .and_then(|s| {
                    let (a, b) = s.trim().split_once(':')?;
                    Some((a.parse().ok()?, b.parse().ok()?))
                })
                .unwrap_or((maj, min));
            out.push(Storage::Block {
                disk,
                start: start * 512,
                end: (start + sectors) * 512,
            });
        }
        None => out.push(Storage::Block {
            disk: (maj, min),
            start: 0,
            end: sectors.saturating_mul(512),
        }),
    }
    // A loop device's bytes are its backing file's.
    if let Ok(b) = std::fs::read_to_string(sys.join("loop/backing_file")) {
        if let Ok(bm) = std::fs::metadata(b.trim()) {
            out.push(Storage::File {
                dev: bm.dev(),
                ino: bm.ino(),
            });
        }
    }
    Some(out)
}

/// One path an export uses, and what for.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The export's name.
    pub export: String,
    /// "source" or "cache".
    pub role: &'static str,
    /// The path (or URI) as given.
    pub path: String,
}

/// Refuses any two claims whose bytes overlap, where at least one of them is a cache (a
/// cache is written from offset 0, so it would destroy the source or another cache). Two
/// read-only uses of one source are fine; two exports writing one source through two caches
/// are refused too, since neither cache would see the other's writes.
pub fn refuse_overlaps(claims: &[Claim]) -> Result<()> {
    // Paths that do not exist yet (a cache file to create) are told apart by name.
    let located: Vec<(&Claim, Vec<Storage>)> = claims
        .iter()
        .filter(|c| !c.path.contains("://"))
        .map(|c| {
            let p = Path::new(&c.path);
            let s = storage(p).unwrap_or_else(|| vec![Storage::Missing(canonical_name(p))]);
            (c, s)
        })
        .collect();
    for (i, (a, sa)) in located.iter().enumerate() {
        for (b, sb) in &located[i + 1..] {
            if a.role == "source" && b.role == "source" {
                continue;
            }
            // Exports that name the same cache share it (one cached volume over their
            // sources); the same storage under two names would be two caches on it.
            if a.role == "cache"
                && b.role == "cache"
                && canonical_name(Path::new(&a.path)) == canonical_name(Path::new(&b.path))
            {
                continue;
            }
            if sa.iter().any(|x| sb.iter().any(|y| x.overlaps(y))) {
                let what = |c: &Claim| {
                    let ex = if c.export.is_empty() {
                        String::new()
                    } else {
                        format!(" of export {:?}", c.export)
                    };
                    format!("the {}{ex} ({})", c.role, c.path)
                };
                bail!(
                    "{} and {} are the same storage (or overlap): refusing, since sce writes \
                     its cache from the first byte and would destroy the other",
                    what(a),
                    what(b)
                );
            }
        }
    }
    Ok(())
}
