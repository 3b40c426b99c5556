//! The write path, chosen once when the volume opens: write-through (with AWT and
//! write-around), or write-back through the log (issue 29; since issue 45 the only
//! write-back: a device whose slots held dirty data is drained at start, `slots.rs`). Write-back cannot be entered or left at run time,
//! so each request is one `match` here and no path asks what mode it is in.

use crate::devices::Devices;
use crate::engine::Engine;
use crate::log::LogBack;
use crate::through::{Payload, WriteThrough};
use sce_io::{Extent, IoError, StartedRead};
use std::sync::Arc;

/// A cached volume's write path.
pub(crate) enum WritePath {
    /// The source holds every acknowledged write.
    Through(WriteThrough),
    /// The cache device holds the only copy of dirty data, in its write-back log.
    Log(Arc<LogBack>),
}

/// The source's map of `[offset, offset + len)`, which need not be aligned to the source's
/// blocks (NBD lets a client that did not ask for block sizes ask any range): the source is
/// asked for the blocks that cover it, and the answer cut back to the range. A hole cut so
/// still reads as zeroes.
fn source_extents(
    dev: &Devices,
    offset: u64,
    len: u64,
    max: usize,
) -> Result<Vec<Extent>, IoError> {
    let src = &dev.source;
    let lbs = u64::from(src.logical_block_size().max(1));
    let end = offset + len;
    let (a, b) = (
        offset / lbs * lbs,
        end.div_ceil(lbs).saturating_mul(lbs).min(src.size()),
    );
    // Empty, aligned, or out of range (the source refuses it, and says why).
    if len == 0 || end > src.size() || (a == offset && b == end) {
        return src.extents(offset, len, max);
    }
    let mut out = Vec::new();
    let mut at = a;
    for x in src.extents(a, b - a, max)? {
        let (lo, hi) = (at.max(offset), (at + x.len).min(end));
        if lo < hi {
            out.push(Extent {
                len: hi - lo,
                hole: x.hole,
            });
        }
        at += x.len;
        if at >= end {
            break;
        }
    }
    Ok(out)
}

/// The source's `extents` from `offset`, with the dirty range `dirty` (if any) reported as
/// data: the answer stops after the extent it falls in (what lies beyond was not looked
/// up), at most `max` extents.
fn dirty_as_data(
    source: Vec<Extent>,
    offset: u64,
    dirty: Option<(u64, u64)>,
    max: usize,
) -> Vec<Extent> {
    let Some((d0, d1)) = dirty else {
        return source;
    };
    let mut out: Vec<Extent> = Vec::new();
    let mut push = |x: Extent| match out.last_mut() {
        Some(last) if last.hole == x.hole => last.len += x.len,
        _ => out.push(x),
    };
    let mut at = offset;
    for x in source {
        let end = at + x.len;
        if end <= d0 {
            push(x);
            at = end;
            continue;
        }
        // The dirty range starts in this extent (every one before ended at or before it).
        if !x.hole {
            push(x);
        } else {
            if d0 > at {
                push(Extent::hole(d0 - at));
            }
            push(Extent::data(d1.min(end) - d0));
        }
        break;
    }
    out.truncate(max.max(1));
    out
}

impl WritePath {
    /// A client's read; true if every byte came from the cache.
    #[inline]
    pub(crate) fn read(&self, e: &Engine, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        match self {
            WritePath::Through(_) => e.reader().read(offset, buf),
            WritePath::Log(l) => l.read(&e.log_io(), offset, buf),
        }
    }

    /// A client's write.
    pub(crate) fn write(&self, e: &Engine, offset: u64, data: Payload) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.write(&e.writer(), offset, data),
            WritePath::Log(l) => l.write(&e.log_io(), offset, data.bytes()),
        }
    }

    /// A client's discard. Through the log, whole pages reach the source as a discard and
    /// the log's versions of them are superseded (`log/drain.rs`).
    pub(crate) fn discard(&self, e: &Engine, offset: u64, len: u64) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.discard(&e.writer(), offset, len),
            WritePath::Log(l) => l.discard(&e.log_io(), offset, len),
        }
    }

    /// A client's flush: every acknowledged write made durable where the path keeps it.
    pub(crate) fn flush(&self, e: &Engine) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.flush(&e.writer()),
            WritePath::Log(l) => l.flush(&e.log_io()),
        }
    }

    /// The allocation of `[offset, offset + len)`: the source's, the system of record
    /// (where a discard punched its hole). In write-back the source lacks the dirty data:
    /// its map, less the holes where the cache holds dirty or lost pages (by 1 MiB or
    /// fragment), which are data.
    ///
    /// Never a hole that holds an acknowledged write: where the cache holds dirty data is
    /// looked up first, the source's map after. A write acknowledged before the request is
    /// dirty at that look (reported as data), or was cleaned before it, and so is on the
    /// source when its map is read (the cleaner writes the source before it marks a page
    /// clean). Only the first dirty place is looked up, so the answer may stop there (a
    /// prefix, which a block status may be).
    pub(crate) fn extents(
        &self,
        dev: &Devices,
        offset: u64,
        len: u64,
        max: usize,
    ) -> Result<Vec<Extent>, IoError> {
        let Some(end) = offset.checked_add(len).filter(|&x| x <= dev.size) else {
            return Err(IoError::OutOfRange {
                op: sce_io::Op::Read,
                offset,
                len,
                size: dev.size,
            });
        };
        let dirty = match self {
            WritePath::Through(_) => return source_extents(dev, offset, len, max),
            WritePath::Log(l) => {
                let ps = sce_core::PAGE_SIZE;
                (l.dirty_group_from(offset / ps, end.div_ceil(ps)))
                    .map(|(a, b)| ((a * ps).max(offset), (b * ps).min(end)))
            }
        };
        let source = source_extents(dev, offset, len, max)?;
        Ok(dirty_as_data(source, offset, dirty, max))
    }

    /// Whether `extents` asks nothing remote: the source's map is, in every mode.
    pub(crate) fn extents_are_local(&self, dev: &Devices) -> bool {
        dev.source.extents_are_local()
    }

    /// Starts a hit through the I/O queue (write-through only: write-back's reads take the
    /// range lock).
    pub(crate) fn start_read(&self, e: &Arc<Engine>, offset: u64, len: u64) -> Option<StartedRead> {
        match self {
            WritePath::Through(t) => t.start_read(e, offset, len),
            WritePath::Log(l) => l.start_read(e, offset, len),
        }
    }

    /// The write-back path through the log, if this is it.
    pub(crate) fn log(&self) -> Option<&Arc<LogBack>> {
        match self {
            WritePath::Log(l) => Some(l),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    #[test]
    fn dirty_data_in_a_hole_of_the_source_is_data() {
        let src = vec![Extent::data(M), Extent::hole(8 * M), Extent::data(M)];
        // None dirty: the source's map.
        assert_eq!(dirty_as_data(src.clone(), 0, None, 64), src);
        // Dirty 3-4 MiB in the hole: the hole is cut there, and the answer stops after it.
        assert_eq!(
            dirty_as_data(src.clone(), 0, Some((3 * M, 4 * M)), 64),
            [Extent::data(M), Extent::hole(2 * M), Extent::data(M)]
        );
        // Dirty at the hole's start: the data before and the dirty part merge.
        assert_eq!(
            dirty_as_data(src.clone(), 0, Some((M, 2 * M)), 64),
            [Extent::data(2 * M)]
        );
        // Dirty inside a data extent: that extent, and nothing after it.
        assert_eq!(
            dirty_as_data(src.clone(), 0, Some((M / 2, M)), 64),
            [Extent::data(M)]
        );
        // One extent asked (REQ_ONE): the first, cut at the dirty range.
        let from_hole = vec![Extent::hole(8 * M), Extent::data(M)];
        assert_eq!(
            dirty_as_data(from_hole, M, Some((5 * M, 6 * M)), 1),
            [Extent::hole(4 * M)]
        );
    }
}
