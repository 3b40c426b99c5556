//! The workers' job queue: a mutex, a queue and a condition variable. A worker with nothing
//! to do sleeps at once; it does not spin or `sched_yield` first, as a channel's receiver
//! does (on a two-core machine serving PostgreSQL through FUSE, the idle workers' yields
//! were a quarter of their CPU, taken from the threads with work). Push wakes one sleeper;
//! closing wakes all, and they leave once the queue is empty.

use super::transmission::Job;
use parking_lot::Condvar;
use sce_io::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use std::collections::VecDeque;

/// Jobs for the worker pool.
#[derive(Default)]
pub(super) struct JobQueue {
    st: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

impl JobQueue {
    /// Queues `job` for a worker; gives it back if the queue is closed.
    pub(super) fn push(&self, job: Job) -> Result<(), Job> {
        let mut st = self.st.lock();
        if st.1 {
            return Err(job);
        }
        st.0.push_back(job);
        drop(st);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job, waiting for one; `None` once the queue is closed and empty.
    pub(super) fn pop(&self) -> Option<Job> {
        let mut st = self.st.lock();
        loop {
            if let Some(job) = st.0.pop_front() {
                return Some(job);
            }
            if st.1 {
                return None;
            }
            st.wait(&self.ready);
        }
    }

    /// No more jobs: workers finish what is queued and leave.
    pub(super) fn close(&self) {
        self.st.lock().1 = true;
        self.ready.notify_all();
    }
}
