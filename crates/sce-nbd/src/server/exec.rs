//! One request against its export's device.

use super::errors::errno_of;
use super::transmission::Session;
use super::unaligned;
use super::*;

/// Checks a request against its connection's export before it runs: flags, writes to a
/// read-only export, block status without `base:allocation`, range and size. The errno to
/// reply with, if it may not run.
pub(super) fn check(conn: &Session, req: &Request) -> Result<(), u32> {
    let e = &conn.export;
    let size = e.device.size();
    let (off, len) = (req.offset, req.len as u64);
    let in_range = off.checked_add(len).is_some_and(|end| end <= size);
    let allowed_flags = match req.command {
        proto::CMD_WRITE => proto::CMD_FLAG_FUA,
        proto::CMD_WRITE_ZEROES => proto::CMD_FLAG_FUA | proto::CMD_FLAG_NO_HOLE,
        proto::CMD_TRIM => proto::CMD_FLAG_FUA,
        proto::CMD_READ | proto::CMD_FLUSH | proto::CMD_CACHE => 0,
        proto::CMD_BLOCK_STATUS if conn.block_status && req.len > 0 => proto::CMD_FLAG_REQ_ONE,
        _ => return Err(errno::EINVAL),
    };
    if req.flags & !allowed_flags != 0 {
        return Err(errno::EINVAL);
    }
    let writes = matches!(
        req.command,
        proto::CMD_WRITE | proto::CMD_WRITE_ZEROES | proto::CMD_TRIM
    );
    if writes && e.read_only {
        return Err(errno::EPERM);
    }
    if req.command != proto::CMD_FLUSH && !in_range {
        return Err(if writes { errno::ENOSPC } else { errno::EINVAL });
    }
    if req.command == proto::CMD_READ && req.len > proto::MAX_PAYLOAD {
        return Err(errno::EINVAL);
    }
    Ok(())
}

/// Runs one request: Ok(data for reads), or the errno to reply with.
pub(super) fn execute(
    conn: &Session,
    req: &Request,
    payload: Option<PooledBuf>,
    pool: &Arc<BufPool>,
) -> Result<Option<PooledBuf>, u32> {
    check(conn, req)?;
    let e = &conn.export;
    let dev = &e.device;
    if conn.byte_granular && unaligned::is_unaligned(&**dev, req.offset, req.len as u64) {
        if let Some(r) = unaligned::execute(conn, req, payload.as_ref(), pool) {
            return r;
        }
    }
    let (off, len) = (req.offset, req.len as u64);
    let fua = |r: Result<(), IoError>| -> Result<Option<PooledBuf>, u32> {
        r.map_err(|x| errno_of(&x, true))?;
        if req.flags & proto::CMD_FLAG_FUA != 0 {
            dev.flush().map_err(|x| errno_of(&x, true))?;
        }
        Ok(None)
    };
    match req.command {
        proto::CMD_READ => {
            // Filled whole by the read, or not sent (an error reply has no data).
            let mut b = pool.take(req.len as usize);
            dev.read_at(off, &mut b).map_err(|x| errno_of(&x, false))?;
            Ok(Some(b))
        }
        proto::CMD_WRITE => {
            // The payload is given away: a cache's asynchronous copy keeps it (no second
            // copy), and it goes back to the pool when the last holder drops it.
            let b = payload.ok_or(errno::EINVAL)?;
            fua(dev.write_shared(off, Arc::new(b)))
        }
        proto::CMD_FLUSH => dev.flush().map(|()| None).map_err(|x| errno_of(&x, true)),
        proto::CMD_TRIM => fua(dev.discard(off, len)),
        proto::CMD_WRITE_ZEROES => {
            if req.flags & proto::CMD_FLAG_NO_HOLE == 0 {
                // Discard reads back as zeroes by the BlockDevice contract.
                return fua(dev.discard(off, len));
            }
            let chunk = AlignedBuf::new((1usize << 20).min(len as usize));
            let mut at = off;
            while at < off + len {
                let n = (chunk.len() as u64).min(off + len - at) as usize;
                dev.write_at(at, &chunk[..n])
                    .map_err(|x| errno_of(&x, true))?;
                at += n as u64;
            }
            fua(Ok(()))
        }
        proto::CMD_BLOCK_STATUS => {
            let one = req.flags & proto::CMD_FLAG_REQ_ONE != 0;
            let max = if one { 1 } else { sce_io::extent::MAX_EXTENTS };
            let ext = dev
                .extents(off, len, max)
                .map_err(|x| errno_of(&x, false))?;
            Ok(Some(block_status(&ext, len, one, pool)))
        }
        proto::CMD_CACHE => match &e.prefetch {
            Some(p) => p(off, len).map(|()| None).map_err(|x| errno_of(&x, false)),
            None => Ok(None),
        },
        _ => Err(errno::EINVAL),
    }
}

/// The payload of a `base:allocation` block status chunk: the context id, then (length,
/// flags) per extent, cut at the request's end (`len`); one extent with REQ_ONE. A device
/// that answered with nothing is reported as data, which is always true.
fn block_status(ext: &[sce_io::Extent], len: u64, one: bool, pool: &Arc<BufPool>) -> PooledBuf {
    let fallback = [sce_io::Extent::data(len)];
    let ext = if ext.is_empty() { &fallback[..] } else { ext };
    let n = if one { 1 } else { ext.len() };
    let mut out = Vec::with_capacity(4 + 8 * n);
    out.extend_from_slice(&proto::BASE_ALLOCATION_ID.to_be_bytes());
    let mut at = 0u64;
    for e in ext.iter().take(n) {
        let l = e.len.min(len - at);
        if l == 0 {
            break;
        }
        let flags = if e.hole {
            proto::STATE_HOLE | proto::STATE_ZERO
        } else {
            0
        };
        out.extend_from_slice(&(l as u32).to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        at += l;
    }
    let mut b = pool.take(out.len());
    b.copy_from_slice(&out);
    b
}
