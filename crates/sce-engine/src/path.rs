//! The write path, chosen once when the volume opens: write-through (with AWT and
//! write-around), write-back in the slots (a device without a write-back log), or
//! write-back through the log (issue 29). Write-back cannot be entered or left at run time,
//! so each request is one `match` here and no path asks what mode it is in.

use crate::back::WriteBack;
use crate::engine::Engine;
use crate::log::LogBack;
use crate::through::{Payload, WriteThrough};
use sce_io::{Extent, IoError, StartedRead};
use std::sync::Arc;

/// A cached volume's write path.
pub(crate) enum WritePath {
    /// The source holds every acknowledged write.
    Through(WriteThrough),
    /// The cache device holds the only copy of dirty data, in the slots (its cleaners share
    /// it).
    Back(Arc<WriteBack>),
    /// The cache device holds the only copy of dirty data, in its write-back log.
    Log(Arc<LogBack>),
}

impl WritePath {
    /// A client's read; true if every byte came from the cache.
    pub(crate) fn read(&self, e: &Engine, offset: u64, buf: &mut [u8]) -> Result<bool, IoError> {
        match self {
            WritePath::Through(_) => e.read(offset, buf),
            WritePath::Back(b) => b.read(e, offset, buf),
            WritePath::Log(l) => l.read(e, offset, buf),
        }
    }

    /// A client's write.
    pub(crate) fn write(&self, e: &Engine, offset: u64, data: Payload) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.write(e, offset, data),
            WritePath::Back(b) => b.write(e, offset, data.bytes()),
            WritePath::Log(l) => l.write(e, offset, data.bytes()),
        }
    }

    /// A client's discard (write-back: zeroes, for its dirty pages must read as zeroes).
    pub(crate) fn discard(&self, e: &Engine, offset: u64, len: u64) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.discard(e, offset, len),
            WritePath::Back(b) => b.zero(e, offset, len),
            WritePath::Log(l) => l.zero(e, offset, len),
        }
    }

    /// A client's flush: every acknowledged write made durable where the path keeps it.
    pub(crate) fn flush(&self, e: &Engine) -> Result<(), IoError> {
        match self {
            WritePath::Through(t) => t.flush(e),
            WritePath::Back(b) => b.flush(e),
            WritePath::Log(l) => l.flush(e),
        }
    }

    /// The allocation of `[offset, offset + len)`: the source's, the system of record
    /// (where a discard punched its hole); in write-back the source is not, and everything
    /// is reported as data.
    pub(crate) fn extents(
        &self,
        e: &Engine,
        offset: u64,
        len: u64,
        max: usize,
    ) -> Result<Vec<Extent>, IoError> {
        match self {
            WritePath::Through(_) => e.dev.source.extents(offset, len, max),
            WritePath::Back(_) | WritePath::Log(_) => Ok(vec![Extent::data(len)]),
        }
    }

    /// Whether `extents` asks nothing remote: the source's answer in write-through, none
    /// in write-back.
    pub(crate) fn extents_are_local(&self, e: &Engine) -> bool {
        match self {
            WritePath::Through(_) => e.dev.source.extents_are_local(),
            WritePath::Back(_) | WritePath::Log(_) => true,
        }
    }

    /// Starts a hit through the I/O queue (write-through only: write-back's reads take the
    /// range lock).
    pub(crate) fn start_read(&self, e: &Arc<Engine>, offset: u64, len: u64) -> Option<StartedRead> {
        match self {
            WritePath::Through(t) => t.start_read(e, offset, len),
            WritePath::Back(_) | WritePath::Log(_) => None,
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
