//! The page checksums of a persistent cache: on the device in the slot records, and in
//! memory only for the units in use, a bounded cache of units' checksums (a unit is the
//! records of `slots_per_unit` slots, 3 slots of 1 MiB in 4 KiB).
//!
//! * A unit is *resident* or not. A resident unit knows some or all of its pages'
//!   checksums: a cache write records its pages' checksums without reading the unit
//!   (`set`), so a write never waits for metadata; the pages it does not know are taken
//!   from the device when asked for (`pin`), which merges the records' checksums under them.
//! * A read takes its expected checksums under its shard's lock, where no I/O is done: a
//!   unit that is not resident is named (`get` is None), the read lets the lock go, pins the
//!   unit (reads it from the device) and plans again. A pinned unit is never evicted.
//! * A unit whose checksums changed since its records were last written is *dirty*: it is
//!   written by the next flush round (`take_dirty`) and is not evicted until a round made
//!   every change durable (`written`), so a checksum the records do not hold is never
//!   dropped.
//! * Eviction is CLOCK over the resident units, when more than the capacity are resident;
//!   dirty and pinned units are passed over (the capacity is a target, not a wall).
//!
//! Locks: `Entry::unit` (a reader-writer lock per unit) is a leaf, taken under a core shard
//! by reads; `ring` and `dirty` are leaves, never taken while holding a unit's lock for
//! writing, and no I/O is done while holding any of them.

use crate::order::{levels, OrderedMutex, OrderedRwLock};
/// The ring and the dirty list are leaves of the lock order (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_io::{BlockDevice, IoError};
use sce_store::{read_unit_crcs, Layout, UnitCrcs};
use std::collections::VecDeque;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64,
    Ordering::{Acquire, Relaxed, Release, SeqCst},
};
use std::sync::Arc;

/// The checksums of one resident unit.
struct Resident {
    /// Per page of the unit's slots (slot-major).
    crcs: Box<[AtomicU32]>,
    /// Which of them are known (set by a write, or read from the records).
    known: Box<[AtomicU64]>,
    /// Every page is known.
    complete: AtomicBool,
    /// Changes made (each `set` counts one).
    changed: AtomicU64,
    /// Changes the device's records hold (`changed` as a round took it, once durable).
    written: AtomicU64,
    /// Queued in `dirty` for the next round.
    queued: AtomicBool,
    /// Asked for since the clock hand last passed.
    referenced: AtomicBool,
    /// Which life of the unit in memory this is: a round's `written` applies only to the
    /// life whose changes it took (after an eviction the counts start again).
    life: u64,
}

/// Lives of units in memory, numbered.
static LIVES: AtomicU64 = AtomicU64::new(1);

impl Resident {
    fn new(n: usize) -> Box<Resident> {
        Box::new(Resident {
            crcs: (0..n).map(|_| AtomicU32::new(0)).collect(),
            known: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            complete: AtomicBool::new(false),
            changed: AtomicU64::new(0),
            written: AtomicU64::new(0),
            queued: AtomicBool::new(false),
            referenced: AtomicBool::new(true),
            life: LIVES.fetch_add(1, Relaxed),
        })
    }

    fn known(&self, i: usize) -> bool {
        self.known[i / 64].load(Acquire) >> (i % 64) & 1 == 1
    }

    /// Knows every page: those not set by a write since take the records' `crcs`.
    fn complete_with(&self, crcs: &[u32]) {
        if self.complete.load(Acquire) {
            return;
        }
        for (i, &c) in crcs.iter().enumerate() {
            if !self.known(i) {
                self.crcs[i].store(c, Relaxed);
            }
        }
        for w in self.known.iter() {
            w.store(u64::MAX, Release);
        }
        self.complete.store(true, Release);
    }

    /// Marks the unit as asked for (the clock's second chance).
    fn touch(&self) {
        if !self.referenced.load(Relaxed) {
            self.referenced.store(true, Relaxed);
        }
    }

    fn clean(&self) -> bool {
        self.written.load(Acquire) >= self.changed.load(Acquire)
    }
}

/// One unit's place in the cache.
#[derive(Default)]
struct Entry {
    unit: OrderedRwLock<levels::CrcUnit, Option<Box<Resident>>>,
    /// Pins held: a pinned unit is not evicted.
    pins: AtomicU32,
    /// The low 32 bits of the sequence of the image the device holds for the unit (loaded,
    /// or written by a round; 0: unknown): a primary copy with it is read alone.
    seq: AtomicU32,
}

/// Counters of the checksum cache.
#[derive(Default)]
pub(crate) struct CrcCounters {
    /// Units read from the device.
    pub(crate) loads: AtomicU64,
    /// Units evicted.
    pub(crate) evictions: AtomicU64,
    /// Units read whose both copies were damaged (their pages' checksums are unknown: they
    /// fail verification and are treated as damaged data).
    pub(crate) damaged: AtomicU64,
}

/// The page checksums of a persistent cache (see the module's notes).
pub(crate) struct CrcCache {
    dev: Arc<dyn BlockDevice>,
    layout: Layout,
    uuid: [u8; 16],
    entries: Box<[Entry]>,
    /// Resident units in clock order.
    ring: Mutex<VecDeque<u32>>,
    /// Units whose checksums changed since a round last took them.
    dirty: Mutex<Vec<u32>>,
    capacity: usize,
    pub(crate) counters: CrcCounters,
}

/// A unit's changes in memory as a round took them: its life there and their count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Changes(u64, u64);

/// A unit held resident (and not evicted) while this lives.
pub(crate) struct UnitPin<'a> {
    cache: &'a CrcCache,
    unit: u32,
}

impl Drop for UnitPin<'_> {
    fn drop(&mut self) {
        self.cache.entries[self.unit as usize]
            .pins
            .fetch_sub(1, Release);
    }
}

impl UnitPin<'_> {
    /// The unit pinned.
    pub(crate) fn unit(&self) -> u32 {
        self.unit
    }
}

/// The units a cache of `units` metadata units keeps resident by default: one in 32 (about
/// 32 bytes per cached MiB at 1 MiB slots, against 1 KiB for every page's checksum), and at
/// least 8,192 (25 MiB, every unit of a cache up to 24 GiB at 1 MiB slots: a cache that
/// small keeps all its checksums in memory, and its hits never wait for a unit's records).
pub(crate) fn default_capacity(units: u32) -> usize {
    (units as usize / 32).max(MIN_RESIDENT)
}

/// The fewest units a cache keeps resident by default.
const MIN_RESIDENT: usize = 8192;

impl CrcCache {
    /// The checksum cache of the device `dev` (laid out as `layout`, of uuid `uuid`),
    /// keeping about `capacity` units resident.
    pub(crate) fn new(
        dev: Arc<dyn BlockDevice>,
        layout: Layout,
        uuid: [u8; 16],
        capacity: usize,
    ) -> CrcCache {
        CrcCache {
            dev,
            layout,
            uuid,
            entries: (0..layout.units).map(|_| Entry::default()).collect(),
            ring: OrderedMutex::new(VecDeque::new()),
            dirty: OrderedMutex::new(Vec::new()),
            capacity: capacity.max(1),
            counters: CrcCounters::default(),
        }
    }

    fn pages_per_unit(&self) -> usize {
        (self.layout.slots_per_unit * self.layout.pages_per_fragment) as usize
    }

    /// The unit of slot `s` and the index of its page `p` within the unit.
    fn index(&self, s: u32, p: u32) -> (u32, usize) {
        let (u, i) = self.layout.unit_of(s);
        (u, (i * self.layout.pages_per_fragment + p) as usize)
    }

    /// The unit that holds slot `s`'s record.
    pub(crate) fn unit_of(&self, s: u32) -> u32 {
        self.layout.unit_of(s).0
    }

    /// The checksum of page `p` of slot `s`, if its unit is resident and knows it. No I/O,
    /// no lock but the unit's (shared): safe under a core shard's lock.
    #[inline]
    pub(crate) fn get(&self, s: u32, p: u32) -> Option<u32> {
        let (u, i) = self.index(s, p);
        let g = self.entries[u as usize].unit.read();
        let r = g.as_ref()?;
        if !r.known(i) {
            return None;
        }
        r.touch();
        Some(r.crcs[i].load(Relaxed))
    }

    /// Appends the checksums of pages `pages` of slot `s` to `want`, under one look at their
    /// unit; a page not known in memory takes `unknown`, or with None names its unit (Err).
    /// No I/O, as `get`.
    pub(crate) fn get_pages(
        &self,
        s: u32,
        pages: std::ops::Range<u32>,
        want: &mut Vec<u32>,
        unknown: Option<u32>,
    ) -> Result<(), u32> {
        let (u, i0) = self.index(s, pages.start);
        let g = self.entries[u as usize].unit.read();
        for i in i0..i0 + pages.len() {
            match g.as_ref().filter(|r| r.known(i)) {
                Some(r) => {
                    r.touch();
                    want.push(r.crcs[i].load(Relaxed));
                }
                None => want.push(unknown.ok_or(u)?),
            }
        }
        Ok(())
    }

    /// The checksum of page `p` of slot `s`, reading its unit from the device if needed
    /// (I/O: for paths that may wait).
    pub(crate) fn get_or_load(&self, s: u32, p: u32) -> Result<u32, IoError> {
        if let Some(c) = self.get(s, p) {
            return Ok(c);
        }
        let _pin = self.pin(self.unit_of(s))?;
        Ok(self.get(s, p).expect("a pinned unit is complete"))
    }

    /// Records the checksum of page `p` of slot `s` (a cache write's, before the core marks
    /// the page valid). No I/O: a unit that is not resident becomes resident knowing only
    /// this page.
    pub(crate) fn set(&self, s: u32, p: u32, crc: u32) {
        let (u, i) = self.index(s, p);
        let e = &self.entries[u as usize];
        let mut inserted = false;
        loop {
            {
                let g = e.unit.read();
                if let Some(r) = g.as_ref() {
                    r.crcs[i].store(crc, Relaxed);
                    r.known[i / 64].fetch_or(1 << (i % 64), Release);
                    self.changed(u, r);
                    break;
                }
            }
            let mut g = e.unit.write();
            if g.is_none() {
                *g = Some(Resident::new(self.pages_per_unit()));
                inserted = true;
            }
        }
        if inserted {
            self.admitted(u);
        }
    }

    /// Unit `u`, resident as `r`, changed: the next round writes it.
    fn changed(&self, u: u32, r: &Resident) {
        r.changed.fetch_add(1, SeqCst);
        if !r.queued.swap(true, SeqCst) {
            self.dirty.lock().push(u);
        }
    }

    /// Unit `u` just became resident: the clock takes it, and may evict another.
    fn admitted(&self, u: u32) {
        self.ring.lock().push_back(u);
        self.evict_over_capacity();
    }

    /// Makes unit `u` resident with every page known (those not set by a write since take
    /// `crcs`), and with `change` changed too. No I/O. True if it was not resident.
    fn complete_with(&self, u: u32, crcs: &[u32], change: bool) -> bool {
        let inserted = {
            let mut g = self.entries[u as usize].unit.write();
            let inserted = g.is_none();
            let r = g.get_or_insert_with(|| Resident::new(crcs.len()));
            r.complete_with(crcs);
            if change {
                self.changed(u, r);
            }
            inserted
        };
        if inserted {
            self.admitted(u);
        }
        inserted
    }

    /// Pins unit `u` with every page's checksum known: reads the device's records for the
    /// pages no write has set since (I/O, with no lock held). A unit whose records cannot be
    /// read is an error (nothing is assumed of it); one whose both copies are damaged knows
    /// its unset pages as checksum 0, which no data matches but by chance: they fail
    /// verification as damaged data does.
    pub(crate) fn pin(&self, u: u32) -> Result<UnitPin<'_>, IoError> {
        let e = &self.entries[u as usize];
        e.pins.fetch_add(1, SeqCst);
        let pin = UnitPin {
            cache: self,
            unit: u,
        };
        let complete =
            |g: &Option<Box<Resident>>| g.as_ref().is_some_and(|r| r.complete.load(Acquire));
        if complete(&e.unit.read()) {
            return Ok(pin);
        }
        self.counters.loads.fetch_add(1, Relaxed);
        let seq = e.seq.load(Acquire);
        let recorded = read_unit_crcs(self.dev.as_ref(), &self.layout, &self.uuid, u, seq)?;
        let n = self.pages_per_unit();
        let crcs = match recorded {
            UnitCrcs::Found(c) => c,
            UnitCrcs::Blank => vec![0; n],
            UnitCrcs::Damaged => {
                self.counters.damaged.fetch_add(1, Relaxed);
                vec![0; n]
            }
        };
        // Pages set by writes since are newer than the records: only the rest.
        self.complete_with(u, &crcs, false);
        Ok(pin)
    }

    /// Takes the units whose checksums changed since the last call (for a flush round: it
    /// writes their records).
    pub(crate) fn take_dirty(&self) -> Vec<u32> {
        let units = std::mem::take(&mut *self.dirty.lock());
        for &u in &units {
            if let Some(r) = self.entries[u as usize].unit.read().as_ref() {
                r.queued.swap(false, SeqCst);
            }
        }
        units
    }

    /// The changes unit `u` (pinned) has had in this life in memory: taken by a round
    /// before it reads the unit's checksums, and handed to `written` once its records are
    /// durable.
    pub(crate) fn changes(&self, pin: &UnitPin) -> Changes {
        let g = self.entries[pin.unit as usize].unit.read();
        g.as_ref()
            .map_or(Changes(0, 0), |r| Changes(r.life, r.changed.load(SeqCst)))
    }

    /// The checksum of page `p` of slot `s`, whose unit is pinned (so every page is known).
    pub(crate) fn pinned(&self, s: u32, p: u32) -> u32 {
        self.get(s, p).expect("a pinned unit knows every page")
    }

    /// Unit `u`'s image of sequence `seq` is durable on the device (both copies).
    pub(crate) fn image_written(&self, u: u32, seq: u64) {
        self.entries[u as usize].seq.store(seq as u32, Release);
    }

    /// The sequences of the images loaded at start, per unit (`Loaded::unit_seqs`).
    pub(crate) fn loaded_seqs(&self, seqs: &[u32]) {
        for (e, &s) in self.entries.iter().zip(seqs) {
            e.seq.store(s, Relaxed);
        }
    }

    /// Unit `u`'s records on the device hold the `changes` a round took. A unit evicted
    /// since (clean then) and set again is another life: what the round took says nothing
    /// of its changes.
    pub(crate) fn written(&self, u: u32, Changes(life, n): Changes) {
        if let Some(r) = self.entries[u as usize].unit.read().as_ref() {
            if r.life == life {
                r.written.fetch_max(n, Release);
            }
        }
    }

    /// Evicts clean, unpinned units not asked for since the hand last passed, while more
    /// than the capacity are resident: a step of at most 64 units per unit made resident
    /// (many units pinned or dirty at once must not make every insertion scan them all;
    /// `trim` catches up after a round).
    fn evict_over_capacity(&self) {
        self.evict_down_to(self.capacity, Some(64));
    }

    /// Units a flush round pins at once: half the capacity, at least 64.
    pub(crate) fn round_part(&self) -> usize {
        (self.capacity / 2).max(64)
    }

    /// A round could not write unit `u`'s image, whose checksums are `image`: the unit
    /// stays in memory, dirty, with them (where no write has set a newer one since), until
    /// a round writes it (its copies on the device may both be bad now).
    pub(crate) fn unwritten(&self, u: u32, image: &[u32]) {
        self.complete_with(u, image, true);
    }

    /// Evicts down to the capacity (after a round made units clean: a burst of writes may
    /// have left more resident than the capacity, all dirty until then).
    pub(crate) fn trim(&self) {
        if self.resident() > self.capacity {
            self.evict_down_to(self.capacity, None);
        }
    }

    /// Evicts every clean unit no one pins (tests: the next use reads the records).
    pub(crate) fn evict_clean(&self) {
        self.evict_down_to(0, None);
    }

    /// Evicts while more than `target` units are resident, visiting at most `step` units
    /// (None: twice the resident count, a whole pass of the clock and a second chance).
    fn evict_down_to(&self, target: usize, step: Option<usize>) {
        let mut ring = self.ring.lock();
        let mut budget = step.unwrap_or(2 * ring.len());
        while ring.len() > target && budget > 0 {
            budget -= 1;
            let Some(u) = ring.pop_front() else { break };
            let e = &self.entries[u as usize];
            let evicted = e.pins.load(SeqCst) == 0
                && e.unit.try_write().is_some_and(|mut g| {
                    let keep = match g.as_ref() {
                        None => false,
                        Some(r) => {
                            e.pins.load(SeqCst) > 0
                                || !r.clean()
                                || r.referenced.swap(false, Relaxed)
                        }
                    };
                    if !keep {
                        *g = None;
                    }
                    !keep
                });
            if evicted {
                self.counters.evictions.fetch_add(1, Relaxed);
            } else {
                ring.push_back(u);
            }
        }
    }

    /// Makes the cache hold as many units as its capacity, each with every page known and
    /// nothing to write (for `sce footprint`: what the checksums take once the cache is in
    /// use). Returns the units made resident.
    pub(crate) fn fill_for_footprint(&self) -> usize {
        let none = vec![0; self.pages_per_unit()];
        let units = (self.entries.len().min(self.capacity)) as u32;
        (0..units)
            .filter(|&u| self.complete_with(u, &none, false))
            .count()
    }

    /// Units resident now.
    pub(crate) fn resident(&self) -> usize {
        self.ring.lock().len()
    }

    /// Bytes the cache takes: its table and its resident units.
    pub(crate) fn bytes(&self) -> usize {
        let n = self.pages_per_unit();
        let unit = std::mem::size_of::<Resident>() + n * 4 + n.div_ceil(64) * 8;
        self.entries.len() * std::mem::size_of::<Entry>() + self.resident() * (unit + 4)
    }
}
