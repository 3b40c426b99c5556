//! `UringQueue`: an [`IoQueue`] on io_uring, for a [`FileDevice`].
//!
//! Submitters push their entries under the queue's mutex and enter the kernel once per
//! batch, after releasing it (the mutex is a device's own lock, `order::levels::Device`:
//! nothing is taken under it, and it is held for the pushes only). One
//! completion thread per queue waits in `io_uring_enter(GETEVENTS)`, reaps every completion
//! there is, takes their operations out of the table under one lock and runs the callbacks
//! outside it.
//!
//! The buffers of operations in flight live in the queue's table of pending operations
//! until their completion is reaped: the kernel's pointer into a buffer stays valid however
//! the submitter's state changes, and nothing frees a buffer the kernel may still write.
//!
//! At most `depth` operations are in flight (the completion ring holds twice as many, so it
//! never overflows); an operation beyond it runs as a blocking call on the submitting thread
//! rather than wait, so a callback that submits (a write followed by its flush) can never
//! deadlock against the completion thread it runs on.

use super::{precheck, run_blocking, Backend, IoDone, IoOp, IoQueue, OnDone};
use crate::order::{levels, OrderedMutex};
use crate::{BlockDevice, FileDevice, IoError, Op};
use io_uring::{opcode, types, IoUring};
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

/// The `user_data` of the no-op that wakes the completion thread at the end.
const WAKE: u64 = u64::MAX;

/// An operation in flight: what it was and who waits for it.
struct InFlight {
    op: IoOp,
    done: OnDone,
}

/// The table of operations in flight, indexed by `user_data`.
#[derive(Default)]
struct Pending {
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    count: usize,
}

impl Pending {
    fn insert(&mut self, f: InFlight) -> usize {
        self.count += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(f);
                i
            }
            None => {
                self.slots.push(Some(f));
                self.slots.len() - 1
            }
        }
    }

    fn take(&mut self, i: usize) -> Option<InFlight> {
        let f = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        self.count -= 1;
        Some(f)
    }
}

struct Inner {
    ring: IoUring,
    dev: Arc<FileDevice>,
    fd: RawFd,
    depth: usize,
    /// The pending table; also serialises use of the submission ring (level `Device`:
    /// nothing is taken under it).
    pending: Mutex<Pending>,
    /// No handle is left: the completion thread ends once nothing is pending.
    closing: AtomicBool,
}

/// io_uring on a file or block device.
pub struct UringQueue {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for UringQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringQueue")
            .field("path", &self.inner.dev.path())
            .field("depth", &self.inner.depth)
            .finish()
    }
}

fn ring_err(op: Op, e: std::io::Error) -> IoError {
    IoError::Io {
        op,
        offset: 0,
        len: 0,
        source: e,
    }
}

impl UringQueue {
    /// A queue of up to `depth` operations in flight on `dev`. Fails if io_uring cannot be
    /// set up here, or a probe read of the device's first block through it fails or reads
    /// other bytes than a blocking read does.
    pub fn new(dev: Arc<FileDevice>, depth: u32) -> Result<UringQueue, IoError> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::builder()
            .setup_cqsize(depth * 2)
            .build(depth)
            .map_err(|e| ring_err(Op::Read, e))?;
        let fd = dev.as_raw_fd();
        let inner = Arc::new(Inner {
            ring,
            dev,
            fd,
            depth: depth as usize,
            pending: Mutex::new(Pending::default()),
            closing: AtomicBool::new(false),
        });
        if let Err(e) = probe(&inner) {
            // The probe may still be in flight: never close the ring under it.
            std::mem::forget(inner);
            return Err(e);
        }
        let reaper = inner.clone();
        std::thread::Builder::new()
            .name("sce-uring".into())
            .spawn(move || reap(&reaper))
            .map_err(|e| ring_err(Op::Read, e))?;
        Ok(UringQueue { inner })
    }
}

/// Reads the device's first block through the ring (before the completion thread runs)
/// and with a blocking read, and compares.
fn probe(inner: &Inner) -> Result<(), IoError> {
    let lbs = inner.dev.logical_block_size() as usize;
    if inner.dev.size() < lbs as u64 {
        return Ok(());
    }
    let mut a = crate::AlignedBuf::new(lbs);
    let mut b = crate::AlignedBuf::new(lbs);
    let entry = opcode::Read::new(types::Fd(inner.fd), a.as_mut_ptr(), lbs as u32)
        .offset(0)
        .build()
        .user_data(0);
    // SAFETY: nothing else uses the rings yet (the completion thread is not started); the
    // buffer outlives the operation, which is waited for below.
    unsafe {
        inner
            .ring
            .submission_shared()
            .push(&entry)
            .map_err(|_| IoError::Invalid("io_uring: submission ring full".into()))?;
    }
    // The read is the kernel's until its completion is reaped: wait for it, and if that
    // cannot be done, leak its buffer rather than free memory the kernel may still write
    // (the caller then leaks the ring, see `UringQueue::new`).
    let res = loop {
        match inner.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if retryable(&e) => {}
            Err(e) => {
                std::mem::forget(a);
                return Err(ring_err(Op::Read, e));
            }
        }
        // SAFETY: the only user of the completion ring at this point.
        if let Some(c) = unsafe { inner.ring.completion_shared() }.next() {
            break c.result();
        }
    };
    if res < 0 {
        return Err(ring_err(Op::Read, std::io::Error::from_raw_os_error(-res)));
    }
    inner.dev.read_at(0, &mut b)?;
    if res as usize != lbs || a[..] != b[..] {
        return Err(IoError::Invalid(format!(
            "io_uring: the probe read {res} bytes unlike a blocking read"
        )));
    }
    Ok(())
}

impl UringQueue {
    /// Pushes every operation it can and enters the kernel once. What cannot go to the ring
    /// (refused by the checks, a write to a read-only device, the ring at its depth) is
    /// completed after the lock is released: at once, or with a blocking call.
    fn submit_all(&self, ops: impl Iterator<Item = (IoOp, OnDone)>) {
        let inner = &*self.inner;
        let mut answered: Vec<(OnDone, IoDone)> = Vec::new();
        let mut blocking: Vec<(IoOp, OnDone)> = Vec::new();
        {
            let mut pending = inner.pending.lock();
            // SAFETY: submission rings are only used under `pending`, which is held.
            let mut sq = unsafe { inner.ring.submission_shared() };
            let mut pushed = 0;
            for (op, done) in ops {
                let op = match precheck(&*inner.dev, op) {
                    Ok(op) => op,
                    Err(d) => {
                        answered.push((done, d));
                        continue;
                    }
                };
                let read_only = matches!(op, IoOp::Write { .. }) && inner.dev.is_read_only();
                if read_only || pending.count >= inner.depth || op.range().1 > u32::MAX as u64 {
                    blocking.push((op, done));
                    continue;
                }
                let key = pending.insert(InFlight { op, done });
                let entry = entry_for(inner.fd, key, &mut pending);
                // SAFETY: the entry points into the buffer held in `pending` until the
                // completion is reaped (an `AlignedBuf`'s heap block does not move when the
                // table grows).
                if unsafe { sq.push(&entry) }.is_err() {
                    // Cannot happen with at most `depth` in flight, each entered at once;
                    // keep the promise anyway.
                    let f = pending.take(key).expect("just inserted");
                    blocking.push((f.op, f.done));
                    continue;
                }
                pushed += 1;
            }
            drop(sq);
            drop(pending);
            if pushed > 0 {
                // Enters the kernel, with the table unlocked: the entries are in the ring
                // (its tail was published by `drop(sq)`), and the kernel serialises
                // concurrent enters itself, so the completion thread need not wait for this
                // call to take its completions (under the lock it spun in `sched_yield`
                // about once per request at depth 32). Should entering keep failing, the
                // entries stay in the ring and the completion thread's next enter (at most
                // `REENTER` away) submits them.
                for _ in 0..16 {
                    match inner.ring.submit() {
                        Err(e) if retryable(&e) => std::thread::yield_now(),
                        _ => break,
                    }
                }
            }
        }
        for (done, d) in answered {
            done(d);
        }
        for (op, done) in blocking {
            done(run_blocking(&*inner.dev, op));
        }
    }
}

/// The ring entry for the pending operation `key`.
fn entry_for(fd: RawFd, key: usize, pending: &mut Pending) -> io_uring::squeue::Entry {
    let fd = types::Fd(fd);
    match &mut pending.slots[key].as_mut().expect("pending").op {
        IoOp::Read { offset, buf } => opcode::Read::new(fd, buf.as_mut_ptr(), buf.len() as u32)
            .offset(*offset)
            .build(),
        IoOp::Write { offset, buf } => opcode::Write::new(fd, buf.as_ptr(), buf.len() as u32)
            .offset(*offset)
            .build(),
        IoOp::Flush => opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
    }
    .user_data(key as u64)
}

impl IoQueue for UringQueue {
    fn submit(&self, op: IoOp, done: OnDone) {
        self.submit_all(std::iter::once((op, done)));
    }

    fn submit_batch(&self, ops: Vec<(IoOp, OnDone)>) {
        self.submit_all(ops.into_iter());
    }

    fn backend(&self) -> Backend {
        Backend::IoUring
    }

    fn device(&self) -> &dyn BlockDevice {
        &*self.inner.dev
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        let inner = &*self.inner;
        inner.closing.store(true, SeqCst);
        let _pending = inner.pending.lock();
        let wake = opcode::Nop::new().build().user_data(WAKE);
        // SAFETY: under `pending`, as every use of the submission ring.
        let _ = unsafe { inner.ring.submission_shared().push(&wake) };
        let _ = inner.ring.submit();
    }
}

/// Errors of `io_uring_enter` worth trying again at once.
fn retryable(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

/// The completion thread's longest wait: it enters the kernel again at least this often, so
/// entries whose submission failed are submitted without waiting for another operation.
const REENTER: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits for at least one completion, or for `REENTER` (kernels without timed waits: no
/// limit), submitting whatever is in the submission ring on the way.
fn wait(inner: &Inner, timed: &mut bool) {
    let r = if *timed {
        let ts = types::Timespec::from(REENTER);
        let args = types::SubmitArgs::new().timespec(&ts);
        match inner.ring.submitter().submit_with_args(1, &args) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                *timed = false;
                return;
            }
            r => r,
        }
    } else {
        inner.ring.submit_and_wait(1)
    };
    match r {
        Ok(_) => {}
        Err(e) if retryable(&e) || e.raw_os_error() == Some(libc::ETIME) => {}
        Err(e) => {
            eprintln!("sce-io: io_uring wait failed: {e}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// The completion thread: reaps completions and runs their callbacks until the last handle
/// is gone and nothing is pending. A callback that panics is reported and does not stop the
/// thread (the other operations in flight must still complete, and their buffers must not
/// be freed under the kernel).
fn reap(inner: &Inner) {
    let mut done: Vec<(u64, i32)> = Vec::new();
    let mut timed = true;
    loop {
        wait(inner, &mut timed);
        // SAFETY: this thread is the only user of the completion ring once started.
        done.extend(unsafe { inner.ring.completion_shared() }.map(|c| (c.user_data(), c.result())));
        // Every reaped operation out of the table under one lock.
        let taken: Vec<(InFlight, i32)> = {
            let mut pending = inner.pending.lock();
            done.drain(..)
                .filter(|&(key, _)| key != WAKE)
                .filter_map(|(key, res)| Some((pending.take(key as usize)?, res)))
                .collect()
        };
        for (mut f, res) in taken {
            let result = finish(inner, &mut f.op, res);
            let (op, callback) = (f.op, f.done);
            let run = std::panic::AssertUnwindSafe(move || {
                callback(IoDone {
                    result,
                    buf: op.into_buf(),
                })
            });
            if std::panic::catch_unwind(run).is_err() {
                eprintln!("sce-io: an I/O completion callback panicked; the queue goes on");
            }
        }
        if inner.closing.load(SeqCst) && inner.pending.lock().count == 0 {
            return;
        }
    }
}

/// The result of a completed operation; a short read or write is finished with blocking
/// calls (rare: the range was checked, so only a signal or an odd device stops it early;
/// on an O_DIRECT device a rest that is not block-aligned fails with EINVAL, reported as
/// the operation's I/O error).
fn finish(inner: &Inner, op: &mut IoOp, res: i32) -> Result<(), IoError> {
    let (offset, len) = op.range();
    let kind = op.op();
    let io_err = |e: std::io::Error| IoError::Io {
        op: kind,
        offset,
        len,
        source: e,
    };
    if res < 0 {
        return Err(io_err(std::io::Error::from_raw_os_error(-res)));
    }
    let n = res as usize;
    let file = inner.dev.file();
    match op {
        IoOp::Read { buf, .. } if n < buf.len() => file
            .read_exact_at(&mut buf[n..], offset + n as u64)
            .map_err(io_err),
        IoOp::Write { buf, .. } if n < buf.len() => file
            .write_all_at(&buf[n..], offset + n as u64)
            .map_err(io_err),
        _ => Ok(()),
    }
}
