//! The errno a request is answered with when its device fails: one mapping for every path
//! that runs requests (the workers' `exec.rs`, byte-granular `unaligned.rs`, the I/O queue's
//! `queued.rs`).

use super::*;

/// The NBD errno of `e` (a request that wrote if `write`): two rules of the protocol first;
/// then the error's own errno (`IoError::errno`, where each kind's is chosen once), put in
/// the protocol's words.
pub(super) fn errno_of(e: &IoError, write: bool) -> u32 {
    match e {
        IoError::OutOfRange { .. } if write => return errno::ENOSPC,
        IoError::Unsupported { .. } | IoError::DirectIoUnsupported { .. } => return errno::EINVAL,
        _ => {}
    }
    match e.errno() {
        libc::EINVAL => errno::EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => errno::ENOSPC,
        libc::ENOMEM => errno::ENOMEM,
        libc::ESHUTDOWN => errno::ESHUTDOWN,
        _ => errno::EIO,
    }
}
