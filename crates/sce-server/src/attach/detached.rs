//! Writes served while an export is detached: counted, and their ranges kept (merged, at
//! most [`MAX_RANGES`]), so that an attach of the *same* device drops only what they changed
//! and keeps the rest of the cache warm. The device is recognised by its UUID and its
//! superblock's sequence number as the detach left them (every open writes the superblock
//! anew, so a device opened anywhere since, or another device, does not match): anything
//! else attaches as before (trusted only if nothing was written, else cold). Past the bound
//! of ranges, cold too.
//!
//! The ranges live in memory only. That is safe: the device stays marked detached on the
//! device itself until the attach has dropped the written ranges and made that durable
//! (`settle_detached`), and a start that finds the mark trusts nothing of it. A crash while
//! detached therefore costs the warm cache, never the data.

use sce_engine::order::{levels, OrderedMutex};
/// The ranges and the device are leaves of the lock order (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Ranges kept at most; one more and an attach starts cold.
pub(crate) const MAX_RANGES: usize = 4096;

/// Writes served while detached since the last attach.
pub(crate) struct DetachedWrites {
    count: AtomicU64,
    /// Sorted, disjoint, merged `(start, end)` byte ranges; None once over the bound.
    ranges: Mutex<Option<Vec<(u64, u64)>>>,
    /// The device the ranges are relative to, as the detach left it.
    device: Mutex<Option<DeviceMark>>,
}

/// A cache device as a detach left it: its path, UUID and superblock sequence number.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DeviceMark {
    path: PathBuf,
    uuid: [u8; 16],
    seq: u64,
}

impl DetachedWrites {
    /// None written yet.
    pub(crate) fn new() -> Self {
        DetachedWrites {
            count: AtomicU64::new(0),
            ranges: Mutex::new(Some(Vec::new())),
            device: Mutex::new(None),
        }
    }

    /// A write or discard of `[offset, offset + len)` is about to reach the source (counted
    /// before it is sent: an attach that sees the count unchanged knows no write it missed
    /// can land on the source later).
    pub(crate) fn note(&self, offset: u64, len: u64) {
        self.count.fetch_add(1, Relaxed);
        let mut g = self.ranges.lock();
        let Some(r) = g.as_mut() else {
            return;
        };
        let (mut a, mut b) = (offset, offset.saturating_add(len));
        // Every range that touches [a, b) merges into it.
        let lo = r.partition_point(|&(_, e)| e < a);
        let hi = r.partition_point(|&(s, _)| s <= b);
        if lo < hi {
            a = a.min(r[lo].0);
            b = b.max(r[hi - 1].1);
        }
        r.splice(lo..hi, [(a, b)]);
        if r.len() > MAX_RANGES {
            *g = None;
        }
    }

    /// Writes since the last reset.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The ranges written since the last reset, None if too many were.
    pub(crate) fn ranges(&self) -> Option<Vec<(u64, u64)>> {
        self.ranges.lock().clone()
    }

    /// Starts over (the cache is attached, or detached afresh): no range, no device.
    pub(crate) fn reset(&self) {
        *self.ranges.lock() = Some(Vec::new());
        *self.device.lock() = None;
        self.count.store(0, Relaxed);
    }

    /// The device the detach released (read after its close), which the ranges are for.
    pub(crate) fn set_device(&self, mark: Option<DeviceMark>) {
        *self.device.lock() = mark;
    }

    /// True if `mark` is the device the detach released, unchanged since.
    fn same_device(&self, mark: Option<&DeviceMark>) -> bool {
        mark.is_some() && self.device.lock().as_ref() == mark
    }
}

impl super::Attachable {
    /// Writes served while detached since the last attach.
    pub fn writes_while_detached(&self) -> u64 {
        self.detached.count()
    }

    /// The cache device at `path` as it is now: its UUID and superblock sequence (None if it
    /// cannot be read, or holds no sce cache).
    pub(super) fn device_mark(&self, path: &Path) -> Option<DeviceMark> {
        let read = |d: &dyn sce_io::BlockDevice| sce_store::read_superblock(d).ok();
        let sb = match self.cfg.devices.get(&path.to_string_lossy()) {
            Some(d) => read(&*d)?,
            None => {
                let opts = sce_io::FileOptions {
                    direct: self.cfg.direct,
                    create_size: None,
                    read_only: true,
                    lock: sce_io::LockMode::Shared,
                };
                read(&sce_io::FileDevice::open(path, &opts).ok()?)?
            }
        };
        Some(DeviceMark {
            path: path.to_path_buf(),
            uuid: sb.uuid,
            seq: sb.seq,
        })
    }

    /// Whether an attach of the device at `path` may open it warm, dropping only the ranges
    /// written since its detach (it is the device the detach released, unchanged, and the
    /// ranges are known); and whether it opens trusting its changed source identity (only
    /// then, and only if something was written).
    pub(super) fn warm_attach(&self, path: &Path) -> (bool, bool) {
        let warm = self.detached.ranges().is_some()
            && self.detached.same_device(self.device_mark(path).as_ref());
        (warm, warm && self.detached.count() > 0)
    }

    /// At an attach, under the gate, with volume `v` opened (warm: trusting the device, its
    /// "detached" mark kept; cold otherwise, after `written` writes): drops every page of the
    /// ranges written while detached or attaching, makes that durable, then clears the mark.
    /// The mark stays if anything of that failed (a start then trusts nothing of the
    /// device). Returns why the cache starts cold, if it does after all.
    pub(super) fn settle_detached(
        &self,
        v: &sce_engine::CacheVolume,
        warm: bool,
        written: u64,
    ) -> Option<String> {
        let (late, ranges) = (self.detached.count(), self.detached.ranges());
        let forget = |why: String| {
            let (_, errors) = v.forget();
            let tail = if errors > 0 {
                " (and its records could not be written)"
            } else {
                ""
            };
            (errors == 0, format!("{why}{tail}"))
        };
        if !warm {
            // Opened cold (its mark cleared with a new generation); writes while it opened
            // changed pages it may have restored since.
            if late == written {
                return None;
            }
            let w = "write(s) reached the source while the cache was detached or attaching";
            return Some(forget(format!("{late} {w}")).1);
        }
        let (durable, why) = match ranges.map(|r| self.drop_ranges(v, &r)) {
            Some(Ok(())) => (true, None),
            Some(Err(e)) => {
                let (ok, why) = forget(e);
                (ok, Some(why))
            }
            None => {
                let (ok, why) = forget(format!(
                    "{late} write(s) reached the source while the cache was detached or \
                     attaching, over more ranges than are kept"
                ));
                (ok, Some(why))
            }
        };
        if !durable {
            tracing::warn!(target: crate::LOG_TARGET, "attach: what was written while detached could not be dropped durably: the device keeps its detached mark, and a restart will start it cold");
        } else if let Err(e) = v.set_detached(0, false) {
            // The mark stays: a start trusts nothing of the device, which is safe.
            tracing::warn!(target: crate::LOG_TARGET, "attach: the cache device's detached mark could not be cleared ({e}): a restart will start it cold");
        }
        why
    }

    /// Drops the cached pages of `ranges` (widened to whole pages) and writes the records;
    /// why it could not, if it could not.
    fn drop_ranges(
        &self,
        v: &sce_engine::CacheVolume,
        ranges: &[(u64, u64)],
    ) -> Result<(), String> {
        let (page, size) = (sce_core::PAGE_SIZE, self.source.size());
        let mut dropped = 0;
        for &(a, b) in ranges {
            let (a, b) = (
                a / page * page,
                b.div_ceil(page).saturating_mul(page).min(size),
            );
            if a < b {
                dropped += v
                    .evict(a, b - a)
                    .map_err(|e| format!("dropping what was written while detached failed: {e}"))?;
            }
        }
        let errors = v.flush_metadata();
        if errors > 0 {
            return Err(format!(
                "{errors} metadata writes failed while dropping what was written while detached"
            ));
        }
        if !ranges.is_empty() {
            tracing::info!(target: crate::LOG_TARGET, ranges = ranges.len(), dropped_bytes = dropped, "attach: dropped what was written while the cache was detached; the rest stays warm");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_overflow_to_none() {
        let w = DetachedWrites::new();
        w.note(100, 10);
        w.note(0, 10);
        w.note(10, 5); // touches [0, 10): merges
        w.note(200, 50);
        w.note(90, 120); // bridges [100, 110) and [200, 250)
        assert_eq!(w.ranges(), Some(vec![(0, 15), (90, 250)]));
        assert_eq!(w.count(), 5);
        for i in 0..MAX_RANGES as u64 {
            w.note(1_000 + i * 10, 1);
        }
        assert_eq!(w.ranges(), None, "over the bound: cold");
        w.reset();
        assert_eq!((w.ranges(), w.count()), (Some(vec![]), 0));
    }
}
