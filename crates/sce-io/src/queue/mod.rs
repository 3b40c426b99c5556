//! The owned-buffer I/O boundary: an operation is *submitted* with the buffer it works on,
//! and *completes* later, on another thread, handing the buffer back with the result.
//!
//! [`BlockDevice`] borrows the caller's slice for the length of a blocking call, so a
//! request occupies a thread for the whole device time. An [`IoQueue`] takes the buffer
//! instead ([`PooledBuf`], aligned for O_DIRECT), so a single thread can keep many
//! operations in flight on the device: what io_uring needs, since the kernel writes into
//! the buffer after the submitting call returned.
//!
//! Implementations:
//! - [`UringQueue`]: io_uring on a [`FileDevice`] (a file or a block device). Submitters
//!   push entries under a mutex; one completion thread per queue reaps them and runs the
//!   callbacks.
//! - [`ThreadQueue`]: a pool of threads running the blocking [`BlockDevice`] calls, for any
//!   device, and where io_uring is unavailable (an old kernel, a seccomp profile that
//!   forbids it).
//!
//! [`open_queue`] picks one ([`Backend::Auto`]: io_uring if a probe read through it works).
//!
//! # Contract (checked for both by `tests/queue.rs`)
//! - Every submitted operation completes exactly once: its callback runs with the result
//!   and, for reads and writes, the buffer. Errors (out of range, unaligned, a device error)
//!   come through the callback too, never as a panic. Range and alignment are checked as
//!   [`BlockDevice`] checks them, before anything reaches the device.
//! - A read's buffer holds the bytes read when its callback runs with `Ok`.
//! - Operations in flight at once are unordered, as on any device queue: a caller that
//!   needs a write before a read, or writes before a flush, waits for the completion first.
//!   `Flush` makes durable every write that completed before it was submitted.
//! - Callbacks run on the queue's completion thread(s), or on the submitting thread when the
//!   queue is full or shut: they must not block for long, and must not wait for another
//!   operation of the same queue to complete.
//! - Dropping the last handle of a queue does not wait: operations in flight still
//!   complete and run their callbacks, and the threads end after the last one. A buffer the
//!   kernel may still write into is never freed before its completion.

mod threads;
mod uring;

pub use threads::ThreadQueue;
pub use uring::UringQueue;

use crate::{check_range, BlockDevice, FileDevice, IoError, Op, PooledBuf};
use std::sync::Arc;

/// One operation, with the buffer it owns.
#[derive(Debug)]
pub enum IoOp {
    /// Read `buf.len()` bytes at `offset` into `buf`.
    Read {
        /// Byte offset on the device.
        offset: u64,
        /// Filled by the read.
        buf: PooledBuf,
    },
    /// Write `buf` at `offset`.
    Write {
        /// Byte offset on the device.
        offset: u64,
        /// The bytes to write.
        buf: PooledBuf,
    },
    /// Make the writes completed so far durable.
    Flush,
}

impl IoOp {
    /// The operation's kind, for errors.
    pub fn op(&self) -> Op {
        match self {
            IoOp::Read { .. } => Op::Read,
            IoOp::Write { .. } => Op::Write,
            IoOp::Flush => Op::Flush,
        }
    }

    /// Offset and length (0, 0 for a flush).
    pub fn range(&self) -> (u64, u64) {
        match self {
            IoOp::Read { offset, buf } | IoOp::Write { offset, buf } => (*offset, buf.len() as u64),
            IoOp::Flush => (0, 0),
        }
    }

    /// The buffer the operation carries (none for a flush).
    pub fn into_buf(self) -> Option<PooledBuf> {
        match self {
            IoOp::Read { buf, .. } | IoOp::Write { buf, .. } => Some(buf),
            IoOp::Flush => None,
        }
    }
}

/// A completed operation: its result and its buffer (none for a flush).
#[derive(Debug)]
pub struct IoDone {
    /// What the device said.
    pub result: Result<(), IoError>,
    /// The buffer the operation was submitted with.
    pub buf: Option<PooledBuf>,
}

/// What runs when an operation completes.
pub type OnDone = Box<dyn FnOnce(IoDone) + Send>;

/// A queue of operations on one device, with owned buffers. See the module documentation
/// for the contract.
pub trait IoQueue: Send + Sync {
    /// Submits `op`; `done` runs once it completed (possibly before `submit` returns).
    fn submit(&self, op: IoOp, done: OnDone);
    /// Submits several operations at once (on io_uring: one system call, and one
    /// notification of the device for the lot). The default submits them one by one.
    fn submit_batch(&self, ops: Vec<(IoOp, OnDone)>) {
        for (op, done) in ops {
            self.submit(op, done);
        }
    }
    /// Runs `op` with a blocking call on this thread and then `done`: for a caller that has
    /// nothing else to do meanwhile (a client at queue depth 1), which saves the wake-up
    /// of the completion thread.
    fn run_here(&self, op: IoOp, done: OnDone) {
        done(run_blocking(self.device(), op));
    }
    /// Which implementation this is.
    fn backend(&self) -> Backend;
    /// The device the queue works on.
    fn device(&self) -> &dyn BlockDevice;
}

/// A read started by [`QueuedReads::start_read`]: given the buffer to fill and what to run
/// when it completes, it returns the operation and completion to submit to the device's
/// queue ([`QueuedReads::queue`]), so that the caller can submit several together.
pub type StartedRead = Box<dyn FnOnce(PooledBuf, OnDone) -> (IoOp, OnDone) + Send>;

/// A write started by [`QueuedReads::start_write`]: given the buffer of exactly the length
/// it was started for, and what to run when it completes, it returns the operation and
/// completion to submit to the queue `start_write` named with it. Dropped unsubmitted, it
/// gives back what it held and writes nothing.
pub type StartedWrite = StartedRead;

/// A device that can serve some reads without blocking the caller: a cached volume, whose
/// hits are reads of its cache device through an [`IoQueue`], while its misses wait for a
/// remote source and stay blocking calls.
pub trait QueuedReads: Send + Sync {
    /// Starts a read of `len` bytes at `offset` if it can complete without blocking the
    /// caller (for a cache: every page a hit), or `None` for the caller to use the blocking
    /// `read_at`. A started read must be given its buffer and its operation submitted: it
    /// may hold resources (a cache's pins) until it completes.
    fn start_read(&self, offset: u64, len: u64) -> Option<StartedRead>;
    /// The queue started reads are submitted to (none until the device has one).
    fn queue(&self) -> Option<Arc<dyn IoQueue>>;
    /// Whether a write of `len` bytes at `offset` (`op` [`Op::Write`]), or a flush
    /// ([`Op::Flush`]), is served by the local device alone, in about the time of the
    /// device's own write or flush (a write-back cache's log append, or its commit): a
    /// server may then run one alone in flight on the thread that received it, as it does
    /// a local file's, instead of waking another thread for it. Default: no.
    fn runs_locally(&self, op: Op, offset: u64, len: u64) -> bool {
        let _ = (op, offset, len);
        false
    }
    /// Starts a write of `len` bytes at `offset` if it can complete without blocking the
    /// caller (a write-back cache's log append that needs no waiting), with the queue to
    /// submit it to; or `None` for the caller to use the blocking `write_at`. It never
    /// blocks (a started write may hold what others wait for until it completes, so the
    /// caller must submit what it started before it blocks). Acknowledge it only from its
    /// completion: it is written, and visible to reads, then. Default: never.
    fn start_write(&self, offset: u64, len: u64) -> Option<(StartedWrite, Arc<dyn IoQueue>)> {
        let _ = (offset, len);
        None
    }
}

/// An implementation of [`IoQueue`], or the choice of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// io_uring if it works here, else threads.
    #[default]
    Auto,
    /// io_uring ([`UringQueue`]).
    IoUring,
    /// A pool of threads doing blocking I/O ([`ThreadQueue`]).
    Threads,
}

impl Backend {
    /// The name used on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::IoUring => "io_uring",
            Backend::Threads => "threads",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Backend::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(Backend::IoUring),
            "threads" => Ok(Backend::Threads),
            _ => Err(format!(
                "unknown I/O backend {s:?}: expected auto, io_uring or threads"
            )),
        }
    }
}

/// Operations in flight at once on an io_uring queue, and threads of a thread queue, by
/// default.
pub const DEFAULT_DEPTH: u32 = 256;
/// Threads of a [`ThreadQueue`] made by [`open_queue`].
pub const DEFAULT_THREADS: usize = 32;

/// A queue on `dev`: io_uring, threads, or (with `Auto`) io_uring when a probe read through
/// it works and threads otherwise. Only `IoUring` asked for and unavailable is an error.
pub fn open_queue(
    dev: Arc<FileDevice>,
    backend: Backend,
    depth: u32,
) -> Result<Arc<dyn IoQueue>, IoError> {
    match backend {
        Backend::Threads => Ok(Arc::new(ThreadQueue::new(dev, DEFAULT_THREADS))),
        Backend::IoUring => Ok(Arc::new(UringQueue::new(dev, depth)?)),
        Backend::Auto => match UringQueue::new(dev.clone(), depth) {
            Ok(q) => Ok(Arc::new(q)),
            Err(e) => {
                tracing_free_log(&format!(
                    "io_uring is not usable on {} ({e}): using a pool of {DEFAULT_THREADS} I/O threads",
                    dev.path().display()
                ));
                Ok(Arc::new(ThreadQueue::new(dev, DEFAULT_THREADS)))
            }
        },
    }
}

/// sce-io has no logging dependency: the fallback is said on stderr, once per queue.
fn tracing_free_log(msg: &str) {
    eprintln!("sce-io: {msg}");
}

/// Checks an operation as [`BlockDevice`] would, before it reaches the device: `Err` holds
/// the completion to give at once.
pub(crate) fn precheck(dev: &dyn BlockDevice, op: IoOp) -> Result<IoOp, IoDone> {
    let (offset, len) = op.range();
    let r = match op {
        IoOp::Flush => Ok(()),
        _ => check_range(op.op(), offset, len, dev.size(), dev.logical_block_size()),
    };
    match r {
        Ok(()) if len > 0 || matches!(op, IoOp::Flush) => Ok(op),
        Ok(()) => Err(IoDone {
            result: Ok(()),
            buf: op.into_buf(),
        }),
        Err(e) => Err(IoDone {
            result: Err(e),
            buf: op.into_buf(),
        }),
    }
}

/// Runs an operation with the device's blocking calls.
pub(crate) fn run_blocking(dev: &dyn BlockDevice, op: IoOp) -> IoDone {
    match op {
        IoOp::Read { offset, mut buf } => IoDone {
            result: dev.read_at(offset, &mut buf),
            buf: Some(buf),
        },
        IoOp::Write { offset, buf } => IoDone {
            result: dev.write_at(offset, &buf),
            buf: Some(buf),
        },
        IoOp::Flush => IoDone {
            result: dev.flush(),
            buf: None,
        },
    }
}
