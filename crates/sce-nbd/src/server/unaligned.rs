//! Byte-granular requests on a device whose offsets and lengths must be multiples of its
//! logical block size (issue 27, item 10).
//!
//! NBD's default minimum block size is 1 byte: a client that did not ask for block sizes
//! (NBD_INFO_BLOCK_SIZE in its NBD_OPT_GO, or one that used NBD_OPT_EXPORT_NAME) may send
//! any offset and length, and the server does not send it a larger minimum. Such requests
//! that are not aligned are served here: a read reads the blocks that cover it and returns
//! its bytes; a write (or write-zeroes) reads the first and last covering blocks, puts its
//! bytes in, and writes the blocks back; a trim discards the whole blocks inside it (a
//! trim is advisory). Aligned requests never come here.
//!
//! The read-modify-writes of all exports run one at a time under [`RMW`], so two unaligned
//! writes into one block (two single bytes side by side, say) never undo each other. The
//! lock is taken by no thread that holds another lock, and is held across device calls.
//! As on any block device, requests in flight together that overlap have no defined
//! outcome.

use super::errors::errno_of;
use super::transmission::Session;
use super::*;

/// Serializes the read-modify-writes of unaligned writes.
static RMW: sce_io::order::OrderedMutex<sce_io::order::levels::NbdRmw, ()> =
    sce_io::order::OrderedMutex::new(());

/// Zeroes written per device call by an unaligned write-zeroes.
const ZERO_CHUNK: u64 = 1 << 20;

/// Whether `[off, off + len)` is not aligned to `dev`'s block size.
pub(super) fn is_unaligned(dev: &dyn BlockDevice, off: u64, len: u64) -> bool {
    let b = dev.logical_block_size().max(1) as u64;
    !off.is_multiple_of(b) || !len.is_multiple_of(b)
}

/// The aligned range covering `[off, off + len)`: (start, end).
fn cover(dev: &dyn BlockDevice, off: u64, len: u64) -> (u64, u64) {
    let b = dev.logical_block_size().max(1) as u64;
    (off / b * b, (off + len).div_ceil(b) * b)
}

/// Reads `out.len()` bytes at `off`, through the blocks that cover them.
pub(super) fn read(dev: &dyn BlockDevice, off: u64, out: &mut [u8]) -> Result<(), IoError> {
    let (lo, hi) = cover(dev, off, out.len() as u64);
    let mut b = AlignedBuf::new((hi - lo) as usize);
    dev.read_at(lo, &mut b)?;
    let at = (off - lo) as usize;
    out.copy_from_slice(&b[at..at + out.len()]);
    Ok(())
}

/// Writes `data` at `off` by read-modify-write of its first and last covering blocks.
pub(super) fn write(dev: &dyn BlockDevice, off: u64, data: &[u8]) -> Result<(), IoError> {
    let bs = dev.logical_block_size().max(1) as usize;
    let (lo, hi) = cover(dev, off, data.len() as u64);
    let mut b = AlignedBuf::new((hi - lo) as usize);
    let _serial = RMW.lock();
    let (head, end) = ((off - lo) as usize, (off - lo) as usize + data.len());
    if head != 0 {
        dev.read_at(lo, &mut b[..bs])?;
    }
    let n = b.len();
    // The last block, unless the first read already holds it.
    if end != n && (head == 0 || n > bs) {
        dev.read_at(hi - bs as u64, &mut b[n - bs..])?;
    }
    b[head..end].copy_from_slice(data);
    dev.write_at(lo, &b)
}

/// Writes zeroes over `[off, off + len)`, in chunks.
fn zero(dev: &dyn BlockDevice, off: u64, len: u64) -> Result<(), IoError> {
    let zeroes = vec![0u8; ZERO_CHUNK.min(len) as usize];
    let mut at = off;
    while at < off + len {
        let n = ZERO_CHUNK.min(off + len - at);
        write(dev, at, &zeroes[..n as usize])?;
        at += n;
    }
    Ok(())
}

/// Discards the whole blocks inside `[off, off + len)`, if any.
fn trim(dev: &dyn BlockDevice, off: u64, len: u64) -> Result<(), IoError> {
    let b = dev.logical_block_size().max(1) as u64;
    let (lo, hi) = (off.div_ceil(b) * b, (off + len) / b * b);
    if hi > lo {
        dev.discard(lo, hi - lo)?;
    }
    Ok(())
}

/// Runs an unaligned request of a byte-granular session: Some(result) for a read, write,
/// trim or write-zeroes; None for the others (they run as usual).
pub(super) fn execute(
    conn: &Session,
    req: &Request,
    payload: Option<&PooledBuf>,
    pool: &Arc<BufPool>,
) -> Option<Result<Option<PooledBuf>, u32>> {
    let dev = &*conn.export.device;
    let (off, len) = (req.offset, req.len as u64);
    let done = match req.command {
        proto::CMD_READ => {
            let mut b = pool.take(req.len as usize);
            return Some(
                read(dev, off, &mut b)
                    .map(|()| Some(b))
                    .map_err(|x| errno_of(&x, false)),
            );
        }
        proto::CMD_WRITE => match payload {
            Some(b) => write(dev, off, b),
            None => return Some(Err(errno::EINVAL)),
        },
        proto::CMD_TRIM => trim(dev, off, len),
        proto::CMD_WRITE_ZEROES => zero(dev, off, len),
        _ => return None,
    };
    let fua = req.flags & proto::CMD_FLAG_FUA != 0;
    Some(
        done.and_then(|()| if fua { dev.flush() } else { Ok(()) })
            .map(|()| None)
            .map_err(|x| errno_of(&x, true)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sce_io::MemDevice;

    #[test]
    fn single_bytes_read_and_write_through_their_blocks() {
        let dev = MemDevice::new(8192);
        let mut all = AlignedBuf::new(8192);
        for (i, x) in all.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        dev.write_at(0, &all).unwrap();
        assert!(is_unaligned(&dev, 1, 1) && !is_unaligned(&dev, 512, 512));
        write(&dev, 513, &[0xaa]).unwrap();
        write(&dev, 510, &[1, 2, 3, 4]).unwrap();
        write(&dev, 1000, &[7u8; 3000]).unwrap();
        all[513] = 0xaa;
        all[510..514].copy_from_slice(&[1, 2, 3, 4]);
        all[1000..4000].fill(7);
        let mut one = [0u8; 1];
        for at in [0u64, 509, 510, 513, 514, 999, 1000, 3999, 4000, 8191] {
            read(&dev, at, &mut one).unwrap();
            assert_eq!(one[0], all[at as usize], "byte {at}");
        }
        let mut back = AlignedBuf::new(8192);
        dev.read_at(0, &mut back).unwrap();
        assert!(back[..] == all[..], "bytes around the writes changed");
    }
}
