//! The error type of block devices, with the errno each error maps to at a protocol edge.

use std::fmt;
use std::path::PathBuf;

/// The kind of operation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// A read.
    Read,
    /// A write.
    Write,
    /// A flush.
    Flush,
    /// A discard.
    Discard,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
        })
    }
}

/// Why a block-device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The range goes past the end of the device.
    #[error(
        "{op} of {len} bytes at offset {offset} goes beyond the end of the device ({size} bytes)"
    )]
    OutOfRange {
        /// Operation.
        op: Op,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Device size.
        size: u64,
    },
    /// Offset or length is not a multiple of the logical block size.
    #[error("{op} of {len} bytes at offset {offset} is not aligned to the {align}-byte logical block size")]
    Unaligned {
        /// Operation.
        op: Op,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Required alignment.
        align: u32,
    },
    /// The operating system reported an error.
    #[error("{op} of {len} bytes at offset {offset} failed: {source}")]
    Io {
        /// Operation.
        op: Op,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A device could not be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file or device is locked by another user (another sce serving it, for example).
    #[error("{} is in use{holder}: another process holds it open exclusively", path.display())]
    Busy {
        /// The path.
        path: PathBuf,
        /// " by process PID" where it is known, else empty.
        holder: String,
    },
    /// The filesystem refused O_DIRECT.
    #[error(
        "the filesystem holding {} refused O_DIRECT (tmpfs does, for example); put the file on a \
         filesystem that supports direct I/O, or allow buffered I/O (DirectMode::Preferred, \
         --allow-buffered)",
        path.display()
    )]
    DirectIoUnsupported {
        /// The path.
        path: PathBuf,
    },
    /// A fault injected by a test wrapper.
    #[error("injected fault: {op} of {len} bytes at offset {offset}")]
    Injected {
        /// Operation.
        op: Op,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// The device does not support the operation.
    #[error("{op} is not supported by this device")]
    Unsupported {
        /// Operation.
        op: Op,
    },
    /// An invalid argument or device (wrong size, bad configuration): the request (or the
    /// caller) is at fault.
    #[error("{0}")]
    Invalid(String),
    /// A device below failed in a way that has no OS error of its own (the cache device's
    /// journal or records could not be written, the source would not take dirty data): the
    /// request was valid.
    #[error("{0}")]
    Failed(String),
    /// There is no room for the request's data now (write-back: the cache is full of dirty
    /// data the source is not taking).
    #[error("{0}")]
    NoRoom(String),
    /// The device is shutting down: the request was not run.
    #[error("{0}")]
    ShuttingDown(String),
}

impl IoError {
    /// The errno a protocol edge should report.
    pub fn errno(&self) -> i32 {
        match self {
            IoError::OutOfRange { .. } | IoError::Unaligned { .. } | IoError::Invalid(_) => {
                libc::EINVAL
            }
            IoError::Io { source, .. } | IoError::Open { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            IoError::Injected { .. } | IoError::Failed(_) => libc::EIO,
            IoError::NoRoom(_) => libc::ENOSPC,
            IoError::ShuttingDown(_) => libc::ESHUTDOWN,
            IoError::Busy { .. } => libc::EBUSY,
            IoError::Unsupported { .. } | IoError::DirectIoUnsupported { .. } => libc::EOPNOTSUPP,
        }
    }

    /// True if the device failed, as opposed to the request being bad.
    pub fn is_media_error(&self) -> bool {
        matches!(
            self,
            IoError::Io { .. } | IoError::Injected { .. } | IoError::Failed(_)
        )
    }
}

/// Checks a request against a device's size and logical block size, as the `BlockDevice`
/// contract requires: `OutOfRange` if `offset + len` is past `size` (or overflows), else
/// `Unaligned` if `offset` or `len` is not a multiple of `lbs`.
pub fn check_range(op: Op, offset: u64, len: u64, size: u64, lbs: u32) -> Result<(), IoError> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(IoError::OutOfRange {
            op,
            offset,
            len,
            size,
        });
    }
    let a = lbs as u64;
    if a > 1 && (!offset.is_multiple_of(a) || !len.is_multiple_of(a)) {
        return Err(IoError::Unaligned {
            op,
            offset,
            len,
            align: lbs,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn check_range_order_and_overflow() {
        let c = |o, l| check_range(Op::Read, o, l, 8192, 512);
        assert!(c(0, 8192).is_ok());
        assert!(c(8192, 0).is_ok(), "empty at the end");
        assert!(matches!(c(8192, 512), Err(IoError::OutOfRange { .. })));
        assert!(matches!(
            c(u64::MAX - 10, 512),
            Err(IoError::OutOfRange { .. })
        ));
        assert!(matches!(
            c(u64::MAX - 511, 512),
            Err(IoError::OutOfRange { .. })
        ));
        assert!(matches!(c(1, 512), Err(IoError::Unaligned { .. })));
        assert!(matches!(c(0, 100), Err(IoError::Unaligned { .. })));
        assert!(
            check_range(Op::Read, 3, 5, 8192, 1).is_ok(),
            "lbs 1 never unaligned"
        );
    }

    #[test]
    fn messages_and_errnos() {
        let e = IoError::OutOfRange {
            op: Op::Write,
            offset: 4096,
            len: 512,
            size: 4096,
        };
        assert_eq!(
            e.to_string(),
            "write of 512 bytes at offset 4096 goes beyond the end of the device (4096 bytes)"
        );
        assert_eq!((e.errno(), e.is_media_error()), (libc::EINVAL, false));
        let e = IoError::Unaligned {
            op: Op::Read,
            offset: 1,
            len: 512,
            align: 512,
        };
        assert!(e.to_string().contains("512-byte"), "{e}");
        assert_eq!(e.errno(), libc::EINVAL);
        let e = IoError::Io {
            op: Op::Flush,
            offset: 0,
            len: 0,
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        assert_eq!((e.errno(), e.is_media_error()), (libc::ENOSPC, true));
        let e = IoError::Io {
            op: Op::Read,
            offset: 0,
            len: 512,
            source: std::io::ErrorKind::UnexpectedEof.into(),
        };
        assert_eq!(e.errno(), libc::EIO, "no OS errno falls back to EIO");
        let e = IoError::Open {
            path: "/x/y".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert!(e.to_string().contains("/x/y"));
        assert_eq!((e.errno(), e.is_media_error()), (libc::ENOENT, false));
        let e = IoError::DirectIoUnsupported {
            path: Path::new("/dev/shm/c").into(),
        };
        let m = e.to_string();
        for w in [
            "/dev/shm/c",
            "O_DIRECT",
            "tmpfs",
            "DirectMode::Preferred",
            "--allow-buffered",
        ] {
            assert!(m.contains(w), "{m:?} lacks {w:?}");
        }
        assert_eq!(e.errno(), libc::EOPNOTSUPP);
        let e = IoError::Injected {
            op: Op::Discard,
            offset: 0,
            len: 512,
        };
        assert!(e.to_string().contains("injected"));
        assert_eq!((e.errno(), e.is_media_error()), (libc::EIO, true));
        let e = IoError::Unsupported { op: Op::Discard };
        assert_eq!((e.errno(), e.is_media_error()), (libc::EOPNOTSUPP, false));
        assert_eq!(IoError::Invalid("x".into()).errno(), libc::EINVAL);
        let e = IoError::Failed("the journal could not be written".into());
        assert_eq!((e.errno(), e.is_media_error()), (libc::EIO, true));
        assert_eq!(IoError::NoRoom("full".into()).errno(), libc::ENOSPC);
        assert_eq!(IoError::ShuttingDown("bye".into()).errno(), libc::ESHUTDOWN);
        let ops = [Op::Read, Op::Write, Op::Flush, Op::Discard].map(|o| o.to_string());
        assert_eq!(ops, ["read", "write", "flush", "discard"]);
    }
}
