//! Write-back's sequential bypass (issue 45), as bcache's `sequential_cutoff` does it: a
//! write of at least [`MIN_REQUEST`] bytes that continues a sequential stream whose run has
//! reached the cutoff (`--sequential-cutoff`, the detector reads' admission uses) goes
//! through to the source instead of into the log, so that a restore or a copy does not
//! fill the dirty room and push the random writes the log is for behind it. Smaller writes
//! stay in the log even in a stream: a database's WAL appends are sequential and small,
//! each waiting for its FLUSH, and the log is what makes them fast. A write that goes
//! through is written as a drain writes one (`drain.rs`): merged with, and superseding,
//! the log's versions of its pages.

use crate::order::{levels, OrderedMutex};
use sce_core::admit::Streams;

/// The smallest write the bypass considers (smaller ones never take its lock).
pub(super) const MIN_REQUEST: u64 = 128 << 10;

/// Verdicts remembered by request: more than the writes a client keeps in flight, so that
/// a worker asking about a write the reader asked about first finds the reader's answer.
const RECENT: usize = 64;

/// The stream detector of the log's writes.
pub(super) struct Bypass {
    st: OrderedMutex<levels::Leaf, State>,
}

struct State {
    cutoff: u64,
    streams: Streams,
    /// The last verdicts, by (offset, length): the NBD reader asks first, in the order the
    /// requests came (`queued.rs`, `runs_locally`), and a worker asks again for a write the
    /// reader left to it; both must get the same answer, and the stream must count the
    /// request once.
    recent: [(u64, u64, bool); RECENT],
    next: usize,
}

impl State {
    fn new(cutoff: u64) -> State {
        State {
            cutoff,
            streams: Streams::new(cutoff, 20),
            recent: [(0, 0, false); RECENT],
            next: 0,
        }
    }
}

impl Bypass {
    /// A detector with `cutoff` bytes of run (0: none goes through).
    pub(super) fn new(cutoff: u64) -> Bypass {
        Bypass {
            st: OrderedMutex::new(State::new(cutoff)),
        }
    }

    /// A new cutoff (`sce ctl set ... seq-cutoff`): the streams start over.
    pub(super) fn set_cutoff(&self, cutoff: u64) {
        let mut st = self.st.lock();
        if st.cutoff != cutoff {
            *st = State::new(cutoff);
        }
    }

    /// Whether a client's write of `len` bytes at `offset` goes through to the source. The
    /// same request asked again gets the same answer.
    pub(super) fn goes_around(&self, offset: u64, len: u64) -> bool {
        if len < MIN_REQUEST {
            return false;
        }
        let mut st = self.st.lock();
        if st.cutoff == 0 {
            return false;
        }
        if let Some(&(_, _, v)) = st.recent.iter().find(|r| r.0 == offset && r.1 == len) {
            return v;
        }
        let v = st.streams.observe(offset, len).sequential;
        let k = st.next;
        st.recent[k] = (offset, len, v);
        st.next = (k + 1) % RECENT;
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_of_large_writes_goes_around_from_the_cutoff_and_small_ones_never() {
        let b = Bypass::new(4 << 20);
        let mib = 1u64 << 20;
        // 1 MiB writes in a row: the fourth reaches 4 MiB of run.
        let v: Vec<bool> = (0..6).map(|k| b.goes_around(k * mib, mib)).collect();
        assert_eq!(v, [false, false, false, true, true, true]);
        // Asked again (the reader, then a worker): the same answer, counted once.
        assert!(b.goes_around(5 * mib, mib));
        assert!(b.goes_around(6 * mib, mib));
        // Small sequential writes (a WAL) stay in the log however long the run.
        let small: Vec<bool> = (0..4096)
            .map(|k| b.goes_around((1 << 30) + k * 8192, 8192))
            .collect();
        assert!(small.iter().all(|&x| !x));
        // A random large write is not a stream.
        assert!(!b.goes_around(7 << 30, mib));
        // Cutoff 0: nothing goes around.
        b.set_cutoff(0);
        assert!(!b.goes_around(7 * mib, mib));
    }
}
