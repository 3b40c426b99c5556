//! A host: its RAM cache above its flash cache.

use super::flash::{Down, Flash, ReferenceTiming};
use super::{RamPolicy, PAGE};
use crate::engine::{Device, DeviceModel, LatencyHistogram};
use crate::reference::BlockCache;

/// An LRU cache of 4 KiB pages in RAM with a write policy towards the flash cache below.
pub struct RamCache {
    pub(super) pages: BlockCache,
    pub(super) dirty: Vec<bool>,
    pub(super) policy: RamPolicy,
    pub(super) next_flush: Option<u64>,
    /// Read pages served from RAM.
    pub read_hits: u64,
    /// Pages written down to the flash cache.
    pub pages_written_down: u64,
}

impl RamCache {
    /// A RAM cache of `size` bytes (at least one page) with `policy`.
    pub fn new(size: u64, policy: RamPolicy) -> Self {
        let n = (size / PAGE).max(1) as usize;
        RamCache {
            pages: BlockCache::new(crate::ReferencePolicy::Lru, n),
            dirty: vec![false; n],
            policy,
            next_flush: None,
            read_hits: 0,
            pages_written_down: 0,
        }
    }

    /// A RAM cache with another replacement policy (LFU for the analytic model).
    pub fn with_policy(size: u64, policy: RamPolicy, repl: crate::ReferencePolicy) -> Self {
        let mut r = RamCache::new(size, policy);
        r.pages = BlockCache::new(repl, r.dirty.len());
        r
    }

    pub(super) fn write_down(&mut self, down: &mut Down, t: u64, first: u64, n: u64) {
        self.pages_written_down += n;
        down.write(t, first * PAGE, n * PAGE);
    }

    /// Inserts (or touches) page `b`; a modified page it evicts goes down first.
    pub(super) fn touch(&mut self, b: u64, t: u64, down: &mut Down) -> (bool, u32) {
        let a = self.pages.access_detailed(b);
        if let Some(old) = a.evicted {
            if std::mem::take(&mut self.dirty[a.slot as usize]) {
                self.write_down(down, t, old, 1);
            }
        }
        (a.hit, a.slot)
    }

    /// Runs the periodic flushes due by `t`.
    pub(super) fn advance(&mut self, t: u64, down: &mut Down) {
        let RamPolicy::Periodic(p) = self.policy else {
            return;
        };
        let next = *self.next_flush.get_or_insert(t.saturating_add(p));
        if next <= t {
            self.flush(next, down);
            let periods = (t - next) / p.max(1) + 1;
            self.next_flush = Some(next.saturating_add(periods.saturating_mul(p)));
        }
    }

    /// Writes every modified page down, in address order, coalesced into runs.
    pub(super) fn flush(&mut self, t: u64, down: &mut Down) {
        let mut blocks: Vec<u64> = Vec::new();
        for (b, slot) in self.pages.cached() {
            if std::mem::take(&mut self.dirty[slot as usize]) {
                blocks.push(b);
            }
        }
        blocks.sort_unstable();
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            self.write_down(down, t, blocks[i], (j - i) as u64);
            i = j;
        }
    }

    /// A write at `t`; returns when the application has it acknowledged: with `Sync`, when
    /// the flash layer acknowledges it; otherwise at once (in RAM).
    pub(super) fn write(&mut self, t: u64, offset: u64, len: u64, down: &mut Down) -> u64 {
        if len == 0 {
            return t;
        }
        let through = matches!(self.policy, RamPolicy::Sync | RamPolicy::Async);
        for b in offset / PAGE..=(offset + len - 1) / PAGE {
            let (_, slot) = self.touch(b, t, down);
            self.dirty[slot as usize] = !through;
        }
        if through {
            self.pages_written_down += (offset + len - 1) / PAGE - offset / PAGE + 1;
            let acked = down.write(t, offset, len);
            if self.policy == RamPolicy::Sync {
                return acked;
            }
        }
        t
    }

    pub(super) fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let dirty = &mut self.dirty;
        len > 0
            && self
                .pages
                .remove_range(offset / PAGE, (offset + len - 1) / PAGE + 1, |slot| {
                    dirty[slot as usize] = false
                })
    }
}

/// One host: an optional RAM cache above a flash cache.
pub struct Host {
    /// The RAM cache, if any.
    pub ram: Option<RamCache>,
    /// The flash cache.
    pub flash: Flash,
    pub(super) timing: Option<ReferenceTiming>,
    pub(super) read_pages: u64,
    pub(super) read_hits: u64,
    pub(super) ram_hits: u64,
    pub(super) flash_read_pages: u64,
    pub(super) flash_read_hits: u64,
    /// Read pages served from the source past the caches (their region owned by another
    /// host), counted in `read_pages` too.
    pub(super) read_pages_bypassed: u64,
}

impl Host {
    /// A host with a flash cache and, optionally, a RAM cache above it. A reference flash
    /// cache does no modelled I/O (its requests complete at once) unless
    /// [`Host::with_devices`] gives it devices.
    pub fn new(flash: Flash, ram: Option<RamCache>) -> Self {
        Host {
            ram,
            flash,
            timing: None,
            read_pages: 0,
            read_hits: 0,
            ram_hits: 0,
            flash_read_pages: 0,
            flash_read_hits: 0,
            read_pages_bypassed: 0,
        }
    }

    /// Models the I/O of a reference flash cache over these devices (an engine flash cache
    /// models its own, and is left as it is): hits are read from `ssd`, misses from
    /// `source` and then written to `ssd`, writes go to `source` and their blocks to `ssd`.
    /// Each host has its own devices, the source included, as each engine has.
    pub fn with_devices(mut self, ssd: DeviceModel, source: DeviceModel) -> Self {
        if matches!(self.flash, Flash::Reference(_)) {
            self.timing = Some(ReferenceTiming {
                ssd: Device::new(ssd),
                source: Device::new(source),
                read_latency: LatencyHistogram::new(),
                write_latency: LatencyHistogram::new(),
            });
        }
        self
    }

    /// A read at `t`; returns its completion.
    pub(super) fn read(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        let mut down = Down {
            flash: &mut self.flash,
            timing: self.timing.as_mut(),
        };
        match &mut self.ram {
            Some(ram) => {
                let h0 = ram.read_hits;
                let mut flash_pages = 0;
                let mut flash_hits = 0;
                let mut done = t;
                // Count what reaches the flash cache through a counting shim.
                let pages = {
                    let mut shim = |d: &mut Down, tt: u64, o: u64, l: u64| {
                        let (h, p, c) = d.read(tt, o, l);
                        flash_hits += h;
                        flash_pages += p;
                        done = done.max(c);
                    };
                    ram_read(ram, t, offset, len, &mut down, &mut shim)
                };
                let ram_hits = ram.read_hits - h0;
                self.ram_hits += ram_hits;
                self.flash_read_hits += flash_hits;
                self.flash_read_pages += flash_pages;
                self.read_pages += pages;
                self.read_hits += ram_hits + flash_hits;
                done
            }
            None => {
                let (h, p, done) = down.read(t, offset, len);
                self.read_pages += p;
                self.read_hits += h;
                self.flash_read_pages += p;
                self.flash_read_hits += h;
                done
            }
        }
    }

    /// A read at `t` past the caches, from the source (shared mode: another host owns the
    /// region): no hit, nothing filled, neither cache touched; returns its completion.
    pub(super) fn read_uncached(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        if len == 0 {
            return t;
        }
        let pages = (offset + len - 1) / PAGE - offset / PAGE + 1;
        self.read_pages += pages;
        self.read_pages_bypassed += pages;
        match (&mut self.flash, &mut self.timing) {
            (Flash::Engine(e), _) => e.read_uncached(t, offset, len),
            (Flash::Reference(_), Some(tm)) => {
                let done = tm.source.io(t, len, false);
                tm.read_latency.record(done - t);
                done
            }
            (Flash::Reference(_), None) => t,
        }
    }

    /// A write at `t`; returns when it is acknowledged.
    pub(super) fn write(&mut self, t: u64, offset: u64, len: u64) -> u64 {
        let mut down = Down {
            flash: &mut self.flash,
            timing: self.timing.as_mut(),
        };
        match &mut self.ram {
            Some(ram) => ram.write(t, offset, len, &mut down),
            None => down.write(t, offset, len),
        }
    }

    /// Runs the periodic RAM flushes due by `t`.
    pub(super) fn advance_ram(&mut self, t: u64) {
        if let Some(ram) = &mut self.ram {
            let mut down = Down {
                flash: &mut self.flash,
                timing: self.timing.as_mut(),
            };
            ram.advance(t, &mut down);
        }
    }

    /// Writes down what the RAM cache holds modified (none with a write-through policy).
    pub(super) fn flush_ram(&mut self, t: u64) {
        if let Some(ram) = &mut self.ram {
            if ram.policy != RamPolicy::Sync && ram.policy != RamPolicy::Async {
                let mut down = Down {
                    flash: &mut self.flash,
                    timing: self.timing.as_mut(),
                };
                ram.flush(t, &mut down);
            }
        }
    }

    pub(super) fn invalidate(&mut self, offset: u64, len: u64) -> bool {
        let ram = self.ram.as_mut().is_some_and(|r| r.invalidate(offset, len));
        let flash = self.flash.invalidate(offset, len);
        ram || flash
    }
}

/// A RAM-cache read that reports flash reads through `to_flash` (so the host can count
/// them); returns the pages read.
pub(super) fn ram_read(
    ram: &mut RamCache,
    t: u64,
    offset: u64,
    len: u64,
    down: &mut Down,
    to_flash: &mut dyn FnMut(&mut Down, u64, u64, u64),
) -> u64 {
    if len == 0 {
        return 0;
    }
    let mut pages = 0;
    let mut run: Option<(u64, u64)> = None;
    for b in offset / PAGE..=(offset + len - 1) / PAGE {
        pages += 1;
        let (hit, _) = ram.touch(b, t, down);
        if hit {
            ram.read_hits += 1;
            if let Some((first, n)) = run.take() {
                to_flash(down, t, first * PAGE, n * PAGE);
            }
        } else {
            run = match run {
                Some((first, n)) => Some((first, n + 1)),
                None => Some((b, 1)),
            };
        }
    }
    if let Some((first, n)) = run.take() {
        to_flash(down, t, first * PAGE, n * PAGE);
    }
    pages
}
