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
    /// An invalid argument or device (wrong size, bad configuration).
    #[error("{0}")]
    Invalid(String),
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
            IoError::Injected { .. } => libc::EIO,
            IoError::Unsupported { .. } | IoError::DirectIoUnsupported { .. } => libc::EOPNOTSUPP,
        }
    }

    /// True if the device failed, as opposed to the request being bad.
    pub fn is_media_error(&self) -> bool {
        matches!(self, IoError::Io { .. } | IoError::Injected { .. })
    }
}

/// Checks a request against a device's size and logical block size.
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
