//! The page area: single 4 KiB pages of sparse lines, packed into slots of their own (issue 47).
//!
//! A line slot holds one line, so a line with two hot pages costs a whole slot of cache
//! space, and filling it costs a whole line of flash writes. The page area holds such pages
//! one at a time: a *packed* slot is cut into sets of [`WAYS`] pages, and a source page can
//! live only in the set its page number hashes to (set-associative, as flashcache is, so
//! that a lookup scans one set and needs no index). Per cached page it keeps 6 bytes: the
//! page number (40 bits: sources up to 4 PiB) and a state byte.
//!
//! # Growing without moving data
//! The number of sets changes with the number of packed slots, one slot of sets at a time
//! (linear hashing): with `2^b <= n < 2^(b+1)` sets, a page's *primary* set is its hash
//! modulo `2^(b+1)`, or modulo `2^b` if that set does not exist yet; it is filled there.
//! A set `a` was split off its *parent*, `a` with its highest bit cleared, and every set
//! a page was ever filled in is its hash modulo some power of two: a parent, grandparent
//! and so on of its primary. Lookups walk that chain (one set per doubling, down to the
//! first slot's), so a split moves no data and drops nothing; a page left in an ancestor
//! stays until CLOCK evicts it there. Shrinking drops the pages of the last slot's sets.
//!
//! # Ways and their states
//! A way is empty, *valid* (its page may be read), *filling* (a fill of its page is in
//! flight: it becomes valid when the fill completes, unless *spoiled* meanwhile by a write
//! or a drop), or *draining* (dropped while its slot was pinned: a read planned before the
//! drop may still be reading it, so it is not reused until the slot has no pin). A way is
//! rewritten only when it is empty, or draining or valid with its slot unpinned: pins are
//! taken only under the core's lock, so no read can be in flight on it then; and a filling
//! way is never reused before its fill completes, so at most one device write per way is
//! ever in flight.

use crate::addr::SlotNo;

/// Pages per set.
pub const WAYS: u32 = 16;

const OCC: u8 = 1;
const VALID: u8 = 2;
const FILLING: u8 = 4;
const SPOILED: u8 = 8;
const DRAIN: u8 = 16;
const REF_SHIFT: u8 = 5;
const REF_MAX: u8 = 3;
const REF_MASK: u8 = REF_MAX << REF_SHIFT;

/// Largest page number the area can hold (40 bits).
pub const MAX_PAGE: u64 = (1 << 40) - 1;

/// What [`PageArea::drop_page`] found.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// The page was not in the area.
    Absent,
    /// A valid copy was dropped.
    Valid,
    /// A fill in flight was spoiled.
    Filling,
}

/// Where a way is on the cache device: its slot and the page within the slot.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WayAt {
    /// The packed slot.
    pub slot: SlotNo,
    /// The page within the slot.
    pub page: u32,
}

/// The page area of one core.
#[derive(Debug)]
pub struct PageArea {
    /// Sets per packed slot (pages per slot / WAYS).
    per_slot: u32,
    /// The packed slots, in set order: slot `i` holds sets `[i * per_slot, (i+1) * per_slot)`.
    slots: Vec<SlotNo>,
    /// Per way: the page number's low 32 bits.
    lo: Vec<u32>,
    /// Per way: the page number's bits 32..40 (low byte) and the state (high byte).
    hi: Vec<u16>,
    /// Per set: its CLOCK hand.
    hands: Vec<u8>,
    /// `b`: `2^b <= sets < 2^(b+1)` (0 while empty).
    level: u32,
    valid: u64,
}

/// A bijective mix of the page number, so that strided pages spread over the sets.
#[inline]
fn mix(page: u64) -> u64 {
    let mut h = page.wrapping_add(0x9E37_79B9_7F4A_7C15);
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

impl PageArea {
    /// An empty area for slots of `pages_per_slot` pages (a multiple of [`WAYS`]).
    pub fn new(pages_per_slot: u32) -> PageArea {
        debug_assert!(pages_per_slot >= WAYS && pages_per_slot.is_power_of_two());
        PageArea {
            per_slot: pages_per_slot / WAYS,
            slots: Vec::new(),
            lo: Vec::new(),
            hi: Vec::new(),
            hands: Vec::new(),
            level: 0,
            valid: 0,
        }
    }

    /// Packed slots.
    pub fn slots(&self) -> &[SlotNo] {
        &self.slots
    }

    /// Valid pages held.
    pub fn valid_pages(&self) -> u64 {
        self.valid
    }

    /// Pages the area can hold.
    pub fn capacity(&self) -> u64 {
        self.lo.len() as u64
    }

    /// Bytes of memory per way (the page number and the state) and per set (the hand).
    pub fn memory_bytes(&self) -> usize {
        self.lo.capacity() * 4
            + self.hi.capacity() * 2
            + self.hands.capacity()
            + self.slots.capacity() * 4
    }

    fn sets(&self) -> u64 {
        self.hands.len() as u64
    }

    #[inline]
    fn state(&self, w: usize) -> u8 {
        (self.hi[w] >> 8) as u8
    }

    #[inline]
    fn page_of(&self, w: usize) -> u64 {
        ((self.hi[w] as u64 & 0xff) << 32) | self.lo[w] as u64
    }

    #[inline]
    fn set_state(&mut self, w: usize, st: u8) {
        self.hi[w] = (self.hi[w] & 0xff) | ((st as u16) << 8);
    }

    fn put(&mut self, w: usize, page: u64, st: u8) {
        self.lo[w] = page as u32;
        self.hi[w] = ((page >> 32) as u16 & 0xff) | ((st as u16) << 8);
    }

    /// The page's first set.
    fn addr(&self, page: u64) -> u64 {
        self.addr_of(mix(page))
    }

    /// The page's second set (another mix of its number): a page is filled in whichever of
    /// its two sets has room.
    fn addr2(&self, page: u64) -> u64 {
        self.addr_of(mix(page ^ 0x5851_F42D_4C95_7F2D))
    }

    /// The set of hash `h` by linear hashing: `h` modulo twice the level's sets if that set
    /// exists, else modulo the level's.
    fn addr_of(&self, h: u64) -> u64 {
        let a = h & ((2u64 << self.level) - 1);
        if a < self.sets() {
            a
        } else {
            h & ((1u64 << self.level) - 1)
        }
    }

    /// The set `set` was split off (its highest bit cleared), None for the first slot's.
    #[inline]
    fn parent(&self, set: u64) -> Option<u64> {
        (set >= self.per_slot as u64).then(|| set & !(1u64 << (63 - set.leading_zeros())))
    }

    fn find_in(&self, set: u64, page: u64) -> Option<usize> {
        let w0 = (set * WAYS as u64) as usize;
        (w0..w0 + WAYS as usize).find(|&w| self.state(w) & OCC != 0 && self.page_of(w) == page)
    }

    /// The way holding `page` (valid or filling), if any.
    pub fn find(&self, page: u64) -> Option<usize> {
        if self.hands.is_empty() || page > MAX_PAGE {
            return None;
        }
        let (a, b) = self.choices(page);
        self.find_from(a, page)
            .or_else(|| b.and_then(|b| self.find_from(b, page)))
    }

    /// The page's sets: the first, and the second unless it is the same.
    fn choices(&self, page: u64) -> (u64, Option<u64>) {
        let (a, b) = (self.addr(page), self.addr2(page));
        (a, (b != a).then_some(b))
    }

    /// The way holding `page` in `set` or the sets it was split off.
    fn find_from(&self, mut set: u64, page: u64) -> Option<usize> {
        loop {
            if let Some(w) = self.find_in(set, page) {
                return Some(w);
            }
            set = self.parent(set)?;
        }
    }

    /// Where `page` can be read from, if a valid copy is held.
    #[inline]
    pub fn lookup(&self, page: u64) -> Option<WayAt> {
        let w = self.find(page)?;
        (self.state(w) & VALID != 0).then(|| self.at(w))
    }

    /// True if `page` has a fill in flight.
    pub fn filling(&self, page: u64) -> bool {
        self.find(page)
            .is_some_and(|w| self.state(w) & FILLING != 0)
    }

    /// Where way `w` is on the cache device.
    pub fn at(&self, w: usize) -> WayAt {
        let per = (self.per_slot * WAYS) as usize;
        WayAt {
            slot: self.slots[w / per],
            page: (w % per) as u32,
        }
    }

    /// Counts a hit on `page` for CLOCK.
    pub fn touch(&mut self, page: u64) {
        if let Some(w) = self.find(page) {
            let st = self.state(w);
            if st & VALID != 0 {
                let r = ((st & REF_MASK) >> REF_SHIFT)
                    .saturating_add(1)
                    .min(REF_MAX);
                self.set_state(w, (st & !REF_MASK) | (r << REF_SHIFT));
            }
        }
    }

    /// The way `page` would take in one of its two sets: an empty way, else (if `pinned`
    /// says the set's slot has no pin) a draining way, else CLOCK's victim among the valid
    /// ways of the first set whose slot has no pin (its page is returned, for an admission
    /// duel). None if no set has an empty way and every unpinned one is filling. Advances
    /// that set's hand.
    pub fn victim(
        &mut self,
        page: u64,
        pinned: impl Fn(SlotNo) -> bool,
    ) -> Option<(usize, Option<u64>)> {
        if self.hands.is_empty() || page > MAX_PAGE {
            return None;
        }
        let (a, b) = self.choices(page);
        let sets = [Some(a), b];
        for set in sets.into_iter().flatten() {
            if let Some(w) = Self::ways(set).find(|&w| self.state(w) == 0) {
                return Some((w, None));
            }
        }
        let open = sets.map(|s| s.filter(|&set| !pinned(self.at(Self::ways(set).start).slot)));
        for set in open.into_iter().flatten() {
            if let Some(w) = Self::ways(set).find(|&w| self.state(w) & DRAIN != 0) {
                return Some((w, None));
            }
        }
        open.into_iter().flatten().find_map(|set| self.clock(set))
    }

    /// The ways of set `set`.
    fn ways(set: u64) -> std::ops::Range<usize> {
        let w0 = (set * WAYS as u64) as usize;
        w0..w0 + WAYS as usize
    }

    /// CLOCK's victim among the valid ways of `set` (aging the ones it passes), with its
    /// page; None if every way is filling.
    fn clock(&mut self, set: u64) -> Option<(usize, Option<u64>)> {
        let w0 = Self::ways(set).start;
        let hand = &mut self.hands[set as usize];
        // Two sweeps with aging find a victim unless every way is filling.
        for _ in 0..(WAYS * (REF_MAX as u32 + 1)) {
            let w = w0 + *hand as usize;
            *hand = ((*hand as u32 + 1) % WAYS) as u8;
            let st = (self.hi[w] >> 8) as u8;
            if st & VALID == 0 {
                continue;
            }
            let r = (st & REF_MASK) >> REF_SHIFT;
            if r == 0 {
                return Some((w, Some(self.page_of(w))));
            }
            self.hi[w] =
                (self.hi[w] & 0xff) | (((st & !REF_MASK) | ((r - 1) << REF_SHIFT)) as u16) << 8;
        }
        None
    }

    /// True if one of `page`'s sets has a way to give without evicting a valid page: an
    /// empty way, or (its slot not `pinned`) a draining one.
    pub fn has_room(&self, page: u64, pinned: impl Fn(SlotNo) -> bool) -> bool {
        if self.hands.is_empty() || page > MAX_PAGE {
            return false;
        }
        let (a, b) = self.choices(page);
        [Some(a), b].into_iter().flatten().any(|set| {
            let ways = Self::ways(set);
            ways.clone().any(|w| self.state(w) == 0)
                || (!pinned(self.at(ways.start).slot)
                    && ways.into_iter().any(|w| self.state(w) & DRAIN != 0))
        })
    }

    /// Starts a fill of `page` into way `w` (from [`Self::victim`]): the way's old page, if
    /// valid, is dropped. The caller guarantees that `page` is not in the area.
    pub fn start_fill(&mut self, w: usize, page: u64) {
        debug_assert!(self.find(page).is_none());
        if self.state(w) & VALID != 0 {
            self.valid -= 1;
        }
        self.put(w, page, OCC | FILLING);
    }

    /// Completes the fill of `page` in way `w`: valid if `ok` and not spoiled (true then);
    /// otherwise the way is empty again.
    pub fn complete_fill(&mut self, w: usize, page: u64, ok: bool) -> bool {
        let st = self.state(w);
        debug_assert!(st & FILLING != 0 && self.page_of(w) == page);
        if st & FILLING == 0 || self.page_of(w) != page {
            return false;
        }
        if ok && st & SPOILED == 0 {
            self.set_state(w, OCC | VALID);
            self.valid += 1;
            true
        } else {
            self.set_state(w, 0);
            false
        }
    }

    /// Drops way `w`: a valid page becomes draining if its slot is `pinned`, else empty; a
    /// fill in flight is spoiled.
    fn drop_way(&mut self, w: usize, pinned: bool) -> Dropped {
        let st = self.state(w);
        if st & FILLING != 0 {
            self.set_state(w, st | SPOILED);
            Dropped::Filling
        } else if st & VALID != 0 {
            self.valid -= 1;
            self.set_state(w, if pinned { DRAIN } else { 0 });
            Dropped::Valid
        } else {
            Dropped::Absent
        }
    }

    /// Drops `page` (a write, an eviction of its line, a bad checksum).
    pub fn drop_page(&mut self, page: u64, pinned: impl Fn(SlotNo) -> bool) -> Dropped {
        match self.find(page) {
            Some(w) => {
                let p = pinned(self.at(w).slot);
                self.drop_way(w, p)
            }
            None => Dropped::Absent,
        }
    }

    /// A write replaces `page`: a valid copy in a slot no read holds (`pinned` false) turns
    /// into a fill in flight in the same way, which the write's cache copy completes
    /// ([`Self::complete_fill`]); returns that way. Otherwise the page is dropped as by
    /// [`Self::drop_page`] (a fill in flight spoiled) and None is returned.
    pub fn rewrite(&mut self, page: u64, pinned: impl Fn(SlotNo) -> bool) -> Option<usize> {
        let w = self.find(page)?;
        let p = pinned(self.at(w).slot);
        if self.state(w) & VALID != 0 && !p {
            self.valid -= 1;
            self.set_state(w, OCC | FILLING);
            return Some(w);
        }
        self.drop_way(w, p);
        None
    }

    /// Drops every page (the source changed); returns the valid pages dropped.
    pub fn drop_all(&mut self, pinned: impl Fn(SlotNo) -> bool) -> u64 {
        let before = self.valid;
        for w in 0..self.lo.len() {
            let p = pinned(self.at(w).slot);
            self.drop_way(w, p);
        }
        before - self.valid
    }

    /// Drops every page of packed slot number `i` (`pinned`: whether it has a pin); returns
    /// the valid pages dropped.
    pub fn drop_all_in(&mut self, i: usize, pinned: impl Fn(SlotNo) -> bool) -> u64 {
        let before = self.valid;
        let p = pinned(self.slots[i]);
        let ways = (self.per_slot * WAYS) as usize;
        for w in i * ways..(i + 1) * ways {
            self.drop_way(w, p);
        }
        before - self.valid
    }

    /// Adds packed slot `s` (its sets empty). No page moves: each stays in the set it was
    /// filled in, which is on its new primary's chain of parents.
    pub fn grow(&mut self, s: SlotNo) {
        self.slots.push(s);
        let ways = (self.per_slot * WAYS) as usize;
        self.lo.resize(self.lo.len() + ways, 0);
        self.hi.resize(self.hi.len() + ways, 0);
        self.hands
            .resize(self.hands.len() + self.per_slot as usize, 0);
        let n = self.sets();
        if n == self.per_slot as u64 {
            self.level = n.trailing_zeros();
        } else if n == 2u64 << self.level {
            self.level += 1;
        }
    }

    /// True if the last packed slot can be given back now: no fill in flight in its sets and
    /// (`pinned`) no pin.
    pub fn can_shrink(&self, pinned: impl Fn(SlotNo) -> bool) -> bool {
        let Some(&last) = self.slots.last() else {
            return false;
        };
        let ways = (self.per_slot * WAYS) as usize;
        let w0 = self.lo.len() - ways;
        !pinned(last) && (w0..self.lo.len()).all(|w| self.state(w) & FILLING == 0)
    }

    /// Gives back the last packed slot (check [`Self::can_shrink`] first), dropping its
    /// pages; returns it and the valid pages dropped.
    pub fn shrink(&mut self) -> Option<(SlotNo, u64)> {
        let s = self.slots.pop()?;
        let ways = (self.per_slot * WAYS) as usize;
        let w0 = self.lo.len() - ways;
        let dropped = (w0..self.lo.len())
            .filter(|&w| self.state(w) & VALID != 0)
            .count() as u64;
        self.valid -= dropped;
        self.lo.truncate(w0);
        self.hi.truncate(w0);
        let n = self.hands.len() - self.per_slot as usize;
        self.hands.truncate(n);
        if n == 0 {
            self.level = 0;
        } else if (n as u64) < 1u64 << self.level {
            self.level -= 1;
        }
        Some((s, dropped))
    }

    /// The index of packed slot `s`, if it is one.
    pub fn index_of(&self, s: SlotNo) -> Option<usize> {
        self.slots.iter().position(|&x| x == s)
    }

    /// True if packed slot number `i` has a fill in flight.
    pub fn slot_filling(&self, i: usize) -> bool {
        let ways = (self.per_slot * WAYS) as usize;
        (i * ways..(i + 1) * ways).any(|w| self.state(w) & FILLING != 0)
    }

    /// Moves packed slot number `i`'s sets to slot `to` (which holds nothing), dropping their
    /// pages: the caller guarantees no fill is in flight in them and the old slot has no pin.
    /// Returns the valid pages dropped.
    pub fn replace(&mut self, i: usize, to: SlotNo) -> u64 {
        let ways = (self.per_slot * WAYS) as usize;
        let mut dropped = 0;
        for w in i * ways..(i + 1) * ways {
            debug_assert!(self.state(w) & FILLING == 0);
            dropped += (self.state(w) & VALID != 0) as u64;
            self.hi[w] = 0;
        }
        self.valid -= dropped;
        self.slots[i] = to;
        dropped
    }
}

#[cfg(test)]
#[path = "pagearea_tests.rs"]
mod tests;
