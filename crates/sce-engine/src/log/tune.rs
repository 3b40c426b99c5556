//! The cleaner as an operator steers it (issue 45; `sce_core::WritebackTuning`): when it
//! starts (the low watermark), when it is urgent (the high watermark), how fast it cleans
//! in the background (the rate), and each volume's share of a shared device's log.
//!
//! The rules. Background cleaning runs from the low watermark (or when idle, or for the
//! mirror area): 16 source writes in flight, a lower CPU priority, at most `rate` bytes a
//! second (a batch of at most a second's worth, then a pause that keeps the commit duties
//! and ends once cleaning turns urgent). Above the high watermark, or while writers wait for room or a drain runs, it is
//! urgent: 64 writes in flight, the clients' priority, no rate limit, so that the limit is
//! never why a write waits. On a device shared by several volumes, a volume that holds its
//! share of dirty data (its `cache_share`, or an equal part, of the log up to the high
//! watermark) takes no room the others are still owed: its writers wait while the rest of
//! the log is reserved for them, and go on while there is more.

use super::LogBack;
use super::St;
use sce_core::wbtune::{millionths, share_of as part};
use sce_core::WritebackTuning;
use sce_store::wblog::LogWriter;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// The settings, readable without a lock.
#[derive(Debug, Default)]
pub(super) struct Tuning {
    /// Watermarks in millionths of the ring.
    low: AtomicU64,
    high: AtomicU64,
    /// Bytes per second of background cleaning (0: no limit).
    rate: AtomicU64,
}

impl Tuning {
    pub(super) fn new(t: &WritebackTuning) -> Self {
        let x = Tuning::default();
        x.set(t);
        x
    }

    fn set(&self, t: &WritebackTuning) {
        self.low.store(millionths(t.low_watermark), Relaxed);
        self.high.store(millionths(t.high_watermark), Relaxed);
        self.rate.store(t.rate, Relaxed);
    }
}

impl LogBack {
    /// New watermarks and rate (`sce ctl set`, or a start): the cleaner looks at them on its
    /// next round.
    pub(crate) fn set_tuning(&self, t: &WritebackTuning) {
        self.tuning.set(t);
        self.cleaner_wanted();
    }

    /// Positions in use from which background cleaning starts: the low watermark's share
    /// of the most the log may hold (its region and every chunk of read slots it may lend),
    /// as dm-writecache's watermarks are of the whole cache. Dirty data stays until then,
    /// and absorbs rewrites: what a burst leaves is cleaned once it is over, or gently.
    pub(super) fn low_blocks(&self, _w: &LogWriter) -> u64 {
        part(self.region.lap(), self.tuning.low.load(Relaxed))
    }

    /// True if the ring is past its high watermark: less room left, in the most the log
    /// may hold (its region and every chunk of read slots it may lend), than the high
    /// watermark leaves. (It lends the next chunk at half of what it holds now: a burst
    /// grows it, cleaned gently in the background, until it nears the most.)
    pub(super) fn past_high(&self, w: &LogWriter) -> bool {
        let high = self.tuning.high.load(Relaxed);
        sce_core::wbtune::past_high(self.region.lap(), w.room(), high)
    }

    /// How long background cleaning pauses after a batch that cleaned `bytes` in
    /// `took`, to keep to the rate (zero without one).
    pub(super) fn rate_pause(&self, bytes: u64, took: Duration) -> Duration {
        match self.tuning.rate.load(Relaxed) {
            0 => Duration::ZERO,
            r => Duration::from_secs_f64(bytes as f64 / r as f64)
                .saturating_sub(took)
                .min(Duration::from_secs(3600)),
        }
    }

    /// The most pages a background batch takes: a second's worth at the rate (at least
    /// one), unlimited without a rate.
    pub(super) fn rate_pages(&self) -> usize {
        match self.tuning.rate.load(Relaxed) {
            0 => usize::MAX,
            r => (r / sce_core::PAGE_SIZE).max(1) as usize,
        }
    }

    /// The volumes' shares of the log, as weights (`cache_share`, or an equal part); once,
    /// at open.
    pub(crate) fn set_shares(&self, shares: &[Option<f64>]) {
        let n = shares.len().max(1) as f64;
        let s = shares
            .iter()
            .map(|x| (x.unwrap_or(1.0 / n).clamp(0.0, 1.0) * 1e6) as u64)
            .collect();
        let set = self.shares.set(s);
        debug_assert!(set.is_ok(), "the log's shares set twice");
    }

    /// True if the volume of global page `g`, on a device it shares, holds its share of
    /// dirty data and `n` more positions would take room the other volumes are still owed
    /// (their shares less what they hold): its writers wait, the others go on.
    pub(super) fn over_share(&self, st: &St, g: u64, n: u64) -> bool {
        if self.vols.len() < 2 {
            return false;
        }
        let share = |v: usize| self.share_blocks(v);
        let v = st.vol_of(g);
        if st.vol_dirty[v] < share(v) {
            return false;
        }
        let owed: u64 = (0..self.vols.len())
            .filter(|&u| u != v)
            .map(|u| share(u).saturating_sub(st.vol_dirty[u]))
            .sum();
        st.w.room() < owed + n + st.spare()
    }

    /// Positions of the log volume `v` may hold before it waits for the others' room: its
    /// share (`cache_share`, or an equal part) of the log up to the high watermark; the
    /// whole ring for a volume alone on its device (its writers wait only when it is full).
    fn share_blocks(&self, v: usize) -> u64 {
        if self.vols.len() < 2 {
            return self.region.lap();
        }
        let cap = part(self.region.lap(), self.tuning.high.load(Relaxed));
        let shares = self.shares.get().map_or(&[][..], Vec::as_slice);
        part(cap, shares.get(v).copied().unwrap_or(1_000_000)).max(1)
    }

    /// Bytes of dirty data the volume of global page `g` may hold before its writers wait
    /// for room the other volumes of its device are owed (`status`' "this export" line).
    pub(crate) fn share_bytes_of(&self, g: u64) -> u64 {
        let v = self.st.lock().vol_of(g);
        self.share_blocks(v) * sce_core::PAGE_SIZE
    }
}
