//! The MRU hotness window (SCE section 3.1): the most recently accessed fragments, each with
//! an access count. Population picks the hottest fragment in the window that is worth
//! populating. Touching a fragment is O(1): a small hash index plus an intrusive recency list.

use crate::addr::FragNo;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hasher for integer keys (fragment numbers are not attacker-chosen
/// in a way that matters: the window is tiny and bounded).
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ *b as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64)
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64)
    }
}

/// A `HashMap` keyed by small integers.
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

const NIL: u16 = u16::MAX;

#[derive(Clone, Copy, Debug)]
struct Entry {
    frag: FragNo,
    count: u32,
    /// Which 64ths of the fragment were touched since the count was last reset.
    mask: u64,
    prev: u16,
    next: u16,
}

/// The window of the `capacity` most recently used fragments.
#[derive(Debug)]
pub struct MruWindow {
    entries: Vec<Entry>,
    index: IntMap<u64, u16>,
    head: u16,
    tail: u16,
    capacity: usize,
}

impl MruWindow {
    /// A window of `capacity` fragments (1..=65534).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, NIL as usize - 1);
        let mut index = IntMap::default();
        index.reserve(capacity);
        MruWindow {
            entries: Vec::with_capacity(capacity),
            index,
            head: NIL,
            tail: NIL,
            capacity,
        }
    }

    /// Number of fragments in the window.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn unlink(&mut self, i: u16) {
        let Entry { prev, next, .. } = self.entries[i as usize];
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }

    fn push_front(&mut self, i: u16) {
        self.entries[i as usize].prev = NIL;
        self.entries[i as usize].next = self.head;
        if self.head != NIL {
            self.entries[self.head as usize].prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
    }

    /// Records an access to `f`: it becomes the most recent, and its count goes up.
    #[inline]
    pub fn touch(&mut self, f: FragNo) {
        self.touch_parts(f, u64::MAX);
    }

    /// Records an access to the 64ths of `f` set in `mask`.
    #[inline]
    pub fn touch_parts(&mut self, f: FragNo, mask: u64) {
        if let Some(&i) = self.index.get(&f.0) {
            let e = &mut self.entries[i as usize];
            e.count = e.count.saturating_add(1);
            e.mask |= mask;
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return;
        }
        let i = if self.entries.len() < self.capacity {
            self.entries.push(Entry {
                frag: f,
                count: 1,
                mask,
                prev: NIL,
                next: NIL,
            });
            (self.entries.len() - 1) as u16
        } else {
            let i = self.tail;
            self.unlink(i);
            self.index.remove(&self.entries[i as usize].frag.0);
            self.entries[i as usize].frag = f;
            self.entries[i as usize].count = 1;
            self.entries[i as usize].mask = mask;
            i
        };
        self.index.insert(f.0, i);
        self.push_front(i);
    }

    /// Access count of `f` while it is in the window.
    pub fn count(&self, f: FragNo) -> u32 {
        self.index
            .get(&f.0)
            .map_or(0, |&i| self.entries[i as usize].count)
    }

    /// Adds the 64ths in `mask` to what `f` touched, without counting an access (a request
    /// that continues a stream in a fragment counted already).
    pub fn add_parts(&mut self, f: FragNo, mask: u64) {
        if let Some(&i) = self.index.get(&f.0) {
            self.entries[i as usize].mask |= mask;
        }
    }

    /// Forgets the 64ths in `mask` of what `f` touched (they were filled); the count stays.
    pub fn clear_parts(&mut self, f: FragNo, mask: u64) {
        if let Some(&i) = self.index.get(&f.0) {
            self.entries[i as usize].mask &= !mask;
        }
    }

    /// The 64ths of `f` touched since its count was last reset (0 if not in the window).
    pub fn parts(&self, f: FragNo) -> u64 {
        self.index
            .get(&f.0)
            .map_or(0, |&i| self.entries[i as usize].mask)
    }

    /// Resets the count of `f` (after it was picked for population).
    pub fn reset(&mut self, f: FragNo) {
        if let Some(&i) = self.index.get(&f.0) {
            self.entries[i as usize].count = 0;
            self.entries[i as usize].mask = 0;
        }
    }

    /// The fragment with the highest count (ties go to the more recent) among those for which
    /// `eligible` is true and whose count is at least 1.
    pub fn hottest(&self, mut eligible: impl FnMut(FragNo) -> bool) -> Option<FragNo> {
        self.hottest_by(|f, _| eligible(f))
    }

    /// Like `hottest`, with `eligible` also given the fragment's count.
    pub fn hottest_by(&self, mut eligible: impl FnMut(FragNo, u32) -> bool) -> Option<FragNo> {
        let mut best: Option<(u32, FragNo)> = None;
        let mut i = self.head;
        while i != NIL {
            let e = self.entries[i as usize];
            if e.count > 0 && best.is_none_or(|(c, _)| e.count > c) && eligible(e.frag, e.count) {
                best = Some((e.count, e.frag));
            }
            i = e.next;
        }
        best.map(|(_, f)| f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_keeps_most_recent_and_counts() {
        let mut w = MruWindow::new(3);
        for f in [1, 2, 3, 1, 1, 4] {
            w.touch(FragNo(f));
        }
        // 2 was least recent when 4 arrived.
        assert_eq!(w.len(), 3);
        assert_eq!(w.count(FragNo(2)), 0);
        assert_eq!(w.count(FragNo(1)), 3);
        assert_eq!(w.hottest(|_| true), Some(FragNo(1)));
        assert_eq!(w.hottest(|f| f != FragNo(1)), Some(FragNo(4)));
        w.reset(FragNo(1));
        assert_eq!(w.hottest(|_| true), Some(FragNo(4)));
    }
}
