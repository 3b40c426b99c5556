//! The parts of flash-conscious admission that sit beside the MRU window (issue 11):
//!
//! * [`FreqSketch`]: a count-min sketch of fragment heat with periodic halving (TinyLFU's
//!   frequency histogram). It keeps a fragment's heat after the fragment leaves the window
//!   or the cache, so that the admission duel can compare a candidate with the fragment it
//!   would evict, and so that a fragment evicted a moment ago is not a stranger.
//! * [`Streams`]: a detector of sequential streams (several at once, per volume), in the
//!   manner of bcache's `sequential_cutoff` and Mercury's sequential bypass: a request that
//!   continues a stream in the fragment the stream touched last is not a new touch, and once
//!   a stream's run reaches the cutoff its requests neither raise heat nor get admitted.
//! * [`PopBudget`]: a token bucket of population bytes per second. With a fixed rate it is a
//!   plain limit; by default it adapts: it is quartered each second while the cache is full
//!   and the read hit ratio no longer improves, and doubles while it does; when it falls, as
//!   it does when the workload shifts, it returns to the ceiling at once.
//! * [`Endurance`]: an optional cap on all bytes written to the cache device, in bytes per
//!   day: the writes of any 24 hours (in hour buckets) stay within the budget.
//!
//! None of them reads a clock: the times come from the driver through `pick_population`.

use crate::addr::Nanos;

/// A count-min sketch of 4 rows of 8-bit counters (saturating at 255), halved every
/// `sample` increments.
#[derive(Debug)]
pub struct FreqSketch {
    rows: [Box<[u8]>; 4],
    mask: u64,
    added: u64,
    sample: u64,
}

impl FreqSketch {
    /// A sketch sized for about `items` distinct hot keys: `4 * items` counters per row
    /// (a power of two, from 1024 to 1 Mi), halved every `10 * items` increments.
    pub fn new(items: usize) -> Self {
        let width = (items.saturating_mul(4))
            .clamp(1024, 1 << 20)
            .next_power_of_two();
        let row = || vec![0u8; width].into_boxed_slice();
        FreqSketch {
            rows: [row(), row(), row(), row()],
            mask: width as u64 - 1,
            added: 0,
            sample: (items as u64).max(256) * 10,
        }
    }

    #[inline]
    fn index(&self, key: u64, row: usize) -> usize {
        const SEEDS: [u64; 4] = [
            0x9E37_79B9_7F4A_7C15,
            0xC2B2_AE3D_27D4_EB4F,
            0x1656_67B1_9E37_79F9,
            0x27D4_EB2F_1656_67C5,
        ];
        let h = (key ^ (row as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)).wrapping_mul(SEEDS[row]);
        ((h ^ (h >> 29)) & self.mask) as usize
    }

    /// Estimated touches of `key` (within the halving horizon).
    pub fn estimate(&self, key: u64) -> u32 {
        (0..4)
            .map(|r| self.rows[r][self.index(key, r)] as u32)
            .min()
            .unwrap_or(0)
    }

    /// Counts one touch of `key` (conservative update: only the smallest counters grow).
    pub fn add(&mut self, key: u64) {
        let idx: [usize; 4] = std::array::from_fn(|r| self.index(key, r));
        let min = (0..4).map(|r| self.rows[r][idx[r]]).min().unwrap_or(0);
        if min < u8::MAX {
            for (row, &i) in self.rows.iter_mut().zip(&idx) {
                if row[i] == min {
                    row[i] = min + 1;
                }
            }
        }
        self.added += 1;
        if self.added >= self.sample {
            self.age();
        }
    }

    /// Halves every counter (TinyLFU's reset), so that heat fades.
    pub fn age(&mut self) {
        for row in &mut self.rows {
            for c in row.iter_mut() {
                *c >>= 1;
            }
        }
        self.added /= 2;
    }

    /// Bytes of counters.
    pub fn memory_bytes(&self) -> usize {
        self.rows.iter().map(|r| r.len()).sum()
    }
}

/// A frequency sketch allocated at its first count: a cache that reads nothing (and
/// `sce footprint`, which measures a cache at open) holds none of it.
#[derive(Debug)]
pub struct LazySketch {
    items: usize,
    sketch: Option<FreqSketch>,
}

impl LazySketch {
    /// A sketch for about `items` keys (see [`FreqSketch::new`]), not allocated yet.
    pub fn new(items: usize) -> LazySketch {
        LazySketch {
            items,
            sketch: None,
        }
    }

    /// Estimated touches of `key` (0 before the first count).
    pub fn estimate(&self, key: u64) -> u32 {
        self.sketch.as_ref().map_or(0, |s| s.estimate(key))
    }

    /// Counts one touch of `key`, allocating the sketch at the first.
    pub fn add(&mut self, key: u64) {
        let items = self.items;
        self.sketch
            .get_or_insert_with(|| FreqSketch::new(items))
            .add(key);
    }

    /// Bytes of counters (0 before the first count).
    pub fn memory_bytes(&self) -> usize {
        self.sketch.as_ref().map_or(0, |s| s.memory_bytes())
    }
}

/// What the stream detector says about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StreamVerdict {
    /// The request belongs to a stream whose run (this request included) has reached the
    /// cutoff: it raises no heat and is not admitted.
    pub sequential: bool,
    /// The request continues a stream in the fragment the stream touched last: that
    /// fragment has been counted already.
    pub same_fragment: bool,
}

#[derive(Clone, Copy, Debug)]
struct Stream {
    next: u64,
    run: u64,
    last_frag: u64,
    used: u64,
}

/// Up to `N` concurrent sequential streams, least recently used replaced.
#[derive(Debug)]
pub struct Streams {
    streams: Vec<Stream>,
    cutoff: u64,
    tick: u64,
    shift: u32,
}

impl Streams {
    /// Streams tracked at once.
    pub const N: usize = 16;
    /// A gap up to this many bytes ahead of a stream's end still continues it (read-ahead
    /// windows, skipped blocks of a file, and a request of the stream that another thread
    /// planned first). A request behind the end is never a continuation: re-reading a block
    /// is a re-reference.
    pub const GAP: u64 = 256 << 10;

    /// A detector whose runs count as sequential from `cutoff` bytes (0: never), over
    /// fragments of `1 << fragment_shift` bytes.
    pub fn new(cutoff: u64, fragment_shift: u32) -> Self {
        Streams {
            streams: Vec::with_capacity(Self::N),
            cutoff,
            tick: 0,
            shift: fragment_shift,
        }
    }

    /// Classifies a request of `len` bytes at `offset` and updates the streams.
    pub fn observe(&mut self, offset: u64, len: u64) -> StreamVerdict {
        self.tick += 1;
        let first_frag = offset >> self.shift;
        let last_frag = (offset + len.max(1) - 1) >> self.shift;
        let end = offset + len;
        let found = self
            .streams
            .iter_mut()
            .find(|s| offset >= s.next && offset - s.next <= Self::GAP);
        let (run, same) = match found {
            Some(s) => {
                let same = first_frag == s.last_frag && last_frag == s.last_frag;
                s.run = s.run.saturating_add(len);
                s.next = end;
                s.last_frag = last_frag;
                s.used = self.tick;
                (s.run, same)
            }
            None => {
                let st = Stream {
                    next: end,
                    run: len,
                    last_frag,
                    used: self.tick,
                };
                if self.streams.len() < Self::N {
                    self.streams.push(st);
                } else if let Some(old) = self.streams.iter_mut().min_by_key(|s| s.used) {
                    *old = st;
                }
                (len, false)
            }
        };
        StreamVerdict {
            sequential: self.cutoff > 0 && run >= self.cutoff,
            same_fragment: same,
        }
    }
}

/// Population bytes per second: fixed, or adaptive between a floor and a ceiling.
#[derive(Debug)]
pub struct PopBudget {
    rate: f64,
    min_rate: f64,
    max_rate: f64,
    adaptive: bool,
    tokens: f64,
    last: Option<Nanos>,
    epoch_start: Option<Nanos>,
    epoch_ns: u64,
    epoch_pages: (u64, u64),
    prev_ratio: Option<f64>,
    /// The last epoch's read hit ratio rose or fell beyond its noise.
    moving: bool,
}

impl PopBudget {
    /// Fewest read pages an epoch needs before its hit ratio is compared.
    const MIN_EPOCH_PAGES: u64 = 256;

    /// A budget of `rate` bytes/s (0: unlimited) or, if `adaptive`, between `min_rate` and
    /// `rate`, re-decided every `epoch_ns`.
    pub fn new(rate: u64, min_rate: u64, adaptive: bool, epoch_ns: u64) -> Self {
        PopBudget {
            rate: rate as f64,
            min_rate: (min_rate.min(rate)) as f64,
            max_rate: rate as f64,
            adaptive,
            tokens: 0.0,
            last: None,
            epoch_start: None,
            epoch_ns: epoch_ns.max(1),
            epoch_pages: (0, 0),
            prev_ratio: None,
            moving: false,
        }
    }

    /// The current rate in bytes per second (0: unlimited).
    pub fn rate(&self) -> u64 {
        self.rate as u64
    }

    /// True if the last epoch's read hit ratio rose or fell beyond its noise (a fixed rate
    /// never says so): population is winning hits back, or has hits to win.
    pub fn moving(&self) -> bool {
        self.moving
    }

    /// Counts read pages for the adaptive epoch.
    pub fn record_reads(&mut self, hits: u64, misses: u64) {
        self.epoch_pages.0 += hits;
        self.epoch_pages.1 += misses;
    }

    /// Advances to `now`: refills tokens (at most one second's worth, and at least enough
    /// for one `unit`) and, when an epoch ends, adapts the rate. `full` says whether the
    /// cache has no free slot (the rate adapts only then; with free space it is the ceiling).
    pub fn advance(&mut self, now: Nanos, full: bool, unit: u64) {
        if self.max_rate == 0.0 {
            return;
        }
        let last = *self.last.get_or_insert(now);
        let dt = now.0.saturating_sub(last.0) as f64 / 1e9;
        self.last = Some(now);
        let cap = self.rate.max(unit as f64);
        self.tokens = (self.tokens + dt * self.rate).min(cap);
        if !self.adaptive {
            return;
        }
        let start = *self.epoch_start.get_or_insert(now);
        if now.0.saturating_sub(start.0) < self.epoch_ns {
            return;
        }
        let (h, m) = self.epoch_pages;
        if h + m < Self::MIN_EPOCH_PAGES {
            return; // too few reads to judge: the epoch goes on
        }
        let ratio = h as f64 / (h + m) as f64;
        self.epoch_start = Some(now);
        self.epoch_pages = (0, 0);
        // A change counts only beyond the noise of two epochs' binomial estimates.
        let (up, down) = match self.prev_ratio {
            Some(prev) => {
                let noise = 2.0 * (2.0 * ratio * (1.0 - ratio) / (h + m) as f64).sqrt();
                (
                    ratio > prev + noise.max(0.01),
                    ratio < prev - noise.max(0.02),
                )
            }
            None => (false, false),
        };
        self.moving = up || down;
        // A fall is a new working set: the hits lost are what population can win back,
        // and doubling from the floor took seconds of misses to get there (a 200 MiB shift
        // on the server: 3-5 lines a second for the first five).
        self.rate = if !full || down {
            self.max_rate
        } else if up {
            (self.rate * 2.0).min(self.max_rate)
        } else if self.prev_ratio.is_some() {
            (self.rate / 4.0).max(self.min_rate)
        } else {
            self.rate
        };
        self.prev_ratio = Some(ratio);
    }

    /// True if a population of `bytes` may start now; takes the bytes if so. The bucket may
    /// go into debt by one population, so that a rate below one fragment per second still
    /// lets whole fragments through.
    pub fn take(&mut self, bytes: u64) -> bool {
        if self.max_rate == 0.0 {
            return true;
        }
        if self.tokens < 0.0 {
            return false;
        }
        self.tokens -= bytes as f64;
        true
    }

    /// True if the bucket is in debt (no population may start).
    pub fn exhausted(&self) -> bool {
        self.max_rate != 0.0 && self.tokens < 0.0
    }
}

/// A cap on the bytes written to the cache device: at most `per_day` bytes in any 24 hours.
/// Writes are counted in hour buckets, and the window is the current hour and the 24 before
/// it, so that it covers every 24-hour span that ends now (it is conservative by up to an
/// hour). Unused allowance does not carry over.
#[derive(Debug)]
pub struct Endurance {
    per_day: u64,
    start: Option<Nanos>,
    hour: u64,
    hours: [u64; Self::BUCKETS],
    written: u64,
}

impl Endurance {
    const HOUR_NS: u64 = 3_600_000_000_000;
    const BUCKETS: usize = 25;

    /// A cap of `per_day` bytes per day.
    pub fn new(per_day: u64) -> Self {
        Endurance {
            per_day,
            start: None,
            hour: 0,
            hours: [0; Self::BUCKETS],
            written: 0,
        }
    }

    /// Notes the time: hours that have passed leave the window.
    pub fn advance(&mut self, now: Nanos) {
        let start = *self.start.get_or_insert(now);
        let h = now.0.saturating_sub(start.0) / Self::HOUR_NS;
        if h <= self.hour {
            return;
        }
        if h - self.hour >= Self::BUCKETS as u64 {
            self.hours = [0; Self::BUCKETS];
        } else {
            for k in self.hour + 1..=h {
                self.hours[(k % Self::BUCKETS as u64) as usize] = 0;
            }
        }
        self.hour = h;
    }

    /// Bytes written in the window (this hour and the 24 before it).
    pub fn in_window(&self) -> u64 {
        self.hours.iter().sum()
    }

    /// True if `bytes` more may be written now.
    pub fn allows(&self, bytes: u64) -> bool {
        self.in_window().saturating_add(bytes) <= self.per_day
    }

    /// True if `bytes` more may be written; counts them if so.
    pub fn take(&mut self, bytes: u64) -> bool {
        if !self.allows(bytes) {
            return false;
        }
        self.hours[(self.hour % Self::BUCKETS as u64) as usize] += bytes;
        self.written += bytes;
        true
    }

    /// Bytes written (counted) so far.
    pub fn written(&self) -> u64 {
        self.written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sketch_counts_and_ages() {
        let mut s = FreqSketch::new(1000);
        for _ in 0..5 {
            s.add(42);
        }
        s.add(7);
        assert_eq!(s.estimate(42), 5);
        assert_eq!(s.estimate(7), 1);
        assert_eq!(s.estimate(9), 0);
        s.age();
        assert_eq!((s.estimate(42), s.estimate(7)), (2, 0));
        // Many other keys never make a cold key look hot by much (count-min overestimates
        // only through collisions, rare at this load).
        for k in 1000..3000 {
            s.add(k);
        }
        assert!(s.estimate(9) <= 1);
    }

    #[test]
    fn streams_find_runs_and_repeats_in_a_fragment() {
        let mut st = Streams::new(1 << 20, 20);
        // A 4 KiB sweep: the first request of a fragment is a touch, the rest are not.
        let v0 = st.observe(0, 4096);
        assert_eq!(v0, StreamVerdict::default());
        let v1 = st.observe(4096, 4096);
        assert!(v1.same_fragment && !v1.sequential);
        let mut v = v1;
        for i in 2..256 {
            v = st.observe(i * 4096, 4096);
        }
        assert!(v.sequential, "1 MiB of run reaches the cutoff");
        let next = st.observe(1 << 20, 4096);
        assert!(next.sequential && !next.same_fragment);
        // A random request elsewhere is not sequential; an interleaved second stream is
        // tracked independently.
        assert!(!st.observe(1 << 30, 8192).sequential);
        assert!(st.observe((1 << 20) + 4096, 4096).sequential);
        // One request at the cutoff is sequential by itself; cutoff 0 disables.
        assert!(st.observe(5 << 30, 1 << 20).sequential);
        let mut off = Streams::new(0, 20);
        assert!(!off.observe(0, 64 << 20).sequential);
    }

    #[test]
    fn budget_limits_and_adapts() {
        let sec = 1_000_000_000;
        let mut b = PopBudget::new(4 << 20, 1 << 20, false, sec);
        b.advance(Nanos(0), false, 1 << 20);
        assert!(b.take(1 << 20), "debt of one population");
        assert!(!b.take(1 << 20));
        b.advance(Nanos(sec), false, 1 << 20);
        // 4 MiB refilled, 1 MiB of debt: three fragments, then a fourth into debt.
        let n = (0..10).take_while(|_| b.take(1 << 20)).count();
        assert_eq!(n, 4);
        // Adaptive: a full cache with a flat hit ratio quarters the rate each epoch, to the floor.
        let mut a = PopBudget::new(64 << 20, 1 << 20, true, sec);
        for e in 0..12u64 {
            a.record_reads(500, 500);
            a.advance(Nanos(e * sec), true, 1 << 20);
        }
        assert_eq!(a.rate(), 1 << 20);
        assert!(!a.moving(), "a flat hit ratio");
        // The hit ratio rises: the rate doubles, and the workers keep the fast period.
        a.record_reads(600, 400);
        a.advance(Nanos(13 * sec), true, 1 << 20);
        assert_eq!(a.rate(), 2 << 20);
        assert!(a.moving());
        // It falls (a new working set): the ceiling at once.
        a.record_reads(100, 900);
        a.advance(Nanos(14 * sec), true, 1 << 20);
        assert_eq!(a.rate(), 64 << 20);
        assert!(a.moving());
        // Free space: the ceiling.
        for e in 15..20u64 {
            a.record_reads(100, 900);
            a.advance(Nanos(e * sec), true, 1 << 20);
        }
        assert_eq!(a.rate(), 1 << 20);
        a.record_reads(100, 900);
        a.advance(Nanos(20 * sec), false, 1 << 20);
        assert_eq!(a.rate(), 64 << 20);
    }

    #[test]
    fn endurance_counts_a_sliding_day() {
        let hour = 3_600_000_000_000u64;
        let mut e = Endurance::new(1000);
        e.advance(Nanos(5));
        assert!(e.take(600));
        assert!(!e.take(401));
        assert!(e.take(400));
        // 24 hours later the first hour is still in the window; at 25 it leaves it.
        e.advance(Nanos(5 + 24 * hour));
        assert!(!e.take(1));
        e.advance(Nanos(5 + 25 * hour));
        assert!(e.take(1000));
        assert!(!e.take(1));
        // A long idle time does not bank allowance.
        e.advance(Nanos(5 + 24 * 10 * hour));
        assert!(e.take(1000));
        assert!(!e.take(1));
        assert_eq!(e.written(), 3000);
    }
}
