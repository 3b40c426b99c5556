//! `FileDevice`: a regular file or a block device, opened with O_DIRECT by default.
//!
//! I/O is positioned (`pread`/`pwrite`), so any number of threads may use one device at once;
//! the engine's own threads are the thread pool. A block device's size comes from the
//! BLKGETSIZE64 ioctl and its logical block size from BLKSSZGET (`metadata().len()` is 0
//! for block devices).

use crate::buf::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::error::{check_range, IoError, Op};
use crate::BlockDevice;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;
const BLKZEROOUT: libc::c_ulong = 0x127F;

/// Whether to use O_DIRECT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// Use O_DIRECT; fail with `DirectIoUnsupported` where the filesystem refuses it.
    #[default]
    Required,
    /// Use O_DIRECT where possible, buffered I/O elsewhere.
    Preferred,
    /// Buffered I/O.
    Off,
}

/// How to open a `FileDevice`.
#[derive(Clone, Debug, Default)]
pub struct FileOptions {
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// Create the file if missing and set its length to this (sparse).
    pub create_size: Option<u64>,
    /// Open read-only.
    pub read_only: bool,
}

/// A file or block device.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    size: u64,
    lbs: u32,
    direct: bool,
    block_device: bool,
}

fn open_err(path: &Path, source: std::io::Error) -> IoError {
    IoError::Open {
        path: path.to_path_buf(),
        source,
    }
}

impl FileDevice {
    /// Opens `path` as a block device.
    pub fn open(path: &Path, opts: &FileOptions) -> Result<FileDevice, IoError> {
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        if opts.create_size.is_some() && !opts.read_only {
            oo.create(true);
        }
        let try_direct = opts.direct != DirectMode::Off;
        let (file, direct) = if try_direct {
            let mut d = oo.clone();
            d.custom_flags(libc::O_DIRECT);
            match d.open(path) {
                Ok(f) => (f, true),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if opts.direct == DirectMode::Required {
                        return Err(IoError::DirectIoUnsupported {
                            path: path.to_path_buf(),
                        });
                    }
                    (oo.open(path).map_err(|e| open_err(path, e))?, false)
                }
                Err(e) => return Err(open_err(path, e)),
            }
        } else {
            (oo.open(path).map_err(|e| open_err(path, e))?, false)
        };
        let meta = file.metadata().map_err(|e| open_err(path, e))?;
        let block_device = meta.file_type().is_block_device();
        let (size, lbs) = if block_device {
            let mut size: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
            let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
            if r != 0 {
                return Err(open_err(path, std::io::Error::last_os_error()));
            }
            let mut lbs: libc::c_int = 0;
            // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
            let r =
                unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut lbs as *mut libc::c_int) };
            if r != 0 || lbs <= 0 {
                lbs = 512;
            }
            (size, lbs as u32)
        } else if meta.file_type().is_file() {
            if let Some(n) = opts.create_size {
                if meta.len() != n {
                    file.set_len(n).map_err(|e| open_err(path, e))?;
                }
            }
            (file.metadata().map_err(|e| open_err(path, e))?.len(), 512)
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
        })
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// True if it is a block device.
    pub fn is_block_device(&self) -> bool {
        self.block_device
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

impl BlockDevice for FileDevice {
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

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, self.lbs)?;
        if len == 0 {
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        if self.block_device {
            let range = [offset, len];
            // SAFETY: BLKZEROOUT reads two u64 through the pointer, which is valid.
            let r = unsafe { libc::ioctl(fd, BLKZEROOUT, range.as_ptr()) };
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
        // Not supported here: write zeroes, so the range still reads back as zeroes.
        self.write_zeroes(offset, len)
    }
}
