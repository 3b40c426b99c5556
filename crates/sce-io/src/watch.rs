//! `WatchedDevice`: a source's health as its users meet it. Every operation's outcome is
//! recorded: a device error starts an *outage* (the source is down from then, with the
//! error and the time), the next operation that succeeds ends it. The server shows it in
//! status and metrics (`sce_source_up`), counts errors by kind, and logs an outage once
//! when it starts, in a summary at most every [`SUMMARY_EVERY`] while it lasts, and once
//! when it ends, with its count and length.
//!
//! Only the device's own failures count (`IoError::is_media_error`, or no room): a request
//! refused for its range or alignment is the caller's, and a shutdown is not an outage.

use crate::order::{levels, OrderedMutex};
use crate::outage::{OutageLine, OutageLog, SUMMARY_EVERY};
use crate::queue::{IoDone, IoOp, IoQueue, OnDone};
use crate::{BlockDevice, Extent, IoError, Op, SharedBytes};
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Instant, SystemTime};

/// Failed operations, by kind.
#[derive(Debug, Default)]
struct ErrorCounts {
    read: AtomicU64,
    write: AtomicU64,
    flush: AtomicU64,
    discard: AtomicU64,
}

/// A source's health now, for status and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// False during an outage: the last operation failed and none has succeeded since.
    pub up: bool,
    /// When the outage began (None while up).
    pub down_since: Option<SystemTime>,
    /// The outage's failed operations so far (0 while up).
    pub outage_failures: u64,
    /// Failed operations for the device's life, by kind: read, write, flush, discard.
    pub errors: [(&'static str, u64); 4],
    /// The last error and when it came (None if none ever did).
    pub last_error: Option<(SystemTime, String)>,
}

/// A device whose operations' outcomes are recorded (see the module's doc).
pub struct WatchedDevice<D: ?Sized> {
    what: String,
    errors: ErrorCounts,
    /// True during an outage (set and cleared with `outage`'s): a success while up takes
    /// no lock.
    down: AtomicBool,
    outage: OutageLog,
    /// The last error and its time (level `Device`: nothing is taken under it).
    last: Mutex<Option<(SystemTime, String)>>,
    inner: std::sync::Arc<D>,
}

impl<D: BlockDevice + ?Sized> WatchedDevice<D> {
    /// Watches `inner`; `what` names it in the logs ("the source of export lun0").
    pub fn new(inner: std::sync::Arc<D>, what: impl Into<String>) -> Self {
        WatchedDevice {
            what: what.into(),
            errors: ErrorCounts::default(),
            down: AtomicBool::new(false),
            outage: OutageLog::default(),
            last: Mutex::new(None),
            inner,
        }
    }

    /// The health now.
    pub fn health(&self) -> Health {
        let outage = self.outage.current();
        Health {
            up: outage.is_none(),
            down_since: outage.map(|(started, _)| SystemTime::now() - started.elapsed()),
            outage_failures: outage.map_or(0, |(_, n)| n),
            errors: [
                ("read", self.errors.read.load(Relaxed)),
                ("write", self.errors.write.load(Relaxed)),
                ("flush", self.errors.flush.load(Relaxed)),
                ("discard", self.errors.discard.load(Relaxed)),
            ],
            last_error: self.last.lock().clone(),
        }
    }

    /// Records an operation's outcome, and logs what it changed.
    fn note<T>(&self, op: Op, r: Result<T, IoError>) -> Result<T, IoError> {
        self.observe(op, r.as_ref().map(|_| ()));
        r
    }

    /// Records the outcome of an operation done elsewhere (through the device's I/O queue,
    /// [`WatchedQueue`]), and logs what it changed.
    pub fn observe(&self, op: Op, r: Result<(), &IoError>) {
        let line = match r {
            Ok(_) if !self.down.load(Relaxed) => None,
            Ok(_) => {
                self.down.store(false, Relaxed);
                self.outage.succeeded(Instant::now())
            }
            Err(e) if e.is_media_error() || matches!(e, IoError::NoRoom(_)) => self.failed(op, e),
            Err(_) => None,
        };
        match line {
            None => {}
            Some(OutageLine::Started(e)) => tracing::warn!(
                "{} is failing: {e} (further failures are summarized every {} s)",
                self.what,
                SUMMARY_EVERY.as_secs()
            ),
            Some(OutageLine::Summary {
                failed,
                over,
                error,
            }) => tracing::warn!(
                "{}: {failed} more requests failed in the last {} s: {error}",
                self.what,
                over.as_secs()
            ),
            Some(OutageLine::Ended { failed, over }) => tracing::info!(
                "{} works again, after {failed} failed requests over {:.1} s",
                self.what,
                over.as_secs_f64()
            ),
        }
    }

    fn failed(&self, op: Op, e: &IoError) -> Option<OutageLine> {
        let kind = match op {
            Op::Read => &self.errors.read,
            Op::Write => &self.errors.write,
            Op::Flush => &self.errors.flush,
            Op::Discard => &self.errors.discard,
        };
        kind.fetch_add(1, Relaxed);
        let error = e.to_string();
        *self.last.lock() = Some((SystemTime::now(), error.clone()));
        let line = self.outage.failed(Instant::now(), &error);
        self.down.store(true, Relaxed);
        line
    }
}

impl<D: BlockDevice + ?Sized> BlockDevice for WatchedDevice<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.note(Op::Read, self.inner.read_at(offset, buf))
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.note(Op::Write, self.inner.write_at(offset, buf))
    }
    fn flush(&self) -> Result<(), IoError> {
        self.note(Op::Flush, self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.note(Op::Discard, self.inner.discard(offset, len))
    }
    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        self.note(Op::Write, self.inner.write_shared(offset, data))
    }
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, IoError> {
        self.inner.extents(offset, len, max)
    }
    fn extents_are_local(&self) -> bool {
        self.inner.extents_are_local()
    }
}

/// An I/O queue on a watched device (a local source served without a cache goes through
/// its queue, not through the device's calls): every completion's outcome is recorded in
/// the watch as the device's own calls' are.
pub struct WatchedQueue {
    inner: std::sync::Arc<dyn IoQueue>,
    watch: std::sync::Arc<WatchedDevice<dyn BlockDevice>>,
}

impl WatchedQueue {
    /// `inner`'s operations, recorded in `watch`.
    pub fn new(
        inner: std::sync::Arc<dyn IoQueue>,
        watch: std::sync::Arc<WatchedDevice<dyn BlockDevice>>,
    ) -> WatchedQueue {
        WatchedQueue { inner, watch }
    }

    fn watched(&self, op: &IoOp, done: OnDone) -> OnDone {
        let (kind, watch) = (op.op(), self.watch.clone());
        Box::new(move |d: IoDone| {
            watch.observe(kind, d.result.as_ref().map(|_| ()));
            done(d)
        })
    }
}

impl IoQueue for WatchedQueue {
    fn submit(&self, op: IoOp, done: OnDone) {
        let done = self.watched(&op, done);
        self.inner.submit(op, done)
    }
    fn submit_batch(&self, ops: Vec<(IoOp, OnDone)>) {
        let ops = ops
            .into_iter()
            .map(|(op, done)| {
                let done = self.watched(&op, done);
                (op, done)
            })
            .collect();
        self.inner.submit_batch(ops)
    }
    fn run_here(&self, op: IoOp, done: OnDone) {
        let done = self.watched(&op, done);
        self.inner.run_here(op, done)
    }
    fn backend(&self) -> crate::Backend {
        self.inner.backend()
    }
    fn device(&self) -> &dyn BlockDevice {
        self.inner.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultDevice, MemDevice};
    use std::sync::Arc;

    #[test]
    fn an_outage_starts_at_a_device_error_and_ends_at_the_next_success() {
        let faulty = FaultDevice::new(MemDevice::new(1 << 20));
        let faults = faulty.control();
        let dev = WatchedDevice::new(Arc::new(faulty), "src");
        let mut buf = vec![0u8; 4096];
        dev.read_at(0, &mut buf).unwrap();
        let h = dev.health();
        assert!(
            h.up && h.down_since.is_none() && h.last_error.is_none(),
            "{h:?}"
        );
        faults.fail_from(&[Op::Read, Op::Write, Op::Flush], 0);
        assert!(dev.read_at(0, &mut buf).is_err());
        assert!(dev.write_at(0, &buf).is_err());
        assert!(dev.flush().is_err());
        let h = dev.health();
        assert!(!h.up && h.down_since.is_some(), "{h:?}");
        assert_eq!(h.outage_failures, 3);
        assert_eq!(
            h.errors,
            [("read", 1), ("write", 1), ("flush", 1), ("discard", 0)]
        );
        assert!(h.last_error.is_some());
        // A request the device refuses for its range is the caller's: no change.
        faults.clear();
        assert!(dev.read_at(1 << 20, &mut buf).is_err());
        assert!(!dev.health().up);
        dev.read_at(0, &mut buf).unwrap();
        let h = dev.health();
        assert!(
            h.up && h.down_since.is_none() && h.outage_failures == 0,
            "{h:?}"
        );
        assert_eq!(h.errors[0], ("read", 1), "the counts stay: {h:?}");
        assert!(h.last_error.is_some(), "the last error is kept: {h:?}");
    }
}
