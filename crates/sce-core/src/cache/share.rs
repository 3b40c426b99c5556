//! Shares of a cache device that several volumes use: each volume is a range of the
//! core's fragments, and may be given a cap on the slots it holds (`cache_share`). A volume
//! at its cap takes its next slot from its own fragments (the eviction policy's victim
//! among them), so it can neither grow past its share nor push the others out; a volume
//! under its cap competes for free slots and victims like any fragment. Without caps (the
//! default, and with one volume) nothing changes.

use super::CacheCore;
use crate::addr::{FragNo, SlotNo};

/// The volumes' ranges and caps, and the slots each holds.
#[derive(Debug, Default)]
pub(super) struct Shares {
    /// First fragment of each volume, ascending (the first is 0).
    starts: Vec<u64>,
    /// The most slots each may hold (`u32::MAX`: no cap).
    caps: Vec<u32>,
    /// The slots each holds now.
    used: Vec<u32>,
    /// Ranges of fragments `[start, end)` of volumes whose export is detached: nothing is
    /// populated there (their source may be written behind the cache's back).
    disabled: Vec<(u64, u64)>,
}

impl Shares {
    /// True if some volume has a cap.
    pub(super) fn capped(&self) -> bool {
        self.caps.iter().any(|&c| c != u32::MAX)
    }

    /// The volume fragment `f` belongs to, if shares are set.
    fn part(&self, f: FragNo) -> Option<usize> {
        if self.caps.iter().all(|&c| c == u32::MAX) {
            return None;
        }
        Some(self.starts.partition_point(|&s| s <= f.0).saturating_sub(1))
    }
}

impl CacheCore {
    /// Sets the volumes (first fragment of each, ascending from 0) and the most slots each
    /// may hold (None: no cap), and counts what each holds now (after a restore too).
    pub fn set_shares(&mut self, volumes: &[(FragNo, Option<u32>)]) {
        let mut sh = Shares {
            starts: volumes.iter().map(|v| v.0 .0).collect(),
            caps: volumes.iter().map(|v| v.1.unwrap_or(u32::MAX)).collect(),
            used: vec![0; volumes.len()],
            disabled: std::mem::take(&mut self.shares.disabled),
        };
        if sh.starts.first() != Some(&0) {
            sh = Shares::default();
        }
        let slots = self.geo.slots();
        let mut shares = sh;
        for s in (0..slots).map(SlotNo) {
            if let Some(k) = self.slots.fragment(s).and_then(|f| shares.part(f)) {
                shares.used[k] += 1;
            }
        }
        self.shares = shares;
    }

    /// Stops (`on`) or resumes populating the fragments `[start, end)`: a volume whose
    /// export was detached from the cache.
    pub fn set_disabled(&mut self, start: FragNo, end: FragNo, on: bool) {
        let r = (start.0, end.0);
        self.shares.disabled.retain(|&x| x != r);
        if on && start.0 < end.0 {
            self.shares.disabled.push(r);
        }
    }

    /// True if fragment `f` lies in a range that must not be populated.
    pub(super) fn disabled(&self, f: FragNo) -> bool {
        self.shares
            .disabled
            .iter()
            .any(|&(a, b)| a <= f.0 && f.0 < b)
    }

    /// The slots each volume holds now (empty without shares).
    pub fn share_used(&self) -> Vec<u32> {
        if self.shares.part(FragNo(0)).is_none() {
            return Vec::new();
        }
        self.shares.used.clone()
    }

    /// Fragment `f` took (`true`) or gave back a slot.
    pub(super) fn share_count(&mut self, f: FragNo, took: bool) {
        if let Some(k) = self.shares.part(f) {
            let u = &mut self.shares.used[k];
            *u = if took { *u + 1 } else { u.saturating_sub(1) };
        }
    }

    /// The volume of `f`, if it is at its cap: a slot for `f` must come from its own.
    pub(super) fn at_cap(&self, f: FragNo) -> Option<usize> {
        let k = self.shares.part(f)?;
        (self.shares.used[k] >= self.shares.caps[k]).then_some(k)
    }

    /// The eviction policy's victim among the fragments of volume `k`.
    pub(super) fn victim_in(&mut self, k: usize) -> Option<SlotNo> {
        let (slots, shares) = (&self.slots, &self.shares);
        self.evict.victim(|s| {
            slots.pins(s) > 0 || slots.fragment(s).is_none_or(|f| shares.part(f) != Some(k))
        })
    }
}
