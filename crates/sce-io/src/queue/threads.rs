//! `ThreadQueue`: the fallback [`IoQueue`], a pool of threads that run the device's blocking
//! calls. Works for any [`BlockDevice`].

use super::{precheck, run_blocking, Backend, IoOp, IoQueue, OnDone};
use crate::order::{levels, OrderedMutex};
use crate::BlockDevice;
use parking_lot::Condvar;
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::collections::VecDeque;
use std::sync::Arc;

struct Inner<D: ?Sized> {
    jobs: Mutex<Jobs>,
    ready: Condvar,
    dev: Arc<D>,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<(IoOp, OnDone)>,
    /// No handle is left: threads end once the queue is empty.
    closing: bool,
}

/// A pool of threads running blocking I/O on a device.
pub struct ThreadQueue<D: BlockDevice + ?Sized + 'static> {
    inner: Arc<Inner<D>>,
}

impl<D: BlockDevice + ?Sized + 'static> std::fmt::Debug for ThreadQueue<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadQueue").finish()
    }
}

impl<D: BlockDevice + ?Sized + 'static> ThreadQueue<D> {
    /// A queue of `threads` threads (at least one) on `dev`. A thread that cannot be
    /// started is left out; with none at all, operations run on the submitting thread.
    pub fn new(dev: Arc<D>, threads: usize) -> Self {
        let inner = Arc::new(Inner {
            jobs: Mutex::new(Jobs::default()),
            ready: Condvar::new(),
            dev,
        });
        for _ in 0..threads.max(1) {
            let inner = inner.clone();
            if std::thread::Builder::new()
                .name("sce-io".into())
                .spawn(move || run(&inner))
                .is_err()
            {
                break;
            }
        }
        ThreadQueue { inner }
    }
}

fn run<D: BlockDevice + ?Sized>(inner: &Inner<D>) {
    loop {
        let next = {
            let mut jobs = inner.jobs.lock();
            loop {
                if let Some(j) = jobs.queue.pop_front() {
                    break Some(j);
                }
                if jobs.closing {
                    break None;
                }
                jobs.wait(&inner.ready);
            }
        };
        let Some((op, done)) = next else { return };
        let d = run_blocking(&inner.dev, op);
        // A callback that panics must not take a thread of the pool with it.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || done(d))).is_err() {
            eprintln!("sce-io: an I/O completion callback panicked; the queue goes on");
        }
    }
}

impl<D: BlockDevice + ?Sized + 'static> IoQueue for ThreadQueue<D> {
    fn submit(&self, op: IoOp, done: OnDone) {
        let op = match precheck(&self.inner.dev, op) {
            Ok(op) => op,
            Err(d) => return done(d),
        };
        // Only threads still alive hold the inner state besides this handle.
        if Arc::strong_count(&self.inner) == 1 {
            return done(run_blocking(&self.inner.dev, op));
        }
        self.inner.jobs.lock().queue.push_back((op, done));
        self.inner.ready.notify_one();
    }

    fn backend(&self) -> Backend {
        Backend::Threads
    }

    fn device(&self) -> &dyn BlockDevice {
        &self.inner.dev
    }
}

impl<D: BlockDevice + ?Sized + 'static> Drop for ThreadQueue<D> {
    fn drop(&mut self) {
        self.inner.jobs.lock().closing = true;
        self.inner.ready.notify_all();
    }
}
