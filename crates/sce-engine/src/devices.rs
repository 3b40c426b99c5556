//! The devices of a cached volume and the identities of its sources: the source (the
//! volumes laid end to end, `parts.rs`), the cache device's data area, and which sources
//! the cache wrote since their identity was last recorded.

use crate::parts::Placed;
use sce_core::RequestError;
use sce_io::{BlockDevice, IoError, Op};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

/// A volume as the engine keeps it.
pub(crate) struct PartInfo {
    /// Its name in the volume table (or as given, without persistence).
    pub name: String,
    /// Where it is in the cache's address space.
    pub at: Placed,
    /// Its source.
    pub source: Arc<dyn BlockDevice>,
    /// The cache wrote its source since its identity was last recorded.
    pub wrote: AtomicBool,
}

/// The source, the cache device and the volumes.
pub(crate) struct Devices {
    pub(crate) source: Arc<dyn BlockDevice>,
    pub(crate) cache: Arc<dyn BlockDevice>,
    /// The source's size.
    pub(crate) size: u64,
    /// The logical block size requests must be aligned to.
    pub(crate) lbs: u32,
    /// The source's read-ahead, when it is read ahead (`readahead.rs`; the same object as
    /// `source`).
    pub(crate) read_ahead: Option<Arc<crate::readahead::ReadAhead>>,
    /// The volumes served (one unless several share the cache device), in address order.
    volumes: Vec<PartInfo>,
    /// Source writes and discards started, and completed (successfully or not): the flusher
    /// records the source's identity only when the two are equal.
    started: AtomicU64,
    done: AtomicU64,
    /// Source writes and discards that succeeded, and what a source flush covers; one is
    /// owed from the start, for what the source may hold unflushed from before this volume
    /// opened (a previous process's writes, writes made while detached, another host's). A
    /// failed write makes nothing valid: it needs no flush, and a source that fails every
    /// write keeps the rounds going.
    written: FlushMark,
}

/// Writes completed, and how many of them a completed flush covers: a flush counts the
/// writes before it begins, so every one it counts had completed, and is durable once it
/// returns. (A mark one flush cleared before it was done would let a second, finding it
/// clear, return before the first flush made the write durable.)
#[derive(Debug, Default)]
pub(crate) struct FlushMark {
    done: AtomicU64,
    flushed: AtomicU64,
}

impl FlushMark {
    /// A mark that owes a flush from the start.
    pub(crate) fn owing() -> FlushMark {
        FlushMark {
            done: AtomicU64::new(1),
            flushed: AtomicU64::new(0),
        }
    }

    /// A write completed (counted once it has, never before).
    pub(crate) fn completed(&self) {
        self.done.fetch_add(1, SeqCst);
    }

    /// True if a write completed since the last completed flush began.
    pub(crate) fn owed(&self) -> bool {
        self.flushed.load(SeqCst) < self.done.load(SeqCst)
    }

    /// Runs `flush`, noting the writes it covers.
    pub(crate) fn flush(&self, flush: impl FnOnce() -> Result<(), IoError>) -> Result<(), IoError> {
        let done = self.done.load(SeqCst);
        flush()?;
        self.flushed.fetch_max(done, SeqCst);
        Ok(())
    }

    /// Runs `flush` if a write completed since the last completed flush began.
    pub(crate) fn flush_if_owed(
        &self,
        flush: impl FnOnce() -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        if self.owed() {
            self.flush(flush)
        } else {
            Ok(())
        }
    }
}

impl Devices {
    /// The `IoError` for a request at `offset` the core refused.
    pub(crate) fn refused(&self, op: Op, e: RequestError, offset: u64, len: u64) -> IoError {
        match e {
            RequestError::OutOfRange { .. } => IoError::OutOfRange {
                op,
                offset,
                len,
                size: self.size,
            },
            RequestError::Unaligned { .. } => IoError::Unaligned {
                op,
                offset,
                len,
                align: self.lbs,
            },
            RequestError::UnknownId => IoError::Failed("internal: unknown operation id".into()),
        }
    }

    pub(crate) fn new(
        source: Arc<dyn BlockDevice>,
        cache: Arc<dyn BlockDevice>,
        lbs: u32,
        volumes: Vec<PartInfo>,
    ) -> Devices {
        Devices {
            size: source.size(),
            source,
            cache,
            lbs,
            read_ahead: None,
            volumes,
            started: AtomicU64::new(0),
            done: AtomicU64::new(0),
            written: FlushMark::owing(),
        }
    }

    /// The same, with the source's read-ahead.
    pub(crate) fn with_read_ahead(
        mut self,
        ra: Option<Arc<crate::readahead::ReadAhead>>,
    ) -> Devices {
        self.read_ahead = ra;
        self
    }

    /// The source may have changed behind the engine: nothing read ahead is used.
    pub(crate) fn void_read_ahead(&self) {
        if let Some(ra) = &self.read_ahead {
            ra.void_all();
        }
    }

    /// The volumes, in address order.
    pub(crate) fn volumes(&self) -> &[PartInfo] {
        &self.volumes
    }

    /// Runs `f`, a source write or discard at `offset` (of the shared address space),
    /// counted as started and done around it (and as written if it succeeded).
    pub(crate) fn source_write<T>(
        &self,
        offset: u64,
        f: impl FnOnce(&dyn BlockDevice) -> Result<T, IoError>,
    ) -> Result<T, IoError> {
        let k = self
            .volumes
            .partition_point(|p| p.at.base <= offset)
            .saturating_sub(1);
        if let Some(p) = self.volumes.get(k) {
            p.wrote.store(true, SeqCst);
        }
        self.started.fetch_add(1, SeqCst);
        let r = f(&*self.source);
        if r.is_ok() {
            self.written.completed();
        }
        self.done.fetch_add(1, SeqCst);
        r
    }

    /// Flushes the source: every source write completed before the call is durable once
    /// it returns Ok.
    pub(crate) fn flush_source(&self) -> Result<(), IoError> {
        self.written.flush(|| self.source.flush())
    }

    /// True if a source write completed (or the volume opened) since the last completed
    /// source flush began.
    pub(crate) fn owes_source_flush(&self) -> bool {
        self.written.owed()
    }

    /// Makes every source write completed so far durable (and what the source held
    /// unflushed when the volume opened): a flush of the source, unless one that began
    /// after the last of them completed already.
    pub(crate) fn sync_source(&self) -> Result<(), IoError> {
        self.written.flush_if_owed(|| self.source.flush())
    }

    /// Source writes done so far, if none is in flight now.
    pub(crate) fn settled(&self) -> Option<u64> {
        let done = self.done.load(SeqCst);
        (self.started.load(SeqCst) == done).then_some(done)
    }

    /// Source writes done so far.
    pub(crate) fn writes_done(&self) -> u64 {
        self.done.load(SeqCst)
    }

    /// The source identity now of each volume the cache wrote since its identity was last
    /// recorded (None for the others: a change of theirs is someone else's doing, left for
    /// the next start to find), in address order; and which were taken, for `restore`.
    pub(crate) fn identities(&self) -> (Vec<Option<String>>, Vec<bool>) {
        let taken: Vec<bool> = self
            .volumes
            .iter()
            .map(|p| p.wrote.swap(false, SeqCst))
            .collect();
        let ids = self
            .volumes
            .iter()
            .zip(&taken)
            .map(|(p, &w)| if w { p.source.identity() } else { None })
            .collect();
        (ids, taken)
    }

    /// The identities `taken` were not recorded after all.
    pub(crate) fn restore_written(&self, taken: &[bool]) {
        for (p, &w) in self.volumes.iter().zip(taken) {
            if w {
                p.wrote.store(true, SeqCst);
            }
        }
    }
}
