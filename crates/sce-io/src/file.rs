//! `FileDevice`: a regular file or a block device, opened with O_DIRECT by default.
//! shape-rule: one device type (open, lock, identity, the trait) reads best in one file; its tests are a third of it.
//!
//! I/O is positioned (`pread`/`pwrite`), so any number of threads may use one device at once;
//! there is no internal thread pool: the engine's own worker threads are the pool. A block
//! device's size comes from the BLKGETSIZE64 ioctl and its logical block size from BLKSSZGET
//! (`metadata().len()` is 0 for block devices).

use crate::buf::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::error::{check_range, IoError, Op};
use crate::BlockDevice;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Linux `_IOC` request-number encoding. Most architectures use 2 direction bits at bit 30
/// (none = 0, read = 2); mips, powerpc and sparc use 3 at bit 29 (none = 1, read = 2).
mod ioc {
    const ALT: bool = cfg!(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "powerpc",
        target_arch = "powerpc64",
        target_arch = "sparc",
        target_arch = "sparc64"
    ));

    const fn ioc(read: bool, ty: u32, nr: u32, size: u32) -> u32 {
        let (dir, shift) = match (ALT, read) {
            (false, false) => (0, 30),
            (false, true) => (2, 30),
            (true, false) => (1, 29),
            (true, true) => (2, 29),
        };
        (dir << shift) | (size << 16) | (ty << 8) | nr
    }

    /// `_IOR(0x12, 114, size_t)`: the size of a block device in bytes, as a u64.
    pub const BLKGETSIZE64: u32 = ioc(true, 0x12, 114, std::mem::size_of::<usize>() as u32);
    /// `_IO(0x12, 104)`: the logical sector size of a block device, as an int.
    pub const BLKSSZGET: u32 = ioc(false, 0x12, 104, 0);
    /// `_IO(0x12, 127)`: zero a byte range `[u64 start, u64 len]` of a block device.
    pub const BLKZEROOUT: u32 = ioc(false, 0x12, 127, 0);
}
use ioc::{BLKGETSIZE64, BLKSSZGET, BLKZEROOUT};

/// The logical block size of regular files. With O_DIRECT it is raised to the filesystem's
/// direct-I/O offset alignment when that is larger (a filesystem on a 4096-byte-sector disk),
/// so that every aligned request is one the kernel accepts.
const FILE_BLOCK_SIZE: u32 = 512;

/// Whether to use O_DIRECT (bypass the page cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// Use O_DIRECT; fail with `IoError::DirectIoUnsupported` where the filesystem refuses it.
    #[default]
    Required,
    /// Use O_DIRECT where possible, buffered I/O where the filesystem refuses it
    /// (`FileDevice::is_direct` tells which one was used).
    Preferred,
    /// Buffered I/O.
    Off,
}

/// Whether to hold a lock on the opened file or device for the life of the `FileDevice`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LockMode {
    /// No lock.
    #[default]
    None,
    /// A shared `flock`: other shared holders are allowed, an exclusive one is refused.
    Shared,
    /// An exclusive `flock` (and `O_EXCL` for a block device, which the kernel refuses while
    /// the device is mounted or held exclusively by someone else).
    Exclusive,
}

/// How to open a `FileDevice`. The default: O_DIRECT required, no creation, read-write, no
/// lock.
#[derive(Clone, Debug, Default)]
pub struct FileOptions {
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// For a regular file: create it if missing with this length (sparse). An existing file
    /// must already have this length (an empty one is extended): a file is never truncated or
    /// resized implicitly. Must be a positive multiple of 512 and cannot be combined with
    /// `read_only`. Ignored for block devices, whose size is fixed.
    pub create_size: Option<u64>,
    /// Open read-only: writes and discards then fail with `IoError::Unsupported`.
    pub read_only: bool,
    /// The lock to take (without waiting) and hold while the device is open.
    pub lock: LockMode,
}

/// A regular file or a block device, used with positioned I/O from any number of threads.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    size: u64,
    lbs: u32,
    direct: bool,
    block_device: bool,
    read_only: bool,
    created: bool,
}

fn open_err(path: &Path, source: std::io::Error) -> IoError {
    IoError::Open {
        path: path.to_path_buf(),
        source,
    }
}

/// Refuses a size to create that cannot be one.
fn check_create(path: &Path, opts: &FileOptions) -> Result<(), IoError> {
    if let Some(n) = opts.create_size {
        if opts.read_only {
            return Err(IoError::Invalid(format!(
                "{}: a size to create cannot be combined with read-only",
                path.display()
            )));
        }
        if n == 0 || !n.is_multiple_of(FILE_BLOCK_SIZE as u64) {
            return Err(IoError::Invalid(format!(
                "{}: size {n} to create is not a positive multiple of {FILE_BLOCK_SIZE}",
                path.display()
            )));
        }
    }
    Ok(())
}

/// Opens (and with `create_size`, creates) the file, with O_DIRECT as `opts.direct` asks and
/// O_EXCL for a block device held exclusively. Returns the file, whether it is O_DIRECT and
/// whether this call created it.
fn open_file(path: &Path, opts: &FileOptions) -> Result<(File, bool, bool), IoError> {
    let mut oo = OpenOptions::new();
    oo.read(true).write(!opts.read_only);
    let mut created = false;
    if opts.create_size.is_some() {
        // Create it here if it is missing, so that we know whether it is ours to remove.
        match OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(_) => created = true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(open_err(path, e)),
        }
    }
    let exclusive_blockdev = opts.lock == LockMode::Exclusive
        && std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    if exclusive_blockdev {
        oo.custom_flags(libc::O_EXCL);
    }
    if opts.direct == DirectMode::Off {
        return Ok((
            oo.open(path).map_err(|e| open_err(path, e))?,
            false,
            created,
        ));
    }
    let mut d = oo.clone();
    d.custom_flags(libc::O_DIRECT | if exclusive_blockdev { libc::O_EXCL } else { 0 });
    match d.open(path) {
        Ok(f) => Ok((f, true, created)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if opts.direct == DirectMode::Required {
                return Err(IoError::DirectIoUnsupported {
                    path: path.to_path_buf(),
                });
            }
            Ok((
                oo.open(path).map_err(|e| open_err(path, e))?,
                false,
                created,
            ))
        }
        Err(e) => Err(open_err(path, e)),
    }
}

/// A block device's size and logical block size (512 if the kernel gives none that fits).
fn block_device_geometry(file: &File, path: &Path) -> Result<(u64, u32), IoError> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if r != 0 {
        return Err(open_err(path, std::io::Error::last_os_error()));
    }
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
    let r = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            BLKSSZGET as _,
            &mut lbs as *mut libc::c_int,
        )
    };
    if r != 0 || lbs <= 0 || !(lbs as u32).is_power_of_two() {
        lbs = 512;
    }
    Ok((size, lbs as u32))
}

/// A regular file's size (set to `create_size` when it was empty; a file of another size is
/// never resized) and its block size (the O_DIRECT alignment, at least 4 KiB).
fn file_geometry(
    file: &File,
    meta: &std::fs::Metadata,
    path: &Path,
    opts: &FileOptions,
    direct: bool,
) -> Result<(u64, u32), IoError> {
    if let Some(n) = opts.create_size {
        if meta.len() == 0 {
            file.set_len(n).map_err(|e| open_err(path, e))?;
        } else if meta.len() != n {
            return Err(IoError::Invalid(format!(
                "{} exists with {} bytes, not {n}; refusing to resize it",
                path.display(),
                meta.len()
            )));
        }
    }
    let lbs = if direct {
        dio_offset_align(file).max(FILE_BLOCK_SIZE)
    } else {
        FILE_BLOCK_SIZE
    };
    Ok((file.metadata().map_err(|e| open_err(path, e))?.len(), lbs))
}

impl FileDevice {
    /// Opens the regular file or block device at `path` according to `opts`.
    ///
    /// Errors: `Open` (naming the path) when the OS refuses, `DirectIoUnsupported` when
    /// O_DIRECT is required and refused, `Invalid` for a size that is not a positive
    /// multiple of the logical block size or for a path that is neither a file nor a block
    /// device.
    pub fn open(path: &Path, opts: &FileOptions) -> Result<FileDevice, IoError> {
        check_create(path, opts)?;
        let (file, direct, created) = open_file(path, opts)?;
        if opts.lock != LockMode::None {
            lock_file(&file, path, opts.lock)?;
        }
        let meta = file.metadata().map_err(|e| open_err(path, e))?;
        let block_device = meta.file_type().is_block_device();
        let (size, lbs) = if block_device {
            block_device_geometry(&file, path)?
        } else if meta.file_type().is_file() {
            file_geometry(&file, &meta, path, opts, direct)?
        } else {
            return Err(IoError::Invalid(format!(
                "{} is neither a regular file nor a block device",
                path.display()
            )));
        };
        if size == 0 || size % lbs as u64 != 0 {
            return Err(IoError::Invalid(format!(
                "{}: size {size} is not a positive multiple of its {lbs}-byte logical block size",
                path.display()
            )));
        }
        Ok(FileDevice {
            file,
            path: path.to_path_buf(),
            size,
            lbs,
            direct,
            block_device,
            read_only: opts.read_only,
            created,
        })
    }

    /// True if this open created the file (it did not exist before).
    pub fn created(&self) -> bool {
        self.created
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if opened with O_DIRECT (with `DirectMode::Preferred`, false after a fallback).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// True if it is a block device (false for a regular file).
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// True if opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The open file, for the I/O queues.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    fn check_writable(&self, op: Op) -> Result<(), IoError> {
        if self.read_only {
            return Err(IoError::Unsupported { op });
        }
        Ok(())
    }

    fn needs_bounce(&self, p: *const u8) -> bool {
        self.direct && !(p as usize).is_multiple_of(DIRECT_IO_ALIGN)
    }

    fn io_err(op: Op, offset: u64, len: u64, source: std::io::Error) -> IoError {
        IoError::Io {
            op,
            offset,
            len,
            source,
        }
    }

    /// Writes zeroes over a range, in chunks of at most 1 MiB (aligned, for O_DIRECT).
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let chunk = AlignedBuf::new((1 << 20).min(len as usize));
        let mut at = offset;
        while at < offset + len {
            let n = chunk.len().min((offset + len - at) as usize);
            self.file
                .write_all_at(&chunk[..n], at)
                .map_err(|e| Self::io_err(Op::Discard, at, n as u64, e))?;
            at += n as u64;
        }
        Ok(())
    }
}

/// The identity of a regular file from its metadata.
fn file_identity(m: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    format!(
        "file:dev={}:ino={}:size={}:mtime={}.{:09}:ctime={}.{:09}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    )
}

/// What the kernel says identifies a block device's medium: its WWN or serial, or for a loop
/// device its backing file (and that file's identity). Empty if nothing is known.
fn block_device_serial(maj: u32, min: u32) -> String {
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    let read = |p: PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    // A partition's serial is its disk's; add the partition's start to tell them apart.
    let (disk, start) = match read(sys.join("start")) {
        Some(start) => (sys.join(".."), start),
        None => (sys.clone(), "0".into()),
    };
    let mut parts = vec![format!("start={start}")];
    for f in ["wwid", "device/wwid", "device/serial", "serial"] {
        if let Some(v) = read(disk.join(f)) {
            parts.push(format!("{f}={v}"));
            break;
        }
    }
    if let Some(b) = read(disk.join("loop/backing_file")) {
        let id = std::fs::metadata(&b).map_or_else(|_| "gone".into(), |m| file_identity(&m));
        parts.push(format!("loop={b}:{id}"));
    }
    parts.join(":")
}

/// Takes `mode` as an `flock` on `file` without waiting; the error names the path and, where
/// /proc/locks tells, the process that holds it.
fn lock_file(file: &File, path: &Path, mode: LockMode) -> Result<(), IoError> {
    let op = match mode {
        LockMode::None => return Ok(()),
        LockMode::Shared => libc::LOCK_SH,
        LockMode::Exclusive => libc::LOCK_EX,
    };
    // A killed process's io_uring holds its lock a moment after it died: try up to 5 s.
    let mut tries = 0;
    let e = loop {
        // SAFETY: flock takes a valid open descriptor and flags; no memory is passed.
        let r = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        tries += 1;
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) || tries >= 50 {
            break e;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(open_err(path, e));
    }
    let holder = file
        .metadata()
        .ok()
        .and_then(|m| lock_holder(&m))
        .map_or_else(String::new, |pid| format!(" by process {pid}"));
    Err(IoError::Busy {
        path: path.to_path_buf(),
        holder,
    })
}

/// The pid of a process holding an `flock` on the inode of `m`, from /proc/locks.
fn lock_holder(m: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let dev = m.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        m.ino()
    );
    let me = std::process::id();
    let text = std::fs::read_to_string("/proc/locks").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        let (kind, pid, id) = (f.get(1)?, f.get(4)?, f.get(5)?);
        let pid: u32 = pid.parse().ok()?;
        (*kind == "FLOCK" && *id == want && pid != me).then_some(pid)
    })
}

impl BlockDevice for FileDevice {
    /// For a regular file: its device and inode numbers, size, and modification and change
    /// times. For a block device: its major:minor, size, and the serial or WWN the kernel
    /// reports (for a loop device, its backing file's identity).
    fn identity(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let m = self.file.metadata().ok()?;
        if self.block_device {
            let (maj, min) = (libc::major(m.rdev()), libc::minor(m.rdev()));
            Some(format!(
                "block:{maj}:{min}:size={}:{}",
                self.size,
                block_device_serial(maj, min)
            ))
        } else {
            Some(file_identity(&m))
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        check_range(Op::Read, offset, len, self.size, self.lbs)?;
        if len == 0 {
            return Ok(());
        }
        if self.needs_bounce(buf.as_ptr()) {
            let mut b = AlignedBuf::new(buf.len());
            self.file
                .read_exact_at(&mut b, offset)
                .map_err(|e| Self::io_err(Op::Read, offset, len, e))?;
            buf.copy_from_slice(&b);
            return Ok(());
        }
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| Self::io_err(Op::Read, offset, len, e))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        check_range(Op::Write, offset, len, self.size, self.lbs)?;
        self.check_writable(Op::Write)?;
        if len == 0 {
            return Ok(());
        }
        if self.needs_bounce(buf.as_ptr()) {
            let mut b = AlignedBuf::new(buf.len());
            b.copy_from_slice(buf);
            return self
                .file
                .write_all_at(&b, offset)
                .map_err(|e| Self::io_err(Op::Write, offset, len, e));
        }
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| Self::io_err(Op::Write, offset, len, e))
    }

    fn flush(&self) -> Result<(), IoError> {
        self.file
            .sync_data()
            .map_err(|e| Self::io_err(Op::Flush, 0, 0, e))
    }

    /// `lseek`, or nothing for a block device.
    fn extents_are_local(&self) -> bool {
        true
    }

    /// A regular file's holes, from `SEEK_DATA`/`SEEK_HOLE`; a block device: all data.
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<crate::Extent>, IoError> {
        check_range(Op::Read, offset, len, self.size, self.lbs)?;
        if self.block_device {
            return crate::extent::all_data(offset, len, self.size, self.lbs);
        }
        Ok(crate::extent::file_extents(
            self.file.as_raw_fd(),
            offset,
            len,
            max,
        ))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, self.lbs)?;
        self.check_writable(Op::Discard)?;
        if len == 0 {
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        if self.block_device {
            let range = [offset, len];
            // SAFETY: BLKZEROOUT reads two u64 through the pointer, which is valid.
            let r = unsafe { libc::ioctl(fd, BLKZEROOUT as _, range.as_ptr()) };
            if r == 0 {
                return Ok(());
            }
        } else {
            // SAFETY: plain syscall on an open descriptor with integer arguments.
            let r = unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r == 0 {
                return Ok(());
            }
        }
        // Not supported here (EOPNOTSUPP from the filesystem, no BLKZEROOUT for this
        // device): write zeroes, so the range still reads back as zeroes. A device that is
        // really failing fails these writes too, with their own error.
        self.write_zeroes(offset, len)
    }
}

/// The filesystem's O_DIRECT file-offset alignment (statx `STATX_DIOALIGN`, Linux 6.1+), or 0
/// when the kernel or filesystem does not say.
fn dio_offset_align(file: &File) -> u32 {
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, an empty NUL-terminated path with AT_EMPTY_PATH (so the
    // descriptor itself is examined), and a valid pointer to a `statx` for the kernel to fill.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    let a = stx.stx_dio_offset_align;
    if r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && a.is_power_of_two() && a <= 65536 {
        a
    } else {
        0
    }
}

impl std::os::fd::AsRawFd for FileDevice {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    ))]
    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        assert_eq!(BLKGETSIZE64, 0x8008_1272);
        assert_eq!(BLKSSZGET, 0x1268);
        assert_eq!(BLKZEROOUT, 0x127F);
        assert_eq!(BLKSSZGET as libc::Ioctl, libc::BLKSSZGET);
    }
}
