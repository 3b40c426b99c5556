//! Read-ahead of the source for streams of large reads (issue 46: a 1 MiB read that misses
//! is stored by sce, then forwarded, so at depth 1 a stream through sce left the source's
//! link idle for the forward of each request, 0.78-0.88x of the source alone's throughput
//! behind a link-limited source).
//!
//! [`ReadAhead`] wraps the source. A source read of [`MIN_LEN`] to [`MAX_LEN`] bytes that
//! starts where a recent one ended is a stream: the next range of the same length is read
//! at once, on a read-ahead thread, into a *window*; the read that asks for it takes its
//! bytes from the window (waiting for it if it is still in flight) and starts the next one,
//! so the link always has the next request in flight. Anything else goes straight to the
//! source.
//!
//! **Never stale.** Every write and discard through the wrapper voids the windows it
//! overlaps twice: when it starts (a window read before it holds the older bytes) and when
//! it ends (a window started while it was in flight may have read the source before the
//! write landed). A window is used only if no write voided it by the time a read takes its
//! bytes, so a read returns what a source read started no earlier than the last completed
//! write to those bytes returns. Writes that do not go through the wrapper are the engine's
//! to announce: a volume's source written while its export was detached (several exports
//! sharing a cache device) and `forget` void every window (`void_all`); other hosts' writes
//! cannot be, so it is off in shared mode (`EngineConfig::read_ahead`).
//!
//! At most [`WINDOWS`] windows exist at once (the oldest unclaimed one gives way), so the
//! memory held is at most `WINDOWS * MAX_LEN`; a stream that stops wastes one window's read.

use crate::order::{levels, OrderedMutex, OrderedMutexGuard};
use parking_lot::Condvar;
use sce_io::{AlignedBuf, BlockDevice, Extent, IoError, SharedBytes};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The smallest read that may start or continue a stream (smaller ones are what random
/// loads and population are made of).
pub(crate) const MIN_LEN: u64 = 128 << 10;
/// The largest read that does (and so the largest window).
pub(crate) const MAX_LEN: u64 = 8 << 20;
/// Windows held at once.
pub(crate) const WINDOWS: usize = 4;
/// Read ends remembered to find streams (one per concurrent stream).
const ENDS: usize = 8;
/// Threads that read windows.
const THREADS: usize = 2;

enum Fill {
    Pending,
    Ready(AlignedBuf),
    Failed,
}

struct Window {
    id: u64,
    start: u64,
    len: u64,
    fill: Fill,
    /// A write overlapped it since it was started: its bytes are never used.
    void: bool,
    /// A read waits for it (and removes it).
    claimed: bool,
}

#[derive(Default)]
struct State {
    ends: VecDeque<u64>,
    windows: Vec<Window>,
    next_id: u64,
    /// Where the reads of a stream's size going straight to the source start: while any
    /// is in flight, the client keeps several in flight and reads ahead itself.
    reading: Vec<u64>,
}

/// What the read-ahead read and what of it the reads used.
#[derive(Debug, Default)]
pub struct ReadAheadStats {
    /// Bytes read ahead from the source.
    pub read: AtomicU64,
    /// Bytes of them that reads took.
    pub used: AtomicU64,
}

struct Shared {
    st: OrderedMutex<levels::Leaf, State>,
    cv: Condvar,
    stats: Arc<ReadAheadStats>,
}

/// The source with read-ahead for streams (see the module).
pub(crate) struct ReadAhead {
    inner: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    tx: Option<crossbeam_channel::Sender<(u64, u64, u64)>>,
    threads: Vec<JoinHandle<()>>,
}

impl ReadAhead {
    /// Wraps `inner`; its threads are named `sce-readahead-N`.
    pub(crate) fn new(inner: Arc<dyn BlockDevice>) -> Result<ReadAhead, IoError> {
        let shared = Arc::new(Shared {
            st: OrderedMutex::new(State::default()),
            cv: Condvar::new(),
            stats: Arc::default(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<(u64, u64, u64)>();
        let mut threads = Vec::new();
        for i in 0..THREADS {
            let (rx, dev, sh) = (rx.clone(), inner.clone(), shared.clone());
            let t = std::thread::Builder::new()
                .name(format!("sce-readahead-{i}"))
                .spawn(move || {
                    for (id, start, len) in rx {
                        fill(&*dev, &sh, (id, start, len));
                    }
                })
                .map_err(|e| IoError::Failed(format!("cannot start a read-ahead thread: {e}")))?;
            threads.push(t);
        }
        Ok(ReadAhead {
            inner,
            shared,
            tx: Some(tx),
            threads,
        })
    }

    /// Its counters.
    pub(crate) fn stats(&self) -> Arc<ReadAheadStats> {
        self.shared.stats.clone()
    }

    /// Starts a window of `len` bytes at `at` unless one starts there (state locked).
    fn start(&self, st: &mut State, at: u64, len: u64) {
        let len = len.min(self.inner.size().saturating_sub(at));
        let started = st.windows.iter().any(|w| w.start == at && !w.void);
        // Only for a client that waits for each read before it sends the next (depth 1):
        // one that keeps others in flight reads ahead itself, and a window would only add
        // a copy of each MiB (behind a fast source, 0.51-0.60x instead of 0.71-0.79x at
        // depth 8, CPU-bound on 2 CPUs).
        if len == 0 || started || !st.reading.is_empty() {
            return;
        }
        if st.windows.len() >= WINDOWS {
            // The oldest one nobody waits for gives way (its read, if in flight, is dropped
            // when it completes).
            match st.windows.iter().position(|w| !w.claimed) {
                Some(i) => {
                    st.windows.remove(i);
                }
                None => return,
            }
        }
        st.next_id += 1;
        let id = st.next_id;
        st.windows.push(Window {
            id,
            start: at,
            len,
            fill: Fill::Pending,
            void: false,
            claimed: false,
        });
        if let Some(tx) = &self.tx {
            let _ = tx.send((id, at, len));
        }
    }

    /// Remembers that a read ended at `end`; true if `offset` is where a recent one ended.
    fn follow(st: &mut State, offset: u64, end: u64) -> bool {
        let seq = match st.ends.iter().position(|&e| e == offset) {
            Some(i) => {
                st.ends.remove(i);
                true
            }
            None => false,
        };
        st.ends.push_front(end);
        st.ends.truncate(ENDS);
        seq
    }

    /// Takes window `id`'s bytes into `buf` once it is filled; false if it failed or was
    /// voided (the caller reads the source). The window is removed either way.
    fn take(
        &self,
        mut st: OrderedMutexGuard<'_, levels::Leaf, State>,
        id: u64,
        buf: &mut [u8],
    ) -> bool {
        loop {
            let Some(i) = st.windows.iter().position(|w| w.id == id) else {
                return false;
            };
            let w = &st.windows[i];
            if w.void || matches!(w.fill, Fill::Failed) {
                st.windows.remove(i);
                return false;
            }
            if matches!(w.fill, Fill::Pending) {
                st.wait(&self.shared.cv);
                continue;
            }
            let w = st.windows.remove(i);
            drop(st);
            let Fill::Ready(b) = w.fill else {
                unreachable!("checked above")
            };
            buf.copy_from_slice(&b[..buf.len()]);
            self.shared.stats.used.fetch_add(buf.len() as u64, Relaxed);
            return true;
        }
    }

    /// Voids every window that overlaps `[offset, offset + len)`.
    fn void(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len);
        let mut st = self.shared.st.lock();
        for w in &mut st.windows {
            if w.start < end && offset < w.start + w.len {
                w.void = true;
            }
        }
        // Filled ones nobody waits for go now; those in flight when their read ends.
        st.windows
            .retain(|w| !(w.void && !w.claimed && !matches!(w.fill, Fill::Pending)));
        drop(st);
        // A read waiting for a window it claimed must see the void now: the window's own
        // read may never report (its thread skips a window voided before it began).
        self.shared.cv.notify_all();
    }

    /// Voids every window: the source may have changed behind the wrapper (a volume's
    /// source written while its export was detached, `forget`).
    pub(crate) fn void_all(&self) {
        self.void(0, u64::MAX);
    }

    /// A write-like call `f` over `[offset, offset + len)`, with the windows it overlaps
    /// voided before and after it.
    fn writing<T>(&self, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        self.void(offset, len);
        let r = f();
        self.void(offset, len);
        r
    }
}

/// A read-ahead thread's work: reads window `id` and hands it over (or drops it if it is gone
/// or voided with nobody waiting).
fn fill(dev: &dyn BlockDevice, sh: &Shared, (id, start, len): (u64, u64, u64)) {
    {
        let mut st = sh.st.lock();
        let Some(i) = st.windows.iter().position(|w| w.id == id) else {
            return;
        };
        if st.windows[i].void {
            // Never read: a read that claimed it is told so (`void` woke it too).
            if st.windows[i].claimed {
                st.windows[i].fill = Fill::Failed;
            } else {
                st.windows.remove(i);
            }
            drop(st);
            sh.cv.notify_all();
            return;
        }
    }
    let mut buf = AlignedBuf::new(len as usize);
    let r = dev.read_at(start, &mut buf);
    if r.is_ok() {
        sh.stats.read.fetch_add(len, Relaxed);
    }
    let mut st = sh.st.lock();
    if let Some(i) = st.windows.iter().position(|w| w.id == id) {
        if st.windows[i].void && !st.windows[i].claimed {
            st.windows.remove(i);
        } else {
            st.windows[i].fill = match r {
                Ok(()) => Fill::Ready(buf),
                Err(_) => Fill::Failed,
            };
        }
    }
    drop(st);
    sh.cv.notify_all();
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        // The threads end once the channel is closed and their reads are done (a source
        // read has its own deadline).
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl BlockDevice for ReadAhead {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        if !(MIN_LEN..=MAX_LEN).contains(&len) {
            return self.inner.read_at(offset, buf);
        }
        let mut st = self.shared.st.lock();
        let seq = Self::follow(&mut st, offset, offset + len);
        let mine = st
            .windows
            .iter_mut()
            .find(|w| w.start == offset && w.len >= len && !w.void && !w.claimed);
        if let Some(w) = mine {
            w.claimed = true;
            let id = w.id;
            self.start(&mut st, offset + len, len);
            if self.take(st, id, buf) {
                return Ok(());
            }
            return self.inner.read_at(offset, buf);
        }
        if seq {
            self.start(&mut st, offset + len, len);
        }
        st.reading.push(offset);
        drop(st);
        let r = self.inner.read_at(offset, buf);
        let mut st = self.shared.st.lock();
        if let Some(i) = st.reading.iter().position(|&o| o == offset) {
            st.reading.swap_remove(i);
        }
        r
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.writing(offset, buf.len() as u64, || {
            self.inner.write_at(offset, buf)
        })
    }
    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let len = data.len() as u64;
        self.writing(offset, len, || self.inner.write_shared(offset, data))
    }
    fn flush(&self) -> Result<(), IoError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.writing(offset, len, || self.inner.discard(offset, len))
    }
    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, IoError> {
        self.inner.extents(offset, len, max)
    }
    fn extents_are_local(&self) -> bool {
        self.inner.extents_are_local()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    use sce_io::MemDevice;
    use std::sync::atomic::AtomicBool;

    const BLOCK: u64 = 4096;
    const SIZE: u64 = 16 << 20;

    /// A memory device whose reads and writes take a while, so that windows are in flight
    /// while writes land (the races the voiding is for).
    struct Slow(MemDevice);

    impl BlockDevice for Slow {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn logical_block_size(&self) -> u32 {
            self.0.logical_block_size()
        }
        /// The bytes are taken when the read starts, and it completes later.
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
            let r = self.0.read_at(offset, buf);
            std::thread::sleep(std::time::Duration::from_micros(300));
            r
        }
        /// The bytes land a while after the write starts.
        fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
            std::thread::sleep(std::time::Duration::from_micros(50));
            self.0.write_at(offset, buf)
        }
        fn flush(&self) -> Result<(), IoError> {
            Ok(())
        }
        fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
            self.0.discard(offset, len)
        }
    }

    /// Block `b` at version `v`: both in every 8 bytes' first half and second.
    fn stamp(b: u64, v: u64) -> Vec<u8> {
        (0..BLOCK / 16)
            .flat_map(|_| b.to_le_bytes().into_iter().chain(v.to_le_bytes()))
            .collect()
    }

    #[test]
    fn a_stream_is_read_ahead_and_gets_the_right_bytes() {
        let mem = MemDevice::new(SIZE);
        for b in 0..SIZE / BLOCK {
            mem.write_at(b * BLOCK, &stamp(b, 0)).unwrap();
        }
        let ra = ReadAhead::new(Arc::new(Slow(mem))).unwrap();
        let len = 256 << 10;
        let mut buf = vec![0u8; len as usize];
        for at in (0..SIZE).step_by(len as usize) {
            ra.read_at(at, &mut buf).unwrap();
            for (i, c) in buf.chunks(BLOCK as usize).enumerate() {
                assert_eq!(
                    c,
                    &stamp(at / BLOCK + i as u64, 0)[..],
                    "block at {at} + {i}"
                );
            }
        }
        let s = ra.stats();
        // The first two reads find the stream; every later one is read ahead.
        let ahead = SIZE - 2 * len;
        assert_eq!(s.used.load(Relaxed), ahead, "{s:?}");
        // Small reads and reads that follow nothing are left alone.
        let mut small = vec![0u8; 4096];
        ra.read_at(0, &mut small).unwrap();
        ra.read_at(8 * len, &mut buf).unwrap();
        assert_eq!(s.used.load(Relaxed), ahead, "{s:?}");
    }

    /// A write behind the wrapper (a detached export's source) is announced with
    /// `void_all`: the window read before it is not used.
    #[test]
    fn void_all_drops_what_was_read_before_a_write_behind_the_wrapper() {
        let mem = Arc::new(MemDevice::new(SIZE));
        for b in 0..SIZE / BLOCK {
            mem.write_at(b * BLOCK, &stamp(b, 0)).unwrap();
        }
        let ra = ReadAhead::new(mem.clone()).unwrap();
        let len = 256 << 10;
        let mut buf = vec![0u8; len as usize];
        ra.read_at(0, &mut buf).unwrap();
        ra.read_at(len, &mut buf).unwrap();
        // A window of [2 len, 3 len) is started; wait until it is filled.
        while ra.stats().read.load(Relaxed) < len {
            std::thread::yield_now();
        }
        let b = 2 * len / BLOCK;
        mem.write_at(b * BLOCK, &stamp(b, 9)).unwrap();
        ra.void_all();
        ra.read_at(2 * len, &mut buf).unwrap();
        assert_eq!(&buf[..BLOCK as usize], &stamp(b, 9)[..]);
        assert_eq!(ra.stats().used.load(Relaxed), 0);
    }

    /// A writer stamps random blocks with rising versions while two readers stream through
    /// the device: no read returns a block older than the version whose write completed
    /// before the read began.
    #[test]
    fn no_read_ahead_is_older_than_a_write_completed_before_the_read() {
        let mem = MemDevice::new(SIZE);
        let blocks = SIZE / BLOCK;
        for b in 0..blocks {
            mem.write_at(b * BLOCK, &stamp(b, 0)).unwrap();
        }
        let ra = Arc::new(ReadAhead::new(Arc::new(Slow(mem))).unwrap());
        let acked: Arc<Vec<AtomicU64>> = Arc::new((0..blocks).map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (ra, acked, stop) = (ra.clone(), acked.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(7);
                let mut v = 0;
                while !stop.load(Relaxed) {
                    v += 1;
                    let b = rng.gen_range(0..blocks);
                    ra.write_at(b * BLOCK, &stamp(b, v)).unwrap();
                    acked[b as usize].fetch_max(v, Relaxed);
                }
            })
        };
        let readers: Vec<_> = [128u64 << 10, 512 << 10]
            .into_iter()
            .map(|len| {
                let (ra, acked) = (ra.clone(), acked.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; len as usize];
                    let mut old = 0;
                    for pass in 0..4 {
                        for at in (0..SIZE).step_by(len as usize) {
                            let first = at / BLOCK;
                            let n = len / BLOCK;
                            let floor: Vec<u64> = (first..first + n)
                                .map(|b| acked[b as usize].load(Relaxed))
                                .collect();
                            ra.read_at(at, &mut buf).unwrap();
                            for (i, c) in buf.chunks(BLOCK as usize).enumerate() {
                                let got = u64::from_le_bytes(c[8..16].try_into().unwrap());
                                assert_eq!(&c[..8], &(first + i as u64).to_le_bytes());
                                if got < floor[i] {
                                    old += 1;
                                    eprintln!(
                                        "pass {pass}: block {} read at version {got}, \
                                         {} was acknowledged before the read",
                                        first + i as u64,
                                        floor[i]
                                    );
                                }
                            }
                        }
                    }
                    old
                })
            })
            .collect();
        let old: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        stop.store(true, Relaxed);
        writer.join().unwrap();
        assert_eq!(old, 0, "blocks older than an acknowledged write");
        let s = ra.stats();
        assert!(s.used.load(Relaxed) > 0, "nothing was read ahead: {s:?}");
    }
}
